"""Token strings for OpenAI logprobs: a token id's text and its exact bytes."""

from __future__ import annotations

from typing import Any


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTES = _byte_decoder()


class TokenText:
    """A token id's text and bytes, as OpenAI's logprobs show them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if self.tokenizer is None:
            out: tuple[str, list[int] | None] = (f"token_id:{token_id}", None)
        else:
            piece = self.tokenizer.id_to_token(token_id) or ""
            if piece and all(c in _BYTES for c in piece):
                raw = bytes(_BYTES[c] for c in piece)  # byte-level BPE: the exact bytes
            else:
                raw = piece.encode("utf-8")  # a special token, or another tokenizer
            out = (raw.decode("utf-8", errors="replace"), list(raw))
        if len(self._cache) < 65536:
            self._cache[token_id] = out
        return out
