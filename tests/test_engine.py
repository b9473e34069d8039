"""The engine end to end: paged generation equals dense recompute, warmup
compiles every bucket and nothing after, checkpoints load, the pool is sized."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine.loaders.safetensors_llama import (  # noqa: E402
    load_llama_safetensors,
    save_llama_safetensors,
)
from kvsched.engine.model import LlamaConfig, forward_dense, greedy_dense, init_params  # noqa: E402
from kvsched.engine.model_config import UnsupportedConfig  # noqa: E402
from kvsched.engine.runner import Engine, size_pool  # noqa: E402

MODEL = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    ffn_dim=128)  # fmt: skip
PARAMS = init_params(MODEL, seed=1)


def engine(backend="reference", **kw) -> Engine:
    cfg = dict(num_blocks=96, block_size=4, max_num_seqs=4, max_batched_tokens=32,
               max_seq_len=96, long_prefill_chunk=8, overhead_reserve=0.0,
               max_waiting=8)  # fmt: skip
    cfg.update(kw)
    eng = Engine.create(MODEL, PARAMS, kvsched.SchedulerConfig(**cfg), backend=backend)
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    return eng


def run(eng: Engine, prompts, max_tokens: int, *, sequential=False) -> list[list[int]]:
    """Generate for each prompt; sequential: one after another (so later ones hit
    the prefix cache)."""
    out: dict[int, list[int]] = {}
    order: list[int] = []

    def drain() -> None:
        while eng.scheduler.live_requests:
            res = eng.step(now=0.0)
            for f in res.events.finished:
                out[f.request_id] = f.output_ids.tolist()

    for p in prompts:
        order.append(eng.scheduler.submit("t", np.asarray(p, np.int32), max_tokens, now=0.0))
        if sequential:
            drain()
    drain()
    return [out[r] for r in order]


def prompts_with_shared_prefix(seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, MODEL.vocab_size, 30).tolist()
    return [base[:n] + rng.integers(0, MODEL.vocab_size, k).tolist()
            for n, k in ((30, 0), (20, 7), (30, 5), (9, 14))]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_paged_generation_equals_dense_recompute_with_chunks_and_cache_hits(backend):
    eng = engine(backend)
    prompts = prompts_with_shared_prefix()
    got = run(eng, prompts, 6, sequential=True)
    want = [greedy_dense(PARAMS, MODEL, p, 6) for p in prompts]
    assert got == want
    st = eng.scheduler.stats()["tenants"]["t"]
    assert st["prefix_cache"]["hit_tokens"] > 0, "later prompts were served from the cache"
    assert st["prefill_tokens"] < sum(len(p) for p in prompts), "and not recomputed"


@pytest.mark.slow
def test_paged_generation_equals_dense_under_overcommit_preemption():
    eng = engine(num_blocks=33, admission="overcommit", watermark_blocks=0)
    prompts = prompts_with_shared_prefix(seed=3)
    got = run(eng, prompts, 12)
    assert eng.scheduler.stats()["preemptions"] > 0, "32 pages cannot hold their final 42"
    assert got == [greedy_dense(PARAMS, MODEL, p, 12) for p in prompts]


@pytest.mark.slow
def test_warmup_compiles_every_bucket_and_nothing_recompiles_after():
    cfg = kvsched.SchedulerConfig(num_blocks=96, block_size=4, max_num_seqs=4,
                                  max_batched_tokens=32, max_seq_len=96)  # fmt: skip
    eng = Engine.create(MODEL, PARAMS, cfg)
    assert eng.scheduler.lifecycle == "cold"
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    with pytest.raises(kvsched.Rejected) as e:
        eng.scheduler.submit("t", np.arange(4, dtype=np.int32), 2, now=0.0)
    assert e.value.reason == "not_ready"
    eng.warmup(progress=False)
    assert eng.scheduler.ready()
    buckets = len(eng.scheduler.token_buckets)
    assert eng.compiled_programs() == buckets
    rng = np.random.default_rng(0)
    mixes = [[int(n) for n in rng.integers(1, 40, k)] for k in (1, 3, 4, 2, 4)]
    for mix in mixes:  # many different batch mixes, every bucket used
        run(eng, [rng.integers(0, 256, n).tolist() for n in mix], int(rng.integers(1, 8)))
    assert eng.compiled_programs() == buckets


@pytest.mark.slow
def test_temperature_sampling_is_seeded():
    def sample(seed: int) -> list[list[int]]:
        cfg = kvsched.SchedulerConfig(num_blocks=96, block_size=4, max_num_seqs=4,
                                      max_batched_tokens=32, max_seq_len=96)  # fmt: skip
        eng = Engine.create(MODEL, PARAMS, cfg, temperature=1.0, seed=seed)
        eng.warmup(progress=False)
        eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
        return run(eng, [[1, 2, 3, 4, 5]], 10)

    assert sample(0) == sample(0)
    assert sample(0) != sample(7), "the seed is the stream"
    assert sample(0) != [greedy_dense(PARAMS, MODEL, [1, 2, 3, 4, 5], 10)]


def test_setting_the_seed_is_reseeding_even_for_a_request_under_way():
    """`engine.seed = 7` and `engine.reseed(7)` are one act: a request without a
    seed of their own draws from 7 from the next step on, though its sampling
    row (the old seed mixed in) was made and kept at its first step."""

    def sample(change) -> list[int]:
        cfg = kvsched.SchedulerConfig(num_blocks=96, block_size=4, max_num_seqs=4,
                                      max_batched_tokens=32, max_seq_len=96)  # fmt: skip
        eng = Engine.create(MODEL, PARAMS, cfg, temperature=1.0, seed=0)
        eng.warmup(progress=False)
        eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
        eng.scheduler.submit("t", np.asarray([1, 2, 3, 4, 5], np.int32), 16, now=0.0)
        for _ in range(3):
            eng.step(now=0.0)
        change(eng)
        out: list[int] = []
        while eng.scheduler.live_requests:
            for f in eng.step(now=0.0).events.finished:
                out = f.output_ids.tolist()
        return out

    assigned = sample(lambda e: setattr(e, "seed", 7))
    assert assigned == sample(lambda e: e.reseed(7)) != sample(lambda e: None)


def test_a_llama_checkpoint_round_trips_and_bad_shapes_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    save_llama_safetensors(PARAMS, path)
    loaded = load_llama_safetensors(path, MODEL)
    tokens = jnp.arange(12, dtype=jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(forward_dense(loaded, MODEL, tokens)),
        np.asarray(forward_dense(PARAMS, MODEL, tokens)),
    )
    wider = LlamaConfig(**{**MODEL.__dict__, "ffn_dim": 64})
    with pytest.raises(ValueError, match="shape"):
        load_llama_safetensors(path, wider)
    fewer = LlamaConfig(**{**MODEL.__dict__, "n_layers": 1})
    with pytest.raises(ValueError, match="does not describe"):
        load_llama_safetensors(path, fewer)  # a 2-layer file is not a 1-layer model
    hf = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "rope_theta": 10000.0, "rms_norm_eps": 1e-5}  # fmt: skip
    assert LlamaConfig.from_hf(hf, name="tiny-llama") == MODEL
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    assert LlamaConfig.from_hf({**hf, "rope_scaling": llama31}).rope_type == "llama3"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(UnsupportedConfig, match="rope_scaling.*yarn"):
        LlamaConfig.from_hf({**hf, "rope_scaling": yarn})
    with pytest.raises(UnsupportedConfig, match="rope_scaling"):  # llama3 without its fields
        LlamaConfig.from_hf({**hf, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_the_pool_is_sized_from_measured_free_memory_where_there_is_one():
    cfg = kvsched.SchedulerConfig(num_blocks=77, block_size=4, overhead_reserve=0.1)

    class Cpu:
        def memory_stats(self):
            return None

    class Gpu:
        def memory_stats(self):
            return {"bytes_limit": 10_000_000, "bytes_in_use": 2_000_000}

    assert size_pool(MODEL, cfg, "float32", Cpu()).num_blocks == 77
    sized = size_pool(MODEL, cfg, "float32", Gpu())
    per_block = 2 * 4 * 2 * 2 * 16 * 4  # layers x block x (K,V) x kv heads x head_dim x 4 B
    assert sized.bytes_per_block == per_block
    assert (sized.source, sized.measured_free_bytes) == ("measured", 8_000_000)
    assert sized.num_blocks == int(8_000_000 * 0.9) // per_block

    # Tensor parallel over 4 devices: each holds a quarter of every block, and
    # the device with the least free memory decides.
    class Busy(Gpu):
        def memory_stats(self):
            return {"bytes_limit": 10_000_000, "bytes_in_use": 4_000_000}

    tp = size_pool(MODEL, cfg, "float32", Gpu(), shards=4, devices=[Gpu(), Busy(), Gpu(), Gpu()])
    assert tp.num_blocks == int(6_000_000 * 0.9) * 4 // per_block
    # The reserve is held back once: a scheduler over a measured pool keeps none.
    eng = Engine.create(MODEL, PARAMS, cfg, device=Gpu())
    assert eng.scheduler.config.overhead_reserve == 0.0
    assert eng.scheduler.config.num_blocks == sized.num_blocks


@pytest.mark.slow
def test_bf16_weights_generate_like_bf16_dense_recompute():
    model = LlamaConfig(**{**MODEL.__dict__, "dtype": "bfloat16"})
    params = init_params(model, seed=1)
    cfg = kvsched.SchedulerConfig(num_blocks=96, block_size=4, max_num_seqs=4,
                                  max_batched_tokens=32, max_seq_len=96)  # fmt: skip
    eng = Engine.create(model, params, cfg, kv_dtype="bfloat16")
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    prompts = prompts_with_shared_prefix(seed=5)[:2]
    assert run(eng, prompts, 5) == [greedy_dense(params, model, p, 5) for p in prompts]
    assert eng.caches.dtype == jnp.bfloat16


@pytest.mark.slow
def test_the_engine_names_its_model_in_the_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from kvsched.metrics import SchedulerCollector

    eng = engine()
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(eng.scheduler, model=eng.model_info()))
    text = generate_latest(registry).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("kvsched_model_info{"))
    assert f'checksum="{eng.checksum}"' in line and 'name="tiny-llama"' in line
    assert len(eng.checksum) == 16
    other = init_params(MODEL, seed=2)
    assert Engine.create(MODEL, other, eng.scheduler.config).checksum != eng.checksum


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_a_packed_cache_generates_like_dense_recompute(backend):
    """The TPU kernel's layout for narrow heads ([.., kv_heads, 2*head_dim], one
    [K | V] row per head) is written, read by both backends, and computes the same
    tokens."""
    cfg = kvsched.SchedulerConfig(num_blocks=96, block_size=4, max_num_seqs=4,
                                  max_batched_tokens=32, max_seq_len=96, long_prefill_chunk=8,
                                  overhead_reserve=0.0)  # fmt: skip
    eng = Engine.create(MODEL, PARAMS, cfg, backend=backend, kv_layout="packed")
    assert eng.caches.shape[-2:] == (MODEL.n_kv_heads, 2 * MODEL.head_dim)
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    prompts = prompts_with_shared_prefix(seed=7)[:3]
    assert run(eng, prompts, 6, sequential=True) == [greedy_dense(PARAMS, MODEL, p, 6)
                                                     for p in prompts]  # fmt: skip


def test_the_step_program_does_not_grow_with_depth():
    """Layers run under lax.scan: a 6-layer model's step program holds the layer
    body once, as a 2-layer model's does (so warmup does not grow with depth)."""
    import jax

    def matmuls(n_layers: int) -> int:
        model = LlamaConfig(**{**MODEL.__dict__, "n_layers": n_layers})
        cfg = kvsched.SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4,
                                      max_batched_tokens=16, max_seq_len=32)  # fmt: skip
        eng = Engine.create(model, init_params(model, seed=0), cfg)
        s = cfg.max_num_seqs
        args = [np.zeros(16, np.int32)] * 3 + [np.zeros(s + 1, np.int32), np.zeros(s, np.int32),
                np.zeros((s, 8), np.int32), np.zeros(1, np.int32), np.zeros(s, np.int32),
                np.zeros(s, np.float32), np.ones(s, np.float32), np.zeros(s, np.int32),
                np.zeros((s, 2), np.uint32), np.zeros(s, np.int32)]  # fmt: skip
        prev = np.zeros(s, np.int32)  # the previous step's sampled tokens (overlap)
        text = jax.jit(eng._step.__wrapped__).lower(eng.params, eng.caches, prev, *args).as_text()
        return text.count("dot_general")

    assert matmuls(6) == matmuls(2)
