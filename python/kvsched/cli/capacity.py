"""`kvsched capacity`: KV capacity, the matching SchedulerConfig, and cost."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def cmd_capacity(args: argparse.Namespace) -> int:
    from kvsched import capacity as cap
    from kvsched.maxrate_result import load_max_rate

    kv_bytes = None if args.kv_dtype else (2.0 if args.kv_bytes is None else args.kv_bytes)
    m = cap.model_shape(args.model)
    c = cap.capacity(m, args.accelerator, devices=args.devices, precision=args.precision,
                     kv_dtype_bytes=kv_bytes, kv_dtype=args.kv_dtype, overhead_reserve=args.reserve,
                     block_size=args.block_size, context=args.context,
                     hosts=args.hosts, chunk=args.chunk)  # fmt: skip
    where = f"{c.hosts} hosts x {c.devices}" if c.hosts > 1 else f"{c.devices}"
    print(f"{c.model} ({args.precision}) on {where} x {c.accelerator}")
    print(f"  weights          {c.weight_bytes / 1e9:10.1f} GB")
    print(f"  KV per token     {c.kv_bytes_per_token:10,.0f} bytes")
    reserve = f"{args.reserve:.0%} reserve held back"
    print(f"  usable for KV    {c.usable_kv_bytes / 1e9:10.1f} GB ({reserve})")
    if c.hosts > 1:
        print(f"  KV per host      {c.kv_bytes_per_host / 1e9:10.1f} GB (the pool split "
              "evenly over the hosts)")  # fmt: skip
    if m.is_hybrid:
        _print_layouts(c, m)
    else:
        print(f"  KV blocks        {c.kv_blocks:10,} of {c.block_size} tokens = "
              f"{c.kv_tokens:,} tokens")  # fmt: skip
        print(f"  sequences of {c.context:,} tokens at once: {c.max_concurrent_seqs:,}")
    try:
        cfg = c.scheduler_config()
    except cap.CapacityError:
        print(f"  kvsched.SchedulerConfig: none (pages of every layer hold no sequence of "
              f"{c.context:,} tokens)")  # fmt: skip
    else:
        uniform = "  (pages of every layer)" if m.is_hybrid else ""
        print(f"  kvsched.SchedulerConfig(num_blocks={cfg.num_blocks}, "
              f"block_size={cfg.block_size}, max_seq_len={cfg.max_seq_len}, "
              f"max_num_seqs={cfg.max_num_seqs}, overhead_reserve=0.0){uniform}")  # fmt: skip
    if m.is_hybrid and c.hybrid_seqs > 0:
        h = c.scheduler_config("hybrid")
        print(f"  kvsched.SchedulerConfig(num_blocks={h.num_blocks}, "
              f"block_size={h.block_size}, max_seq_len={h.max_seq_len}, "
              f"max_num_seqs={h.max_num_seqs}, overhead_reserve=0.0, "
              f"long_prefill_chunk={h.long_prefill_chunk}, "
              f"kv_cache_groups={h.kv_cache_groups})  (KV-cache groups)")  # fmt: skip
    if c.devices * c.hosts > 1:
        _print_allreduce(args, m, min(c.hybrid_seqs, 1024))
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
            max_rate = load_max_rate(
                args.max_rate_json, model=m.name, accelerator=args.accelerator,
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
                  f"{max_rate.output_tokens_per_s:,.0f}), from "
                  f"{max_rate.describe(args.max_rate_json)}")  # fmt: skip
        elif "self_hosted" in names:
            print(f"  self_hosted units: accelerators ({args.accelerator}) of --device-tps "
                  f"{args.device_tps:g} tokens/s each, as given (not derived from the "
                  f"capacity above)")  # fmt: skip
        if left_out:
            print(f"  {left_out}")
    return 0


def _print_layouts(c: Any, m: Any) -> None:
    """The hybrid and the uniform layout of a hybrid model's KV side by side:
    pages, what one request of the context reserves, sequences that fit."""
    h, u = c.hybrid, c.uniform
    print(f"  layers           {m.layers:10,} ({m.kinds_summary()})")
    if h is u:
        print("  no full-attention layer: KV-cache groups need one (group 0), so every page "
              "holds every layer")  # fmt: skip
    print(f"  {'KV layout':<29}{'hybrid':>10} {'uniform':>10}")
    rows = (
        ("KV-cache groups", h.layout.num_groups, u.layout.num_groups),
        ("layers a page", h.layers_per_page, u.layers_per_page),
        (f"pages of {c.block_size} tokens", h.blocks, u.blocks),
        ("pages a request reserves", h.pages_per_seq, u.pages_per_seq),
        (f"sequences of {c.context:,}", h.seqs, u.seqs),
    )
    for label, hybrid, uniform in rows:
        print(f"    {label:<27}{hybrid:>10,} {uniform:>10,}")
    # A request's pages per kind of group: the full groups hold every page of
    # the context, a window group what its window and the chunk can touch.
    per_kind = dict(zip(h.layout.groups, h.group_pages, strict=True))
    print("  hybrid: a request of {:,} tokens reserves {} (long-prefill chunk {:,})".format(
        c.context, ", ".join(f"{n:,} pages in each {k} group" for k, n in per_kind.items()),
        c.chunk))  # fmt: skip
    n = c.max_concurrent_seqs
    print(f"  each layer keeping only the tokens it attends: {n:,} "
          f"sequence{'' if n == 1 else 's'}")  # fmt: skip


def _print_allreduce(args: argparse.Namespace, m: Any, decode_seqs: int) -> None:
    """What tensor parallelism's all-reduces cost a decode step of
    `decode_seqs` sequences at half the context and a 2,048-token prefill step,
    in the step-cost model (sim/simulator.py)."""
    import numpy as np

    from kvsched.shapes import ACCELERATORS
    from kvsched.sim.simulator import StepCost

    cost = StepCost(m, ACCELERATORS[args.accelerator], devices=args.devices, hosts=args.hosts,
                    precision=args.precision)  # fmt: skip
    print("  tensor-parallel all-reduces per step (2 per layer, not overlapped; step-cost model):")
    decode_kv = cost.kv_tokens_read(np.full(decode_seqs, args.context // 2), np.ones(decode_seqs))
    for what, tokens, kv in (
        (f"decode, {decode_seqs} seqs", decode_seqs, decode_kv),
        ("prefill, 2,048 tokens", 2048, cost.kv_tokens_read(np.array([2048]), np.array([2048]))),
    ):
        ar, step = cost.allreduce_seconds(tokens), cost.seconds(tokens, kv)
        across = cost.host_bytes(tokens)
        hosts = f", {across / 1e6:,.1f} MB each host sends the others" if args.hosts > 1 else ""
        print(f"    {what:<22} {ar * 1e3:8.2f} ms of a {step * 1e3:.2f} ms step "
              f"({ar / step:.0%}){hosts}")  # fmt: skip


def _model(value: str) -> str:
    """--model: a preset's name or the path of a file (read when the command runs)."""
    from kvsched.shapes import MODELS

    if value in MODELS or os.path.isfile(value):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is neither a preset ({', '.join(sorted(MODELS))}) nor a config.json file"
    )


def add_parsers(sub: Any) -> None:
    """The `capacity` sub-command."""
    from kvsched.shapes import ACCELERATORS, MODELS

    c = sub.add_parser("capacity", help="KV capacity, the matching SchedulerConfig, cost")
    # Not preset_options: a model here may also be a config.json.
    c.add_argument("--model", default="llama-3-8b", metavar="PRESET|CONFIG.JSON", type=_model,
                   help=f"model preset ({', '.join(sorted(MODELS))}) or the path of a Hugging "
                   "Face config.json (default llama-3-8b)")  # fmt: skip
    c.add_argument("--accelerator", default="h100", choices=sorted(ACCELERATORS),
                   help="accelerator preset (default h100)")  # fmt: skip
    c.add_argument("--devices", type=int, default=1,
                   help="accelerators, tensor parallel, memory summed as one big device; per "
                   "host with --hosts (count; default 1)")  # fmt: skip
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
    c.add_argument("--chunk", type=int, default=512,
                   help="long-prefill chunk in tokens a request is admitted with: what a "
                   "sliding-window group reserves beside its window (default 512, the "
                   "scheduler's)")  # fmt: skip
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
