"""`kvsched --help` says what the command does: serve, capacity, simulation."""

from __future__ import annotations

import pytest

from kvsched.cli import main


def test_help_names_serving_capacity_and_simulation(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the description
    assert ("kvsched: serve a model (OpenAI-compatible), price capacity, and simulate or "
            "study traces through the real scheduler") in out  # fmt: skip
    listed = set(out.split("{", 1)[1].split("}", 1)[0].split(","))
    assert {"serve", "capacity", "simulate"} <= listed, listed
