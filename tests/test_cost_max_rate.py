"""`kvsched capacity --max-rate-json FILE`: self-hosting costed at the replica's
throughput the simulator's max-rate search found, refused for another model,
accelerator or device count, and the output says where the figure came from."""

from __future__ import annotations

import json

import pytest

from kvsched.capacity import CapacityError
from kvsched.cli import main
from kvsched.maxrate_result import load_max_rate


def max_rate(**over) -> dict:
    data = {
        "multiplier": 2.5, "requests_per_s": 6.5, "output_tokens_per_s": 1500.0,
        "input_tokens_per_s": 8500.0, "model": "llama-3-8b", "accelerator": "h100",
        "devices": 1, "trace": "azure", "attainment_target": 0.99,
        "binding": {"tenant": "interactive", "constraint": "ttft"},
        "slos": {"interactive": {"ttft_s": 1.0, "itl_s": 0.1}},
    }  # fmt: skip
    data.update(over)
    return data


def write(tmp_path, name="mr.json", **over) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(max_rate(**over)))
    return str(path)


COST = ["capacity", "--load", "25000", "--payg", "10", "--device-hour", "3",
        "--engineering-hour", "1"]  # fmt: skip


def test_self_hosting_is_costed_at_the_simulated_max_rate(tmp_path, capsys):
    path = write(tmp_path)
    assert main([*COST, "--max-rate-json", path]) == 0
    out = capsys.readouterr().out
    # 25,000 tokens/s over 10,000 a replica (8,500 prompt + 1,500 output): 3
    # replicas of 1 x H100 at $3, + $1 engineering = $10/h, 83% utilized.
    assert "self_hosted         10.00 $/h  units    3  utilization 83%" in out
    assert ("self_hosted units: replicas of 1 x h100 (1 x --device-hour), 10,000 tokens/s "
            "each (prompt 8,500 + output 1,500), from the simulator's max rate") in out  # fmt: skip
    assert f"({path}: trace azure, 2.5x = 6.50 req/s at attainment 0.99, binding " \
           "interactive ttft)" in out  # fmt: skip
    assert "--device-tps" not in out


def test_a_replica_of_several_devices_is_one_unit(tmp_path, capsys):
    path = write(tmp_path, model="llama-3-70b", devices=2, output_tokens_per_s=2000.0,
                 input_tokens_per_s=3000.0)  # fmt: skip
    args = ["capacity", "--model", "llama-3-70b", "--devices", "2", "--load", "12000",
            "--payg", "10", "--device-hour", "3", "--engineering-hour", "1"]  # fmt: skip
    assert main([*args, "--max-rate-json", path]) == 0
    out = capsys.readouterr().out
    # 12,000 / 5,000 -> 3 replicas of 2 devices at 2 x $3, + $1 = $19/h.
    assert "self_hosted         19.00 $/h  units    3" in out
    assert "replicas of 2 x h100 (2 x --device-hour), 5,000 tokens/s each" in out


@pytest.mark.parametrize(
    ("over", "args", "why"),
    [
        ({"model": "mistral-7b"}, [], "serving mistral-7b, not of 1 x h100 serving llama-3-8b"),
        ({"accelerator": "h200"}, [], "1 x h200 serving llama-3-8b, not of 1 x h100"),
        ({"devices": 2}, [], "2 x h100 serving llama-3-8b, not of 1 x h100"),
        ({"output_tokens_per_s": 0.0, "input_tokens_per_s": 0.0}, [], "no load met the SLOs"),
        ({"multiplier": "fast"}, [], "not a max-rate result"),
    ],
)
def test_a_file_for_something_else_is_refused(tmp_path, capsys, over, args, why):
    path = write(tmp_path, **over)
    assert main([*COST, *args, "--max-rate-json", path]) == 2
    assert why in capsys.readouterr().err


def test_inconsistent_options_are_refused(tmp_path, capsys):
    path = write(tmp_path)
    assert main([*COST, "--device-tps", "100", "--max-rate-json", path]) == 2
    assert "--max-rate-json or --device-tps, not both" in capsys.readouterr().err
    assert main(["capacity", "--load", "100", "--payg", "10", "--max-rate-json", path]) == 2
    assert "--device-hour is needed" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(CapacityError, match="not JSON"):
        load_max_rate(str(tmp_path / "bad.json"), model="llama-3-8b", accelerator="h100",
                      devices=1)  # fmt: skip
    missing = max_rate()
    del missing["requests_per_s"]
    (tmp_path / "missing.json").write_text(json.dumps(missing))
    with pytest.raises(CapacityError, match="requests_per_s"):
        load_max_rate(str(tmp_path / "missing.json"), model="llama-3-8b", accelerator="h100",
                      devices=1)  # fmt: skip
