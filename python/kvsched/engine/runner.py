"""The engine loop: scheduler.step() -> model step -> sampling -> commit().

`Engine` owns the KV caches (every layer's, stacked, donated to each step so they
are updated in place) and one jitted step function. Plans come padded to a token
bucket and every other dimension is fixed, so the step compiles once per bucket:
`warmup()` compiles them all (with a progress bar), runs one synthetic request
end to end, then marks the scheduler ready. After that nothing recompiles;
`compiled_programs()` says how many programs exist.

Requests enter through `Engine.submit(tenant, prompt_ids, SamplingParams)`: each
carries its own temperature, top-k, top-p, seed, stop tokens, stop strings and
logprobs. Per-row parameters reach the jitted step as [max_seqs] arrays, so
requests that differ never recompile. With a tokenizer attached, each step's
`outputs` carry the new text of every request (incremental detokenization that
never splits a UTF-8 character; stop strings matched on the text and not
returned). Requests submitted to `engine.scheduler` directly run with the
engine's default sampling (`temperature`, `seed`) and get no outputs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh

import kvsched
from kvsched.engine import kv_gate, sharding
from kvsched.engine.attention import resolve_backend
from kvsched.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvsched.engine.inputs import HostArray, StepInputs
from kvsched.engine.kv_cache import (
    KVCache,
    KVCacheSpec,
    UnsupportedKVDtype,
    init_caches,
    kv_bytes_per_token,
)
from kvsched.engine.model import (
    InvalidWeights,
    LlamaConfig,
    Params,
    forward_paged,
    weights_checksum,
)
from kvsched.engine.sampling import MAX_LOGPROBS, SamplingBatch, SamplingParams, mix_seed, sample


def kv_bytes_per_block(model: LlamaConfig, block_size: int, kv_dtype: str) -> int:
    """All layers' K and V for one page (int8: with its per-token-per-head scales)."""
    return kv_bytes_per_token(model.n_layers, model.n_kv_heads, model.head_dim, kv_dtype,
                              tokens=block_size)  # fmt: skip


def measured_free_bytes(device: jax.Device) -> int | None:
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
    device: jax.Device,
    *,
    shards: int = 1,
    devices: list[jax.Device] | None = None,
) -> PoolSizing:
    """Size the KV pool from free device memory less the overhead reserve; where
    the backend gives no figure (CPU), keep the configured size. With tensor
    parallelism each of `shards` devices holds 1/shards of every block, so the
    device with the least free memory decides."""
    per_block = kv_bytes_per_block(model, sched_config.block_size, kv_dtype)
    # On several processes (kvsched.engine.multihost) a process can read only its
    # own devices; every process must size the same pool, so the least free
    # memory of any process decides (a collective: every process sizes together).
    here = jax.process_index()
    frees = [measured_free_bytes(d) for d in (devices or [device])
             if getattr(d, "process_index", here) == here]  # fmt: skip
    if any(f is None for f in frees):
        return PoolSizing(sched_config.num_blocks, None, per_block, "configured")
    free = min(f for f in frees if f is not None)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        mib = multihost_utils.process_allgather(np.asarray([free >> 20], np.int32))
        free = int(np.min(mib)) << 20
    usable = int(free * (1.0 - sched_config.overhead_reserve))
    return PoolSizing(max(2, usable * shards // per_block), free, per_block, "measured")


@dataclass
class TokenLogprob:
    """The chosen token's log-probability under the model, and the top-n."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first; n = the request's ask


@dataclass
class RequestOutput:
    """What one request produced in one step (only requests submitted through
    `Engine.submit`). The last output of a request has `finished` set and its
    `finish_reason`: "stop" (a stop token or stop string), "length" (max_tokens),
    "cancelled", "drain_deadline", "shed" (displaced before it finished by a
    higher tier's request that a global limit would have refused; `retry_after`
    says when a retry makes sense), or "error": the engine could not serve it
    (its logits were not finite, or it carried a token id outside the
    vocabulary), said in `error`; the other requests of the step run on."""

    request_id: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None  # why, when finish_reason is "error"
    retry_after: float | None = None  # seconds, when finish_reason is "shed"


@dataclass
class StepResult:
    plan: kvsched.StepPlan | None  # None: no plan ran, only endings to report
    events: kvsched.StepEvents | _NoEvents
    seconds: float  # the whole step: plan, model, commit, outputs
    outputs: list[RequestOutput] = field(default_factory=list)
    model_seconds: float = 0.0  # of which the jitted model step and sampling
    # Requests this step ended because the engine could not serve them (request
    # id -> why); also those submitted to the scheduler directly, whose terminal
    # event is the core's "cancelled".
    errors: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _NoEvents:
    """The events of a step that ran no plan."""

    request_ids: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    tokens: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    finished: tuple[kvsched.FinishedRequest, ...] = ()
    preempted: tuple[int, ...] = ()


_NO_EVENTS = _NoEvents()


@dataclass
class _Live:
    """Engine-side state of a request submitted through `Engine.submit`."""

    params: SamplingParams
    prompt_len: int
    detok: IncrementalDetokenizer | None
    stops: StopStringMatcher | None
    generated: int = 0


@dataclass
class Engine:
    """A model served over one kvsched Scheduler."""

    model: LlamaConfig
    params: Params
    scheduler: kvsched.Scheduler
    backend: str = "reference"
    kv_dtype: str = "float32"
    temperature: float = 0.0  # default sampling for requests without their own
    seed: int = 0  # mixed with each request id where a request brings no seed
    caches: KVCache = field(init=False)  # [layers, pages, block, 2*kv_heads, head_dim]
    sizing: PoolSizing | None = None
    mesh: Mesh | None = None  # KV heads sharded over it (tensor parallelism)
    # A tokenizers.Tokenizer: text in outputs, stop strings. (Any: tokenizers' own
    # stub leaves its methods' parameters unannotated.)
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()  # stop tokens of every request (unless ignore_eos)
    max_logprobs: int = 0  # top-n logprobs computed each step (static; 0 = none)
    # The int8 KV gate (kvsched.engine.kv_gate): a passing KVEvalReport for these
    # weights, or None to look for the one `kvsched eval-kv` saved. "unchecked" is
    # for the evaluation itself only.
    kv_eval: Any = None
    # "split" ([.., 2*kv_heads, head_dim]), "packed" ([.., kv_heads, 2*head_dim]: the
    # TPU kernel's layout for heads narrower than 128 lanes) or "auto" (packed for
    # kvsched's Pallas kernel on TPU when head_dim is not a multiple of 128; split
    # for JAX's kernel, whose layout it is).
    kv_layout: str = "auto"
    kv_min_agreement: float = kv_gate.MIN_AGREEMENT
    kv_max_logprob_diff: float = kv_gate.MAX_MEAN_ABS_LOGPROB_DIFF

    def __post_init__(self) -> None:
        cfg = self.scheduler.config
        if cfg.vocab_size not in (None, self.model.vocab_size):
            raise kvsched.InvalidConfig(
                f"the scheduler's vocab_size is {cfg.vocab_size}, the model's "
                f"{self.model.vocab_size}: they must agree (or leave vocab_size None)"
            )
        if self.kv_layout not in ("auto", "split", "packed"):
            raise ValueError(f"kv_layout must be auto, split or packed, not {self.kv_layout!r}")
        # The kernel the backend runs here (kvsched.InvalidConfig for an unknown
        # backend or KVSCHED_TPU_ATTENTION value): on TPU, `pallas` is kvsched's
        # kernel or JAX's.
        self.attention_kernel = resolve_backend(self.backend, head_dim=self.model.head_dim)
        packed = self.kv_layout == "packed" or (
            self.kv_layout == "auto" and self.attention_kernel == "pallas"
            and jax.default_backend() == "tpu" and self.model.head_dim % 128 != 0
        )  # fmt: skip
        if packed and self.attention_kernel == "jax_kernel":
            raise kvsched.InvalidConfig(
                "kv_layout='packed' with JAX's TPU kernel: it reads the split layout "
                "[.., 2*kv_heads, head_dim], and a packed cache would be relaid out on "
                "every layer of every step (use kv_layout='auto' or 'split')"
            )
        # With more devices than KV heads each head is copied to the devices that
        # read it (sharding.kv_replicas): the program runs a model with that many
        # more KV heads. `model` stays the model as given (its name, its heads);
        # the checksum is of the weights as given.
        self.kv_replicas = 1 if self.mesh is None else sharding.check_divisible(
            self.model, self.mesh)  # fmt: skip
        self.checksum = weights_checksum(self.params)
        program_model, self.params = sharding.replicate_kv_heads(
            self.model, self.params, self.kv_replicas)  # fmt: skip
        spec = KVCacheSpec(
            cfg.num_blocks, cfg.block_size, program_model.n_kv_heads, self.model.head_dim,
            jnp.dtype(self.kv_dtype), packed=packed,
        )  # fmt: skip
        self.spec = spec
        if spec.quantized:
            if self.backend != "reference":
                raise UnsupportedKVDtype(
                    f"kv_dtype={self.kv_dtype!r} is read by the reference backend only, "
                    f"not {self.backend!r}"
                )
            if isinstance(self.kv_eval, str) and self.kv_eval != "unchecked":
                raise ValueError(f"kv_eval: a KVEvalReport, None or 'unchecked', not "
                                 f"{self.kv_eval!r}")  # fmt: skip
            if self.kv_eval != "unchecked":
                report = self.kv_eval or kv_gate.load_report(self.checksum, self.kv_dtype)
                self.kv_eval = kv_gate.check_gate(
                    report, kv_dtype=self.kv_dtype, checksum=self.checksum,
                    min_agreement=self.kv_min_agreement,
                    max_mean_abs_logprob_diff=self.kv_max_logprob_diff,
                )  # fmt: skip
        self.caches = init_caches(spec, self.model.n_layers)
        jit_kw: dict[str, Any] = {}
        if self.mesh is not None:
            self.params = sharding.shard_params(self.params, self.mesh)
            cs = sharding.cache_sharding(self.mesh)
            self.caches = jax.device_put(self.caches, cs)
            rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            jit_kw["out_shardings"] = (rep, cs)
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}]")
        self._live: dict[int, _Live] = {}
        self._default = SamplingParams(temperature=self.temperature)
        model, backend, mesh, n_lp = program_model, self.backend, self.mesh, self.max_logprobs

        n_inputs = StepInputs.num_arrays()

        # Flat at the jit boundary (StepInputs' arrays in field order, then the
        # sampling arrays), named again inside: one compiled program per bucket
        # either way, and the traced step can be lowered from plain arrays.
        def step(
            params: Params, caches: KVCache, *arrays: jax.Array
        ) -> tuple[tuple[jax.Array, ...], KVCache]:
            inputs = StepInputs(*arrays[:n_inputs])
            logits, caches = forward_paged(
                params, caches, model, inputs.token_ids, inputs.positions, inputs.slot_mapping,
                inputs.attention, inputs.logits_indices, backend=backend, mesh=mesh,
            )  # fmt: skip
            out = sample(logits, *arrays[n_inputs:], num_logprobs=n_lp)
            # Per row: are its logits finite? A NaN or inf would be sampled as if
            # it were a distribution (argmax of NaN is some id), so the host
            # ends such a row instead of committing its token.
            finite = jnp.all(jnp.isfinite(logits), axis=-1)
            return (*out, finite), caches

        self._step = jax.jit(step, donate_argnums=(1,), **jit_kw)

    @classmethod
    def create(
        cls,
        model: LlamaConfig,
        params: Params,
        sched_config: kvsched.SchedulerConfig,
        *,
        kv_dtype: str = "float32",
        device: jax.Device | None = None,
        pool: str = "memory",
        **kw: Any,
    ) -> Engine:
        """Size the pool from the device (after the weights are resident), build a
        cold scheduler over it, and the engine. `pool="memory"`: as many blocks
        as the free memory holds where the backend reports it (the configured
        num_blocks elsewhere, e.g. on CPU); `pool="configured"`: the configured
        num_blocks, kvsched.InvalidConfig if a device's free memory cannot hold
        its share."""
        if pool not in ("memory", "configured"):
            raise kvsched.InvalidConfig(f"pool: 'memory' or 'configured', not {pool!r}")
        device = device or jax.devices()[0]
        mesh = kw.get("mesh")
        shards = 1 if mesh is None else mesh.devices.size
        devices = None if mesh is None else list(mesh.devices.flat)
        # Each device holds its share of the KV heads, copies included (kv_replicas).
        replicas = 1 if mesh is None else sharding.check_divisible(model, mesh)
        stored = sharding.widened(model, replicas)
        sizing = size_pool(stored, sched_config, kv_dtype, device, shards=shards, devices=devices)
        if pool == "configured" and sizing.source == "measured":
            if sched_config.num_blocks > sizing.num_blocks:
                free = sizing.measured_free_bytes or 0
                raise kvsched.InvalidConfig(
                    f"num_blocks={sched_config.num_blocks}: the free memory ({free / 2**30:.2f} "
                    f"GiB a device, {sched_config.overhead_reserve:.0%} held back) holds "
                    f"{sizing.num_blocks} blocks of {sched_config.block_size} tokens"
                )
            sizing = dataclasses.replace(sizing, num_blocks=sched_config.num_blocks,
                                         source="configured")  # fmt: skip
        changes: dict[str, Any] = {"num_blocks": sizing.num_blocks, "require_warmup": True}
        if sched_config.vocab_size is None:
            # The core refuses ids outside the vocabulary too, whoever submits.
            changes["vocab_size"] = model.vocab_size
        if sizing.source == "measured":
            changes["overhead_reserve"] = 0.0  # held back from the measurement already
        sched = kvsched.Scheduler(sched_config.replace(**changes))
        return cls(model, params, sched, kv_dtype=kv_dtype, sizing=sizing, **kw)

    # -- running plans -----------------------------------------------------------------

    # -- requests -----------------------------------------------------------------------

    def submit(
        self,
        tenant: str,
        prompt_ids: Any,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | bytes | None = None,
        now: float | None = None,
    ) -> int:
        """Admit a request with its own sampling parameters; returns its id. Raises
        kvsched.InvalidRequest for bad parameters (nothing changes) and
        kvsched.Rejected when admission refuses."""
        params = (params or SamplingParams()).validate(self.model.vocab_size)
        if params.logprobs and params.logprobs > self.max_logprobs:
            raise kvsched.InvalidRequest(
                f"logprobs: {params.logprobs} asked, this engine computes at most "
                f"{self.max_logprobs} (Engine(max_logprobs=...))"
            )
        if params.stop and self.tokenizer is None:
            raise kvsched.InvalidRequest("stop: stop strings need a tokenizer on the engine")
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or (prompt.size and not np.issubdtype(prompt.dtype, np.integer)):
            raise kvsched.InvalidRequest("prompt_ids: a 1-D sequence of integer token ids")
        vocab = self.model.vocab_size
        if prompt.size and (prompt.min() < 0 or prompt.max() >= vocab):
            bad = int(prompt[(prompt < 0) | (prompt >= vocab)][0])
            raise kvsched.InvalidRequest(
                f"prompt_ids: id {bad} is outside the vocabulary of {vocab} "
                f"(ids are 0..{vocab - 1})"
            )
        prompt = prompt.astype(np.int32)
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += [t for t in self.eos_token_ids if t not in stop_ids]
        rid = self.scheduler.submit(tenant, prompt, params.max_tokens,
                                    stop_token_ids=stop_ids or None, cache_salt=cache_salt,
                                    now=now)  # fmt: skip
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt.tolist())
        stops = StopStringMatcher(params.stop) if params.stop else None
        self._live[rid] = _Live(params, len(prompt), detok, stops)
        return rid

    def cancel(self, request_id: int, *, now: float | None = None) -> RequestOutput | None:
        """Cancel a request; returns its final output (finish_reason "cancelled")
        when it was submitted through `submit` and was still running. Cancelling a
        request that has already ended (finished this step, handed back by a
        drain) is not an error: it returns None, and its ending was or will be
        reported by `step`. An id never issued raises kvsched.UnknownRequest."""
        ended_here = self.scheduler.cancel(request_id, now=now)
        live = self._live.pop(request_id, None) if ended_here else None
        if live is None:
            return None
        return self._final(request_id, live, "cancelled")

    def _final(
        self, rid: int, live: _Live, reason: str, retry_after: float | None = None
    ) -> RequestOutput:
        """A request's last output: what its stop-string matcher still held back
        (nothing matched) and its ending."""
        text = live.stops.flush() if live.stops is not None else ""
        return RequestOutput(rid, [], text, None, True, reason, live.prompt_len, live.generated,
                             retry_after=retry_after)  # fmt: skip

    def _endings(self, finished: Iterable[kvsched.FinishedRequest]) -> list[RequestOutput]:
        """Final outputs of requests that ended without a token this step: the
        core's terminal events for cancels (also `scheduler.cancel` called
        directly), for requests a drain's deadline handed back, and for requests
        a higher tier displaced ("shed", with the core's retry_after)."""
        out = []
        for f in finished:
            live = self._live.pop(f.request_id, None)
            if live is not None:
                out.append(self._final(f.request_id, live, f.reason, f.retry_after))
        return out

    def _sampling_batch(self, plan: kvsched.StepPlan) -> SamplingBatch:
        rids = plan.request_ids.tolist()
        params = [self._live[r].params if r in self._live else self._default for r in rids]
        seeds = [mix_seed(self.seed, r) for r in rids]
        return SamplingBatch.build(params, plan.kv_lens[: len(rids)], len(plan.kv_lens), seeds)

    # -- running plans -----------------------------------------------------------------

    def run_plan(
        self, plan: kvsched.StepPlan, batch: SamplingBatch | None = None
    ) -> npt.NDArray[np.int32]:
        """The model on one plan: a sampled token per sequence (int32). The full
        sampler output (tokens, logprob, top ids, top logprobs) is kept in
        `last_sample` for `step`."""
        batch = batch or self._sampling_batch(plan)
        return self._run(StepInputs.from_plan(plan), batch)[: len(plan)]

    def _run(self, inputs: StepInputs[HostArray], batch: SamplingBatch) -> npt.NDArray[np.int32]:
        """The jitted step on `inputs`: every row's sampled token."""
        out, self.caches = self._step(self.params, self.caches, *inputs.arrays(), *batch.arrays())
        self.last_sample = out[:4]
        self.last_finite = out[4]
        return np.asarray(out[0])

    def _unservable(self, plan: kvsched.StepPlan) -> dict[int, str]:
        """Rows of the step just run that must not be committed, by request id:
        non-finite logits (the weights or the activations overflowed: sampling
        from them would return a plausible token computed from nothing), or an
        input token outside the vocabulary (possible only for a request submitted
        to `scheduler` directly: the embedding gather would clamp it silently)."""
        n, vocab = len(plan), self.model.vocab_size
        finite = np.asarray(self.last_finite)[:n]
        toks = plan.token_ids[: plan.num_tokens]
        out_of_vocab = bool(toks.size) and bool((toks.min() < 0) | (toks.max() >= vocab))
        if finite.all() and not out_of_vocab:
            return {}
        rids, cu = plan.request_ids.tolist(), plan.cu_q_lens
        bad: dict[int, str] = {}
        for i, rid in enumerate(rids):
            row = toks[cu[i] : cu[i + 1]]
            outside = row[(row < 0) | (row >= vocab)]
            if outside.size:
                bad[rid] = (f"token id {int(outside[0])} is outside the vocabulary of {vocab} "
                            "(submitted to the scheduler without the engine's check?)")  # fmt: skip
            elif not finite[i]:
                bad[rid] = (
                    "the model's logits were not finite (NaN or inf): the weights or the "
                    "activations overflowed; no token was sampled from them"
                )
        return bad

    def _check_sampled(
        self, plan: kvsched.StepPlan, sampled: npt.NDArray[np.int32], skip: Iterable[int] = ()
    ) -> None:
        """Refuse to commit a sampled id outside the vocabulary: it would be fed
        back as the next input (and clamped there). The sampler draws from
        [0, vocab), so such an id is a bug of the engine, not of a request:
        kvsched.InternalError, raised before `commit` (nothing committed)."""
        vocab, n = self.model.vocab_size, len(plan)
        ids = sampled[:n]
        bad = plan.samples[:n] & ((ids < 0) | (ids >= vocab))
        if not bad.any():
            return
        skipped = set(skip)
        for i, rid in enumerate(plan.request_ids.tolist()):
            if bad[i] and rid not in skipped:
                raise kvsched.InternalError(
                    f"sampled id {int(ids[i])} for request {rid} is outside the vocabulary "
                    f"of {vocab}: not committed (a bug of the model step or the sampler)"
                )

    def step(self, now: float | None = None) -> StepResult | None:
        """One scheduler step through the model; None when nothing can run (and
        no request has an ending to report: requests the scheduler dropped
        without an event, at a drain deadline, come back once with plan None)."""
        t0 = time.perf_counter()
        plan = self.scheduler.step(now=now)
        if plan is None:
            endings = self._endings(self.scheduler.take_finished())
            if not endings:
                return None
            return StepResult(None, _NO_EVENTS, time.perf_counter() - t0, endings)
        t_model = time.perf_counter()
        sampled = self.run_plan(plan)
        t_model = time.perf_counter() - t_model
        errors = self._unservable(plan)
        self._check_sampled(plan, sampled, skip=errors)
        # The rows that cannot be served end here, before the commit (which then
        # drops their tokens); the rest of the batch is committed as usual.
        failed = []
        for rid, why in errors.items():
            self.scheduler.cancel(rid, now=now)
            live = self._live.pop(rid, None)
            if live is not None:
                final = self._final(rid, live, "error")
                final.error = why
                failed.append(final)
        events = self.scheduler.commit(plan, sampled, now=now)
        outputs = self._outputs(plan, events, now) if self._live else []
        if self._live:  # requests that ended with no token this step (cancel, drain)
            outputs += self._endings(events.finished)
        return StepResult(plan, events, time.perf_counter() - t0, failed + outputs, t_model,
                          errors)  # fmt: skip

    def _outputs(
        self, plan: kvsched.StepPlan, events: kvsched.StepEvents, now: float | None
    ) -> list[RequestOutput]:
        """Per request of this step: new tokens, new text, logprobs, and its ending."""
        row_of = {r: i for i, r in enumerate(plan.request_ids.tolist())}
        finished = {f.request_id: f for f in events.finished}
        lp = None
        outputs = []
        for rid, tok in zip(events.request_ids.tolist(), events.tokens.tolist(), strict=True):
            live = self._live.get(rid)
            if live is None:
                continue
            live.generated += 1
            logprobs = None
            if live.params.logprobs is not None:
                if lp is None:
                    lp = [np.asarray(a) for a in self.last_sample[1:]]
                row, n = row_of[rid], live.params.logprobs
                top = list(zip(lp[1][row, :n].tolist(), lp[2][row, :n].tolist(), strict=True))
                logprobs = [TokenLogprob(tok, float(lp[0][row]), top)]
            text, stopped = "", False
            fin = finished.get(rid)
            if live.detok is not None:
                stop_token = fin is not None and fin.reason == "stop"
                # A stop token is not part of the text (OpenAI's convention).
                text = live.detok.push([] if stop_token else [tok])
                if fin is not None:
                    text += live.detok.flush()
                if live.stops is not None:
                    text, stopped = live.stops.feed(text)
                    if fin is not None and not stopped:
                        text += live.stops.flush()
            out = RequestOutput(rid, [tok], text, logprobs, prompt_tokens=live.prompt_len,
                                completion_tokens=live.generated)  # fmt: skip
            if stopped and fin is None:
                # A stop string: the request ends here, finished with reason "stop"
                # (the core's event for it arrives later and is skipped).
                self.scheduler.stop(rid, now=now)
            if stopped or fin is not None:
                out.finished = True
                out.finish_reason = "stop" if stopped or fin is None else fin.reason
                del self._live[rid]
            outputs.append(out)
        return outputs

    def reseed(self, seed: int) -> None:
        """Requests without a seed of their own now draw from `seed`."""
        self.seed = seed

    def compiled_programs(self) -> int:
        """Programs the step function compiled so far (one per bucket after warmup)."""
        # A jitted function's _cache_size() is jax's (jax 0.10), missing from the stub of
        # jax.jit's result (JitWrapped).
        n: int = self._step._cache_size()  # type: ignore[attr-defined]
        return n

    # -- warmup ---------------------------------------------------------------------

    def warmup(self, *, progress: bool | Callable[[int, int, str], None] = True) -> float:
        """Compile every token bucket, run one synthetic request end to end through
        a scratch scheduler of the same shape, then mark the scheduler ready.
        Returns the seconds it took. `progress`: a bar (True), nothing (False), or
        a callback `(done, total, what)` after each of the len(token_buckets) + 1
        parts (it may raise to stop the warmup; the scheduler then stays warming)."""
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
            self._run(
                StepInputs.padding(t, s, pps, pad_slot),
                SamplingBatch.build([], np.zeros(0, np.int32), s, []),
            )
            bar(f"compiled the {t}-token program")
        scratch = kvsched.Scheduler(
            self.scheduler.config.replace(require_warmup=False, prefix_caching=False)
        )
        scratch.add_tenant(kvsched.TenantConfig("warmup"))
        scratch.submit("warmup", np.arange(1, 9, dtype=np.int32), 2, now=0.0)
        while scratch.live_requests:
            plan = scratch.step(now=0.0)
            if plan is None:  # cannot happen: one small request, time never moves
                raise RuntimeError("warmup: the scratch scheduler planned no step")
            sampled = self.run_plan(plan)
            if not np.asarray(self.last_finite)[: len(plan)].all():
                raise InvalidWeights(
                    "warmup: the model's logits are not finite (NaN or inf) for a plain "
                    "request: these weights cannot be served"
                )
            self._check_sampled(plan, sampled)
            scratch.commit(plan, sampled, now=0.0)
        bar("synthetic request completed")
        self.scheduler.mark_ready()
        return time.perf_counter() - t0

    def model_info(self) -> dict[str, str]:
        """For kvsched.metrics.SchedulerCollector(model=...)."""
        return {"name": self.model.name, "checksum": self.checksum}


def _progress(enabled: bool | Callable[[int, int, str], None], total: int) -> Callable[[str], None]:
    """A progress callback: the caller's, rich's bar when enabled and available,
    else silent."""
    if callable(enabled):
        done_parts = [0]

        def report(msg: str) -> None:
            done_parts[0] += 1
            enabled(done_parts[0], total, msg)

        return report
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
