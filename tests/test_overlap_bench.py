"""benches/overlap.py --small: the overlap benchmark runs end to end (the
engine loop alone and through `kvsched serve --model simulated` with
streaming clients), its JSON has every figure of every cell, and with
overlap on the engine loop's device idles less than with it off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.subprocess, pytest.mark.model, pytest.mark.alone]

COMMON = {"part", "seqs", "step_ms", "overlap", "device_idle", "host_ms_per_step",
          "device_step_ms", "wall_ms_per_step", "steps", "wall_s", "requests_ended",
          "loadavg_1m"}  # fmt: skip
SERVE = {"itl_p50_ms", "itl_p99_ms", "itl_p50_x", "itl_p99_x", "client_tokens_per_s",
         "http_errors", "client_cpu_s", "running", "waiting", "ramp_s", "engine_process",
         "event_gap_p50_ms", "event_gap_p99_ms", "tokens_per_event",
         "client_events_per_s"}  # fmt: skip


def test_the_small_benchmark_runs_and_overlap_idles_the_device_less(tmp_path):
    from smollm2_helpers import smollm2_file

    smollm2_file()  # skips with the reason when the model's file cannot be fetched
    out = tmp_path / "overlap.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT / "python")}
    done = subprocess.run([sys.executable, str(ROOT / "benches" / "overlap.py"), "--small",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert json.loads(done.stdout) == got
    assert {"started", "cpus", "loadavg_before", "loadavg_after"} <= set(got["meta"])
    cells = got["cells"]
    engine = [c for c in cells if c["part"] == "engine"]
    serve = [c for c in cells if c["part"] == "serve"]
    # 64 sequences, steps of 2 and 10 ms, overlap on and off, for each part.
    assert len(engine) == 4 and len(serve) == 4
    for c in cells:
        want = COMMON | (SERVE if c["part"] == "serve" else set())
        assert want <= set(c), want - set(c)
        assert 0.0 <= c["device_idle"] <= 1.0 and c["host_ms_per_step"] > 0 and c["steps"] > 0
        # Busy time over steps ended: the step running at either end of the
        # window counts in part, so within a step over the window's steps.
        assert c["device_step_ms"] == pytest.approx(c["step_ms"], rel=0.05)
    for c in serve:
        assert c["http_errors"] == 0 and c["client_tokens_per_s"] > 0
        # Per token, an event's later tokens arrive with its first (gap 0):
        # the per-token median may be 0 when events carry several tokens; the
        # gap between events never is.
        assert 0 <= c["itl_p50_ms"] <= c["itl_p99_ms"]
        assert 0 < c["event_gap_p50_ms"] <= c["event_gap_p99_ms"]
        assert c["tokens_per_event"] >= 1 and c["engine_process"] is True
        assert c["client_tokens_per_s"] >= c["client_events_per_s"] > 0
    for step in (2.0, 10.0):
        on, off = ([c for c in engine if c["step_ms"] == step and c["overlap"] is o][0]
                   for o in (True, False))  # fmt: skip
        assert on["device_idle"] < off["device_idle"], (on, off)
