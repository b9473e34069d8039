"""A stand-in model for load tests: the real engine loop over a device that
only costs time.

`SimulatedEngine` is an `Engine` (the real scheduler, the real sampling
batches, output processing, detokenization, stop strings and overlapped
scheduling) whose jitted model step is replaced by `SimulatedDevice`: a
timeline of steps run in order, each for its step time, that hands back
plausible tokens. Dispatch returns at once; the step's outputs are
`DeviceArray`s that block when converted (`np.asarray`) until the step is
over, sleeping (`time.sleep` releases the GIL, as a host blocked on an
accelerator leaves its core alone), as a jax array does. So overlap behaves
as on a device: the host plans step N + 1 while N runs and blocks at N's
resolve.

- **Step time**: fixed seconds, or a `kvsched.sim.StepCost` (a preset such as
  `StepCost.preset("llama-3-8b", "h100")`, or a calibrated file) that charges
  each plan by its real tokens and KV lengths, as the simulator does; or any
  callable `(tokens, kv_lens, q_lens) -> seconds`.
- **Tokens**: a walk through a real text's token ids (`CORPUS`, tokenized by
  the engine's tokenizer): each row's next token follows one occurrence of its
  last input token in the text, chosen by a hash of the position (greedy
  rows) or of the request's seed and the position (sampled rows). So tokens
  are deterministic, read as text, differ between seeds, and are the same
  whichever batch a request runs in, with overlap on or off, and after a
  preemption. A negative input id is a placeholder (`Scheduler.advance`)
  resolved from the previous step's sampled tokens, as the jitted step does.
  `eos_rate`: the chance each token is the first of `eos_token_ids` (0: never;
  requests then end at max_tokens, a stop token or a stop string). Logprobs
  are fake but well formed (the chosen token first, the top-n best first).
- **Measurements** (`SimulatedDevice.stats()`): the device's busy seconds and
  steps, the host's seconds blocked waiting for a step, and the device's own
  clock, from which the device's idle share and the host's time per step
  follow (`benches/overlap.py`); `SimulatedDeviceCollector` exports them to
  Prometheus (`kvsched serve --model simulated` registers it).

`simulated_engine(sched_config, ...)` builds one over a cold scheduler;
`smollm2_tokenizer()` reads SmolLM2-135M-Instruct's tokenizer and chat template
from its GGUF file, without the weights.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

import kvsched
from kvsched.engine.inputs import HostArray, StepInputs
from kvsched.engine.model_config import LlamaConfig
from kvsched.engine.runner import Engine, _Outputs, kv_group_layout
from kvsched.engine.sampling import GREEDY_EPS, SamplingBatch

__all__ = [
    "CORPUS",
    "DeviceArray",
    "SimulatedDevice",
    "SimulatedDeviceCollector",
    "SimulatedEngine",
    "SimulatedTokenizer",
    "TokenWalk",
    "simulated_engine",
    "smollm2_tokenizer",
]

CORPUS = """\
The harbor wakes before the town does. At five the first boats leave the inner \
basin, their engines low and steady, and the gulls follow them out past the \
breakwater where the water turns from green to grey. By six the fish market has \
its lights on, and the men who work there drink their coffee standing up, \
talking about the weather, the price of diesel and the football.

In the old quarter the streets are narrow and steep. Most of the houses were \
built of the same yellow stone, and in the evening light they look warm even in \
winter. A baker on the corner sells bread until noon and then closes, because, \
he says, anyone who wants bread after noon should have come before it. Children \
run down to the beach after school, and their parents call them back when the \
wind comes up from the south.

Every summer a festival fills the square with music. There are long tables under \
strings of lamps, and people who have not spoken all year sit side by side and \
share their food. The older women remember when the square was a market for \
cattle, and the younger ones do not quite believe them. Late at night the band \
plays the slow songs that everyone knows, and for an hour the town sounds like \
one voice.

The lighthouse on the point has not had a keeper for thirty years. Its lamp \
turns by itself now, checked once a month by an engineer who drives up from the \
city with a thermos and a radio. He likes the quiet. From the gallery he can see \
the whole coast, the ferries crossing to the islands, and on a clear day the \
mountains on the far side of the bay, blue and small, like something drawn on \
the edge of a map.

When the storms come in November the boats stay in, and the harbor is full of \
masts knocking together in the wind. Nobody goes far. The cafes stay open late, \
the windows steam up, and the talk turns to other winters, worse ones, and to \
the people who went away and the few who came back.
"""
"""The text the stand-in's tokens walk through (original prose, in paragraphs)."""

StepTime = float | Any  # seconds, a kvsched.sim.StepCost, or (tokens, kv_lens, q_lens) -> s
_U64 = np.uint64


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finalizer, elementwise (uint64 arithmetic wraps)."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return cast("npt.NDArray[np.uint64]", x ^ (x >> _U64(31)))


def _unit(h: npt.NDArray[np.uint64]) -> npt.NDArray[np.float64]:
    """A hash as a float in [0, 1)."""
    return (h >> _U64(11)).astype(np.float64) * 2.0**-53


class TokenWalk:
    """The stand-in's next-token function (see the module): a walk through
    `corpus` (token ids), vectorized over a step's rows."""

    def __init__(
        self,
        corpus: Sequence[int] | npt.NDArray[np.integer[Any]],
        vocab_size: int,
        *,
        eos_token_id: int | None = None,
        eos_rate: float = 0.0,
    ) -> None:
        ids = np.asarray(corpus, dtype=np.int64)
        if ids.ndim != 1 or ids.size < 2:
            raise ValueError("corpus: at least two token ids")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"corpus: token ids must lie in [0, {vocab_size})")
        if not 0.0 <= eos_rate <= 1.0:
            raise ValueError(f"eos_rate must be in [0, 1], got {eos_rate}")
        if eos_rate > 0 and eos_token_id is None:
            raise ValueError("eos_rate > 0 needs an end-of-text token (eos_token_ids)")
        self.corpus = ids.astype(np.int32)
        self.vocab_size = vocab_size
        self.eos_token_id, self.eos_rate = eos_token_id, eos_rate
        self._order = np.argsort(ids, kind="stable")
        self._sorted = ids[self._order]

    def next_tokens(
        self,
        last: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        seeds: npt.NDArray[np.uint64],
        greedy: npt.NDArray[np.bool_],
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.uint64]]:
        """Each row's token after `last` at `positions` (where the sampled
        token goes), and the hash it was drawn with (for its logprobs)."""
        pos = _mix(positions.astype(np.uint64))
        h = np.where(greedy, pos, _mix(seeds ^ pos))
        n = self.corpus.size
        lo = np.searchsorted(self._sorted, last, "left")
        count = np.searchsorted(self._sorted, last, "right") - lo
        pick = lo + (h % np.maximum(count, 1).astype(np.uint64)).astype(np.int64)
        at = self._order[np.minimum(pick, n - 1)]
        jump = (h % _U64(n)).astype(np.int64)  # a token the text lacks: anywhere in it
        tokens = self.corpus[np.where(count > 0, (at + 1) % n, jump)]
        if self.eos_rate > 0 and self.eos_token_id is not None:
            tokens = np.where(_unit(_mix(h ^ _U64(0xE05))) < self.eos_rate,
                              np.int32(self.eos_token_id), tokens)  # fmt: skip
        return tokens.astype(np.int32), h

    def logprobs(
        self, tokens: npt.NDArray[np.int32], h: npt.NDArray[np.uint64], top_n: int
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        """Fake logprobs: the chosen token's in (-2.05, -0.05], and a top-n led
        by it, distinct ids, best first."""
        lp = (-0.05 - 2.0 * _unit(_mix(h ^ _U64(0x10B)))).astype(np.float32)
        k = np.arange(top_n, dtype=np.int64)
        ids = ((tokens.astype(np.int64)[:, None] + 7919 * k) % self.vocab_size).astype(np.int32)
        top = (lp[:, None] - 0.75 * k).astype(np.float32)
        return lp, ids, top


def _step_seconds(step_time: StepTime) -> Callable[[int, HostArray, HostArray], float]:
    if isinstance(step_time, int | float):
        if not step_time >= 0:
            raise ValueError(f"step_time: seconds >= 0, not {step_time!r}")
        fixed = float(step_time)
        return lambda _tokens, _kv, _q: fixed
    if hasattr(step_time, "seconds") and hasattr(step_time, "kv_tokens_read"):
        cost = step_time  # a kvsched.sim.StepCost: the simulator's charge for a plan

        def charge(tokens: int, kv: HostArray, q: HostArray) -> float:
            return float(cost.seconds(tokens, cost.kv_tokens_read(kv, q)))

        return charge
    if callable(step_time):
        return cast("Callable[[int, HostArray, HostArray], float]", step_time)
    raise TypeError(f"step_time: seconds, a StepCost or a callable, not {step_time!r}")


def describe_step_time(step_time: StepTime) -> str:
    """How a step time reads in a log line."""
    if isinstance(step_time, int | float):
        return f"{step_time * 1000:g} ms a step"
    model = getattr(getattr(step_time, "model", None), "name", None)
    acc = getattr(getattr(step_time, "accelerator", None), "name", None)
    if model and acc:
        return f"the step cost of {model} on {acc}, charged per plan"
    return "a step-time function"


# -- the device ---------------------------------------------------------------------


@dataclass
class _Job:
    """One dispatched step, as the device needs it (copied at dispatch: the
    plan's arrays are the scheduler's buffers, reused two steps later)."""

    n: int  # real rows
    last: npt.NDArray[np.int64]  # each row's last input token; negative: a placeholder
    positions: npt.NDArray[np.int64]  # where each row's sampled token goes
    seeds: npt.NDArray[np.uint64]
    greedy: npt.NDArray[np.bool_]
    logprobs: bool  # some row asked for top-n logprobs
    prev: Any  # the previous step's sampled tokens (a DeviceArray) or a host array


class _Pending:
    """A dispatched step: when the device's timeline finishes it (`end`,
    time.perf_counter()), and its outputs once read."""

    __slots__ = ("device", "end", "job", "lock", "result")

    def __init__(self, device: SimulatedDevice, end: float, job: _Job) -> None:
        self.device, self.end = device, end
        self.job: _Job | None = job  # dropped once its outputs are made
        self.lock = threading.Lock()
        self.result: tuple[npt.NDArray[Any], ...] | None = None

    def ready(self) -> bool:
        return time.perf_counter() >= self.end

    def wait(self) -> tuple[npt.NDArray[Any], ...]:
        """The outputs, blocking (the GIL released) until the step is over on
        the device's timeline; the host's wait is counted, and so is the
        making of the tokens (the device's work, not the host's)."""
        if self.result is not None:
            return self.result
        t0 = time.perf_counter()
        out = self.outputs()
        self.device._count_wait(time.perf_counter() - t0)
        return out

    def outputs(self) -> tuple[npt.NDArray[Any], ...]:
        """Sleep until the step's end, then make its outputs (once)."""
        with self.lock:
            if self.result is None:
                left = self.end - time.perf_counter()
                if left > 0:
                    time.sleep(left)
                assert self.job is not None
                self.result, self.job = self.device._compute(self.job), None
            return self.result


class DeviceArray:
    """One output of a dispatched step (tokens, logprobs, ...): `np.asarray`
    blocks until the device has run the step, as a jax array does."""

    __slots__ = ("_index", "_pending", "dtype", "shape")

    def __init__(self, pending: _Pending, index: int, shape: tuple[int, ...], dtype: Any) -> None:
        self._pending, self._index = pending, index
        self.shape, self.dtype = shape, np.dtype(dtype)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> npt.NDArray[Any]:
        a = self._pending.wait()[self._index]
        return a if dtype is None else a.astype(dtype)

    def is_ready(self) -> bool:
        return self._pending.ready()

    def block_until_ready(self) -> DeviceArray:
        self._pending.wait()
        return self

    def _value(self) -> npt.NDArray[Any]:
        """For the next step's placeholders: the value, its wait counted by
        the caller's."""
        return self._pending.outputs()[self._index]


class SimulatedDevice:
    """A device that runs dispatched steps in order, each for its step time.

    Its timeline is kept in time.perf_counter() seconds: a step dispatched
    while the device is busy starts when the one before it ends, one
    dispatched to an idle device starts at once, and each lasts its step
    time. The host that converts a step's output sleeps until the step's end
    (the GIL released, as a host blocked on an accelerator), then makes the
    step's tokens (a few numpy operations, counted as the device's work).
    No thread of its own: the timeline says what the device would do, where
    a thread sleeping through each step would finish late whenever the
    host's Python held the GIL (up to sys.getswitchinterval(), 5 ms, a step),
    count that lateness as device time, and add a GIL handoff to every
    step. `max_seqs`, `max_logprobs`: the outputs' shapes."""

    def __init__(
        self,
        walk: TokenWalk,
        step_time: StepTime,
        max_seqs: int,
        max_logprobs: int = 0,
    ) -> None:
        self.walk = walk
        self.step_time = step_time
        self._seconds = _step_seconds(step_time)
        self.max_seqs, self.max_logprobs = max_seqs, max_logprobs
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        # (start, end) of the steps not yet over; those over are summed.
        self._timeline: deque[tuple[float, float]] = deque()
        self._last_end = self._t0
        self._busy_done = 0.0
        self._steps_done = 0
        self.host_wait_s = 0.0  # host seconds blocked on a step's outputs
        self.dispatched = 0

    def stats(self) -> dict[str, float]:
        """`clock_s` (the device's clock: seconds since it started), `busy_s`
        (seconds of steps run, the one running included), `steps` (steps
        over), `host_wait_s` (seconds the host blocked on the device); the
        differences between two reads give the device's idle share, 1 - busy
        / clock, and the host's seconds per step, (clock - host_wait) / steps,
        over that window."""
        with self._lock:
            now = time.perf_counter()
            line = self._timeline
            while line and line[0][1] <= now:
                start, end = line.popleft()
                self._busy_done += end - start
                self._steps_done += 1
            busy = self._busy_done + (max(0.0, now - line[0][0]) if line else 0.0)
            return {"clock_s": now - self._t0, "busy_s": busy, "steps": float(self._steps_done),
                    "host_wait_s": self.host_wait_s}  # fmt: skip

    def _count_wait(self, seconds: float) -> None:
        with self._lock:
            self.host_wait_s += seconds

    def dispatch(
        self, inputs: StepInputs[HostArray], batch: SamplingBatch, prev: Any
    ) -> tuple[DeviceArray, ...]:
        """Put one step on the timeline; its outputs (tokens, logprob, top_ids,
        top_logprobs, finite), each blocking when converted until the step
        is over."""
        n = int(inputs.num_seqs[0])
        cu = inputs.cu_q_lens
        seconds = self._seconds(int(cu[n]), inputs.kv_lens[:n], np.diff(cu[: n + 1]))
        rows = inputs.logits_indices[:n]
        job = _Job(
            n=n, last=inputs.token_ids[rows].astype(np.int64),
            positions=batch.positions[:n].astype(np.int64),
            seeds=(batch.seeds[:n, 0].astype(np.uint64) << _U64(32)) | batch.seeds[:n, 1],
            greedy=(batch.temperature[:n] < GREEDY_EPS) | (batch.top_k[:n] == 1),
            logprobs=batch.max_logprobs > 0, prev=prev,
        )  # fmt: skip
        with self._lock:
            now = time.perf_counter()
            start = max(now, self._last_end)
            self._last_end = end = start + seconds
            self._timeline.append((start, end))
            self.dispatched += 1
        pending = _Pending(self, end, job)
        s, k = self.max_seqs, self.max_logprobs
        shapes = (((s,), np.int32), ((s,), np.float32), ((s, k), np.int32),
                  ((s, k), np.float32), ((s,), np.bool_))  # fmt: skip
        return tuple(DeviceArray(pending, i, sh, dt) for i, (sh, dt) in enumerate(shapes))

    def _compute(self, job: _Job) -> tuple[npt.NDArray[Any], ...]:
        s, k = self.max_seqs, self.max_logprobs
        last = job.last
        if last.size and last.min() < 0:
            # A placeholder: the token the previous step sampled at row -t - 1,
            # read from its outputs here, as the jitted step reads `prev`.
            prev = job.prev._value() if isinstance(job.prev, DeviceArray) else job.prev
            prev = np.asarray(prev)
            at = np.clip(-last - 1, 0, prev.shape[0] - 1)
            last = np.where(last < 0, prev[at], last)
        tokens = np.zeros(s, np.int32)
        logprob = np.zeros(s, np.float32)
        top_ids = np.zeros((s, k), np.int32)
        top_lp = np.zeros((s, k), np.float32)
        n = job.n
        if n:
            toks, h = self.walk.next_tokens(last, job.positions, job.seeds, job.greedy)
            tokens[:n] = toks
            # The chosen token's logprob always (logprobs=0 asks for it alone),
            # the top-n where a row asked for them.
            lp, ids, top = self.walk.logprobs(toks, h, k if job.logprobs else 0)
            logprob[:n] = lp
            if job.logprobs:
                top_ids[:n], top_lp[:n] = ids, top
        return tokens, logprob, top_ids, top_lp, np.ones(s, np.bool_)


# -- the engine ---------------------------------------------------------------------


class SimulatedEngine(Engine):
    """An `Engine` over `SimulatedDevice` (see the module): the same `submit`,
    `cancel`, `step`, `warmup` and outputs, for load tests of what runs
    around a model. `scheduler`: a Scheduler (its vocab_size, if set, must be
    the tokenizer's); `step_time`: seconds, a kvsched.sim.StepCost or a
    callable `(tokens, kv_lens, q_lens) -> seconds`; `corpus`: the text (or
    token ids) the tokens walk through (default `CORPUS`; a tokenizer is
    needed for text); `eos_rate`: the chance each token is the end of text.
    The rest as Engine's. `device.stats()` has the measurements."""

    def __init__(
        self,
        scheduler: kvsched.Scheduler,
        step_time: StepTime = 0.01,
        *,
        tokenizer: Any = None,
        eos_token_ids: tuple[int, ...] = (),
        eos_rate: float = 0.0,
        corpus: str | Sequence[int] | None = None,
        max_logprobs: int = 5,
        temperature: float = 0.0,
        seed: int = 0,
        overlap: bool = True,
        model: LlamaConfig | None = None,
        name: str = "simulated",
    ) -> None:
        cfg = scheduler.config
        vocab = cfg.vocab_size
        if vocab is None:
            vocab = tokenizer.get_vocab_size() if tokenizer is not None else 32768
        if model is None:
            model = LlamaConfig(vocab_size=vocab, name=name)
        if model.vocab_size != vocab:
            raise kvsched.InvalidConfig(
                f"the scheduler's vocab_size is {vocab}, the model's {model.vocab_size}"
            )
        if tokenizer is not None and tokenizer.get_vocab_size() > vocab:
            raise kvsched.InvalidConfig(
                f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the vocabulary {vocab}"
            )
        # What Engine.__init__ sets, for a device that holds no weights and no
        # KV cache (tests/test_simulated.py checks nothing is left out).
        self.model, self.scheduler = model, scheduler
        self.backend, self.kv_dtype = "simulated", "float32"
        self.temperature, self.seed, self.sizing, self.mesh = temperature, seed, None, None
        self.tokenizer, self.eos_token_ids = tokenizer, tuple(eos_token_ids)
        self.max_logprobs, self.kv_layout = max_logprobs, "split"
        self.kv_groups = "hybrid"
        self.group_layout = kv_group_layout(model, self.kv_groups)
        if list(cfg.kv_cache_groups) != list(self.group_layout.groups):
            raise kvsched.InvalidConfig(
                f"the scheduler's kv_cache_groups {cfg.kv_cache_groups}: the stand-in "
                f"runs {list(self.group_layout.groups)}"
            )
        self.attention_kernel = "simulated"
        self.kv_replicas = 1
        self.params = cast(Any, {})
        self.kv_eval = None
        self._init_host(tokenizer, temperature, overlap)
        max_seqs = scheduler.plan_shape["max_seqs"]
        self._no_prev = cast(Any, np.zeros(max_seqs, np.int32))
        ids = _corpus_ids(corpus, tokenizer, vocab, seed)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        walk = TokenWalk(ids, vocab, eos_token_id=eos, eos_rate=eos_rate)
        self.step_time, self.eos_rate = step_time, eos_rate
        self.device = SimulatedDevice(walk, step_time, max_seqs, max_logprobs)
        digest = hashlib.sha256(ids.tobytes())
        digest.update(f"{describe_step_time(step_time)}|{eos_rate}|{eos}".encode())
        self.checksum = "sim-" + digest.hexdigest()[:12]

    def _dispatch(self, inputs: StepInputs[HostArray], batch: SamplingBatch, prev: Any) -> _Outputs:
        return _Outputs(*cast(Any, self.device.dispatch(inputs, batch, prev)))

    compiles = False  # its warmup is one step through the device (see `warmup`)

    def compiled_programs(self) -> int:
        """No programs: the stand-in compiles nothing."""
        return 0

    def warmup(self, *, progress: bool | Callable[[int, int, str], None] = True) -> float:
        """No programs to compile: one padding step through the device (so a
        broken device fails here), then the scheduler is ready. `progress`
        (a callback) hears of that one part."""
        t0 = time.perf_counter()
        if self.scheduler.lifecycle == "cold":
            self.scheduler.begin_warmup()
        shape = self.scheduler.plan_shape
        s = shape["max_seqs"]
        pad = StepInputs.padding(self.scheduler.token_buckets[0], s, shape["pages_per_seq"],
                                 shape["pad_slot"], self.group_layout.num_groups)  # fmt: skip
        self._run(pad, SamplingBatch.build([], np.zeros(0, np.int32), s, []))
        if callable(progress):
            progress(1, 1, "the simulated device ran a step")
        self.scheduler.mark_ready()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Nothing to release (no thread, no device memory): for code written
        against a real device's engine."""


def _corpus_ids(
    corpus: str | Sequence[int] | None, tokenizer: Any, vocab: int, seed: int
) -> npt.NDArray[np.int32]:
    if corpus is None and tokenizer is None:
        # No text to walk: a fixed pseudo-text of ids.
        rng = np.random.default_rng(seed)
        return rng.integers(min(256, vocab - 1), vocab, 2048).astype(np.int32)
    if corpus is None or isinstance(corpus, str):
        if tokenizer is None:
            raise ValueError("corpus: a text needs a tokenizer (or give token ids)")
        text = CORPUS if corpus is None else corpus
        ids = tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return np.asarray(ids, np.int32)
    return np.asarray(corpus, np.int32)


def simulated_engine(
    sched_config: kvsched.SchedulerConfig, step_time: StepTime = 0.01, **kw: Any
) -> SimulatedEngine:
    """A SimulatedEngine over a new cold scheduler of `sched_config` (its
    vocab_size set from the tokenizer or `model` where it is None); keyword
    arguments as SimulatedEngine's."""
    changes: dict[str, Any] = {"require_warmup": True}
    if sched_config.vocab_size is None:
        model, tok = kw.get("model"), kw.get("tokenizer")
        if model is not None:
            changes["vocab_size"] = model.vocab_size
        elif tok is not None:
            changes["vocab_size"] = tok.get_vocab_size()
    sched = kvsched.Scheduler(sched_config.replace(**changes))
    return SimulatedEngine(sched, step_time, **kw)


# -- the tokenizer ------------------------------------------------------------------


@dataclass
class SimulatedTokenizer:
    """A real model's tokenizer, chat template and end of text, for the stand-in."""

    tokenizer: Any  # tokenizers.Tokenizer
    encode_chat: Callable[..., list[int]] | None
    eos_token_ids: tuple[int, ...]
    model: LlamaConfig  # its shapes (the vocabulary), named "simulated"


@functools.cache
def smollm2_tokenizer(name: str = "simulated") -> SimulatedTokenizer:
    """SmolLM2-135M-Instruct's tokenizer, chat template and end-of-text token,
    read from its GGUF file (fetched once into the cache, kvsched.model_files)
    without loading the weights; read once a process."""
    import dataclasses

    from kvsched import model_files
    from kvsched.engine.loaders.gguf_file import gguf_model, open_gguf
    from kvsched.engine.loaders.gguf_llama import config_from_gguf, load_gguf_tokenizer

    reader = open_gguf(model_files.fetch())
    config = dataclasses.replace(config_from_gguf(reader), name=name)
    tokenizer, special = load_gguf_tokenizer(reader)
    gg = gguf_model(reader, config, cast(Any, {}), tokenizer, special)
    eos = () if gg.eos_token_id is None else (gg.eos_token_id,)
    return SimulatedTokenizer(tokenizer, gg.encode_chat if gg.chat_template else None, eos,
                              config)  # fmt: skip


# -- metrics ------------------------------------------------------------------------


class SimulatedDeviceCollector:
    """Prometheus: the stand-in device's clock, busy seconds and steps, and the
    host's seconds blocked on it (`kvsched_sim_*`; see SimulatedDevice.stats)."""

    def __init__(self, device: SimulatedDevice) -> None:
        self._device = device

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self._device.stats()
        yield CounterMetricFamily("kvsched_sim_device_clock_seconds",
                                  "Seconds since the simulated device started.",
                                  value=st["clock_s"])  # fmt: skip
        yield CounterMetricFamily("kvsched_sim_device_busy_seconds",
                                  "Seconds the simulated device spent running steps.",
                                  value=st["busy_s"])  # fmt: skip
        yield CounterMetricFamily("kvsched_sim_device_steps", "Steps the simulated device ran.",
                                  value=st["steps"])  # fmt: skip
        yield CounterMetricFamily("kvsched_sim_host_wait_seconds",
                                  "Seconds the engine loop spent blocked on the device.",
                                  value=st["host_wait_s"])  # fmt: skip
        fixed = self._device.step_time
        if isinstance(fixed, int | float):
            yield GaugeMetricFamily("kvsched_sim_device_step_time_seconds",
                                    "The simulated device's fixed step time.",
                                    value=float(fixed))  # fmt: skip
