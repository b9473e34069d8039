"""Fleet-wide tenant rates (issue 31 §4, kvsched.serve.fleet_budget): the
[fleet] table, the shares each replica takes from the demand its peers
report, and (slow) examples/fleet_budget.py behind vllm-router."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvsched
from kvsched.serve.fleet_budget import FleetBudget, FleetConfig, with_rate

from serve_helpers import ROOT

pytest.importorskip("fastapi")

PEERS = ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
KEY = "a-fleet-secret-of-some-length"


def test_the_fleet_table_is_checked():
    ok = FleetConfig.parse({"peers": PEERS, "key": KEY}, [{"name": "a"}])
    assert ok.peers == tuple(PEERS) and ok.interval_s == 0.5 and ok.unreachable == {"a": "closed"}
    bad = [
        ({"key": KEY}, "peers"),
        ({"peers": ["10.0.0.2:8000"], "key": KEY}, "peers"),
        ({"peers": PEERS, "key": "short"}, "key"),
        ({"peers": PEERS, "key": KEY, "interval_s": 0}, "interval_s"),
        ({"peers": PEERS, "key": KEY, "peer": 1}, "unknown"),
    ]
    for table, word in bad:
        with pytest.raises(kvsched.InvalidConfig, match=word):
            FleetConfig.parse(table, [])
    with pytest.raises(kvsched.InvalidConfig, match="fleet_unreachable"):
        FleetConfig.parse({"peers": PEERS, "key": KEY}, [{"name": "a", "fleet_unreachable": "x"}])


def test_a_tenants_file_with_a_fleet_table_loads(tmp_path):
    from kvsched.serve.fleet_budget import load_fleet_table
    from kvsched.serve.tenants import TenantsError, load_tenants

    path = tmp_path / "t.toml"
    path.write_text('[[tenant]]\nname = "a"\napi_key = "sk-a"\nrate_tokens_per_s = 100\n'
                    'fleet_unreachable = "open"\n'
                    f'[fleet]\npeers = {json.dumps(PEERS)}\nkey = "{KEY}"\n')  # fmt: skip
    assert [e.name for e in load_tenants(path)] == ["a"]
    fleet = load_fleet_table(path)
    assert fleet is not None and fleet.unreachable == {"a": "open"}
    path.write_text(path.read_text().replace(KEY, "short"))
    with pytest.raises(TenantsError, match="key must be a secret"):
        load_fleet_table(path)


def budget_with(demand: dict[str, float], peers: list[dict[str, float] | None]) -> FleetBudget:
    """A budget that saw one second of each replica's demand (None: a peer
    that never answered)."""
    b = FleetBudget(FleetConfig(tuple(PEERS[: len(peers)]), KEY))
    b._self.update({}, 0.0)
    b._self.update(demand, 1.0)
    for src, d in zip(b._peers.values(), peers, strict=True):
        if d is not None:
            src.update({}, 0.0)
            src.update(d, 1.0)
    return b


def test_shares_follow_the_demand():
    # All of it here: nearly all of the rate (the peers keep a floor).
    b = budget_with({"a": 900.0}, [{}, {}])
    share = b.shares_now(["a"], now=1.0)["a"]
    assert 0.99 < share < 1.0
    # Spread evenly, or idle: a third each.
    assert b.shares_now(["idle"], now=1.0)["idle"] == pytest.approx(1 / 3)
    even = budget_with({"a": 300.0}, [{"a": 300.0}, {"a": 300.0}])
    assert even.shares_now(["a"], now=1.0)["a"] == pytest.approx(1 / 3)
    # Two thirds elsewhere.
    some = budget_with({"a": 100.0}, [{"a": 200.0}, {"a": 300.0}])
    assert some.shares_now(["a"], now=1.0)["a"] == pytest.approx(1 / 6, rel=0.05)
    # Shares over the replicas add up to one.
    views = [budget_with({"a": d[0]}, [{"a": d[1]}, {"a": d[2]}])
             for d in ((100, 200, 300), (200, 100, 300), (300, 100, 200))]  # fmt: skip
    assert sum(v.shares_now(["a"], now=1.0)["a"] for v in views) == pytest.approx(1.0)


def test_an_unreachable_peer_closes_or_opens_the_share():
    b = budget_with({"a": 900.0, "b": 900.0}, [{"a": 0.0, "b": 0.0}, None])
    b.config.unreachable.update({"a": "closed", "b": "open"})
    late = 1.0 + 4 * b.config.interval_s  # the silent peer is past three intervals
    b._peers[PEERS[0]].last_ok = late
    shares = b.shares_now(["a", "b"], now=late)
    assert shares["a"] == pytest.approx(1 / 3)  # closed: an even split, never over R in all
    assert shares["b"] > 0.99  # open: as if the silent peer wanted nothing
    assert b.unreachable_peers == 1


def test_with_rate_keeps_the_bucket_size_and_the_rest():
    c = kvsched.TenantConfig("a", tier=1, rate_tokens_per_s=300.0, max_concurrent=4)
    d = with_rate(c, 100.0)
    assert (d.rate_tokens_per_s, d.burst_tokens) == (100.0, 300.0)  # one second of the file's
    assert (d.name, d.tier, d.max_concurrent) == ("a", 1, 4)
    e = with_rate(kvsched.TenantConfig("a", rate_tokens_per_s=300.0, burst_tokens=50.0), 10.0)
    assert e.burst_tokens == 50.0


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.model
def test_fleet_budget_behind_vllm_router(tmp_path):
    """Two replicas behind vllm-router (round robin), a tenant limited to R
    driven at 3R: per-replica budgets admit about 2R, fleet-wide ones R; a
    tenant at R/4 is never refused."""
    pytest.importorskip("vllm_router")
    pytest.importorskip("openai")
    from smollm2_helpers import smollm2_file

    smollm2_file()
    out = tmp_path / "budget.json"
    cmd = [sys.executable, str(ROOT / "examples" / "fleet_budget.py"), "--replicas", "2",
           "--rate", "600", "--seconds", "14", "--warm", "4", "--policies", "round_robin",
           "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["budgets"]: r for r in json.loads(out.read_text())}
    for r in rows.values():
        assert r["light_refused"] == 0 and r["capped_errors"] == r["light_errors"] == 0, r
        assert r["light_tokens_per_s"] > 0.8 * 600 / 4, r
    assert rows["replica"]["capped_tokens_per_s"] > 1.6 * 600, rows  # each replica gave R
    assert 0.85 * 600 < rows["fleet"]["capped_tokens_per_s"] < 1.15 * 600, rows


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.model
def test_fleet_demand_answers_the_fleet_key_only(tmp_path):
    """GET /fleet/demand: 401 without the fleet key (a tenant's key is not it),
    the tokens each tenant asked with it (prompt + max_tokens); a peer that
    never answers does not stop the server serving."""
    httpx = pytest.importorskip("httpx")
    from serve_helpers import free_ports, start_serve
    from smollm2_helpers import smollm2_file

    smollm2_file()
    (dead,) = free_ports(1)
    toml = tmp_path / "t.toml"
    toml.write_text('[[tenant]]\nname = "a"\napi_key = "sk-a"\nrate_tokens_per_s = 1000\n'
                    f'[fleet]\npeers = ["http://127.0.0.1:{dead}"]\nkey = "{KEY}"\n'
                    "interval_s = 0.2\n")  # fmt: skip
    proc, url = start_serve(["--model", "simulated", "--tenants", str(toml), "--sim-step-ms", "2"],
                            cwd=tmp_path)  # fmt: skip
    try:
        assert httpx.get(f"{url}/fleet/demand").status_code == 401
        tenant_key = {"Authorization": "Bearer sk-a"}
        assert httpx.get(f"{url}/fleet/demand", headers=tenant_key).status_code == 401
        body = {"model": "simulated", "prompt": [5, 6, 7, 8], "max_tokens": 6}
        r = httpx.post(f"{url}/v1/completions", headers=tenant_key, timeout=60, json=body)
        assert r.status_code == 200, r.text
        got = httpx.get(f"{url}/fleet/demand", headers={"Authorization": f"Bearer {KEY}"})
        assert got.status_code == 200 and got.json() == {"demand": {"a": 10.0}}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
