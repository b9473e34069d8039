"""The README's code blocks run as written.

Python blocks run in order in one namespace (as a reader pastes them into one
session). Bash blocks: every `kvsched ...` command runs (through `python -m
kvsched`, in a scratch directory), every `python examples/...` command too (from the
repository root); the install, test and example commands are
what `.ci/run` and tests/test_examples.py run themselves, so they are checked
to be exactly those. `text` blocks are printed output, not commands.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
# Commands .ci/run or the example tests already run; anything else in a bash
# block must be a `kvsched` command.
COVERED = (
    'pip install -e ".[engine]" && python examples/engine.py',
    "bash .ci/run",
    'pip install -e ".[test]"',
    'pip install -e ".[engine,serve]"',
    "cargo test",
    "python -m pytest",
    "python -m mypy.stubtest kvsched._core",
    "python -m mypy --strict examples/",  # tests/test_stub.py runs it
    "KVSCHED_HYPOTHESIS=long python -m pytest",
)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall(README.read_text()) if kind == lang]


def commands(body: str) -> list[str]:
    """Logical lines (continuations joined), comments dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def test_the_readme_has_python_and_bash_blocks():
    assert len(blocks("python")) >= 2 and len(blocks("bash")) >= 3


def test_python_blocks_run_as_written(tmp_path, monkeypatch):
    """Blocks that call the server (`OpenAI(base_url=...:8000)`) run against a
    `kvsched serve` started here with the README's tenants file, on a free port
    written in place of 8000."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    server = None
    try:
        for body in blocks("python"):
            if "127.0.0.1:8000" in body:
                if server is None:
                    server, url = start_readme_server(tmp_path)
                body = body.replace("http://127.0.0.1:8000", url)
            exec(compile(body, str(README), "exec"), namespace)  # noqa: S102
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)


def start_readme_server(tmp_path):
    """`kvsched serve` over the real model with the README's tenants file."""
    for name in ("fastapi", "uvicorn", "openai", "gguf"):
        pytest.importorskip(name)
    from serve_helpers import start_serve
    from smollm2_helpers import smollm2

    smollm2()  # skips with the reason when the model cannot be fetched
    (toml,) = blocks("toml")
    (tmp_path / "tenants.toml").write_text(toml)
    return start_serve(
        ["--tenants", str(tmp_path / "tenants.toml"), "--max-seq-len", "256"],
        cwd=tmp_path,
        timeout=300,
    )


def test_bash_blocks_are_covered_or_run(tmp_path):
    pytest.importorskip("matplotlib")
    ran = 0
    for body in blocks("bash"):
        for cmd in commands(body):
            if cmd.startswith(COVERED):
                continue
            args = shlex.split(cmd)
            if args[0] == "python" and args[1].startswith("examples/"):
                argv, cwd = [sys.executable, *args[1:]], README.parent
            else:
                assert args[0] == "kvsched", f"a README command no test runs: {cmd!r}"
                argv, cwd = [sys.executable, "-m", "kvsched", *args[1:]], tmp_path
            done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"{cmd}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            ran += 1
    assert ran >= 4
