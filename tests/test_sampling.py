"""Per-request sampling: validation, the batch builder, and the jitted sampler against
numpy references (greedy, top-k / top-p filtering, empirical distributions, seeds)."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvsched
from kvsched.engine.sampling import (
    GREEDY,
    MAX_LOGPROBS,
    SamplingBatch,
    SamplingParams,
    SamplingRow,
    SamplingTable,
    filter_logits,
    mix_seed,
    sample,
    sample_jit,
    sampling_row,
)

V = 64


def _logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def _batch(params, positions=None, max_seqs=None, default_seeds=None) -> SamplingBatch:
    n = len(params)
    pos = np.arange(n) if positions is None else np.asarray(positions)
    if default_seeds is None:
        default_seeds = [mix_seed(0, i) for i in range(n)]
    return SamplingBatch.build(params, pos, max_seqs or n, default_seeds)


def _run(logits, batch, n=0):
    out = sample_jit(jnp.asarray(logits), *batch.arrays(), num_logprobs=n)
    return tuple(np.asarray(x) for x in out)


def _ref_filter(row: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """An independent numpy (float64) top-k then top-p: the renormalized distribution."""
    z = row.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), bool)
    k = len(z) if top_k == 0 else min(top_k, len(z))
    cand = order[:k]
    p = np.exp(z[cand] - z[cand].max())
    p /= p.sum()
    mass = 0.0
    for idx, pi in zip(cand, p, strict=True):
        if mass >= top_p and top_p < 1.0:
            break
        keep[idx] = True
        mass += pi
    out = np.zeros(len(z))
    out[keep] = np.exp(z[keep] - z[keep].max())
    return out / out.sum()


# -- SamplingParams --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": "abc"}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": ["ok", "a\ud800"]}, "stop"),  # a lone surrogate: no UTF-8 for it
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(kvsched.InvalidRequest, match=field) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, kvsched.Rejected)


def test_stop_token_ids_checked_against_the_vocabulary():
    p = SamplingParams(stop_token_ids=[0, 99])
    assert p.validate(100) is p
    with pytest.raises(kvsched.InvalidRequest, match="stop_token_ids"):
        p.validate(99)


def test_params_normalize_lists_and_stay_hashable():
    p = SamplingParams(
        stop_token_ids=[np.int64(2), 3], stop="END", seed=np.int32(7), temperature=1, top_k=5
    )
    assert p.stop_token_ids == (2, 3) and p.stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert type(p.seed) is int and p.seed == 7 and isinstance(p.temperature, float)
    assert hash(p) == hash(SamplingParams(stop_token_ids=(2, 3), stop=("END",), seed=7,
                                          temperature=1.0, top_k=5))  # fmt: skip
    assert SamplingParams(seed=2**63 - 1, logprobs=MAX_LOGPROBS, top_p=1.0).seed == 2**63 - 1
    assert GREEDY.greedy and not SamplingParams(temperature=0.5).greedy


# -- SamplingBatch ---------------------------------------------------------------------


def test_batch_builder_shapes_padding_and_seed_words():
    seed = (5 << 32) | 9
    params = [SamplingParams(temperature=0.5, top_p=0.9, top_k=7, seed=seed, logprobs=3), None]
    b = SamplingBatch.build(params, np.array([11, 4]), 4, default_seeds=[1, 2])
    assert b.temperature.dtype == np.float32 and b.temperature.shape == (4,)
    assert b.top_p.dtype == np.float32 and b.top_k.dtype == np.int32
    assert b.seeds.dtype == np.uint32 and b.seeds.shape == (4, 2)
    assert b.positions.dtype == np.int32
    np.testing.assert_allclose(b.temperature, [0.5, 0, 0, 0])
    np.testing.assert_allclose(b.top_p, [0.9, 1, 1, 1], rtol=1e-6)
    np.testing.assert_array_equal(b.top_k, [7, 0, 0, 0])
    # The greedy row (None) draws nothing: its default seed is not even mixed.
    np.testing.assert_array_equal(b.seeds, [[5, 9], [0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(b.positions, [11, 4, 0, 0])
    assert (b.num_rows, b.max_logprobs, b.any_sampled) == (2, 3, True)
    # The seed words are exactly jax's own key for that seed.
    with jax.enable_x64(True):
        ref = jax.random.key_data(jax.random.PRNGKey(seed))
    np.testing.assert_array_equal(b.seeds[0], np.asarray(ref))


def test_batch_builder_errors():
    with pytest.raises(ValueError, match="max_seqs"):
        SamplingBatch.build([None] * 3, np.arange(3), 2)
    with pytest.raises(ValueError, match="positions"):
        SamplingBatch.build([None] * 3, np.arange(2), 4)
    with pytest.raises(ValueError, match="seed"):
        SamplingBatch.build([SamplingParams(temperature=1.0)], np.arange(1), 4)
    # Greedy rows need no seed at all.
    b = SamplingBatch.build([None, GREEDY], np.arange(2), 4)
    assert not b.any_sampled and not b.seeds.any()


def test_the_sampling_table_gathers_what_build_makes_row_by_row():
    """An engine keeps each live request's row in a SamplingTable (slots
    reused as requests end, the matrix grown past its capacity): every step's
    batch equals SamplingBatch.build on the same requests' parameters, made
    afresh row by row."""
    rng = np.random.default_rng(7)
    params: dict[int, SamplingParams] = {}
    table, made = SamplingTable(capacity=2), []
    live: list[int] = []
    next_id, held = 100, 0
    for _step in range(60):
        for _ in range(int(rng.integers(0, 4))):  # arrivals
            seed = None if rng.random() < 0.5 else int(rng.integers(0, 2**62))
            top_n = None if rng.random() < 0.7 else int(rng.integers(0, 5))
            p = SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.3])),
                               top_p=float(rng.choice([1.0, 0.9])), top_k=int(rng.integers(0, 9)),
                               seed=seed, logprobs=top_n)  # fmt: skip
            params[next_id] = p
            live.append(next_id)
            next_id += 1
        rng.shuffle(live)
        rows = live[:8]
        pos = rng.integers(0, 500, len(rows))

        def make_row(r: int) -> SamplingRow:
            made.append(r)
            return sampling_row(params[r], mix_seed(3, r))

        got = table.batch(rows, pos, 8, make_row)
        held = max(held, len(table))
        want = SamplingBatch.build([params[r] for r in rows], pos, 8,
                                   default_seeds=[mix_seed(3, r) for r in rows])  # fmt: skip
        for a, b in zip(got.arrays(), want.arrays(), strict=True):
            np.testing.assert_array_equal(a, b)
        assert (got.num_rows, got.max_logprobs, got.any_sampled) == (
            want.num_rows, want.max_logprobs, want.any_sampled)  # fmt: skip
        for r in list(live):  # departures
            if rng.random() < 0.25:
                live.remove(r)
                table.drop(r)
    assert len(made) == len(set(made)), "each request's row is made once"
    assert held > 2, "the table grew past its capacity"
    assert len(table) <= len(live), "ended requests' rows are gone"
    table.clear()
    assert len(table) == 0 and live[0] not in table


def test_mix_seed_in_range_and_spread():
    seeds = {mix_seed(e, r) for e in range(4) for r in range(500)}
    assert len(seeds) == 2000
    assert all(0 <= s < 2**63 for s in seeds)
    assert mix_seed(3, 17) == mix_seed(3, 17)


# -- the sampler -----------------------------------------------------------------------


def test_greedy_is_exact_argmax():
    logits = _logits(8, 1000)
    params = [None, GREEDY, SamplingParams(top_k=3, top_p=0.2), SamplingParams(temperature=1e-7)]
    tokens, *_ = _run(logits, _batch(params, max_seqs=8))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_one_and_tiny_top_p_are_greedy(temperature):
    logits = _logits(16, 500, seed=1)
    for p in (SamplingParams(temperature=temperature, top_k=1),
              SamplingParams(temperature=temperature, top_p=1e-6)):  # fmt: skip
        params = [p.__class__(**{**p.__dict__, "seed": i}) for i in range(16)]
        tokens, *_ = _run(logits, _batch(params, positions=np.arange(16) * 7))
        np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_filter_matches_numpy_reference():
    rng = np.random.default_rng(3)
    rows, vocab = 64, 200
    logits = _logits(rows, vocab, seed=4)
    temperature = rng.uniform(0.3, 2.0, rows).astype(np.float32)
    top_k = rng.choice([0, 1, 2, 5, 17, 199, 200, 1000], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.1, 0.01], rows).astype(np.float32)
    scaled = jnp.asarray(logits) / jnp.asarray(temperature)[:, None]
    got = np.asarray(filter_logits(scaled, jnp.asarray(top_k), jnp.asarray(top_p)))
    checked = 0
    for i in range(rows):
        ref = _ref_filter(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]))
        # Skip rows whose nucleus boundary sits within float32 noise of top_p.
        z = np.sort(logits[i].astype(np.float64) / temperature[i])[::-1]
        z = z[: top_k[i] or vocab]
        cum = np.cumsum(np.exp(z - z.max()) / np.exp(z - z.max()).sum())
        if top_p[i] < 1 and np.min(np.abs(cum - top_p[i])) < 1e-4:
            continue
        np.testing.assert_array_equal(np.isfinite(got[i]), ref > 0, err_msg=f"row {i}")
        checked += 1
    assert checked > rows * 0.8


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.7), (2.0, 3, 0.95)],
)
def test_empirical_distribution_matches_reference(temperature, top_k, top_p):
    n, vocab = 20000, 10
    row = np.array([2.0, 1.5, 1.2, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -3.0], np.float32)
    ref = _ref_filter(row, temperature, top_k, top_p)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    b = SamplingBatch.build([p] * n, np.zeros(n, np.int32), n, [mix_seed(9, i) for i in range(n)])
    tokens, *_ = _run(np.broadcast_to(row, (n, vocab)), b)
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[ref == 0].sum() == 0, "sampled a filtered-out token"
    support = ref > 0
    expected = ref[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = max(int(support.sum()) - 1, 1)
    # ~5 sigma above the mean of a chi-square with `dof` degrees of freedom.
    assert chi2 < dof + 5 * math.sqrt(2 * dof) + 5, (chi2, counts, expected)


def test_seed_reproducible_and_independent_of_batch_placement():
    target = _logits(1, 300, seed=7)[0]
    req = SamplingParams(temperature=1.5, top_p=0.9, top_k=50, seed=1234)
    positions = np.arange(20, 32)

    def run_in(row, max_seqs, companions_seed):
        out = []
        others = _logits(max_seqs, 300, seed=companions_seed)
        for pos in positions:
            logits = others.copy()
            logits[row] = target
            params = [SamplingParams(temperature=0.5 + j, seed=j) for j in range(max_seqs)]
            params[row] = req
            pos_row = np.full(max_seqs, 5)
            pos_row[row] = pos
            tokens, *_ = _run(logits, _batch(params, positions=pos_row))
            out.append(int(tokens[row]))
        return out

    a = run_in(0, 4, companions_seed=1)
    assert a == run_in(0, 4, companions_seed=1)  # reproducible
    assert a == run_in(3, 4, companions_seed=2)  # another row, other companions
    assert a == run_in(5, 8, companions_seed=3)  # another batch size too
    assert len(set(a)) > 3  # positions draw different tokens
    other_seed = SamplingParams(temperature=1.5, top_p=0.9, top_k=50, seed=99)
    b = _batch([other_seed] * len(positions), positions=positions)
    tokens, *_ = _run(np.broadcast_to(target, (len(positions), 300)), b)
    assert list(tokens) != a


def test_logprobs_are_raw_log_softmax_and_sorted():
    logits = _logits(6, 400, seed=11)
    params = [SamplingParams(temperature=t, seed=3) for t in (0.0, 0.5, 1.0, 2.0, 0.0, 1.0)]
    tokens, chosen, top_ids, top_lp = _run(logits, _batch(params), n=5)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(chosen, ref[np.arange(6), tokens], rtol=1e-6, atol=1e-6)
    assert top_ids.shape == (6, 5) and top_ids.dtype == np.int32
    assert top_lp.shape == (6, 5) and top_lp.dtype == np.float32
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=-1, kind="stable")[:, :5])
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, top_ids, -1), atol=1e-6)
    assert (np.diff(top_lp, axis=-1) <= 0).all()
    _, _, ids0, lp0 = _run(logits, _batch(params), n=0)
    assert ids0.shape == (6, 0) and lp0.shape == (6, 0)


def test_masked_vocabulary_entries_are_never_drawn():
    logits = _logits(256, 32, seed=5)
    logits[:, 16:] = -np.inf  # e.g. vocabulary padding
    params = [SamplingParams(temperature=3.0, seed=i, top_p=0.99 if i % 2 else 1.0)
              for i in range(256)]  # fmt: skip
    tokens, chosen, *_ = _run(logits, _batch(params))
    assert (tokens < 16).all() and np.isfinite(chosen).all()


def test_no_recompile_across_parameter_values():
    # A fresh function: jit's cache is shared by every jit of the same function object.
    def fresh(*arrays, num_logprobs):
        return sample(*arrays, num_logprobs=num_logprobs)

    jitted = jax.jit(fresh, static_argnames=("num_logprobs",))
    logits = jnp.asarray(_logits(8, V))
    variants = [
        [None] * 3,
        [SamplingParams(temperature=1.0, seed=1)] * 8,
        [SamplingParams(temperature=0.7, top_k=5, top_p=0.5, seed=2), None, GREEDY],
        [SamplingParams(temperature=2.0, top_k=1)] * 5,
    ]
    for params in variants:
        b = _batch(params, max_seqs=8, positions=np.arange(len(params)) + 100)
        jax.block_until_ready(jitted(logits, *b.arrays(), num_logprobs=2))
    assert jitted._cache_size() == 1


def test_all_greedy_skips_the_filtering():
    """The top-k / top-p threshold search (a loop over the vocabulary) lives only
    inside the cond's branches, never at top level; nothing sorts the vocabulary."""
    b = _batch([SamplingParams(temperature=1.0, top_k=3, seed=1)])
    jaxpr = jax.make_jaxpr(partial(sample, num_logprobs=0))(jnp.asarray(_logits(1)), *b.arrays())
    top = {e.primitive.name for e in jaxpr.jaxpr.eqns}
    assert "cond" in top and "scan" not in top
    assert "scan" in str(jaxpr)
    assert "sort[" not in str(jaxpr) and " sort " not in str(jaxpr)


def test_signed_zeros_are_one_value_for_the_thresholds():
    logits = jnp.asarray([[-0.0, 0.0, -1.0]], jnp.float32)
    kept = filter_logits(logits, jnp.asarray([1], jnp.int32), jnp.asarray([1.0], jnp.float32))
    assert np.isfinite(np.asarray(kept)[0, :2]).all(), "a tie at the top is kept whole"
