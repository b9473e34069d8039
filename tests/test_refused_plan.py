"""A plan that full_validation refuses (InternalError) serves nobody. The
tenants' virtual times (fair share) stay those of a scheduler where the refused
step never ran, then and after the steps that follow: the refused step's
service is not charged on top of the next step's."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import kvsched

from helpers import ids


def _twin() -> tuple[kvsched.Scheduler, int]:
    s = kvsched.Scheduler(
        kvsched.SchedulerConfig(num_blocks=64, block_size=4, full_validation=True)
    )
    s.add_tenant(kvsched.TenantConfig("a"))
    s.add_tenant(kvsched.TenantConfig("b", weight=3.0))
    ra = s.submit("a", ids(12), 30, now=0.0)
    s.submit("b", ids(12, start=500), 30, now=0.0)
    for now in (0.0, 0.01):
        p = s.step(now=now)
        s.commit(p, np.full(len(p), 3, np.int32), now=now)
    return s, ra


def _vtimes(s: kvsched.Scheduler) -> dict[str, float]:
    return {t: v["virtual_time"] for t, v in s.stats(now=0.05)["tenants"].items()}


def test_a_refused_plan_charges_no_tenant() -> None:
    s, ra = _twin()
    never, _ = _twin()  # the same scheduler; its refused step never happens
    assert _vtimes(s) == _vtimes(never)
    # Write another request's page into `a`'s row of buffer set 0 (the next
    # step's), through raw memory: numpy cannot write the array.
    p = s.step(now=0.02)
    rows = p.page_indices
    row_a = p.request_ids.tolist().index(ra)
    s.commit(p, np.full(len(p), 3, np.int32), now=0.02)
    q = never.step(now=0.02)
    never.commit(q, np.full(len(q), 3, np.int32), now=0.02)
    # `p`'s arrays are the buffer set the step after next writes.
    p = s.step(now=0.03)
    s.commit(p, np.full(len(p), 3, np.int32), now=0.03)
    q = never.step(now=0.03)
    never.commit(q, np.full(len(q), 3, np.int32), now=0.03)
    other = int(rows[1 - row_a, 0])
    addr = rows.ctypes.data + row_a * rows.strides[0]
    ctypes.memmove(addr, np.array([other], np.int32).ctypes.data, 4)
    with pytest.raises(kvsched.InternalError, match="does not hold the request's pages"):
        s.step(now=0.04)
    assert _vtimes(s) == _vtimes(never)
    for now in (0.04, 0.05, 0.06):
        for x in (s, never):
            plan = x.step(now=now)
            x.commit(plan, np.full(len(plan), 3, np.int32), now=now)
        assert _vtimes(s) == _vtimes(never)
