"""`kvsched simulate`: a workload replayed through the real scheduler, its
scenarios, SLO attainment and the highest rate that meets them."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from kvsched.cli.common import check_writable, engine_options, progress


def cmd_simulate(args: argparse.Namespace) -> int:
    from kvsched.sim import scenarios, setup
    from kvsched.sim.slo import ANY, parse_slos

    # --trace azure|mooncake with --trace-path: that trace's own format from the
    # file; --trace-path alone: a generic trace (CSV or JSON lines).
    trace = args.trace or ("file" if args.trace_path else "azure")
    generic = trace == "file"
    if args.trace_path and trace not in ("azure", "mooncake", "file"):
        raise ValueError(f"--trace-path replaces azure or mooncake; {trace} is synthetic")
    if not generic:
        for opt, v in (("--rate", args.rate), ("--burstiness", args.burstiness),
                       ("--seed", args.seed), ("--tier", args.tier),
                       ("--hash-block", args.hash_block)):  # fmt: skip
            if v is not None:
                raise ValueError(f"{opt} applies to a generic trace (--trace-path FILE "
                                 f"without --trace), not to --trace {trace}")  # fmt: skip
    if args.rate is not None and args.time_scale != 1.0:
        # The times drawn at --rate would be stretched while the header (and the
        # max-rate search's other seeds, drawn afresh) kept --rate itself.
        raise ValueError("--time-scale stretches a trace's own arrival times; with --rate, "
                         "give the rate you mean (or --load to multiply it)")  # fmt: skip
    if not args.find_max_rate:
        for opt, v in (("--attainment", args.attainment), ("--seeds", args.seeds),
                       ("--json", args.json)):  # fmt: skip
            if v is not None:
                raise ValueError(f"{opt} applies to --find-max-rate")
    elif not args.slo:
        raise ValueError("--find-max-rate needs at least one --slo TENANT:ttft=S,itl=S")
    elif args.plots:
        raise ValueError("--plots does not apply to --find-max-rate")
    if args.json:
        check_writable(args.json, "--json")
    slos = parse_slos(args.slo or [])
    default_load = 1.0 if generic else setup.DEFAULT_LOAD.get(trace, 1.0)
    # The search's multipliers count from the workload's own rate (1x); --load
    # is where its bracketing starts.
    load = default_load if args.load is None else args.load
    if not (0 < load < math.inf and 0 < args.time_scale < math.inf):  # NaN too
        # inf squeezed every arrival to 0 s (load) or to inf s, where the
        # replay never ended (time scale).
        raise ValueError(f"--load ({load}) and --time-scale ({args.time_scale}) must be "
                         "finite and > 0")  # fmt: skip
    at = 1.0 if args.find_max_rate else load
    if generic:
        if args.burstiness is not None and args.rate is None:
            raise ValueError("--burstiness shapes arrivals drawn at --rate: give --rate too")
        burstiness = 1.0 if args.burstiness is None else args.burstiness
        arrivals, tenants = setup.file_workload(
            args.trace_path, rate=args.rate, burstiness=burstiness, seed=args.seed or 0,
            load=at / args.time_scale, limit=args.limit,
            tiers=setup.parse_tiers(args.tier or []),
            hash_block=512 if args.hash_block is None else args.hash_block,
        )  # fmt: skip
        label = Path(args.trace_path).name
    else:
        arrivals, tenants = setup.named_workload(
            trace, load=at, time_scale=args.time_scale, limit=args.limit, path=args.trace_path
        )
        label = trace
    step_budget = args.max_batched_tokens
    if step_budget is None:
        step_budget = setup.DEFAULT_STEP_BUDGET.get(trace, setup.STEP_BUDGET)
    if not arrivals:
        print("the workload is empty", file=sys.stderr)
        return 2
    tenant_names = [t.name for t in tenants]
    unknown = sorted(set(slos) - set(tenant_names) - {ANY})
    if unknown:
        raise ValueError(f"--slo for {', '.join(map(repr, unknown))}, not a tenant of "
                         f"{label} (its tenants: {', '.join(tenant_names)})")  # fmt: skip
    if args.step_cost and args.hosts > 1:
        raise ValueError("--step-cost is a cost measured on one host: not with --hosts")
    cost = (setup.StepCost.load(args.step_cost, model=args.model, devices=args.devices)
            if args.step_cost else None)  # fmt: skip
    engine = setup.engine_for(arrivals, model=args.model, accelerator=args.accelerator,
                              devices=args.devices, hosts=args.hosts, context=args.context,
                              max_num_seqs=args.max_num_seqs, step_budget=step_budget,
                              chunk=args.chunk, cost=cost)  # fmt: skip
    base, cost = engine.config, engine.cost
    chosen = scenarios.standard(base)
    if args.scenarios != "standard":
        wanted = list(dict.fromkeys(w.strip() for w in args.scenarios.split(",") if w.strip()))
        chosen = [s for s in chosen if s.name in wanted]
        if len(chosen) != len(wanted):
            names = ", ".join(s.name for s in scenarios.standard(base))
            print(f"unknown scenario in {args.scenarios!r}; known: {names}", file=sys.stderr)
            return 2
    pool = f"{base.num_blocks - 1:,} KV blocks of {base.block_size}"
    where = f"{args.hosts} hosts x {args.devices}" if args.hosts > 1 else f"{args.devices}"
    print(f"{len(arrivals)} requests ({label}) on {where} x {args.accelerator} "
          f"serving {args.model}: {pool}; step budget {step_budget:,} tokens, prefill "
          f"chunk {args.chunk:,}")  # fmt: skip
    if args.step_cost:
        cal = cost.calibration or {}
        basis = (f"calibrated on {cal.get('device', '?')}, {cal.get('backend', '?')} backend"
                 if cal else f"{cost.accelerator.name}'s rates, not calibrated")  # fmt: skip
        print(f"  step times from {args.step_cost} ({basis}); pool sized for "
              f"{args.accelerator}'s memory")  # fmt: skip
    else:
        print(f"  step times from {args.accelerator}'s peak rates x efficiency (mfu "
              f"{cost.mfu:g}, bandwidth {cost.bandwidth_efficiency:g}; --step-cost FILE from "
              "kvsched calibrate for measured ones)")  # fmt: skip
    if generic:
        tiers = ", ".join(f"{t.name} (tier {t.tier})" for t in tenants)
        timing = ("arrival times from the file" if args.rate is None else
                  f"arrivals drawn at {args.rate:g} req/s, gamma gaps of CV "
                  f"{burstiness:g}{' (Poisson)' if burstiness == 1 else ''}, seed "
                  f"{args.seed or 0}")  # fmt: skip
        print(f"  tenants: {tiers}; {timing}")
    if args.find_max_rate:
        start = 1.0 if args.load is None else load
        return _find_max_rate(args, arrivals, tenants, engine, slos, chosen, label, start)
    why = (" (the default for this trace: at its own rate the pool is seldom under "
           "pressure and the scenarios barely differ; --load 1 for the trace's rate)"
           if args.load is None and load != 1.0 else "")  # fmt: skip
    print(f"  load {load:g}x the workload's arrival rate{why}")
    if trace == "prefill-vs-decode":
        print("  prefill-vs-decode: 20 s; chat 4 req/s (200-token prompts, 200 out, tier 0), "
              "docs 1 req/s (30,000-token prompts, 16 out, tier 1), Poisson, seed 0")  # fmt: skip
    prog, update = progress()
    if prog is not None:
        prog.start()
    try:
        results = scenarios.run(base, tenants, arrivals, cost, chosen, progress=update)
    finally:
        if prog is not None:
            prog.stop()
    print(scenarios.table(results, slos or None))
    if args.plots:
        for p in scenarios.plot(results, args.plots):
            print(f"wrote {p}")
    return 0


def _find_max_rate(args: argparse.Namespace, arrivals: Any, tenants: Any, engine: Any,
                   slos: Any, chosen: Any, label: str, start: float) -> int:  # fmt: skip
    """`kvsched simulate --find-max-rate`: the search (sim/maxrate.py), wired."""
    from kvsched.sim import maxrate

    if len(chosen) != 1 and args.scenarios != "standard":
        raise ValueError("--find-max-rate searches one scenario: name one in --scenarios")
    scenario = chosen[0]  # continuous unless --scenarios names one
    target = 0.99 if args.attainment is None else args.attainment
    seeds = 3 if args.seeds is None else args.seeds
    vary: Any = "shift"
    if args.rate is not None:
        b = 1.0 if args.burstiness is None else args.burstiness
        vary = maxrate.retimed(args.rate, b, seed=args.seed or 0)
    how = ("fresh arrival draws at the rate" if args.rate is not None else
           "the trace rotated in time by a random offset")  # fmt: skip
    print(f"  searching the arrival-rate multiplier from {start:g}x: scenario {scenario.name}; "
          f"every tenant with an SLO serves >= {target:.1%} of its offered requests within "
          f"it, over {seeds} seed(s) (seed 0 as given, the others {how})")  # fmt: skip

    def show(p: maxrate.Point) -> None:
        verdict = "met " if p.passed else "miss"
        shares = ", ".join(f"{t} {s:.2%}" for t, s in p.attainment.items())
        worst = f"; worst: {p.worst[0]} {p.worst[1]}" if p.worst else ""
        print(f"  {p.multiplier:8.4g}x {p.requests_per_s:9.4g} req/s  {verdict}  {shares} "
              f"({p.seeds_run} seed(s)){worst}", flush=True)  # fmt: skip

    result = maxrate.find_max_rate(
        arrivals, tenants, engine, slos, target=target, seeds=seeds, vary=vary,
        scenario=scenario, start=start, trace=label,
        base_rate=args.rate, progress=show,
    )  # fmt: skip
    print(result.line())
    print(f"  at {result.multiplier:.4g}x: {result.output_tokens_per_s:,.1f} output and "
          f"{result.input_tokens_per_s:,.1f} prompt tokens/s served; {result.runs} runs, "
          f"{result.wall_s:.1f} s")  # fmt: skip
    if args.json:
        Path(args.json).write_text(result.to_json() + "\n")
        print(f"wrote {args.json}")
    return 0


def add_parsers(sub: Any) -> None:
    """The `simulate` sub-command."""
    from kvsched.sim.setup import DEFAULT_LOAD

    s = sub.add_parser("simulate", help="replay a workload through the real scheduler")
    s.add_argument("--trace", choices=["azure", "mooncake", "prefill-vs-decode", "burst"],
                   default=None, help="workload (default azure; with --trace-path and no "
                   "--trace, the file is a generic trace)")  # fmt: skip
    s.add_argument("--trace-path",
                   help="a trace file, plain or .gz: with --trace azure or mooncake, that "
                   "trace's format (default: the bundled copy); alone, a generic CSV or JSON "
                   "lines trace: columns prompt_tokens, output_tokens (integers >= 1), "
                   "optional arrival_s (seconds), tenant, hash_ids (ids of 512-token "
                   "prompt blocks: shared ids, shared prefix)")  # fmt: skip
    s.add_argument("--rate", type=float,
                   help="generic trace: draw arrivals at this many requests/s (needed when "
                   "the file has no arrival_s; replaces its times when it has; default: the "
                   "file's times)")  # fmt: skip
    s.add_argument("--burstiness", type=float,
                   help="with --rate: coefficient of variation of the gamma gaps between "
                   "arrivals (x: their standard deviation over their mean; 1 = Poisson, "
                   "> 1 burstier; default 1)")  # fmt: skip
    s.add_argument("--seed", type=int,
                   help="with --rate: seed of the arrival draws and of the random prompt "
                   "tokens (default 0)")  # fmt: skip
    s.add_argument("--tier", action="append", metavar="TENANT=TIER",
                   help="generic trace: a tenant's tier (0 most important; repeatable; "
                   "default 0 for every tenant)")  # fmt: skip
    s.add_argument("--hash-block", type=int,
                   help="generic trace: tokens per hash_ids block (default 512, as in "
                   "the Mooncake trace)")  # fmt: skip
    s.add_argument("--slo", action="append", metavar="TENANT:ttft=S,itl=S[,gap=S]",
                   help="a tenant's SLO, seconds (repeatable; TENANT * for every tenant not "
                   "named): adds SLO attainment and goodput columns to the table; needed by "
                   "--find-max-rate")  # fmt: skip
    s.add_argument("--find-max-rate", action="store_true",
                   help="search the highest arrival-rate multiplier at which every tenant "
                   "with an SLO meets its attainment target (--load: where the search "
                   "starts, default 1x)")  # fmt: skip
    s.add_argument("--attainment", type=float,
                   help="with --find-max-rate: the fraction of each tenant's offered requests "
                   "that must meet its SLO (default 0.99)")  # fmt: skip
    s.add_argument(
        "--seeds",
        type=int,
        help="with --find-max-rate: workload variants per point (count; default 3)",
    )
    s.add_argument(
        "--json", metavar="FILE", help="with --find-max-rate: also write the result as JSON to FILE"
    )
    s.add_argument(
        "--limit", type=int, help="replay the first N requests of the trace (default: all)"
    )
    s.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies arrival times (x; < 1 compresses time; default 1)")  # fmt: skip
    s.add_argument("--load", type=float, default=None,
                   help="arrival-rate multiplier (x; arrival times divided by it); default "
                   f"{DEFAULT_LOAD['azure']:g} for azure (the pool under pressure), "
                   "1 otherwise")  # fmt: skip
    s.add_argument(
        "--scenarios",
        default="standard",
        help="comma-separated scenario names (default: standard, all eight)",
    )
    engine_options(s, budget_help="step budget in tokens (default 2048 for "
                    "prefill-vs-decode, 8192 otherwise)",
                    devices_help="accelerators, tensor parallel; per host with --hosts (count; "
                    "default 1)")  # fmt: skip
    s.add_argument("--hosts", type=int, default=1,
                   help="hosts of --devices accelerators each, one replica over all: the "
                   "step cost pays the all-reduces between hosts (count; default 1)")  # fmt: skip
    s.add_argument("--plots", help="write PNG plots to this folder")
    s.add_argument("--step-cost", metavar="FILE",
                   help="a step-cost file from kvsched calibrate, for the same --model "
                   "(default: the preset's peak rates x efficiency)")  # fmt: skip
    s.set_defaults(func=cmd_simulate)
