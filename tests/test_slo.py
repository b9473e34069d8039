"""SLO targets per tenant and attainment over offered requests (kvsched.sim.slo)."""

import math

import pytest

from kvsched.sim.setup import engine_for, named_workload
from kvsched.sim.simulator import RequestRecord, SimResult, simulate
from kvsched.sim.slo import Slo, SloError, attainment, parse_slo, parse_slos


def test_specs_parse_and_bad_ones_name_the_part():
    assert parse_slo("interactive:ttft=1,itl=0.1") == ("interactive", Slo(1.0, 0.1))
    assert parse_slo("*:itl=0.05") == ("*", Slo(None, 0.05))
    for bad, part in [("interactive", "TENANT:"), (":ttft=1", "TENANT:"), ("a:ttft", "'ttft'"),
                      ("a:tpot=1", "'tpot=1'"), ("a:gap=-1", "> 0"), ("a:ttft=x", "not a number"),
                      ("a:ttft=1,ttft=2", "twice"), ("a:ttft=0", "> 0"),
                      ("a:itl=nan", "> 0"), ("a:ttft=inf", "finite")]:  # fmt: skip
        with pytest.raises(SloError, match=part):
            parse_slo(bad)
    with pytest.raises(SloError, match="two SLOs"):
        parse_slos(["a:ttft=1", "a:itl=1"])


def _rec(outcome, ttft=0.5, out=11, itl=0.01, tenant="t", gap=0.02):
    r = RequestRecord(tenant, 10.0, 100, outcome, output_len=out, max_gap=gap)
    if outcome in ("finished", "capped"):
        r.first_token = 10.0 + ttft
        r.finished = r.first_token + itl * (out - 1)
    return r


def test_every_offered_request_counts_and_a_refusal_is_a_miss():
    recs = [_rec("finished"), _rec("finished", ttft=2.0), _rec("finished", itl=0.2),
            _rec("rejected:pool_full"), _rec("rejected:displaced"), _rec("capped"),
            _rec("finished", out=1, itl=9.0), _rec("aborted:oom"), _rec("pending"),
            _rec("finished", tenant="free"), _rec("finished", gap=0.5)]  # fmt: skip
    res = SimResult("x", recs, virtual_s=4.0, wall_s=0, steps=1, step_errors=0)
    att = attainment(res, {"t": Slo(1.0, 0.1, gap_s=0.3)})
    assert set(att) == {"t"}  # "free" has no SLO and no "*": not scored
    a = att["t"]
    assert (a.offered, a.met) == (10, 2)  # the 1-token request has no gap to pace
    assert a.misses == {"refused": 4, "capped": 1, "ttft": 1, "itl": 1, "gap": 1}
    assert a.binding == "refused"
    assert math.isclose(a.share, 2 / 10) and math.isclose(a.goodput_rps, 0.5)
    assert math.isclose(a.goodput_tokens_per_s, (11 + 1) / 4.0)
    star = attainment(res, {"*": Slo(ttft_s=1.0)})
    assert star["free"].met == 1 and star["t"].misses["itl"] == 0


def test_chunked_prefill_keeps_chat_under_a_pause_target_the_unchunked_stall_breaks():
    # A 30k-token prefill in one step stalls every decoding chat request once;
    # chunks spread it, so each pause is short, though the mean pace is slower
    # (more, fuller steps), which a mean-ITL target alone would reward.
    arrivals, tenants = named_workload("prefill-vs-decode")
    eng = engine_for(arrivals, step_budget=2048)
    slos = parse_slos(["chat:gap=0.2"])
    chunked = simulate(eng.config, tenants, arrivals, eng.cost)
    whole = simulate(eng.config.replace(long_prefill_chunk=eng.config.max_seq_len,
                                        max_batched_tokens=eng.config.max_seq_len,
                                        token_buckets=None),
                     tenants, arrivals, eng.cost)  # fmt: skip
    a, b = attainment(chunked, slos)["chat"], attainment(whole, slos)["chat"]
    assert a.offered == b.offered > 50
    assert a.share > 0.9 > b.share and b.binding == "gap"
    mean = parse_slos(["chat:itl=0.03"])
    assert attainment(chunked, mean)["chat"].share < attainment(whole, mean)["chat"].share
