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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh

import kvsched
from kvsched.engine import kv_gate, sharding
from kvsched.engine.attention import resolve_backend
from kvsched.engine.inputs import HostArray, StepInputs
from kvsched.engine.kv_cache import KVCache, KVCacheSpec, UnsupportedKVDtype, init_caches
from kvsched.engine.model import (
    InvalidWeights,
    LlamaConfig,
    Params,
    forward_paged,
    weights_checksum,
)
from kvsched.engine.outputs import (
    Logprobs,
    OutputProcessor,
    RequestOutput,
    StepOutputs,
    TokenLogprob,
)
from kvsched.engine.pool_sizing import (
    PoolSizing,
    kv_bytes_per_block,
    measured_free_bytes,
    size_pool,
)
from kvsched.engine.sampling import (
    MAX_LOGPROBS,
    SamplingBatch,
    SamplingParams,
    SamplingRow,
    SamplingTable,
    mix_seed,
    sample,
    sampling_row,
)
from kvsched.shapes import KVGroupLayout, group_layers

# Named here too: they were defined in this module before it was split.
__all__ = [
    "Engine",
    "PoolSizing",
    "RequestOutput",
    "StepOutputs",
    "StepResult",
    "TokenLogprob",
    "kv_bytes_per_block",
    "measured_free_bytes",
    "size_pool",
]


@dataclass
class StepResult:
    plan: kvsched.StepPlan | None  # None: no plan ran, only endings to report
    events: kvsched.StepEvents | _NoEvents
    seconds: float  # the whole step: plan, model, commit, outputs
    outputs: StepOutputs = field(default_factory=StepOutputs.empty)
    model_seconds: float = 0.0  # of which the jitted model step and sampling
    # Requests this step ended because the engine could not serve them (request
    # id -> why; the core's terminal event says "error" with the same words),
    # also those submitted to the scheduler directly.
    errors: dict[int, str] = field(default_factory=dict)


class _PlanRows(Mapping[int, int]):
    """A plan's row of each request, made only in a step where some request
    needs it (logprobs), on its first lookup."""

    def __init__(self, request_ids: npt.NDArray[Any]) -> None:
        self._ids = request_ids
        self._rows: dict[int, int] | None = None

    def __getitem__(self, request_id: int) -> int:
        if self._rows is None:
            self._rows = {r: i for i, r in enumerate(self._ids.tolist())}
        return self._rows[request_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids.tolist())

    def __len__(self) -> int:
        return len(self._ids)


class _Outputs(NamedTuple):
    """The jitted step's outputs, on the device (see `Sampled`)."""

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    finite: jax.Array

    def sampled(self) -> Sampled:
        """Wait for the step, and bring the tokens to the host."""
        return Sampled(np.asarray(self.tokens), self.logprob, self.top_ids, self.top_logprobs,
                       self.finite)  # fmt: skip


@dataclass
class _Launched:
    """A plan dispatched (overlapped scheduling) and not resolved yet."""

    plan: kvsched.StepPlan
    out: _Outputs
    model_seconds: float = 0.0  # the dispatch's share of the model time


@dataclass(frozen=True)
class _NoEvents:
    """The events of a step that ran no plan."""

    request_ids: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    tokens: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    finished: tuple[kvsched.FinishedRequest, ...] = ()
    preempted: tuple[int, ...] = ()


_NO_EVENTS = _NoEvents()


class Sampled(NamedTuple):
    """What the jitted step returns for every row of a plan: the sampled token
    (on the host), and on the device the sampler's logprob outputs and whether
    each row's logits were finite (read only when needed)."""

    tokens: npt.NDArray[np.int32]
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    finite: jax.Array

    def logprobs(self, n: int) -> Logprobs:
        """The first `n` rows' logprob outputs, on the host."""
        return (np.asarray(self.logprob)[:n], np.asarray(self.top_ids)[:n],
                np.asarray(self.top_logprobs)[:n])  # fmt: skip


class Engine:
    """A model served over one kvsched Scheduler.

    `model`, `params`: the model and its weights; `scheduler`: a Scheduler whose
    pool the engine's KV cache mirrors (Engine.create sizes one from the device).
    `backend`: the attention kernel (kvsched.engine.attention.BACKENDS).
    `kv_dtype`: the cache's ("float32", "bfloat16", "int8": int8 needs a passing
    `kv_eval` report, kvsched.engine.kv_gate). `temperature`, `seed`: the
    sampling of requests submitted to the scheduler directly, and the seed mixed
    with each request id where a request brings none. `mesh`: KV heads sharded
    over it (tensor parallelism). `tokenizer`: a tokenizers.Tokenizer (text in
    outputs, stop strings). `eos_token_ids`: stop tokens of every request
    (unless ignore_eos). `max_logprobs`: top-n logprobs computed each step
    (static; 0 = none). `kv_layout`: "split" ([.., 2*kv_heads, head_dim]),
    "packed" ([.., kv_heads, 2*head_dim]: the TPU kernel's layout for heads
    narrower than 128 lanes) or "auto" (packed for kvsched's Pallas kernel on TPU
    when head_dim is not a multiple of 128; split for JAX's kernel).
    `kv_groups`: "hybrid" (a model that mixes sliding-window and full-attention
    layers keeps each kind in its own KV-cache groups, a window group holding
    only what its window reads; kvsched.shapes.group_layers) or "uniform"
    (every layer's KV kept in full, one group: the baseline). The scheduler's
    kv_cache_groups must be the layout's (Engine.create sets them).
    `overlap` (on by default): step N + 1 is planned and dispatched while the
    device still runs step N, its decodes' input tokens taken from N's sampled
    array on the device; N is resolved after (see `step`)."""

    def __init__(
        self,
        model: LlamaConfig,
        params: Params,
        scheduler: kvsched.Scheduler,
        backend: str = "reference",
        kv_dtype: str = "float32",
        temperature: float = 0.0,
        seed: int = 0,
        *,
        sizing: PoolSizing | None = None,
        mesh: Mesh | None = None,
        tokenizer: Any = None,
        eos_token_ids: tuple[int, ...] = (),
        max_logprobs: int = 0,
        kv_eval: Any = None,
        kv_layout: str = "auto",
        kv_min_agreement: float = kv_gate.MIN_AGREEMENT,
        kv_max_logprob_diff: float = kv_gate.MAX_MEAN_ABS_LOGPROB_DIFF,
        kv_groups: str = "hybrid",
        overlap: bool = True,
    ) -> None:
        self.model, self.scheduler = model, scheduler
        self.backend, self.kv_dtype = backend, kv_dtype
        self.temperature, self.seed, self.sizing, self.mesh = temperature, seed, sizing, mesh
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.max_logprobs, self.kv_layout = max_logprobs, kv_layout
        _check_vocab(scheduler.config, model)
        self.kv_groups = kv_groups
        self.group_layout = kv_group_layout(model, kv_groups)
        if list(scheduler.config.kv_cache_groups) != list(self.group_layout.groups):
            raise kvsched.InvalidConfig(
                f"the scheduler's kv_cache_groups {scheduler.config.kv_cache_groups} are not "
                f"the model's {list(self.group_layout.groups)} (kv_groups={kv_groups!r}; "
                "Engine.create sets them)"
            )
        if kv_layout not in ("auto", "split", "packed"):
            raise ValueError(f"kv_layout must be auto, split or packed, not {kv_layout!r}")
        if not 0 <= max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}]")
        # The kernel the backend runs here (kvsched.InvalidConfig for an unknown
        # backend or KVSCHED_TPU_ATTENTION value): on TPU, `pallas` is kvsched's
        # kernel or JAX's.
        self.attention_kernel = resolve_backend(backend, head_dim=model.head_dim)
        packed = _packed_layout(kv_layout, self.attention_kernel, model.head_dim)
        # With more devices than KV heads each head is copied to the devices that
        # read it (sharding.kv_replicas): the program runs a model with that many
        # more KV heads. `model` stays the model as given (its name, its heads);
        # the checksum is of the weights as given.
        self.kv_replicas = 1 if mesh is None else sharding.check_divisible(model, mesh)
        self.checksum = weights_checksum(params)
        program_model, self.params = sharding.replicate_kv_heads(model, params, self.kv_replicas)
        cfg = scheduler.config
        self.spec = KVCacheSpec(cfg.num_blocks, cfg.block_size, program_model.n_kv_heads,
                                model.head_dim, jnp.dtype(kv_dtype), packed=packed)  # fmt: skip
        self.kv_eval = kv_eval
        if self.spec.quantized:
            self.kv_eval = _gate_quantized(self, kv_eval, kv_min_agreement, kv_max_logprob_diff)
        # A page holds one KV-cache group's layers: a slot per layer of a group.
        self.caches: KVCache = init_caches(self.spec, self.group_layout.layers_per_group)
        jit_kw: dict[str, Any] = {}
        if mesh is not None:
            self.params = sharding.shard_params(self.params, mesh)
            cs = sharding.cache_sharding(mesh)
            self.caches = jax.device_put(self.caches, cs)
            rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            jit_kw["out_shardings"] = (rep, cs)
        self._init_host(tokenizer, temperature, overlap)
        self._no_prev = jnp.zeros(scheduler.plan_shape["max_seqs"], jnp.int32)
        if mesh is not None:
            # Placed as the step's sampled tokens are (replicated), so that the
            # step compiles once whichever it is given.
            self._no_prev = jax.device_put(self._no_prev, rep)
        step = _step_function(program_model, backend, mesh, max_logprobs, self.group_layout)
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
        layout = kv_group_layout(model, kw.get("kv_groups", "hybrid"))
        sizing = size_pool(stored, sched_config, kv_dtype, device, shards=shards, devices=devices,
                           layers_per_block=layout.layers_per_group)  # fmt: skip
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
        changes: dict[str, Any] = {"num_blocks": sizing.num_blocks, "require_warmup": True,
                                   "kv_cache_groups": list(layout.groups)}  # fmt: skip
        if sched_config.vocab_size is None:
            # The core refuses ids outside the vocabulary too, whoever submits.
            changes["vocab_size"] = model.vocab_size
        if sizing.source == "measured":
            changes["overhead_reserve"] = 0.0  # held back from the measurement already
        sched = kvsched.Scheduler(sched_config.replace(**changes))
        return cls(model, params, sched, kv_dtype=kv_dtype, sizing=sizing, **kw)

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
        self.outputs.add(rid, params, prompt.tolist())
        return rid

    def cancel(self, request_id: int, *, now: float | None = None) -> RequestOutput | None:
        """Cancel a request; returns its final output (finish_reason "cancelled")
        when it was submitted through `submit` and was still running. Cancelling a
        request that has already ended (finished this step, handed back by a
        drain) is not an error: it returns None, and its ending was or will be
        reported by `step`. An id never issued raises kvsched.UnknownRequest."""
        if not self.scheduler.cancel(request_id, now=now):
            return None
        # Its terminal event, delivered later, finds no state and is skipped.
        return self.outputs.final(request_id, "cancelled")

    # -- running plans -----------------------------------------------------------------

    def run_plan(
        self, plan: kvsched.StepPlan, batch: SamplingBatch | None = None
    ) -> npt.NDArray[np.int32]:
        """The model on one plan: a sampled token per sequence (int32)."""
        return self._sample(plan, batch).tokens[: len(plan)]

    def _sample(self, plan: kvsched.StepPlan, batch: SamplingBatch | None = None) -> Sampled:
        """The jitted step on one plan, with each request's sampling (a plan
        of any scheduler: warmup's scratch one, a caller's: rows not kept)."""
        batch = batch or self._sampling_batch(plan, keep=False)
        return self._run(StepInputs.from_plan(plan), batch)

    def _init_host(self, tokenizer: Any, temperature: float, overlap: bool) -> None:
        """The host side's state (this engine's and the stand-in's)."""
        self.outputs = OutputProcessor(tokenizer)
        self._default = SamplingParams(temperature=temperature)
        self.overlap = overlap
        # The plan dispatched and not resolved yet (overlap); the stand-in for
        # a previous step's sampled tokens when there is none is set apart.
        self._inflight: _Launched | None = None
        self._kv_event_sink: Callable[[bytes], None] | None = None
        # Each live request's sampling row, made once (see `_sampling_batch`),
        # and how many may be kept (see `_ended`).
        self._sampling_rows = SamplingTable(self.scheduler.plan_shape["max_seqs"] + 64)
        self._sampling_rows_limit = 4 * self.scheduler.plan_shape["max_seqs"] + 64

    def _sampling_batch(self, plan: kvsched.StepPlan, *, keep: bool = True) -> SamplingBatch:
        """The plan's sampling arrays. `keep`: the plan is this engine's
        scheduler's, so each request's row is kept for its next plans (and
        forgotten when it ends: `_ended`)."""
        rids = plan.request_ids.tolist()

        def make_row(r: int) -> SamplingRow:
            # A request's first plan (or a request the core serves without
            # this engine's parameters: the engine's default).
            return sampling_row(self.outputs.params(r) or self._default, mix_seed(self.seed, r))

        positions, max_seqs = plan.kv_lens[: len(rids)], len(plan.kv_lens)
        if not keep:
            return SamplingBatch.from_rows([make_row(r) for r in rids], positions, max_seqs)
        return self._sampling_rows.batch(rids, positions, max_seqs, make_row)

    def _ended(self, request_ids: Iterable[int]) -> None:
        """Forget ended requests' sampling rows. Whatever may end without an
        event (a drain deadline) is bounded: past a few times the running
        limit, the rows are made again as plans need them."""
        for r in request_ids:
            self._sampling_rows.drop(r)
        if len(self._sampling_rows) > self._sampling_rows_limit:
            self._sampling_rows.clear()

    def _run(self, inputs: StepInputs[HostArray], batch: SamplingBatch) -> Sampled:
        """The jitted step on `inputs`: every row's sampled token, and the rest."""
        return self._dispatch(inputs, batch, self._no_prev).sampled()

    def _dispatch(
        self, inputs: StepInputs[HostArray], batch: SamplingBatch, prev: jax.Array
    ) -> _Outputs:
        """Dispatch the jitted step on `inputs` (asynchronously: its outputs
        are device arrays); a negative input token is read from `prev`, the
        previous step's sampled tokens (see Scheduler.advance)."""
        args = (*inputs.arrays(), *batch.arrays())
        out, self.caches = self._step(self.params, self.caches, prev, *args)
        return _Outputs(*out)

    def _unservable(self, plan: kvsched.StepPlan, finite: jax.Array) -> dict[int, str]:
        """Rows of the step just run that must not be committed, by request id:
        non-finite logits (the weights or the activations overflowed: sampling
        from them would return a plausible token computed from nothing), or an
        input token outside the vocabulary (possible only for a request submitted
        to `scheduler` directly: the embedding gather would clamp it silently)."""
        n, vocab = len(plan), self.model.vocab_size
        ok = np.asarray(finite)[:n]
        # A negative id is a placeholder the step took from the previous one's
        # sampled tokens (Scheduler.advance; the core refuses negative ids).
        toks = plan.token_ids[: plan.num_tokens]
        out_of_vocab = bool(toks.size) and bool(toks.max() >= vocab)
        if ok.all() and not out_of_vocab:
            return {}
        rids, cu = plan.request_ids.tolist(), plan.cu_q_lens
        bad: dict[int, str] = {}
        for i, rid in enumerate(rids):
            row = toks[cu[i] : cu[i + 1]]
            outside = row[row >= vocab]
            if outside.size:
                bad[rid] = (f"token id {int(outside[0])} is outside the vocabulary of {vocab} "
                            "(submitted to the scheduler without the engine's check?)")  # fmt: skip
            elif not ok[i]:
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
        """One scheduler step through the model; None when nothing ran and no
        request has an ending to report (requests the scheduler dropped
        without an event, at a drain deadline, come back once with plan None).

        Overlapped (the default): the next plan is planned and dispatched
        first, then the plan dispatched by the previous call is resolved and
        its outputs made while the device runs the new one; the result is that
        previous plan's (plan None on a call that only dispatched). A request a
        step ends (a stop token, a stop string) is known one step late: the
        token the next step computed for it is dropped. `overlap=False`: plan,
        run, commit, in that order, each call.

        Every ending is the core's: a row the engine cannot serve is ended in
        the core (`Scheduler.fail`, reason "error"), a stop string the output
        processor matched too (`Scheduler.stop`); the outputs follow the core's
        terminal events."""
        result = self._step_overlapped(now) if self.overlap else self._step_serial(now)
        if self._kv_event_sink is not None:
            batch = self.scheduler.drain_kv_events(time.time())
            if batch is not None:
                self._kv_event_sink(batch)
        return result

    def publish_kv_events(self, sink: Callable[[bytes], None] | None) -> None:
        """Hand the prefix cache's changes to `sink` once a step, as one
        batch in vLLM's KV-event format (`Scheduler.drain_kv_events`; a
        `kvsched.serve.kv_events.KvEventPublisher`'s `publish` sends them to
        routers). None stops handing them over (the core keeps recording,
        up to its bound)."""
        if sink is not None:
            self.scheduler.enable_kv_events()
        self._kv_event_sink = sink

    def _step_overlapped(self, now: float | None) -> StepResult | None:
        """`step` with overlap: dispatch the next plan, then resolve the previous one."""
        t0 = time.perf_counter()
        plan = self.scheduler.step(now=now)
        launched = None
        if plan is not None:
            prev = self._inflight.out.tokens if self._inflight is not None else self._no_prev
            t_dispatch = time.perf_counter()
            batch = self._sampling_batch(plan)
            launched = _Launched(plan, self._dispatch(StepInputs.from_plan(plan), batch, prev))
            launched.model_seconds = time.perf_counter() - t_dispatch
        previous, self._inflight = self._inflight, None
        result = None
        if previous is not None:
            result = self._finish(previous, now, t0)
        if launched is not None:
            self.scheduler.advance(launched.plan, now=now)
            self._inflight = launched
            if result is None:  # the first plan of a run: dispatched, nothing to report yet
                result = StepResult(None, _NO_EVENTS, time.perf_counter() - t0)
        return result if result is not None else self._endings_only(t0)

    def _endings_only(self, t0: float) -> StepResult | None:
        """A call that ran no plan: the endings delivered since (requests that
        ended with no token), or None when there are none."""
        finished = self.scheduler.take_finished()
        self._ended(f.request_id for f in finished)
        endings = self.outputs.endings(finished)
        if not endings:
            return None
        return StepResult(None, _NO_EVENTS, time.perf_counter() - t0, StepOutputs.empty(endings))

    def _finish(self, launched: _Launched, now: float | None, t0: float) -> StepResult:
        """Resolve a plan dispatched and advanced: wait for its tokens, end the
        rows it could not serve, give the core the tokens, make the outputs."""
        plan = launched.plan
        t_wait = time.perf_counter()
        sampled = launched.out.sampled()
        model_s = launched.model_seconds + time.perf_counter() - t_wait
        tokens = sampled.tokens[: len(plan)]
        errors = self._unservable(plan, sampled.finite)
        self._check_sampled(plan, tokens, skip=errors)
        for rid, why in list(errors.items()):
            try:
                self.scheduler.fail(rid, why, now=now)
            except kvsched.UnknownRequest:
                # Planned before an earlier step's resolve ended it (this engine
                # failed or stopped it): its row here is the dropped extra one.
                del errors[rid]
        events = self.scheduler.resolve(plan, tokens, now=now)
        outputs = self._outputs(plan, sampled, events, now)
        return StepResult(plan, events, time.perf_counter() - t0, outputs, model_s, errors)

    def _step_serial(self, now: float | None) -> StepResult | None:
        """`step` without overlap: plan, run, commit."""
        t0 = time.perf_counter()
        plan = self.scheduler.step(now=now)
        if plan is None:
            return self._endings_only(t0)
        t_model = time.perf_counter()
        sampled = self._sample(plan, self._sampling_batch(plan))
        t_model = time.perf_counter() - t_model
        tokens = sampled.tokens[: len(plan)]
        errors = self._unservable(plan, sampled.finite)
        self._check_sampled(plan, tokens, skip=errors)
        # The rows that cannot be served end here, before the commit (which then
        # drops their tokens and delivers their terminal events); the rest of the
        # batch is committed as usual.
        for rid, why in errors.items():
            self.scheduler.fail(rid, why, now=now)
        events = self.scheduler.commit(plan, tokens, now=now)
        outputs = self._outputs(plan, sampled, events, now)
        return StepResult(plan, events, time.perf_counter() - t0, outputs, t_model, errors)

    def _outputs(
        self,
        plan: kvsched.StepPlan,
        sampled: Sampled,
        events: kvsched.StepEvents,
        now: float | None,
    ) -> StepOutputs:
        """Each request's output of a committed (or resolved) step: its new
        text, stop strings (a match ends it in the core), logprobs, endings."""
        self._ended(f.request_id for f in events.finished)
        if not len(self.outputs):
            return StepOutputs.empty()
        outputs, stopped = self.outputs.process(
            events.request_ids, events.tokens, events.finished, _PlanRows(plan.request_ids),
            lambda: sampled.logprobs(len(plan)),
        )  # fmt: skip
        for rid in stopped:  # a stop string: finished, reason "stop"
            self.scheduler.stop(rid, now=now)
        self._ended(stopped)
        # Requests that ended with no token this step (cancel, drain, error).
        outputs.endings += self.outputs.endings(events.finished)
        return outputs

    compiles = True  # warmup compiles a program per token bucket (the stand-in: False)

    @property
    def seed(self) -> int:
        """The seed requests without one of their own draw from (mixed with each
        request's id). Setting it is `reseed`: the next step draws from it."""
        return self._seed

    @seed.setter
    def seed(self, seed: int) -> None:
        self._seed = seed
        # Each request's sampling row is made once and kept (its seed mixed in):
        # those made with the old seed go. (None while __init__ runs.)
        rows: SamplingTable | None = getattr(self, "_sampling_rows", None)
        if rows is not None:
            rows.clear()

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
        groups = self.group_layout.num_groups
        for t in buckets:
            # An all-padding plan of bucket t: nothing attends, every write drops.
            self._run(
                StepInputs.padding(t, s, pps, pad_slot, groups),
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
            sampled = self._sample(plan)
            if not np.asarray(sampled.finite)[: len(plan)].all():
                raise InvalidWeights(
                    "warmup: the model's logits are not finite (NaN or inf) for a plain "
                    "request: these weights cannot be served"
                )
            self._check_sampled(plan, sampled.tokens)
            scratch.commit(plan, sampled.tokens[: len(plan)], now=0.0)
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


def _check_vocab(cfg: kvsched.SchedulerConfig, model: LlamaConfig) -> None:
    if cfg.vocab_size not in (None, model.vocab_size):
        raise kvsched.InvalidConfig(
            f"the scheduler's vocab_size is {cfg.vocab_size}, the model's "
            f"{model.vocab_size}: they must agree (or leave vocab_size None)"
        )


def _packed_layout(kv_layout: str, kernel: str, head_dim: int) -> bool:
    """Whether the cache is stored packed ([.., kv_heads, 2*head_dim])."""
    packed = kv_layout == "packed" or (
        kv_layout == "auto" and kernel == "pallas" and jax.default_backend() == "tpu"
        and head_dim % 128 != 0
    )  # fmt: skip
    if packed and kernel == "jax_kernel":
        raise kvsched.InvalidConfig(
            "kv_layout='packed' with JAX's TPU kernel: it reads the split layout "
            "[.., 2*kv_heads, head_dim], and a packed cache would be relaid out on "
            "every layer of every step (use kv_layout='auto' or 'split')"
        )
    return packed


def _gate_quantized(engine: Engine, kv_eval: Any, min_agreement: float,
                    max_logprob_diff: float) -> Any:  # fmt: skip
    """The int8 KV gate (kvsched.engine.kv_gate): a passing KVEvalReport for these
    weights (given, or the one `kvsched eval-kv` saved), or "unchecked" (for the
    evaluation itself only). Raises where it does not pass."""
    if engine.backend != "reference":
        raise UnsupportedKVDtype(
            f"kv_dtype={engine.kv_dtype!r} is read by the reference backend only, "
            f"not {engine.backend!r}"
        )
    if isinstance(kv_eval, str) and kv_eval != "unchecked":
        raise ValueError(f"kv_eval: a KVEvalReport, None or 'unchecked', not {kv_eval!r}")
    if kv_eval == "unchecked":
        return kv_eval
    report = kv_eval or kv_gate.load_report(engine.checksum, engine.kv_dtype)
    return kv_gate.check_gate(report, kv_dtype=engine.kv_dtype, checksum=engine.checksum,
                              min_agreement=min_agreement,
                              max_mean_abs_logprob_diff=max_logprob_diff)  # fmt: skip


def kv_group_layout(model: LlamaConfig, kv_groups: str) -> KVGroupLayout:
    """The model's layers cut into KV-cache groups (kvsched.shapes.group_layers):
    `kv_groups` "hybrid" (a group per attention kind) or "uniform" (one full
    group, the baseline). A model of windowed layers only runs uniform."""
    if kv_groups not in ("hybrid", "uniform"):
        raise kvsched.InvalidConfig(f"kv_groups: 'hybrid' or 'uniform', not {kv_groups!r}")
    kinds = model.layer_kinds
    if kv_groups == "hybrid" and "full" not in kinds:
        raise kvsched.InvalidConfig(
            f"{model.name}: no full-attention layer, so no KV-cache group 0; "
            "run it with kv_groups='uniform'"
        )
    return group_layers(kinds, uniform=kv_groups == "uniform")


def _step_function(
    model: LlamaConfig,
    backend: str,
    mesh: Mesh | None,
    num_logprobs: int,
    layout: KVGroupLayout | None = None,
) -> Callable[..., tuple[tuple[jax.Array, ...], KVCache]]:
    """The step the engine jits: the model on a plan's arrays, then sampling.
    Flat at the jit boundary (StepInputs' arrays in field order, then the
    sampling arrays), named again inside: one compiled program per bucket
    either way, and the traced step can be lowered from plain arrays."""
    n_inputs = StepInputs.num_arrays()

    def step(
        params: Params, caches: KVCache, prev: jax.Array, *arrays: jax.Array
    ) -> tuple[tuple[jax.Array, ...], KVCache]:
        inputs = StepInputs(*arrays[:n_inputs])
        # Overlapped scheduling: a negative input token is the one the previous
        # step sampled at row -t - 1, still on the device (Scheduler.advance).
        ids = inputs.token_ids
        ids = jnp.where(ids < 0, prev[jnp.maximum(-ids - 1, 0)], ids)
        inputs = dataclasses.replace(inputs, token_ids=ids)
        logits, caches = forward_paged(
            params, caches, model, inputs.token_ids, inputs.positions, inputs.slot_mapping,
            inputs.attention, inputs.logits_indices, backend=backend, mesh=mesh,
            kv_layout=layout,
        )  # fmt: skip
        out = sample(logits, *arrays[n_inputs:], num_logprobs=num_logprobs)
        # Per row: are its logits finite? A NaN or inf would be sampled as if it
        # were a distribution (argmax of NaN is some id), so the host ends such a
        # row instead of committing its token.
        finite = jnp.all(jnp.isfinite(logits), axis=-1)
        return (*out, finite), caches

    return step
