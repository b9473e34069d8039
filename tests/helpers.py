"""Small helpers shared by the tests."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np


def ids(n: int, start: int = 1) -> np.ndarray:
    """A prompt of `n` int32 token ids."""
    return np.arange(start, start + n, dtype=np.int32)


def without_rejections(stats: dict[str, Any]) -> dict[str, Any]:
    """stats() with every rejection counter removed: what a rejection must not change."""
    out = copy.deepcopy(stats)
    out.pop("rejected")
    for t in out["tenants"].values():
        t.pop("rejected")
    return out


def rejection_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Which global rejection counters moved, and by how much."""
    return {
        r: after["rejected"][r] - before["rejected"][r]
        for r in after["rejected"]
        if after["rejected"][r] != before["rejected"][r]
    }
