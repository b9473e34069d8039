"""What each request produced, step by step: the output processor.

`OutputProcessor` keeps the per-request state of the requests an `Engine`
serves (their sampling parameters, prompt length, incremental detokenizer and
stop-string matcher) and turns each commit's tokens into `RequestOutput`s: new
token ids, new text (never a broken UTF-8 character), logprobs, and the ending.
It decides nothing about scheduling: a stop string it matches is returned to the
engine, which ends the request in the core (`Scheduler.stop`); every other
ending comes from the core's terminal events (`FinishedRequest`), so there is
one place a request ends and one vocabulary for how (`kvsched.FinishReason`).

Plain numpy and the tokenizer: no JAX, so it is tested without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import numpy.typing as npt

import kvsched
from kvsched.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvsched.engine.token_bytes import text_streams

if TYPE_CHECKING:
    from kvsched.engine.sampling import SamplingParams


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
    `finish_reason` (kvsched.FinishReason): "stop" (a stop token or stop string),
    "length" (max_tokens), "cancelled", "drain_deadline", "shed" (displaced
    before it finished by a higher tier's request that a global limit would have
    refused; `retry_after` says when a retry makes sense), or "error": the
    engine could not serve it (its logits were not finite, or it carried a
    token id outside the vocabulary), said in `error`; the other requests of the
    step run on."""

    request_id: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool = False
    finish_reason: kvsched.FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None  # why, when finish_reason is "error"
    retry_after: float | None = None  # seconds, when finish_reason is "shed"


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One request's two consecutive outputs as one: `a`'s tokens, text and
    logprobs followed by `b`'s, and `b`'s ending and counts (a stream that
    reads several outputs at once hands them on in one event)."""
    logprobs = None if a.logprobs is None and b.logprobs is None else [
        *(a.logprobs or ()), *(b.logprobs or ())]  # fmt: skip
    return RequestOutput(a.request_id, [*a.token_ids, *b.token_ids], a.text + b.text, logprobs,
                         b.finished, b.finish_reason, b.prompt_tokens, b.completion_tokens,
                         b.error, b.retry_after)  # fmt: skip


@dataclass
class RequestState:
    """The processor's state of one request (its counters live in the
    processor's arrays, at `slot`)."""

    params: SamplingParams
    slot: int
    detok: IncrementalDetokenizer | None
    stops: StopStringMatcher | None


# The sampler's logprob outputs for a step's rows, on the host: the chosen
# token's logprob [rows], the top ids [rows, n] and their logprobs [rows, n].
Logprobs = tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]


class StepOutputs(Sequence[RequestOutput]):
    """One step's outputs, held as columns: row `i` is request
    `request_ids[i]` getting token `token_ids[i]` and `texts[i]`; then
    `endings`, the requests that ended with no token (cancels, drain
    deadlines, errors, displacement).

    A server that handles a step as a whole reads the columns (`finished`,
    `num_tokens`, `finished_ids()`), which cost no Python object per row. As
    a sequence it is the step's `RequestOutput`s, token rows first, each made
    when first read."""

    __slots__ = ("_built", "_ends", "_logprobs", "completion_tokens", "endings", "finished",
                 "prompt_tokens", "request_ids", "texts", "token_ids")  # fmt: skip

    def __init__(
        self,
        request_ids: npt.NDArray[np.int64],
        token_ids: npt.NDArray[np.int64],
        texts: list[str],
        prompt_tokens: npt.NDArray[np.int64],
        completion_tokens: npt.NDArray[np.int64],
        finished: npt.NDArray[np.bool_],
        ends: dict[int, tuple[kvsched.FinishReason, str | None, float | None]],
        logprobs: dict[int, list[TokenLogprob]],
        endings: list[RequestOutput],
    ) -> None:
        self.request_ids, self.token_ids, self.texts = request_ids, token_ids, texts
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens
        self.finished = finished  # [rows] bool: the row's token was its last
        self._ends = ends  # row -> (finish reason, error, retry_after)
        self._logprobs = logprobs  # row -> the token's logprobs, for rows that asked
        self.endings = endings
        self._built: list[RequestOutput] | None = None

    @classmethod
    def empty(cls, endings: list[RequestOutput] | None = None) -> StepOutputs:
        """No token rows: only `endings` (none by default)."""
        none = np.zeros(0, np.int64)
        return cls(none, none, [], none, none, np.zeros(0, bool), {}, {}, endings or [])

    @property
    def num_tokens(self) -> int:
        """Tokens this step gave (one per row)."""
        return len(self.texts)

    def finished_ids(self) -> list[int]:
        """The requests that ended this step, with a token or without."""
        ids: list[int] = self.request_ids[self.finished].tolist()
        return ids + [o.request_id for o in self.endings]

    def finish_reason(self, row: int) -> kvsched.FinishReason | None:
        """Row `row`'s finish reason (None: it goes on)."""
        end = self._ends.get(row)
        return None if end is None else end[0]

    def _build(self) -> list[RequestOutput]:
        if self._built is None:
            outs = []
            rows = zip(self.request_ids.tolist(), self.token_ids.tolist(), self.texts,
                       self.prompt_tokens.tolist(), self.completion_tokens.tolist(),
                       strict=True)  # fmt: skip
            for i, (rid, tok, text, prompt, done) in enumerate(rows):
                out = RequestOutput(rid, [tok], text, self._logprobs.get(i), False, None, prompt,
                                    done)  # fmt: skip
                end = self._ends.get(i)
                if end is not None:
                    out.finished = True
                    out.finish_reason, out.error, out.retry_after = end
                outs.append(out)
            self._built = outs
        return self._built + self.endings if self.endings else self._built

    def __len__(self) -> int:
        return len(self.texts) + len(self.endings)

    @overload
    def __getitem__(self, i: int) -> RequestOutput: ...
    @overload
    def __getitem__(self, i: slice) -> list[RequestOutput]: ...
    def __getitem__(self, i: int | slice) -> RequestOutput | list[RequestOutput]:
        return self._build()[i]

    def __iter__(self) -> Iterator[RequestOutput]:
        return iter(self._build())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepOutputs | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepOutputs({len(self.texts)} token rows, {len(self.endings)} endings)"


class OutputProcessor:
    """Per-request detokenization, stop strings, logprobs and endings (see the
    module). `tokenizer`: a tokenizers.Tokenizer, or None (outputs then carry
    token ids and no text).

    A step costs a dictionary lookup per row, array operations, and the
    core's text push (`TextStreams`); Python per row only for rows that ask
    for logprobs, that end, or (with `native_text=False`) for the text."""

    def __init__(self, tokenizer: Any = None, *, native_text: bool = True) -> None:
        self.tokenizer = tokenizer
        self._states: dict[int, RequestState] = {}
        # Each served request's counters, at its slot (freed slots are reused).
        self._slot: dict[int, int] = {}
        self._free: list[int] = []
        self._generated = np.zeros(64, np.int64)
        self._prompt_len = np.zeros(64, np.int64)
        self._top_n = np.full(64, -1, np.int64)  # the logprobs it asked for; -1: none
        # The core's text streams (every row's text and stop strings in one
        # call a step) where the tokenizer decodes as its tokens' bytes joined
        # (kvsched.engine.token_bytes); else a Python detokenizer per request.
        self._streams: kvsched._core.TextStreams | None = None
        if tokenizer is not None and native_text:
            self._streams = text_streams(tokenizer)

    @property
    def native_text(self) -> bool:
        """Whether text and stop strings run in the core (`TextStreams`)."""
        return self._streams is not None

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def params(self, request_id: int) -> SamplingParams | None:
        """The sampling parameters of a request it serves (None: not one of its)."""
        state = self._states.get(request_id)
        return None if state is None else state.params

    def generated(self, request_id: int) -> int | None:
        """Tokens a request it serves has been given so far (None: not one of its)."""
        slot = self._slot.get(request_id)
        return None if slot is None else int(self._generated[slot])

    def add(self, request_id: int, params: SamplingParams, prompt: Sequence[int]) -> None:
        """Start serving an admitted request."""
        if self._streams is not None:  # (refuses a request it has already)
            self._streams.add(request_id, list(params.stop or ()))
        slot = self._slot.get(request_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._slot[request_id] = self._free.pop()
        self._generated[slot] = 0
        self._prompt_len[slot] = len(prompt)
        self._top_n[slot] = -1 if params.logprobs is None else params.logprobs
        if self._streams is not None:
            self._states[request_id] = RequestState(params, slot, None, None)
            return
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, list(prompt))
        stops = StopStringMatcher(params.stop) if params.stop else None
        self._states[request_id] = RequestState(params, slot, detok, stops)

    def _grow(self) -> None:
        """Twice the slots (the arrays' values kept)."""
        old = len(self._generated)
        self._generated = np.concatenate([self._generated, np.zeros(old, np.int64)])
        self._prompt_len = np.concatenate([self._prompt_len, np.zeros(old, np.int64)])
        self._top_n = np.concatenate([self._top_n, np.full(old, -1, np.int64)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _drop(self, request_id: int) -> RequestState | None:
        """Stop serving a request: its state, its slot freed."""
        state = self._states.pop(request_id, None)
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        return state

    def final(
        self,
        request_id: int,
        reason: kvsched.FinishReason,
        *,
        error: str | None = None,
        retry_after: float | None = None,
    ) -> RequestOutput | None:
        """The last output of a request that ended without a token: what its
        stop-string matcher still held back (nothing matched) and its ending.
        None for a request it does not serve (or no longer: it ended already)."""
        state = self._states.get(request_id)
        if state is None:
            return None
        prompt, done = int(self._prompt_len[state.slot]), int(self._generated[state.slot])
        self._drop(request_id)
        if self._streams is not None:
            text = self._streams.finish(request_id) or ""
        else:
            text = state.stops.flush() if state.stops is not None else ""
        return RequestOutput(request_id, [], text, None, True, reason, prompt, done, error=error,
                             retry_after=retry_after)  # fmt: skip

    def endings(self, finished: Iterable[kvsched.FinishedRequest]) -> list[RequestOutput]:
        """Final outputs from the core's terminal events of requests still served
        here: cancels (also `Scheduler.cancel` called directly), drain deadlines,
        displacements ("shed", with the core's retry_after) and failures
        ("error", with the engine's reason). Events of requests that ended in
        `process` (with a token) are skipped."""
        out = []
        for f in finished:
            final = self.final(f.request_id, f.reason, error=f.error, retry_after=f.retry_after)
            if final is not None:
                out.append(final)
        return out

    def process(
        self,
        request_ids: Sequence[int] | npt.NDArray[np.integer],
        tokens: Sequence[int] | npt.NDArray[np.integer],
        finished: Iterable[kvsched.FinishedRequest],
        rows: Mapping[int, int],
        logprobs: Callable[[], Logprobs],
    ) -> tuple[StepOutputs, list[int]]:
        """One commit's tokens (`request_ids[i]` got `tokens[i]`; `finished`: the
        commit's terminal events; `rows`: each request's row in the step, for
        `logprobs()`, called once and only if a request asked for them; read
        only for those requests). Returns the outputs (rows of requests it does
        not serve left out), and the requests whose text matched a stop string:
        they end here (finish_reason "stop"), and the caller ends them in the
        core (`Scheduler.stop`)."""
        rids = np.asarray(request_ids, np.int64).reshape(-1)
        toks = np.asarray(tokens, np.int64).reshape(-1)
        if rids.shape != toks.shape:
            raise ValueError(f"{rids.size} request ids and {toks.size} tokens: one each per row")
        get = self._slot.get
        slots = np.array([get(r, -1) for r in rids.tolist()], np.int64)
        served = slots >= 0
        if not served.all():
            rids, toks, slots = rids[served], toks[served], slots[served]
        self._generated[slots] += 1
        n = rids.size
        # The terminal events of this step's rows, by row (few: sparse work).
        last = np.zeros(n, bool)
        ended: dict[int, kvsched.FinishedRequest] = {}
        by_id = {f.request_id: f for f in finished}
        if by_id and n:
            order = np.argsort(rids, kind="stable")
            want = np.fromiter(by_id, np.int64, len(by_id))
            at = np.minimum(np.searchsorted(rids[order], want), n - 1)
            for rid, i in zip(want.tolist(), order[at].tolist(), strict=True):
                if rids[i] == rid:
                    ended[i] = by_id[rid]
                    last[i] = True
        text_toks = toks
        stop_rows = [i for i, f in ended.items() if f.reason == "stop"]
        if stop_rows:  # a stop token is not part of the text (OpenAI's convention)
            text_toks = toks.copy()
            text_toks[stop_rows] = -1
        texts, stopped = self._texts(rids, text_toks, last)
        # Logprobs, for the rows that asked.
        lp_rows: dict[int, list[TokenLogprob]] = {}
        top_n = self._top_n[slots]
        asked = np.flatnonzero(top_n >= 0)
        if asked.size:
            lp = logprobs()
            for i, k in zip(asked.tolist(), top_n[asked].tolist(), strict=True):
                row = rows[int(rids[i])]
                top = list(zip(lp[1][row, :k].tolist(), lp[2][row, :k].tolist(), strict=True))
                lp_rows[i] = [TokenLogprob(int(toks[i]), float(lp[0][row]), top)]
        out = StepOutputs(rids, toks, texts, self._prompt_len[slots], self._generated[slots],
                          last, {}, lp_rows, [])  # fmt: skip
        # Endings: the core's events, and stop strings matched here.
        stopped_here = []
        for i in sorted({*ended, *stopped}):
            fin = ended.get(i)
            if fin is None:
                stopped_here.append(int(rids[i]))  # the core's event for it arrives later, skipped
                out._ends[i] = ("stop", None, None)
            else:
                out._ends[i] = ("stop" if i in stopped else fin.reason, fin.error, fin.retry_after)
            out.finished[i] = True
            self._drop(int(rids[i]))
        return out, stopped_here

    def _texts(
        self, rids: npt.NDArray[np.int64], toks: npt.NDArray[np.int64], last: npt.NDArray[np.bool_]
    ) -> tuple[list[str], set[int]]:
        """Each row's new text (a negative token: one with no text, a stop
        token), and the rows a stop string ended."""
        if self._streams is not None:
            # Every row in one call to the core.
            pushed, ended = self._streams.push(rids.tolist(), toks.tolist(), last.tolist())
            return pushed, {i for i, s in enumerate(ended) if s} if any(ended) else set()
        states = [self._states[r] for r in rids.tolist()]
        # First every row's new ids, so that all the windows decode in one call
        # (a tokenizers.Tokenizer's decode_batch) instead of one call each.
        windows: list[tuple[int, IncrementalDetokenizer]] = []
        for i, (state, tok) in enumerate(zip(states, toks.tolist(), strict=True)):
            detok = state.detok
            if detok is not None and detok.extend(() if tok < 0 else (tok,)):
                windows.append((i, detok))
        deltas: dict[int, str] = {}
        moved = []
        for (i, detok), text in zip(windows, self._decode([d.window for _, d in windows]),
                                    strict=True):  # fmt: skip
            deltas[i] = detok.take(text)
            if detok.needs_context:
                moved.append(detok)
        for detok, text in zip(moved, self._decode([d.window for d in moved]), strict=True):
            detok.set_context(text)
        texts: list[str] = []
        stops: set[int] = set()
        for i, (state, end) in enumerate(zip(states, last.tolist(), strict=True)):
            text, stopped = self._text(state, deltas.get(i, ""), end)
            texts.append(text)
            if stopped:
                stops.add(i)
        return texts, stops

    def _decode(self, windows: list[list[int]]) -> list[str]:
        """The text of each window, decoded in one call."""
        if not windows:
            return []
        batch = getattr(self.tokenizer, "decode_batch", None)
        if batch is None:  # a decoder of one text at a time (see TokenDecoder)
            return [self.tokenizer.decode(w, skip_special_tokens=True) for w in windows]
        texts: list[str] = batch(windows, skip_special_tokens=True)
        return texts

    @staticmethod
    def _text(state: RequestState, delta: str, last: bool) -> tuple[str, bool]:
        """The new text of one token (its detokenized `delta`, the rest flushed
        when it is the last), and whether it matched a stop string."""
        if state.detok is None:
            return "", False
        text = delta
        if last:
            text += state.detok.flush()
        stopped = False
        if state.stops is not None:
            text, stopped = state.stops.feed(text)
            if last and not stopped:
                text += state.stops.flush()
        return text, stopped
