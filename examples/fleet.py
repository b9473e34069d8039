"""Replicas of `kvsched serve` behind vllm-router, round-robin against KV-aware.

    pip install 'kvsched[fleet]'          # vllm-router, pinned, and the openai client
    python examples/fleet.py                                  # 3 stand-in replicas
    python examples/fleet.py --replicas 2 --conversations 8 --turns 3   # smaller

For each policy (`--policies`, default round_robin then kv_aware) it starts
`--replicas` fresh `kvsched serve` replicas on localhost (the stand-in model by
default, each step charged what a 70B model's step costs on an H200, so a
prompt served from the cache saves prefill time as it would there), each
publishing its KV events (`--kv-events`), and vllm-router in front of them
(kv_aware reads the events, and asks each replica for a request's tokens
through /v1/chat/completions/render). Then the same workload through the
router with the openai client: `--system-prompts` system prompts shared by
`--conversations` conversations of `--turns` turns each, each turn a question
over a passage of `--passage` words (every turn sends the whole conversation
so far, as chat clients do), `--concurrency` conversations at once. It
prints, per policy and per replica, the requests served and the prefix cache's
hit rate (prompt tokens served from the cache over prompt tokens looked up),
and per policy the time to first token (p50, p99) as the clients saw it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEY = "sk-fleet"
MODEL = "simulated"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"{url}: the process exited ({proc.returncode}):\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} was not ready in {timeout:.0f} s")


def scrape(url: str) -> dict[str, float]:
    """A replica's prefix-cache counters and chat requests answered."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"query": 0.0, "hit": 0.0, "requests": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("kvsched_prefix_cache_query_tokens_total"):
            out["query"] += float(value)
        elif name.startswith("kvsched_prefix_cache_hit_tokens_total"):
            out["hit"] += float(value)
        elif name.startswith("kvsched_http_requests_total") and (
            'route="/v1/chat/completions"' in name and 'status="200"' in name
        ):
            out["requests"] += float(value)
    return out


@dataclass
class Fleet:
    """N replicas and the router in front of them, started for one policy."""

    policy: str
    args: argparse.Namespace
    workdir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    router: str = ""

    def start(self) -> None:
        n = self.args.replicas
        ports = free_ports(3 * n + 2)
        tenants = self.workdir / "tenants.toml"
        tenants.write_text(f'[[tenant]]\nname = "fleet"\napi_key = "{KEY}"\n')
        sources: list[str] = []
        for k in range(n):
            http, events, replay = ports[3 * k : 3 * k + 3]
            url = f"http://127.0.0.1:{http}"
            cmd = [sys.executable, "-m", "kvsched", "serve", "--model", self.args.model,
                   "--tenants", str(tenants), "--port", str(http),
                   "--max-seq-len", "8192", "--max-batched-tokens", "512",
                   "--max-num-seqs", "32", "--num-blocks", str(self.args.num_blocks),
                   "--kv-events", str(events), "--kv-events-replay", str(replay),
                   "--log-level", "warning"]  # fmt: skip
            if self.args.model == "simulated":
                cmd += ["--sim-step-cost", self.args.sim_step_cost]
            log = self.workdir / f"{self.policy}-replica{k}.log"
            self.logs.append(log)
            with log.open("wb") as f:
                self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
            self.replicas.append(url)
            sources += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{events}",
                        "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replay}"]  # fmt: skip
        for url, proc, log in zip(self.replicas, self.procs, self.logs, strict=True):
            wait_ready(f"{url}/ready", proc, log)
        router = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
        if not os.path.exists(router):
            raise SystemExit("vllm-router is not installed: pip install 'kvsched[fleet]'")
        port, metrics_port = ports[-2:]
        cmd = [router, "--host", "127.0.0.1", "--port", str(port), "--policy", self.policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
               "--worker-urls", *self.replicas,
               # Readiness, not liveness, decides who gets traffic: a warming
               # or draining replica answers /ready 503.
               "--health-check-endpoint", "/ready", "--health-check-interval-secs", "1",
               "--log-level", "warning"]  # fmt: skip
        if self.policy == "kv_aware":
            cmd += [*sources, "--kv-event-block-size", "16", "--kv-event-model", MODEL]
        log = self.workdir / f"{self.policy}-router.log"
        with log.open("wb") as f:
            self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
        self.router = f"http://127.0.0.1:{port}"
        wait_ready(f"{self.router}/health", self.procs[-1], log)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def system_prompts(n: int, rules: int) -> list[str]:
    """Long system prompts (about 14 tokens a rule), different from the first words."""
    rule = "Rule {k}.{i}: answer in plain words, exactly and briefly."
    return [
        f"You are assistant number {k}. " + " ".join(rule.format(k=k, i=i) for i in range(rules))
        for k in range(n)
    ]


WORDS = ("cache", "replica", "router", "prefix", "token", "block", "tenant", "budget", "step",
         "queue", "latency", "memory", "page", "model", "request", "stream")  # fmt: skip


def question(c: int, turn: int, words: int) -> str:
    """A user turn: a question over a passage of `words` words (each conversation's own)."""
    rng = random.Random(c * 1000 + turn)
    passage = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Conversation {c}, question {turn}. Passage: {passage}. What does it say?"


async def drive(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every conversation's turns through the router; TTFT of each request."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    systems = system_prompts(args.system_prompts, args.system_rules)
    ttfts: list[float] = []
    errors: list[str] = []
    gate = asyncio.Semaphore(args.concurrency)

    async def conversation(c: int) -> None:
        messages: list[Any] = [{"role": "system", "content": systems[c % len(systems)]}]
        async with gate:
            for turn in range(args.turns):
                messages.append({"role": "user", "content": question(c, turn, args.passage)})
                t0 = time.perf_counter()
                first: float | None = None
                text = []
                try:
                    stream = await client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=args.max_tokens,
                        temperature=0, stream=True,
                    )  # fmt: skip
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            if first is None:
                                first = time.perf_counter() - t0
                            text.append(chunk.choices[0].delta.content)
                except Exception as e:  # noqa: BLE001 - counted and shown, the run goes on
                    errors.append(f"{type(e).__name__}: {e}")
                    return
                if first is not None:
                    ttfts.append(first)
                messages.append({"role": "assistant", "content": "".join(text)})

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    await client.close()
    return {"ttfts": ttfts, "errors": errors, "wall_s": time.perf_counter() - t0}


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def run_policy(policy: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    fleet = Fleet(policy, args, workdir)
    try:
        fleet.start()
        before = [scrape(u) for u in fleet.replicas]
        got = asyncio.run(drive(fleet.router, args))
        after = [scrape(u) for u in fleet.replicas]
    finally:
        fleet.stop()
    per = []
    for k, (b, a) in enumerate(zip(before, after, strict=True)):
        query, hit = a["query"] - b["query"], a["hit"] - b["hit"]
        per.append({"replica": k, "requests": int(a["requests"] - b["requests"]),
                    "hit_rate": hit / query if query else 0.0,
                    "prompt_tokens": int(query), "cached_tokens": int(hit)})  # fmt: skip
    query = sum(p["prompt_tokens"] for p in per)
    hit = sum(p["cached_tokens"] for p in per)
    ttfts = got["ttfts"]
    return {
        "policy": policy, "replicas": per, "requests": sum(p["requests"] for p in per),
        "hit_rate": hit / query if query else 0.0,
        "ttft_p50_s": pct(ttfts, 50) if ttfts else None,
        "ttft_p99_s": pct(ttfts, 99) if ttfts else None,
        "errors": got["errors"], "wall_s": round(got["wall_s"], 2),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--policies", default="round_robin,kv_aware")
    ap.add_argument("--model", default="simulated",
                    help="what each replica serves: simulated (default), smollm2, tiny, or a "
                    "GGUF path (as kvsched serve --model)")  # fmt: skip
    ap.add_argument(
        "--sim-step-cost",
        default="llama-3-70b:h200",
        help="the stand-in's step cost (kvsched serve --sim-step-cost)",
    )
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV pages per replica")
    ap.add_argument("--system-prompts", type=int, default=6)
    ap.add_argument(
        "--system-rules",
        type=int,
        default=60,
        help="each system prompt's length in rules (about 14 tokens each)",
    )
    ap.add_argument("--passage", type=int, default=500, help="words of a passage in each user turn")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the policies in turn this many times; the summary shows the "
                    "median over runs (and the range)")  # fmt: skip
    ap.add_argument("--json", metavar="PATH", help="also write every run's results here")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="kvsched-fleet-") as tmp:
        for rep in range(args.repeats):
            for policy in args.policies.split(","):
                print(f"{policy}: {args.replicas} replicas and vllm-router...", flush=True)
                results.append({**run_policy(policy, args, Path(tmp)), "run": rep})
    print(f"\n{'policy':12} {'run':>3} {'replica':>7} {'requests':>8} {'hit rate':>8}")
    for r in results:
        for p in r["replicas"]:
            print(f"{r['policy']:12} {r['run']:>3} {p['replica']:>7} {p['requests']:>8} "
                  f"{p['hit_rate']:>8.1%}")  # fmt: skip
    print(f"\n{'policy':12} {'requests':>8} {'hit rate':>14} {'TTFT p50':>16} {'TTFT p99':>18} "
          f"{'errors':>6}")  # fmt: skip
    for policy in args.policies.split(","):
        runs = [r for r in results if r["policy"] == policy]

        def show(key: str, scale: float, fmt: str, runs: list[dict[str, Any]] = runs) -> str:
            xs = sorted(r[key] * scale for r in runs if r[key] is not None)
            if not xs:
                return "-"
            mid = format(statistics.median(xs), fmt)
            return mid if len(xs) == 1 else f"{mid} ({xs[0]:{fmt}}-{xs[-1]:{fmt}})"

        print(f"{policy:12} {sum(r['requests'] for r in runs):>8} "
              f"{show('hit_rate', 100, '.1f') + '%':>14} {show('ttft_p50_s', 1000, '.0f'):>16} "
              f"{show('ttft_p99_s', 1000, '.0f'):>18} "
              f"{sum(len(r['errors']) for r in runs):>6}")  # fmt: skip
    print("(TTFT in ms; with --repeats, the median over runs and their range)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
