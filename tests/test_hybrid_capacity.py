"""Hybrid attention in the capacity model and the simulator (issue 29, section 4):
KV-cache groups, a request's reservation, the pool's sequences in the hybrid and
the uniform layout, config.json models, and the step cost of sliding windows,
each against figures worked out by hand here."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

import kvsched
from kvsched.capacity import MODELS, CapacityError, ModelShape, capacity
from kvsched.shapes import (
    KVGroupLayout,
    group_layers,
    parse_kind,
    reserved_pages,
    reserved_pages_per_group,
)
from kvsched.sim.simulator import Arrival, StepCost, simulate

W512 = "sliding_window:512"
W1024 = "sliding_window:1024"
W128 = "sliding_window:128"

# -- attention kinds -------------------------------------------------------------------


def test_kind_strings_parse_and_bad_ones_say_what_is_wrong():
    assert parse_kind("full") == ("full", None)
    assert parse_kind("sliding_window:512") == ("sliding_window", 512)
    assert parse_kind("chunked_local:8192") == ("chunked_local", 8192)
    for bad in ["", "full:3", "sliding_window", "sliding_window:", "sliding_window:0",
                "sliding_window:-4", "sliding_window:+4", "sliding_window: 4",
                "sliding_window:1.5", "sliding_window:\u0663", "window:4", "Full"]:  # fmt: skip
        with pytest.raises(ValueError, match="attention kind"):
            parse_kind(bad)
    with pytest.raises(ValueError, match="a string"):
        parse_kind(512)  # type: ignore[arg-type]


# -- layers to groups (the contract's rule) --------------------------------------------


def test_gemma_3_270m_layers_form_one_full_and_five_window_groups_of_three():
    kinds = MODELS["gemma-3-270m"].layer_types
    # Layer i is global iff (i + 1) % 6 == 0: layers 5, 11, 17.
    assert [i for i, k in enumerate(kinds) if k == "full"] == [5, 11, 17]
    layout = group_layers(kinds)
    assert layout.groups == ("full",) + (W512,) * 5
    assert layout.layers_per_group == 3  # the fewest of one kind: the 3 full layers
    # Sliding layers in order (0 1 2 | 3 4 6 | 7 8 9 | 10 12 13 | 14 15 16) fill
    # groups 1..5; the full ones group 0.
    assert layout.layer_group == (1, 1, 1, 2, 2, 0, 2, 3, 3, 3, 4, 0, 4, 4, 5, 5, 5, 0)
    assert layout.layer_slot == (0, 1, 2, 0, 1, 0, 2, 0, 1, 2, 0, 1, 1, 2, 0, 1, 2, 2)
    assert layout.layers_of(0) == (5, 11, 17)
    assert layout.layers_of(2) == (3, 4, 6)


def test_gemma_3_27b_last_window_group_is_padded_and_gpt_oss_has_two_groups():
    layout = MODELS["gemma-3-27b"].kv_layout()
    # 10 full layers (5, 11, ..., 59) and 52 sliding: Lg = 10, 1 + ceil(52 / 10) = 7
    # groups; the last holds sliding layers 60 and 61 in 2 of its 10 slots.
    assert (layout.layers_per_group, layout.groups) == (10, ("full",) + (W1024,) * 6)
    assert layout.layers_of(0) == tuple(range(5, 62, 6))
    assert layout.layers_of(6) == (60, 61)
    assert (layout.layer_slot[60], layout.layer_slot[61]) == (0, 1)

    oss = MODELS["gpt-oss-20b"].kv_layout()  # even layers slide, odd are full: 12 each
    assert (oss.layers_per_group, oss.groups) == (12, ("full", W128))
    assert (oss.layer_group[0], oss.layer_slot[0]) == (1, 0)
    assert (oss.layer_group[1], oss.layer_slot[1]) == (0, 0)
    assert (oss.layer_group[22], oss.layer_slot[22]) == (1, 11)
    assert (oss.layer_group[23], oss.layer_slot[23]) == (0, 11)
    assert MODELS["gpt-oss-120b"].kv_layout().layers_per_group == 18


def test_full_groups_come_first_then_kinds_in_order_of_first_appearance():
    kinds = ["sliding_window:4", "full", "chunked_local:8", "full", "sliding_window:04",
             "chunked_local:8"]  # fmt: skip
    layout = group_layers(kinds)
    assert layout == KVGroupLayout(
        groups=("full", "sliding_window:4", "chunked_local:8"),
        layers_per_group=2,
        layer_group=(1, 0, 2, 0, 1, 2),
        layer_slot=(0, 0, 0, 1, 1, 1),
    )
    # One layer of a kind makes pages of one layer: three full groups here.
    assert group_layers(["full"] * 3 + ["sliding_window:4"]).groups == ("full",) * 3 + (
        "sliding_window:4",
    )
    assert group_layers(["full"] * 4) == KVGroupLayout(("full",), 4, (0,) * 4, (0, 1, 2, 3))


def test_a_model_without_full_attention_has_only_the_uniform_layout():
    with pytest.raises(ValueError, match="no full-attention layer"):
        group_layers([W512] * 4)
    assert group_layers([W512] * 4, uniform=True) == KVGroupLayout(
        ("full",), 4, (0, 0, 0, 0), (0, 1, 2, 3)
    )
    uniform = group_layers(MODELS["gemma-3-270m"].layer_types, uniform=True)
    assert (uniform.groups, uniform.layers_per_group) == (("full",), 18)
    assert uniform.layer_slot == tuple(range(18))
    with pytest.raises(ValueError, match="at least one layer"):
        group_layers([])
    with pytest.raises(ValueError, match="attention kind"):
        group_layers(["full", "sliding:4"])


# -- a request's reservation -----------------------------------------------------------


def test_reserved_pages_follow_the_contracts_formula():
    groups = ("full",) + (W512,) * 5  # Gemma 3 270M
    # 8k, pages of 16, chunk 512: the full group ceil(8192 / 16) = 512; a window
    # group min(512, ceil((512 + 512 - 2) / 16) + 1) = min(512, 64 + 1) = 65.
    assert reserved_pages_per_group(groups, 8000, 192, 16, 512) == (512, 65, 65, 65, 65, 65)
    assert reserved_pages(groups, 8000, 192, 16, 512) == 512 + 5 * 65 == 837
    assert reserved_pages(groups, 8192, 0, 16, 512) == 837  # prompt + max_tokens, however split
    # Shorter than the window: every group holds every page, ceil(100 / 16) = 7.
    assert reserved_pages(groups, 90, 10, 16, 512) == 6 * 7
    # A single full group: ceil(n / B) as always.
    assert reserved_pages(("full",), 8192, 1, 16, 512) == 513
    # Gemma 3 27B at 32k with a 2,048-token chunk: 2,048 + 6 x (ceil(3,070 / 16) + 1 = 193).
    assert reserved_pages(("full",) + (W1024,) * 6, 32768, 0, 16, 2048) == 2048 + 6 * 193
    # Chunked local of 8,192 at 32k, chunk 512: ceil((8,192 + 510) / 16) + 1 = 544 + 1.
    assert reserved_pages(("full", "chunked_local:8192"), 32768, 0, 16, 512) == 2048 + 545
    # A decode (chunk 1) of a window as long as a page can straddle two pages.
    assert reserved_pages(("sliding_window:16",), 4096, 0, 16, 1) == 2
    for bad in ((-1, 0, 16, 512), (1, -1, 16, 512), (1, 0, 0, 512), (1, 0, 16, 0)):
        with pytest.raises(ValueError):
            reserved_pages(groups, *bad)


# -- the pool in both layouts ----------------------------------------------------------


def test_gemma_3_270m_on_one_h100_hybrid_against_uniform():
    # Weights 268e6 x 2 bytes; usable 80e9 x 0.9 - 0.536e9 = 71.464e9 bytes. One
    # token of one layer: K and V of 1 head of 256 in bf16 = 1,024 bytes.
    usable = 71_464_000_000
    hybrid_page = 3 * 16 * 1024  # 3 layers a page: 49,152 bytes
    uniform_page = 18 * 16 * 1024  # 294,912
    assert usable // hybrid_page == 1_453_938 and usable // uniform_page == 242_323
    for context, hybrid_pages, hybrid_seqs, uniform_seqs in (
        (8192, 512 + 5 * 65, 1_453_938 // 837, 242_323 // 512),  # 1,737 against 473
        (32768, 2048 + 5 * 65, 1_453_938 // 2373, 242_323 // 2048),  # 612 against 118
        (2048, 128 + 5 * 65, 1_453_938 // 453, 242_323 // 128),  # 3,209 against 1,893
    ):
        c = capacity("gemma-3-270m", "h100", context=context)
        assert c.usable_kv_bytes == pytest.approx(usable)
        assert c.hybrid is not None and c.uniform is not None
        assert (c.hybrid.layers_per_page, c.hybrid.page_bytes) == (3, hybrid_page)
        assert (c.uniform.layers_per_page, c.uniform.page_bytes) == (18, uniform_page)
        assert (c.hybrid.blocks, c.uniform.blocks) == (1_453_938, 242_323)
        assert c.hybrid.pages_per_seq == hybrid_pages
        assert c.uniform.pages_per_seq == context // 16
        assert (c.hybrid_seqs, c.full_context_seqs) == (hybrid_seqs, uniform_seqs)
        assert c.uniform.seqs == uniform_seqs and c.kv_blocks == 242_323
    # KV a request holds, in layer-pages: 8k 512 x 18 against 837 x 3 (3.7x), 32k
    # 2,048 x 18 against 2,373 x 3 (5.2x): the "~4x at 8k, ~5x at 32k".
    assert (512 * 18) / (837 * 3) == pytest.approx(3.67, abs=0.01)
    assert (2048 * 18) / (2373 * 3) == pytest.approx(5.18, abs=0.01)


@pytest.mark.parametrize(
    ("accelerator", "devices", "context", "hybrid", "uniform"),
    [
        # Weights 27.4e9 x 2 = 54.8e9. One H100: 72e9 - 54.8e9 = 17.2e9 bytes of KV;
        # 8 x v5e: 8 x 16e9 x 0.9 - 54.8e9 = 60.4e9. A token of one layer: 2 x 16
        # heads x 128 x 2 bytes = 8,192; a page of 10 layers 1,310,720 bytes, of
        # 62 layers 8,126,464: H100 13,122 and 2,116 pages, v5e 46,081 and 7,432.
        # 32k: 2,048 + 6 x 97 = 2,630 pages a request (97 = ceil(1,534 / 16) + 1)
        # against 2,048; 128k: 8,192 + 582 = 8,774 against 8,192.
        ("h100", 1, 32768, 13_122 // 2630, 2_116 // 2048),  # 4 against 1
        ("h100", 1, 131072, 13_122 // 8774, 0),  # 1 against 0
        ("tpu-v5e", 8, 32768, 46_081 // 2630, 7_432 // 2048),  # 17 against 3
        ("tpu-v5e", 8, 131072, 46_081 // 8774, 0),  # 5 against 0
    ],
)
def test_gemma_3_27b_sequences_that_fit(accelerator, devices, context, hybrid, uniform):
    c = capacity("gemma-3-27b", accelerator, devices=devices, context=context)
    assert c.hybrid is not None and c.uniform is not None
    assert c.hybrid.group_pages == (context // 16,) + (97,) * 6
    assert (c.hybrid.seqs, c.uniform.seqs) == (hybrid, uniform)
    if uniform == 0:
        # Pages of every layer hold none: no SchedulerConfig for them.
        with pytest.raises(CapacityError, match="hold no sequence of 131,072"):
            c.scheduler_config()


def test_gemma_2_and_single_group_models_in_both_layouts():
    # Gemma-2-9B on one H100 at 8k: 21 full and 21 sliding layers, Lg = 21; a page
    # of 21 layers is 21 x 16 x 8,192 = 2,752,512 bytes: 53.52e9 // that = 19,444
    # pages; a request 512 + (ceil((4,096 + 510) / 16) + 1 = 289) = 801 pages.
    c = capacity("gemma-2-9b", "h100", context=8192)
    assert c.hybrid is not None
    assert (c.hybrid.blocks, c.hybrid.pages_per_seq) == (19_444, 801)
    assert (c.hybrid_seqs, c.max_concurrent_seqs, c.full_context_seqs) == (19_444 // 801, 25, 18)
    # All layers full: both layouts are the one of today.
    llama = capacity("llama-3-8b", "h100", context=8192)
    assert llama.hybrid is llama.uniform
    assert llama.uniform is not None
    u = llama.uniform
    assert (u.blocks, u.pages_per_seq, u.seqs, llama.hybrid_seqs) == (26_674, 512, 52, 52)
    # The larger chunk a window group keeps room for costs pages: 97 -> 193.
    wide = capacity("gemma-3-27b", "h100", context=32768, chunk=2048)
    assert wide.hybrid is not None and wide.hybrid.pages_per_seq == 2048 + 6 * 193
    with pytest.raises(CapacityError, match="chunk"):
        capacity("gemma-3-27b", "h100", chunk=0)


def test_a_context_neither_layout_fits_is_refused_and_padding_can_cost():
    with pytest.raises(CapacityError, match="KV-cache groups.*not one sequence of 262,144"):
        capacity("gemma-3-27b", "h100", context=262_144)
    # Below the window the hybrid layout pays for the 8 padding slots of its 7th
    # group: 70 layer slots a token against 62 (13,122 // 7 x 4 = 29 sequences of 1k
    # against 2,116 // 64 = 33).
    c = capacity("gemma-3-27b", "h100", context=1024)
    assert (c.hybrid_seqs, c.full_context_seqs) == (13_122 // (7 * 64), 2_116 // 64) == (29, 33)


# -- ModelShape's layer kinds -------------------------------------------------------------


def test_layer_types_and_the_gemma_2_fields_describe_the_same_model():
    window = "sliding_window:4096"
    alternating = tuple(window if i % 2 == 0 else "full" for i in range(42))
    old = ModelShape("g", 42, 8, 256, 1.0, 1, 4096, 21)
    new = ModelShape("g", 42, 8, 256, 1.0, 1, layer_types=alternating)
    assert old.layer_types == new.layer_types == alternating
    assert (new.sliding_window, new.sliding_layers) == (4096, 21)
    assert old == new == MODELS["gemma-2-9b"].__class__(**dataclasses.asdict(old))
    assert ModelShape("l", 4, 1, 8, 1.0, 1).layer_types == ("full",) * 4
    assert not ModelShape("l", 4, 1, 8, 1.0, 1).is_hybrid and new.is_hybrid
    with pytest.raises(CapacityError, match="3 layer_types for 4 layers"):
        ModelShape("l", 4, 1, 8, 1.0, 1, layer_types=("full",) * 3)
    with pytest.raises(CapacityError, match="disagree"):
        ModelShape("g", 42, 8, 256, 1.0, 1, 1024, 21, layer_types=alternating)
    with pytest.raises(CapacityError, match="attention kind"):
        ModelShape("l", 2, 1, 8, 1.0, 1, layer_types=("full", "local"))
    # A StepCost file of a hybrid model reads back the same model.
    cost = StepCost.preset("gemma-3-27b", "h100")
    assert StepCost.from_json(json.loads(json.dumps(cost.to_json()))) == cost


# -- config.json ---------------------------------------------------------------------------

GEMMA_3_270M = {  # as transformers writes it (the fields read here)
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
    "hidden_size": 640, "intermediate_size": 2048, "num_attention_heads": 4,
    "num_hidden_layers": 18, "num_key_value_heads": 1, "sliding_window": 512,
    "vocab_size": 262144,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                    for i in range(18)],
}  # fmt: skip
GPT_OSS_20B = {
    "model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
    "num_local_experts": 32, "vocab_size": 201088, "tie_word_embeddings": False,
    "sliding_window": 128,
    "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
}  # fmt: skip


def test_a_config_json_gives_the_presets_shape(tmp_path, capsys):
    folder = tmp_path / "gemma-3-270m-it"
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps(GEMMA_3_270M))
    m = ModelShape.from_hf_config(path)
    preset = MODELS["gemma-3-270m"]
    assert m.name == "gemma-3-270m-it"
    assert m.layer_types == preset.layer_types
    assert (m.layers, m.kv_heads, m.head_dim, m.hidden, m.query_heads, m.ffn) == (
        18, 1, 256, 640, 4, 2048)  # fmt: skip
    # Parameters from the shapes: 262,144 x 640 tied embeddings, and per layer
    # 640 x 256 x (2 x 4 + 2 x 1) attention + 3 x 640 x 2,048 MLP.
    assert m.params == 262_144 * 640 + 18 * (640 * 256 * 10 + 3 * 640 * 2048) == 268_042_240
    # The older spelling (Gemma 3's sliding_window_pattern) reads the same.
    legacy = {k: v for k, v in GEMMA_3_270M.items() if k != "layer_types"}
    assert ModelShape.from_hf_config({**legacy, "sliding_window_pattern": 6}).layer_types == (
        preset.layer_types)  # fmt: skip
    # A path goes wherever a preset's name does.
    assert capacity(str(path), "h100").hybrid_seqs == capacity(preset, "h100").hybrid_seqs
    from kvsched.cli import main

    assert main(["capacity", "--model", str(path)]) == 0
    assert "gemma-3-270m-it (bf16) on 1 x h100" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["capacity", "--model", str(tmp_path / "missing.json")])


def test_experts_and_a_multimodal_config_are_read():
    oss = ModelShape.from_hf_config(GPT_OSS_20B, name="gpt-oss-20b")
    assert oss.layer_types == MODELS["gpt-oss-20b"].layer_types
    # Untied embeddings 2 x 201,088 x 2,880; a layer 2,880 x 64 x (128 + 16) of
    # attention, 32 experts of 3 x 2,880 x 2,880 and a 2,880 x 32 router.
    layer = 2880 * 64 * 144 + 32 * 3 * 2880 * 2880 + 2880 * 32
    assert oss.params == 2 * 201_088 * 2880 + 24 * layer
    assert oss.params == pytest.approx(20.91e9, rel=0.01)  # OpenAI's model card
    # Gemma 3 27B's multimodal config: the text model's keys in text_config, some
    # left to Gemma3TextConfig's defaults (vocab_size 262,208).
    mm = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
          "text_config": {"model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376,
                          "intermediate_size": 21504, "num_attention_heads": 32,
                          "num_hidden_layers": 62, "num_key_value_heads": 16,
                          "sliding_window": 1024}}  # fmt: skip
    big = ModelShape.from_hf_config(mm, name="gemma-3-27b-it")
    assert big.layer_types == MODELS["gemma-3-27b"].layer_types and big.vocab == 262_208


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"layer_types": ["linear_attention"] * 24}, "layer type 'linear_attention'"),
        ({"layer_types": ["full_attention"] * 23}, "layer_types must list the 24"),
        # (A gemma3_text config may leave it out: Gemma3TextConfig's default applies.)
        ({"num_hidden_layers": None}, "no num_hidden_layers"),
        ({"head_dim": 0}, "head_dim must be a whole number"),
        ({"kv_lora_rank": 512}, "multi-head latent attention"),
        ({"model_type": "qwen2", "layer_types": None}, "not which layers use it"),
        ({"layer_types": ["chunked_attention"] * 24}, "no attention_chunk_size"),
    ],
)
def test_a_config_json_kvsched_cannot_size_is_refused_by_name(change, why):
    cfg = {k: v for k, v in {**GPT_OSS_20B, **change}.items() if v is not None}
    with pytest.raises(CapacityError, match=why):
        ModelShape.from_hf_config(cfg)


def test_a_file_that_is_not_a_config_is_refused(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CapacityError, match="not JSON"):
        ModelShape.from_hf_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(CapacityError, match="holds an object"):
        capacity(str(tmp_path / "list.json"), "h100")
    with pytest.raises(CapacityError, match="unknown model 'llama-9'"):
        capacity("llama-9", "h100")


def test_windows_alone_run_in_the_uniform_layout(tmp_path, capsys):
    mistral = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
               "vocab_size": 32000, "sliding_window": 4096,
               "tie_word_embeddings": False}  # fmt: skip
    m = ModelShape.from_hf_config(mistral, name="mistral-7b-v0.1")
    assert m.layer_types == ("sliding_window:4096",) * 32
    c = capacity(m, "h100")
    assert c.hybrid is c.uniform  # no full group 0: no KV-cache groups
    path = tmp_path / "config.json"
    path.write_text(json.dumps(mistral))
    from kvsched.cli import main

    assert main(["capacity", "--model", str(path)]) == 0
    assert "no full-attention layer" in capsys.readouterr().out


# -- the command -----------------------------------------------------------------------------


def test_kvsched_capacity_prints_the_layouts_side_by_side(capsys):
    from kvsched.cli import main

    assert main(["capacity", "--model", "gemma-3-270m", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    lines = [re.sub(r"\s+", " ", line.strip()) for line in out.splitlines()]
    assert "layers 18 (3 full, 15 sliding_window:512)" in lines
    assert "KV layout hybrid uniform" in lines
    assert "KV-cache groups 6 1" in lines
    assert "layers a page 3 18" in lines
    assert "pages of 16 tokens 1,453,938 242,323" in lines
    assert "pages a request reserves 837 512" in lines
    assert "sequences of 8,192 1,737 473" in lines
    assert ("hybrid: a request of 8,192 tokens reserves 512 pages in each full group, 65 pages "
            "in each sliding_window:512 group (long-prefill chunk 512)") in lines  # fmt: skip
    assert lines[-2].endswith("max_num_seqs=473, overhead_reserve=0.0) (pages of every layer)")
    assert lines[-1] == (
        "kvsched.SchedulerConfig(num_blocks=1453939, block_size=16, max_seq_len=8192, "
        "max_num_seqs=1024, overhead_reserve=0.0, long_prefill_chunk=512, kv_cache_groups="
        "['full', 'sliding_window:512', 'sliding_window:512', 'sliding_window:512', "
        "'sliding_window:512', 'sliding_window:512']) (KV-cache groups)"
    )
    # A model of full layers prints what it printed before.
    assert main(["capacity", "--model", "llama-3-8b"]) == 0
    out = capsys.readouterr().out
    assert "KV layout" not in out and "sequences of 8,192 tokens at once: 52" in out


def test_the_docs_show_what_kvsched_capacity_prints(capsys):
    """docs/capacity.md's Gemma 3 27B table: each row's figures (hybrid / uniform)
    are what `kvsched capacity` prints for its arguments."""
    from kvsched.cli import main

    doc = (Path(__file__).resolve().parent.parent / "docs" / "capacity.md").read_text()
    rows = re.findall(r"^\| `(--accelerator [^`]*)` \| (.*) \|$", doc, re.M)
    assert len(rows) == 4, rows
    for args, figures in rows:
        assert main(["capacity", "--model", "gemma-3-27b", *args.split()]) == 0
        out = capsys.readouterr().out
        printed = []
        for label in (r"pages of 16 tokens", r"pages a request reserves", r"sequences of [\d,]+"):
            (pair,) = re.findall(rf"^ +{label} +([\d,]+) +([\d,]+)$", out, re.M)
            printed.append(" / ".join(pair))
        assert [f.strip() for f in figures.split("|")] == printed, (args, out)


# -- the step cost -----------------------------------------------------------------------------


def test_a_sliding_window_layer_reads_only_its_window():
    cost = StepCost.preset("gemma-3-270m", "h100")
    # A decode at 8,192 and one at 300: the 3 full layers read 8,192 + 300, the 15
    # window layers min(8,192, 512) + min(300, 512) = 812: (3 x 8,492 + 15 x 812) /
    # 18 = 37,656 / 18 = 2,092 tokens of every layer.
    assert cost.kv_tokens_read(np.array([8192, 300]), np.array([1, 1])) == 37_656 / 18 == 2092
    # Alone at 8k a decode reads 1/16 of the KV in a window layer: (3 x 8,192 + 15 x
    # 512) / 18 = 1,792.
    assert cost.kv_tokens_read(np.array([8192]), np.array([1])) == 1792
    # A 512-token chunk at positions 1,536..2,047: its windows cover [1,025, 2,048),
    # 1,023 tokens = min(2,048, 512 + 512 - 1).
    assert cost.kv_tokens_read(np.array([2048]), np.array([512])) == (3 * 2048 + 15 * 1023) / 18
    weights = 268e6 * 2
    per_token = 2 * 18 * 1 * 256 * 2  # 18,432 bytes of every layer
    assert cost.memory_seconds(1792) == (weights + 1792 * per_token) / (3.35e12 * 0.8)
    # A chunked local layer of 1,024 reads from its first query's chunk: queries
    # 2,900..2,999 from 2,048 (952 tokens); windows of 256: 256 + 99 = 355.
    mixed = dataclasses.replace(
        MODELS["llama-3-8b"], name="mixed", layers=4,
        layer_types=("full", "chunked_local:1024", "sliding_window:256", "sliding_window:256"),
    )  # fmt: skip
    cost = StepCost(mixed, cost.accelerator)
    assert cost.kv_tokens_read(np.array([3000]), np.array([100])) == (3000 + 952 + 2 * 355) / 4
    # A fresh 100-token prompt reads 100 in every layer.
    assert cost.kv_tokens_read(np.array([100]), np.array([100])) == 100
    # Full layers: the sum of kv_lens, as before.
    llama = StepCost.preset("llama-3-8b", "h100")
    assert llama.kv_tokens_read(np.array([8192, 300]), np.array([1, 1])) == 8492


def test_the_simulator_charges_each_step_the_windowed_read():
    seen: list[float] = []

    @dataclasses.dataclass(frozen=True)
    class Recording(StepCost):
        def seconds(self, tokens: int, kv_tokens_read: float) -> float:
            seen.append(kv_tokens_read)
            return super().seconds(tokens, kv_tokens_read)

    cost = Recording(MODELS["gemma-3-270m"], StepCost.preset().accelerator)
    cfg = kvsched.SchedulerConfig(num_blocks=400, block_size=16, max_num_seqs=4,
                                  max_batched_tokens=512, long_prefill_chunk=512,
                                  max_seq_len=4096)  # fmt: skip
    prompt = np.arange(1, 2049, dtype=np.int32)
    simulate(cfg, [kvsched.TenantConfig("t")], [Arrival(0.0, "t", prompt, 2)], cost)
    # Four chunks of 512 (kv_len 512..2,048), then one decode at 2,049; each step
    # reads (3 x kv_len + 15 x min(kv_len, 512 + q_len - 1)) / 18 tokens of every layer.
    assert seen == [
        512,
        (3 * 1024 + 15 * 1023) / 18,
        (3 * 1536 + 15 * 1023) / 18,
        (3 * 2048 + 15 * 1023) / 18,
        (3 * 2049 + 15 * 512) / 18,
    ]


def test_calibration_counts_a_hybrid_engine_models_windowed_read():
    """`kvsched calibrate` fits the byte rate on the KV a step read: the engine
    model's layer kinds (`layer_kinds`) come into its ModelShape."""
    pytest.importorskip("jax")
    from types import SimpleNamespace

    from kvsched.sim.calibrate import model_shape
    from kvsched.sim.simulator import kv_tokens_read

    kinds = ("sliding_window:16",) * 5 + ("full",)
    config = SimpleNamespace(name="tiny-gemma3", n_layers=6, n_kv_heads=1, head_dim=8,
                             vocab_size=64, dim=32, n_heads=2, ffn_dim=64,
                             layer_kinds=kinds)  # fmt: skip
    shape = model_shape(config, {"w": np.zeros((4, 8))})  # type: ignore[arg-type]
    assert (shape.layer_types, shape.params) == (kinds, 32.0)
    # A decode at 100: (1 x 100 + 5 x 16) / 6 = 30 tokens of every layer.
    assert kv_tokens_read(shape, np.array([100]), np.array([1])) == 30
    llama = SimpleNamespace(**{k: v for k, v in vars(config).items() if k != "layer_kinds"})
    assert model_shape(llama, {}).layer_types == ("full",) * 6  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["gemma-3-270m", "gemma-3-27b", "gpt-oss-20b", "llama-3-8b"])
def test_the_hybrid_scheduler_config_admits_the_sequences_the_capacity_model_counts(model):
    """The scheduler built from `scheduler_config("hybrid")` admits exactly
    `hybrid.seqs` requests of the context, one more is refused for the pool:
    the capacity model and the scheduler's reservations agree."""
    import numpy as np

    import kvsched

    c = capacity(model, "h100", context=8192)
    cfg = c.scheduler_config("hybrid", max_waiting=1 << 20)
    assert cfg.kv_cache_groups == list(c.hybrid.layout.groups)
    s = kvsched.Scheduler(cfg)
    s.add_tenant(kvsched.TenantConfig("t"))
    prompt = np.ones(8192 - 100, np.int32)
    for _ in range(c.hybrid.seqs):
        s.submit("t", prompt, max_tokens=100, now=0.0)
    with pytest.raises(kvsched.Rejected) as e:
        s.submit("t", prompt, max_tokens=100, now=0.0)
    assert e.value.reason == "pool_full"


def test_the_simulator_runs_a_hybrid_model_in_kv_cache_groups():
    import numpy as np

    from kvsched.sim.setup import engine_for
    from kvsched.sim.simulator import Arrival

    arrivals = [Arrival(at=0.0, tenant="t", prompt=np.ones(4000, np.int32), max_tokens=50)]
    hybrid = engine_for(arrivals, model="gemma-3-27b", context=8192)
    uniform = engine_for(arrivals, model="gemma-3-27b", context=8192, kv_groups="uniform")
    assert hybrid.config.kv_cache_groups == ["full"] + ["sliding_window:1024"] * 6
    assert uniform.config.kv_cache_groups == ["full"]
    assert hybrid.config.num_blocks > uniform.config.num_blocks
