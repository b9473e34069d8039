"""The peer check (tests/peer_smollm2.py): kvsched serving SmolLM2-135M-Instruct
computes what transformers computes on the same GGUF file. Runs where torch,
transformers and accelerate are installed (they are not kvsched dependencies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.subprocess, pytest.mark.slow]

for name in ("torch", "transformers", "accelerate", "gguf", "jax"):
    pytest.importorskip(name, reason=f"the peer check needs {name}")

from smollm2_helpers import smollm2_file  # noqa: E402


def test_kvsched_serves_smollm2_as_transformers_computes_it():
    smollm2_file()  # skips with the reason when the model cannot be fetched
    script = Path(__file__).parent / "peer_smollm2.py"
    done = subprocess.run(
        # The Pallas kernel is checked against the reference elsewhere
        # (test_engine_attention, test_engine): here the reference against
        # transformers, in CI's time (`--runs pallas:reserve` by hand).
        [sys.executable, str(script), "--runs", "reference:reserve,reference:overcommit"],
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["prompts"] >= 8
    assert r["tokenizer_mismatches"] == [], "the same ids as transformers' GGUF tokenizer"
    assert r["rel_logit_diff"] < 1e-3, r["max_abs_logit_diff"]
    by = {(x["backend"], x["admission"]): x for x in r["runs"]}
    reserve = by[("reference", "reserve")]
    assert all(reserve["greedy_identical"]), reserve["first_divergence"]
    assert reserve["prefix_hit_tokens"] > 0, "the second wave hit the cached system prompt"
    assert reserve["generated_tokens"] > 8 * 16
    over = by[("reference", "overcommit")]
    assert all(over["greedy_identical"]), over["first_divergence"]
    assert over["preemptions"] > 0, "the pool was short: requests were preempted and recomputed"
    for run in r["runs"]:
        assert run["programs"] == run["buckets"], "nothing compiled after warmup"
