"""`kvsched serve` with its engine in its own process (the default;
kvsched.serve.engine_process): when either process dies the other ends, and
every stream is told; the front end never holds the model; the engine's
/metrics families and a tenant's settings cross the boundary intact.

The serving behaviour itself (tenants, keys, 429, drain, SIGHUP, --end-at,
metrics) is what the other `kvsched serve` tests check, and they run on the
split as it is the default."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import kvsched  # noqa: E402

from serve_helpers import start_serve  # noqa: E402

KEY = "sk-split"


def _tenants(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[[tenant]]\nname = "gold"\napi_key = "{KEY}"\n')
    return path


def _engine_pid(server_pid: int) -> int:
    """The server's engine process: its child started by multiprocessing's spawn."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    raise AssertionError(f"no engine process among {children}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited (its parent has not reaped it yet).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _stream(url: str, out: dict, started: threading.Event) -> None:
    body = {"model": "simulated", "prompt": "Tell me a story", "stream": True,
            "max_tokens": 1000}  # fmt: skip
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:  # fmt: skip
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.setdefault("events", []).append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    started.set()


@pytest.mark.subprocess
@pytest.mark.slow
def test_an_engine_process_that_dies_ends_every_stream_and_the_server(tmp_path):
    """SIGKILL the engine process mid-stream: each open stream gets an error
    event and [DONE], /health never claims the server alive after, and the
    server exits with status 1."""
    proc, url = start_serve(["--model", "simulated", "--tenants", str(_tenants(tmp_path)),
                             "--sim-step-ms", "20", "--log-level", "warning"])  # fmt: skip
    try:
        outs = [{} for _ in range(3)]
        started = [threading.Event() for _ in outs]
        threads = [threading.Thread(target=_stream, args=(url, o, s), daemon=True)
                   for o, s in zip(outs, started, strict=True)]  # fmt: skip
        for t in threads:
            t.start()
        for s in started:
            assert s.wait(30)
        engine = _engine_pid(proc.pid)
        os.kill(engine, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert proc.wait(timeout=30) == 1
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for o in outs:
        assert o.get("status") == 200, (o, log)
        events = o["events"]
        assert events[-1] == "[DONE]", (events[-3:], log)
        last = json.loads(events[-2])
        assert last["error"]["code"] == "engine_error", (last, log)
    assert "the engine process exited" in log, log


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_engine_process_ends_when_the_front_end_is_killed(tmp_path):
    proc, url = start_serve(["--model", "simulated", "--tenants", str(_tenants(tmp_path)),
                             "--log-level", "warning"])  # fmt: skip
    engine = _engine_pid(proc.pid)
    assert _alive(engine)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine), "the engine process outlived its front end"


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_front_end_holds_no_model_and_metrics_come_from_the_engine(tmp_path):
    """The engine's families (scheduler, engine loop, the stand-in device)
    and the front end's (HTTP) are on one /metrics; the front end process
    never initialised a JAX backend; --no-engine-process serves from one."""
    for split in (True, False):
        args = ["--model", "simulated", "--tenants", str(_tenants(tmp_path)), "--log-level",
                "warning", *([] if split else ["--no-engine-process"])]  # fmt: skip
        proc, url = start_serve(args)
        try:
            r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "simulated", "prompt": "Hi", "max_tokens": 4},
                           timeout=30)  # fmt: skip
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            text = httpx.get(f"{url}/metrics", timeout=30).text
            for family in ("kvsched_steps_total", "kvsched_engine_steps_total",
                           "kvsched_sim_device_steps_total", "kvsched_http_requests_total",
                           "kvsched_model_info{", "vllm:num_requests_running{"):  # fmt: skip
                assert family in text, (split, family)
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            assert bool(children) == split
            # The model's memory: the front end holds a tokenizer, not the engine.
            if split:
                front = _rss_mib(proc.pid)
                back = _rss_mib(_engine_pid(proc.pid))
                assert front < back, (front, back)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, proc.stdout.read()[-3000:]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_tenant_config_crosses_the_process_boundary_whole():
    """The tenant registry adds and updates tenants in the engine's process:
    every field of a TenantConfig survives the pipe (pickle)."""
    from kvsched.serve import engine_process  # noqa: F401 - registers the pickling

    t = kvsched.TenantConfig("a", tier=2, kv_floor_blocks=3, kv_cap_blocks=40, max_concurrent=5,
                             rate_tokens_per_s=7.5, burst_tokens=30, weight=2.0,
                             max_step_tokens=64, prefix_namespace="team-a")  # fmt: skip
    back = pickle.loads(pickle.dumps(t))
    assert repr(back) == repr(t)
    assert back.kv_cap_blocks == 40 and back.prefix_namespace == "team-a"


def test_the_card_carries_no_weights():
    """What the front end gets of a GGUF model: its encoders, bound to a copy
    without params, encode as the loaded model does and pickle small."""
    from kvsched.engine.loaders.gguf_llama import load_gguf
    from kvsched.serve.engine_process import without_weights

    from smollm2_helpers import smollm2_file

    gg = load_gguf(smollm2_file())
    chat, prompt = without_weights(gg.encode_chat), without_weights(gg.encode_prompt)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert chat(messages) == gg.encode_chat(messages)
    assert prompt("Once upon") == gg.encode_prompt("Once upon")
    assert chat.__self__.params is None and gg.params is not None
    size = len(pickle.dumps((chat, prompt)))
    assert size < 20 * 2**20, size  # the weights alone are over 500 MB as float32


def test_kvsched_main_runs_only_as_main():
    """A spawned process (the engine's) imports `python -m kvsched`'s module
    by name under another: it must not run the command then."""
    r = subprocess.run([sys.executable, "-c", "import kvsched.__main__"], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0 and r.stdout == "", (r.stdout, r.stderr)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_failed_drain_still_ends_both_processes(tmp_path):
    """The checkpoint cannot be written (its path is a directory): the drain
    fails, the server exits 1, and its engine process is gone with it (it
    used to be left waiting for a pipe the exiting front end still held,
    and the front end waiting for it)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    proc, url = start_serve(["--model", "simulated", "--tenants", str(_tenants(tmp_path)),
                             "--checkpoint", str(ckpt), "--drain-seconds", "1"])  # fmt: skip
    engine = _engine_pid(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=40) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "the drain failed" in proc.stdout.read()
    deadline = time.monotonic() + 10
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine)
