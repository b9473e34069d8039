"""Streaming text over a small byte-level BPE tokenizer trained here: incremental
detokenization (no broken UTF-8, deltas add up to the full decode) and stop strings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvsched.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

EOT = "<|endoftext|>"
CORPUS = [
    "héllo wörld 你好 🙂",
    "hello world, hello there",
    "the quick brown fox jumps over the lazy dog",
    "wörld héllo 你好 你好 🙂🙂",
    "Stop here. The end.",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """GPT-2 style: byte-level pre-tokenizer and decoder, all 256 byte tokens, a few merges
    (so common multi-byte characters are one token and rare ones, like 🚀, are several)."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t.train_from_iterator(CORPUS * 3, trainer)
    return t


def _stream(detok: IncrementalDetokenizer, ids, chunk: int = 1) -> list[str]:
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


# -- IncrementalDetokenizer -----------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld 你好 🙂",
        "🚀 launch 🚀🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 — “quotes” ñandú",
        "  leading spaces and\nnewlines\n\n",
        "a",
    ],
)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_the_full_decode(tok, text, chunk):
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    deltas = _stream(IncrementalDetokenizer(tok), ids, chunk)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing was left for flush


def test_character_split_over_tokens_is_held_back(tok):
    ids = tok.encode("🚀 ok").ids
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:3] == ["\ufffd"] * 3, "the test needs 🚀 split over byte tokens"
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(np.int32(i)) for i in ids] == ["", "", "🚀", " ", "o", "k"]
    assert detok.flush() == ""
    assert detok.num_tokens == len(ids)


def test_complete_text_before_a_split_character_is_not_held(tok):
    ids = tok.encode("hello🚀").ids
    detok = IncrementalDetokenizer(tok)
    first = detok.push(ids[:-1])  # "hello" plus part of 🚀
    assert first == "hello"
    assert detok.push(ids[-1]) == "🚀"


def test_prompt_context_and_leading_space(tok):
    prompt = tok.encode("hello").ids
    gen = tok.encode(" world, hello there").ids
    deltas = _stream(IncrementalDetokenizer(tok, prompt_ids=prompt), gen)
    assert "".join(deltas) == " world, hello there" == tok.decode(gen)
    assert deltas[0].startswith(" ")


def test_prompt_ending_mid_character(tok):
    ids = tok.encode("ok 🚀!").ids
    cut = next(i for i in range(len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    prompt, gen = ids[:cut], ids[cut:]
    deltas = _stream(IncrementalDetokenizer(tok, prompt_ids=prompt), gen)
    assert "".join(deltas) == tok.decode(gen)


def test_invalid_bytes_come_out_on_flush(tok):
    lead = tok.encode("🚀").ids[0]  # a lone lead byte: never completed
    detok = IncrementalDetokenizer(tok)
    assert detok.push([tok.encode("hi").ids[0], lead]) == "h"
    assert detok.push([]) == ""
    rest = detok.flush()
    assert "h" + rest == tok.decode([tok.encode("hi").ids[0], lead])
    assert rest.endswith("\ufffd")
    assert detok.flush() == ""


def test_special_tokens(tok):
    eot = tok.token_to_id(EOT)
    ids = [*tok.encode("the end").ids, eot]
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == "the end"
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(_stream(keep, ids)) == "the end" + EOT


class _CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.longest, self.calls = tok, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest, self.calls = max(self.longest, len(ids)), self.calls + 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decodes_a_small_window_not_everything(tok):
    ids = tok.encode(" ".join(CORPUS * 10)).ids
    counting = _CountingTokenizer(tok)
    deltas = _stream(IncrementalDetokenizer(counting, prompt_ids=ids[:50]), ids)
    assert "".join(deltas) == tok.decode(ids)
    assert counting.longest <= 8  # a few tokens (a split character needs up to 4 bytes)
    assert counting.calls <= 2 * len(ids) + 4


# Text from a mix of scripts: ASCII, accents, CJK, emoji (several are byte-split).
_PIECES = [*"abc xyz,.\n", *"éöñ你好世界", "🙂", "🚀", "👍🏽", "𝔘"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=40).map("".join)


@settings(max_examples=50, deadline=None)
@given(text=_TEXT, chunk=st.integers(1, 4))
def test_property_valid_text_streams_exactly(tok, text, chunk):
    ids = tok.encode(text).ids
    deltas = _stream(IncrementalDetokenizer(tok), ids, chunk)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_property_arbitrary_ids_match_decode(tok, data):
    """Any id sequence, invalid UTF-8 included: deltas plus flush equal the decode."""
    n = tok.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, n - 1), max_size=30))
    prompt = data.draw(st.lists(st.integers(0, n - 1), max_size=8))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    out, i = [], 0
    for c in chunks:
        if i >= len(ids):
            break
        out.append(detok.push(ids[i : i + c]))
        i += c
    out.append(detok.flush())
    assert "".join(out) == tok.decode(ids)


# -- StopStringMatcher ----------------------------------------------------------------


def _feed_all(matcher: StopStringMatcher, deltas) -> tuple[str, bool]:
    out = []
    for d in deltas:
        text, hit = matcher.feed(d)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_spanning_deltas():
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello, wo") == ("Hello, wo", False)
    assert m.feed("rld! STO") == ("rld! ", False)
    assert m.feed("P and more") == ("", True)
    assert m.matched == "STOP"
    assert m.feed("later") == ("", True)
    assert m.flush() == ""


def test_partial_prefix_held_then_released():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("x <") == ("x ", False)
    assert m.feed("/ans") == ("", False)
    assert m.feed("wer is") == ("</answer is", False)
    assert m.feed(" <") == (" ", False)
    assert m.flush() == "<"


def test_first_completed_stop_wins():
    m = StopStringMatcher(["world", "lo"])
    assert m.feed("hello world") == ("hel", True)
    assert m.matched == "lo"
    # The one that completes first wins even when another starts earlier.
    m = StopStringMatcher(["abcd", "bc"])
    assert m.feed("xabcd") == ("xa", True)
    # Same end: the longer (earlier-starting) one.
    m = StopStringMatcher(["cd", "abcd"])
    assert m.feed("zabcd!") == ("z", True)


def test_stop_at_start_and_whole_delta():
    assert StopStringMatcher(["<eos>"]).feed("<eos>tail") == ("", True)
    m = StopStringMatcher(["\n\n"])
    assert m.feed("line\n") == ("line", False)
    assert m.feed("\n") == ("", True)


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def _reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    if not hits:
        return text, False
    end, neg = min(hits)
    return text[: end + neg], True


@settings(max_examples=50, deadline=None)
@given(
    text=st.text(alphabet="abc \n", max_size=40),
    stops=st.lists(st.text(alphabet="abc \n", min_size=1, max_size=4), min_size=1, max_size=3),
    data=st.data(),
)
def test_property_streaming_equals_whole_text(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert _feed_all(StopStringMatcher(stops), deltas) == _reference(text, stops)
