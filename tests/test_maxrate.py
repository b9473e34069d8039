"""The max-rate search (sim/maxrate.py) and `kvsched simulate --find-max-rate`:
checked against simulate() itself, on small in-memory workloads."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvsched.cli import main
from kvsched.sim import engine_for, file_workload, workloads
from kvsched.sim.maxrate import MaxRate, MaxRateError, find_max_rate, retimed, shifted
from kvsched.sim.simulator import simulate
from kvsched.sim.slo import attainment, parse_slos

RATE = 4.0


def mix(n: int = 60):
    """Chat (short prompts, long answers) beside docs (long prompts, short answers)."""
    rng = np.random.default_rng(3)
    records = [
        {"prompt_tokens": int(rng.integers(50, 300)), "output_tokens": int(rng.integers(30, 120)),
         "tenant": "chat"} if i % 3 else
        {"prompt_tokens": int(rng.integers(3000, 6000)), "output_tokens": 8, "tenant": "docs"}
        for i in range(n)
    ]  # fmt: skip
    arrivals, tenants = file_workload(records, rate=RATE)
    return arrivals, tenants, engine_for(arrivals)


def pooled(arrivals, tenants, engine, slos, m, seeds, vary):
    """Each tenant's attainment at multiplier m over the seeds, run here."""
    met: dict[str, int] = {}
    offered: dict[str, int] = {}
    for seed in range(seeds):
        run = workloads.scale_time(vary(arrivals, seed), 1 / m)
        r = simulate(engine.config, tenants, run, engine.cost)
        for t, a in attainment(r, slos).items():
            met[t] = met.get(t, 0) + a.met
            offered[t] = offered.get(t, 0) + a.offered
    return {t: met[t] / offered[t] for t in met}


def test_the_found_rate_meets_the_target_and_a_little_more_misses():
    arrivals, tenants, engine = mix()
    slos = parse_slos(["chat:ttft=0.5,itl=0.04", "docs:ttft=5"])
    vary = retimed(RATE)
    r = find_max_rate(arrivals, tenants, engine, slos, target=0.95, seeds=2, vary=vary)
    assert r.upper is not None and r.multiplier < r.upper <= r.multiplier * 1.02 + 1e-12
    at = pooled(arrivals, tenants, engine, slos, r.multiplier, 2, vary)
    above = pooled(arrivals, tenants, engine, slos, r.upper, 2, vary)
    assert all(s >= 0.95 for s in at.values()), at
    assert min(above.values()) < 0.95, above
    assert r.attainment == pytest.approx(at)
    assert r.requests_per_s == pytest.approx(RATE * r.multiplier)
    assert r.output_tokens_per_s > 0 and r.input_tokens_per_s > r.output_tokens_per_s
    # The binding tenant is the one below target at `upper`, with its main cause.
    assert r.binding is not None and above[r.binding["tenant"]] < 0.95
    assert r.points[-1]["multiplier"] in (r.multiplier, r.upper)


@pytest.mark.parametrize(
    ("specs", "binding"),
    [
        (["chat:itl=0.03", "docs:ttft=60"], {"tenant": "chat", "constraint": "itl"}),
        (["chat:ttft=60", "docs:ttft=0.4"], {"tenant": "docs", "constraint": "ttft"}),
    ],
)
def test_the_binding_tenant_and_constraint(specs, binding):
    """Constructed so one target is tight and the other lax: the tight one binds."""
    arrivals, tenants, engine = mix()
    r = find_max_rate(arrivals, tenants, engine, parse_slos(specs), seeds=1, tolerance=0.1)
    assert r.binding == binding
    assert r.line().endswith(f"(binding: {binding['tenant']} {binding['constraint']})")


def test_no_binding_up_to_the_limit_and_an_impossible_slo():
    arrivals, tenants, engine = mix(30)
    lax = find_max_rate(arrivals, tenants, engine, parse_slos(["*:ttft=1000"]), seeds=1,
                        max_multiplier=4.0)  # fmt: skip
    assert (lax.multiplier, lax.upper, lax.binding) == (4.0, None, None)
    assert "binding: none up to the search limit" in lax.line()
    with pytest.raises(MaxRateError, match="no load meets the SLOs"):
        find_max_rate(arrivals, tenants, engine, parse_slos(["docs:ttft=0.001"]), seeds=1,
                      min_multiplier=0.25)  # fmt: skip
    with pytest.raises(ValueError, match="'nope', not a tenant"):
        find_max_rate(arrivals, tenants, engine, parse_slos(["nope:ttft=1"]))


def test_the_result_round_trips_through_json():
    arrivals, tenants, engine = mix(30)
    r = find_max_rate(arrivals, tenants, engine, parse_slos(["chat:ttft=0.5"]), seeds=1,
                      tolerance=0.2, trace="mine")  # fmt: skip
    data = json.loads(r.to_json())
    for key in ("multiplier", "requests_per_s", "output_tokens_per_s", "input_tokens_per_s",
                "model", "accelerator", "devices", "trace", "attainment_target", "binding",
                "slos"):  # fmt: skip
        assert key in data, key
    assert (data["model"], data["accelerator"], data["devices"]) == ("llama-3-8b", "h100", 1)
    assert data["slos"] == {"chat": "ttft=0.5"} and data["trace"] == "mine"
    assert MaxRate.from_json(r.to_json()) == r
    with pytest.raises(ValueError, match="lacks"):
        MaxRate.from_json('{"multiplier": 1}')


def test_shifted_rotates_the_trace_in_time():
    arrivals = workloads.from_trace(
        [workloads.TraceRequest(10 + i, 4, arrival_s=float(i * i)) for i in range(20)]
    )
    assert shifted(arrivals, 0) == arrivals
    moved = shifted(arrivals, 5)
    assert [a.at for a in moved] == sorted(a.at for a in moved) and moved != arrivals
    # The same requests, and the same gaps but one (where the end wraps to the start).
    assert sorted(len(a.prompt) for a in moved) == [10 + i for i in range(20)]
    gaps = np.round(np.diff([a.at for a in arrivals]), 9)
    moved_gaps = np.round(np.diff([a.at for a in moved]), 9)
    assert len(set(gaps) & set(moved_gaps)) == len(gaps) - 1


def test_kvsched_simulate_find_max_rate(tmp_path, capsys):
    rows = "".join(f"{100 + 37 * (i % 9)},{20 + i % 50},{'ab'[i % 2]}\n" for i in range(50))
    path = tmp_path / "mine.csv"
    path.write_text("prompt_tokens,output_tokens,tenant\n" + rows)
    out_json = tmp_path / "r.json"
    assert main(["simulate", "--trace-path", str(path), "--rate", "2", "--find-max-rate",
                 "--slo", "a:ttft=0.3,itl=0.03", "--slo", "*:ttft=2", "--attainment", "0.9",
                 "--seeds", "2", "--json", str(out_json)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("max rate:"))
    m = re.fullmatch(r"max rate: ([\d.]+)x = ([\d.]+) req/s \(binding: (\w+) (\w+)\)", line)
    assert m, line
    data = json.loads(out_json.read_text())
    assert float(m[1]) == pytest.approx(data["multiplier"], rel=1e-2)
    assert float(m[2]) == pytest.approx(2 * data["multiplier"], rel=1e-2)
    assert data["binding"] == {"tenant": m[3], "constraint": m[4]}
    assert data["attainment_target"] == 0.9 and data["seeds"] == 2
    assert data["slos"] == {"a": "ttft=0.3,itl=0.03", "b": "ttft=2"}
    two = ["--find-max-rate", "--slo", "a:ttft=1", "--scenarios", "continuous,static"]
    for bad in (["--find-max-rate"], ["--seeds", "2", "--slo", "a:ttft=1"], two):
        assert main(["simulate", "--trace-path", str(path), "--rate", "2", *bad]) == 2
    assert "searches one scenario" in capsys.readouterr().err


def test_retimed_variants_never_repeat_the_workloads_own_draw():
    records = [{"prompt_tokens": 5, "output_tokens": 2}] * 20
    for seed in (0, 1, 2):
        arrivals, _ = file_workload(records, rate=3.0, seed=seed)
        vary = retimed(3.0, seed=seed)
        assert vary(arrivals, 0) == arrivals
        times = [tuple(a.at for a in vary(arrivals, k)) for k in range(4)]
        assert len(set(times)) == 4, f"seed {seed}: a variant repeats another"
