"""The core's text streams (kvsched._core.TextStreams, the table from
kvsched.engine.token_bytes) against the tokenizers library's own decode and the
per-request Python path (IncrementalDetokenizer + StopStringMatcher): for any
ids, split into any steps, with any stop strings, the text streamed is the
tokenizer's decode cut before the first stop, and the two paths agree row by
row. Tokenizers: a byte-level BPE and a SentencePiece BPE with byte fallback
built here (always run), and SmolLM2's and Gemma 3's real ones when cached."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import kvsched
from kvsched.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvsched.engine.outputs import OutputProcessor
from kvsched.engine.sampling import SamplingParams
from kvsched.engine.token_bytes import byte_level_decoder, text_streams, token_table

EXAMPLES = itertools.count()
CACHE = Path.home() / ".cache" / "kvsched"
TEXT = "The harbor at dawn. Ça coûte 5 € — 日本語 🙂\n\nhello héllo world.\n"


def byte_level() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet,
                                  special_tokens=["<|end|>"], show_progress=False)  # fmt: skip
    t.train_from_iterator([TEXT] * 3, trainer)
    return t


def byte_fallback() -> Tokenizer:
    """SentencePiece-style: `▁` for a space, a few whole pieces, every byte as
    <0xHH>, decoded as Gemma's and Llama 2's are (kvsched's Gemma loader)."""
    pieces = ["<unk>", "<s>", *(f"<0x{b:02X}>" for b in range(256)),
              "▁", "▁the", "▁harbor", "h", "e", "l", "o", "é", "日本", "€", "\n"]  # fmt: skip
    t = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True))
    t.add_special_tokens(["<s>"])
    t.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return t


def real(name: str) -> Tokenizer:
    from kvsched.engine.loaders.gguf_file import open_gguf

    path = CACHE / name
    if not path.exists():
        pytest.skip(f"{name} is not cached (python -m kvsched fetch-model)")
    if name.startswith("gemma"):
        from kvsched.engine.loaders.gguf_gemma3 import load_gguf_spm_tokenizer as load
    else:
        from kvsched.engine.loaders.gguf_llama import load_gguf_tokenizer as load
    tok: Tokenizer = load(open_gguf(path))[0]
    return tok


TOKENIZERS = {
    "byte_level": byte_level,
    "byte_fallback": byte_fallback,
    "smollm2": lambda: real("SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": lambda: real("gemma-3-270m-q4_k_m.gguf"),
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok(request) -> Tokenizer:
    return TOKENIZERS[request.param]()


@pytest.fixture(scope="module")
def streams(tok):
    """`tok`'s streams, one table per tokenizer (a test leaves none open)."""
    s = text_streams(tok)
    assert s is not None
    return s


def reference(tok: Tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """The tokenizers library's decode of everything, cut before the stop that
    completes first (ties: the longer)."""
    text = tok.decode(ids, skip_special_tokens=True)
    hits = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    if not hits:
        return text, False
    end, neg = min(hits)
    return text[: end + neg], True


def python_path(tok: Tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    detok, matcher = IncrementalDetokenizer(tok), StopStringMatcher(stops)
    out = []
    for t in ids:
        text, hit = matcher.feed(detok.push([t]))
        out.append(text)
        if hit:
            return "".join(out), True
    text, hit = matcher.feed(detok.flush())
    return "".join(out) + text + ("" if hit else matcher.flush()), hit


def test_the_table_is_each_tokens_bytes(tok):
    data, offsets, byte_tokens, skipped = token_table(tok)
    n = tok.get_vocab_size(with_added_tokens=True)
    assert len(offsets) == n + 1 and offsets[-1] == len(data)
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert b"".join(data[offsets[t] : offsets[t + 1]] for t in ids).decode() == tok.decode(ids)
    for t in skipped:
        assert tok.decode([t], skip_special_tokens=True) == "" and offsets[t] == offsets[t + 1]
    for t in byte_tokens:
        assert tok.id_to_token(t) == f"<0x{data[offsets[t]]:02X}>"
    assert bool(byte_tokens) == (tok.decoder.__getstate__() != decoders.ByteLevel().__getstate__())


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_ids_any_stops_stream_as_the_tokenizer_decodes(tok, streams, data):
    """Many requests in each push, each its own ids (any: invalid UTF-8 and
    special tokens included) and stops (drawn from its text, so they do match)."""
    n = tok.get_vocab_size(with_added_tokens=True)
    encoded = tok.encode(TEXT, add_special_tokens=False).ids
    base = next(EXAMPLES) * 10  # fresh request ids: a failed example leaves its streams
    rows = data.draw(st.integers(1, 4))
    want, got, ids_of = {}, {}, {}
    for r in range(base, base + rows):
        ids = data.draw(st.one_of(
            st.lists(st.integers(0, n - 1), max_size=24),
            st.integers(0, len(encoded) - 1).map(lambda i: encoded[i : i + 24]),
        ))  # fmt: skip
        text = tok.decode(ids, skip_special_tokens=True)
        pieces = [text[i : i + 2] for i in range(len(text))] or ["zz"]  # stops that match
        stops = data.draw(st.lists(
            st.sampled_from(["\n\n", "€", "o w", "zz", *pieces]), max_size=2, unique=True,
        ))  # fmt: skip
        ids_of[r] = ids
        want[r] = reference(tok, ids, stops)
        if "\ufffd" in text and not isinstance(tok.decoder, decoders.ByteLevel):
            # Broken UTF-8 from byte-fallback runs: neither path promises the
            # decoder's text there (docs/engine.md); the core's still ends.
            want[r] = None
        else:
            assert python_path(tok, ids, stops) == want[r], "the Python path"
        streams.add(r, stops)
        got[r] = ["", False]
    for step in range(max(map(len, ids_of.values()), default=0)):
        live = [r for r in ids_of if step < len(ids_of[r]) and not got[r][1]]
        texts, stopped = streams.push(
            live, [ids_of[r][step] for r in live], [step == len(ids_of[r]) - 1 for r in live]
        )
        for r, text, hit in zip(live, texts, stopped, strict=True):
            got[r][0] += text
            got[r][1] = hit
    for r in ids_of:
        if not ids_of[r]:
            got[r][0] = streams.finish(r)
        if want[r] is not None:
            assert tuple(got[r]) == want[r], (r, ids_of[r])
    assert not any(r in streams for r in ids_of), "every stream closed at its end"


def test_the_processor_serves_real_answers_alike_on_both_paths(tok):
    """OutputProcessor end to end, text and stops in the core vs in Python."""
    answer = tok.encode(TEXT, add_special_tokens=False).ids
    prompt = tok.encode("Question: the harbor?", add_special_tokens=False).ids
    params = [SamplingParams(max_tokens=99), SamplingParams(max_tokens=99, stop=("\n\n",)),
              SamplingParams(max_tokens=99, stop=("€", "dawn"))]  # fmt: skip
    results = []
    for native in (True, False):
        p = OutputProcessor(tok, native_text=native)
        assert p.native_text == native
        for rid, sp in enumerate(params):
            p.add(rid, sp, prompt)
        texts = {rid: "" for rid in range(len(params))}
        seen = []  # every output: the same on both paths, step by step
        for t in answer:
            rids = [r for r in range(len(params)) if r in p]
            outs, stopped = p.process(rids, [t] * len(rids), [], {}, lambda: None)
            for o in outs:
                texts[o.request_id] += o.text
                seen.append((o.request_id, o.text, o.finished, o.completion_tokens))
            seen.append(("stopped", *stopped))
        for o in p.endings(
            [_End(r) for r in range(len(params)) if r in p]  # the rest: cancelled
        ):
            texts[o.request_id] += o.text
            seen.append((o.request_id, o.text, o.finish_reason))
        results.append((texts, seen))
    assert results[0][1] == results[1][1], "the same outputs, step by step"
    results = [texts for texts, _ in results]
    whole = tok.decode(answer)
    assert results[0][0] == whole
    assert results[0][1] == whole[: whole.index("\n\n")]
    assert results[0][2] == whole[: whole.index("dawn")]


def test_a_stop_in_a_byte_run_ends_on_the_same_token_on_both_paths():
    """`<0x0A>` (a newline written as a byte-fallback token) with stop "\n":
    both paths end the request on that token, with the same counts."""
    tok = byte_fallback()
    h, newline = tok.token_to_id("h"), tok.token_to_id("<0x0A>")
    seen = []
    for native in (True, False):
        p = OutputProcessor(tok, native_text=native)
        p.add(1, SamplingParams(max_tokens=9, stop=("\n",)), [h])
        steps = []
        for t in (h, newline, h):
            if 1 not in p:
                break
            outs, stopped = p.process([1], [t], [], {}, lambda: None)
            steps.append([(o.text, o.finished, o.completion_tokens, stopped) for o in outs])
        seen.append(steps)
    assert seen[0] == seen[1] == [[("h", False, 1, [])], [("", True, 2, [1])]]


class _End:
    def __init__(self, rid: int) -> None:
        self.request_id, self.reason, self.error, self.retry_after = rid, "cancelled", None, None


def test_other_decoders_keep_the_python_path():
    """A decoder whose text is not its tokens' bytes joined (WordPiece's `##`,
    Metaspace dropping the first space) gets no table: Python detokenizes."""
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "he": 1, "##llo": 2}, unk_token="[UNK]"))
    wp.decoder = decoders.WordPiece()
    meta = byte_fallback()
    meta.decoder = decoders.Metaspace()
    for t in (wp, meta):
        assert token_table(t) is None
        assert not OutputProcessor(t).native_text
    assert OutputProcessor(byte_level()).native_text


def test_ids_past_the_vocabulary_count_are_in_the_table():
    """A vocabulary with gaps (ids up to 7, three tokens): the table covers
    every id up to the largest, so "b" (id 7) has its text."""
    t = Tokenizer(models.BPE({"a": 0, "b": 7}, []))
    t.add_special_tokens(["<s>"])
    t.decoder = decoders.ByteLevel()
    assert t.get_vocab_size(with_added_tokens=True) == 3
    p = OutputProcessor(t)
    assert p.native_text
    p.add(1, SamplingParams(max_tokens=5), [0])
    outs, _ = p.process([1], [7], [], {}, lambda: None)
    assert outs[0].text == "b"


def test_the_gpt2_byte_alphabet_maps_back_to_every_byte():
    alphabet = byte_level_decoder()
    assert sorted(alphabet.values()) == list(range(256))
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    assert alphabet["Ġ"] == ord(" ") and alphabet["Ċ"] == ord("\n") and alphabet["a"] == ord("a")


def test_bad_calls_are_refused_and_change_nothing():
    streams = text_streams(byte_level())
    streams.add(1, ["x"])
    with pytest.raises(kvsched.InvalidRequest, match="has a text stream already"):
        streams.add(1)
    with pytest.raises(kvsched.InvalidRequest, match="non-empty"):
        streams.add(2, ["ok", ""])
    assert 2 not in streams and len(streams) == 1
    with pytest.raises(kvsched.InvalidRequest, match="one each per row"):
        streams.push([1], [5, 6], [False])
    with pytest.raises(kvsched.InvalidConfig, match="offsets"):
        kvsched._core.TextStreams(b"abc", [0, 2])
    assert streams.push([9], [5], [False]) == ([""], [False]), "no stream: nothing"
