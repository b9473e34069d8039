"""Each token's bytes: the table `kvsched._core.TextStreams` detokenizes with.

A byte-level BPE tokenizer (GPT-2, SmolLM2, Llama 3) and a SentencePiece one
with byte fallback (Llama 2, Gemma; `▁` decoded as a space) decode a list of
ids as the bytes of its tokens joined, read as UTF-8. For those the whole
step's detokenization and stop strings run in the core, one call for every row
(`TextStreams.push`), instead of a Python detokenizer per row
(kvsched.engine.detokenizer, which stays for every other tokenizer).

`token_table` derives the table from the tokenizer's own decode (every token
that decodes alone to whole characters) and its vocabulary (the others: a
byte-level token's characters map back to bytes; a byte-fallback token
`<0xHH>` is that byte), then checks it: a sample text's ids must decode the
same through the table as through the tokenizer. Anything else (another
decoder, a decoder that strips or cleans up text, a failed check) gets None.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import kvsched

REPLACEMENT = "\ufffd"
SPACE = "\u2581"  # SentencePiece's word boundary, decoded as " "

# Decoders whose output is the tokens' bytes joined: ByteLevel, or this exact
# SentencePiece sequence (a Strip would drop the text's first space: not joined).
BYTE_FALLBACK = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                 {"type": "ByteFallback"}, {"type": "Fuse"}]  # fmt: skip

SAMPLE = (
    "The harbor at dawn: boats, gulls and a café. Ça coûte 5 € — naïve façade.\n\n"
    "日本語のテキスト、中文文本，한국어 텍스트. Emoji 🙂🚀 and math ∑ x² ≤ ∞.\n"
    "def f(x):\n    return {'a': [1, 2]}  # code\tand\ttabs  \n"
)


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each of the 256 characters a
    byte-level BPE writes a byte as, to that byte. Printable Latin-1 bytes
    stand for themselves; the rest (controls, space, a few others) are
    shifted past U+0100 in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + shifted)] = b
            shifted += 1
    return out


def _decoder_kind(tokenizer: Any) -> str | None:
    decoder = getattr(tokenizer, "decoder", None)
    if decoder is None:
        return None
    spec = json.loads(decoder.__getstate__())
    if spec.get("type") == "ByteLevel":
        return "byte_level"
    if spec.get("type") == "Sequence" and spec.get("decoders") == BYTE_FALLBACK:
        return "byte_fallback"
    return None


def _piece_bytes(piece: str, kind: str, byte_of: dict[str, int]) -> bytes | None:
    """A vocabulary piece's bytes by the decoder's rule; None if it has none."""
    if kind == "byte_level":
        if any(c not in byte_of for c in piece):
            return None
        return bytes(byte_of[c] for c in piece)
    got = _byte_piece(piece)
    return got if got is not None else piece.replace(SPACE, " ").encode()


def _byte_piece(piece: str) -> bytes | None:
    """A byte-fallback token's byte (`<0xHH>`), or None."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    return None


class TokenTable(NamedTuple):
    """`kvsched._core.TextStreams`'s arguments: every token's bytes joined
    (`data`; token t is `data[offsets[t]:offsets[t + 1]]`), the byte-fallback
    tokens (`<0xHH>`) and the special tokens
    decoding skips."""

    data: bytes
    offsets: list[int]
    byte_tokens: list[int]
    skipped: list[int]


def token_table(tokenizer: Any) -> TokenTable | None:
    """The table of a tokenizers.Tokenizer whose decode is its tokens' bytes
    joined, checked on a sample; None otherwise."""
    try:
        return _token_table(tokenizer)
    except Exception:  # noqa: BLE001 - any tokenizer this cannot read keeps the Python path
        return None


def _token_table(tokenizer: Any) -> TokenTable | None:
    kind = _decoder_kind(tokenizer)
    if kind is None:
        return None
    # Ids may have gaps (an added token past the vocabulary): the table covers
    # every id up to the largest.
    n = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    alone = tokenizer.decode_batch([[t] for t in range(n)], skip_special_tokens=True)
    byte_of = byte_level_decoder()
    skipped = sorted(
        t for t, added in tokenizer.get_added_tokens_decoder().items() if added.special
    )
    byte_tokens = []
    parts: list[bytes] = []
    for t, text in enumerate(alone):
        piece = tokenizer.id_to_token(t)
        if kind == "byte_fallback" and piece is not None and _byte_piece(piece) is not None:
            byte_tokens.append(t)
            parts.append(_byte_piece(piece) or b"")
            continue
        if REPLACEMENT not in text:
            parts.append(text.encode())  # whole characters (special tokens: "")
            continue
        got = None if piece is None else _piece_bytes(piece, kind, byte_of)
        if got is None:
            return None
        parts.append(got)
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + len(p))
    table = TokenTable(b"".join(parts), offsets, byte_tokens, skipped)
    # The check: a sample's ids stream through the table as the tokenizer decodes them.
    ids = tokenizer.encode(SAMPLE, add_special_tokens=False).ids
    streams = kvsched._core.TextStreams(*table)
    streams.add(0)
    texts, _ = streams.push([0] * len(ids), ids, [i == len(ids) - 1 for i in range(len(ids))])
    if "".join(texts) != tokenizer.decode(ids, skip_special_tokens=True):
        return None
    return table


def text_streams(tokenizer: Any) -> kvsched._core.TextStreams | None:
    """The core's text streams for `tokenizer`, or None (see `token_table`)."""
    table = token_table(tokenizer)
    return None if table is None else kvsched._core.TextStreams(*table)
