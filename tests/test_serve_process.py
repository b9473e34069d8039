"""`kvsched serve` as a process, as a newcomer and an orchestrator meet it (tiny
model, real subprocesses on localhost): what is refused before the model loads
(a port in use, a checkpoint another server holds), what it says while it loads
and warms up, what it logs and does not, and signals in any number and order:
every stream still ends with its final chunk, the checkpoint is written, the
exit status is 0 and nothing aborts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import ROOT, start_serve  # noqa: E402

pytestmark = pytest.mark.subprocess

KEY = "sk-proc"


@pytest.fixture
def tenants(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[[tenant]]\nname = "gold"\napi_key = "{KEY}"\n')
    return path


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvsched", "serve", "--model", "tiny", *args]


def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT / "python"),
            "KVSCHED_CACHE": str(tmp_path / "cache")}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ended(proc: subprocess.Popen) -> None:
    """Whatever a test left of the server, gone."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path, tenants):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        done = subprocess.run(serve_cmd("--tenants", str(tenants), "--port", str(port)),
                              capture_output=True, text=True, env=env(tmp_path),
                              timeout=120)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "loading" not in out and "serving" not in out, "nothing loads or is announced"
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_a_checkpoint_is_written_only_where_asked_and_never_shared(tmp_path, tenants):
    """Without --checkpoint a drain writes no file (it would hold every tenant's
    prompts and nothing reads it back: each client was told at the drain what it
    got); with one, a second live server given the same file is refused, naming
    the holder, before its model loads, and the first one's drain writes it; the
    next server given the file replaces it whole at its own drain."""
    cache = tmp_path / "cache"
    bare, _ = start_serve(["--model", "tiny", "--tenants", str(tenants)],
                          env_extra={"KVSCHED_CACHE": str(cache)})  # fmt: skip
    try:
        bare.send_signal(signal.SIGTERM)
        assert bare.wait(60) == 0
    finally:
        ended(bare)
    assert not [p for p in cache.glob("**/*") if "checkpoint" in p.name], list(cache.glob("**/*"))
    mine = tmp_path / "mine.jsonl"
    proc, _ = start_serve(["--model", "tiny", "--tenants", str(tenants), "--checkpoint", str(mine)])
    try:
        assert (tmp_path / f"{mine.name}.lock").exists()
        second = subprocess.run(
            serve_cmd("--tenants", str(tenants), "--port", str(free_port()),
                      "--checkpoint", str(mine)),
            capture_output=True, text=True, env=env(tmp_path), timeout=120,
        )  # fmt: skip
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"belongs to another live kvsched serve (pid {proc.pid})" in second.stderr
        assert "loading" not in second.stdout + second.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert mine.exists(), "the first server's drain wrote its own file"
        assert mine.stat().st_mode & 0o777 == 0o600
    finally:
        ended(proc)
    # Its lock went with it: the file is free for the next server.
    first = mine.stat().st_ino
    again, _ = start_serve(["--model", "tiny", "--tenants", str(tenants), "--checkpoint",
                            str(mine)])  # fmt: skip
    again.send_signal(signal.SIGTERM)
    assert again.wait(60) == 0
    assert mine.stat().st_ino != first, "the drain wrote a new file over the last one"
    assert mine.stat().st_mode & 0o777 == 0o600
    assert len(mine.read_text().splitlines()) == 2, "header and trailer: nothing was cut"


@pytest.mark.slow
def test_it_says_what_it_is_doing_and_logs_no_probe_nor_jax_info(tmp_path, tenants):
    """/ready answers "loading" while the model loads and the warmup's progress
    while it compiles; the log shows each warmup part; the serving line comes
    only once the socket serves; /health, /ready and /metrics polls are not
    access-logged (a /v1 request is); no JAX INFO line. (The server runs with
    JAX_PLATFORMS=cpu here, so JAX never looks for libtpu: the line it logs
    without that is test_the_servers_logging_hides_jaxs_search_for_a_tpu_....)"""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        serve_cmd("--tenants", str(tenants), "--port", str(port), "--max-batched-tokens",
                  "512"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(tmp_path),
    )  # fmt: skip
    seen: list[dict] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                status, body = get(f"{url}/ready")
            except OSError:
                time.sleep(0.05)
                continue
            seen.append(body)
            if status == 200:
                break
            for probe in ("/health", "/metrics"):
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(url + probe, timeout=2).read()
            time.sleep(0.05)
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert models.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        ended(proc)
    out = proc.stdout.read()
    statuses = [b["status"] for b in seen]
    assert statuses[-1] == "ready"
    assert "loading" in statuses or "warming" in statuses, statuses
    warming = [b["warmup"] for b in seen if b["status"] == "warming" and "warmup" in b]
    assert warming and all(w["total"] == 7 for w in warming), warming  # 6 buckets + 1
    assert [f"warmup {i}/7:" in out for i in range(1, 8)] == [True] * 7, out
    assert out.index("Application startup complete") < out.index("serving tiny-llama")
    assert '"GET /v1/models HTTP/1.1" 200' in out
    for probe in ("/health", "/ready", "/metrics"):
        assert f'"GET {probe} HTTP' not in out, f"{probe} was access-logged"
    assert "libtpu" not in out and "jax._src" not in out, out


def jax_devices_logged(setup: str) -> str:
    """What a fresh interpreter prints when it runs `setup` and then asks JAX
    for its devices, with JAX free to look for every platform (JAX_PLATFORMS
    unset, as a user's shell has it)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(ROOT / "python")
    done = subprocess.run([sys.executable, "-c", f"{setup}\nimport jax\njax.devices()"],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


@pytest.mark.slow
def test_the_servers_logging_hides_jaxs_search_for_a_tpu_unless_at_debug():
    """With the log at INFO, JAX says it could not open libtpu.so on a machine
    without a TPU; the server's logging (as `kvsched serve` sets it before the
    model loads) keeps JAX's INFO lines out, except at --log-level debug."""
    bare = jax_devices_logged("import logging\nlogging.basicConfig(level='INFO')")
    if "libtpu" not in bare:
        pytest.skip("JAX logs no libtpu line at INFO here (a TPU machine?): nothing to hide")
    served = "from kvsched.serve.process import configure_logging\nconfigure_logging('{}')"
    assert "libtpu" not in jax_devices_logged(served.format("info"))
    assert "libtpu" in jax_devices_logged(served.format("debug"))


SEQUENCES = {
    "term-term-int-hup-term-int": [
        signal.SIGTERM,
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGTERM,
        signal.SIGINT,
    ],  # fmt: skip
    "int-hup-int-term-hup-term-term": [
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGTERM,
        signal.SIGTERM,
    ],  # fmt: skip
}


@pytest.mark.slow
@pytest.mark.parametrize("sequence", list(SEQUENCES))
def test_signals_in_any_order_still_answer_every_request_and_write_the_checkpoint(
    tmp_path, tenants, sequence
):
    """The second SIGTERM / SIGINT ends a 60 s drain now; later signals, SIGHUP
    among them, change nothing: every stream ends with a final chunk and [DONE],
    every request not streamed gets its 200 JSON answer ending the same way
    (finish_reason "length", kvsched_finish_reason "drain_deadline"), the
    checkpoint holds each one, the process exits 0 with no traceback and no
    native abort. (A second SIGTERM aborted the process with exit 134: streams
    cut, the answer not streamed a plain-text 500, no checkpoint.)"""
    ckpt = tmp_path / "ckpt.jsonl"
    proc, url = start_serve(
        ["--model", "tiny", "--tenants", str(tenants), "--drain-seconds", "60",
         "--checkpoint", str(ckpt), "--max-seq-len", "2048", "--max-num-seqs", "4",
         "--max-batched-tokens", "64", "--num-blocks", "1000"],
    )  # fmt: skip
    ends: dict[int, list[str]] = {}
    answers: dict[int, httpx.Response] = {}

    def run(i: int) -> None:
        body = {"model": "tiny-llama", "prompt": [5, 17, 99, 3 + i], "max_tokens": 2000}
        auth = {"Authorization": f"Bearer {KEY}"}
        if i % 2:  # not streamed: one answer at the end
            answers[i] = httpx.post(f"{url}/v1/completions", json=body, timeout=90,
                                    headers=auth)  # fmt: skip
            return
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=90, headers=auth) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        ends[i] = events[-2:]

    try:
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # four run, two wait behind max_num_seqs
        t0 = time.monotonic()
        for sig in SEQUENCES[sequence]:
            proc.send_signal(sig)
            # Apart: two signals sent at once may be merged by the kernel into one (the
            # case of both reaching the loop before the drain runs is tested in-process:
            # test_serve_openai.py::test_two_signals_taken_before_the_drain_first_runs...).
            time.sleep(0.1)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        assert time.monotonic() - t0 < 30, "the second signal ended the 60 s drain"
    finally:
        ended(proc)
    out = proc.stdout.read()
    assert (sorted(ends), sorted(answers)) == ([0, 2, 4], [1, 3, 5])
    for events in ends.values():
        assert events[-1] == "[DONE]"
        final = json.loads(events[0])["choices"][0]
        assert final["finish_reason"] == "length"
        assert final["kvsched_finish_reason"] == "drain_deadline"
    for r in answers.values():
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "length"
        assert choice["kvsched_finish_reason"] == "drain_deadline"
        assert r.json()["usage"]["completion_tokens"] < 2000  # cut, or never run
    lines = ckpt.read_text().splitlines()
    assert len(lines) == 6 + 2, "header, the six handed back, trailer"
    assert "Traceback" not in out and "terminate called" not in out, out


@pytest.mark.parametrize("while_", ["loading", pytest.param("warming", marks=pytest.mark.slow)])
def test_a_signal_while_loading_or_warming_up_exits_zero_at_once(tmp_path, tenants, while_):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        serve_cmd("--tenants", str(tenants), "--port", str(port), "--max-batched-tokens",
                  "1024", "--checkpoint", str(tmp_path / "ck.jsonl")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(tmp_path),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, f"never {while_}"
            try:
                if get(f"{url}/ready")[1]["status"] == while_:
                    break
            except OSError:
                pass
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        ended(proc)
    out = proc.stdout.read()
    assert "Traceback" not in out and "terminate called" not in out, out
    if while_ == "loading":
        assert "SIGTERM while loading the model: nothing was admitted" in out
    else:
        assert "warmup stopped by the drain" in out


@pytest.mark.slow
def test_max_connections_one_serves_one_connection_and_refuses_a_second(tmp_path, tenants):
    """`--max-connections 1`: a lone request is served; one on a second
    connection gets a 503 (the first was refused too: uvicorn counts the
    requesting connection against its limit)."""
    proc, url = start_serve(["--model", "tiny", "--tenants", str(tenants), "--max-connections",
                             "1"])  # fmt: skip
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as held:
            held.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert held.recv(4096).startswith(b"HTTP/1.1 200"), "kept alive, still open"
            refused = httpx.get(f"{url}/health")
            assert refused.status_code == 503 and refused.text == "Service Unavailable"
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code != 200:  # once the server saw it close
            assert time.monotonic() < deadline, "the closed connection still counted"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        ended(proc)


@pytest.mark.slow
def test_served_model_name_replaces_the_models_names(tmp_path, tenants):
    proc, url = start_serve(["--model", "tiny", "--tenants", str(tenants),
                             "--served-model-name", "my-model", "also-me"])  # fmt: skip
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        models = httpx.get(f"{url}/v1/models", headers=auth).json()
        assert [m["id"] for m in models["data"]] == ["my-model"]
        for name, status in (("my-model", 200), ("also-me", 200), ("tiny-llama", 404)):
            r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=30,
                           json={"model": name, "prompt": [1, 2, 3], "max_tokens": 2})  # fmt: skip
            assert r.status_code == status, (name, r.text)
            if status == 200:
                assert r.json()["model"] == name
        assert 'kvsched_model_info{checksum="' in (metrics := httpx.get(f"{url}/metrics").text)
        assert 'name="my-model"' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@pytest.mark.slow
@pytest.mark.model
def test_the_real_model_is_served_as_smollm2_135m_instruct(tenants):
    """The name the README tells clients to send is the one /v1/models lists,
    responses carry and the metrics' model info holds (the GGUF's own
    general.name is "Smollm2 135M 8k Lc100K Mix1 Ep2"); "smollm2" is accepted too."""
    from kvsched import model_files

    try:
        model_files.fetch(quiet=True)
    except model_files.ModelFetchError as e:
        pytest.skip(f"SmolLM2-135M-Instruct cannot be fetched: {e}")
    name = "SmolLM2-135M-Instruct"
    proc, url = start_serve(["--tenants", str(tenants), "--max-seq-len", "128",
                             "--max-num-seqs", "2", "--max-batched-tokens", "32"],
                            timeout=600)  # fmt: skip
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        models = httpx.get(f"{url}/v1/models", headers=auth).json()
        assert [m["id"] for m in models["data"]] == [name]
        for asked in (name, "smollm2"):
            r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=60,
                           json={"model": asked, "prompt": "Hi", "max_tokens": 1})  # fmt: skip
            assert r.status_code == 200 and r.json()["model"] == asked, r.text
        info = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line.startswith("kvsched_model_info{")]  # fmt: skip
        assert len(info) == 1 and f'name="{name}"' in info[0], info
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        ended(proc)
    assert f"serving {name} to 1 tenant(s)" in proc.stdout.read()


@pytest.mark.slow
def test_the_scheduler_table_and_flags_set_the_servers_scheduler(tmp_path, tenants):
    """The tenants file's [scheduler] table sets the knobs, a flag given wins
    over it, and the log says what the scheduler runs with."""
    tenants.write_text(tenants.read_text() + "[scheduler]\npreempt_lower_tiers = false\n"
                       "max_num_seqs = 3\nladder = \"off\"\n")  # fmt: skip
    proc, url = start_serve(["--model", "tiny", "--tenants", str(tenants), "--max-num-seqs", "5"])
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        ended(proc)
    out = proc.stdout.read()
    assert ("scheduler: reserve admission, preempt_lower_tiers False, ladder off, "
            "max_num_seqs 5, max_batched_tokens 256") in out, out  # fmt: skip


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def gauge(metrics: str, name: str) -> float:
    (value,) = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith(name + " ")]  # fmt: skip
    return value


@pytest.mark.slow
def test_a_soak_of_mixed_requests_keeps_memory_flat_and_ends_with_nothing_held(tmp_path, tenants):
    """300 requests of every kind (answered, streamed and dropped, malformed,
    over the context, made-up methods and paths, over the body limit), ten at a
    time: the server's RSS grows by no more in the second half than a little,
    and at the end nothing is live and no KV page is held."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    proc, url = start_serve(["--model", "tiny", "--tenants", str(tenants), "--max-seq-len",
                             "256", "--max-body-bytes", "65536"])  # fmt: skip
    auth = {"Authorization": f"Bearer {KEY}"}

    def one(i: int) -> None:
        rng = random.Random(i)
        kind = i % 6
        with httpx.Client(base_url=url, headers=auth, timeout=60) as c:
            if kind == 0:
                prompt = [rng.randrange(1, 500) for _ in range(9)]
                c.post("/v1/completions", json={"model": "tiny-llama", "max_tokens": 8,
                                                "prompt": prompt})  # fmt: skip
            elif kind == 1:
                body = {"model": "tiny-llama", "prompt": [5, 6, i % 400], "max_tokens": 200,
                        "stream": True}  # fmt: skip
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for n, _ in enumerate(r.iter_lines()):
                        if n > 3:
                            break  # the client goes: the request is cancelled
            elif kind == 2:
                c.post("/v1/completions", content=b'{"model": "tiny-llama", "prompt": [1,')
            elif kind == 3:
                c.post("/v1/completions", json={"model": "tiny-llama", "prompt": [1] * 300})
            elif kind == 4:
                c.request(f"M{i}", f"/x/{i}")
            else:
                c.post("/v1/completions", content=b"x" * 70_000)

    try:
        with ThreadPoolExecutor(10) as pool:
            list(pool.map(one, range(150)))
            middle = rss_kib(proc.pid)
            list(pool.map(one, range(150, 300)))
        end = rss_kib(proc.pid)
        deadline = time.monotonic() + 30
        while True:
            metrics = httpx.get(f"{url}/metrics").text
            live = gauge(metrics, "kvsched_live_requests")
            used = gauge(metrics, "kvsched_pool_used_blocks")
            if (live, used) == (0, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (live, used) == (0, 0)
        assert end - middle < 20 * 1024, f"RSS grew {(end - middle) / 1024:.1f} MiB"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
