"""Heterogeneous tenants together vs apart vs time-sliced (kvsched.sim.mix,
`kvsched mix`)."""

from __future__ import annotations

import pytest

from kvsched.cli import main
from kvsched.sim import mix
from kvsched.sim.slo import parse_slos

TINY = mix.MixWorkload(seconds=8.0, docs_rate=0.5, chat_rate=3.0, chat_output=120)
SLOS = parse_slos(mix.DEFAULT_SLOS)


def test_every_arrangement_accounts_for_every_request():
    arrivals = TINY.arrivals(1.0)
    offered = {t: sum(a.tenant == t for a in arrivals) for t in ("chat", "docs")}
    assert offered["chat"] > 10 and offered["docs"] >= 2
    runs = mix.arrange(arrivals, TINY.tenants(), SLOS, window=0.5)
    assert [r.name for r in runs] == list(mix.ARRANGEMENTS)
    for arr in runs:
        recs = arr.result.records
        assert {t: sum(r.tenant == t for r in recs) for t in offered} == offered, arr.name
        for r in recs:  # served in full, or refused with its reason: nothing pending
            assert r.outcome == "finished" or r.outcome.startswith("rejected:"), arr.name
            if r.outcome == "finished":
                assert r.output_len == r.asked_max_tokens and r.first_token >= r.arrival
        assert {t: a.offered for t, a in arr.attainment.items()} == offered
        assert arr.result.step_errors == 0
        served_tokens = sum(r.output_len for r in recs)
        assert served_tokens == sum(a.max_tokens for a in arrivals)  # all served here
    together, replicas, apart, _ = runs
    # The whole machine prefills a 30k prompt in half the time one device takes.
    tt, ta = mix.figures(together)["docs"], mix.figures(apart)["docs"]
    assert tt.ttft_p99 < ta.ttft_p99


def test_time_slices_serve_each_tenant_only_in_its_own_windows():
    w = 0.5
    for slot in (0, 1):
        for tau in (0.0, 0.2, 0.5, 1.3, 7.9):
            t = mix._wall_clock(tau, slot, w)
            assert int((t - slot * w) // w) % 2 == 0  # inside one of its windows
            assert mix._own_clock(t, slot, w) == pytest.approx(tau)
    # An arrival in the other tenant's window waits for the next own window.
    assert mix._own_clock(0.7, 0, w) == mix._own_clock(1.0, 0, w) == pytest.approx(0.5)
    assert mix._own_clock(0.2, 1, w) == 0.0
    sl = mix.sliced(*_whole(), w)
    order = [t.name for t in TINY.tenants()]
    for r in sl.records:
        slot = order.index(r.tenant)
        for v in (r.first_token, r.finished):
            phase = (v - slot * w) % (2 * w)
            assert phase <= w + 1e-9 or phase >= 2 * w - 1e-9, (r.tenant, v)
    # A chat answer longer than a window pauses for the other tenant's window.
    long = [r for r in sl.records if r.tenant == "chat" and r.finished - r.first_token > w]
    assert long and all(r.max_gap >= w for r in long)


def _whole():
    arrivals = TINY.arrivals(1.0)
    eng = mix.engine_for(arrivals, devices=2, max_num_seqs=256, step_budget=4096)
    return eng.config, TINY.tenants(), arrivals, eng.cost


def test_bad_arrangements_are_refused_with_the_reason(monkeypatch):
    arrivals = TINY.arrivals(1.0)
    sims = []
    monkeypatch.setattr(mix, "simulate", lambda *a, **k: sims.append(a) or 1 / 0)
    with pytest.raises(ValueError, match="even"):
        mix.arrange(arrivals, TINY.tenants(), SLOS, devices=3)
    with pytest.raises(ValueError, match="unknown arrangement"):
        mix.arrange(arrivals, TINY.tenants(), SLOS, which=["shared"])
    with pytest.raises(ValueError, match="window"):
        mix.sliced(*_whole(), 0.0)
    with pytest.raises(ValueError, match="window"):
        mix.arrange(arrivals, TINY.tenants(), SLOS, window=float("nan"))
    assert sims == []  # every refusal came before anything ran
    with pytest.raises(ValueError, match="two tenants"):
        mix.arrange([a for a in arrivals if a.tenant == "chat"], TINY.tenants(), SLOS)
    with pytest.raises(ValueError, match="load"):
        TINY.arrivals(0.0)


def test_the_mix_command_prints_each_load_and_the_gain(capsys):
    assert main(["mix", "--seconds", "6", "--loads", "0.5,1", "--chat-output", "100",
                 "--arrangements", "together,apart"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "load 0.5x:" in out and "load 1x:" in out and "half the devices" in out
    assert "together vs apart:" in out and "sliced" not in out.split("load 0.5x:")[1]
    assert main(["mix", "--loads", "one"]) == 2
    assert "--loads" in capsys.readouterr().err
    assert main(["mix", "--devices", "3", "--seconds", "4", "--loads", "1"]) == 2
    assert "even" in capsys.readouterr().err


def test_the_gain_is_only_claimed_between_arrangements_that_ran():
    sc = mix.scan(TINY, [1.0], SLOS, which=["sliced"], window=0.5)
    lines = mix.summary(sc)
    assert not any("together" in line or "mixing" in line for line in lines)


def test_the_limit_of_each_arrangement_is_bisected_between_a_pass_and_a_miss():
    sc = mix.scan(TINY, [1, 4, 8], SLOS, which=["together", "apart"], refine=3)
    apart, together = sc.limits["apart"], sc.limits["together"]
    assert apart.load is not None and apart.missed is not None
    assert apart.load not in sc.loads and apart.missed - apart.load <= 3 / 8 + 1e-9
    assert mix.meets(apart.run, sc.target) and apart.run.name == "apart"
    again = mix.arrange(TINY.arrivals(apart.missed), TINY.tenants(), SLOS, which=["apart"])
    assert not mix.meets(again[0], sc.target)
    # On this small mix one engine on both devices holds more than two halves.
    assert together.load > apart.load
    lines = mix.summary(sc)
    assert any(line.startswith("  together vs apart:") for line in lines)
