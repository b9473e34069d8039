"""The stand-in model (kvsched.engine.simulated): an Engine whose device step
only costs time. Overlap on and off give every request the same tokens;
placeholders are read from the previous step's sampled tokens; the device's
step time is what it is told (ratios, not tight absolute bounds); `kvsched
serve --model simulated` answers a streaming chat through the official
openai client."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("jax")

import kvsched  # noqa: E402
from kvsched.cli.serve import parse_step_time  # noqa: E402
from kvsched.engine.inputs import StepInputs  # noqa: E402
from kvsched.engine.sampling import SamplingBatch, SamplingParams  # noqa: E402
from kvsched.engine.simulated import (  # noqa: E402
    SimulatedEngine,
    TokenWalk,
    simulated_engine,
)

VOCAB = 512
CFG = dict(num_blocks=400, block_size=4, max_num_seqs=8, max_batched_tokens=48, max_seq_len=96,
           long_prefill_chunk=16, overhead_reserve=0.0, max_waiting=32,
           vocab_size=VOCAB)  # fmt: skip


def engine(overlap: bool = True, step: float = 0.0005, **kw) -> SimulatedEngine:
    cfg = {**CFG, **kw.pop("cfg", {})}
    eng = simulated_engine(kvsched.SchedulerConfig(**cfg), step, overlap=overlap,
                           max_logprobs=3, **kw)  # fmt: skip
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("t"))
    eng.scheduler.add_tenant(kvsched.TenantConfig("low", tier=1))
    return eng


def drive(eng: SimulatedEngine, jobs) -> dict[int, dict]:
    """Submit (tenant, prompt, params) jobs and step to the end; per request
    its tokens, logprobs, text and finish reason."""
    rids = [eng.submit(t, p, sp) for t, p, sp in jobs]
    got = {r: {"tokens": [], "logprobs": [], "text": "", "reason": None} for r in rids}
    while eng.scheduler.live_requests:
        res = eng.step()
        assert res is not None
        for o in res.outputs:
            g = got[o.request_id]
            g["tokens"] += o.token_ids
            g["text"] += o.text
            g["logprobs"] += [(t.token_id, t.logprob, tuple(t.top)) for t in o.logprobs or []]
            if o.finished:
                assert g["reason"] is None, "ended twice"
                g["reason"] = o.finish_reason
    while (res := eng.step()) is not None:  # a step still in flight ends quietly
        assert all(not o.token_ids for o in res.outputs)
    assert all(g["reason"] for g in got.values()), "every request ends, and is told"
    assert not eng._sampling_rows, "every ended request's sampling row is forgotten"
    return got


def jobs(n: int, seed: int = 0, vocab: int = VOCAB, **params):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        sp = SamplingParams(max_tokens=int(rng.integers(3, 30)), logprobs=2,
                            temperature=0.0 if k % 2 else 0.9, top_p=0.95,
                            seed=None if k % 3 else k, **params)  # fmt: skip
        tenant = "low" if k % 4 == 3 else "t"
        out.append((tenant, rng.integers(1, vocab, int(rng.integers(2, 30))).tolist(), sp))
    return out


def test_the_stand_in_sets_what_engine_init_sets():
    """Engine's methods run on the stand-in unchanged: it has every attribute
    Engine.__init__ sets, but the compiled step and the device's weights and
    KV cache."""
    from kvsched.engine.model import LlamaConfig, init_params
    from kvsched.engine.runner import Engine

    model = LlamaConfig(vocab_size=VOCAB)
    real = Engine.create(model, init_params(model), kvsched.SchedulerConfig(**CFG))
    sim = engine()
    missing = set(vars(real)) - set(vars(sim))
    assert missing <= {"spec", "caches", "_step"}, missing
    assert sim.compiled_programs() == 0 and sim.scheduler.ready()
    assert sim.model_info()["name"] == "simulated"


@pytest.mark.parametrize("eos_rate", [0.0, 0.05])
def test_overlap_on_and_off_give_the_same_tokens(eos_rate):
    """Greedy and seeded sampled rows, logprobs, stop tokens (the end of text
    at a rate, known one step late overlapped), two tiers: every request's
    tokens, logprobs and ending agree; sampled rows differ from greedy ones."""
    work = jobs(24, stop_token_ids=[7])
    kw = {"eos_token_ids": (3,), "eos_rate": eos_rate}
    serial = drive(engine(False, **kw), work)
    overlapped = drive(engine(True, **kw), work)
    assert list(serial.values()) == list(overlapped.values())
    reasons = {g["reason"] for g in serial.values()}
    assert "length" in reasons
    if eos_rate:
        assert "stop" in reasons
    lens = [len(g["tokens"]) for g in serial.values()]
    assert sum(lens) > 100
    # Each token's logprobs are well formed: the chosen one first, best first.
    for g in serial.values():
        for tok, lp, top in g["logprobs"]:
            assert top[0] == (tok, lp) and lp <= 0 and len(top) == 2 and top[1][1] < lp


def test_overlap_on_and_off_agree_under_preemption():
    """Over-commit: eight requests reserve 2 pages each and grow to 12 in 40
    pages; they are preempted and recomputed, and still get the same tokens
    both ways."""
    rng = np.random.default_rng(5)
    work = [("t", rng.integers(1, VOCAB, 6).tolist(),
             SamplingParams(max_tokens=40, logprobs=2, temperature=0.9 * (k % 2), seed=k))
            for k in range(8)]  # fmt: skip
    cfg = {"num_blocks": 41, "admission": "overcommit"}
    a, b = engine(False, cfg=cfg), engine(True, cfg=cfg)
    serial, overlapped = drive(a, work), drive(b, work)
    assert list(serial.values()) == list(overlapped.values())
    assert a.scheduler.stats()["preemptions"] > 0 and b.scheduler.stats()["preemptions"] > 0


def test_tokens_depend_on_the_request_not_the_batch():
    """A request alone and the same request among others get the same tokens
    (greedy and seeded), as the real sampler keys draws by seed and position."""
    work = jobs(10, seed=5)
    alone = drive(engine(), [work[1]])
    together = drive(engine(), work)
    assert list(alone.values())[0]["tokens"] == list(together.values())[1]["tokens"]
    seeded = [w for w in work if w[2].seed is not None and not w[2].greedy][0]
    assert drive(engine(), [seeded]) == drive(engine(), [seeded])


def _pad_inputs(eng, token_ids, kv_lens):
    """A decode-only plan's inputs: one token per row."""
    shape = eng.scheduler.plan_shape
    n = len(token_ids)
    inp = StepInputs.padding(eng.scheduler.token_buckets[0], shape["max_seqs"],
                             shape["pages_per_seq"], shape["pad_slot"])  # fmt: skip
    inp.token_ids[:n] = token_ids
    inp.cu_q_lens[: n + 1] = np.arange(n + 1)
    inp.cu_q_lens[n + 1 :] = n
    inp.kv_lens[:n] = kv_lens
    inp.num_seqs[0] = n
    inp.logits_indices[:n] = np.arange(n)
    return inp


def test_placeholders_are_read_from_the_previous_steps_tokens():
    """A negative input id -(row + 1) is the token the previous step sampled
    at that row: a step of placeholders samples what the same step with the
    real ids does."""
    eng = engine(step=0.0)
    s = eng.scheduler.plan_shape["max_seqs"]
    dev = eng.device
    batch = SamplingBatch.build([SamplingParams(temperature=0.7, seed=9)] * 3,
                                np.array([5, 6, 7]), s)  # fmt: skip
    first = dev.dispatch(_pad_inputs(eng, [11, 12, 13], [5, 6, 7]), batch, eng._no_prev)
    batch2 = SamplingBatch.build([SamplingParams(temperature=0.7, seed=9)] * 3,
                                 np.array([6, 7, 8]), s)  # fmt: skip
    # Rows 0, 1, 2 read rows 2, 0, 1 of the step before, still in flight.
    via_placeholders = dev.dispatch(_pad_inputs(eng, [-3, -1, -2], [6, 7, 8]), batch2, first[0])
    prev = np.asarray(first[0])
    real = dev.dispatch(_pad_inputs(eng, [prev[2], prev[0], prev[1]], [6, 7, 8]), batch2,
                        eng._no_prev)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(via_placeholders[0])[:3], np.asarray(real[0])[:3])
    # Not what the ids themselves, read as tokens, would give.
    wrong = dev.dispatch(_pad_inputs(eng, [prev[0], prev[1], prev[2]], [6, 7, 8]), batch2,
                         eng._no_prev)  # fmt: skip
    assert not np.array_equal(np.asarray(wrong[0])[:3], np.asarray(real[0])[:3])


def test_the_walk_reads_as_the_text():
    """Greedy from a token of the text, the walk follows the text where the
    token occurs once; a token the text lacks jumps into it."""
    corpus = [10, 11, 12, 13, 14, 15, 16, 17]
    walk = TokenWalk(corpus, 64)
    z = np.zeros(3, np.uint64)
    toks, _ = walk.next_tokens(np.array([10, 13, 50]), np.array([1, 2, 3]), z, np.ones(3, bool))
    assert toks[:2].tolist() == [11, 14] and toks[2] in corpus
    with pytest.raises(ValueError, match="vocabulary|lie in"):
        TokenWalk([1, 99], 64)


@pytest.mark.alone  # times the machine (tests/conftest.py)
def test_the_device_takes_its_step_time():
    """Serial steps of 30 ms take at least that each; the device counts that
    much busy time a step; three times the step time is about three times the
    wall time (the host's share is small here)."""

    def run(step: float, steps: int = 12) -> tuple[float, dict]:
        eng = engine(False, step=step)
        before = eng.device.stats()
        t0 = time.perf_counter()
        shape = eng.scheduler.plan_shape
        batch = SamplingBatch.build([], np.zeros(0, np.int32), shape["max_seqs"], [])
        for _ in range(steps):
            inp = _pad_inputs(eng, [1, 2], [3, 4])
            np.asarray(eng._dispatch(inp, batch, eng._no_prev).tokens)
        wall = time.perf_counter() - t0
        after = eng.device.stats()
        return wall, {k: after[k] - before[k] for k in before}

    wall_30, d30 = run(0.030)
    wall_10, d10 = run(0.010)
    assert wall_30 >= 12 * 0.030
    assert d30["steps"] == 12 and d30["busy_s"] == pytest.approx(12 * 0.030, rel=1e-6)
    assert d30["host_wait_s"] <= wall_30 and d30["host_wait_s"] > 0.5 * wall_30
    assert 2.0 < wall_30 / wall_10 < 3.3


def test_a_step_cost_charges_each_plan_by_its_tokens_and_kv():
    from kvsched.sim import StepCost

    cost = StepCost.preset("llama-3-8b", "h100")
    eng = engine(False, step=cost)
    shape = eng.scheduler.plan_shape
    batch = SamplingBatch.build([], np.zeros(0, np.int32), shape["max_seqs"], [])
    short = eng.device._seconds(2, np.array([3, 4]), np.array([1, 1]))
    long = eng.device._seconds(2, np.array([30_000, 40_000]), np.array([1, 1]))
    assert long > short == pytest.approx(cost.seconds(2, 7))
    before = eng.device.stats()
    np.asarray(eng._dispatch(_pad_inputs(eng, [1, 2], [3, 4]), batch, eng._no_prev).tokens)
    assert eng.device.stats()["busy_s"] - before["busy_s"] == pytest.approx(short, rel=1e-6)


@pytest.mark.alone  # times the machine (tests/conftest.py)
def test_overlap_hides_the_host_behind_the_device():
    """The same workload at 5 ms a step: with overlap the device idles less."""

    def idle(overlap: bool) -> float:
        eng = engine(overlap, step=0.005)
        before = eng.device.stats()
        drive(eng, jobs(16, seed=2))
        after = eng.device.stats()
        return 1 - (after["busy_s"] - before["busy_s"]) / (after["clock_s"] - before["clock_s"])

    assert idle(True) < idle(False)


def test_step_time_specs():
    assert parse_step_time("10") == pytest.approx(0.010)
    assert parse_step_time("2.5ms") == pytest.approx(0.0025)
    cost = parse_step_time("llama-3-8b:h100")
    assert cost.model.name == "llama-3-8b" and cost.accelerator.name == "h100"
    for bad in ("fast", "llama-3-8b:abacus", "-1"):
        with pytest.raises(kvsched.InvalidConfig):
            parse_step_time(bad)


def test_sim_options_need_the_simulated_model(tmp_path, capsys):
    from kvsched.cli import main

    toml = tmp_path / "t.toml"
    toml.write_text('[[tenant]]\nname = "a"\napi_key = "sk-a"\n')
    assert main(["serve", "--model", "tiny", "--tenants", str(toml), "--sim-step-ms", "5"]) == 2
    assert "--sim-step-ms is an option of --model simulated" in capsys.readouterr().err
    bad = ["serve", "--model", "simulated", "--tenants", str(toml), "--sim-step-cost", "x:y"]
    assert main(bad) == 2
    assert "MODEL:ACCELERATOR" in capsys.readouterr().err


# -- with SmolLM2's tokenizer -------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tok():
    pytest.importorskip("gguf")
    from kvsched import model_files
    from kvsched.engine.simulated import smollm2_tokenizer

    try:
        model_files.fetch(quiet=True)
    except model_files.ModelFetchError as e:
        pytest.skip(f"SmolLM2-135M-Instruct cannot be fetched: {e}")
    return smollm2_tokenizer()


@pytest.mark.model
def test_text_and_stop_strings_agree_with_overlap_on_and_off(smollm2_tok):
    """With SmolLM2's tokenizer: the tokens read as the text they walk, and
    stop strings (matched on the host, one step late overlapped) end the
    same requests at the same text both ways."""
    tok = smollm2_tok
    prompts = [tok.encode_chat([{"role": "user", "content": q}])
               for q in ("Tell me about the harbor.", "What happens in November?")]  # fmt: skip
    work = [("t", prompts[k % 2], SamplingParams(max_tokens=80, temperature=0.8, seed=k,
                                                 stop=["\n\n", " town"], logprobs=1))
            for k in range(8)]  # fmt: skip
    kw = dict(tokenizer=tok.tokenizer, eos_token_ids=tok.eos_token_ids, model=tok.model,
              cfg={"vocab_size": None, "max_seq_len": 256, "block_size": 16,
                   "max_batched_tokens": 256, "long_prefill_chunk": 64})  # fmt: skip
    serial = drive(engine(False, **kw), work)
    overlapped = drive(engine(True, **kw), work)
    assert list(serial.values()) == list(overlapped.values())
    texts = [g["text"] for g in serial.values()]
    assert any(g["reason"] == "stop" for g in serial.values())
    assert all(" town" not in t and "\n\n" not in t for t in texts)
    words = " ".join(texts).split()
    assert sum(w.strip(".,").isalpha() for w in words) > 0.8 * len(words), texts


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.model
def test_kvsched_serve_simulated_streams_a_chat(tmp_path, smollm2_tok):
    """`kvsched serve --model simulated --sim-step-ms 5`: a streaming chat
    through the official openai client, with top_p, a stop string and
    logprobs; /metrics carries the device's figures."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import urllib.request

    from serve_helpers import start_serve

    toml = tmp_path / "t.toml"
    toml.write_text('[[tenant]]\nname = "gold"\napi_key = "sk-sim"\n')
    proc, url = start_serve(["--model", "simulated", "--tenants", str(toml), "--sim-step-ms",
                             "5", "--max-seq-len", "256"], cwd=tmp_path)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-sim", max_retries=0)
        assert [m.id for m in client.models.list()] == ["simulated"]
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model="simulated", messages=[{"role": "user", "content": "Hello"}], stream=True,
            max_tokens=40, temperature=0.7, top_p=0.9, stop=["zzz"], logprobs=True,
            top_logprobs=2,
        )  # fmt: skip
        chunks = list(stream)
        wall = time.perf_counter() - t0
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
        choices = [c.choices[0] for c in chunks if c.choices]
        # a chunk may carry several tokens when the stream coalesces under
        # load: every one of the 40 tokens has its entry, in some chunk
        lps = [lp for ch in choices if ch.logprobs and ch.logprobs.content
               for lp in ch.logprobs.content]  # fmt: skip
        assert len(lps) == 40 and all(len(lp.top_logprobs) == 2 for lp in lps)
        assert "".join(lp.token for lp in lps) == text
        assert len(text.split()) >= 10, text
        assert wall >= 40 * 0.005  # 40 tokens, a 5 ms step each at least
        with urllib.request.urlopen(f"{url}/metrics") as r:
            metrics = r.read().decode()
        steps = [ln for ln in metrics.splitlines() if ln.startswith("kvsched_sim_device_steps")]
        assert steps and float(steps[0].split()[1]) >= 40
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log = proc.stdout.read()
    # Its warmup says what it does: one step, nothing compiled.
    assert "one step through the simulated device (nothing to compile)" in log, log[-2000:]
    assert "programs to compile" not in log
