""".ci/run's own parts: the tools it checks before it starts, and its CUDA-lowering
step, which must see the packages of the environment it is run from (a
virtualenv's included, as a newcomer runs it) and leave the plugin nowhere."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_ci(
    tmp_path: Path, tools: dict[str, str], python: str = sys.executable
) -> subprocess.CompletedProcess[str]:
    """`bash .ci/run` with a PATH of only `dirname` and the given fake tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    for name, script in tools.items():
        (bin_dir / name).write_text(f"#!{shutil.which('bash')}\n{script}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "PYTHON": python, "HOME": str(tmp_path)}
    return subprocess.run([shutil.which("bash"), ".ci/run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.subprocess
def test_ci_run_without_rust_names_it_and_how_to_get_it_before_anything_runs(tmp_path):
    done = run_ci(tmp_path, {})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "missing: a Rust toolchain (cargo" in done.stderr
    assert "https://sh.rustup.rs" in done.stderr
    assert "==>" not in done.stdout, "a step ran before the tools were checked"


@pytest.mark.subprocess
def test_ci_run_names_a_missing_clippy_and_rustfmt(tmp_path):
    # A cargo that has neither component (rustup's minimal profile).
    done = run_ci(tmp_path, {"cargo": '[ "$1" = "--version" ] && exit 0; exit 1'})
    assert done.returncode == 2
    assert "missing: rustfmt" in done.stderr and "rustup component add rustfmt" in done.stderr
    assert "missing: clippy" in done.stderr and "rustup component add clippy" in done.stderr
    assert "Rust toolchain" not in done.stderr


@pytest.mark.subprocess
def test_ci_run_refuses_a_python_older_than_3_10(tmp_path):
    old = tmp_path / "python-old"
    old.write_text(f"#!{shutil.which('bash')}\n[ \"$1\" = -V ] && echo 'Python 3.8.10'; exit 1\n")
    old.chmod(0o755)
    done = run_ci(tmp_path, {"cargo": "exit 0"}, python=str(old))
    assert done.returncode == 2
    assert "Python 3.10 or newer" in done.stderr and "Python 3.8.10" in done.stderr


def ci_commands() -> list[str]:
    """.ci/run's commands: comments dropped, continued lines joined."""
    text = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    lines = [re.sub(r"(^|\s)#.*", "", line).strip() for line in text.splitlines()]
    return [" ".join(line.split()) for line in lines if line]


def test_the_cuda_lowering_step_runs_through_the_venv_safe_helper():
    """The step that lowers the GPU kernel for cuda runs pytest through
    .ci/with_cuda_plugin.py with the interpreter .ci/run was given (the same
    environment, a virtualenv's included); nothing in .ci/run makes a venv (a
    throwaway `venv --system-site-packages` made from a virtualenv sees the base
    interpreter's packages, not the venv's: pytest there lacks them)."""
    commands = ci_commands()
    (lowering,) = [c for c in commands if "lowers_to_triton_for_cuda" in c]
    assert lowering.startswith('"$PY" .ci/with_cuda_plugin.py -m pytest '), lowering
    assert "tests/test_engine_attention.py" in lowering
    made = [c for c in commands if "venv" in c or "--system-site-packages" in c]
    assert not made, made


def venv_seeing_this_environment(where: Path) -> Path:
    """A virtualenv without the system's site-packages whose own site-packages
    holds a module nothing else has and a .pth that adds this interpreter's
    site-packages (as a user's venv holds what the README installs): the python
    inside it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    own = Path(purelib)
    (own / "kvsched_ci_venv_probe.py").write_text("WHERE = 'the venv'\n")
    ours = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    lines = [f"import site; site.addsitedir({p!r})" for p in dict.fromkeys(ours)]
    (own / "zz_outer.pth").write_text("\n".join(lines) + "\n")
    return python


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_cuda_lowering_step_sees_the_venv_it_runs_from(tmp_path):
    """From a venv whose packages live in the venv alone, the step's child sees
    them and the plugin; the plugin is gone afterwards. (The step used a throwaway
    `venv --system-site-packages`, which from a venv sees the base interpreter's
    packages instead: the probe import failed, as hypothesis did for a newcomer.)"""
    pytest.importorskip("jax")
    python = venv_seeing_this_environment(tmp_path / "venv")
    probe = "import kvsched_ci_venv_probe, jax_cuda12_plugin, jax; print('seen', jax.__version__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(python), str(ROOT / ".ci" / "with_cuda_plugin.py"), "-c", probe],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    out = done.stdout + done.stderr
    if "wheel here: the Triton lowering check is skipped" in out:
        pytest.skip("no jax-cuda12-plugin wheel can be installed here (no package index?)")
    assert done.returncode == 0, out
    assert "seen" in done.stdout
    gone = subprocess.run([str(python), "-c", "import jax_cuda12_plugin"],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert gone.returncode != 0, "the plugin stayed in the environment"
