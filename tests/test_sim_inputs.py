"""Unusual inputs a capacity planner may bring to the simulator, the max-rate
search, `kvsched mix`, `kvsched sweep` and `kvsched capacity` (workloads that
draw nothing, hand-edited files, conflicting options, infinite loads, output
paths that cannot be written): each is refused with a clear, typed error before
anything runs, or printed for what it is."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvsched.cli import main
from kvsched.maxrate_result import load_max_rate
from kvsched.sim import maxrate, mix, setup, sweeps
from kvsched.sim.simulator import StepCost, StepCostError
from kvsched.sim.slo import parse_slos

DATA = Path(__file__).parent / "data"
AZURE = str(DATA / "azure_code_head400.csv")


def test_a_max_rate_search_refuses_a_workload_arriving_all_at_once():
    # Every request at 0 s: a multiplier divides the arrival times and changes
    # nothing, so a search would climb to its limit and print "0 req/s".
    arrivals, tenants = setup.file_workload(
        [{"prompt_tokens": 100, "output_tokens": 20, "arrival_s": 0}] * 3
    )
    engine = setup.engine_for(arrivals)
    with pytest.raises(ValueError, match="at one instant"):
        maxrate.find_max_rate(arrivals, tenants, engine, parse_slos(["*:ttft=1,itl=0.1"]))


def _max_rate_file(tmp_path, **over):
    data = {"multiplier": 1024.0, "requests_per_s": 2048.0, "output_tokens_per_s": 300.0,
            "input_tokens_per_s": 3000.0, "model": "llama-3-8b", "accelerator": "h100",
            "devices": 1, "trace": "t.csv", "attainment_target": 0.99, "binding": None,
            "slos": {"default": "ttft=100,itl=100"}, "upper": None}  # fmt: skip
    data.update(over)
    path = tmp_path / "mr.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_max_rate_no_load_bound_is_costed_as_a_lower_bound(tmp_path, capsys):
    mr = load_max_rate(_max_rate_file(tmp_path), model="llama-3-8b", accelerator="h100",
                       devices=1)  # fmt: skip
    said = mr.describe()
    assert "?" not in said
    assert "lower bound" in said and "1024x" in said
    bound = load_max_rate(
        _max_rate_file(tmp_path, binding={"tenant": "a", "constraint": "ttft"}, upper=1.1),
        model="llama-3-8b", accelerator="h100", devices=1,
    )  # fmt: skip
    assert "binding a ttft" in bound.describe() and "lower bound" not in bound.describe()


def test_rate_with_time_scale_is_refused(tmp_path, capsys):
    # --time-scale would stretch the drawn times while the search's other
    # seeds are drawn at --rate itself (and the header prints --rate).
    path = tmp_path / "t.csv"
    path.write_text("prompt_tokens,output_tokens\n100,20\n200,30\n")
    assert main(["simulate", "--trace-path", str(path), "--rate", "2", "--time-scale", "2",
                 "--scenarios", "continuous"]) == 2  # fmt: skip
    out, err = capsys.readouterr()
    assert "--time-scale" in err and "--rate" in err and out == ""


@pytest.mark.parametrize("over", [{"chat_rate": 0.0}, {"docs_rate": -1.0},
                                  {"docs_rate": float("nan")}, {"chat_output": 0},
                                  {"seconds": 0.0}])  # fmt: skip
def test_a_mix_workload_with_a_rate_that_draws_nothing_is_refused(over):
    with pytest.raises(ValueError):
        mix.MixWorkload(**over)


def test_mix_refuses_bad_machine_options_before_printing_anything(capsys):
    assert main(["mix", "--chat-rate", "0", "--loads", "1", "--arrangements", "apart"]) == 2
    assert main(["mix", "--devices", "3", "--loads", "1", "--seconds", "1"]) == 2
    assert main(["mix", "--arrangements", "together,bogus", "--loads", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "chat" in err and "even" in err and "bogus" in err


def test_an_slo_for_no_tenant_of_the_workload_is_refused(capsys):
    # Taken silently, it would give goodput 0.000 req/s on every row.
    assert main(["sweep", "reserve", "--trace-path", AZURE, "--limit", "5", "--values", "0.1",
                 "--slo", "nobody:ttft=1"]) == 2  # fmt: skip
    assert main(["mix", "--loads", "1", "--seconds", "1", "--arrangements", "together",
                 "--slo", "nobody:ttft=1"]) == 2  # fmt: skip
    out, err = capsys.readouterr()
    assert err.count("'nobody'") == 2 and "interactive" in err and "chat" in err
    assert "goodput" not in out
    arrivals, tenants = setup.named_workload("azure", path=AZURE, limit=5)
    engine = setup.engine_for(arrivals)
    with pytest.raises(ValueError, match="nobody"):
        sweeps.sweep(engine.config, tenants, arrivals, engine.cost, "reserve", [0.1],
                     slos=parse_slos(["nobody:ttft=1"]))  # fmt: skip


@pytest.mark.parametrize("key,value", [("mfu", 0), ("mfu", "0.5"), ("mfu", 1.5),
                                       ("bandwidth_efficiency", 0), ("flop_rate", "1e12"),
                                       ("byte_rate", True), ("overhead_s", None),
                                       ("kv_dtype_bytes", -2), ("activation_bytes", 0),
                                       ("devices", 1.0)])  # fmt: skip
def test_a_hand_edited_step_cost_file_is_refused_with_a_step_cost_error(tmp_path, key, value):
    data = StepCost.preset().to_json()
    data[key] = value
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    with pytest.raises(StepCostError, match=key):
        StepCost.load(path, model="llama-3-8b", devices=1)


def test_simulate_says_where_its_step_times_come_from(tmp_path, capsys):
    # A calibration from another device (CPU here) gives the step times while
    # --accelerator still sizes the pool: the header says both, not only
    # "on 1 x h100".
    where = {"device": "cpu x86_64 x 1 (cpu, jax 0.4)", "backend": "reference"}
    cal = replace(StepCost.preset("llama-3-8b", "h100"), flop_rate=1e12, byte_rate=1e10,
                  calibration=where)  # fmt: skip
    path = tmp_path / "cpu.json"
    cal.save(path)
    args = ["simulate", "--trace", "azure", "--trace-path", AZURE, "--limit", "20",
            "--scenarios", "continuous"]  # fmt: skip
    assert main([*args, "--step-cost", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"step times from {path}" in out and "calibrated on cpu x86_64" in out
    assert "pool sized for h100" in out
    assert main(args) == 0
    assert "step times from h100's peak rates x efficiency" in capsys.readouterr().out


def test_mix_says_the_together_engine_pays_its_all_reduces(capsys):
    # The step cost charges tensor parallelism's all-reduces, and the mix
    # header says so (saying it did not would read as together being
    # flattered).
    assert main(["mix", "--loads", "1", "--seconds", "2", "--docs-rate", "4", "--arrangements",
                 "together"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "all-reduces are charged" in out and "does not charge" not in out
    arrivals = mix.MixWorkload(seconds=2.0, docs_rate=4.0).arrivals()
    whole = setup.engine_for(arrivals, devices=2)
    assert whole.cost.allreduce_seconds(256) > 0


def test_a_limit_below_one_request_is_refused_as_such(capsys):
    assert main(["simulate", "--trace", "azure", "--trace-path", AZURE, "--limit", "0"]) == 2
    assert "--limit" in capsys.readouterr().err
    with pytest.raises(ValueError, match="limit"):
        setup.file_workload([{"prompt_tokens": 10, "output_tokens": 2}], rate=1.0, limit=-3)


def test_a_trace_file_given_with_a_synthetic_workload_is_refused(capsys):
    # kvsched sweep chunk (prefill-vs-decode) runs a synthetic mix: a
    # --trace-path FILE would be ignored, so it is refused, as simulate does.
    assert main(["sweep", "chunk", "--trace-path", AZURE, "--values", "256"]) == 2
    out, err = capsys.readouterr()
    assert "synthetic" in err and out == ""


@pytest.mark.parametrize("args", [["--time-scale", "inf"], ["--load", "inf"],
                                  ["--load", "1e-320"]])  # fmt: skip
def test_an_infinite_load_or_time_scale_is_refused(capsys, args):
    # --time-scale inf would put every arrival at inf s and the replay never
    # end; --load inf would squeeze them all to 0 s and print "load infx".
    assert main(["simulate", "--trace", "azure", "--trace-path", AZURE, "--limit", "20",
                 "--scenarios", "continuous", *args]) == 2  # fmt: skip
    assert "finite" in capsys.readouterr().err
    with pytest.raises(ValueError, match="finite"):
        setup.file_workload([{"prompt_tokens": 10, "output_tokens": 2}], rate=1.0,
                            load=float(args[1]) if args[0] == "--load" else 1e-320)  # fmt: skip


def test_mix_refuses_an_infinite_load():
    with pytest.raises(ValueError, match="finite"):
        mix.MixWorkload(seconds=1.0).arrivals(float("inf"))
    assert main(["mix", "--loads", "1,inf"]) == 2


def test_an_output_file_in_a_missing_folder_is_refused_before_the_run(tmp_path, capsys):
    # Refused at once, not when the result is written after the whole search
    # (or the whole calibration, minutes on a CPU).
    bad = str(tmp_path / "no" / "such.json")
    assert main(["simulate", "--trace", "azure", "--trace-path", AZURE, "--limit", "20",
                 "--find-max-rate", "--slo", "*:ttft=2", "--json", bad]) == 2  # fmt: skip
    out, err = capsys.readouterr()
    assert "--json" in err and "searching" not in out
    assert main(["calibrate", "--out", bad]) == 2
    out, err = capsys.readouterr()
    assert "--out" in err and "calibrating" not in out


@pytest.mark.parametrize("args", [["--precision", "int4"], ["--kv-dtype", "int8"],
                                  ["--kv-bytes", "1"], ["--reserve", "0.3"],
                                  ["--block-size", "32"]])  # fmt: skip
def test_a_max_rate_is_not_costed_for_another_replica_than_the_one_simulated(
    tmp_path, capsys, args
):
    # The search's replica had bf16 weights, bf16 KV, a 10% reserve and
    # 16-token pages (what simulate sizes its pool with); int4 weights or int8
    # KV hold another pool and sustain another rate.
    path = _max_rate_file(tmp_path, binding={"tenant": "a", "constraint": "ttft"}, upper=1.1)
    cost = ["capacity", "--load", "25000", "--payg", "10", "--device-hour", "3",
            "--engineering-hour", "1", "--max-rate-json", path]  # fmt: skip
    assert main([*cost, *args]) == 2
    err = capsys.readouterr().err
    assert "(simulated: " in err and args[1] in err
    assert main(cost) == 0
