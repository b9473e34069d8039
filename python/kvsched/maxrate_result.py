"""The simulator's max-rate result (`kvsched simulate --find-max-rate --json
FILE`): the one class for it, its JSON file, and the reader the cost model uses
to cost a replica at that rate. Imports no simulator and no JAX, so the capacity
planner (kvsched.capacity) and the search (kvsched.sim.maxrate) both use it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvsched.shapes import CapacityError


@dataclass
class MaxRate:
    """The result of `find_max_rate`; `to_json` / `from_json` round-trip it.

    `multiplier`: the highest multiplier found to meet every target; the rates
    are measured there (offered requests/s, served output and prompt tokens per
    second of the run, pooled over the seeds). `upper`: the lowest multiplier
    found to miss (None: none missed up to the search's limit, and `binding` is
    None). `binding`: {"tenant", "constraint"} at `upper`."""

    multiplier: float
    requests_per_s: float
    output_tokens_per_s: float
    input_tokens_per_s: float
    model: str
    accelerator: str
    devices: int
    trace: str
    attainment_target: float
    binding: dict[str, str] | None
    slos: dict[str, str]
    upper: float | None = None
    seeds: int = 1
    variation: str = "shift"
    scenario: str = "continuous"
    attainment: dict[str, float] = field(default_factory=dict)  # at `multiplier`
    points: list[dict[str, Any]] = field(default_factory=list)  # in the order tried
    runs: int = 0  # simulations run
    wall_s: float = 0.0

    def line(self) -> str:
        """`max rate: <multiplier>x = <requests/s> req/s (binding: <tenant> <constraint>)`."""
        rate = f"{self.multiplier:.3g}x = {self.requests_per_s:.3g} req/s"
        if self.binding is None:
            return f"max rate: {rate} (binding: none up to the search limit, {self.multiplier:g}x)"
        return f"max rate: {rate} (binding: {self.binding['tenant']} {self.binding['constraint']})"

    @property
    def tokens_per_s(self) -> float:
        """Prompt + output tokens/s of one replica (the devices together): the
        tokens a cost --load counts, as `capacity.load_series` does."""
        return self.input_tokens_per_s + self.output_tokens_per_s

    def describe(self, source: str = "") -> str:
        """Where a figure costed at this rate comes from, in words (`source`: the
        file it was read from)."""
        # No binding: the search met the SLOs up to its limit and stopped there,
        # so the replica was never shown to miss: its rate is a floor, not a max.
        bound = (f"binding {self.binding['tenant']} {self.binding['constraint']}"
                 if self.binding else
                 f"no binding: every load up to the search's limit {self.multiplier:g}x met "
                 "the SLOs, so this is a lower bound on what a replica sustains")  # fmt: skip
        return (
            f"the simulator's max rate ({f'{source}: ' if source else ''}trace {self.trace}, "
            f"{self.multiplier:g}x = {self.requests_per_s:,.2f} req/s at attainment "
            f"{self.attainment_target:g}, {bound})"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> MaxRate:
        """A result `to_json` wrote; ValueError naming what is missing or of the
        wrong type."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a max-rate result is a JSON object")
        known = set(cls.__dataclass_fields__)
        missing = {"multiplier", "requests_per_s", "output_tokens_per_s", "input_tokens_per_s",
                   "model", "accelerator", "devices", "trace", "attainment_target", "binding",
                   "slos"} - set(data)  # fmt: skip
        if missing:
            raise ValueError(f"a max-rate result lacks {', '.join(sorted(missing))}")
        fields = {k: v for k, v in data.items() if k in known}
        for name, kind in (("multiplier", float), ("requests_per_s", float),
                           ("output_tokens_per_s", float), ("input_tokens_per_s", float),
                           ("attainment_target", float), ("devices", int), ("model", str),
                           ("accelerator", str), ("trace", str)):  # fmt: skip
            try:
                fields[name] = kind(fields[name])
            except (TypeError, ValueError):
                raise ValueError(f"{name} is {fields[name]!r}, not a {kind.__name__}") from None
        binding = fields["binding"]
        if binding is not None and not (
            isinstance(binding, dict) and {"tenant", "constraint"} <= set(binding)
        ):
            raise ValueError(f"binding is {binding!r}, not {{tenant, constraint}} or null")
        return cls(**fields)


def load_max_rate(path: str, *, model: str, accelerator: str, devices: int) -> MaxRate:
    """Read a max-rate file (`kvsched simulate --find-max-rate --json FILE`) to cost
    a replica at; refuse (CapacityError) one for another model, accelerator or
    device count than the one costed, or one with no rate."""
    try:
        with open(path) as f:
            mr = MaxRate.from_json(f.read())
    except json.JSONDecodeError as e:
        raise CapacityError(f"{path}: not JSON ({e})") from None
    except ValueError as e:
        raise CapacityError(f"{path}: not a max-rate result ({e})") from None
    for what, mine, theirs in (("model", model, mr.model),
                               ("accelerator", accelerator, mr.accelerator),
                               ("devices", devices, mr.devices)):  # fmt: skip
        if mine != theirs:
            raise CapacityError(
                f"{path} is the max rate of {mr.devices} x {mr.accelerator} serving "
                f"{mr.model}, not of {devices} x {accelerator} serving {model} ({what} "
                "differs): simulate this configuration's max rate"
            )
    if not (mr.tokens_per_s > 0 and math.isfinite(mr.tokens_per_s)):
        raise CapacityError(
            f"{path}: the max rate sustains {mr.tokens_per_s:g} tokens/s (no load met the "
            "SLOs?): nothing to cost a replica at"
        )
    return mr
