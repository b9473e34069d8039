"""Knob sweeps and their knees (kvsched.sim.sweeps, `kvsched sweep`)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import kvsched
from kvsched.cli import main
from kvsched.sim import scenarios, sweeps
from kvsched.sim.setup import engine_for, named_workload
from kvsched.sim.simulator import Arrival, StepCost
from kvsched.sim.slo import parse_slos

DATA = Path(__file__).parent / "data"
AZURE = str(DATA / "azure_code_head400.csv")
COST = StepCost.preset("llama-3-8b", "h100")


def test_the_knee_of_a_clear_bend_a_straight_line_and_a_noisy_bend():
    xs = list(range(11))
    bend = [min(x, 4) for x in xs]  # rises, then flat from x = 4
    k = sweeps.knee(xs, bend)
    assert k is not None and (k.index, k.x, k.y) == (4, 4.0, 4.0) and k.distance > 0.4
    falling = [100.0 / (1 + x) for x in xs]  # a convex decay bends early
    assert sweeps.knee(xs, falling).index in (1, 2)
    # A straight line, a flat curve and too few points have no knee.
    assert sweeps.knee(xs, [3.0 * x + 1 for x in xs]) is None
    assert sweeps.knee(xs, [5.0] * 11) is None
    assert sweeps.knee([0, 1], [0, 5]) is None
    rng = np.random.default_rng(7)
    noisy = [y + rng.normal(0, 0.08) for y in bend]  # 2% of the range
    assert abs(sweeps.knee(xs, noisy).index - 4) <= 1
    # Noise of a few percent on a straight line or around a level is no knee
    # (normalising would otherwise blow the wiggle up to the unit square).
    assert sweeps.knee(xs, [x + rng.normal(0, 0.2) for x in xs]) is None
    assert sweeps.knee(xs, [4.2 + rng.normal(0, 0.02) for _ in xs]) is None
    # Missing values (a p99 of nothing served) are left out, not read as 0.
    holes = [float("nan") if x == 7 else y for x, y in zip(xs, bend, strict=True)]
    assert sweeps.knee(xs, holes).index == 4
    with pytest.raises(ValueError, match="increasing"):
        sweeps.knee([0, 2, 1], [0, 1, 2])
    with pytest.raises(ValueError, match="positions"):
        sweeps.knee([0, 1, 2], [0, 1])


def _burst(n: int, prompt: int, out: int) -> list[Arrival]:
    rng = np.random.default_rng(0)
    return [Arrival(0.0, "t", rng.integers(0, 32000, prompt, dtype=np.int32), out)
            for _ in range(n)]  # fmt: skip


def test_reserve_sweep_refuses_what_the_usable_pages_cannot_hold():
    # Refusals against reserve are not monotone on a trace (a refused long
    # request can leave room for two short ones later; the azure excerpt shows
    # dips), but on a burst of equal requests submitted before any step they
    # must be: admitted = usable pages // pages per request, every reserve.
    arrivals = _burst(60, prompt=1000, out=104)  # 69 pages of 16 tokens each
    base = kvsched.SchedulerConfig(num_blocks=2001, block_size=16, max_num_seqs=64,
                                   max_batched_tokens=2048, max_seq_len=2048,
                                   max_waiting=256, overhead_reserve=0.0)  # fmt: skip
    values = [0.0, 0.1, 0.2, 0.3, 0.5]
    sw = sweeps.sweep(base, [kvsched.TenantConfig("t")], arrivals, COST, "reserve", values,
                      slos=parse_slos(["*:ttft=30"]))  # fmt: skip
    assert [p.value for p in sw.points] == values
    refused = [sum(p.summary["t"]["rejected"].values()) for p in sw.points]
    usable = [2000 - math.ceil(2000 * r) for r in values]
    assert refused == [60 - min(60, u // 69) for u in usable]  # 32, 34, 37, 40, 46
    assert refused == sorted(refused) and refused[0] < refused[-1]
    for p in sw.points:  # the books balance: every request served or refused
        outcomes = [r.outcome for r in p.result.records]
        assert len(outcomes) == 60 and set(outcomes) <= {"finished", "rejected:pool_full"}
    rows = sweeps.table(sw).splitlines()
    assert [r.split()[0] for r in rows[3:-1]] == ["0%", "10%", "20%", "30%", "50%"]


def test_reserve_sweep_on_the_azure_excerpt_keeps_promises_under_the_usable_share():
    arrivals, tenants = named_workload("azure", path=AZURE, load=2.0)
    eng = engine_for(arrivals)
    base = eng.config.replace(num_blocks=2001)  # a small pool: admission is refused
    sw = sweeps.sweep(base, tenants, arrivals, eng.cost, "reserve", [0.0, 0.15, 0.3],
                      slos=parse_slos(sweeps.DEFAULT_SLOS["azure"]), load=2.0)  # fmt: skip
    assert len(sw.points) == 3
    for p in sw.points:
        assert len(p.result.records) == len(arrivals) and p.result.step_errors == 0
        assert all(r.outcome in ("finished", "capped") or r.outcome.startswith("rejected:")
                   for r in p.result.records)  # fmt: skip
        assert p.result.pool_shares()["promised_peak"] <= 1 - p.value + 1e-9
        assert sum(a.offered for a in p.attainment.values()) == len(arrivals)
    assert sum(sum(s["rejected"].values()) for s in sw.points[0].summary.values()) > 0
    curves = sw.curves()
    assert set(curves) == {"goodput"} | {f"{m}:{t}" for m, *_ in sweeps.TENANT_METRICS
                                         for t in ("batch", "interactive")}  # fmt: skip
    assert all(len(ys) == 3 for ys in curves.values())
    lines = sweeps.knee_lines(sw)
    assert len(lines) == len(curves) and "goodput" in lines[0]


def test_chunk_sweep_unchunked_is_the_scenario_and_chunks_over_the_budget_are_flagged():
    arrivals, tenants = named_workload("prefill-vs-decode", load=1.0)
    arrivals = [a for a in arrivals if a.at < 6.0]
    eng = engine_for(arrivals, step_budget=2048)
    got = sweeps.configs(eng.config, "chunk", [256, 4096, None])
    assert got[0][1].long_prefill_chunk == 256 and got[0][2] == ""
    assert "capped" in got[1][2]
    unchunked = next(s for s in scenarios.standard(eng.config) if s.name == "unchunked")
    assert got[2][1] == eng.config.replace(**unchunked.overrides)
    sw = sweeps.sweep(eng.config, tenants, arrivals, eng.cost, "chunk", [256, None],
                      slos=parse_slos(sweeps.DEFAULT_SLOS["prefill-vs-decode"]))  # fmt: skip
    assert sw.positions() == [8.0, 9.0]  # log2; unchunked an octave past the largest
    chat = [p.summary["chat"]["itl_max"] for p in sw.points]
    assert chat[0] < 0.1 < 0.5 < chat[1]  # the whole 30k prefill stalls chat
    for bad in ([0], [1.5]):
        with pytest.raises(ValueError, match="long_prefill_chunk"):
            sweeps.configs(eng.config, "chunk", bad)
    with pytest.raises(ValueError, match="overhead_reserve"):
        sweeps.configs(eng.config, "reserve", [1.0])
    for bad in ([512, 256], [256, 256], [None, 256], [None, None]):  # the x axis
        with pytest.raises(ValueError, match="ascending and distinct"):
            sweeps.configs(eng.config, "chunk", bad)
    with pytest.raises(ValueError, match="unknown knob"):
        sweeps.configs(eng.config, "budget", [1])


def test_the_sweep_command_prints_a_row_per_value_the_knees_and_writes_the_plot(tmp_path, capsys):
    assert main(["sweep", "reserve", "--trace-path", AZURE, "--values", "0,0.1,0.2",
                 "--plots", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "SLO: interactive:ttft=2,itl=0.5 batch:ttft=20 (the default" in out
    assert "load 2x" in out and "knees" in out and "goodput" in out
    assert (tmp_path / "reserve_sweep.png").stat().st_size > 0
    assert main(["sweep", "chunk", "--values", "nope"]) == 2
    assert "not a whole number" in capsys.readouterr().err
    assert main(["sweep", "reserve", "--trace-path", AZURE, "--slo", "interactive:ttft"]) == 2
    assert "SLO" in capsys.readouterr().err
