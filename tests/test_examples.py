"""The examples run as tests, so the README's commands keep working."""

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_accounts_for_every_request(capsys):
    table = load("quickstart").main(seed=1, n_requests=300)
    assert sum(sum(row.values()) for row in table.values()) == 300
    assert all(row["admitted"] > 0 for row in table.values())
    assert "rejections by reason" in capsys.readouterr().out
