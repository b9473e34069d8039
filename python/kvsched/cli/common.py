"""What the `kvsched` sub-commands share: the engine options, the progress
bar, the output-file check."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any


def progress() -> tuple[Any, Callable[[str, int, int], None]]:
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


def check_writable(path: str, option: str) -> None:
    """Refuse an output file whose folder is missing (or is a folder itself)
    before a long run, not after it."""
    p = Path(path)
    if p.is_dir() or not p.parent.is_dir():
        raise ValueError(f"{option} {path}: no such folder to write the file in"
                         if not p.is_dir() else f"{option} {path} is a folder")  # fmt: skip


def preset_options(
    p: argparse.ArgumentParser, *, devices: int = 1,
    devices_help: str = "accelerators, tensor parallel (count; default 1)",
) -> None:  # fmt: skip
    """--model, --accelerator (the capacity presets) and --devices: what
    capacity, simulate, sweep and mix size the engine from."""
    from kvsched.shapes import ACCELERATORS, MODELS

    p.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS),
                   help="model preset (default llama-3-8b)")  # fmt: skip
    p.add_argument("--accelerator", default="h100", choices=sorted(ACCELERATORS),
                   help="accelerator preset (default h100)")  # fmt: skip
    p.add_argument("--devices", type=int, default=devices, help=devices_help)


def engine_options(
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
    preset_options(p, devices=devices, devices_help=devices_help)
    if context:
        p.add_argument("--context", type=int, default=8192,
                       help="max sequence length in tokens, raised to the workload's longest "
                       "(default 8192)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=128, help=seqs_help)
    p.add_argument("--max-batched-tokens", type=int, default=budget, help=budget_help)
    p.add_argument("--chunk", type=int, default=2048, help=chunk_help)
