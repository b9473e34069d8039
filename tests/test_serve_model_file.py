"""`kvsched serve --model FILE.gguf --devices N`: any Llama-architecture GGUF
file, served with its own tokenizer and chat template, tensor parallel over
forced host devices, through the official openai client."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")
openai = pytest.importorskip("openai")

from gguf_helpers import write_gguf  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine.loaders.gguf_llama import load_gguf  # noqa: E402
from kvsched.engine.model import LlamaConfig, greedy_dense, init_params  # noqa: E402
from kvsched.serve.server import load_model  # noqa: E402

from serve_helpers import start_serve  # noqa: E402

KEY = "sk-file"
# One KV head for four query heads: on 4 devices each holds a copy of it.
MODEL = LlamaConfig(vocab_size=264, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=16,
                    ffn_dim=96, name="file-llama")  # fmt: skip


@pytest.fixture
def gguf_file(tmp_path):
    params = init_params(MODEL, seed=5)
    path = tmp_path / "my-model.gguf"
    write_gguf(path, MODEL, {**params, "lm_head": params["embed"].T}, name="file-llama")
    return path


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_gguf_file_is_served_tensor_parallel_and_greedy_tokens_equal_dense_recompute(
    tmp_path, gguf_file, monkeypatch
):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nname = "t"\napi_key = "{KEY}"\n')
    proc, url = start_serve(
        ["--model", str(gguf_file), "--devices", "4", "--tenants", str(tenants),
         "--max-seq-len", "128", "--max-num-seqs", "4", "--max-batched-tokens", "64",
         "--checkpoint", str(tmp_path / "ck.jsonl"), "--log-level", "warning"],
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["file-llama"]
        # The file's own tokenizer and chat template, under its file name too.
        gg = load_gguf(gguf_file)
        prompt = gg.tokenizer.encode("hello world", add_special_tokens=False).ids
        got = client.completions.create(model="my-model.gguf", prompt="hello world",
                                        max_tokens=12, temperature=0.0,
                                        extra_body={"return_token_ids": True})  # fmt: skip
        ids = got.choices[0].model_extra["token_ids"]
        want = greedy_dense(gg.params, gg.config, prompt, 12)
        assert ids == want, "4 devices with a copied KV head generate what one dense pass does"
        assert got.choices[0].text == gg.tokenizer.decode(want)
        chat = client.chat.completions.create(
            model="file-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
            temperature=0.0, extra_body={"return_token_ids": True},
        )  # fmt: skip
        chat_prompt = gg.encode_chat([{"role": "user", "content": "hello"}])
        assert chat.choices[0].model_extra["token_ids"] == greedy_dense(
            gg.params, gg.config, chat_prompt, 5)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(30)
    out = proc.stdout.read()
    assert "tensor parallel over 4 cpu devices, each KV head on 4" in out, out[-2000:]


def test_bad_model_device_and_dtype_choices_are_refused_before_anything_loads(tmp_path):
    for kw, match in [
        ({"which": str(tmp_path / "missing.gguf")}, "smollm2, gemma3-270m, tiny, the path of a"),
        ({"which": "tiny", "devices": 2}, "--devices 2: this machine has 1"),
        ({"which": "tiny", "devices": 0}, "--devices 0"),
        ({"which": "tiny", "dtype": "float8"}, "--dtype"),
    ]:
        with pytest.raises(kvsched.InvalidConfig, match=match):
            load_model(**kw)
    m = load_model("tiny", dtype="bfloat16", max_num_seqs=2, max_seq_len=64)
    assert m.engine.model.dtype == "bfloat16" and m.engine.kv_replicas == 1


def test_the_file_names_the_model_and_a_file_without_a_chat_template_serves_completions_only(
    tmp_path, gguf_file
):
    m = load_model(str(gguf_file), max_num_seqs=2, max_seq_len=64)
    assert (m.model_name, m.aliases) == ("file-llama", ("my-model.gguf", "my-model"))
    assert m.encode_chat is not None
    assert m.encode_chat([{"role": "user", "content": "hi"}])[0] == 0  # <|im_start|>
    bare = tmp_path / "bare.gguf"
    write_gguf(bare, MODEL, init_params(MODEL, seed=1), tied=False, chat_template=None)
    plain = load_model(str(bare), max_num_seqs=2, max_seq_len=64)
    assert plain.encode_chat is None
    assert (plain.model_name, plain.aliases) == ("bare", ("bare.gguf",)), "no general.name"


def test_num_blocks_is_the_pool_wherever_it_runs_and_memory_sizes_it_otherwise(monkeypatch):
    """On an accelerator (faked here: 1 MiB free) the pool was always sized
    from memory, so `--num-blocks` was silently ignored there."""
    from kvsched.engine import pool_sizing

    monkeypatch.setattr(pool_sizing, "measured_free_bytes", lambda device: 1 << 20)
    # The tiny model: 2 layers x 2 KV heads x 32 x f32, K and V: 1 KiB a token.
    auto = load_model("tiny", max_num_seqs=2, max_seq_len=64)
    assert auto.engine.sizing.source == "measured"
    assert auto.engine.scheduler.config.num_blocks == (1 << 20) // (16 << 10)
    fixed = load_model("tiny", max_num_seqs=2, max_seq_len=64, num_blocks=20, block_size=32)
    assert fixed.engine.sizing.source == "configured"
    cfg = fixed.engine.scheduler.config
    assert (cfg.num_blocks, cfg.block_size) == (20, 32)
    assert fixed.engine.caches.shape[1:3] == (20, 32)
    with pytest.raises(kvsched.InvalidConfig, match="num_blocks=100: the free memory"):
        load_model("tiny", max_num_seqs=2, max_seq_len=64, num_blocks=100)
