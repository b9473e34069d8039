"""Streaming text: incremental detokenization and stop strings.

A byte-level BPE tokenizer (GPT-2, SmolLM2) can split one character over several
tokens, so decoding token by token would stream broken UTF-8 (U+FFFD) to clients,
and decoding everything every step costs O(n^2) over a long answer. Stop strings are
matched on the text, so text that might be the start of a stop has to wait.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from numbers import Integral
from typing import Protocol

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5
"""Prompt tokens decoded ahead of the first generated one, so that a tokenizer that
treats the start of a text specially (leading-space handling) sees a continuation."""


class TokenDecoder(Protocol):
    """What detokenizing needs of a tokenizer (a tokenizers.Tokenizer has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turn generated token ids into text deltas, a few tokens of decoding per push.

    The "prefix offset / read offset" technique: the window holds a few ids already
    emitted (decoded again only as context, so leading spaces come out right) and the
    ids not yet final. Each push decodes just that window and emits what follows the
    context's text; the window then slides to start at the old read offset. A trailing
    U+FFFD may be a character split across tokens, so that tail is held back until a
    later token completes it (or `flush` gives up and emits it as it decodes).

    For byte-level tokenizers the concatenation of every delta and `flush()` equals
    `tokenizer.decode(all_generated_ids)`.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        ctx = [int(t) for t in list(prompt_ids)[-CONTEXT_TOKENS:]]
        if ctx and self._decode(ctx).endswith(REPLACEMENT):
            ctx = []  # the prompt ends mid-character: its context would not be a prefix
        self._ids: list[int] = ctx  # the window: context ids, then ids not yet final
        self._read = len(ctx)  # window ids before this are emitted (the context)
        self._context_text: str | None = self._decode(ctx)
        self._held_out = 0  # chars past the context text already emitted from this window
        self.num_tokens = 0  # generated ids pushed so far

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Append generated ids; return the text that is now final."""
        if not self.extend(token_ids):
            return ""
        delta = self.take(self._decode(self._ids))
        if self.needs_context:
            self.set_context(self._decode(self._ids))
        return delta

    # `push` in three steps, so that a caller with many streams decodes all their
    # windows in one call (a tokenizer's decode_batch): `extend`, then `take` the
    # decoded `window`, then, where `needs_context`, `set_context` to the decoded
    # `window` again.

    def extend(self, token_ids: int | Iterable[int]) -> bool:
        """Append generated ids without decoding; whether any came."""
        # (int is named for mypy, which does not count it an Integral; numpy ints are)
        ids = (token_ids,) if isinstance(token_ids, (int, Integral)) else token_ids
        before = len(self._ids)
        self._ids.extend(int(t) for t in ids)
        self.num_tokens += len(self._ids) - before
        return len(self._ids) > before

    @property
    def window(self) -> list[int]:
        """The ids to decode for `take` (and for `set_context`)."""
        return self._ids

    def take(self, text: str) -> str:
        """The final text of `window` decoded as `text`."""
        if text.endswith(REPLACEMENT):
            # Emit what precedes the trailing U+FFFD run: bytes after a complete
            # character cannot change how it decodes. Offsets stay put.
            return self._emit(text.rstrip(REPLACEMENT), advance=False)
        return self._emit(text, advance=True)

    @property
    def needs_context(self) -> bool:
        """Whether the window moved on and its context's text must be set
        (`set_context` with the decoded `window`)."""
        return self._context_text is None

    def set_context(self, text: str) -> None:
        self._context_text = text

    def flush(self) -> str:
        """The end of generation: emit anything held back, invalid bytes as U+FFFD."""
        if self._read >= len(self._ids):
            return ""
        delta = self._emit(self._decode(self._ids), advance=True)
        self.set_context(self._decode(self._ids))
        return delta

    def _emit(self, text: str, *, advance: bool) -> str:
        context = self._context_text
        assert context is not None, "set_context first"
        start = len(context) + self._held_out
        if not text.startswith(context):
            start = len(text)  # a decoder that rewrote its context: emit nothing, not junk
        delta = text[start:]
        if advance:
            # The old read point becomes the window's start: the text up to it ended
            # in a complete character, so it is a character boundary. Its text (the
            # next context) is decoded by the caller (`set_context`).
            del self._ids[: self._read]
            self._read = len(self._ids)
            self._context_text = None
            self._held_out = 0
        else:
            self._held_out += len(delta)
        return delta


class StopStringMatcher:
    """Cut streamed text at the first stop string, holding back possible beginnings.

    `feed` returns (text safe to emit, matched). Text that could be the start of a stop
    string waits for the next delta; on a match the returned text ends right before
    the stop and the stop itself is never returned. When several stops occur, the one
    that completes first in the stream wins (ties: the longer one), so the result does
    not depend on how the text was split into deltas.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            stops = (stops,)
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(dict.fromkeys(stops))
        self._longest = max((len(s) for s in self.stops), default=0)
        # Every proper prefix of a stop: a held-back tail is the longest suffix
        # of the text found here (a set lookup per length, not a scan of stops).
        self._prefixes = {s[:k] for s in self.stops for k in range(1, len(s))}
        self._buf = ""
        self.matched: str | None = None  # the stop that matched, once one has

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._buf + delta
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0:
                cand = (i + len(s), -len(s), s)
                if best is None or cand < best:
                    best = cand
        if best is not None:
            end, neg_len, s = best
            self.matched = s
            self._buf = ""
            return buf[: end + neg_len], True
        hold = self._partial_len(buf)
        self._buf = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def _partial_len(self, buf: str) -> int:
        """The longest suffix of buf that is a proper prefix of some stop."""
        prefixes = self._prefixes
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            if buf[-k:] in prefixes:
                return k
        return 0

    def flush(self) -> str:
        """The end of the stream: text held back as a possible stop start, or "" after
        a match."""
        out, self._buf = self._buf, ""
        return "" if self.matched is not None else out
