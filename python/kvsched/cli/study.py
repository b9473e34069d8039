"""`kvsched sweep` and `kvsched mix`: one knob against goodput with its knee,
and two tenants together against apart."""

from __future__ import annotations

import argparse
import math
from typing import Any

from kvsched.cli.common import engine_options


def _workload_engine(args: argparse.Namespace, step_budget: int):
    """The workload and engine a sweep or mix names on its command line, built
    as `kvsched simulate` builds them (sim/setup.py)."""
    from kvsched.sim import setup

    load = setup.DEFAULT_LOAD.get(args.trace, 1.0) if args.load is None else args.load
    arrivals, tenants = setup.named_workload(args.trace, load=load, time_scale=args.time_scale,
                                             limit=args.limit, path=args.trace_path)  # fmt: skip
    engine = setup.engine_for(arrivals, model=args.model, accelerator=args.accelerator,
                              devices=args.devices, context=args.context,
                              max_num_seqs=args.max_num_seqs, step_budget=step_budget,
                              chunk=args.chunk)  # fmt: skip
    return load, arrivals, tenants, engine


def _slos(given: list[str] | None, default: tuple[str, ...]):
    """The SLOs of --slo, else `default`; and how to say which."""
    from kvsched.sim.slo import parse_slos

    specs = given or list(default)
    slos = parse_slos(specs)
    said = " ".join(specs) + ("" if given else " (the default for this workload; --slo to change)")
    return slos, said


def cmd_sweep(args: argparse.Namespace) -> int:
    """One knob swept at a stated load: a table, the knee of every curve, PNGs."""
    from kvsched.sim import setup, sweeps

    if args.trace is None:
        args.trace = "azure" if args.knob == "reserve" else "prefill-vs-decode"
    values = sweeps.DEFAULT_VALUES[args.knob]
    if args.values:
        values = tuple(_knob_value(args.knob, v) for v in args.values.split(",") if v.strip())
    step_budget = args.max_batched_tokens
    if step_budget is None:
        step_budget = setup.DEFAULT_STEP_BUDGET.get(args.trace, setup.STEP_BUDGET)
        if args.knob == "chunk":  # its largest chunk must fit a step, or it sweeps the budget
            step_budget = setup.STEP_BUDGET
    slos, said = _slos(args.slo, sweeps.DEFAULT_SLOS.get(args.trace, ("*:ttft=5,itl=0.5",)))
    load, arrivals, tenants, engine = _workload_engine(args, step_budget)
    base = engine.config
    print(f"{args.knob} sweep: {len(arrivals)} requests ({args.trace}) at load {load:g}x on "
          f"{args.devices} x {args.accelerator} serving {args.model}: {base.num_blocks - 1:,} "
          f"KV blocks of {base.block_size}, step budget {base.max_batched_tokens:,} tokens"
          + (f", prefill chunk {base.long_prefill_chunk:,}" if args.knob == "reserve" else "")
          )  # fmt: skip
    if args.knob == "reserve":
        print("  overhead_reserve: share of the pool kept out of admission, on top of the "
              "capacity model's 10% of HBM held back")  # fmt: skip
    else:
        print("  long_prefill_chunk: most prompt tokens one sequence gets per step (several "
              "sequences may prefill in one step); unchunked also raises the step budget to "
              f"{base.max_seq_len:,}")  # fmt: skip
    print(f"  SLO: {said}")
    sw = sweeps.sweep(base, tenants, arrivals, engine.cost, args.knob, values, slos=slos,
                      load=load)  # fmt: skip
    print(sweeps.table(sw))
    print(f"knees (the point farthest from the chord of the curve normalised to the unit "
          f"square; none when every point is within {sweeps.MIN_DISTANCE:g} of the chord, or "
          f"the curve spans under {sweeps.MIN_RANGE:.0%} of its largest value):")  # fmt: skip
    for line in sweeps.knee_lines(sw):
        print(line)
    if args.plots:
        print(f"wrote {sweeps.plot(sw, args.plots)}")
    return 0


def _knob_value(knob: str, text: str) -> float | None:
    text = text.strip()
    if knob == "chunk":
        if text == "unchunked":
            return None
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"--values: {text!r} is not a whole number of tokens or "
                             "'unchunked'") from None  # fmt: skip
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--values: {text!r} is not a share (0..1)") from None


def cmd_mix(args: argparse.Namespace) -> int:
    """A prefill-heavy and a decode-heavy tenant together on one machine, against
    each alone on half of it and against time slices of the whole."""
    from kvsched.sim import mix
    from kvsched.sim.slo import check_tenants

    workload = mix.MixWorkload(seconds=args.seconds, docs_rate=args.docs_rate,
                               chat_rate=args.chat_rate, chat_output=args.chat_output,
                               seed=args.seed)  # fmt: skip
    try:
        loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--loads {args.loads!r}: expected numbers like 0.5,1,2") from None
    if not loads or not all(0 < x < math.inf for x in loads):  # NaN too
        raise ValueError(f"--loads {args.loads!r}: every load must be finite and > 0")
    which = [w.strip() for w in args.arrangements.split(",") if w.strip()]
    which = mix.check_machine(args.devices, args.window, which)  # before the header
    if not (0 < args.attainment <= 1):  # NaN too
        raise ValueError(f"--attainment must be a fraction in (0, 1], got {args.attainment!r}")
    slos, said = _slos(args.slo, mix.DEFAULT_SLOS)
    check_tenants(slos, [t.name for t in workload.tenants()])
    print(f"mix: {workload.describe()}; both tenants tier 0")
    half = f"{args.devices // 2} x {args.accelerator}"
    print(f"  together: {args.devices} x {args.accelerator} serving {args.model}, one engine "
          "(tensor parallel: its all-reduces are charged in every step)")  # fmt: skip
    fewer = "no all-reduces" if args.devices == 2 else "fewer all-reduces"
    print(f"  replicas: two engines of {half}, each serving both (mixing on half the "
          f"devices per engine: {fewer})")  # fmt: skip
    print(f"  apart:    {half} per tenant (half the devices: two engines, each its own "
          "weights, pool and steps)")  # fmt: skip
    print(f"  sliced:   the whole machine alternating in {args.window:g} s windows (free "
          "switches, whole pool each: optimistic)")  # fmt: skip
    print(f"  per device: {args.max_num_seqs} sequences, a {args.max_batched_tokens:,}-token "
          f"step budget; prefill chunk {args.chunk:,}")  # fmt: skip
    print(f"  SLO: {said}; attainment target {args.attainment:.0%}")
    sc = mix.scan(workload, loads, slos, target=args.attainment, model=args.model,
                  accelerator=args.accelerator, devices=args.devices, window=args.window,
                  max_num_seqs=args.max_num_seqs, step_budget=args.max_batched_tokens,
                  chunk=args.chunk, which=which)  # fmt: skip
    for load in sc.loads:
        print(mix.table(sc.runs[load], load))
    print("met: share of offered requests within the SLO (refusals are misses); tokens/s: "
          "prompt + output of served requests per second of the run; ITL99 over requests' "
          "mean time per token; maxgap: the longest pause any served request saw")  # fmt: skip
    for line in mix.summary(sc):
        print(line)
    return 0


def add_parsers(sub: Any) -> None:
    """The `sweep` and `mix` sub-commands."""
    from kvsched.sim.mix import DEFAULT_LOADS as MIX_LOADS
    from kvsched.sim.setup import DEFAULT_LOAD

    w = sub.add_parser("sweep", help="one knob swept at a stated load: table, knees, curves")
    w.add_argument("knob", choices=["reserve", "chunk"],
                   help="reserve: overhead_reserve (share of the pool kept out of admission); "
                   "chunk: long_prefill_chunk (tokens)")  # fmt: skip
    w.add_argument("--values",
                   help="comma-separated knob values (default: reserve 0,0.05,...,0.3; chunk "
                   "128,256,...,8192,unchunked)")  # fmt: skip
    w.add_argument(
        "--trace",
        choices=["azure", "mooncake", "prefill-vs-decode", "burst"],
        help="workload (default: azure for reserve, prefill-vs-decode for chunk)",
    )
    w.add_argument(
        "--trace-path", help="the trace file for azure or mooncake (default: the bundled copy)"
    )
    w.add_argument("--limit", type=int,
                   help="replay the first N requests of the trace (default: all)")  # fmt: skip
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies arrival times (x; default 1)")  # fmt: skip
    w.add_argument("--load", type=float, default=None,
                   help="arrival-rate multiplier (x); default "
                   f"{DEFAULT_LOAD['azure']:g} for azure, 1 otherwise")  # fmt: skip
    w.add_argument("--slo", action="append",
                   help="TENANT:ttft=SECONDS,itl=SECONDS,gap=SECONDS, repeatable, * for every "
                   "tenant (default per workload, printed)")  # fmt: skip
    engine_options(w, budget_help="step budget in tokens (default: 8192 for the chunk "
                    "sweep, so every chunk fits a step; the workload's, as simulate, for "
                    "reserve)", chunk_help="long-prefill chunk of the reserve sweep, tokens "
                    "(default 2048)")  # fmt: skip
    w.add_argument("--plots", help="write <knob>_sweep.png to this folder")
    w.set_defaults(func=cmd_sweep)

    x = sub.add_parser("mix", help="a prefill-heavy and a decode-heavy tenant: together, "
                       "on two mixed replicas, apart, or time-sliced")  # fmt: skip
    x.add_argument("--loads", default=",".join(f"{v:g}" for v in MIX_LOADS),
                   help="comma-separated arrival-rate multipliers, scanned in order (x; "
                   f"default {','.join(f'{v:g}' for v in MIX_LOADS)})")  # fmt: skip
    x.add_argument("--seconds", type=float, default=60.0,
                   help="arrivals over this many seconds (default 60)")  # fmt: skip
    x.add_argument(
        "--docs-rate",
        type=float,
        default=0.5,
        help="docs (30,000-token prompts, 16 out) requests/s at load 1 (default 0.5)",
    )
    x.add_argument("--chat-rate", type=float, default=6.0,
                   help="chat (200-token prompts) requests/s at load 1 (default 6)")  # fmt: skip
    x.add_argument("--chat-output", type=int, default=1000,
                   help="chat's answer length, tokens (default 1000)")  # fmt: skip
    x.add_argument("--seed", type=int, default=0, help="arrival seed (default 0)")
    x.add_argument(
        "--arrangements",
        default="together,replicas,apart,sliced",
        help="comma-separated: together, replicas, apart, sliced (default all four)",
    )
    x.add_argument("--window", type=float, default=1.0,
                   help="time slice of each tenant when sliced, seconds (default 1)")  # fmt: skip
    x.add_argument("--slo", action="append",
                   help="TENANT:ttft=SECONDS,itl=SECONDS,gap=SECONDS, repeatable (default "
                   "chat:ttft=1,itl=0.1,gap=0.2 and docs:ttft=10)")  # fmt: skip
    x.add_argument("--attainment", type=float, default=0.95,
                   help="share of each tenant's requests that must meet its SLO (0..1; "
                   "default 0.95)")  # fmt: skip
    engine_options(x, devices=2, devices_help="accelerators of the whole machine, even: "
                    "half each apart (count; default 2)", context=False,
                    seqs_help="sequences running at once, per device (count; default 128)",
                    budget=2048, budget_help="step budget per device, tokens (default 2048)",
                    chunk_help="long-prefill chunk, tokens (default 2048)")  # fmt: skip
    x.set_defaults(func=cmd_mix)
