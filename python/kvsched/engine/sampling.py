"""Per-request sampling: parameters, a fixed-shape batch of them, and a jittable sampler.

Every request may ask for its own temperature, top-k, top-p and seed. They reach the
jitted engine step as arrays of shape [max_seqs] rather than Python scalars, so a new
combination of values never triggers a recompile. Randomness is per row and keyed by
(request seed, position): a request samples the same tokens whichever batch row it sits
in and whoever shares the batch, and again after it is preempted and recomputed.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

import kvsched

MAX_LOGPROBS = 20
"""The most top-n logprobs one request may ask for (OpenAI's limit)."""

SEED_LIMIT = 2**63
"""Seeds live in [0, 2**63): they fit a signed 64-bit integer on every client."""

GREEDY_EPS = 1e-5
"""Temperatures below this sample greedily: logits / 1e-6 would overflow float32."""

_PRNG_IMPL = "threefry2x32"  # pinned: a config change must not change what a seed means
_MASK64 = (1 << 64) - 1


def _bad(field_name: str, msg: str) -> kvsched.InvalidRequest:
    return kvsched.InvalidRequest(f"{field_name}: {msg}")


def _as_int(field_name: str, value: Any) -> int:
    """An integer (numpy ints included); bools and floats are client mistakes."""
    if isinstance(value, bool | np.bool_):
        raise _bad(field_name, f"must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise _bad(field_name, f"must be an integer, got {value!r}") from None


def _as_float(field_name: str, value: Any) -> float:
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
        raise _bad(field_name, f"must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise _bad(field_name, f"must be finite, got {value!r}")
    return out


@dataclass(frozen=True)
class SamplingParams:
    """How one request wants its tokens drawn.

    Lists are accepted for the tuple fields (and a single string for `stop`, as in
    the OpenAI API); values are normalized and checked on construction, so a bad
    request fails at submit time with `kvsched.InvalidRequest` naming the field.
    Call `validate(vocab_size)` once the model's vocabulary is known to check
    `stop_token_ids` as well.
    """

    max_tokens: int = 256
    temperature: float = 0.0  # 0 (or below GREEDY_EPS) = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; the top token is always kept
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = the engine derives one from its seed and the request id
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized text
    logprobs: int | None = None  # top-n logprobs per token, 0..MAX_LOGPROBS; None = none
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalize in place once, here
        set_(self, "max_tokens", _as_int("max_tokens", self.max_tokens))
        set_(self, "temperature", _as_float("temperature", self.temperature))
        set_(self, "top_p", _as_float("top_p", self.top_p))
        set_(self, "top_k", _as_int("top_k", self.top_k))
        if self.seed is not None:
            set_(self, "seed", _as_int("seed", self.seed))
        if self.logprobs is not None:
            set_(self, "logprobs", _as_int("logprobs", self.logprobs))
        ids = self.stop_token_ids
        if isinstance(ids, int | np.integer):
            ids = (ids,)
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray):
            raise _bad("stop_token_ids", f"must be a list of integers, got {ids!r}")
        set_(self, "stop_token_ids", tuple(_as_int("stop_token_ids", i) for i in ids))
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop", f"must be a list of strings, got {stop!r}")
        set_(self, "stop", tuple(stop))
        set_(self, "ignore_eos", bool(self.ignore_eos))
        self.validate()

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise `kvsched.InvalidRequest` naming the first bad field; returns self.
        With `vocab_size`, stop token ids must also lie in [0, vocab_size)."""
        if self.max_tokens < 1:
            raise _bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**31:
            raise _bad("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise _bad("seed", f"must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise _bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        hi = vocab_size if vocab_size is not None else 2**31
        for t in self.stop_token_ids:
            if not 0 <= t < hi:
                where = f"the vocabulary [0, {vocab_size})" if vocab_size else "[0, 2**31)"
                raise _bad("stop_token_ids", f"{t} is outside {where}")
        for s in self.stop:
            if not s:
                raise _bad("stop", "stop strings must be non-empty")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise _bad("stop", f"{s!r} is not valid Unicode (a lone surrogate)") from None
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


GREEDY = SamplingParams()
"""The default: greedy, no stops, no logprobs."""


def mix_seed(engine_seed: int, request_id: int) -> int:
    """A seed in [0, 2**63) for a request that brought none: the engine's seed mixed
    with the request id (splitmix64), so concurrent requests draw independent streams
    and a replay with the same engine seed draws the same ones."""
    x = (engine_seed * 0x9E3779B97F4A7C15 + request_id + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class SamplingRow(NamedTuple):
    """One request's row of a `SamplingBatch`, the same every step of its life."""

    temperature: float
    top_p: float
    top_k: int
    seed_hi: int  # the seed's words: threefry key data (0, 0 for a greedy row
    seed_lo: int  # without a seed of its own: its key is never used)
    logprobs: int
    sampled: bool  # not greedy


def sampling_row(params: SamplingParams | None, default_seed: int | None = None) -> SamplingRow:
    """`params`' (None = `GREEDY`) row; `default_seed` (see `mix_seed`) is its
    seed when it brought none, required (ValueError) when it samples."""
    p = GREEDY if params is None else params
    seed = p.seed
    if seed is None and not p.greedy:
        if default_seed is None:
            raise ValueError("a row that samples needs a seed or a default seed")
        seed = int(default_seed) % SEED_LIMIT
    hi, lo = (0, 0) if seed is None else (seed >> 32, seed & 0xFFFFFFFF)
    return SamplingRow(p.temperature, p.top_p, p.top_k, hi, lo, p.logprobs or 0, not p.greedy)


def _checked_positions(n: int, positions: npt.ArrayLike, max_seqs: int) -> npt.NDArray[Any]:
    """`positions` as an array, for a batch of `n` rows (ValueError: too many
    rows for `max_seqs`, or positions not 1-D with at least `n` entries)."""
    if n > max_seqs:
        raise ValueError(f"{n} rows do not fit max_seqs={max_seqs}")
    pos = np.asarray(positions)
    if pos.ndim != 1 or pos.shape[0] < n:
        raise ValueError(f"positions must be 1-D with at least {n} entries")
    return pos


@dataclass(frozen=True)
class SamplingBatch:
    """Fixed-shape [max_seqs] arrays for `sample`, one row per sequence in plan order.

    Rows past `num_rows` are padding: greedy, seed 0, position 0. Pass the arrays with
    `sample(logits, *batch.arrays(), num_logprobs=...)`; the batch itself is not a
    pytree on purpose, so its host-only fields can never become static jit arguments.
    """

    temperature: np.ndarray  # [S] f32
    top_p: np.ndarray  # [S] f32
    top_k: np.ndarray  # [S] i32, 0 = off
    seeds: np.ndarray  # [S, 2] u32: threefry key data (high word, low word of the seed)
    positions: np.ndarray  # [S] i32: folded into the key, one draw per position
    num_rows: int = 0  # host-only: real rows
    max_logprobs: int = 0  # host-only: the largest `logprobs` any row asked for
    any_sampled: bool = False  # host-only: some row is not greedy

    @classmethod
    def build(
        cls,
        params_per_row: Sequence[SamplingParams | None],
        positions: np.ndarray,
        max_seqs: int,
        default_seeds: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """The batch for one step. `params_per_row[i]` (None = `GREEDY`) belongs to
        plan row i; `positions[i]` is the position the sampled token will take in its
        sequence (its length so far), which keeps draws reproducible under
        preemption. `default_seeds[i]` (see `mix_seed`) is used where a row brought
        no seed; it is required when such a row samples."""
        n = len(params_per_row)
        if n > max_seqs:  # (from_rows checks it too; before any row is made)
            raise ValueError(f"{n} rows do not fit max_seqs={max_seqs}")
        if default_seeds is not None and len(default_seeds) < n:
            raise ValueError(f"default_seeds must have at least {n} entries")
        rows = []
        for i, p in enumerate(params_per_row):
            try:
                rows.append(sampling_row(p, None if default_seeds is None else default_seeds[i]))
            except ValueError:
                raise ValueError(f"row {i} samples without a seed and no default_seeds") from None
        return cls.from_rows(rows, positions, max_seqs)

    @classmethod
    def from_rows(
        cls, rows: Sequence[SamplingRow], positions: np.ndarray, max_seqs: int
    ) -> SamplingBatch:
        """The batch for one step from each plan row's `sampling_row` (which an
        engine keeps per request between steps: a step's batch is then one
        array conversion, not Python per row); `positions` as in `build`."""
        n = len(rows)
        pos = _checked_positions(n, positions, max_seqs)
        # float64 holds every field exactly (seed words < 2**32; temperature
        # and top_p become float32 as they would from a Python float).
        a = np.array(rows, dtype=np.float64).reshape(n, len(SamplingRow._fields))
        return cls._from_matrix(a, pos, max_seqs)

    @classmethod
    def _from_matrix(
        cls, a: npt.NDArray[np.float64], positions: npt.NDArray[Any], max_seqs: int
    ) -> SamplingBatch:
        """The batch from rows as a float64 matrix [n, len(SamplingRow._fields)]."""
        n = a.shape[0]
        temperature = np.zeros(max_seqs, np.float32)
        top_p = np.ones(max_seqs, np.float32)
        top_k = np.zeros(max_seqs, np.int32)
        seeds = np.zeros((max_seqs, 2), np.uint32)
        out_pos = np.zeros(max_seqs, np.int32)
        out_pos[:n] = positions[:n]
        max_lp, any_sampled = 0, False
        if n:
            temperature[:n], top_p[:n], top_k[:n] = a[:, 0], a[:, 1], a[:, 2]
            seeds[:n, 0], seeds[:n, 1] = a[:, 3], a[:, 4]
            max_lp, any_sampled = int(a[:, 5].max()), bool(a[:, 6].any())
        return cls(temperature, top_p, top_k, seeds, out_pos, n, max_lp, any_sampled)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(temperature, top_p, top_k, seeds, positions): `sample`'s array arguments."""
        return (self.temperature, self.top_p, self.top_k, self.seeds, self.positions)


class SamplingTable:
    """Each live request's `SamplingRow`, made once and kept as a row of one
    float64 matrix (at the request's slot; freed slots are reused), so that
    a step's `SamplingBatch` is a gather of its rows: a dictionary lookup per
    row and array operations, no Python object per row."""

    _WIDTH = len(SamplingRow._fields)

    def __init__(self, capacity: int = 64) -> None:
        self._slot: dict[int, int] = {}
        self._rows = np.zeros((max(capacity, 1), self._WIDTH), np.float64)
        self._free = list(range(len(self._rows) - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._slot

    def put(self, request_id: int, row: SamplingRow) -> int:
        """Keep (or replace) a request's row; returns its slot."""
        slot = self._slot.get(request_id)
        if slot is None:
            if not self._free:
                old = len(self._rows)
                self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)])
                self._free.extend(range(2 * old - 1, old - 1, -1))
            slot = self._slot[request_id] = self._free.pop()
        self._rows[slot] = row
        return slot

    def drop(self, request_id: int) -> None:
        """Forget a request's row (nothing if it has none)."""
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        """Forget every row."""
        self._free.extend(self._slot.values())
        self._slot.clear()

    def batch(
        self,
        request_ids: Sequence[int],
        positions: npt.NDArray[Any],
        max_seqs: int,
        make_row: Callable[[int], SamplingRow],
    ) -> SamplingBatch:
        """The step's batch for plan rows `request_ids` (`positions` as in
        `SamplingBatch.build`); a request without a row yet gets
        `make_row(request_id)`, kept."""
        pos = _checked_positions(len(request_ids), positions, max_seqs)
        get = self._slot.get
        slots = [get(r, -1) for r in request_ids]
        if -1 in slots:
            for i, r in enumerate(request_ids):
                if slots[i] < 0:
                    slots[i] = self.put(r, make_row(r))
        return SamplingBatch._from_matrix(self._rows[slots], pos, max_seqs)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One key per row: fold_in(key(seed), position). Depends on nothing else."""

    def one(kd: jax.Array, pos: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.wrap_key_data(kd, impl=_PRNG_IMPL), pos)

    return jax.vmap(one)(seeds.astype(jnp.uint32), positions.astype(jnp.int32))


def _ordered_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (the IEEE sign-magnitude trick), so a
    threshold can be searched bit by bit instead of sorting."""
    x = x.astype(jnp.float32) + 0.0  # -0.0 becomes +0.0: equal values, equal bits
    i = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(i >> 31 == 1, ~i, i | jnp.uint32(0x80000000))


def _largest_threshold(pred: Callable[[jax.Array], jax.Array], rows: int) -> jax.Array:
    """Per row, the largest uint32 t with pred(t) true, for a pred that is true at
    0 and monotonically turns false: 32 halvings, exact."""

    def halve(_: jax.Array, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo = jnp.zeros(rows, jnp.uint32)
    hi = jnp.full(rows, 0xFFFFFFFF, jnp.uint32)
    bounds: tuple[jax.Array, jax.Array] = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return bounds[0]


def filter_logits(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k, then top-p on the renormalized top-k distribution; dropped entries
    become -inf. The top token always survives. Filtering is by value threshold, so
    entries tied with the last kept one are kept too.

    No sort: each threshold is found by bisection over the values' ordered bit
    patterns (32 masked passes over the vocabulary), several times cheaper than
    sorting 49k logits per row on a CPU and exact: the top-k threshold is the k-th
    largest value, the top-p one the largest value whose at-or-above mass
    reaches top_p."""
    v = scaled.shape[-1]
    bits = _ordered_bits(scaled)
    k_eff = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)

    def at_least_k(t: jax.Array) -> jax.Array:
        return jnp.sum(bits >= t[:, None], axis=-1) >= k_eff

    rows = scaled.shape[0]
    k_thresh = _largest_threshold(at_least_k, rows)
    in_k = bits >= k_thresh[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, scaled, -jnp.inf), axis=-1)

    def mass_reaches_p(t: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(bits >= t[:, None], probs, 0.0), axis=-1) >= top_p

    p_thresh = _largest_threshold(mass_reaches_p, rows)
    # top_p >= 1 keeps the whole top-k set (no rounding of the mass can drop one).
    thresh = jnp.where(top_p >= 1.0, k_thresh, jnp.maximum(k_thresh, p_thresh))
    return jnp.where(bits >= thresh[:, None], scaled, -jnp.inf)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    seeds: jax.Array,
    positions: jax.Array,
    *,
    num_logprobs: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One token per row of `logits` [S, V].

    Returns (tokens [S] i32, logprob [S] f32 of each chosen token under the raw model
    distribution log_softmax(logits), top_ids [S, n] i32, top_logprobs [S, n] f32
    sorted best first) with n = num_logprobs (static; 0 gives [S, 0] arrays).

    Greedy rows (temperature < GREEDY_EPS) take the exact argmax. When every row is
    greedy the sampling branch never runs; the top-k / top-p threshold search runs
    only when some sampled row sets top-k or top-p.
    """
    logits = logits.astype(jnp.float32)
    temperature = temperature.astype(jnp.float32)
    top_p = top_p.astype(jnp.float32)
    top_k = top_k.astype(jnp.int32)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature >= GREEDY_EPS

    def draw(_: None) -> jax.Array:
        scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
        filtering = jnp.any(sampled & ((top_k > 0) | (top_p < 1.0)))
        scaled = jax.lax.cond(
            filtering, lambda s: filter_logits(s, top_k, top_p), lambda s: s, scaled
        )
        keys = row_keys(seeds, positions)
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(sampled, drawn, greedy_tokens)

    tokens = jax.lax.cond(jnp.any(sampled), draw, lambda _: greedy_tokens, None)
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    s = logits.shape[0]
    if num_logprobs > 0:
        top_lp, top_ids = jax.lax.top_k(logp, num_logprobs)
        top_ids = top_ids.astype(jnp.int32)
    else:
        top_lp = jnp.zeros((s, 0), jnp.float32)
        top_ids = jnp.zeros((s, 0), jnp.int32)
    return tokens, chosen, top_ids, top_lp


sample_jit = jax.jit(sample, static_argnames=("num_logprobs",))
"""`sample` compiled on its own (the engine calls `sample` inside its step instead)."""
