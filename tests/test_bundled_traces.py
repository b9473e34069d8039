"""The two public traces ship inside the package (package data read through
importlib.resources), so the simulator's defaults work from an installed wheel,
and no code path reads the development checkout's ../shared folder."""

from __future__ import annotations

import gzip

try:
    import tomllib
except ImportError:  # pragma: no cover (Python 3.10)
    import tomli as tomllib  # type: ignore[no-redef]
from importlib import resources
from pathlib import Path

import pytest

from kvsched.sim import prefix_replay
from kvsched.sim.traces import bundled, read_azure, read_mooncake

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "kvsched"


def test_bundled_traces_open_through_importlib_resources():
    traces = resources.files("kvsched").joinpath("data", "traces")
    for name in ("azure_code_2023.csv.gz", "mooncake_synthetic.jsonl.gz"):
        with traces.joinpath(name).open("rb") as raw, gzip.open(raw, "rt") as f:
            assert f.readline().strip()
    readme = traces.joinpath("README.md").read_text()
    assert "CC-BY 4.0" in readme and "Apache-2.0" in readme
    assert "Microsoft Azure, AzurePublicDataset" in readme  # CC-BY's attribution


def test_readers_default_to_the_bundled_traces_whole():
    azure = read_azure()
    assert len(azure) == 8819  # the trace's README: one hour, 8,819 requests
    assert azure[0].arrival == 0.0
    assert len(read_mooncake()) == 3993
    assert len(read_mooncake(bundled("mooncake"), limit=10)) == 10
    with pytest.raises(ValueError, match="no bundled trace"):
        bundled("sharegpt")


def test_bundled_traces_match_the_test_excerpts():
    head = ROOT / "tests" / "data" / "azure_code_head400.csv"
    assert read_azure(bundled("azure"), limit=399) == read_azure(head)
    head = ROOT / "tests" / "data" / "mooncake_head600.jsonl"
    assert read_mooncake(bundled("mooncake"), limit=600) == read_mooncake(head)


def test_no_code_path_reads_outside_the_package():
    for f in PACKAGE.rglob("*.py"):
        text = f.read_text()
        assert "shared/traces" not in text, f"{f} reads the checkout's shared folder"
        assert "parents[2]" not in text and "parents[3]" not in text, f
    assert not hasattr(prefix_replay, "DEFAULT_TRACE")


def test_the_wheel_includes_the_package_data():
    # maturin puts everything under python-source/kvsched in the wheel unless
    # excluded; make sure nothing excludes the traces.
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["maturin"]
    assert tool["python-source"] == "python"
    for pattern in tool.get("exclude", []):
        assert "data" not in str(pattern) and ".gz" not in str(pattern)
    assert (PACKAGE / "data" / "traces" / "azure_code_2023.csv.gz").is_file()


def test_cli_and_prefix_replay_defaults_run_anywhere(tmp_path, monkeypatch, capsys):
    from kvsched.cli import main

    monkeypatch.chdir(tmp_path)  # nothing relative to the checkout
    assert main(["simulate", "--trace", "azure", "--limit", "40", "--scenarios", "continuous"]) == 0
    assert "40 requests (azure)" in capsys.readouterr().out
    prefix_replay.main(["--limit", "30", "--pools", "262144"])
    assert "30 requests" in capsys.readouterr().out
