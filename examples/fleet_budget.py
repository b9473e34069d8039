"""A tenant's rate limit across replicas: per replica, against fleet-wide.

    pip install 'kvsched[fleet]'
    python examples/fleet_budget.py                   # 3 replicas, R = 800 tokens/s
    python examples/fleet_budget.py --seconds 10 --replicas 2

For each budget mode (`--budgets`: `replica`, each replica enforcing the
tenants file's rates on its own, as without a [fleet] table; `fleet`, the
same file with a [fleet] table naming the peers, kvsched.serve.fleet_budget)
and each router policy (`--policies`), it starts `--replicas` stand-in
replicas and vllm-router, and drives two tenants through the router with
the openai client, open loop: `capped` (limited to R tokens a second) at 3R,
and `light` (limited to R too) at R/4. Every request asks for the same number
of tokens (a 48-token prompt, `--max-tokens` more), which is what a tenant's
rate charges. It prints each tenant's admitted tokens a second over the
measured window (after `--warm` seconds, so the buckets' initial bursts are
left out) and its refusals. Per replica, the capped tenant gets R from each
replica; fleet-wide, R in all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fleet import free_ports, wait_ready

PROMPT_TOKENS = 48
FLEET_KEY = "fleet-secret-0123456789"


def tenants_toml(rate: float, peers: list[str] | None) -> str:
    text = "".join(
        f'[[tenant]]\nname = "{name}"\napi_key = "sk-{name}"\nrate_tokens_per_s = {rate}\n'
        for name in ("capped", "light")
    )
    if peers is not None:
        text += f'[fleet]\npeers = {json.dumps(peers)}\nkey = "{FLEET_KEY}"\ninterval_s = 0.5\n'
    return text


def start(
    mode: str, policy: str, args: argparse.Namespace, tmp: Path
) -> tuple[list[subprocess.Popen[bytes]], str]:
    """The replicas and the router (its process last), and the router's URL."""
    n = args.replicas
    ports = free_ports(2 * n + 2)
    urls = [f"http://127.0.0.1:{ports[2 * k]}" for k in range(n)]
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    for k in range(n):
        peers = [u for j, u in enumerate(urls) if j != k] if mode == "fleet" else None
        toml = tmp / f"{mode}-{policy}-{k}.toml"
        toml.write_text(tenants_toml(args.rate, peers))
        log = tmp / f"{mode}-{policy}-{k}.log"
        logs.append(log)
        cmd = [sys.executable, "-m", "kvsched", "serve", "--model", "simulated",
               "--tenants", str(toml), "--port", str(ports[2 * k]), "--sim-step-ms", "10",
               "--kv-events", str(ports[2 * k + 1]), "--log-level", "warning"]  # fmt: skip
        with log.open("wb") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
    for url, proc, log in zip(urls, procs, logs, strict=True):
        wait_ready(f"{url}/ready", proc, log)
    router = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    cmd = [router, "--host", "127.0.0.1", "--port", str(ports[-2]), "--policy", policy,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports[-1]),
           "--worker-urls", *urls, "--health-check-endpoint", "/ready",
           "--log-level", "warning"]  # fmt: skip
    if policy == "kv_aware":
        for k, url in enumerate(urls):
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{ports[2 * k + 1]}"]
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", "simulated"]
    log = tmp / f"{mode}-{policy}-router.log"
    with log.open("wb") as f:
        procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
    wait_ready(f"http://127.0.0.1:{ports[-2]}/health", procs[-1], log)
    return procs, f"http://127.0.0.1:{ports[-2]}"


async def drive(url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Both tenants, open loop, for `--seconds`: admitted tokens a second
    and refusals over the window after `--warm`."""
    from openai import AsyncOpenAI, RateLimitError

    cost = PROMPT_TOKENS + args.max_tokens
    rates = {"capped": 3 * args.rate, "light": args.rate / 4}
    got = {t: {"admitted": 0.0, "refused": 0.0, "other": 0.0} for t in rates}
    t0 = time.monotonic()
    tasks: set[asyncio.Task[None]] = set()
    clients = {t: AsyncOpenAI(base_url=f"{url}/v1", api_key=f"sk-{t}", max_retries=0,
                              timeout=60) for t in rates}  # fmt: skip

    async def one(tenant: str, sent: float) -> None:
        prompt = [1000 + i for i in range(PROMPT_TOKENS)]
        try:
            await clients[tenant].completions.create(
                model="simulated", prompt=prompt, max_tokens=args.max_tokens, temperature=0
            )
            outcome = "admitted"
        except RateLimitError:
            outcome = "refused"
        except Exception:  # noqa: BLE001 - counted: the run goes on
            outcome = "other"
        if sent >= args.warm:
            got[tenant][outcome] += cost if outcome == "admitted" else 1

    async def tenant_loop(tenant: str) -> None:
        period = cost / rates[tenant]
        k = 0
        while (now := time.monotonic() - t0) < args.seconds:
            task = asyncio.create_task(one(tenant, now))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            k += 1
            await asyncio.sleep(max(0.0, k * period - (time.monotonic() - t0)))

    await asyncio.gather(*(tenant_loop(t) for t in rates))
    if tasks:
        await asyncio.gather(*tasks)
    for c in clients.values():
        await c.close()
    window = args.seconds - args.warm
    return {t: {"tokens_per_s": g["admitted"] / window, "refused": g["refused"],
                "errors": g["other"]} for t, g in got.items()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--rate", type=float, default=800.0, help="R: each tenant's tokens a second")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warm", type=float, default=4.0, help="seconds left out at the start")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--budgets", default="replica,fleet")
    ap.add_argument("--policies", default="round_robin,kv_aware")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvsched-budget-") as tmp:
        for mode in args.budgets.split(","):
            for policy in args.policies.split(","):
                print(f"{mode} budgets, {policy}: {args.replicas} replicas...", flush=True)
                procs, url = start(mode, policy, args, Path(tmp))
                try:
                    got = asyncio.run(drive(url, args))
                finally:
                    for p in procs:
                        p.terminate()
                    for p in procs:
                        p.wait(timeout=60)
                rows.append({"budgets": mode, "policy": policy, **{
                    f"{t}_{k}": v for t, g in got.items() for k, v in g.items()}})  # fmt: skip
    print(f"\nR = {args.rate:g} tokens/s per tenant; capped driven at 3R, light at R/4; "
          f"window {args.seconds - args.warm:g} s")  # fmt: skip
    print(f"{'budgets':8} {'policy':12} {'capped tok/s':>12} {'x R':>6} {'refused':>8} "
          f"{'light tok/s':>11} {'refused':>8} {'errors':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['budgets']:8} {r['policy']:12} {r['capped_tokens_per_s']:>12.0f} "
              f"{r['capped_tokens_per_s'] / args.rate:>6.2f} {r['capped_refused']:>8.0f} "
              f"{r['light_tokens_per_s']:>11.0f} {r['light_refused']:>8.0f} "
              f"{r['capped_errors'] + r['light_errors']:>6.0f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
