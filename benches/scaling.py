"""How the scheduler's costs grow with the running set, side by side with other
builds of kvsched (e.g. main before a change) and with the pure-Python planner,
in one run.

    python benches/scaling.py                                 # this checkout only
    python benches/scaling.py --build before=/path/to/python  # plus another build

A build is a directory that holds a `kvsched` package with its compiled `_core`
(a checkout's `python/` after a release build). Each measurement runs in a fresh
subprocess per build, the builds alternating, `--repeats` times; the table shows
the median over repeats of each subprocess's median. Measured:

- step + commit with N sequences decoding and 4 prompts in chunked prefill (the
  workload of bench_planner.py), N in --sizes, prefix cache on and off, and the
  cost per decoding sequence; the Python planner (py_planner.py) at the same N;
- submit + cancel of a 2048-token prompt whose first 1024 tokens are cached
  (bench_prefix.py's workload), also with the vocabulary declared, with a fresh
  rest after the cached prefix each time, and with nothing cached or shared;
- the heap the scheduler holds per token for 4,096 running sequences of ~2k tokens
  (bytes in use after, less before: glibc's mallinfo2, plus the extension's own
  count of its Rust heap where that is mimalloc), two ways: "held", what
  running them adds to a scheduler already built (the pool's per-page arrays, the
  prefix index and the plan buffers are allocated at construction, sized by
  num_blocks and the config's maxima rather than by what runs), and "all", with
  the scheduler's construction counted too (its pool sized for just these
  sequences, so nothing is counted that they do not need).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


# ----------------------------------------------------------------------------
# Workers: each runs in its own process with PYTHONPATH set to one build.


def _time_calls(fn, rounds: int) -> float:
    """Median seconds of one call to fn over `rounds` calls."""
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) * 1e-9


def work_step(kind: str, n: int) -> dict:
    from bench_planner import warmed

    d = warmed(kind, n)
    rounds = 300 if n <= 1024 else 120
    if kind == "python":
        rounds = max(20, rounds // (n // 64 or 1))
    for _ in range(10):
        d.round()
    median = _time_calls(d.round, rounds)
    assert d.round() == n, "still all decoding"
    return {"seconds": median}


def work_prefix(kind: str) -> dict:
    import bench_prefix

    # kind[:varied | :unshared]: the same prompt each time (the benchmark), a
    # fresh rest after the cached prefix each time, or nothing shared at all.
    kind, _, how = kind.partition(":")
    sched = bench_prefix.make(kind)
    if how:
        prompts = bench_prefix.varied(100, shared=how == "varied")
    else:
        prompts = [bench_prefix.prompt_pair()[1]] * 100

    def once() -> None:
        for p in prompts:
            sched.cancel(sched.submit("t", p, 256, now=1.0))

    return {"seconds": _time_calls(once, 200) / 100}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def heap_in_use() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    glibc = int(m.uordblks + m.hblkhd)
    # A build whose Rust heap is its own allocator (mimalloc) counts it itself:
    # glibc sees only Python's and numpy's part then. Older builds have no count
    # and allocate everything through glibc.
    from kvsched import _core

    rust = getattr(_core, "_heap_bytes", None)
    return glibc + (rust() if rust is not None else 0)


def work_memory(kind: str, n: int = 4096, prompt: int = 2000, decode: int = 16) -> dict:
    import numpy as np

    import kvsched

    bs = 16
    max_tokens = 256  # more than the steps that prefill takes: all decode at once
    per_seq = -(-(prompt + max_tokens) // bs)
    empty = heap_in_use()
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(
            num_blocks=n * per_seq + 64,
            block_size=bs,
            max_num_seqs=n,
            max_batched_tokens=65536,
            max_seq_len=4096,
            overhead_reserve=0.0,
            prefix_caching=kind == "kvsched",
        )
    )
    sched.add_tenant(kvsched.TenantConfig("t"))
    rng = np.random.default_rng(0)
    sampled = np.full(65536, 7, np.int32)
    before = heap_in_use()
    for _ in range(n):
        sched.submit("t", rng.integers(0, 32000, prompt, dtype=np.int32), max_tokens, now=0.0)
    tokens = n * prompt
    decoded = 0
    while decoded < decode:
        plan = sched.step(now=0.0)
        events = sched.commit(plan, sampled[: len(plan)], now=0.0)
        tokens += len(events.tokens)
        assert not events.finished
        decoded += plan.num_decode == n
    del plan, events
    after = heap_in_use()
    held = after - before
    stats = sched.stats(now=0.0)
    return {
        "bytes_per_token": held / tokens,
        "all_bytes_per_token": (after - empty) / tokens,
        "tokens": tokens,
        "running": stats["running"],
    }


def worker(args: list[str]) -> None:
    sys.path.insert(0, str(HERE))
    what, kind, *rest = args
    if what == "step":
        out = work_step(kind, int(rest[0]))
    elif what == "prefix":
        out = work_prefix(kind)
    else:
        out = work_memory(kind)
    print(json.dumps(out))


# ----------------------------------------------------------------------------
# The driver.


def run_worker(build: Path | None, *args: str) -> dict:
    env = dict(os.environ)
    if build is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(build), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    env.setdefault("JAX_PLATFORMS", "cpu")
    # numpy's OpenBLAS otherwise keeps a thread spinning on the other core.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"worker {args} in {build} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def us(x: float) -> str:
    return f"{x * 1e6:,.1f} us" if x < 1e-2 else f"{x * 1e3:,.1f} ms"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--sizes", default="64,256,1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-python", action="store_true", help="skip the Python planner")
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args()
    builds: list[tuple[str, Path | None]] = [("this", None)]
    for spec in args.build:
        name, _, path = spec.partition("=")
        builds.append((name, Path(path).resolve()))
    sizes = [int(s) for s in args.sizes.split(",")]

    jobs: list[tuple[str, tuple[str, ...]]] = []
    for n in sizes:
        for kind in ("kvsched", "kvsched_no_prefix_cache"):
            jobs.append((f"step+commit {n} ({'cache on' if kind == 'kvsched' else 'cache off'})",
                         ("step", kind, str(n))))  # fmt: skip
    jobs.append(("prefix admission 2048 (1024 cached)", ("prefix", "kvsched")))
    jobs.append(("  the same, vocab_size 32,000 declared", ("prefix", "kvsched_vocab")))
    jobs.append(("  the cached prefix, a fresh rest each", ("prefix", "kvsched:varied")))
    jobs.append(("  nothing cached, nothing shared", ("prefix", "kvsched_cold:unshared")))
    if not args.no_memory:
        jobs.append(("bytes/token, 4096 x ~2k (cache on)", ("memory", "kvsched")))
        jobs.append(("bytes/token, 4096 x ~2k (cache off)", ("memory", "kvsched_off")))

    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for label, wargs in jobs:
            for name, path in builds:
                results.setdefault((label, name), []).append(run_worker(path, *wargs))
    python: dict[int, float] = {}
    if not args.no_python:
        for n in sizes:
            python[n] = run_worker(None, "step", "python", str(n))["seconds"]

    names = [n for n, _ in builds]
    cols = names + [f"{names[0]} / {n}" for n in names[1:]] + (["python planner"] if python else [])
    print("| measurement | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    rows = []
    for label, wargs in jobs:
        if wargs[0] == "memory":
            what = label.replace("bytes/token", "bytes/token {}")
            rows.append((what.format("held"), label, wargs, "bytes_per_token"))
            rows.append((what.format("all"), label, wargs, "all_bytes_per_token"))
        else:
            rows.append((label, label, wargs, "seconds"))
    for shown, label, wargs, key in rows:
        vals = [statistics.median(r[key] for r in results[(label, n)]) for n in names]
        if key == "seconds":
            cells = [us(v) for v in vals]
            if wargs[0] == "step":
                n = int(wargs[2])
                cells = [f"{us(v)} ({v / n * 1e9:.1f} ns/seq)" for v in vals]
        else:
            cells = [f"{v:.2f} B" for v in vals]
        ratios = [f"{vals[0] / v:.2f}x" for v in vals[1:]]
        if python:
            cold = wargs[0] == "step" and wargs[1] == "kvsched_no_prefix_cache"
            ratios.append(us(python[int(wargs[2])]) if cold else "")
        print(f"| {shown} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
