"""The output processor alone, with no model: a commit's tokens become text
deltas, logprobs and endings; a stop string it matches is handed back to the
engine (which ends the request in the core); every other ending comes from the
core's terminal events, with the core's reason and the engine's error text."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("jax")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine.outputs import OutputProcessor  # noqa: E402
from kvsched.engine.sampling import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    t.train_from_iterator(["hello world. The end. héllo"] * 3, trainer)
    return t


@pytest.fixture(params=[True, False], ids=["core_text", "python_text"])
def processor(request, tok):
    """An OutputProcessor over `tok`, with text and stop strings in the core's
    TextStreams or in the per-request Python detokenizer: both must behave alike."""

    def make() -> OutputProcessor:
        p = OutputProcessor(tok, native_text=request.param)
        assert p.native_text == request.param
        return p

    return make


@dataclass
class Ended:
    """What the processor reads of a kvsched.FinishedRequest."""

    request_id: int
    reason: kvsched.FinishReason
    error: str | None = None
    retry_after: float | None = None


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text).ids


def no_logprobs():
    raise AssertionError("nobody asked for logprobs")


def test_tokens_become_text_and_a_stop_string_is_handed_back_to_the_engine(tok, processor):
    p = processor()
    p.add(1, SamplingParams(max_tokens=50, stop=("The end",)), ids(tok, "hi"))
    p.add(2, SamplingParams(max_tokens=50), ids(tok, "hi"))
    answer = ids(tok, "hello world. The end. more")
    texts, stopped_at = [], None
    for i, t in enumerate(answer):
        outs, stopped = p.process([1, 2], [t, t], [], {1: 0, 2: 1}, no_logprobs)
        assert [o.request_id for o in outs] == [1, 2]
        texts.append(outs[0].text)
        if stopped:
            assert stopped == [1] and outs[0].finished and outs[0].finish_reason == "stop"
            stopped_at = i
            break
    assert stopped_at is not None
    assert "".join(texts) == "hello world. ", "the stop string is not returned"
    assert 1 not in p and 2 in p and len(p) == 1
    # The core's event for the stopped request comes later: nothing is reported twice.
    assert p.endings([Ended(1, "stop")]) == []


def test_endings_carry_the_cores_reason_and_the_engines_error(tok, processor):
    p = processor()
    for rid in (1, 2, 3):
        p.add(rid, SamplingParams(max_tokens=5), ids(tok, "hi"))
    outs = p.endings([Ended(1, "error", error="logits were not finite"),
                      Ended(2, "shed", None, 3.0), Ended(9, "cancelled")])  # fmt: skip
    assert [(o.request_id, o.finish_reason, o.error, o.retry_after, o.finished) for o in outs] == [
        (1, "error", "logits were not finite", None, True),
        (2, "shed", None, 3.0, True),
    ]
    assert p.final(3, "cancelled").finish_reason == "cancelled"
    assert p.final(3, "cancelled") is None, "ended once"
    assert len(p) == 0


def test_a_stop_token_is_not_text_and_logprobs_are_read_once_when_asked(tok, processor):
    p = processor()
    p.add(1, SamplingParams(max_tokens=5, logprobs=2), ids(tok, "hi"))
    p.add(2, SamplingParams(max_tokens=5), ids(tok, "hi"))
    calls = []

    def logprobs():
        calls.append(1)
        return (np.array([-0.5, -1.5]), np.array([[7, 8], [9, 10]]),
                np.array([[-0.5, -2.0], [-1.5, -3.0]]))  # fmt: skip

    h, end = ids(tok, "hello")[0], ids(tok, ".")[0]
    outs, _ = p.process([2, 1], [end, h], [Ended(2, "stop")], {1: 0, 2: 1}, logprobs)
    assert calls == [1]
    by_id = {o.request_id: o for o in outs}
    assert by_id[2].finished and by_id[2].finish_reason == "stop" and by_id[2].text == ""
    assert by_id[2].logprobs is None
    lp = by_id[1].logprobs[0]
    assert (lp.token_id, lp.logprob, lp.top) == (h, -0.5, [(7, -0.5), (8, -2.0)])
    assert by_id[1].completion_tokens == 1 and not by_id[1].finished


def test_the_finish_reasons_are_one_vocabulary():
    import typing

    assert typing.get_args(kvsched.FinishReason) == kvsched.FINISH_REASONS
    assert "error" in kvsched.FINISH_REASONS


def test_a_steps_columns_say_what_its_outputs_say(tok, processor):
    """StepOutputs: the columns a server reads a step by (`token_ids`,
    `texts`, `finished`, `finished_ids()`, the counts) say what the
    RequestOutputs made from them say; a row of a request the processor does
    not serve is left out; the endings come after the token rows."""
    p = processor()
    for rid in (1, 2, 3, 4):
        p.add(rid, SamplingParams(max_tokens=9, stop=("world",) if rid == 3 else ()),
              ids(tok, "hi"))  # fmt: skip
    text = ids(tok, "hello world")
    for t in text[:-1]:
        p.process([1, 2, 3, 4], [t] * 4, [], {}, no_logprobs)
    outs, stopped = p.process([9, 2, 1, 3, 4], [5, text[-1], text[-1], text[-1], text[-1]],
                              [Ended(1, "length"), Ended(4, "stop")], {}, no_logprobs)  # fmt: skip
    assert stopped == [3], "the stop string matched for 3"
    outs.endings += p.endings([Ended(2, "cancelled")])
    rows = list(outs)
    assert [o.request_id for o in rows] == [2, 1, 3, 4, 2], "9 is not served; the ending last"
    assert outs.request_ids.tolist() == [2, 1, 3, 4] and outs.num_tokens == 4 and len(outs) == 5
    assert outs.token_ids.tolist() == [o.token_ids[0] for o in rows[:4]]
    assert outs.texts == [o.text for o in rows[:4]]
    assert outs.finished.tolist() == [False, True, True, True] == [o.finished for o in rows[:4]]
    assert [outs.finish_reason(i) for i in range(4)] == [None, "length", "stop", "stop"]
    assert [o.finish_reason for o in rows] == [None, "length", "stop", "stop", "cancelled"]
    assert outs.finished_ids() == [1, 3, 4, 2]
    assert outs.completion_tokens.tolist() == [len(text)] * 4
    assert [o.completion_tokens for o in rows] == [len(text)] * 4 + [len(text)]
    assert rows[3].text == "", "a stop token is not text"
    assert outs == rows and outs[1:3] == rows[1:3] and outs[-1] is rows[-1]
    assert len(p) == 0
    empty = type(outs).empty()
    assert empty == [] and empty.finished_ids() == [] and empty.num_tokens == 0
