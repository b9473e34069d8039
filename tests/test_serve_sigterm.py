"""SIGTERM under load, in a real `kvsched serve` process (tiny model): every
stream, running or still waiting, ends within the drain deadline plus a second
with a final chunk; the checkpoint holds exactly the requests handed back, with
the tokens each stream received; the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

pytest.importorskip("jax")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import start_serve  # noqa: E402

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

KEY = "sk-load"
DRAIN_S = 1.5


def test_sigterm_mid_load_ends_every_stream_and_saves_exactly_the_handed_back(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nname = "gold"\napi_key = "{KEY}"\n')
    ckpt = tmp_path / "ckpt.jsonl"
    proc, url = start_serve(
        ["--model", "tiny", "--tenants", str(tenants), "--drain-seconds", str(DRAIN_S),
         "--checkpoint", str(ckpt), "--max-seq-len", "2048", "--max-num-seqs", "4",
         "--max-batched-tokens", "64", "--num-blocks", "1000", "--log-level", "warning"],
    )  # fmt: skip
    streams: list[dict] = [{"tokens": [], "events": [], "ended_at": None} for _ in range(7)]
    started = [threading.Event() for _ in streams]

    def run(i: int) -> None:
        # Four long requests run; three more wait behind max_num_seqs = 4.
        body = {"model": "tiny-llama", "prompt": [5, 17, 99, 3 + i], "stream": True,
                "max_tokens": 2000, "return_token_ids": True}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:  # fmt: skip
            started[i].set()
            streams[i]["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                streams[i]["events"].append(line[6:])
                if line[6:] != "[DONE]":
                    choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                    streams[i]["tokens"] += choice.get("token_ids") or []
        streams[i]["ended_at"] = time.monotonic()

    try:
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(7)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(30)
        while sum(1 for s in streams if s["tokens"]) < 4:  # the running ones produce
            time.sleep(0.05)
        sigterm = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(DRAIN_S + 30)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [s["status"] for s in streams] == [200] * 7, "all admitted (three wait)"
    for s in streams:
        assert s["ended_at"] is not None and s["ended_at"] - sigterm <= DRAIN_S + 1.0, s
        assert s["events"][-1] == "[DONE]"
    finals = [json.loads(s["events"][-2])["choices"][0] for s in streams]
    handed_back = [
        i for i, f in enumerate(finals) if f["kvsched_finish_reason"] == "drain_deadline"
    ]
    assert len(handed_back) == 7, "2000 tokens cannot finish in the drain: all are handed back"
    records = [json.loads(line) for line in ckpt.read_text().splitlines() if line.strip()]
    in_flight = [r for r in records if r["kind"] == "in_flight"]
    assert len(in_flight) == len(handed_back)
    assert sorted(r["generated_ids"] for r in in_flight) == sorted(
        streams[i]["tokens"] for i in handed_back
    ), "each saved request holds exactly the tokens its stream received"
    assert sum(1 for r in in_flight if not r["generated_ids"]) == 3, "the waiting ones too"
