"""Inputs a capacity planner brings that the simulator's authors had not tried
(issue 16's review): each is refused with a clear, typed error before anything
runs, or printed for what it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsched.sim import maxrate, setup
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
