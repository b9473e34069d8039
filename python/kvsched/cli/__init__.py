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
                                    the OpenAI-compatible server (pip install -e ".[engine,serve]")
kvsched fetch-model [smollm2-135m|gemma3-270m]
                                    fetch a model's GGUF into the cache (default SmolLM2)
kvsched eval-kv [--kv-dtype int8] [--prompts N] [--tokens N]
                                    the int8 KV gate: measured on the real model, saved
"""

from __future__ import annotations

import argparse
import sys

from kvsched._extras import MissingExtra, require
from kvsched.cli import calibrate, capacity, serve, simulate, study

# The extras each sub-command needs (pyproject.toml's optional dependencies);
# --plots needs "sim" as well, wherever it is offered.
NEEDS: dict[str, tuple[str, ...]] = {
    "serve": ("engine", "serve"),
    "eval-kv": ("engine",),
    "calibrate": ("engine",),
}


def build_parser() -> argparse.ArgumentParser:
    """The `kvsched` command line: every option carries help text with its unit
    and default (tests/test_capacity.py walks it)."""
    ap = argparse.ArgumentParser(
        prog="kvsched",
        description="kvsched: serve a model (OpenAI-compatible), price capacity, and "
        "simulate or study traces through the real scheduler",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    for commands in (capacity, simulate, study, calibrate, serve):
        commands.add_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command == "capacity" and args.kv_dtype and args.kv_bytes is not None:
        ap.error("--kv-dtype and --kv-bytes: give one")
    import kvsched
    from kvsched.model_files import ModelFetchError

    needs = NEEDS.get(args.command, ()) + (("sim",) if getattr(args, "plots", None) else ())
    try:
        if needs:  # before any work: a missing extra is one line, not a traceback
            require(f"kvsched {args.command}{' --plots' if 'sim' in needs else ''}", *needs)
        return int(args.func(args))
    except MissingExtra as e:
        print(e, file=sys.stderr)
        return 2
    except (ValueError, OSError, ModelFetchError, kvsched.KvSchedError) as e:
        # CapacityError and UnsupportedConfig are ValueErrors.
        print(f"kvsched {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
