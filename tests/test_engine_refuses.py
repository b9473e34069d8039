"""The engine refuses what it cannot serve: token ids outside
the vocabulary (at submit, in a plan, and in what the sampler returns), weights
that are not finite or not floating point, and paths that are not model files.
Each refusal names what it refuses, and a refused request changes nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("jax")
gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
import jax.numpy as jnp  # noqa: E402
from test_gguf_loader import MODEL as GGUF_MODEL  # noqa: E402
from test_gguf_loader import tied_params, write_gguf  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine.loaders.gguf_llama import load_gguf  # noqa: E402
from kvsched.engine.loaders.safetensors_llama import (  # noqa: E402
    load_llama_safetensors,
    read_safetensors,
    save_llama_safetensors,
)
from kvsched.engine.model import (  # noqa: E402
    LAYER_WEIGHTS,
    InvalidWeights,
    LlamaConfig,
    greedy_dense,
    init_params,
    make_params,
)
from kvsched.engine.runner import Engine  # noqa: E402
from kvsched.engine.sampling import SamplingParams  # noqa: E402

MODEL = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    ffn_dim=128)  # fmt: skip
PARAMS = init_params(MODEL, seed=1)
CFG = dict(num_blocks=96, block_size=4, max_num_seqs=4, max_batched_tokens=32, max_seq_len=96,
           long_prefill_chunk=8, overhead_reserve=0.0, max_waiting=8)  # fmt: skip
PROMPT = [5, 17, 99, 3, 42, 7]


def engine(params=PARAMS, **kw) -> Engine:
    eng = Engine.create(MODEL, params, kvsched.SchedulerConfig(**CFG), **kw)
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    return eng


def drive(eng: Engine) -> tuple[dict[int, list], dict[int, str]]:
    """Step until nothing is live: every output by request, and every error."""
    outs: dict[int, list] = {}
    errors: dict[int, str] = {}
    while eng.scheduler.live_requests:
        res = eng.step()
        for o in res.outputs:
            outs.setdefault(o.request_id, []).append(o)
        errors.update(res.errors)
    return outs, errors


# -- ids outside the vocabulary -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("bad", [256, 10**6, 2**31 - 1, -1])
def test_a_prompt_id_outside_the_vocabulary_is_refused_naming_it_and_changes_nothing(bad):
    eng = engine()
    before = eng.scheduler.stats(now=1.0)
    with pytest.raises(kvsched.InvalidRequest,
                       match=f"prompt_ids: id {bad} is outside the vocabulary of 256"):  # fmt: skip
        eng.submit("t", [5, 17, bad, 3], SamplingParams(max_tokens=2))
    assert eng.scheduler.live_requests == 0
    assert eng.scheduler.stats(now=1.0) == before


@pytest.mark.slow
def test_the_engines_scheduler_knows_the_vocabulary_and_refuses_a_direct_submit():
    """Engine.create gives its scheduler the model's vocab_size: a request
    submitted to the scheduler directly, bypassing Engine.submit, is refused by
    the core (`invalid`), and nothing changes."""
    eng = engine()
    assert eng.scheduler.config.vocab_size == MODEL.vocab_size
    before = eng.scheduler.stats(now=1.0)
    with pytest.raises(
        kvsched.InvalidRequest, match="prompt token 2 is 256, outside the vocabulary"
    ):
        eng.scheduler.submit("t", np.asarray([5, 17, 256, 3], np.int32), 4, now=1.0)
    assert eng.scheduler.live_requests == 0
    assert eng.scheduler.stats(now=1.0)["pool"] == before["pool"]
    with pytest.raises(kvsched.InvalidConfig, match="vocab_size is 300, the model's 256"):
        Engine(MODEL, PARAMS, kvsched.Scheduler(kvsched.SchedulerConfig(**CFG, vocab_size=300)))


@pytest.mark.slow
def test_a_plan_carrying_an_id_outside_the_vocabulary_ends_that_request_only():
    """With a scheduler that does not know the vocabulary (built by hand, no
    vocab_size), a request submitted to it directly bypasses every check; its
    out-of-vocabulary id would be clamped by the embedding gather and served as
    id 255. The step ends it with an error and the batch mate runs on."""
    sched = kvsched.Scheduler(kvsched.SchedulerConfig(**CFG, require_warmup=True))
    eng = Engine(MODEL, PARAMS, sched)
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    direct = eng.scheduler.submit("t", np.asarray([5, 17, 256, 3], np.int32), 4)
    good = eng.submit("t", PROMPT, SamplingParams(max_tokens=4))
    outs, errors = drive(eng)
    assert set(errors) == {direct}
    assert "token id 256 is outside the vocabulary of 256" in errors[direct]
    assert [t for o in outs[good] for t in o.token_ids] == greedy_dense(PARAMS, MODEL, PROMPT, 4)
    assert outs[good][-1].finish_reason == "length"


@pytest.mark.slow
def test_a_sampled_id_outside_the_vocabulary_is_never_committed():
    eng = engine(overlap=False)
    rid = eng.submit("t", PROMPT, SamplingParams(max_tokens=4))
    real = eng._sample

    planned = []

    def broken(plan, batch=None):  # a sampler bug: one id past the vocabulary
        out = real(plan, batch)
        tokens = out.tokens.copy()
        tokens[0] = 10**6
        planned.append(eng.scheduler.stats(now=1.0))  # planned, not committed yet
        return out._replace(tokens=tokens)

    eng._sample = broken
    with pytest.raises(kvsched.InternalError, match="sampled id 1000000 .* outside the vocab"):
        eng.step(now=1.0)
    assert eng.scheduler.stats(now=1.0) == planned[0], "nothing committed"
    assert rid in eng.outputs


@pytest.mark.slow
def test_an_overlapped_step_never_resolves_a_sampled_id_outside_the_vocabulary():
    """The device's sampled array feeds the next step as it is, but the host
    checks it before the core takes it: nothing resolved, the request's tokens
    untouched."""
    eng = engine()
    rid = eng.submit("t", PROMPT, SamplingParams(max_tokens=4))
    real = eng._dispatch

    def broken(inputs, batch, prev):  # a sampler bug: one id past the vocabulary
        out = real(inputs, batch, prev)
        return out._replace(tokens=out.tokens.at[0].set(10**6))

    eng._dispatch = broken
    eng.step(now=1.0)  # dispatched and advanced
    advanced = eng.scheduler.unresolved_step
    before = eng.scheduler.stats(now=1.0)
    with pytest.raises(kvsched.InternalError, match="sampled id 1000000 .* outside the vocab"):
        eng.step(now=1.0)
    assert eng.scheduler.unresolved_step == advanced is not None, "nothing resolved"
    assert (
        eng.scheduler.stats(now=1.0)["tenants"]["t"]["tokens_out"]
        == before["tenants"]["t"]["tokens_out"]
    )
    assert rid in eng.outputs and eng.outputs.generated(rid) == 0


# -- weights and logits that are not finite -------------------------------------------------


@pytest.mark.slow
def test_non_finite_logits_end_that_request_with_an_error_and_others_run_on():
    """Token 200's embedding is NaN: a request that reads it has NaN logits (the
    attention guards would turn them into plausible tokens). It ends with
    finish_reason "error"; its batch mate, and a request that reuses its freed
    pages afterwards, produce exactly the clean model's tokens."""
    params = {**PARAMS, "embed": PARAMS["embed"].at[200].set(jnp.nan)}
    eng = engine(params)
    want = greedy_dense(PARAMS, MODEL, PROMPT, 6)
    assert 200 not in want  # the batch mate never reads the poisoned row
    poisoned = eng.submit("t", [5, 17, 200, 3, 9], SamplingParams(max_tokens=6))
    good = eng.submit("t", PROMPT, SamplingParams(max_tokens=6))
    outs, errors = drive(eng)
    final = outs[poisoned][-1]
    assert final.finished and final.finish_reason == "error"
    assert "not finite" in final.error and "not finite" in errors[poisoned]
    assert final.token_ids == [] and final.completion_tokens == 0
    assert [t for o in outs[good] for t in o.token_ids] == want
    later = eng.submit("t", PROMPT[::-1], SamplingParams(max_tokens=6))
    outs, errors = drive(eng)
    assert not errors
    assert [t for o in outs[later] for t in o.token_ids] == greedy_dense(
        PARAMS, MODEL, PROMPT[::-1], 6
    )


@pytest.mark.slow
def test_warmup_refuses_weights_whose_logits_are_not_finite():
    """All-NaN q_proj: attention's guards make every token plausible-looking."""
    wq = PARAMS["layers"]["wq"].at[0].set(jnp.nan)
    params = {**PARAMS, "layers": {**PARAMS["layers"], "wq": wq}}
    eng = Engine.create(MODEL, params, kvsched.SchedulerConfig(**CFG))
    with pytest.raises(InvalidWeights, match="not finite"):
        eng.warmup(progress=False)
    assert eng.scheduler.lifecycle != "ready"


def layers_of(params) -> list[dict]:
    return [{k: np.asarray(params["layers"][k][i]) for k in LAYER_WEIGHTS}
            for i in range(MODEL.n_layers)]  # fmt: skip


@pytest.mark.parametrize(
    "value, dtype, match",
    [
        (np.nan, np.float32, r"layers\[1\]\.wq: .* not finite"),
        (np.inf, np.float32, r"layers\[1\]\.wq: .* not finite"),
        (1e300, np.float64, r"layers\[1\]\.wq: .* not finite"),  # inf once cast
        (1, np.int64, r"layers\[1\]\.wq is int64"),
        (True, np.bool_, r"layers\[1\]\.wq is bool"),
    ],
)
def test_make_params_refuses_weights_that_are_not_finite_or_not_float(value, dtype, match):
    layers = layers_of(PARAMS)
    wq = layers[1]["wq"].astype(dtype)
    wq[3, 4] = value
    layers[1]["wq"] = wq
    p = PARAMS
    with pytest.raises(InvalidWeights, match=match):
        make_params(MODEL, embed=p["embed"], layers=layers, final_norm=p["final_norm"],
                    lm_head=p["lm_head"])  # fmt: skip


def test_the_gguf_loader_refuses_a_non_finite_tensor_naming_it(tmp_path):
    params = tied_params()
    params["layers"] = {**params["layers"], "wq": params["layers"]["wq"].at[1].set(jnp.nan)}
    write_gguf(tmp_path / "m.gguf", GGUF_MODEL, params)
    with pytest.raises(InvalidWeights, match=r"blk\.1\.attn_q\.weight: 4096 of 4096 .* not finite"):
        load_gguf(tmp_path / "m.gguf")


def test_the_safetensors_loader_refuses_a_non_finite_tensor_naming_it(tmp_path):
    params = {**PARAMS, "lm_head": PARAMS["lm_head"].at[0, 7].set(jnp.inf)}
    save_llama_safetensors(params, tmp_path / "model.safetensors")
    with pytest.raises(InvalidWeights, match=r"lm_head\.weight: 1 of .* not finite"):
        load_llama_safetensors(tmp_path / "model.safetensors", MODEL)


# -- dtypes the model does not expect, paths that are not model files ----------------------


def test_the_gguf_loader_refuses_integer_tensors_naming_them(tmp_path):
    path = tmp_path / "m.gguf"
    params = tied_params()
    norm = np.ones((GGUF_MODEL.n_layers, GGUF_MODEL.dim), np.int32)  # ints, not floats
    real_add = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, a, *args, **kw):
        if name == "blk.0.attn_norm.weight":
            a = norm[0]
        return real_add(self, name, a, *args, **kw)

    gguf.GGUFWriter.add_tensor = add_tensor
    try:
        write_gguf(path, GGUF_MODEL, params)
    finally:
        gguf.GGUFWriter.add_tensor = real_add
    with pytest.raises(InvalidWeights, match=r"blk\.0\.attn_norm\.weight is I32"):
        load_gguf(path)


def safetensors_file(path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file written by hand: header length, JSON header, data."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}  # fmt: skip
        data += raw
    head = json.dumps(header).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + data)


@pytest.mark.parametrize("dtype, raw", [("I64", np.arange(4, dtype=np.int64).tobytes()),
                                        ("BOOL", bytes(4))])  # fmt: skip
def test_the_safetensors_reader_refuses_integer_and_bool_tensors(tmp_path, dtype, raw):
    path = tmp_path / "model.safetensors"
    safetensors_file(path, {"model.norm.weight": (dtype, [4], raw)})
    with pytest.raises(ValueError, match=f"model.norm.weight is {dtype}"):
        read_safetensors(path)


@pytest.mark.parametrize("load", [load_gguf, read_safetensors], ids=["gguf", "safetensors"])
def test_paths_that_are_not_model_files_get_clear_errors(tmp_path, load):
    with pytest.raises(IsADirectoryError, match="is a directory: pass the .* file itself"):
        load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load(tmp_path / "missing")
    junk = tmp_path / "notes.txt"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json, 16 by")
    with pytest.raises(ValueError, match="not a (GGUF|safetensors) file"):
        load(junk)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for load in (load_gguf, read_safetensors):
        with pytest.raises(ValueError, match="not a regular file"):
            load(fifo)
