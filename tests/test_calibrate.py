"""`kvsched calibrate`: the step-cost model fitted to the real engine on CPU, its
file, and the simulator's use of it (`--step-cost`), refused for another model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvsched.capacity import ACCELERATORS, MODELS
from kvsched.cli import main
from kvsched.sim.simulator import StepCost, StepCostError

# -- the fit, on figures made by a known model (no engine) -------------------------------


def test_the_fit_recovers_known_rates():
    """Points made by a StepCost with both compute- and memory-bound steps give
    its overhead, FLOP rate and byte rate back."""
    from kvsched.sim.calibrate import Measured, Point, fit

    shape = MODELS["llama-3-8b"]
    truth = StepCost(shape, ACCELERATORS["h100"], overhead_s=0.003, flop_rate=4e14,
                     byte_rate=2e12)  # fmt: skip
    measured = []
    for tokens, kv in ((8, 8_000), (64, 200_000), (256, 50_000), (1024, 10_000), (4096, 4_000),
                       (32, 500_000), (2048, 300_000)):  # fmt: skip
        measured.append(Measured(Point(tokens, 0, 1), tokens, kv, truth.seconds(tokens, kv)))
    f = fit(measured, shape, weight_bytes=shape.params * 2, kv_dtype_bytes=2.0)
    assert f.identified == {"flop_rate": True, "byte_rate": True}
    assert f.overhead_s == pytest.approx(0.003, rel=1e-6)
    assert f.flop_rate == pytest.approx(4e14, rel=1e-6)
    assert f.byte_rate == pytest.approx(2e12, rel=1e-6)
    # Only compute-bound points: the byte rate is a bound, and said to be one.
    compute_bound = [measured[i] for i in (3, 4, 6)]  # 1,024 / 4,096 / 2,048 tokens
    f = fit(compute_bound, shape, weight_bytes=shape.params * 2, kv_dtype_bytes=2.0)
    assert f.identified["byte_rate"] is False
    assert f.flop_rate == pytest.approx(4e14, rel=1e-6)
    assert f.byte_rate <= 2e12  # the lowest rate that keeps every point compute-bound


def test_bad_points_are_refused():
    from kvsched.sim.calibrate import CalibrationError, Measured, Point, check_points, fit

    for bad in (Point(0, 0, 1), Point(-1, 4, 8), Point(2, 0, 0)):
        with pytest.raises(CalibrationError):
            check_points([bad])
    with pytest.raises(CalibrationError, match="at least 3"):
        fit([Measured(Point(1, 0, 1), 1, 1, 0.01)] * 2, MODELS["llama-3-8b"], weight_bytes=1,
            kv_dtype_bytes=2)  # fmt: skip


# -- the file ---------------------------------------------------------------------------


def test_the_file_round_trips_and_is_refused_for_another_model(tmp_path):
    cost = StepCost.preset("llama-3-8b", "h100", devices=2, flop_rate=1e14, byte_rate=1e12,
                           calibration={"device": "test"})  # fmt: skip
    path = tmp_path / "cost.json"
    cost.save(path)
    back = StepCost.load(path, model="llama-3-8b")
    assert back == cost and back.calibration == {"device": "test"}
    assert back.seconds(100, 10_000) == cost.seconds(100, 10_000)
    with pytest.raises(StepCostError, match="calibrated for 'llama-3-8b', not 'mistral-7b'"):
        StepCost.load(path, model="mistral-7b")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(StepCostError, match="not JSON"):
        StepCost.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(StepCostError, match="not a step-cost file"):
        StepCost.load(tmp_path / "other.json")
    data = cost.to_json()
    del data["model"]["layers"]
    with pytest.raises(StepCostError, match="malformed"):
        StepCost.from_json(data)
    data = cost.to_json()
    data["flop_rate"] = -1
    with pytest.raises(StepCostError, match="flop_rate"):
        StepCost.from_json(data)


def test_a_calibrated_cost_charges_the_bucket_padding():
    """The calibration engine pads a step to a multiple of 16 tokens and computes
    all of it: a cost with token_quantum=16 charges 33 tokens as 48; the
    presets (quantum 1) charge what was scheduled."""
    cost = StepCost.preset("smollm2-135m", "h100", flop_rate=1e11, byte_rate=1e12,
                           token_quantum=16)  # fmt: skip
    assert cost.seconds(33, 100) == cost.seconds(48, 100) > cost.seconds(32, 100)
    assert StepCost.from_json(cost.to_json()).token_quantum == 16
    preset = StepCost.preset("smollm2-135m", "h100", flop_rate=1e11, byte_rate=1e12)
    assert preset.seconds(33, 100) < preset.seconds(48, 100)
    with pytest.raises(StepCostError, match="token_quantum"):
        StepCost.preset("smollm2-135m", "h100", token_quantum=0)


def test_simulate_uses_the_file_and_refuses_another_models(tmp_path, capsys):
    args = ["simulate", "--trace", "azure", "--limit", "40", "--scenarios", "continuous"]
    assert main(args) == 0
    preset = capsys.readouterr().out
    slow = replace(StepCost.preset("llama-3-8b", "h100"), flop_rate=1e12, byte_rate=1e10,
                   overhead_s=0.05)  # fmt: skip
    path = tmp_path / "slow.json"
    slow.save(path)
    assert main([*args, "--step-cost", str(path)]) == 0
    slowed = capsys.readouterr().out
    # The same workload, much slower steps: the table's figures change.
    assert slowed != preset
    assert main([*args, "--model", "mistral-7b", "--step-cost", str(path)]) == 2
    err = capsys.readouterr().err
    assert "calibrated for 'llama-3-8b', not 'mistral-7b'" in err
    # Measured on one device: not charged as if it were two (no all-reduces in it).
    assert main([*args, "--devices", "2", "--step-cost", str(path)]) == 2
    assert "for 1 device(s), not 2" in capsys.readouterr().err


# -- the engine on CPU ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.alone  # times the machine: under pytest-xdist, with the other worker idle
def test_calibration_on_cpu_predicts_held_out_steps(tmp_path):
    """The tiny model on CPU: fitted on steps of 16, 64 and 128 tokens, the
    step cost predicts the engine's own measured step times on held-out mixes
    of decodes and prefill it was not fitted on: their median within 20%, each
    within 50%. Three token buckets compile (most of the test's time).

    The bound is on the median because one point's time is noisy on a shared
    2-core machine even as the lowest of 5 pass medians: the same point
    measured 1.77-2.06 ms in 4 runs in a row here, and CI's run of 8d66659 had
    one held-out point 25.6% off (median 9.1%); 7 runs here gave held-out
    medians 1.5-19.9%, maxima 3.9-22.2%. How close one machine's fit is,
    `kvsched calibrate` prints (a timing figure, not a unit test's). A broken
    fit still fails: the best constant cost on the same figures is 24% off in
    median, and it cannot charge a 128-token step 1.5x a 16-token one (the
    fits here and on CI: 2.1-2.6x, as measured)."""
    pytest.importorskip("jax")
    from kvsched.engine.model import LlamaConfig, init_params
    from kvsched.sim.calibrate import Point, calibrate

    model = LlamaConfig()
    # A small mixed step among the fitted ones (decodes beside a prefill at
    # 16 tokens), as the held-out mixes are: without it a 4 + 12 mix was
    # under-predicted by up to 21% on a loaded run.
    fit_on = [Point(8, 8, 16), Point(16, 0, 32), Point(0, 16, 1), Point(0, 64, 1), Point(64, 0, 8),
              Point(0, 128, 1), Point(64, 64, 40), Point(112, 16, 24)]  # fmt: skip
    held = [Point(4, 12, 8), Point(48, 16, 32), Point(8, 56, 16), Point(32, 96, 8)]
    # CPU time, not wall time: CI's 2 cores are shared, and other work there
    # inflates wall medians 2-4x, unevenly (see calibrate's doc).
    cal = calibrate(model, init_params(model, seed=0), fit_on, held, reps=7, passes=5,
                    clock="cpu")  # fmt: skip
    report = cal.report()
    errors = [abs(m.error) for m in cal.held_out]
    assert cal.held_out_error["median"] < 0.20, report
    assert max(errors) < 0.50, report
    c = cal.cost
    assert c.seconds(128, 512) > 1.5 * c.seconds(16, 64), report
    assert cal.fit_error["points"] == 8 and cal.held_out_error["points"] == 4
    assert c.overhead_s >= 0 and c.flop_rate and c.byte_rate
    meta = c.calibration
    assert meta is not None
    assert meta["model"] == "tiny-llama" and meta["backend"] == "reference"
    assert meta["device"].startswith("cpu") and meta["kv_dtype"] == "float32"
    assert meta["clock"] == "cpu"
    assert meta["held_out_error"]["max"] == pytest.approx(max(errors))
    # The file gives back the same predictions; the simulator's models refuse it.
    path = tmp_path / "tiny.json"
    c.save(path)
    back = StepCost.load(path, model="tiny-llama")
    for m in cal.held_out:
        assert back.seconds(m.tokens, round(m.kv_read)) == pytest.approx(m.predicted)
    with pytest.raises(StepCostError, match="calibrated for 'tiny-llama'"):
        StepCost.load(path, model="llama-3-8b")


def test_calibrate_cli_refuses_bad_grids(tmp_path, capsys):
    pytest.importorskip("jax")
    out = str(tmp_path / "c.json")
    for bad in (["--decode", "1,x"], ["--held-out", "1:2"], ["--held-out", "a:b:c"]):
        with pytest.raises(SystemExit) as e:
            main(["calibrate", "--out", out, *bad])
        assert e.value.code == 2
        assert "integers" in capsys.readouterr().err
    # A point no engine step can be: refused before anything runs, nothing written.
    assert main(["calibrate", "--out", out, "--decode", "-1"]) == 2
    assert "decode and prefill must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()
