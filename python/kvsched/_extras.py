"""The optional features and the pip extra that brings each.

The core (`kvsched.Scheduler` and friends) needs numpy alone. The engine, the
server and the plots need more; a feature used without its extra says so in one
line, naming the `pip install` that brings it, instead of a bare
ModuleNotFoundError from deep inside an import.
"""

from __future__ import annotations

import importlib

# The modules each extra installs that kvsched imports (pyproject.toml's
# [project.optional-dependencies] has the distributions and versions).
EXTRAS: dict[str, tuple[str, ...]] = {
    "engine": ("jax", "gguf", "tokenizers", "safetensors", "jinja2", "rich"),
    "serve": ("fastapi", "uvicorn"),
    "sim": ("matplotlib",),
}


class MissingExtra(ModuleNotFoundError):
    """A feature's optional dependency is not installed; the message says which
    `pip install` brings it (`name` is the missing module, as Python's)."""


def install_hint(*extras: str) -> str:
    """The command that installs these extras from a kvsched checkout."""
    return f'pip install -e ".[{",".join(extras)}]"'


def require(feature: str, *extras: str, modules: tuple[str, ...] | None = None) -> None:
    """Import what `feature` needs from `extras` (every module they install, or
    only `modules`); raise MissingExtra naming the first one missing."""
    for extra in extras:
        names = EXTRAS[extra] if modules is None else [m for m in modules if m in EXTRAS[extra]]
        for name in names:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name is None or e.name.split(".")[0] != name.split(".")[0]:
                    raise  # something inside it is missing: not ours to explain
                raise MissingExtra(
                    f"{feature} needs {name}, which the {extra} extra installs: "
                    f"{install_hint(*extras)}",
                    name=name,
                ) from None
