"""Replaying request traces through the real scheduler, in virtual time.

`traces` reads the bundled real traces and any trace (`read_requests`: CSV or
JSON lines); `prefix_replay` replays mooncake_synthetic.jsonl to measure the
prefix cache's hit rate.

A custom study in a few lines (the names below are exported here):

    arrivals, tenants = file_workload("my.csv", rate=5.0)   # or records in memory
    engine = engine_for(arrivals, model="llama-3-8b", accelerator="h100")
    result = simulate(engine.config, tenants, arrivals, engine.cost)
    attainment(result, parse_slos(["*:ttft=1,itl=0.1"]))
    find_max_rate(arrivals, tenants, engine, parse_slos(["*:ttft=1"]))

`engine_for` returns a `SimEngine` (the scheduler's configuration and the
step-cost model); its old name here, `Engine`, stays for one release,
deprecated: it was a second class of that name beside kvsched.engine's.
"""

from kvsched.sim.maxrate import MaxRate, MaxRateError, find_max_rate
from kvsched.sim.setup import SimEngine, engine_for, file_workload, named_workload
from kvsched.sim.simulator import Arrival, SimResult, StepCost, simulate
from kvsched.sim.slo import Attainment, Slo, SloError, attainment, parse_slos
from kvsched.sim.traces import TraceError, read_requests

__all__ = [
    "Arrival",
    "Attainment",
    "MaxRate",
    "MaxRateError",
    "SimEngine",
    "SimResult",
    "Slo",
    "SloError",
    "StepCost",
    "TraceError",
    "attainment",
    "engine_for",
    "file_workload",
    "find_max_rate",
    "named_workload",
    "parse_slos",
    "read_requests",
    "simulate",
]


def __getattr__(name: str) -> type[SimEngine]:
    if name == "Engine":  # deprecated alias (see the module)
        return SimEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
