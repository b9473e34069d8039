"""Client-side benchmark of `kvsched serve`: a trace's request lengths, time-scaled,
through the official openai async client, three tenants on three tiers.

    python benches/serve_bench.py [--model smollm2|tiny] [--requests 24] [--rate 0.5]
                                  [--max-prompt 192] [--max-output 48] [--url URL]

Starts a server on a free localhost port (or uses --url with the keys below),
replays the bundled Azure code-trace excerpt's prompt and output lengths (capped
to what a CPU serves in a minute; prompts are random token ids of that length,
sent as a token-id prompt to /v1/completions, streamed), at `--rate` requests/s
with the trace's own spacing scaled to that mean. Requests go to tenants gold /
silver / bronze (tiers 0 / 1 / 2) in turn. Reports per tenant: requests, ended
with a finish reason, HTTP errors by status, client-side TTFT and inter-token
p50/p99, and goodput (requests/s that met the SLO: TTFT <= --slo-ttft and p99
inter-token <= --slo-itl); and from the server's /metrics the share of engine
step time spent outside the model (scheduling, detokenization, Python): the
server's own overhead, which should stay under 5% of step time.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import numpy as np

TRACE = Path(__file__).resolve().parent.parent / "tests" / "data" / "azure_code_head400.csv"
TENANTS = [("gold", 0, "sk-bench-gold"), ("silver", 1, "sk-bench-silver"),
           ("bronze", 2, "sk-bench-bronze")]  # fmt: skip


def trace(n: int, rate: float, max_prompt: int, max_output: int) -> list[tuple[float, int, int]]:
    """(arrival offset s, prompt tokens, output tokens) for the first n requests."""
    rows = []
    with open(TRACE, newline="") as f:
        for r in csv.DictReader(f):
            stamp = r["TIMESTAMP"].strip()
            head, _, frac = stamp.partition(".")
            t = datetime.fromisoformat(f"{head}.{frac[:6]}" if frac else head).timestamp()
            rows.append((t, int(r["ContextTokens"]), int(r["GeneratedTokens"])))
            if len(rows) == n:
                break
    t0 = rows[0][0]
    span = max(rows[-1][0] - t0, 1e-9)
    scale = (len(rows) / rate) / span  # the trace's spacing, stretched to the mean rate
    return [((t - t0) * scale, max(1, min(p, max_prompt)), max(1, min(g, max_output)))
            for t, p, g in rows]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, workdir: str,
                 engine_process: bool = True) -> subprocess.Popen:  # fmt: skip
    toml = Path(workdir) / "tenants.toml"
    toml.write_text("".join(
        f'[[tenant]]\nname = "{n}"\napi_key = "{k}"\ntier = {t}\n\n' for n, t, k in TENANTS
    ))  # fmt: skip
    # Rows of 256 tokens: the reference attention reads every row's pages up to
    # max_seq_len, so a CPU serves these short requests fastest with short rows.
    cmd = [sys.executable, "-m", "kvsched", "serve", "--model", model, "--tenants", str(toml),
           "--host", "127.0.0.1", "--port", str(port), "--max-seq-len", "256",
           "--max-batched-tokens", "128",
           "--engine-process" if engine_process else "--no-engine-process"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become ready in 300 s")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvsched_engine_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def one(client_for, tenant: str, key: str, offset: float, plen: int, olen: int,
              start: float, rng: np.random.Generator, model: str) -> dict:  # fmt: skip
    import openai

    await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
    prompt = rng.integers(100, 500, plen).tolist()  # ids every served model has
    rec = {"tenant": tenant, "sent": time.monotonic(), "chunks": [], "finish": None,
           "status": None}  # fmt: skip
    try:
        stream = await client_for(key).completions.create(
            model=model, prompt=prompt, max_tokens=olen, stream=True, temperature=0.0,
        )  # fmt: skip
        async for chunk in stream:
            now = time.monotonic()
            if chunk.choices and (chunk.choices[0].text or chunk.choices[0].finish_reason):
                if chunk.choices[0].text:
                    rec["chunks"].append(now)
                if chunk.choices[0].finish_reason:
                    rec["finish"] = chunk.choices[0].finish_reason
    except openai.APIStatusError as e:
        rec["status"] = e.status_code
    except openai.APIError as e:  # connection trouble: counted, never silent
        rec["status"] = f"error: {type(e).__name__}"
    return rec


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--url", help="an already running server (with the bench tenants' keys)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=0.5, help="mean arrivals per second")
    ap.add_argument("--max-prompt", type=int, default=192)
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-itl", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the server's engine in its own process (default; as kvsched serve)",
    )
    args = ap.parse_args(argv)
    import openai

    workdir = tempfile.mkdtemp(prefix="kvsched-bench-")
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        proc = start_server(args.model, port, workdir, args.engine_process)
        url = f"http://127.0.0.1:{port}"
    model = json.load(_models(url, TENANTS[0][2]))["data"][0]["id"]
    clients: dict[str, openai.AsyncOpenAI] = {}

    def client_for(key: str) -> openai.AsyncOpenAI:
        if key not in clients:
            clients[key] = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                                              timeout=300)  # fmt: skip
        return clients[key]

    reqs = trace(args.requests, args.rate, args.max_prompt, args.max_output)
    rng = np.random.default_rng(args.seed)
    try:
        before = scrape(url)

        async def run() -> list[dict]:
            start = time.monotonic() + 0.2
            tasks = [one(client_for, TENANTS[i % 3][0], TENANTS[i % 3][2], off, p, o, start,
                         np.random.default_rng(rng.integers(1 << 31)), model)
                     for i, (off, p, o) in enumerate(reqs)]  # fmt: skip
            try:
                return await asyncio.gather(*tasks)
            finally:  # on this loop: their finalizers would try a closed one
                for c in clients.values():
                    await c.close()

        t0 = time.monotonic()
        records = asyncio.run(run())
        wall = time.monotonic() - t0
        after = scrape(url)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    step_s = (
        after["kvsched_engine_step_seconds_total"] - before["kvsched_engine_step_seconds_total"]
    )
    model_s = (after["kvsched_engine_model_seconds_total"]
               - before["kvsched_engine_model_seconds_total"])  # fmt: skip
    table = {}
    for name, tier, _key in TENANTS:
        mine = [r for r in records if r["tenant"] == name]
        ttft = [r["chunks"][0] - r["sent"] for r in mine if r["chunks"]]
        itl = [b - a for r in mine for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)]
        good = [r for r in mine if r["finish"] and r["chunks"]
                and r["chunks"][0] - r["sent"] <= args.slo_ttft
                and pct(np.diff(r["chunks"]).tolist() or [0.0], 99) <= args.slo_itl]  # fmt: skip
        errors: dict[str, int] = {}
        for r in mine:
            if r["status"] is not None:
                errors[str(r["status"])] = errors.get(str(r["status"]), 0) + 1
        table[name] = {
            "tier": tier, "requests": len(mine), "finished": sum(1 for r in mine if r["finish"]),
            "errors": errors, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "goodput": len(good) / wall,
        }  # fmt: skip
    outside = 1.0 - model_s / step_s if step_s > 0 else float("nan")
    print(f"{len(records)} requests at {args.rate}/s ({args.model}), {wall:.1f} s wall")
    print(f"{'tenant':<8}{'tier':>5}{'ended':>7}  {'TTFT p50/p99 (s)':>17}  "
          f"{'ITL p50/p99 (ms)':>17}{'goodput/s':>10}  errors")  # fmt: skip
    for name, row in table.items():
        print(f"{name:<8}{row['tier']:>5}{row['finished']:>4}/{row['requests']:<3}"
              f"{row['ttft_p50']:>8.2f}/{row['ttft_p99']:<8.2f}  "
              f"{row['itl_p50'] * 1e3:>8.0f}/{row['itl_p99'] * 1e3:<8.0f}"
              f"{row['goodput']:>10.2f}  {row['errors'] or '-'}")  # fmt: skip
    print(
        f"engine steps: {step_s:.1f} s, of which model {model_s:.1f} s: "
        f"{outside:.1%} of step time outside the model"
    )
    ended = sum(1 for r in records if r["finish"] or r["status"] is not None)
    result = {"tenants": table, "wall_s": wall, "step_s": step_s, "model_s": model_s,
              "outside_model_share": outside, "records": len(records), "ended": ended}  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "tenants"}))
    return result


def _models(url: str, key: str):
    req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    return urllib.request.urlopen(req, timeout=10)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(sys.argv[1:])
