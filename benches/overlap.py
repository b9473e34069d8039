"""Does the device wait for the host? Overlapped scheduling measured with the
stand-in model (kvsched.engine.simulated), side by side with it off.

    python benches/overlap.py [--small] [--seqs 64,256,1024] [--step-ms 2,10,20]
                              [--parts engine,serve] [--out overlap.json]
    python benches/overlap.py --profile 1024:10 [--profile-steps 300]
                              [--profiler cprofile|pyinstrument]

(a) `engine`: a SimulatedEngine driven by its own loop, N sequences kept
running (a request that ends is replaced at once), every request sampled
(temperature 0.8, top_p 0.95) with a stop string, SmolLM2's tokenizer (text,
detokenization, stop strings all on). (b) `serve`: `kvsched serve --model
simulated` with N streaming chat clients driven from a process of their own
(raw asyncio HTTP/1.1 and SSE, so the clients' own Python costs as little as
it can on a shared machine), each sending its next request as one ends.

Per cell (N sequences x device step x overlap on/off), over a window after
the ramp (the device thread's own figures, `SimulatedDevice.stats()`, read
in the engine's process; through /metrics for the server):

- `device_idle`: 1 - device busy / wall.
- `host_ms_per_step`: the engine loop's time outside waiting for the device,
  per step ((wall - host blocked on the device) / steps).
- `device_step_ms`: the device's mean step (the nominal step plus sleep's
  overshoot).
- serve only: client-side inter-token latency p50/p99 (per token, inside
  the window: the gap since the stream's previous event for an event's
  first token, 0 for the others an event carries when the server merged
  what waited), in ms and as a multiple of the nominal step (`itl_p50_x`,
  `itl_p99_x`), the gap between a stream's events (`event_gap_p50_ms`,
  `event_gap_p99_ms`) and the tokens an event carried (`tokens_per_event`),
  the tokens/s and events/s the clients saw (token ids are asked for and
  counted), and the sequences running at the window's start
  and end (the window
  opens once 95% of the clients' requests run, or after RAMP_S: a server
  that cannot keep N running is measured as it is).

`--engine-process on,off` runs each serve cell with the engine in its own
process (the default) and on a thread of the server's.

`--small` (about a minute): 64 sequences, steps of 2 and 10 ms, both parts.
JSON on stdout (and in --out); a table on stderr. `--profile N:MS` runs the
engine loop (overlap on) under cProfile and prints where the host's time per
step goes, the device wait left out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-overlap-bench"
STOP = ["\n\n"]
QUESTIONS = [
    "Tell me about the harbor in the morning.",
    "What happens in the town in November?",
    "Describe the festival in the square.",
    "Who looks after the lighthouse now?",
    "What does the baker on the corner do?",
    "Write a short paragraph about the old quarter.",
    "What can you see from the lighthouse gallery?",
    "How do the fishermen start their day?",
]
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
MAX_TOKENS = (64, 256)  # each request's max_tokens, drawn uniformly
MAX_SEQ_LEN = 512
RAMP_S = 20.0  # serve: the longest ramp waited for before measuring


def scheduler_knobs(n: int) -> dict[str, Any]:
    """Room for every sequence's decode and a few prefills each step."""
    return {"max_num_seqs": n, "max_batched_tokens": n + 512, "max_waiting": n,
            "long_prefill_chunk": 256}  # fmt: skip


def window(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Idle share, host ms a step and the device's mean step over a window of
    two SimulatedDevice.stats() reads."""
    d = {k: after[k] - before[k] for k in before}
    steps = max(d["steps"], 1.0)
    return {
        "device_idle": round(1.0 - d["busy_s"] / d["clock_s"], 4),
        "host_ms_per_step": round(1000 * (d["clock_s"] - d["host_wait_s"]) / steps, 3),
        "device_step_ms": round(1000 * d["busy_s"] / steps, 3),
        "wall_ms_per_step": round(1000 * d["clock_s"] / steps, 3),
        "steps": int(d["steps"]),
        "wall_s": round(d["clock_s"], 3),
    }


# -- (a) the engine loop alone ---------------------------------------------------------


def engine_cell(n: int, step_ms: float, overlap: bool, *, warm_steps: int, measure_steps: int,
                seed: int = 0, profile: Any = None,
                per_row: bool = False) -> dict[str, Any]:  # fmt: skip
    import kvsched
    from kvsched.engine.sampling import SamplingParams
    from kvsched.engine.simulated import simulated_engine, smollm2_tokenizer

    tok = smollm2_tokenizer()
    assert tok.encode_chat is not None
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    blocks = -(-MAX_SEQ_LEN // 16)
    cfg = kvsched.SchedulerConfig(num_blocks=n * blocks + 1, block_size=16,
                                  max_seq_len=MAX_SEQ_LEN, overhead_reserve=0.0,
                                  **scheduler_knobs(n))  # fmt: skip
    eng = simulated_engine(cfg, step_ms / 1000.0, tokenizer=tok.tokenizer,
                           eos_token_ids=tok.eos_token_ids, model=tok.model, overlap=overlap,
                           seed=seed)  # fmt: skip
    eng.warmup(progress=False)
    gc.collect()
    gc.freeze()  # what kvsched serve does once warm (AsyncEngine's freeze_gc)
    eng.scheduler.add_tenant(kvsched.TenantConfig("bench"))
    rng = random.Random(seed)

    def submit() -> None:
        params = SamplingParams(
            max_tokens=rng.randint(*MAX_TOKENS),
            stop=tuple(STOP),
            temperature=SAMPLING["temperature"],
            top_p=SAMPLING["top_p"],
        )
        eng.submit("bench", rng.choice(prompts), params)

    for _ in range(n):
        submit()
    ended = tokens = 0

    def run(steps: int) -> None:
        nonlocal ended, tokens
        done = 0
        while done < steps:
            res = eng.step()
            if res is None:
                continue
            done += res.plan is not None
            if per_row:  # a RequestOutput per row, as a per-stream server reads them
                for out in res.outputs:
                    tokens += len(out.token_ids)
                    if out.finished:
                        ended += 1
                        submit()
                continue
            # The step's outputs as columns (a server that handles a step
            # whole reads them so).
            tokens += res.outputs.num_tokens
            for _ in res.outputs.finished_ids():
                ended += 1
                submit()

    run(warm_steps)
    ended = tokens = 0
    before = eng.device.stats()
    if profile is not None:
        profile.enable()
    run(measure_steps)
    if profile is not None:
        profile.disable()
    after = eng.device.stats()
    eng.close()
    cell: dict[str, Any] = {"part": "engine", "seqs": n, "step_ms": step_ms, "overlap": overlap,
                            "outputs": "per_row" if per_row else "columns"}  # fmt: skip
    cell.update(window(before, after))
    cell["requests_ended"] = ended
    cell["tokens_per_step"] = round(tokens / max(cell["steps"], 1), 1)
    return cell


# -- (b) through kvsched serve -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(n: int, step_ms: float, overlap: bool, workdir: Path,
                 split: bool = True) -> tuple[Any, str]:  # fmt: skip
    toml = workdir / "tenants.toml"
    toml.write_text(f'[[tenant]]\nname = "bench"\napi_key = "{KEY}"\n')
    port = free_port()
    knobs = scheduler_knobs(n)
    cmd = [sys.executable, "-m", "kvsched", "serve", "--model", "simulated", "--tenants",
           str(toml), "--port", str(port), "--sim-step-ms", str(step_ms),
           "--max-seq-len", str(MAX_SEQ_LEN), "--max-num-seqs", str(n),
           "--max-batched-tokens", str(knobs["max_batched_tokens"]),
           "--max-waiting", str(n), "--max-connections", "0", "--drain-seconds", "0",
           "--log-level", "warning", "--overlap" if overlap else "--no-overlap",
           "--engine-process" if split else "--no-engine-process"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            raise RuntimeError(f"kvsched serve exited: {err}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("kvsched serve was not ready in 180 s")


def serve_cell(n: int, step_ms: float, overlap: bool, *, warm_s: float, measure_s: float,
               split: bool = True) -> dict[str, Any]:  # fmt: skip
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(n, step_ms, overlap, Path(tmp), split)
        t_ready = time.monotonic()
        try:
            cmd = [sys.executable, __file__, "--client", url, "--clients", str(n),
                   "--warm-s", str(warm_s), "--measure-s", str(measure_s)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=warm_s + measure_s + 300)  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"the clients failed: {done.stderr[-3000:]}")
            got = json.loads(done.stdout)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    running = (got["before"].pop("running"), got["after"].pop("running"))
    waiting = (got["before"].pop("waiting"), got["after"].pop("waiting"))
    cell: dict[str, Any] = {"part": "serve", "seqs": n, "step_ms": step_ms, "overlap": overlap,
                            "engine_process": split}  # fmt: skip
    cell.update(window(got["before"], got["after"]))
    cell["running"], cell["waiting"] = running, waiting  # at the window's start and end
    cell["ramp_s"], cell["server_start_s"] = got["ramp_s"], round(t_ready - t_start, 1)
    itl = sorted(got["gaps"])
    cell["itl_p50_ms"] = round(1000 * percentile(itl, 50), 3)
    cell["itl_p99_ms"] = round(1000 * percentile(itl, 99), 3)
    cell["itl_p50_x"] = round(cell["itl_p50_ms"] / step_ms, 3)
    cell["itl_p99_x"] = round(cell["itl_p99_ms"] / step_ms, 3)
    events = sorted(got["event_gaps"])
    cell["event_gap_p50_ms"] = round(1000 * percentile(events, 50), 3)
    cell["event_gap_p99_ms"] = round(1000 * percentile(events, 99), 3)
    cell["tokens_per_event"] = round(got["tokens"] / max(1, got["events"]), 2)
    cell["client_tokens_per_s"] = round(got["tokens"] / got["window_s"], 1)
    cell["client_events_per_s"] = round(got["events"] / got["window_s"], 1)
    cell["requests_ended"] = got["ended"]
    cell["http_errors"] = got["errors"]
    cell["client_cpu_s"] = got["cpu_s"]
    return cell


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def scrape(url: str) -> dict[str, float]:
    names = {"kvsched_sim_device_clock_seconds_total": "clock_s",
             "kvsched_sim_device_busy_seconds_total": "busy_s",
             "kvsched_sim_device_steps_total": "steps",
             "kvsched_sim_host_wait_seconds_total": "host_wait_s",
             "kvsched_running": "running", "kvsched_waiting": "waiting"}  # fmt: skip
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[names[name]] = float(value)
    return out


async def clients(url: str, n: int, warm_s: float, measure_s: float) -> dict[str, Any]:
    """N streaming chat clients, each sending its next request as one ends;
    the inter-token gaps seen inside the measurement window."""
    host, port = url.removeprefix("http://").split(":")
    rng = random.Random(1)
    gaps: list[float] = []
    event_gaps: list[float] = []
    stats = {"events": 0, "tokens": 0, "ended": 0, "errors": 0}
    t_start = time.monotonic()
    win = [float("inf"), float("inf")]  # the measurement window, once the ramp is over
    stop = asyncio.Event()

    async def one_client(k: int) -> None:
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        while not stop.is_set():
            if writer is None:
                reader, writer = await asyncio.open_connection(host, int(port))
            assert reader is not None
            body = json.dumps({
                "model": "simulated", "stream": True, "stop": STOP,
                "max_tokens": rng.randint(*MAX_TOKENS),
                "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], **SAMPLING,
                "return_token_ids": True,
            }).encode()  # fmt: skip
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                         b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                         b"Content-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
            status = await reader.readline()
            chunked, length = False, 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                low = line.lower()
                chunked |= low.startswith(b"transfer-encoding:") and b"chunked" in low
                if low.startswith(b"content-length:"):
                    length = int(low.split(b":")[1])
            if b" 200 " not in status:
                stats["errors"] += 1
                if length:
                    await reader.readexactly(length)
                await asyncio.sleep(0.05)
                continue
            buf, last = b"", None
            while True:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    await reader.readline()
                    break
                buf += (await reader.readexactly(size + 2))[:-2]
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    now = time.monotonic()
                    if b'"delta":{"content":' in event and b'"finish_reason":null' in event:
                        # An event may carry several tokens (a server that
                        # fell behind merges what waits): the first came after
                        # the gap, the others with it (gaps of 0).
                        ids = event.partition(b'"token_ids":[')[2].partition(b"]")[0]
                        k = ids.count(b",") + 1 if ids else 1
                        if last is not None and win[0] <= last and now <= win[1]:
                            gaps.append(now - last)
                            gaps.extend([0.0] * (k - 1))
                            event_gaps.append(now - last)
                        if win[0] <= now <= win[1]:
                            stats["events"] += 1
                            stats["tokens"] += k
                        last = now
                    elif b'"finish_reason":"' in event and win[0] <= now <= win[1]:
                        stats["ended"] += 1
            if not chunked:
                writer.close()
                writer = None
        if writer is not None:
            writer.close()

    tasks = [asyncio.create_task(one_client(k)) for k in range(n)]
    loop = asyncio.get_running_loop()
    # The ramp: at least warm_s, until nearly every client's request runs
    # (or RAMP_S: a server that cannot keep N running is measured as it is).
    while True:
        await asyncio.sleep(0.5)
        st = await loop.run_in_executor(None, scrape, url)
        elapsed = time.monotonic() - t_start
        if elapsed >= RAMP_S or (elapsed >= warm_s and st["running"] >= 0.95 * n):
            break
    before = await loop.run_in_executor(None, scrape, url)
    t0 = win[0] = time.monotonic()
    win[1] = t0 + measure_s
    await asyncio.sleep(measure_s)
    after = await loop.run_in_executor(None, scrape, url)
    t1 = time.monotonic()
    win[1] = t1  # gaps recorded up to the second scrape
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"gaps": gaps, "event_gaps": event_gaps, "before": before, "after": after,
            "window_s": t1 - t0,
            "ramp_s": round(t0 - t_start, 2), "cpu_s": round(time.process_time(), 2),
            **stats}  # fmt: skip


# -- profile ---------------------------------------------------------------------------------


class _Pyinstrument:
    """pyinstrument's sampling profiler with cProfile's enable/disable."""

    def __init__(self) -> None:
        from pyinstrument import Profiler

        self.profiler = Profiler(interval=0.0002)

    def enable(self) -> None:
        self.profiler.start()

    def disable(self) -> None:
        self.profiler.stop()


def profile(n: int, step_ms: float, steps: int, tool: str = "cprofile") -> dict[str, Any]:
    """The engine loop (overlap on) under a profiler: cProfile (each
    function's own and cumulative time per step, the device's share, the
    host asleep on a step and the stand-in making its tokens, left out;
    its overhead inflates Python-heavy code about twofold) or pyinstrument
    (sampling, little overhead: the call tree as text)."""
    import cProfile
    import pstats

    prof: Any = cProfile.Profile() if tool == "cprofile" else _Pyinstrument()
    cell = engine_cell(n, step_ms, True, warm_steps=60, measure_steps=steps, profile=prof)
    if tool != "cprofile":
        text = prof.profiler.output_text(unicode=False, color=False, show_all=False)
        return {"cell": cell, "tool": "pyinstrument", "tree": text}
    st = pstats.Stats(prof)
    rows = []
    total = device = 0.0
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        name = f"{Path(file).name}:{line}({func})" if line else func
        total += tt
        if Path(file).name == "simulated.py" and func == "wait":
            # The stand-in device: the host asleep until a step's end, and the
            # step's tokens made (the device's work), not the host's.
            device += ct
            continue
        rows.append({"function": name, "calls_per_step": round(nc / steps, 2),
                     "own_ms_per_step": round(1000 * tt / steps, 4),
                     "cum_ms_per_step": round(1000 * ct / steps, 4)})  # fmt: skip
    rows = [r for r in rows if "sleep" not in r["function"]]
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return {"cell": cell, "tool": "cprofile",
            "profiled_host_ms_per_step": round(1000 * (total - device) / steps, 3),
            "top_own": rows[:40],
            "top_cumulative": sorted(rows, key=lambda r: -r["cum_ms_per_step"])[:40]}  # fmt: skip


# -- main ------------------------------------------------------------------------------------


def table(cells: list[dict[str, Any]]) -> str:
    head = (f"{'part':9} {'seqs':>5} {'step':>5} {'overlap':>7} {'idle':>7} {'host ms':>8} "
            f"{'dev ms':>7} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>8}")  # fmt: skip
    lines = [head]
    for c in cells:
        itl = (f"{c['itl_p50_x']:>7.2f}x {c['itl_p99_x']:>7.2f}x {c['client_tokens_per_s']:>8.0f}"
               if c["part"] == "serve" else f"{'':>8} {'':>8} {'':>8}")  # fmt: skip
        part = c["part"] + ("" if c.get("engine_process", True) else "/1p")
        lines.append(f"{part:9} {c['seqs']:>5} {c['step_ms']:>5g} "
                     f"{'on' if c['overlap'] else 'off':>7} {c['device_idle']:>7.1%} "
                     f"{c['host_ms_per_step']:>8.2f} {c['device_step_ms']:>7.2f} "
                     f"{itl}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="64 sequences, 2 and 10 ms: ~1 minute")
    ap.add_argument("--seqs", default="64,256,1024", help="running sequences (comma-separated)")
    ap.add_argument("--step-ms", default="2,10,20", help="device steps (ms, comma-separated)")
    ap.add_argument("--parts", default="engine,serve", help="engine, serve or engine,serve")
    ap.add_argument("--overlap", default="on,off", help="on, off or on,off (both)")
    ap.add_argument("--engine-process", default="on",
                    help="serve: the engine in its own process (on), on a thread of the "
                    "server's (off), or on,off (both; default on)")  # fmt: skip
    ap.add_argument("--measure-steps", type=int, help="engine: steps measured (default 300)")
    ap.add_argument("--warm-s", type=float, help="serve: seconds before the window (default 4)")
    ap.add_argument("--measure-s", type=float, help="serve: the window (seconds; default 6)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--per-row", action="store_true",
                    help="engine: read each step's outputs as a RequestOutput per row "
                    "(default: as columns, StepOutputs)")  # fmt: skip
    ap.add_argument("--profile", metavar="N:MS", help="profile the engine loop instead")
    ap.add_argument("--profile-steps", type=int, default=300)
    ap.add_argument("--profiler", choices=["cprofile", "pyinstrument"], default="cprofile")
    # The client process of a serve cell (internal).
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--clients", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.client:
        got = asyncio.run(clients(args.client, args.clients, args.warm_s, args.measure_s))
        print(json.dumps(got))
        return 0
    if args.profile:
        n, ms = args.profile.split(":")
        out = profile(int(n), float(ms), args.profile_steps, args.profiler)
        print(out["tree"] if "tree" in out else json.dumps(out, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        return 0
    if args.small:
        seqs, steps = [64], [2.0, 10.0]
        measure_steps, warm_s, measure_s = args.measure_steps or 150, 2.0, 3.0
    else:
        seqs = [int(x) for x in args.seqs.split(",")]
        steps = [float(x) for x in args.step_ms.split(",")]
        measure_steps = args.measure_steps or 300
        warm_s, measure_s = 4.0, 6.0
    warm_s = args.warm_s if args.warm_s is not None else warm_s
    measure_s = args.measure_s if args.measure_s is not None else measure_s
    names = args.overlap.replace("both", "on,off").split(",")
    if not set(names) <= {"on", "off"}:
        ap.error(f"--overlap: on, off or on,off, not {args.overlap!r}")
    overlaps = [o == "on" for o in names]
    splits_named = args.engine_process.split(",")
    if not set(splits_named) <= {"on", "off"}:
        ap.error(f"--engine-process: on, off or on,off, not {args.engine_process!r}")
    splits = [x == "on" for x in splits_named]
    parts = args.parts.split(",")
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg(), "small": args.small,
            "measure_steps": measure_steps, "warm_s": warm_s, "measure_s": measure_s}  # fmt: skip
    cells = []
    for part in parts:
        for n in seqs:
            for ms in steps:
                for ov in overlaps:
                    for split in splits if part == "serve" else [True]:
                        load = os.getloadavg()[0]
                        if part == "engine":
                            warm = max(40, 3 * -(-n * 40 // (n + 512)))
                            cell = engine_cell(n, ms, ov, warm_steps=warm,
                                               measure_steps=measure_steps,
                                               per_row=args.per_row)  # fmt: skip
                        else:
                            cell = serve_cell(n, ms, ov, warm_s=warm_s, measure_s=measure_s,
                                              split=split)  # fmt: skip
                        cell["loadavg_1m"] = round(load, 2)
                        cells.append(cell)
                        print(table([cell]).splitlines()[1], file=sys.stderr, flush=True)
    meta["loadavg_after"] = os.getloadavg()
    out = {"meta": meta, "cells": cells}
    print(table(cells), file=sys.stderr)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
