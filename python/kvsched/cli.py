"""The `kvsched` command.

kvsched capacity --model llama-3-8b --accelerator h100 [--devices N] [--context 8192]
                 [--load TOK_PER_S --payg $/Mtok [--device-hour $ --device-tps N
                  --engineering-hour $] [--ptu-hour $ --ptu-tps N]]
                 [--kv-dtype bf16|int8|float32] [--max-rate-json FILE (instead of --device-tps)]
kvsched simulate --trace azure|mooncake|prefill-vs-decode|burst [--trace-path F]
                 [--limit N] [--load X] [--time-scale X] [--scenarios standard|a,b,...]
                 [--model M --accelerator A --devices N] [--plots DIR] [--step-cost FILE]
                 [--slo TENANT:ttft=S,itl=S ...] [--find-max-rate [--attainment 0.99]
                  [--seeds N] [--json FILE]]
kvsched simulate --trace-path FILE.csv|FILE.jsonl [--rate R [--burstiness B] [--seed N]]
                 [--tier TENANT=TIER ...] ...    any trace (see --help)
kvsched sweep reserve|chunk [--values V,V,...] [--trace T] [--load X] [--slo SPEC ...]
              [--model M --accelerator A --devices N] [--plots DIR]
                                    a knob against goodput, p99 and refusals, with knees
kvsched mix [--loads X,X,...] [--devices 2] [--window S] [--arrangements A,...] [--slo SPEC ...]
                                    two tenants together, on mixed replicas, apart, time-sliced
kvsched calibrate --out FILE [--model tiny|smollm2] [--decode 1,16,64] [--prefill 0,32,96]
                  [--context 8,48] [--held-out D:P:C,...]
                                    fit the simulator's step cost to the engine here
kvsched serve --tenants tenants.toml [--model smollm2|tiny] [--host H] [--port P]
              [--drain-seconds S] [--end-at TIME]
                                    the OpenAI-compatible server (pip install kvsched[serve])
kvsched fetch-model                 fetch SmolLM2-135M-Instruct's GGUF into the cache
kvsched eval-kv [--kv-dtype int8] [--prompts N] [--tokens N]
                                    the int8 KV gate: measured on the real model, saved
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any


def _progress():
    """A rich progress bar keyed by scenario (plain text without rich)."""
    try:
        from rich.progress import Progress
    except ImportError:  # pragma: no cover
        return None, lambda name, done, total: None
    prog = Progress(transient=True)
    tasks: dict[str, Any] = {}

    def update(name: str, done: int, total: int) -> None:
        if name not in tasks:
            tasks[name] = prog.add_task(f"simulating {name}", total=total)
        prog.update(tasks[name], completed=done)

    return prog, update


def cmd_capacity(args: argparse.Namespace) -> int:
    from kvsched import capacity as cap

    kv_bytes = None if args.kv_dtype else (2.0 if args.kv_bytes is None else args.kv_bytes)
    c = cap.capacity(args.model, args.accelerator, devices=args.devices, precision=args.precision,
                     kv_dtype_bytes=kv_bytes, kv_dtype=args.kv_dtype, overhead_reserve=args.reserve,
                     block_size=args.block_size, context=args.context,
                     hosts=args.hosts)  # fmt: skip
    where = f"{c.hosts} hosts x {c.devices}" if c.hosts > 1 else f"{c.devices}"
    print(f"{c.model} ({args.precision}) on {where} x {c.accelerator}")
    print(f"  weights          {c.weight_bytes / 1e9:10.1f} GB")
    print(f"  KV per token     {c.kv_bytes_per_token:10,.0f} bytes")
    reserve = f"{args.reserve:.0%} reserve held back"
    print(f"  usable for KV    {c.usable_kv_bytes / 1e9:10.1f} GB ({reserve})")
    if c.hosts > 1:
        print(f"  KV per host      {c.kv_bytes_per_host / 1e9:10.1f} GB (the pool split "
              "evenly over the hosts)")  # fmt: skip
    print(f"  KV blocks        {c.kv_blocks:10,} of {c.block_size} tokens = {c.kv_tokens:,} tokens")
    print(f"  sequences of {c.context:,} tokens at once: {c.max_concurrent_seqs:,}")
    m = cap.MODELS[args.model]
    if m.sliding_layers and m.sliding_window is not None:
        print(f"    ({m.sliding_layers} of {m.layers} layers keep a {m.sliding_window:,}-token "
              f"sliding window; {c.full_context_seqs:,} if every layer kept all "
              f"{c.context:,} tokens, as kvsched's pages do)")  # fmt: skip
    cfg = c.scheduler_config()
    print(
        f"  kvsched.SchedulerConfig(num_blocks={cfg.num_blocks}, block_size={cfg.block_size}, "
        f"max_seq_len={cfg.max_seq_len}, max_num_seqs={cfg.max_num_seqs}, overhead_reserve=0.0)"
    )
    if c.devices * c.hosts > 1:
        _print_allreduce(args, cfg.max_num_seqs)
    if args.load is not None:
        if args.payg is None:
            print("cost: --payg (per million tokens) is needed with --load", file=sys.stderr)
            return 2
        device_hour, device_tps = args.device_hour, args.device_tps
        max_rate = None
        if args.max_rate_json is not None:
            if args.device_tps is not None:
                print("cost: --max-rate-json or --device-tps, not both", file=sys.stderr)
                return 2
            if device_hour is None:
                print("cost: --max-rate-json costs self-hosting: --device-hour is needed",
                      file=sys.stderr)  # fmt: skip
                return 2
            # kvsched simulate sizes its pool with the capacity model's defaults;
            # a replica of other weights or KV holds another pool, another rate.
            kv = args.kv_dtype or ("bf16" if kv_bytes == 2.0 else f"{kv_bytes:g} bytes")
            simulated = {"--precision": ("bf16", args.precision), "KV": ("bf16", kv),
                         "--reserve": (0.10, args.reserve),
                         "--block-size": (16, args.block_size)}  # fmt: skip
            differ = [f"{k} {mine:g} (simulated: {theirs:g})" if not isinstance(mine, str)
                      else f"{k} {mine} (simulated: {theirs})"
                      for k, (theirs, mine) in simulated.items() if mine != theirs]  # fmt: skip
            if differ:
                print(f"cost: --max-rate-json is the rate of a replica kvsched simulate sized "
                      f"with bf16 weights, 2-byte KV, a 10% reserve and 16-token pages; this "
                      f"one differs ({'; '.join(differ)}): its pool and rate are others",
                      file=sys.stderr)  # fmt: skip
                return 2
            max_rate = cap.load_max_rate(
                args.max_rate_json, model=args.model, accelerator=args.accelerator,
                devices=args.devices,
            )  # fmt: skip
            # A self-hosted unit is then the simulated replica: its devices together.
            device_hour, device_tps = device_hour * c.devices * c.hosts, max_rate.tokens_per_s
        left_out = None
        if device_hour is not None and args.engineering_hour is None:
            # The options that need no engineering cost are still worth printing.
            left_out = (
                "self_hosted left out: --engineering-hour ($ per hour of the people who "
                "run it) is needed; no default is honest (0 makes self-hosting look cheaper)"
            )
            device_hour = device_tps = None
        prices = cap.Prices(args.payg, args.ptu_hour, args.ptu_tps, device_hour,
                            device_tps, args.engineering_hour)  # fmt: skip
        options = cap.compare(args.load, prices)
        print(f"cost of {args.load:,.0f} tokens/s:")
        for o in options:
            print(f"  {o.name:<14} {o.per_hour:10.2f} $/h  units {o.units:>4}  "
                  f"utilization {o.utilization:.0%}")  # fmt: skip
        # Where "units" come from: given throughputs, not this command's sizing.
        names = {o.name for o in options}
        if "provisioned" in names:
            print(f"  provisioned units: throughput units of --ptu-tps {args.ptu_tps:g} "
                  "tokens/s each")  # fmt: skip
        if "self_hosted" in names and max_rate is not None:
            print(f"  self_hosted units: replicas of {c.devices} x {args.accelerator} "
                  f"({c.devices} x --device-hour), {max_rate.tokens_per_s:,.0f} tokens/s "
                  f"each (prompt {max_rate.input_tokens_per_s:,.0f} + output "
                  f"{max_rate.output_tokens_per_s:,.0f}), from {max_rate.describe()}")  # fmt: skip
        elif "self_hosted" in names:
            print(f"  self_hosted units: accelerators ({args.accelerator}) of --device-tps "
                  f"{args.device_tps:g} tokens/s each, as given (not derived from the "
                  f"capacity above)")  # fmt: skip
        if left_out:
            print(f"  {left_out}")
    return 0


def _print_allreduce(args: argparse.Namespace, decode_seqs: int) -> None:
    """What tensor parallelism's all-reduces cost a decode step of
    `decode_seqs` sequences at half the context and a 2,048-token prefill step,
    in the step-cost model (sim/simulator.py)."""
    from kvsched.sim.simulator import StepCost

    cost = StepCost.preset(args.model, args.accelerator, devices=args.devices, hosts=args.hosts,
                           precision=args.precision)  # fmt: skip
    print("  tensor-parallel all-reduces per step (2 per layer, not overlapped; step-cost model):")
    for what, tokens, kv in (
        (f"decode, {decode_seqs} seqs", decode_seqs, decode_seqs * args.context // 2),
        ("prefill, 2,048 tokens", 2048, 2048),
    ):
        ar, step = cost.allreduce_seconds(tokens), cost.seconds(tokens, kv)
        across = cost.host_bytes(tokens)
        hosts = f", {across / 1e6:,.1f} MB each host sends the others" if args.hosts > 1 else ""
        print(f"    {what:<22} {ar * 1e3:8.2f} ms of a {step * 1e3:.2f} ms step "
              f"({ar / step:.0%}){hosts}")  # fmt: skip


def _check_writable(path: str, option: str) -> None:
    """Refuse an output file whose folder is missing (or is a folder itself)
    before a long run, not after it."""
    p = Path(path)
    if p.is_dir() or not p.parent.is_dir():
        raise ValueError(f"{option} {path}: no such folder to write the file in"
                         if not p.is_dir() else f"{option} {path} is a folder")  # fmt: skip


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
        _check_writable(args.json, "--json")
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
    prog, update = _progress()
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


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a comma-separated list of integers, not {text!r}"
        ) from None


def _points(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        try:
            d, p, c = (int(x) for x in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"points are DECODE:PREFILL:CONTEXT (integers), not {item!r}"
            ) from None
        out.append((d, p, c))
    return out


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the simulator's step cost to the engine on this machine's device."""
    from kvsched.sim import calibrate as cal

    _check_writable(args.out, "--out")  # before minutes of measuring
    points = cal.grid(args.decode, args.prefill, args.context)
    held = [cal.Point(*p) for p in args.held_out]
    cal.check_points(points + held)  # before the model loads
    if args.model == "tiny":
        from kvsched.engine.model import LlamaConfig, init_params

        model = LlamaConfig()
        params = init_params(model, seed=0)
        name = None
    else:
        from kvsched import model_files
        from kvsched.engine.loaders.gguf_llama import load_gguf

        gg = load_gguf(model_files.fetch())
        model, params = gg.config, gg.params
        name = "smollm2-135m"  # the capacity preset of the same model
    print(f"calibrating {name or model.name} on {cal.device_name()}: {len(points)} points, "
          f"{len(held)} held out, {args.passes} passes of {args.reps} timed steps each "
          "(the first step of each token bucket compiles: minutes on a small CPU)",
          flush=True)  # fmt: skip
    c = cal.calibrate(model, params, points, held, backend=args.backend,
                      kv_dtype=args.kv_dtype, reps=args.reps, warmup=args.warmup,
                      passes=args.passes, clock=args.clock, name=name)  # fmt: skip
    print(c.report())
    c.cost.save(args.out)
    from kvsched.capacity import MODELS

    fitted = c.cost.model.name
    use = f"kvsched simulate --model {fitted} --step-cost {args.out}"
    if fitted not in MODELS:
        use = f"StepCost.load in a study of {fitted}; kvsched simulate's presets refuse it"
    print(f"wrote {args.out} ({use})")
    return 0


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from kvsched import model_files

    path = model_files.fetch()
    model_files.verify(path)
    print(f"{path} ({model_files.SMOLLM2_135M.size:,} bytes, sha256 checked)")
    return 0


def cmd_eval_kv(args: argparse.Namespace) -> int:
    """The quantized-KV gate on SmolLM2-135M-Instruct: greedy agreement and mean
    |logprob difference| against float32 KV; the report is saved for the engine."""
    from kvsched import model_files
    from kvsched.engine import kv_eval
    from kvsched.engine.loaders.gguf_llama import load_gguf

    gg = load_gguf(model_files.fetch())
    prompts = [gg.encode_chat([{"role": "user", "content": p}])
               for p in kv_eval.EVAL_PROMPTS[: args.prompts]]  # fmt: skip
    # Judged by the engine's default thresholds; an engine configured with others
    # (kv_min_agreement, kv_max_logprob_diff) checks the saved figures itself.
    report = kv_eval.evaluate_kv(gg.config, gg.params, prompts, kv_dtype=args.kv_dtype,
                                 tokens=args.tokens)  # fmt: skip
    path = kv_eval.save_report(report)
    verdict = "PASS" if report.passed else "FAIL"
    print(f"{args.kv_dtype} KV vs float32 KV on {report.model} ({report.checksum}), "
          f"{report.prompts} prompts x {report.tokens_per_prompt} greedy tokens:")  # fmt: skip
    print(
        f"  greedy agreement       {report.greedy_agreement:.3f} (gate >= "
        f"{report.min_agreement}); {report.identical_prompts}/{report.prompts} identical"
    )
    print(
        f"  mean |logprob diff|    {report.mean_abs_logprob_diff:.4f} (gate <= "
        f"{report.max_mean_abs_logprob_diff}); max {report.max_abs_logprob_diff:.4f}"
    )
    print(f"  {verdict} in {report.seconds:.0f} s; report {path}")
    return 0 if report.passed else 1


def cmd_serve(args: argparse.Namespace) -> int:
    """The OpenAI-compatible server (kvsched.serve.server) until SIGTERM drains it."""
    import logging
    import time

    from kvsched.model_files import cache_dir
    from kvsched.serve import AsyncEngine
    from kvsched.serve.server import OpenAIServer, load_model, parse_end_at
    from kvsched.serve.tenants import TenantRegistry

    tenants = TenantRegistry.from_file(args.tenants)  # a bad file fails before the model loads
    end_at = parse_end_at(args.end_at) if args.end_at else None
    if end_at is not None and end_at <= time.time():
        raise ValueError(f"--end-at {args.end_at} is in the past")
    if args.drain_seconds < 0:
        raise ValueError("--drain-seconds must be >= 0")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    m = load_model(args.model, max_seq_len=args.max_seq_len, max_num_seqs=args.max_num_seqs,
                   num_blocks=args.num_blocks, max_batched_tokens=args.max_batched_tokens,
                   max_logprobs=args.max_logprobs, backend=args.backend,
                   seed=args.seed)  # fmt: skip
    checkpoint = (
        Path(args.checkpoint) if args.checkpoint else cache_dir() / "serve-checkpoint.jsonl"
    )
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    engine = AsyncEngine(m.engine, checkpoint_path=str(checkpoint))
    server = OpenAIServer(engine, tenants, model_name=m.model_name, encode_chat=m.encode_chat,
                          aliases=m.aliases, max_body_bytes=args.max_body_bytes,
                          drain_seconds=args.drain_seconds, end_at=end_at)  # fmt: skip
    print(f"serving {m.model_name} to {len(tenants.names)} tenant(s) on "
          f"http://{args.host}:{args.port}/v1 (checkpoint {checkpoint})", flush=True)  # fmt: skip
    return server.run(args.host, args.port, log_level=args.log_level)


def _preset_options(
    p: argparse.ArgumentParser, *, devices: int = 1,
    devices_help: str = "accelerators, tensor parallel (count; default 1)",
) -> None:  # fmt: skip
    """--model, --accelerator (the capacity presets) and --devices: what
    capacity, simulate, sweep and mix size the engine from."""
    from kvsched.capacity import ACCELERATORS, MODELS

    p.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS),
                   help="model preset (default llama-3-8b)")  # fmt: skip
    p.add_argument("--accelerator", default="h100", choices=sorted(ACCELERATORS),
                   help="accelerator preset (default h100)")  # fmt: skip
    p.add_argument("--devices", type=int, default=devices, help=devices_help)


def _engine_options(
    p: argparse.ArgumentParser, *, budget_help: str, budget: int | None = None,
    devices: int = 1, devices_help: str = "accelerators, tensor parallel (count; default 1)",
    context: bool = True, seqs_help: str = "sequences running at once (count; default 128)",
    chunk_help: str = "long-prefill chunk in tokens (default 2048)",
) -> None:  # fmt: skip
    """The simulated engine's options, the same in simulate, sweep and mix:
    the presets and devices, --context (not mix: its workload fixes it),
    --max-num-seqs, --max-batched-tokens (its default differs per command,
    hence `budget` and `budget_help`) and --chunk. The help texts that differ
    (mix counts per device) are passed in."""
    _preset_options(p, devices=devices, devices_help=devices_help)
    if context:
        p.add_argument("--context", type=int, default=8192,
                       help="max sequence length in tokens, raised to the workload's longest "
                       "(default 8192)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=128, help=seqs_help)
    p.add_argument("--max-batched-tokens", type=int, default=budget, help=budget_help)
    p.add_argument("--chunk", type=int, default=2048, help=chunk_help)


def build_parser() -> argparse.ArgumentParser:
    """The `kvsched` command line: every option carries help text with its unit
    and default (tests/test_capacity.py walks it)."""
    from kvsched.sim.mix import DEFAULT_LOADS as MIX_LOADS
    from kvsched.sim.setup import DEFAULT_LOAD

    ap = argparse.ArgumentParser(prog="kvsched", description="kvsched: capacity and simulation")
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("capacity", help="KV capacity, the matching SchedulerConfig, cost")
    _preset_options(c, devices_help="accelerators, tensor parallel, memory summed as one big "
                    "device; per host with --hosts (count; default 1)")  # fmt: skip
    c.add_argument("--hosts", type=int, default=1,
                   help="hosts of --devices accelerators each, one tensor-parallel replica over "
                   "all of them: KV per host and the all-reduce traffic between hosts (count; "
                   "default 1)")  # fmt: skip
    c.add_argument(
        "--precision",
        default="bf16",
        help="weight precision: float32, bf16, fp16, int8 or int4 (default bf16)",
    )
    c.add_argument("--kv-bytes", type=float, help="bytes per KV element (default 2)")
    c.add_argument(
        "--kv-dtype",
        choices=["float32", "bf16", "int8"],
        help="KV dtype by name (int8 includes its scales); instead of --kv-bytes "
        "(default: 2 bytes per element)",
    )
    c.add_argument(
        "--reserve",
        type=float,
        default=0.10,
        help="share of HBM held back from KV (fraction 0..1; default 0.10)",
    )
    c.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV page (default 16)")  # fmt: skip
    c.add_argument(
        "--context",
        type=int,
        default=8192,
        help="tokens per sequence to count sequences at (default 8192)",
    )
    c.add_argument("--load", type=float,
                   help="load to cost, in tokens/s (default: no cost table)")  # fmt: skip
    c.add_argument(
        "--payg",
        type=float,
        help="pay-as-you-go price, $ per million tokens (no default; needed with --load)",
    )
    c.add_argument(
        "--ptu-hour",
        type=float,
        help="provisioned throughput unit, $ per hour (default: not costed)",
    )
    c.add_argument(
        "--ptu-tps", type=float, help="tokens/s one provisioned unit sustains (default: not costed)"
    )
    c.add_argument(
        "--device-hour",
        type=float,
        help="self-hosting, $ per accelerator-hour (default: not costed)",
    )
    c.add_argument("--device-tps", type=float,
                   help="tokens/s one self-hosted accelerator sustains, as you measured it: "
                   "the self_hosted units are load / this (default: not costed)")  # fmt: skip
    c.add_argument("--max-rate-json", metavar="FILE",
                   help="instead of --device-tps: the JSON `kvsched simulate --find-max-rate "
                   "--json FILE` wrote for this --model, --accelerator and --devices; a unit "
                   "is then that replica, sustaining its prompt + output tokens/s under the "
                   "SLOs (default: not used)")  # fmt: skip
    c.add_argument("--engineering-hour", type=float,
                   help="self-hosting's people, $ per hour; no default (without it "
                   "self-hosting is left out of the cost table)")  # fmt: skip
    c.set_defaults(func=cmd_capacity)

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
    _engine_options(s, budget_help="step budget in tokens (default 2048 for "
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
    _engine_options(w, budget_help="step budget in tokens (default: 8192 for the chunk "
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
    _engine_options(x, devices=2, devices_help="accelerators of the whole machine, even: "
                    "half each apart (count; default 2)", context=False,
                    seqs_help="sequences running at once, per device (count; default 128)",
                    budget=2048, budget_help="step budget per device, tokens (default 2048)",
                    chunk_help="long-prefill chunk, tokens (default 2048)")  # fmt: skip
    x.set_defaults(func=cmd_mix)

    k = sub.add_parser("calibrate", help="fit the simulator's step cost to the engine here")
    k.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="the engine's model: a random tiny one, or SmolLM2-135M-Instruct "
        "(fetched; the smollm2-135m preset) (default tiny)",
    )
    k.add_argument(
        "--backend",
        choices=["reference", "pallas", "jax"],
        default="reference",
        help="attention backend the engine runs (default reference)",
    )
    k.add_argument(
        "--kv-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="KV cache dtype (default float32)",
    )
    k.add_argument(
        "--decode",
        type=_int_list,
        default=[1, 16, 64],
        help="grid: decoding sequences in a step (counts; default 1,16,64)",
    )
    k.add_argument(
        "--prefill",
        type=_int_list,
        default=[0, 32, 96],
        help="grid: prompt tokens prefilled in a step (tokens; default 0,32,96)",
    )
    k.add_argument(
        "--context",
        type=_int_list,
        default=[8, 48],
        help="grid: tokens of KV each decoding sequence holds (tokens; default 8,48)",
    )
    k.add_argument(
        "--held-out",
        type=_points,
        default=_points("32:32:24,8:88:16,48:0:40,0:64:1"),
        metavar="D:P:C,...",
        help="points measured but not fitted, for the error on unseen mixes "
        "(decode:prefill:context; default 32:32:24,8:88:16,48:0:40,0:64:1)",
    )
    k.add_argument(
        "--reps",
        type=int,
        default=7,
        help="timed steps per point and pass, median kept (count; default 7)",
    )
    k.add_argument(
        "--warmup", type=int, default=1, help="untimed steps before them (count; default 1)"
    )
    k.add_argument(
        "--passes",
        type=int,
        default=3,
        help="passes over the grid, the lowest median kept (count; default 3)",
    )
    k.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: a step's latency (a machine to itself); cpu: the process's CPU "
        "seconds over the step, which other work on a shared machine does not "
        "inflate (default wall)",
    )
    k.add_argument(
        "--out", required=True, metavar="FILE", help="the step-cost JSON file to write (no default)"
    )
    k.set_defaults(func=cmd_calibrate)

    f = sub.add_parser("fetch-model", help="fetch SmolLM2-135M-Instruct's GGUF into the cache")
    f.set_defaults(func=cmd_fetch_model)

    e = sub.add_parser("eval-kv", help="the quantized-KV gate, measured on the real model")
    e.add_argument("--kv-dtype", default="int8", choices=["int8"],
                   help="the KV dtype judged (default int8)")  # fmt: skip
    e.add_argument("--prompts", type=int, default=8, choices=range(1, 11), metavar="1..10",
                   help="evaluation prompts (count; default 8)")  # fmt: skip
    e.add_argument("--tokens", type=int, default=32,
                   help="greedy tokens per prompt (default 32)")  # fmt: skip
    e.set_defaults(func=cmd_eval_kv)

    v = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    v.add_argument(
        "--model",
        choices=["smollm2", "tiny"],
        default="smollm2",
        help="SmolLM2-135M-Instruct, or a random tiny model without a tokenizer (default smollm2)",
    )
    v.add_argument("--tenants", required=True, help="the tenants TOML file (names, API keys)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    v.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long running requests may go on (seconds; default 30)",
    )
    v.add_argument("--end-at", help="drain and exit by this time (ISO 8601 or Unix seconds)")
    v.add_argument(
        "--checkpoint",
        help="where the drain writes the scheduler checkpoint (default: the kvsched cache folder)",
    )
    v.add_argument("--max-seq-len", type=int, default=1024,
                   help="longest prompt + output in tokens (default 1024)")  # fmt: skip
    v.add_argument("--max-num-seqs", type=int, default=16,
                   help="sequences running at once (count; default 16)")  # fmt: skip
    v.add_argument("--max-batched-tokens", type=int, default=256,
                   help="step budget in tokens (default 256)")  # fmt: skip
    v.add_argument(
        "--num-blocks",
        type=int,
        help="KV pages (count; default: every sequence at full length)",
    )
    v.add_argument("--max-logprobs", type=int, default=5,
                   help="top logprobs a request may ask (count; default 5)")  # fmt: skip
    v.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body in bytes (default 1048576)")  # fmt: skip
    v.add_argument(
        "--backend", choices=["reference", "pallas", "jax"], default="reference",
        help="attention: reference (jnp), pallas (kvsched's kernel; on TPU JAX's unless "
        "KVSCHED_TPU_ATTENTION=ours), jax (JAX's kernel on TPU, its jnp reference elsewhere); "
        "default reference",
    )  # fmt: skip
    v.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    v.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log level (default info)")  # fmt: skip
    v.set_defaults(func=cmd_serve)

    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command == "capacity" and args.kv_dtype and args.kv_bytes is not None:
        ap.error("--kv-dtype and --kv-bytes: give one")
    import kvsched
    from kvsched.model_files import ModelFetchError

    try:
        return int(args.func(args))
    except (ValueError, OSError, ModelFetchError, kvsched.KvSchedError) as e:
        # CapacityError and UnsupportedConfig are ValueErrors.
        print(f"kvsched {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
