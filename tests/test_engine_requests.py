"""Requests through `Engine.submit` with their own sampling parameters: seeded
draws independent of batch mates, greedy rows equal to dense recompute beside
sampled ones, logprobs equal to the model's log-softmax, no recompiles when
parameters differ, bad parameters refused without a trace, the int8 KV gate."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine import kv_eval  # noqa: E402
from kvsched.engine.kv_cache import UnsupportedKVDtype  # noqa: E402
from kvsched.engine.model import LlamaConfig, forward_dense, greedy_dense, init_params  # noqa: E402
from kvsched.engine.runner import Engine, size_pool  # noqa: E402
from kvsched.engine.sampling import SamplingParams  # noqa: E402

MODEL = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    ffn_dim=128)  # fmt: skip
PARAMS = init_params(MODEL, seed=1)
CFG = dict(num_blocks=96, block_size=4, max_num_seqs=4, max_batched_tokens=32, max_seq_len=96,
           long_prefill_chunk=8, overhead_reserve=0.0, max_waiting=8)  # fmt: skip


def engine(**kw) -> Engine:
    cfg = {**CFG, **kw.pop("cfg", {})}
    eng = Engine.create(MODEL, PARAMS, kvsched.SchedulerConfig(**cfg), **kw)
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    return eng


def run(eng: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    """Submit all at once; per request, the outputs in order."""
    rids = [eng.submit("t", p, sp) for p, sp in requests]
    outs: dict[int, list] = {r: [] for r in rids}
    while eng.scheduler.live_requests:
        for o in eng.step().outputs:
            outs[o.request_id].append(o)
    return [outs[r] for r in rids]


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


PROMPT = [5, 17, 99, 3, 42, 7]


@pytest.mark.slow
def test_a_seeded_request_draws_the_same_tokens_whatever_its_batch_mates():
    eng = engine()
    mine = (PROMPT, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234))
    alone = tokens(run(eng, [mine])[0])
    others = [([9, 8, 7], SamplingParams(max_tokens=20, temperature=0.7, top_k=5, seed=1)),
              (list(range(1, 30)), SamplingParams(max_tokens=5)),
              ([4, 4, 4, 4], SamplingParams(max_tokens=9, temperature=1.3))]  # fmt: skip
    crowded = run(eng, [others[0], mine, *others[1:]])
    assert tokens(crowded[1]) == alone, "same seed, same tokens, whoever shares the batch"
    other_seed = (PROMPT, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99))
    assert tokens(run(eng, [other_seed])[0]) != alone, "the seed is the stream"
    assert alone != greedy_dense(PARAMS, MODEL, PROMPT, 12), "it did sample"


@pytest.mark.slow
def test_greedy_rows_equal_dense_recompute_beside_sampled_rows():
    eng = engine()
    prompts = [PROMPT, list(range(40, 61)), [1, 2, 3]]
    reqs = [
        (prompts[0], SamplingParams(max_tokens=10)),
        (prompts[1], SamplingParams(max_tokens=10, temperature=2.0, seed=5)),
        (prompts[2], SamplingParams(max_tokens=10, top_k=3)),
    ]  # top_k at T=0: greedy
    outs = run(eng, reqs)
    assert tokens(outs[0]) == greedy_dense(PARAMS, MODEL, prompts[0], 10)
    assert tokens(outs[2]) == greedy_dense(PARAMS, MODEL, prompts[2], 10)
    assert all(o[-1].finished and o[-1].finish_reason == "length" for o in outs)
    assert outs[0][-1].completion_tokens == 10 and outs[0][-1].prompt_tokens == len(PROMPT)


@pytest.mark.slow
def test_mixed_sampling_parameters_never_recompile():
    eng = engine(max_logprobs=3)
    programs = eng.compiled_programs()
    assert programs == len(eng.scheduler.token_buckets)
    rng = np.random.default_rng(0)
    for _ in range(4):
        reqs = [(rng.integers(1, 256, int(rng.integers(2, 30))).tolist(),
                 SamplingParams(max_tokens=int(rng.integers(1, 8)),
                                temperature=float(rng.choice([0.0, 0.5, 1.5])),
                                top_p=float(rng.choice([1.0, 0.8])), top_k=int(rng.choice([0, 4])),
                                seed=int(rng.integers(1000)),
                                logprobs=[None, 0, 3][int(rng.integers(3))]))
                for _ in range(int(rng.integers(1, 5)))]  # fmt: skip
        run(eng, reqs)
    assert eng.compiled_programs() == programs


@pytest.mark.slow
def test_logprobs_are_the_models_log_softmax_at_each_position():
    eng = engine(max_logprobs=4)
    outs = run(eng, [(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=3,
                                             logprobs=4))])[0]  # fmt: skip
    generated = tokens(outs)
    seq = jnp.asarray(PROMPT + generated, jnp.int32)
    logp = np.asarray(jax.nn.log_softmax(forward_dense(PARAMS, MODEL, seq), axis=-1))
    for i, o in enumerate(outs):
        (lp,) = o.logprobs
        row = logp[len(PROMPT) - 1 + i]
        assert lp.token_id == generated[i]
        assert lp.logprob == pytest.approx(row[generated[i]], abs=2e-4)
        assert [t for t, _ in lp.top] == np.argsort(-row)[:4].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(row)[::-1][:4], atol=2e-4)


@pytest.mark.slow
def test_bad_parameters_are_refused_and_change_nothing():
    eng = engine(max_logprobs=2)
    before = eng.scheduler.stats()["tenants"]["t"]
    bad = [
        SamplingParams(max_tokens=4, logprobs=3),  # more than the engine computes
        SamplingParams(max_tokens=4, stop_token_ids=(999,)),
    ]  # outside the vocabulary
    for sp in bad:
        with pytest.raises(kvsched.InvalidRequest):
            eng.submit("t", PROMPT, sp)
    with pytest.raises(kvsched.InvalidRequest, match="temperature"):
        eng.submit("t", PROMPT, SamplingParams(temperature=-1.0))
    with pytest.raises(kvsched.InvalidRequest, match="tokenizer"):
        eng.submit("t", PROMPT, SamplingParams(stop=("x",)))  # no tokenizer on this engine
    assert eng.scheduler.live_requests == 0
    assert eng.scheduler.stats()["tenants"]["t"] == before


@pytest.mark.slow
def test_cancel_ends_a_request_with_a_final_output():
    eng = engine()
    rid = eng.submit("t", PROMPT, SamplingParams(max_tokens=50))
    eng.step()
    final = eng.cancel(rid)
    assert final.finished and final.finish_reason == "cancelled"
    assert eng.scheduler.live_requests == 0
    # A step still in flight (overlapped) ends without another output for it.
    for _ in range(2):
        res = eng.step()
        if res is None:
            break
        assert res.outputs == []
    assert eng.step() is None


@pytest.mark.slow
def test_stop_token_ids_end_a_request_with_reason_stop():
    eng = engine()
    want = greedy_dense(PARAMS, MODEL, PROMPT, 10)
    stop = want[4]
    outs = run(eng, [(PROMPT, SamplingParams(max_tokens=10, stop_token_ids=(stop,)))])[0]
    assert tokens(outs) == want[: want.index(stop) + 1]
    assert outs[-1].finish_reason == "stop"
    eos_eng = engine(eos_token_ids=(stop,))
    assert tokens(run(eos_eng, [(PROMPT, SamplingParams(max_tokens=10))])[0])[-1] == stop
    ignored = run(eos_eng, [(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))])[0]
    assert tokens(ignored) == want, "ignore_eos runs to max_tokens"


# -- int8 KV -----------------------------------------------------------------------------


def test_int8_kv_holds_about_twice_the_tokens_of_bf16_in_the_same_memory():
    class Gpu:
        def memory_stats(self):
            return {"bytes_limit": 50_000_000, "bytes_in_use": 0}

    cfg = kvsched.SchedulerConfig(num_blocks=8, block_size=16, overhead_reserve=0.1)
    gemma_like = LlamaConfig(n_layers=30, n_kv_heads=3, head_dim=64)
    bf16 = size_pool(gemma_like, cfg, "bfloat16", Gpu()).num_blocks
    int8 = size_pool(gemma_like, cfg, "int8", Gpu()).num_blocks
    assert int8 / bf16 == pytest.approx(128 / 68, rel=0.01)  # 64 B + 4 B scale vs 128 B


@pytest.mark.slow
def test_int8_kv_is_refused_without_a_passing_evaluation(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCHED_CACHE", str(tmp_path))
    cfg = kvsched.SchedulerConfig(**CFG)
    with pytest.raises(kv_eval.KVGateError, match="eval-kv"):
        Engine.create(MODEL, PARAMS, cfg, kv_dtype="int8")
    prompts = [PROMPT, list(range(40, 61)), [1, 2, 3, 9]]
    report = kv_eval.evaluate_kv(MODEL, PARAMS, prompts, tokens=8, block_size=4)
    assert report.prompts == 3 and 0.0 <= report.greedy_agreement <= 1.0
    assert report.mean_abs_logprob_diff >= 0.0
    # Saved where the engine looks, keyed by the weights: the engine starts.
    kv_eval.save_report(report)
    if report.passed:
        eng = Engine.create(MODEL, PARAMS, cfg, kv_dtype="int8")
        assert eng.kv_eval.checksum == eng.checksum
    # A stricter configured gate than the figures refuses, naming them.
    with pytest.raises(kv_eval.KVGateError, match="fails the gate"):
        Engine.create(MODEL, PARAMS, cfg, kv_dtype="int8", kv_eval=report,
                      kv_max_logprob_diff=report.mean_abs_logprob_diff / 2 - 1e-9,
                      kv_min_agreement=1.1)  # fmt: skip
    # A report for other weights does not count.
    other = init_params(MODEL, seed=9)
    with pytest.raises(kv_eval.KVGateError, match="not"):
        Engine.create(MODEL, other, cfg, kv_dtype="int8", kv_eval=report)
    with pytest.raises(UnsupportedKVDtype, match="reference"):
        Engine.create(MODEL, PARAMS, cfg, kv_dtype="int8", kv_eval=report, backend="pallas")


@pytest.mark.slow
def test_int8_kv_generates_like_float_kv_on_the_tiny_model():
    """With a passing gate the int8 engine serves; its greedy tokens are those
    of the float32 engine for most positions (they may part near a tie)."""
    prompts = [PROMPT, list(range(40, 61))]
    report = kv_eval.evaluate_kv(MODEL, PARAMS, prompts, tokens=10, block_size=4)
    eng = engine(kv_dtype="int8", kv_eval=report, kv_min_agreement=0.0,
                 kv_max_logprob_diff=10.0)  # fmt: skip
    assert eng.caches.values.dtype == jnp.int8
    got = [tokens(o) for o in run(eng, [(p, SamplingParams(max_tokens=10)) for p in prompts])]
    want = [greedy_dense(PARAMS, MODEL, p, 10) for p in prompts]
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert same >= 0.6 * 20


@pytest.mark.slow
def test_prompt_ids_outside_the_vocabulary_or_not_integers_are_refused():
    eng = engine()
    for bad in ([5, 17, 256], [5, -1], [5.7, 17.2], [[1, 2], [3, 4]]):
        with pytest.raises(kvsched.InvalidRequest, match="prompt_ids"):
            eng.submit("t", np.asarray(bad), SamplingParams(max_tokens=2))
    assert eng.scheduler.live_requests == 0


@pytest.mark.slow
def test_requests_a_drain_hands_back_get_a_final_output():
    eng = engine()
    rids = [eng.submit("t", PROMPT, SamplingParams(max_tokens=40)) for _ in range(2)]
    eng.step(now=1.0)
    eng.scheduler.drain(1.5)
    ended = {}
    for now in (2.0, 2.5, 3.0):
        res = eng.step(now=now)
        for o in res.outputs if res else []:
            if o.finished:
                ended[o.request_id] = o.finish_reason
    assert ended == {r: "drain_deadline" for r in rids}, "no stream waits forever"
    assert eng.step(now=4.0) is None
    assert eng.cancel(rids[0]) is None, "cancelling what already ended is not an error"
    with pytest.raises(kvsched.UnknownRequest):
        eng.cancel(10**9)  # an id never issued is


def test_the_int8_gate_refuses_a_report_with_nan_figures():
    report = kv_eval.KVEvalReport("int8", "abc", "m", 1, 1, float("nan"), float("nan"), 0.0, 0)
    with pytest.raises(kv_eval.KVGateError, match="fails the gate"):
        kv_eval.check_gate(report, kv_dtype="int8", checksum="abc")
