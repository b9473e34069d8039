"""A feature used without its pip extra says in one line which `pip install`
brings it (not a bare ModuleNotFoundError traceback). Each case runs in a
fresh interpreter where the extra's module cannot be imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]


def run_without(module: str, code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # None in sys.modules makes `import module` raise ModuleNotFoundError, as
    # when it is not installed.
    prelude = f"import sys; sys.modules[{module!r}] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)  # fmt: skip


CLI = "from kvsched.cli import main; sys.exit(main({argv!r}))"


@pytest.mark.parametrize(
    ("module", "argv", "extras"),
    [
        ("fastapi", ["serve", "--tenants", "t.toml"], "engine,serve"),
        ("uvicorn", ["serve", "--tenants", "t.toml"], "engine,serve"),
        ("jax", ["serve", "--tenants", "t.toml"], "engine,serve"),
        ("jax", ["eval-kv"], "engine"),
        ("jax", ["calibrate", "--out", "x.json", "--model", "tiny"], "engine"),
        ("matplotlib", ["simulate", "--trace", "azure", "--plots", "plots"], "sim"),
        ("matplotlib", ["sweep", "chunk", "--plots", "plots"], "sim"),
    ],
)
def test_a_command_without_its_extra_names_the_pip_install_in_one_line(
    tmp_path, module, argv, extras
):
    done = run_without(module, CLI.format(argv=argv), tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, f"one line, not a traceback: {done.stderr}"
    assert f"needs {module}" in done.stderr
    assert f'pip install -e ".[{extras}]"' in done.stderr
    assert not (tmp_path / "plots").exists(), "refused before any work"


def test_the_engine_package_without_jax_names_the_engine_extra(tmp_path):
    done = run_without("jax", "import kvsched.engine.runner", tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvsched._extras.MissingExtra: kvsched.engine needs jax")
    assert 'pip install -e ".[engine]"' in last


def test_the_example_engine_without_jax_says_so_in_one_line(tmp_path):
    script = str(ROOT / "examples" / "engine.py")
    code = f"sys.argv = [{script!r}]; import runpy; runpy.run_path({script!r}, run_name='__main__')"
    done = run_without("jax", code, tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "examples/engine.py: kvsched.engine needs jax, which the engine extra installs: "
        'pip install -e ".[engine]"'
    )


def test_the_core_needs_no_extra(tmp_path):
    code = "import kvsched; kvsched.Scheduler(kvsched.SchedulerConfig()); print('ok')"
    for module in ("jax", "fastapi", "matplotlib"):
        done = run_without(module, code, tmp_path)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
