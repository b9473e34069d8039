"""benches/tpu_check.py (and its exit codes) in Pallas' CPU interpreter: one real
mixed plan against the reference, then the decode timing table with the cost
model's columns. (benches/gpu_check.py's small run is in test_examples.py.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tpu_check_runs_small_in_the_interpreter(capsys):
    pytest.importorskip("jax")
    check = load("tpu_check")
    out = check.main(["--small"])
    text = capsys.readouterr().out
    assert out["ran"] and out["ok"] and out["mixed"], text
    assert check.exit_code(out) == 0
    assert out["max_error"]["pallas"] < 1e-2
    assert "a mixed one" in text
    header = next(line for line in text.splitlines() if line.strip().startswith("kernel"))
    assert header.split()[:8] == ["kernel", "ms", "GB/s", "HBM", "model", "ms", "model", "HBM"]
    names = ("pallas", "jax", "reference")
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith("  ") and line.split()[0] in names}  # fmt: skip
    assert "pallas" in rows and "reference" in rows
    assert ("jax" in rows) == out["jax_backend"]
    if not out["jax_backend"]:
        assert "backend 'jax' is not in this tree" in text
    pallas = out["decode"]["pallas"]
    assert float(rows["pallas"][1]) == pytest.approx(pallas["s"] * 1e3, rel=1e-3, abs=1e-3)
    assert rows["pallas"][3].endswith("%") and rows["pallas"][5].endswith("%")
    assert rows["pallas"][6] == "latency"
    assert 0 < pallas["model_hbm"] < 1 and pallas["model_s"] > 0
    assert rows["reference"][4:6] == ["-", "-"]
    # One kvsched kernel: the one a TPU runs (kernels/tpu.py), checked and timed as pallas.
    assert set(out["max_error"]) <= {"pallas", "jax"}
    assert set(out["decode"]) <= {"pallas", "jax", "reference"}


@pytest.mark.subprocess
def test_the_check_scripts_exit_codes():
    pytest.importorskip("jax")
    for name in ("tpu_check", "gpu_check"):
        check = load(name)
        assert check.exit_code({"ran": False}) == 2
        assert check.exit_code({"ran": True, "ok": False}) == 1
        assert check.exit_code({"ran": True, "ok": True}) == 0
    # Without a TPU and without --small it says so and exits 2, running nothing.
    run = subprocess.run([sys.executable, str(BENCHES / "tpu_check.py")], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "no TPU visible" in run.stdout
