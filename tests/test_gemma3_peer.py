"""The peer check (tests/peer_gemma3.py) in CI's time: transformers, run now on
the same GGUF file, computes what tests/data/gemma3_golden.json says (the layer
pattern kvsched derives, every token id, logits rows before, at and past the
512-token window, and the greedy tokens of prompts up to 2,015 tokens), and
tests/test_gemma3_golden.py checks kvsched against that same file: kvsched
agrees with transformers through it. The whole live comparison (kvsched's
forward_paged with KV-cache groups against transformers' generate) runs by hand:
`python tests/peer_gemma3.py`. Runs where torch, transformers and accelerate are
installed (not kvsched dependencies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gemma, pytest.mark.subprocess, pytest.mark.slow]

for name in ("torch", "transformers", "accelerate", "gguf", "jax"):
    pytest.importorskip(name, reason=f"the peer check needs {name}")

from gemma3_helpers import gemma3_file  # noqa: E402


def test_transformers_computes_what_the_golden_file_says():
    gemma3_file()  # skips with the reason when the model cannot be fetched
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, str(here / "peer_gemma3.py"), "--tokens", "16",
                           "--against-golden", str(here / "data" / "gemma3_golden.json")],
                          capture_output=True, text=True, timeout=2400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["mode"] == "against_golden"
    assert r["layer_kinds_match"] and r["hf_sliding_window"] == 512
    assert r["tokenizer_mismatches"] == [], "transformers' GGUF tokenizer gives the file's ids"
    assert r["top_ids_match"] and r["rel_logit_diff"] < 1e-4, r["max_abs_logit_diff"]
    assert sum(n > 512 for n in r["prompt_lengths"]) >= 3 and max(r["prompt_lengths"]) > 2000
    assert all(r["greedy_identical"]), r["first_divergence"]
