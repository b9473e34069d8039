"""Gemma 3 270M against what transformers computed on the same GGUF file, without
torch: tests/data/gemma3_golden.json holds transformers' token ids, greedy
tokens and logits rows (written by `python tests/peer_gemma3.py --golden
tests/data/gemma3_golden.json`, which also checks the same things against a
live transformers). Prompts of 613, 1,201 and 2,015 tokens run past the
512-token window; the greedy runs go through `forward_paged` with the model's
six KV-cache groups, prefilled in chunks smaller than the window: on
hand-built plans, and through the whole engine (the scheduler's groups, prefix
hits past the window)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("gguf")

import jax.numpy as jnp  # noqa: E402
from gemma3_helpers import HandPlan, gemma3_270m  # noqa: E402

from kvsched import model_files  # noqa: E402
from kvsched.engine.model import forward_dense  # noqa: E402

pytestmark = [pytest.mark.gemma, pytest.mark.slow]

GOLDEN = json.loads((Path(__file__).parent / "data" / "gemma3_golden.json").read_text("utf-8"))
PROMPTS = GOLDEN["prompts"]
# transformers and forward_dense differ by 1e-3 at most on these prompts, at a
# logit scale of about 30 (float32, different summation orders)
LOGIT_TOL = 5e-3
GREEDY = 16  # of the golden file's greedy tokens, per prompt


def test_the_golden_file_is_for_the_fetched_model_file():
    assert GOLDEN["sha256"] == model_files.GEMMA3_270M.sha256
    lengths = [len(p["ids"]) for p in PROMPTS]
    assert max(lengths) > 2000 and sum(n > 512 for n in lengths) >= 3


def test_the_tokenizer_gives_transformers_ids():
    m = gemma3_270m()
    for case in GOLDEN["awkward"] + PROMPTS:
        assert m.encode_prompt(case["text"]) == case["ids"], case["text"][:60]


def test_dense_logits_are_transformers_before_at_and_past_the_window():
    m = gemma3_270m()
    fixed = np.asarray(GOLDEN["fixed_ids"])
    for p in PROMPTS:
        rows = [r["position"] for r in p["logits"]]
        got = np.asarray(forward_dense(m.params, m.config, jnp.asarray(p["ids"], jnp.int32),
                                       rows=jnp.asarray(rows, jnp.int32)))  # fmt: skip
        for row, want in zip(got, p["logits"], strict=True):
            assert int(np.argmax(row)) == want["top_ids"][0]
            np.testing.assert_allclose(row[want["top_ids"]], want["top_logits"], atol=LOGIT_TOL)
            np.testing.assert_allclose(row[fixed], want["fixed_logits"], atol=LOGIT_TOL)


def test_forward_paged_with_kv_groups_gives_transformers_greedy_tokens():
    """Hand-built plans (tests/gemma3_helpers.py): out-of-window pages are
    returned and poisoned with NaN, so a read of one would show. The prompts
    up to 1,201 tokens (the 2,015-token one runs through the engine below)."""
    m = gemma3_270m()
    prompts = {i: p["ids"] for i, p in enumerate(PROMPTS) if len(p["ids"]) < 2000}
    longest = max(map(len, prompts.values())) + GREEDY
    pages = sum(-(-(len(p) + GREEDY) // 16) for p in prompts.values())
    plan = HandPlan(m.params, m.config, block_size=16, num_blocks=6 * pages + 1, max_seqs=4,
                    max_len=longest + 16, tokens_per_step=256)  # fmt: skip
    assert plan.layout.num_groups == 6
    got = plan.generate(prompts, GREEDY, chunk=200)
    assert max(map(len, prompts.values())) > 1024, "past the window twice"
    for i in prompts:
        p = PROMPTS[i]
        assert got[i] == p["greedy"][:GREEDY], (len(p["ids"]), got[i], p["greedy"][:GREEDY])


def test_the_engine_serves_transformers_greedy_tokens_with_kv_groups_and_prefix_hits():
    """The whole engine: the scheduler's KV-cache groups (a full group, five
    of the 512-token window), chunked prefill of 200 tokens, four sequences a
    step; then the long prompts again, hitting the prefix cache past the window."""
    import kvsched
    from kvsched.engine.runner import Engine

    m = gemma3_270m()
    cfg = kvsched.SchedulerConfig(num_blocks=1200, block_size=16, max_num_seqs=4,
                                  max_batched_tokens=256, max_seq_len=2112, max_waiting=16,
                                  long_prefill_chunk=200, overhead_reserve=0.0)  # fmt: skip
    eng = Engine.create(m.config, m.params, cfg, backend="reference", pool="configured")
    assert eng.group_layout.groups == ("full",) + ("sliding_window:512",) * 5
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    out: dict[int, list[int]] = {}

    def run(prompts: list[dict]) -> list[int]:
        ids = [eng.scheduler.submit("t", np.asarray(p["ids"], np.int32), GREEDY) for p in prompts]
        while eng.scheduler.live_requests:
            for f in eng.step().events.finished:
                out[f.request_id] = f.output_ids.tolist()
        return ids

    for prompts in (PROMPTS, [p for p in PROMPTS if len(p["ids"]) > 512]):
        for rid, p in zip(run(prompts), prompts, strict=True):
            assert out[rid] == p["greedy"][:GREEDY], len(p["ids"])
    hits = eng.scheduler.stats()["tenants"]["t"]["prefix_cache"]["hit_tokens"]
    assert hits > 3000  # the second wave read its long prompts from the cache
