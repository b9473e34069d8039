"""The simulator's speed, side by side with other builds of kvsched (e.g. main
before a change), in one run, and proof that they give the same results.

    python benches/sim_speed.py                                  # this checkout only
    python benches/sim_speed.py --build main=/path/to/main/python
    python benches/sim_speed.py --trace-path AzureLLMInferenceTrace_conv.csv --load 1

A build is a directory that holds a `kvsched` package with its compiled `_core`
(a checkout's `python/` after a release build). Each repeat runs every build
once, in a fresh subprocess per build, the builds alternating; a subprocess
replays the workload through each scenario of `kvsched simulate` (the 8
standard ones unless --scenarios), timing each with time.process_time (CPU
seconds, not wall: the machine is shared), and hashes what each produced: the
records (outcome, arrival, first/last token, finished, output_len, max_tokens,
max_gap), the inter-token gaps per tenant, the timeline, the scheduler's final
stats, the step count and virtual time. Every build must give every scenario
the same hashes, or the run fails naming what differs. The table shows the
median CPU seconds per scenario over repeats, and each other build's median
over this one's (the speed-up of this checkout).

`--cli` also times the whole `kvsched simulate` command (workload set-up, every
scenario, the table) per build, as the CPU seconds of a child process.

The workload is `kvsched simulate --trace azure`'s: the bundled Azure code trace
(8,819 requests) unless --trace-path names another file in its format, such as
the Azure conversation trace (AzurePublicDataset, AzureLLMInferenceTrace_conv.csv,
19,366 requests), at --load x its arrival rate (default: the command's, 2x).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

FIELDS = ("records", "gaps", "timeline", "stats", "steps")


def _digest(value: object) -> str:
    # repr of floats round-trips exactly, and dicts keep their insertion order,
    # so equal hashes mean equal values in the same order.
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def worker(trace_path: str, load: float, wanted: str) -> dict:
    from kvsched.sim import scenarios, setup
    from kvsched.sim.simulator import simulate

    arrivals, tenants = setup.named_workload("azure", load=load, path=trace_path or None)
    engine = setup.engine_for(arrivals)
    out: dict[str, dict] = {"requests": len(arrivals), "scenarios": {}}
    for sc in scenarios.standard(engine.config):
        if wanted != "standard" and sc.name not in wanted.split(","):
            continue
        cfg = engine.config.replace(**sc.overrides)
        t0 = time.process_time()
        r = simulate(cfg, tenants, arrivals, engine.cost, name=sc.name,
                     static_batching=sc.static_batching)  # fmt: skip
        cpu = time.process_time() - t0
        got = {
            "records": [dataclasses.astuple(x) for x in r.records],
            "gaps": list(r.gaps.items()),
            "timeline": list(r.timeline.items()),
            "stats": r.stats,
            "steps": (r.steps, r.step_errors, r.virtual_s),
        }
        out["scenarios"][sc.name] = {
            "cpu_s": cpu,
            "steps": r.steps,
            "tokens": sum(x.output_len for x in r.records),
            "digest": {k: _digest(got[k]) for k in FIELDS},
        }
    return out


def _env(build: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if build is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(build), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    # numpy's OpenBLAS otherwise keeps a thread spinning on the other core.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def run_worker(build: Path | None, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", *args],
        env=_env(build), capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"worker {args} in {build} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_cli(build: Path | None, trace_path: str, load: float | None) -> float:
    """CPU seconds (user + system) of one `kvsched simulate --trace azure` run."""
    cmd = [sys.executable, "-m", "kvsched", "simulate", "--trace", "azure"]
    if trace_path:
        cmd += ["--trace-path", trace_path]
    if load is not None:
        cmd += ["--load", str(load)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, env=_env(build), capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"kvsched simulate in {build} failed:\n{done.stderr[-3000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        trace_path, load, wanted = sys.argv[2:5]
        print(json.dumps(worker(trace_path, float(load), wanted)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--trace-path", default="", help="an Azure-format CSV (default: bundled)")
    ap.add_argument("--load", type=float, default=None,
                    help="arrival-rate multiplier (default: kvsched simulate's)")  # fmt: skip
    ap.add_argument("--scenarios", default="standard", help="comma-separated, or standard")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cli", action="store_true", help="also time the whole command")
    args = ap.parse_args()
    from kvsched.sim import setup  # this checkout's default load

    load = setup.DEFAULT_LOAD["azure"] if args.load is None else args.load
    builds: list[tuple[str, Path | None]] = [("this", None)]
    for spec in args.build:
        name, _, path = spec.partition("=")
        builds.append((name, Path(path).resolve()))
    names = [n for n, _ in builds]

    runs: dict[str, list[dict]] = {n: [] for n in names}
    cli: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name, path in builds:
            runs[name].append(run_worker(path, args.trace_path, str(load), args.scenarios))
            if args.cli:
                cli[name].append(run_cli(path, args.trace_path, load))

    # Same results: every repeat of every build, against this build's first.
    ref = runs[names[0]][0]["scenarios"]
    differ = []
    for name in names:
        for rep in runs[name]:
            for sc, got in rep["scenarios"].items():
                bad = [k for k in FIELDS if got["digest"][k] != ref[sc]["digest"][k]]
                if bad:
                    differ.append(f"{name} {sc}: {', '.join(bad)} differ")
    requests = runs[names[0]][0]["requests"]
    print(f"{requests:,} requests ({args.trace_path or 'bundled azure'}), load {load:g}x, "
          f"{args.repeats} repeats; median CPU seconds per scenario")  # fmt: skip
    cols = names + [f"{n} / {names[0]}" for n in names[1:]]
    print("| scenario | steps | tokens | " + " | ".join(cols) + " |")
    print("|---|---:|---:|" + "---:|" * len(cols))
    totals = {n: 0.0 for n in names}
    for sc, first in ref.items():
        med = {n: statistics.median(r["scenarios"][sc]["cpu_s"] for r in runs[n]) for n in names}
        for n in names:
            totals[n] += med[n]
        cells = [f"{med[n]:.2f}" for n in names] + [
            f"{med[n] / med[names[0]]:.2f}x" for n in names[1:]
        ]
        print(f"| {sc} | {first['steps']:,} | {first['tokens']:,} | " + " | ".join(cells) + " |")
    cells = [f"{totals[n]:.2f}" for n in names] + [
        f"{totals[n] / totals[names[0]]:.2f}x" for n in names[1:]
    ]
    print("| (sum) | | | " + " | ".join(cells) + " |")
    if args.cli:
        med = {n: statistics.median(cli[n]) for n in names}
        cells = [f"{med[n]:.2f}" for n in names] + [
            f"{med[n] / med[names[0]]:.2f}x" for n in names[1:]
        ]
        print("| kvsched simulate (whole command) | | | " + " | ".join(cells) + " |")
    if differ:
        raise SystemExit("results differ:\n" + "\n".join(differ))
    print(f"results identical across builds and repeats: {', '.join(FIELDS)}")


if __name__ == "__main__":
    main()
