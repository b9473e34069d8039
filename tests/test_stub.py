"""The hand-kept stub (kvsched/_core.pyi) says what the compiled module does: its
docstrings are the compiled objects' own, its TypedDicts have the keys of the
dicts the core returns, its Literal vocabularies are the values it gives, and
mypy --strict passes on the examples against it. (mypy.stubtest checks the
signatures; it is run separately.)"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvsched
import kvsched._core as core

ROOT = Path(__file__).resolve().parents[1]
STUB = Path(core.__file__).with_name("_core.pyi")
TREE = ast.parse(STUB.read_text())


def _norm(doc: str | None) -> str:
    return " ".join((doc or "").split())


def _stub_doc(node: ast.ClassDef | ast.FunctionDef) -> str | None:
    return ast.get_docstring(node, clean=True)


def _classes() -> dict[str, ast.ClassDef]:
    return {n.name: n for n in TREE.body if isinstance(n, ast.ClassDef)}


def _documented_pairs() -> list[tuple[str, str | None, str]]:
    """(qualname, the stub's docstring, the compiled object's docstring) for every
    class of the module and every documented method and property of them."""
    out = []
    classes = _classes()
    for name, obj in vars(core).items():
        if not isinstance(obj, type) or name.startswith("_"):
            continue
        node = classes[name]
        out.append((name, _stub_doc(node), inspect.cleandoc(obj.__doc__ or "")))
        methods = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
        # Sorted: the compiled class's attribute order is not fixed from one
        # process to the next (pytest-xdist's workers must collect the same tests).
        for attr, value in sorted(vars(obj).items()):
            doc = getattr(value, "__doc__", None)
            # Plain data (a class default such as Rejected.permanent = False) is the
            # stub's annotation's, which stubtest checks; here: what has a docstring.
            if attr.startswith("__") or not doc or isinstance(value, str | bool | int | float):
                continue
            assert attr in methods, f"{name}.{attr} is not in the stub"
            out.append((f"{name}.{attr}", _stub_doc(methods[attr]), inspect.cleandoc(doc)))
    return out


@pytest.mark.parametrize(("qualname", "stub", "runtime"),
                         [pytest.param(*p, id=p[0]) for p in _documented_pairs()])  # fmt: skip
def test_docstrings_are_the_compiled_ones(qualname: str, stub: str | None, runtime: str) -> None:
    assert _norm(stub) == _norm(runtime), f"{qualname}: stub and module disagree"


# -- TypedDicts -----------------------------------------------------------------


def _typeddict_keys(name: str) -> tuple[set[str], set[str]]:
    """(every key, the NotRequired ones) of TypedDict `name` in the stub."""
    node = _classes()[name]
    keys: set[str] = set()
    optional: set[str] = set()
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id != "TypedDict":
            k, o = _typeddict_keys(base.id)
            keys |= k
            optional |= o
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            keys.add(item.target.id)
            if "NotRequired" in ast.unparse(item.annotation):
                optional.add(item.target.id)
    return keys, optional


def _check(name: str, value: dict[str, Any]) -> None:
    keys, optional = _typeddict_keys(name)
    assert set(value) <= keys, f"{name}: keys the stub lacks: {set(value) - keys}"
    assert keys - optional <= set(value), f"{name}: missing {keys - optional - set(value)}"


def _literal(alias: str) -> set[str]:
    for node in TREE.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == alias:
            return {
                ast.literal_eval(e) for e in ast.walk(node.value) if isinstance(e, ast.Constant)
            }
    raise AssertionError(f"{alias} is not in the stub")


RUNGS = [
    {"signal": "queue_depth", "engage": 2, "release": 1, "action": "cap_max_tokens", "value": 4},
    {"signal": "reserved_share", "engage": 0.99, "release": 0.5, "action": "shed_lowest_tier"},
]


def _busy_scheduler() -> tuple[kvsched.Scheduler, list[int]]:
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(
        num_blocks=65, block_size=8, max_num_seqs=2, max_batched_tokens=32, max_seq_len=64,
        overhead_reserve=0.0, max_waiting=8, ladder=RUNGS))  # fmt: skip
    sched.add_tenant(kvsched.TenantConfig("a", kv_cap_blocks=40, rate_tokens_per_s=1e6))
    rids = [sched.submit("a", np.arange(1, 10, dtype=np.int32), 8, now=0.0) for _ in range(4)]
    for k in range(3):
        plan = sched.step(now=0.1 * k)
        assert plan is not None
        sched.commit(plan, np.ones(len(plan), dtype=np.int32), now=0.1 * k)
    return sched, rids


def test_stats_plan_shape_and_pressure_match_their_typeddicts() -> None:
    sched, _ = _busy_scheduler()
    st = sched.stats(now=1.0)
    _check("SchedulerStats", dict(st))
    _check("PoolStats", dict(st["pool"]))
    _check("RejectionCounts", dict(st["rejected"]))
    assert set(st["rejected"]) == set(kvsched.REJECT_REASONS)
    _check("Histogram", dict(st["step_gap"]))
    _check("LadderStats", dict(st["ladder"]))
    for rung in st["ladder"]["rungs"]:
        _check("LadderRungState", dict(rung))
    _check("Pressure", dict(st["pressure"]))
    for t in st["tenants"].values():
        _check("TenantStats", dict(t))
        _check("PrefixCacheStats", dict(t["prefix_cache"]))
        _check("RejectionCounts", dict(t["rejected"]))
        for h in ("queue_time", "ttft", "inter_token", "e2e"):
            _check("Histogram", dict(t[h]))
    _check("PlanShape", dict(sched.plan_shape))
    _check("Pressure", dict(sched.pressure(now=1.0)))
    for rung in sched.config.ladder:
        _check("LadderRung", dict(rung))
    assert st["lifecycle"] in _literal("_Lifecycle")


def test_events_match_their_typeddicts() -> None:
    sched, _ = _busy_scheduler()
    events = sched.take_events()
    kinds = {e["kind"] for e in events}
    assert {"rung_engaged", "max_tokens_capped"} <= kinds, kinds
    for e in events:
        _check("MaxTokensCappedEvent" if e["kind"] == "max_tokens_capped" else "RungEvent", dict(e))
        if e["kind"] != "max_tokens_capped":
            _check("Pressure", dict(e["pressure"]))


def test_checkpoint_records_match_their_typeddicts() -> None:
    sched, rids = _busy_scheduler()
    sched.drain(100.0)
    while True:
        plan = sched.step(now=1.0)
        if plan is None:
            break
        events = sched.commit(plan, np.ones(len(plan), dtype=np.int32), now=1.0)
        if events.finished:
            break
    records = sched.checkpoint_records()
    assert {r["kind"] for r in records} == {"finished", "in_flight"}
    for r in records:
        _check("FinishedRecord" if r["kind"] == "finished" else "InFlightRecord", dict(r))
    fresh = kvsched.Scheduler(sched.config.replace(ladder=None))
    fresh.add_tenant(kvsched.TenantConfig("a"))
    out = fresh.restore_records([r for r in records if r["kind"] == "in_flight"], now=0.0)
    _check("RestoredRecords", dict(out))


def test_literal_vocabularies_are_the_modules() -> None:
    assert set(kvsched.REJECT_REASONS) == _literal("_RejectReason")
    assert kvsched.build_profile in ("debug", "release")
    cfg = kvsched.SchedulerConfig(require_warmup=True)
    sched = kvsched.Scheduler(cfg)
    seen = {sched.lifecycle}
    sched.begin_warmup()
    seen.add(sched.lifecycle)
    sched.mark_ready()
    seen.add(sched.lifecycle)
    sched.drain(0.0)
    seen.add(sched.lifecycle)
    assert seen <= _literal("_Lifecycle") and "cold" in seen
    for mode in ("reserve", "overcommit"):
        assert kvsched.SchedulerConfig(admission=mode).admission in _literal("_Admission")


@pytest.mark.slow
@pytest.mark.subprocess
def test_mypy_strict_passes_on_the_examples() -> None:
    """Strict on everything it follows from the examples: the engine and serve
    packages included (no override in pyproject.toml hides a module's errors)."""
    pytest.importorskip("mypy")
    cmd = [sys.executable, "-m", "mypy", "--strict", "examples/", "python/kvsched/checkpoint.py"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    mypy_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    for override in mypy_cfg.get("overrides", []):
        hidden = {k: override[k] for k in ("ignore_errors", "follow_imports") if k in override}
        assert not hidden, f"pyproject.toml hides {override['module']} from mypy: {hidden}"
