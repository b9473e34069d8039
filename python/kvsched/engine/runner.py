"""The engine loop: scheduler.step() -> model step -> sampling -> commit().

`Engine` owns the KV caches (one per layer, donated to each step so they are
updated in place) and one jitted step function. Plans come padded to a token
bucket and every other dimension is fixed, so the step compiles once per bucket:
`warmup()` compiles them all (with a progress bar), runs one synthetic request
end to end, then marks the scheduler ready. After that nothing recompiles;
`compiled_programs()` says how many programs exist.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kvsched
from kvsched.engine.attention import AttentionInputs
from kvsched.engine.kv_cache import KVCacheSpec, init_caches
from kvsched.engine.model import LlamaConfig, Params, forward_paged, weights_checksum


def kv_bytes_per_block(model: LlamaConfig, block_size: int, kv_dtype: str) -> int:
    """All layers' K and V for one page."""
    return (
        model.n_layers * block_size * 2 * model.n_kv_heads * model.head_dim
        * jnp.dtype(kv_dtype).itemsize
    )  # fmt: skip


def measured_free_bytes(device: Any) -> int | None:
    """Free accelerator memory as the backend reports it (None on CPU or when the
    backend gives no figure)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


@dataclass
class PoolSizing:
    num_blocks: int
    measured_free_bytes: int | None
    bytes_per_block: int
    source: str  # "measured" or "configured"


def size_pool(
    model: LlamaConfig,
    sched_config: kvsched.SchedulerConfig,
    kv_dtype: str,
    device: Any,
    *,
    shards: int = 1,
    devices: list[Any] | None = None,
) -> PoolSizing:
    """Size the KV pool from free device memory less the overhead reserve; where
    the backend gives no figure (CPU), keep the configured size. With tensor
    parallelism each of `shards` devices holds 1/shards of every block, so the
    device with the least free memory decides."""
    per_block = kv_bytes_per_block(model, sched_config.block_size, kv_dtype)
    frees = [measured_free_bytes(d) for d in (devices or [device])]
    if any(f is None for f in frees):
        return PoolSizing(sched_config.num_blocks, None, per_block, "configured")
    free = min(f for f in frees if f is not None)
    usable = int(free * (1.0 - sched_config.overhead_reserve))
    return PoolSizing(max(2, usable * shards // per_block), free, per_block, "measured")


@dataclass
class StepResult:
    plan: Any
    events: Any
    seconds: float


@dataclass
class Engine:
    """A model served over one kvsched Scheduler."""

    model: LlamaConfig
    params: Params
    scheduler: kvsched.Scheduler
    backend: str = "reference"
    kv_dtype: str = "float32"
    temperature: float = 0.0
    seed: int = 0
    caches: jax.Array = field(init=False)  # [layers, pages, block, 2*kv_heads, head_dim]
    sizing: PoolSizing | None = None
    mesh: Any = None  # a jax.sharding.Mesh: KV heads sharded over it (tensor parallelism)

    def __post_init__(self) -> None:
        cfg = self.scheduler.config
        spec = KVCacheSpec(
            cfg.num_blocks, cfg.block_size, self.model.n_kv_heads, self.model.head_dim,
            jnp.dtype(self.kv_dtype),
        )  # fmt: skip
        self.spec = spec
        self.checksum = weights_checksum(self.params)
        self.caches = init_caches(spec, self.model.n_layers)
        jit_kw: dict[str, Any] = {}
        if self.mesh is not None:
            from kvsched.engine import sharding

            sharding.check_divisible(self.model, self.mesh)
            self.params = sharding.shard_params(self.params, self.mesh)
            cs = sharding.cache_sharding(self.mesh)
            self.caches = jax.device_put(self.caches, cs)
            rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            jit_kw["out_shardings"] = (rep, cs)
        self._key = jax.random.PRNGKey(self.seed)
        model, backend, mesh = self.model, self.backend, self.mesh

        def step(params, caches, token_ids, positions, slot_mapping, cu_q_lens, kv_lens,
                 page_indices, num_seqs, logits_indices, key, temperature):  # fmt: skip
            inputs = AttentionInputs(positions, cu_q_lens, kv_lens, page_indices, num_seqs)
            logits, caches = forward_paged(
                params, caches, model, token_ids, positions, slot_mapping, inputs,
                logits_indices, backend=backend, mesh=mesh,
            )  # fmt: skip
            greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
            tokens = jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)
            return tokens, caches

        self._step = jax.jit(step, donate_argnums=(1,), **jit_kw)

    @classmethod
    def create(
        cls,
        model: LlamaConfig,
        params: Params,
        sched_config: kvsched.SchedulerConfig,
        *,
        kv_dtype: str = "float32",
        device: Any = None,
        **kw: Any,
    ) -> Engine:
        """Size the pool from the device (after the weights are resident), build a
        cold scheduler over it, and the engine."""
        device = device or jax.devices()[0]
        mesh = kw.get("mesh")
        shards = 1 if mesh is None else mesh.devices.size
        devices = None if mesh is None else list(mesh.devices.flat)
        sizing = size_pool(model, sched_config, kv_dtype, device, shards=shards, devices=devices)
        changes: dict[str, Any] = {"num_blocks": sizing.num_blocks, "require_warmup": True}
        if sizing.source == "measured":
            changes["overhead_reserve"] = 0.0  # held back from the measurement already
        sched = kvsched.Scheduler(sched_config.replace(**changes))
        return cls(model, params, sched, kv_dtype=kv_dtype, sizing=sizing, **kw)

    # -- running plans -----------------------------------------------------------------

    def run_plan(self, plan: Any) -> np.ndarray:
        """The model on one plan: a sampled token per sequence (int32)."""
        self._key, key = jax.random.split(self._key)
        tokens, self.caches = self._step(
            self.params, self.caches, plan.token_ids, plan.positions, plan.slot_mapping,
            plan.cu_q_lens, plan.kv_lens, plan.page_indices, plan.num_seqs,
            plan.logits_indices, key, jnp.float32(self.temperature),
        )  # fmt: skip
        return np.asarray(tokens)[: len(plan)]

    def step(self, now: float | None = None) -> StepResult | None:
        """One scheduler step through the model; None when nothing can run."""
        t0 = time.perf_counter()
        plan = self.scheduler.step(now=now)
        if plan is None:
            return None
        sampled = self.run_plan(plan)
        events = self.scheduler.commit(plan, sampled, now=now)
        return StepResult(plan, events, time.perf_counter() - t0)

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream from `seed`."""
        self.seed = seed
        self._key = jax.random.PRNGKey(seed)

    def compiled_programs(self) -> int:
        """Programs the step function compiled so far (one per bucket after warmup)."""
        return self._step._cache_size()

    # -- warmup ---------------------------------------------------------------------

    def warmup(self, *, progress: bool = True) -> float:
        """Compile every token bucket, run one synthetic request end to end through
        a scratch scheduler of the same shape, then mark the scheduler ready.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        if self.scheduler.lifecycle == "cold":
            self.scheduler.begin_warmup()
        buckets = self.scheduler.token_buckets
        shape = self.scheduler.plan_shape
        s, pps = shape["max_seqs"], shape["pages_per_seq"]
        pad_slot = shape["pad_slot"]
        bar = _progress(progress, len(buckets) + 1)
        for t in buckets:
            # An all-padding plan of bucket t: nothing attends, every write drops.
            dummy = _Plan(
                token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
                slot_mapping=np.full(t, pad_slot, np.int32), cu_q_lens=np.zeros(s + 1, np.int32),
                kv_lens=np.zeros(s, np.int32), page_indices=np.zeros((s, pps), np.int32),
                num_seqs=np.zeros(1, np.int32), logits_indices=np.zeros(s, np.int32), n=0,
            )  # fmt: skip
            self.run_plan(dummy)
            bar(f"compiled bucket {t}")
        scratch = kvsched.Scheduler(
            self.scheduler.config.replace(require_warmup=False, prefix_caching=False)
        )
        scratch.add_tenant(kvsched.TenantConfig("warmup"))
        scratch.submit("warmup", np.arange(1, 9, dtype=np.int32), 2, now=0.0)
        while scratch.live_requests:
            plan = scratch.step(now=0.0)
            scratch.commit(plan, self.run_plan(plan), now=0.0)
        bar("synthetic request completed")
        self.reseed(self.seed)  # sampling does not depend on what warmup ran
        self.scheduler.mark_ready()
        return time.perf_counter() - t0

    def model_info(self) -> dict[str, str]:
        """For kvsched.metrics.SchedulerCollector(model=...)."""
        return {"name": self.model.name, "checksum": self.checksum}


@dataclass
class _Plan:
    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray
    num_seqs: np.ndarray
    logits_indices: np.ndarray
    n: int

    def __len__(self) -> int:
        return self.n


def _progress(enabled: bool, total: int):
    """A progress callback: rich's bar when enabled and available, else silent."""
    if not enabled:
        return lambda _msg: None
    try:
        from rich.progress import Progress
    except ImportError:  # pragma: no cover - rich is part of the engine extra
        return lambda msg: print(msg, flush=True)
    prog = Progress(transient=True)
    task = prog.add_task("warmup", total=total)
    prog.start()
    done = [0]

    def advance(msg: str) -> None:
        done[0] += 1
        prog.update(task, advance=1, description=msg)
        if done[0] == total:
            prog.stop()

    return advance
