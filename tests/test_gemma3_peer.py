"""The peer check (tests/peer_gemma3.py): kvsched's Gemma 3 270M computes what
transformers computes on the same GGUF file: the layer pattern, the tokenizer's
ids, the logits, and greedy tokens through forward_paged with KV-cache groups on
prompts of 607 and 2,006 tokens (past the 512-token window; a third of 1,219
with `--lengths 600,1200,2000` by hand). Runs where
torch, transformers and accelerate are installed (not kvsched dependencies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gemma, pytest.mark.subprocess, pytest.mark.slow]

for name in ("torch", "transformers", "accelerate", "gguf", "jax"):
    pytest.importorskip(name, reason=f"the peer check needs {name}")

from gemma3_helpers import gemma3_270m  # noqa: E402


def test_kvsched_computes_gemma3_as_transformers_does():
    gemma3_270m()  # skips with the reason when the model cannot be fetched
    script = Path(__file__).parent / "peer_gemma3.py"
    done = subprocess.run([sys.executable, str(script), "--tokens", "16", "--lengths", "600,2000"],
                          capture_output=True, text=True, timeout=2400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["layer_kinds_match"] and r["hf_sliding_window"] == 512
    assert r["tokenizer_mismatches"] == [], "the same ids as transformers' GGUF tokenizer"
    assert r["rel_logit_diff"] < 1e-4, r["max_abs_logit_diff"]
    longest = sorted(r["prompt_lengths"])[-2:]
    assert all(n >= want for n, want in zip(longest, (600, 2000), strict=True)), longest
    assert all(r["greedy_identical"]), r["first_divergence"]
    assert r["kv_groups"] == ["full"] + ["sliding_window:512"] * 5
