"""The real model through the engine: SmolLM2-135M-Instruct read from its GGUF
file answers in real text, streams it without broken characters, stops on its
EOS and on stop strings (freeing its pages), and its shapes are the published
ones. (The peer check against transformers is test_peer_smollm2.py.)"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

import kvsched  # noqa: E402
from kvsched.engine.runner import Engine  # noqa: E402
from kvsched.engine.sampling import SamplingParams  # noqa: E402

from smollm2_helpers import smollm2  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def served():
    gg = smollm2()
    cfg = kvsched.SchedulerConfig(num_blocks=129, block_size=16, max_num_seqs=4,
                                  max_batched_tokens=64, max_seq_len=256, long_prefill_chunk=64,
                                  overhead_reserve=0.0)  # fmt: skip
    eng = Engine.create(gg.config, gg.params, cfg, tokenizer=gg.tokenizer,
                        eos_token_ids=(gg.eos_token_id,), max_logprobs=2)  # fmt: skip
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    return gg, eng


def ask(served, question: str, **params):
    gg, eng = served
    rid = eng.submit("t", gg.encode_chat([{"role": "user", "content": question}]),
                     SamplingParams(**params))  # fmt: skip
    outs = []
    while eng.scheduler.live_requests:
        outs += [o for o in eng.step().outputs if o.request_id == rid]
    return outs


def test_the_file_is_the_published_model():
    gg = smollm2()
    c = gg.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.ffn_dim, c.rope_theta) == (49152, 1536, 100000.0)
    assert gg.eos_token_id == gg.tokenizer.token_to_id("<|im_end|>")
    text = gg.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n"), "the template's default system prompt"


def test_it_answers_in_real_text_and_stops_at_its_eos(served):
    outs = ask(served, "What is the capital of France?", max_tokens=40)
    text = "".join(o.text for o in outs)
    assert "Paris" in text
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert "<|im_end|>" not in text, "the stop token is not part of the text"
    gg, _ = served
    assert outs[-1].token_ids == [gg.eos_token_id]


def test_streamed_text_is_the_decoded_tokens(served):
    gg, _ = served
    outs = ask(served, "Write a sentence with the words café, naïve and 🙂.", max_tokens=40,
               temperature=0.7, seed=11, ignore_eos=True)  # fmt: skip
    ids = [t for o in outs for t in o.token_ids]
    streamed = "".join(o.text for o in outs)
    assert streamed == gg.tokenizer.decode(ids)
    assert all("\ufffd" not in o.text for o in outs)


def test_a_stop_string_ends_the_request_and_frees_its_pages(served):
    gg, eng = served
    free_before = eng.scheduler.stats()["pool"]["free"]
    counts = eng.scheduler.stats()["tenants"]["t"]
    outs = ask(served, "What is the capital of France?", max_tokens=40, stop=("Paris",))
    after = eng.scheduler.stats()["tenants"]["t"]
    assert after["finished"] == counts["finished"] + 1, "a stop string finishes the request"
    assert after["cancelled"] == counts["cancelled"]
    text = "".join(o.text for o in outs)
    assert "Paris" not in text and text.strip().startswith("The capital")
    assert outs[-1].finish_reason == "stop"
    assert eng.scheduler.live_requests == 0
    st = eng.scheduler.stats()["pool"]
    # Its pages are back (some stay cached for the prefix cache, evictable).
    assert st["free"] + st["evictable"] >= free_before


def test_logprobs_of_the_real_model_are_probabilities(served):
    outs = ask(served, "Say yes.", max_tokens=3, logprobs=2)
    for o in outs:
        (lp,) = o.logprobs
        assert lp.logprob <= 0.0 and len(lp.top) == 2
        assert lp.top[0][1] >= lp.top[1][1]
        assert np.exp(lp.top[0][1]) + np.exp(lp.top[1][1]) <= 1.0 + 1e-5
        assert lp.token_id == lp.top[0][0], "greedy picks the most likely token"
