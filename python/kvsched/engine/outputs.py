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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


@dataclass
class RequestState:
    """The processor's state of one request."""

    params: SamplingParams
    prompt_len: int
    detok: IncrementalDetokenizer | None
    stops: StopStringMatcher | None
    generated: int = 0


# The sampler's logprob outputs for a step's rows, on the host: the chosen
# token's logprob [rows], the top ids [rows, n] and their logprobs [rows, n].
Logprobs = tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]


class OutputProcessor:
    """Per-request detokenization, stop strings, logprobs and endings (see the
    module). `tokenizer`: a tokenizers.Tokenizer, or None (outputs then carry
    token ids and no text)."""

    def __init__(self, tokenizer: Any = None, *, native_text: bool = True) -> None:
        self.tokenizer = tokenizer
        self._states: dict[int, RequestState] = {}
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

    def add(self, request_id: int, params: SamplingParams, prompt: Sequence[int]) -> None:
        """Start serving an admitted request."""
        if self._streams is not None:
            self._streams.add(request_id, list(params.stop or ()))
            self._states[request_id] = RequestState(params, len(prompt), None, None)
            return
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, list(prompt))
        stops = StopStringMatcher(params.stop) if params.stop else None
        self._states[request_id] = RequestState(params, len(prompt), detok, stops)

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
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        if self._streams is not None:
            text = self._streams.finish(request_id) or ""
        else:
            text = state.stops.flush() if state.stops is not None else ""
        return RequestOutput(request_id, [], text, None, True, reason, state.prompt_len,
                             state.generated, error=error, retry_after=retry_after)  # fmt: skip

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
        request_ids: Sequence[int],
        tokens: Sequence[int],
        finished: Iterable[kvsched.FinishedRequest],
        rows: dict[int, int],
        logprobs: Callable[[], Logprobs],
    ) -> tuple[list[RequestOutput], list[int]]:
        """One commit's tokens (`request_ids[i]` got `tokens[i]`; `finished`: the
        commit's terminal events; `rows`: each request's row in the step, for
        `logprobs()`, called once and only if a request asked for them).
        Returns the outputs, and the requests whose text matched a stop string:
        they end here (finish_reason "stop"), and the caller ends them in the
        core (`Scheduler.stop`)."""
        ends = {f.request_id: f for f in finished}
        lp: Logprobs | None = None
        outputs, stopped_here = [], []
        served: list[tuple[int, int, RequestState, kvsched.FinishedRequest | None]] = []
        for rid, tok in zip(request_ids, tokens, strict=True):
            state = self._states.get(rid)
            if state is None:
                continue
            state.generated += 1
            served.append((rid, tok, state, ends.get(rid)))
        texts, stops = self._texts(served)
        for (rid, tok, state, fin), text, stopped in zip(served, texts, stops, strict=True):
            token_logprobs = None
            if state.params.logprobs is not None:
                if lp is None:
                    lp = logprobs()
                row, n = rows[rid], state.params.logprobs
                top = list(zip(lp[1][row, :n].tolist(), lp[2][row, :n].tolist(), strict=True))
                token_logprobs = [TokenLogprob(tok, float(lp[0][row]), top)]
            out = RequestOutput(rid, [tok], text, token_logprobs, prompt_tokens=state.prompt_len,
                                completion_tokens=state.generated)  # fmt: skip
            if stopped and fin is None:
                stopped_here.append(rid)  # the core's event for it arrives later, skipped
            if stopped or fin is not None:
                out.finished = True
                out.finish_reason = "stop" if stopped or fin is None else fin.reason
                del self._states[rid]
            outputs.append(out)
        return outputs, stopped_here

    def _texts(
        self, served: list[tuple[int, int, RequestState, kvsched.FinishedRequest | None]]
    ) -> tuple[list[str], list[bool]]:
        """Each served row's new text and whether a stop string ended it. A
        stop token is not part of the text (OpenAI's convention)."""
        if self._streams is not None:
            # Every row in one call to the core.
            return self._streams.push(
                [rid for rid, _, _, _ in served],
                [-1 if _stop_token(fin) else tok for _, tok, _, fin in served],
                [fin is not None for _, _, _, fin in served],
            )
        # First every row's new ids, so that all the windows decode in one call
        # (a tokenizers.Tokenizer's decode_batch) instead of one call each.
        windows: list[tuple[int, IncrementalDetokenizer]] = []
        for rid, tok, state, fin in served:
            detok = state.detok
            if detok is not None and detok.extend(() if _stop_token(fin) else (tok,)):
                windows.append((rid, detok))
        deltas: dict[int, str] = {}
        moved = []
        for (rid, detok), text in zip(windows, self._decode([d.window for _, d in windows]),
                                      strict=True):  # fmt: skip
            deltas[rid] = detok.take(text)
            if detok.needs_context:
                moved.append(detok)
        for detok, text in zip(moved, self._decode([d.window for d in moved]), strict=True):
            detok.set_context(text)
        texts, stops = [], []
        for rid, _, state, fin in served:
            text, stopped = self._text(state, deltas.get(rid, ""), fin)
            texts.append(text)
            stops.append(stopped)
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
    def _text(
        state: RequestState, delta: str, fin: kvsched.FinishedRequest | None
    ) -> tuple[str, bool]:
        """The new text of one token (its detokenized `delta`, the rest flushed
        when it ends), and whether it matched a stop string."""
        if state.detok is None:
            return "", False
        text = delta
        if fin is not None:
            text += state.detok.flush()
        stopped = False
        if state.stops is not None:
            text, stopped = state.stops.feed(text)
            if fin is not None and not stopped:
                text += state.stops.flush()
        return text, stopped


def _stop_token(fin: kvsched.FinishedRequest | None) -> bool:
    """Whether the request's last token ended it as a stop token."""
    return fin is not None and fin.reason == "stop"
