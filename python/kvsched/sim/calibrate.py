"""`kvsched calibrate`: the simulator's step-cost model fitted to the real engine
on the device at hand.

The engine (kvsched.engine.runner.Engine) runs steps of known composition over
a grid of points: `decode` sequences each decoding one token at about
`context` tokens of KV, plus `prefill` prompt tokens in the same step (split
into sequences of at most the engine's max_seq_len - 1 tokens). Each point's
step is timed whole (scheduler plan, model, sampling, commit: what a step
costs a server), `reps` times after `warmup` untimed runs (the first run of a
new token bucket compiles), and the median taken; the grid is measured in
`passes` passes, and a point keeps its lowest pass median: other work on the
machine only ever adds time, and a burst of it can cover half of one pass.

How the steps are set up: the decoding sequences are admitted and prefilled by
the scheduler alone (plan and commit, the model not run): their KV pages hold
zeros rather than real keys and values, which changes no shape and so no
step's time; then every timed step runs through `Engine.step`, the same path
as serving. The engine's token buckets are every `block_size` tokens up to the
largest point, so a step pads at most block_size - 1 tokens, and the fitted
cost charges that padding (`StepCost.token_quantum`): the engine computes the
whole bucket (a 33-token step of SmolLM2 on CPU costs what a 48-token one
does). A production engine's power-of-two buckets pad up to 2x, which this
does not model.

The fit: the simulator's model, step = overhead + max(compute, memory) with
compute = tokens x 2 x params / flop_rate and memory = (weight bytes + KV bytes
read) / byte_rate (kvsched.sim.simulator.StepCost; KV read = each scheduled
sequence's kv_len, only what the window covers in a sliding-window layer, as
the simulator counts it: kv_tokens_read). Least squares on the relative
error (each point weighted by 1 / its time, so a 1 ms step counts as much as a
100 ms one) of that exact max() model: the max() makes a point compute-bound
exactly when tokens x 2 x params / (weight + KV bytes) is above
flop_rate / byte_rate, so every split of the points sorted by that ratio is
tried, each a linear least squares in (overhead, 1/flop_rate, 1/byte_rate),
and the best fit of the max() model kept. When no point is memory-bound the
byte rate is not identified: the file then holds the lowest byte rate that
keeps every measured point compute-bound, and says so (`identified`); the same
the other way round.

What the file records (`StepCost.to_json`, key `calibration`): the model (its
shape in full), the device, the kernel backend, the KV dtype, the grid, every
point's measured and predicted time, and the fit error (median and max
relative error on the fitted points and on held-out points, which the fit did
not see). `kvsched simulate --step-cost FILE` refuses a file calibrated on
another model than the one simulated: the fitted rates are the engine's on
that model, not a property of the device alone.

Timing is wall-clock (a step's latency) or, with clock="cpu", the process's
CPU seconds over the step, which other work on a shared machine inflates far
less (see `calibrate`).

On CPU with the `reference` backend, the attention gathers each token row's
whole page row (max_seq_len tokens, a static shape), so a step's time follows
its tokens, its number of sequences and the engine's max_seq_len (the grid's
longest context plus the timed steps, kept small) more than the context:
there the fitted byte rate stands for what decode-heavy steps cost beyond
their tokens (more sequences, more page rows gathered) rather than for a
memory bandwidth. The gathered rows (tokens x max_seq_len) can outgrow the
CPU's caches, and the time then stops being linear in tokens: on this
project's machine, at max_seq_len 272 a 128-token step took 7x a 64-token one
(at max_seq_len 64, 1.4x). The CLI's default grid keeps contexts under 64 and
steps under 160 tokens.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

import kvsched
from kvsched.shapes import Accelerator, ModelShape
from kvsched.sim.simulator import StepCost, kv_tokens_read

if TYPE_CHECKING:
    from kvsched.engine.model_config import LlamaConfig
    from kvsched.engine.runner import Engine


CLOCKS = ("wall", "cpu")


class CalibrationError(ValueError):
    """A grid the engine cannot run as asked, or too few points to fit."""


@dataclass(frozen=True)
class Point:
    """One step's composition: `decode` sequences decoding a token each, each
    holding about `context` tokens of KV, and `prefill` prompt tokens."""

    decode: int
    prefill: int
    context: int

    @property
    def tokens(self) -> int:
        return self.decode + self.prefill


@dataclass
class Measured:
    point: Point
    tokens: int  # scheduled tokens of the step, as planned
    kv_read: float  # KV tokens the step read (kv_tokens_read; mean over the timed steps)
    seconds: float  # median of the timed steps
    samples: list[float] = field(default_factory=list)
    predicted: float = math.nan  # the fitted model's time

    @property
    def error(self) -> float:
        """Relative error of the prediction: (predicted - measured) / measured."""
        return (self.predicted - self.seconds) / self.seconds


def grid(decode: Sequence[int], prefill: Sequence[int], context: Sequence[int]) -> list[Point]:
    """Every combination, less the empty step (no decode, no prefill) and the
    duplicates a context makes without decoding sequences."""
    out: list[Point] = []
    for d in decode:
        for p in prefill:
            for c in context if d else (1,):
                pt = Point(d, p, c)
                if pt.tokens > 0 and pt not in out:
                    out.append(pt)
    return out


def check_points(points: Sequence[Point]) -> None:
    for p in points:
        if p.decode < 0 or p.prefill < 0 or p.context < 1 or p.tokens == 0:
            raise CalibrationError(
                f"{p}: decode and prefill must be >= 0 with at least one token, context >= 1"
            )


def model_shape(config: LlamaConfig, params: Any) -> ModelShape:
    """The step-cost model's view of an engine model: its layers and KV heads,
    and its parameter count from the weights themselves."""
    import jax

    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    # A hybrid model's layers (Gemma 3's config says them: `layer_kinds`): the
    # step cost then charges a window layer only its window's KV.
    kinds = tuple(getattr(config, "layer_kinds", ()))
    return ModelShape(config.name, config.n_layers, config.n_kv_heads, config.head_dim,
                      float(n), config.vocab_size, hidden=config.dim,
                      query_heads=config.n_heads, ffn=config.ffn_dim,
                      layer_types=kinds)  # fmt: skip


class Bench:
    """An engine sized for a set of points, and the timing of one point."""

    TENANT = "calibrate"

    def __init__(
        self,
        model: LlamaConfig,
        params: Any,
        points: Sequence[Point],
        *,
        backend: str = "reference",
        kv_dtype: str = "float32",
        block_size: int = 16,
        steps_per_point: int = 16,
        seed: int = 0,
    ) -> None:
        from kvsched.engine.runner import Engine

        check_points(points)
        if not points:
            raise CalibrationError("no points to measure")
        bs = block_size
        self.max_tokens = -(-max(p.tokens for p in points) // bs) * bs
        # A step budget that prefills all of a point's decoders at once (those
        # set-up steps never run the model, so their buckets never compile):
        # a decoder then waits no steps, decoding, for the others.
        budget = max(self.max_tokens, *(-(-p.decode * (p.context + 1) // bs) * bs
                                        for p in points))  # fmt: skip
        # Room for each decoder's context, its set-up step and the timed steps.
        # Kept small on purpose: the reference attention gathers max_seq_len
        # tokens for every token row.
        longest = max(p.context for p in points) + steps_per_point + 2
        self.max_seq_len = -(-longest // bs) * bs
        self.chunk = self.max_seq_len - 1  # the longest prefill sequence
        seqs = max(p.decode + self._prefill_seqs(p.prefill) for p in points)
        pages = self.max_seq_len // bs
        cfg = kvsched.SchedulerConfig(
            num_blocks=(seqs + 1) * pages + 1, block_size=bs, max_num_seqs=seqs + 1,
            max_batched_tokens=budget, max_seq_len=self.max_seq_len,
            long_prefill_chunk=self.chunk, overhead_reserve=0.0, max_waiting=2 * seqs + 2,
            prefix_caching=False, token_buckets=list(range(bs, budget + 1, bs)),
        )  # fmt: skip
        sched = kvsched.Scheduler(cfg)
        sched.add_tenant(kvsched.TenantConfig(self.TENANT))
        # One step at a time, each timed whole: not overlapped with the next.
        self.engine: Engine = Engine(model, params, sched, backend=backend, kv_dtype=kv_dtype,
                                     overlap=False)  # fmt: skip
        self.steps_per_point = steps_per_point
        self.shape = model_shape(model, params)  # what a step's KV read is counted on
        self.rng = np.random.default_rng(seed)
        self.vocab = model.vocab_size

    def _prefill_seqs(self, tokens: int) -> int:
        return -(-tokens // self.chunk) if tokens else 0

    def _prompt(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab, n, dtype=np.int32)

    def measure(
        self, point: Point, *, reps: int = 5, warmup: int = 1, clock: str = "wall"
    ) -> Measured:
        """Time `reps` steps of `point` (after `warmup` untimed ones) through the
        engine; the median is the point's time. `clock`: "wall" (the step's
        latency) or "cpu" (the process's CPU time over the step: see
        `calibrate`)."""
        if clock not in CLOCKS:
            raise CalibrationError(f"clock must be one of {', '.join(CLOCKS)}, not {clock!r}")
        if reps < 1 or warmup < 0 or reps + warmup > self.steps_per_point:
            raise CalibrationError(
                f"reps ({reps}) >= 1 and warmup ({warmup}) >= 0, at most "
                f"{self.steps_per_point} steps a point"
            )
        s, now = self.engine.scheduler, 0.0
        t = self.TENANT
        room = self.max_seq_len - point.context
        decoders = [s.submit(t, self._prompt(point.context), room, now=now)
                    for _ in range(point.decode)]  # fmt: skip
        started: set[int] = set()
        try:
            # Prefill the decoders with the scheduler alone (see the module's doc).
            while len(started) < point.decode:
                plan = s.step(now=now)
                if plan is None:
                    raise CalibrationError(f"{point}: the scheduler planned nothing")
                events = s.commit(plan, np.zeros(len(plan), np.int32), now=now)
                started.update(events.request_ids.tolist())
            samples: list[float] = []
            kv: list[float] = []
            for i in range(warmup + reps):
                chunks, left = [], point.prefill
                while left:
                    chunks.append(min(left, self.chunk))
                    left -= chunks[-1]
                prefills = [s.submit(t, self._prompt(n), 1, now=now) for n in chunks]
                cpu = time.process_time()
                res = self.engine.step(now=now)
                cpu = time.process_time() - cpu
                for rid in prefills:
                    s.cancel(rid, now=now)
                if res is None or res.plan is None or res.plan.num_tokens != point.tokens:
                    got = None if res is None or res.plan is None else res.plan.num_tokens
                    raise CalibrationError(
                        f"{point}: the step ran {got} tokens, not {point.tokens} (the "
                        "engine is too small for the point?)"
                    )
                if i >= warmup:
                    samples.append(res.seconds if clock == "wall" else cpu)
                    n = len(res.plan)
                    kv.append(
                        kv_tokens_read(
                            self.shape,
                            np.asarray(res.plan.kv_lens)[:n],
                            np.diff(np.asarray(res.plan.cu_q_lens)[: n + 1]),
                        )
                    )
        finally:
            for rid in decoders:
                s.cancel(rid, now=now)
            s.take_finished()
        return Measured(point, point.tokens, float(np.mean(kv)), float(np.median(samples)),
                        samples)  # fmt: skip


# -- the fit ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    overhead_s: float
    flop_rate: float
    byte_rate: float
    identified: dict[str, bool]  # which of the rates some point bound


def _features(
    measured: Sequence[Measured], shape: ModelShape, weight_bytes: float, kv_dtype_bytes: float,
    quantum: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    flops = np.array([-(-m.tokens // quantum) * quantum * shape.flops_per_token()
                      for m in measured])  # fmt: skip
    mem = np.array([weight_bytes + m.kv_read * shape.kv_bytes_per_token(kv_dtype_bytes)
                    for m in measured])  # fmt: skip
    t = np.array([m.seconds for m in measured])
    return flops, mem, t


def _nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (few unknowns: each subset of
    the columns is tried, the best feasible solution kept)."""
    n = a.shape[1]
    # Columns scaled to 1 first: FLOPs (~1e12) beside a constant (~1e3) would
    # otherwise cost the solver most of its precision.
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a_n = a / scale
    best, best_loss = np.zeros(n), float(np.sum(b**2))
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(a_n[:, cols], b, rcond=None)
        if (x < 0).any():
            continue
        full = np.zeros(n)
        full[cols] = x / scale[cols]
        loss = float(np.sum((a @ full - b) ** 2))
        if loss < best_loss:
            best, best_loss = full, loss
    return best


def fit(
    measured: Sequence[Measured],
    shape: ModelShape,
    *,
    weight_bytes: float,
    kv_dtype_bytes: float,
    token_quantum: int = 1,
) -> Fit:
    """Overhead, FLOP rate and byte rate of step = overhead + max(flops /
    flop_rate, bytes / byte_rate), least squares on the relative error (see the
    module's doc)."""
    if len(measured) < 3:
        raise CalibrationError(f"{len(measured)} points: at least 3 are needed to fit 3 figures")
    flops, mem, t = _features(measured, shape, weight_bytes, kv_dtype_bytes, token_quantum)
    w = 1.0 / t
    order = np.argsort(flops / mem)  # compute-bound points are those of the highest ratios
    best: tuple[float, np.ndarray] | None = None
    for k in range(len(t) + 1):  # the k lowest ratios memory-bound, the rest compute-bound
        memory_bound = np.zeros(len(t), bool)
        memory_bound[order[:k]] = True
        a = np.stack([np.ones_like(t), np.where(memory_bound, 0, flops),
                      np.where(memory_bound, mem, 0)], axis=1)  # fmt: skip
        x = _nonneg_lstsq(a * w[:, None], t * w)
        pred = x[0] + np.maximum(flops * x[1], mem * x[2])
        loss = float(np.sum(((pred - t) * w) ** 2))
        if best is None or loss < best[0] - 1e-15:
            best = (loss, x)
    assert best is not None
    o, u, v = best[1]
    identified = {"flop_rate": bool(u > 0 and (flops * u >= mem * v).any()),
                  "byte_rate": bool(v > 0 and (mem * v > flops * u).any())}  # fmt: skip
    if u <= 0 and v <= 0:
        raise CalibrationError("the step time does not grow with tokens or KV: nothing to fit")
    if not identified["byte_rate"]:
        # No point was memory-bound: the lowest byte rate that keeps them all so.
        v = float(np.min(flops * u / mem))
    if not identified["flop_rate"]:
        u = float(np.min(mem * v / flops))
    return Fit(float(o), 1.0 / u, 1.0 / v, identified)


# -- calibration -----------------------------------------------------------------------


@dataclass
class Calibration:
    cost: StepCost
    fitted: list[Measured]
    held_out: list[Measured]
    wall_s: float = 0.0

    @staticmethod
    def _errors(ms: Sequence[Measured]) -> dict[str, float]:
        e = [abs(m.error) for m in ms]
        if not e:
            return {"median": math.nan, "max": math.nan, "points": 0}
        return {"median": float(np.median(e)), "max": float(max(e)), "points": len(e)}

    @property
    def fit_error(self) -> dict[str, float]:
        return self._errors(self.fitted)

    @property
    def held_out_error(self) -> dict[str, float]:
        return self._errors(self.held_out)

    def report(self) -> str:
        c = self.cost
        cal = c.calibration or {}
        ident = cal.get("identified", {})
        lines = [
            f"calibrated {c.model.name} on {cal.get('device')} (backend {cal.get('backend')}, "
            f"KV {cal.get('kv_dtype')}) in {self.wall_s:.1f} s",
            f"  overhead     {c.overhead_s * 1e3:10.3f} ms per step",
            f"  FLOP rate    {c.flop_rate or 0:10.3e} FLOP/s"
            + ("" if ident.get("flop_rate", True) else "  (not identified: no point "
               "was compute-bound; the highest rate consistent)"),
            f"  byte rate    {c.byte_rate or 0:10.3e} bytes/s"
            + ("" if ident.get("byte_rate", True) else "  (not identified: no point "
               "was memory-bound; the lowest rate consistent)"),
            "  point (decode, prefill, context)  tokens   kv_read   measured ms  predicted ms  "
            "error",
        ]  # fmt: skip
        for label, ms in (("fit", self.fitted), ("held-out", self.held_out)):
            for m in ms:
                p = m.point
                lines.append(
                    f"  {label:<8} ({p.decode:>3}, {p.prefill:>5}, {p.context:>6})    "
                    f"{m.tokens:>6} {m.kv_read:>9,.0f} {m.seconds * 1e3:>13.3f} "
                    f"{m.predicted * 1e3:>13.3f} {m.error:>+6.1%}"
                )
        for label, e in (("fitted points", self.fit_error), ("held-out points",
                                                             self.held_out_error)):  # fmt: skip
            if e["points"]:
                lines.append(f"  relative error on {e['points']} {label}: median "
                             f"{e['median']:.1%}, max {e['max']:.1%}")  # fmt: skip
        return "\n".join(lines)


def device_name() -> str:
    import jax

    d = jax.devices()[0]
    kind = getattr(d, "device_kind", "") or d.platform
    if d.platform == "cpu":
        kind = f"cpu {platform.processor() or platform.machine()}".strip()
    return f"{kind} x {jax.device_count()} ({d.platform}, jax {jax.__version__})"


def calibrate(
    model: LlamaConfig,
    params: Any,
    points: Sequence[Point],
    held_out: Sequence[Point] = (),
    *,
    backend: str = "reference",
    kv_dtype: str = "float32",
    reps: int = 7,
    warmup: int = 1,
    passes: int = 3,
    clock: str = "wall",
    name: str | None = None,
    progress: Callable[[int, int, Point], None] | None = None,
) -> Calibration:
    """Measure `points` and `held_out` on the engine (`passes` times over the
    whole grid, `reps` timed steps each), fit the step cost on `points` alone,
    and predict both. `name` names the model in the file (default: the
    config's), e.g. the capacity preset it corresponds to.

    `clock="wall"` times a step's latency: what the simulator charges, right on
    a machine the calibration has to itself. `clock="cpu"` times the CPU
    seconds the process spent on the step instead: the same figure on an idle
    machine where XLA runs the step on one thread (more where it runs several),
    and one that other work on a shared machine does not inflate (on this
    project's shared 2-core machine at a load of ~7, wall medians came out 2-4x
    above the quieter machine's and uneven from pass to pass, CPU medians
    steady and 0-25% above them)."""
    if passes < 1:
        raise CalibrationError(f"passes must be >= 1, got {passes}")
    if clock not in CLOCKS:
        raise CalibrationError(f"clock must be one of {', '.join(CLOCKS)}, not {clock!r}")
    t0 = time.perf_counter()
    shape = model_shape(model, params)
    if name is not None:
        shape = replace(shape, name=name)
    kv_bytes = float(np.dtype(kv_dtype).itemsize) if kv_dtype != "bfloat16" else 2.0
    weight_bytes = shape.params * (2.0 if model.dtype == "bfloat16" else 4.0)
    every = list(points) + list(held_out)
    bench = Bench(model, params, every, backend=backend, kv_dtype=kv_dtype,
                  steps_per_point=reps + warmup)  # fmt: skip
    runs: list[list[Measured]] = [[] for _ in every]
    for k in range(passes):
        for i, p in enumerate(every):
            if progress is not None:
                progress(k * len(every) + i, passes * len(every), p)
            runs[i].append(bench.measure(p, reps=reps, warmup=warmup, clock=clock))
    # Each pass's median; the lowest kept (a busy machine only adds time), with
    # every pass's samples.
    measured = []
    for r in runs:
        best = min(r, key=lambda m: m.seconds)
        best.samples = [x for m in r for x in m.samples]
        measured.append(best)
    fitted, held = measured[: len(points)], measured[len(points) :]
    quantum = bench.engine.scheduler.config.block_size  # the bucket spacing
    f = fit(fitted, shape, weight_bytes=weight_bytes, kv_dtype_bytes=kv_bytes,
            token_quantum=quantum)  # fmt: skip
    device = device_name()
    precision = "bf16" if model.dtype == "bfloat16" else "float32"
    acc = Accelerator(device, 0.0, f.byte_rate, f.flop_rate)
    cost = StepCost(shape, acc, precision=precision, kv_dtype_bytes=kv_bytes, mfu=1.0,
                    bandwidth_efficiency=1.0, overhead_s=f.overhead_s, flop_rate=f.flop_rate,
                    byte_rate=f.byte_rate, token_quantum=quantum)  # fmt: skip
    for m in measured:
        m.predicted = cost.seconds(m.tokens, round(m.kv_read))
    cal = Calibration(cost, fitted, held, time.perf_counter() - t0)
    cost = replace(cost, calibration={
        "model": shape.name,
        "model_config": asdict(model),
        "device": device,
        "backend": backend,
        "attention_kernel": bench.engine.attention_kernel,
        "kv_dtype": kv_dtype,
        "max_seq_len": bench.max_seq_len,
        "token_buckets": f"every {bench.engine.scheduler.config.block_size} tokens up to "
                         f"{bench.max_tokens}",
        "reps": reps,
        "warmup": warmup,
        "passes": passes,
        "clock": clock,
        "fit": "least squares on relative error of overhead + max(compute, memory), "
        "tokens padded to token_quantum",
        "identified": f.identified,
        "fit_error": cal.fit_error,
        "held_out_error": cal.held_out_error,
        "points": [{**asdict(m.point), "tokens": m.tokens, "kv_read": m.kv_read,
                    "measured_s": m.seconds, "predicted_s": m.predicted,
                    "held_out": i >= len(points)} for i, m in enumerate(measured)],
        "wall_s": cal.wall_s,
    })  # fmt: skip
    cal.cost = cost
    return cal
