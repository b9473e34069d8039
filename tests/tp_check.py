"""Run by test_engine_tp.py in a fresh process with 4 forced host devices:
generate with the KV heads sharded over a 4-device mesh and print what the test
checks as JSON.

    python tests/tp_check.py BACKEND [KV_HEADS]

KV_HEADS (default 4) below 4 runs a model with fewer KV heads than devices:
each head is copied to the devices that read it. Those runs also size the pool
as on an accelerator, from a faked 64 KiB of free memory per device (small:
the Pallas interpreter copies the whole cache on every call)."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine import pool_sizing, runner  # noqa: E402
from kvsched.engine.mesh import make_mesh  # noqa: E402
from kvsched.engine.model import (  # noqa: E402
    LlamaConfig,
    greedy_dense,
    init_params,
    weights_checksum,
)
from kvsched.engine.runner import Engine  # noqa: E402

backend = sys.argv[1]
kv_heads = int(sys.argv[2]) if len(sys.argv) > 2 else 4
model = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=kv_heads,
                    head_dim=16, ffn_dim=128)  # fmt: skip
params = init_params(model, seed=2)
cfg = kvsched.SchedulerConfig(
    num_blocks=64, block_size=4, max_num_seqs=4, max_batched_tokens=32, max_seq_len=64,
    long_prefill_chunk=8, overhead_reserve=0.0,
)  # fmt: skip
if kv_heads < 4:
    pool_sizing.measured_free_bytes = lambda device: 1 << 16
eng = Engine.create(model, params, cfg, mesh=make_mesh(4), backend=backend)
eng.warmup(progress=False)
eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 256, n).tolist() for n in (5, 19, 11)]
ids = [eng.scheduler.submit("t", np.asarray(p, np.int32), 6, now=0.0) for p in prompts]
out = {}
while eng.scheduler.live_requests:
    for f in eng.step(now=0.0).events.finished:
        out[f.request_id] = f.output_ids.tolist()
equal = [out[i] == greedy_dense(params, model, p, 6) for i, p in zip(ids, prompts, strict=True)]
refused = None
if kv_heads < 4:
    sized = []
    real_size_pool = runner.size_pool
    runner.size_pool = lambda *a, **k: sized.append(1) or real_size_pool(*a, **k)
    six = LlamaConfig(vocab_size=256, dim=64, n_layers=1, n_heads=12, n_kv_heads=6,
                      head_dim=16, ffn_dim=128)  # fmt: skip
    try:
        Engine.create(six, init_params(six), cfg, mesh=make_mesh(4), backend=backend)
    except kvsched.InvalidConfig as e:
        refused = [type(e).__name__, bool(sized)]
print(json.dumps({
    "devices": len(jax.devices()),
    "kv_replicas": eng.kv_replicas,
    "refused": refused,
    "pool_source": eng.sizing.source,
    "cache_bytes_per_device": eng.caches.addressable_shards[0].data.nbytes,
    "checksum_as_given": eng.checksum == weights_checksum(params),
    "cache_spec": str(eng.caches.sharding.spec),
    "shard_shapes": [list(s.data.shape) for s in eng.caches.addressable_shards],
    "equal_dense": equal,
    "programs": eng.compiled_programs(),
    "buckets": len(eng.scheduler.token_buckets),
}))  # fmt: skip
