"""Every knob of SchedulerConfig and TenantConfig round-trips: the constructor, the
getter, the repr, replace(), equality, the stub and the simulator all know it. And
every integer knob refuses a value out of its range (a negative int, an int of 64
bits or more, an int of 32 bits or more for the u32 knobs) with an InvalidConfig
naming the knob and the range it accepts, not pyo3's bare OverflowError ("can't
convert negative int to unsigned"), through every path a config is built by (the
constructors, replace, reconfigure, update_tenant), and changes nothing.

The knobs are listed once in the bindings (rust/py/config.rs, `knob_table!`); these
tests catch a knob missing from any place that is still written by hand (the
constructor's signature, the stub) or dropped on the way (the simulator's scenarios).
Extreme values within range, and what a scheduler does with them, are
test_extreme_values.py's.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

import kvsched
from kvsched.sim import scenarios

# One non-default value per knob; each is valid on its own over the defaults
# (watermark_blocks needs admission="overcommit", added where it is set alone).
SCHEDULER_KNOBS: dict[str, Any] = {
    "num_blocks": 1000,
    "block_size": 32,
    "max_num_seqs": 64,
    "max_batched_tokens": 1024,
    "max_seq_len": 4096,
    "overhead_reserve": 0.25,
    "max_waiting": 7,
    "long_prefill_chunk": 256,
    "token_buckets": [64, 2048],
    "admission": "overcommit",
    "watermark_blocks": 5,
    "preempt_lower_tiers": True,
    "full_validation": True,
    "prefix_caching": False,
    "prefix_cache_partition": "tenant",
    "ladder": [
        {
            "signal": "queue_depth",
            "engage": 10.0,
            "release": 5.0,
            "action": "max_running",
            "value": 8,
        },
    ],  # fmt: skip
    "ladder_retry_after_s": 2.5,
    "require_warmup": True,
    "retry_after_hint_s": 0.5,
    "vocab_size": 49152,
    "kv_cache_groups": ["full", "sliding_window:512", "chunked_local:64"],
}
WRITE_ONLY = {"prefix_cache_key"}
# Knobs whose value follows another's unless set: the derived token buckets end
# at max_batched_tokens; each admission mode has its own default watermark.
FOLLOWS = {"max_batched_tokens": {"token_buckets"}, "admission": {"watermark_blocks"}}
# Knobs whose test values exclude each other: a cache partitioned by tenant needs
# reserve admission. "At once" is checked on sets without such a pair, which
# between them hold every knob.
AT_ONCE = [
    {k: v for k, v in SCHEDULER_KNOBS.items() if k != "prefix_cache_partition"},
    {k: v for k, v in SCHEDULER_KNOBS.items() if k not in {"admission", "watermark_blocks"}},
]

TENANT_KNOBS: dict[str, Any] = {
    "name": "gold",
    "tier": 2,
    "kv_floor_blocks": 3,
    "kv_cap_blocks": 40,
    "max_concurrent": 6,
    "rate_tokens_per_s": 100.0,
    "burst_tokens": 250.0,
    "weight": 2.5,
    "max_step_tokens": 128,
    "prefix_namespace": "shared",
}


def _alone(knob: str) -> dict[str, Any]:
    changes = {knob: SCHEDULER_KNOBS[knob]}
    if knob == "watermark_blocks":
        changes["admission"] = "overcommit"
    return changes


def _rebuild(obj: object) -> object:
    return eval(repr(obj), {name: getattr(kvsched, name) for name in kvsched.__all__})


def _params(cls: type) -> list[str]:
    return list(inspect.signature(cls).parameters)


def test_the_table_covers_the_constructor() -> None:
    assert set(_params(kvsched.SchedulerConfig)) == set(SCHEDULER_KNOBS) | WRITE_ONLY
    assert set(_params(kvsched.TenantConfig)) == set(TENANT_KNOBS)


@pytest.mark.parametrize("knob", list(SCHEDULER_KNOBS))
def test_scheduler_knob_round_trips(knob: str) -> None:
    default = kvsched.SchedulerConfig()
    value = SCHEDULER_KNOBS[knob]
    assert getattr(default, knob) != value, "the test value must not be the default"

    built = kvsched.SchedulerConfig(**_alone(knob))
    replaced = default.replace(**_alone(knob))
    assert getattr(built, knob) == value
    assert built == replaced
    assert built != default
    assert f"{knob}={value!r}" in repr(built)
    assert _rebuild(built) == built
    assert built.replace() == built
    # Every other knob keeps the default's value.
    for other in SCHEDULER_KNOBS:
        if other not in _alone(knob) and other not in FOLLOWS.get(knob, set()):
            assert getattr(built, other) == getattr(default, other), other
    # And replacing another knob keeps this one.
    other = "max_waiting" if knob != "max_waiting" else "max_num_seqs"
    assert getattr(built.replace(**{other: SCHEDULER_KNOBS[other]}), knob) == value


@pytest.mark.parametrize("knobs", AT_ONCE)
def test_every_scheduler_knob_at_once(knobs: dict[str, Any]) -> None:
    assert set().union(*AT_ONCE) == set(SCHEDULER_KNOBS)
    cfg = kvsched.SchedulerConfig(**knobs)
    for knob, value in knobs.items():
        assert getattr(cfg, knob) == value, knob
        assert f"{knob}={value!r}" in repr(cfg), knob
    assert _rebuild(cfg) == cfg
    assert kvsched.SchedulerConfig().replace(**knobs) == cfg
    assert cfg.replace() == cfg


def test_a_partitioned_cache_refuses_overcommit() -> None:
    with pytest.raises(kvsched.InvalidConfig, match="prefix_cache_partition"):
        kvsched.SchedulerConfig(prefix_cache_partition="tenant", admission="overcommit")
    with pytest.raises(kvsched.InvalidConfig, match="prefix_cache_partition"):
        kvsched.SchedulerConfig(prefix_cache_partition="lru")
    sched = kvsched.Scheduler(kvsched.SchedulerConfig())
    with pytest.raises(kvsched.RestartRequired, match="prefix_cache_partition"):
        sched.reconfigure(prefix_cache_partition="tenant")


def test_derived_token_buckets_stay_derived() -> None:
    """The buckets of a config that never set them follow max_batched_tokens in a
    replace, and the repr rebuilds the config, not a copy with the list frozen."""
    cfg = kvsched.SchedulerConfig(max_batched_tokens=512)
    assert cfg.token_buckets[-1] == 512
    assert cfg.replace(max_batched_tokens=1024).token_buckets[-1] == 1024
    assert _rebuild(cfg) == cfg
    assert cfg != kvsched.SchedulerConfig(max_batched_tokens=512, token_buckets=cfg.token_buckets)


def test_the_key_is_carried_but_never_shown() -> None:
    key = bytes(range(16))
    cfg = kvsched.SchedulerConfig(prefix_cache_key=key)
    assert cfg != kvsched.SchedulerConfig()
    same_key = kvsched.SchedulerConfig(prefix_cache_key=key, max_waiting=3)
    assert cfg.replace(max_waiting=3) == same_key
    assert key.hex() not in repr(cfg) and "prefix_cache_key" not in repr(cfg)


@pytest.mark.parametrize("knob", list(TENANT_KNOBS))
def test_tenant_knob_round_trips(knob: str) -> None:
    default = kvsched.TenantConfig("t")
    value = TENANT_KNOBS[knob]
    assert getattr(default, knob) != value
    args = {k: v for k, v in {"name": "t", knob: value}.items() if k != "name"}
    if knob == "burst_tokens":  # a bucket size needs a rate
        args["rate_tokens_per_s"] = TENANT_KNOBS["rate_tokens_per_s"]
    built = kvsched.TenantConfig(value if knob == "name" else "t", **args)
    assert getattr(built, knob) == value
    assert built != default
    if knob == "name":
        assert repr(built).startswith(f"TenantConfig({value!r}, ")
    else:
        assert f"{knob}={value!r}" in repr(built)
    assert _rebuild(built) == built
    for other in TENANT_KNOBS:
        if other != knob and other not in args:
            assert getattr(built, other) == getattr(default, other), other


def test_every_tenant_knob_at_once() -> None:
    kwargs = {k: v for k, v in TENANT_KNOBS.items() if k != "name"}
    t = kvsched.TenantConfig(TENANT_KNOBS["name"], **kwargs)
    for knob, value in TENANT_KNOBS.items():
        assert getattr(t, knob) == value, knob
    assert _rebuild(t) == t


def _stub_class(name: str) -> ast.ClassDef:
    stub = Path(kvsched.__file__).with_name("_core.pyi")
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"{name} is not in the stub")


def _stub_knobs(name: str) -> tuple[set[str], set[str]]:
    """The stub's constructor parameters and properties of class `name`."""
    params: set[str] = set()
    props: set[str] = set()
    for item in _stub_class(name).body:
        if not isinstance(item, ast.FunctionDef):
            continue
        if item.name == "__new__":
            a = item.args
            params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]} - {"cls"}
        elif any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
            props.add(item.name)
    return params, props


def test_the_stub_lists_every_knob() -> None:
    params, props = _stub_knobs("SchedulerConfig")
    assert params == set(SCHEDULER_KNOBS) | WRITE_ONLY
    assert props == set(SCHEDULER_KNOBS)
    params, props = _stub_knobs("TenantConfig")
    assert params == set(TENANT_KNOBS)
    assert props == set(TENANT_KNOBS)


def test_the_simulator_keeps_the_base_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scenario changes its overrides and nothing else of the base config: not
    its token buckets, not require_warmup."""
    built: list[kvsched.SchedulerConfig] = []

    def fake_simulate(cfg: kvsched.SchedulerConfig, *args: Any, **kwargs: Any) -> None:
        built.append(cfg)

    monkeypatch.setattr(scenarios, "simulate", fake_simulate)
    base = kvsched.SchedulerConfig(
        token_buckets=[64, 2048], require_warmup=True, retry_after_hint_s=0.5, max_waiting=9
    )
    scenarios.run(base, [], [], None, scenarios.standard(base))  # type: ignore[arg-type]
    names = [sc.name for sc in scenarios.standard(base)]
    assert len(built) == len(names)
    by_name = dict(zip(names, built, strict=True))
    assert by_name["continuous"] == base
    for name, cfg in by_name.items():
        assert cfg.require_warmup is True, name
        assert cfg.retry_after_hint_s == 0.5, name
        assert cfg.max_waiting == 9, name
        assert cfg.token_buckets[:2] == [64, 2048], name
    assert by_name["unchunked"].token_buckets[-1] >= by_name["unchunked"].max_batched_tokens
    assert by_name["overcommit"].admission == "overcommit"
    assert by_name["overcommit"].watermark_blocks == 1
    assert by_name["reserve_20%"].overhead_reserve == 0.2


def test_a_scenario_switching_back_to_reserve_drops_the_watermark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[kvsched.SchedulerConfig] = []
    monkeypatch.setattr(scenarios, "simulate", lambda cfg, *a, **k: built.append(cfg))
    base = kvsched.SchedulerConfig(admission="overcommit", watermark_blocks=4)
    scenarios.run(base, [], [], None, [scenarios.Scenario("r", {"admission": "reserve"})])  # type: ignore[arg-type]
    assert built[0].admission == "reserve" and built[0].watermark_blocks is None


# -- integer knobs out of range ------------------------------------------------------

# Every integer knob, with its bit width (usize knobs take 0 .. 2**64-1).
SCHEDULER_INT_KNOBS = {
    "num_blocks": 64,
    "block_size": 64,
    "max_num_seqs": 64,
    "max_batched_tokens": 64,
    "max_seq_len": 64,
    "max_waiting": 64,
    "long_prefill_chunk": 64,
    "watermark_blocks": 64,
    "vocab_size": 32,
}
TENANT_INT_KNOBS = {
    "tier": 32,
    "kv_floor_blocks": 64,
    "kv_cap_blocks": 64,
    "max_concurrent": 32,
    "max_step_tokens": 64,
}
BAD = [-1, -(2**70), 2**64, 2**100, 10**5000]
BAD_IDS = ["-1", "-2**70", "2**64", "2**100", "10**5000"]


def _range(bits: int) -> str:
    return f"from 0 to 2**{bits}-1"


def _is_int_knob(value: object) -> bool:
    if isinstance(value, list):
        return bool(value) and all(_is_int_knob(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


def test_the_lists_hold_every_integer_knob():
    # A config with every optional integer knob set: each int-valued getter is
    # listed above (token_buckets, a list of ints, has its own tests).
    c = kvsched.SchedulerConfig(admission="overcommit", vocab_size=1)
    ints = {k for k in kvsched.SchedulerConfig.__dict__ if _is_int_knob(getattr(c, k, None))}
    assert ints == set(SCHEDULER_INT_KNOBS) | {"token_buckets"}
    t = kvsched.TenantConfig("a", kv_cap_blocks=1, max_concurrent=1, max_step_tokens=1)
    ints = {k for k in kvsched.TenantConfig.__dict__ if _is_int_knob(getattr(t, k, None))}
    assert ints == set(TENANT_INT_KNOBS)


def _overcommit_if_needed(knob: str) -> dict:
    return {"admission": "overcommit"} if knob == "watermark_blocks" else {}


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("knob", sorted(SCHEDULER_INT_KNOBS))
def test_scheduler_knob_out_of_range(knob, bad):
    want = f"{knob} out of range: must be an integer {_range(SCHEDULER_INT_KNOBS[knob])}"
    with pytest.raises(kvsched.InvalidConfig, match=want.replace("*", r"\*")):
        kvsched.SchedulerConfig(**{knob: bad}, **_overcommit_if_needed(knob))
    base = kvsched.SchedulerConfig(num_blocks=64, **_overcommit_if_needed(knob))
    with pytest.raises(kvsched.InvalidConfig, match=knob):
        base.replace(**{knob: bad})
    s = kvsched.Scheduler(base)
    before = s.config
    with pytest.raises(kvsched.InvalidConfig, match=knob):
        s.reconfigure(**{knob: bad})
    assert s.config == before


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("knob", sorted(TENANT_INT_KNOBS))
def test_tenant_knob_out_of_range(knob, bad):
    want = f"{knob} out of range: must be an integer {_range(TENANT_INT_KNOBS[knob])}"
    with pytest.raises(kvsched.InvalidConfig, match=want.replace("*", r"\*")):
        kvsched.TenantConfig("a", **{knob: bad})
    # update_tenant takes a TenantConfig: the refusal comes before it, and the
    # tenant keeps its configuration.
    s = kvsched.Scheduler(kvsched.SchedulerConfig(num_blocks=64))
    s.add_tenant(kvsched.TenantConfig("a", kv_floor_blocks=2))
    before = s.tenant("a")
    with pytest.raises(kvsched.InvalidConfig, match=knob):
        s.update_tenant(kvsched.TenantConfig("a", **{knob: bad}), now=0.0)
    assert s.tenant("a") == before


@pytest.mark.parametrize("knob", ["tier", "max_concurrent"])
def test_u32_knobs_refuse_32_bits(knob):
    with pytest.raises(kvsched.InvalidConfig, match=rf"{knob} .* got 4294967296"):
        kvsched.TenantConfig("a", **{knob: 2**32})
    assert getattr(kvsched.TenantConfig("a", **{knob: 2**32 - 1}), knob) == 2**32 - 1


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_token_bucket_entry_out_of_range(bad):
    with pytest.raises(
        kvsched.InvalidConfig, match=r"token_buckets entry out of range: .* 2\*\*64-1"
    ):
        kvsched.SchedulerConfig(token_buckets=[16, bad])
    s = kvsched.Scheduler(kvsched.SchedulerConfig(num_blocks=64))
    before = s.config
    with pytest.raises(kvsched.InvalidConfig, match="token_buckets"):
        s.reconfigure(token_buckets=[bad])
    assert s.config == before


@pytest.mark.parametrize("knob", sorted(SCHEDULER_INT_KNOBS) + ["token_buckets"])
def test_scheduler_knob_wrong_type_names_it(knob):
    # In the message itself (pyo3 names the argument only in a note, which
    # pytest's match= also reads but a log line or an HTTP error does not).
    with pytest.raises(TypeError) as e:
        kvsched.SchedulerConfig(**{knob: "7"}, **_overcommit_if_needed(knob))
    assert knob in str(e.value)


@pytest.mark.parametrize("knob", sorted(TENANT_INT_KNOBS))
def test_tenant_knob_wrong_type_names_it(knob):
    with pytest.raises(TypeError) as e:
        kvsched.TenantConfig("a", **{knob: "7"})
    assert knob in str(e.value)


def test_the_largest_in_range_values_are_accepted():
    # The largest values the readers take are the core's to judge (a floor of
    # 2**64-1 is the core's InvalidConfig about floors, not the reader's).
    t = kvsched.TenantConfig("a", tier=2**32 - 1, kv_cap_blocks=2**64 - 1)
    assert (t.tier, t.kv_cap_blocks) == (2**32 - 1, 2**64 - 1)
    with pytest.raises(kvsched.InvalidConfig) as e:
        kvsched.TenantConfig("a", kv_floor_blocks=2**64 - 1)
    assert "out of range: must be an integer" not in str(e.value)


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("knob", ["num_blocks", "block_size"])
def test_a_block_pool_out_of_range_names_its_argument(knob, bad):
    args = {"num_blocks": 8, "block_size": 16, knob: bad}
    with pytest.raises(kvsched.InvalidConfig) as e:
        kvsched.BlockPool(**args)
    assert knob in str(e.value) and _range(64) in str(e.value)
