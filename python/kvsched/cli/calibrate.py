"""`kvsched calibrate`: the simulator's step cost fitted to the engine here."""

from __future__ import annotations

import argparse
from typing import Any

from kvsched.cli.common import check_writable


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

    check_writable(args.out, "--out")  # before minutes of measuring
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

        gg = load_gguf(model_files.fetch(), name=model_files.SMOLLM2_135M.model_name)
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
    from kvsched.shapes import MODELS

    fitted = c.cost.model.name
    use = f"kvsched simulate --model {fitted} --step-cost {args.out}"
    if fitted not in MODELS:
        use = f"StepCost.load in a study of {fitted}; kvsched simulate's presets refuse it"
    print(f"wrote {args.out} ({use})")
    return 0


def add_parsers(sub: Any) -> None:
    """The `calibrate` sub-command."""
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
