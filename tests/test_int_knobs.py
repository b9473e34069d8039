"""Issue 14 leftover: an integer knob out of range (a negative int, an int of 64
bits or more, an int of 32 bits or more for the u32 knobs) is an InvalidConfig
naming the knob and the range it accepts, through every path a config is built
by (the constructors, replace, reconfigure, update_tenant), and changes
nothing. Before, pyo3 raised a bare OverflowError ("can't convert negative int
to unsigned") that named no knob."""

from __future__ import annotations

import pytest

import kvsched

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


def test_in_range_values_still_accepted():
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
