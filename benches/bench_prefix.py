"""Prefix-cache lookup + admission: submit (and cancel) a 2048-token prompt whose
first 1024 tokens are cached, beside a pure-Python cache of the same design
(baselines.PyPrefixAdmission), and beside kvsched with nothing cached and with
caching off, so the cost of the lookup itself shows.

Run: python -m pytest benches/bench_prefix.py --benchmark-enable --benchmark-group-by=group
"""

import numpy as np
import pytest
from baselines import PyPrefixAdmission, PyTenant

import kvsched

NUM_BLOCKS, BLOCK = 8192, 16
PROMPT, CACHED = 2048, 1024
GROUP = f"prefix cache: submit + cancel, {PROMPT}-token prompt, first {CACHED} cached"


def prompt_pair() -> tuple[np.ndarray, np.ndarray]:
    """The prompt that warms the cache and the one benchmarked: equal for CACHED tokens."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 32000, PROMPT, dtype=np.int32)
    other = base.copy()
    other[CACHED:] = rng.integers(0, 32000, PROMPT - CACHED, dtype=np.int32)
    return base[: CACHED + 1], other


# The prompts' ids are below 32,000: the vocabulary an engine would declare
# (Engine.create always sets vocab_size). Declared, ids are checked against
# it and, at most 65,536 ids, named two bytes a token: the "_vocab" kinds.
VOCAB = 32000


def warmed_kvsched(caching: bool, warm: bool, vocab_size: int | None = None) -> kvsched.Scheduler:
    s = kvsched.Scheduler(
        kvsched.SchedulerConfig(
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK,
            max_num_seqs=256,
            max_seq_len=8192,
            max_batched_tokens=2048,
            prefix_caching=caching,
            vocab_size=vocab_size,
        )  # fmt: skip
    )
    s.add_tenant(kvsched.TenantConfig("t"))
    if warm:
        warm_prompt, _ = prompt_pair()
        s.submit("t", warm_prompt, 1, now=0.0)
        while s.live_requests:
            plan = s.step(now=0.0)
            s.commit(plan, np.zeros(len(plan), np.int32), now=0.0)
    return s


def make(kind: str):
    if kind == "python":
        s = PyPrefixAdmission(NUM_BLOCKS, BLOCK, 8192, 256)
        s.tenants["t"] = PyTenant(None)
        s.warm("t", prompt_pair()[0])
        return s
    vocab = VOCAB if kind.endswith("_vocab") else None
    kind = kind.removesuffix("_vocab")
    return warmed_kvsched(caching=kind != "kvsched_off", warm=kind != "kvsched_cold",
                          vocab_size=vocab)  # fmt: skip


def varied(n: int = 64, shared: bool = True) -> list[np.ndarray]:
    """`n` prompts of PROMPT tokens: the cached CACHED-token prefix and a fresh
    rest each (a shared system prompt, different user text), or (`shared`
    False) nothing in common. The benchmarked prompt above repeats one prompt,
    which the names memo serves whole; these show what it does when the rest
    differs, and what it costs when nothing repeats."""
    rng = np.random.default_rng(1)
    base = prompt_pair()[1]
    out = []
    for _ in range(n):
        p = rng.integers(0, 32000, PROMPT, dtype=np.int32)
        if shared:
            p[:CACHED] = base[:CACHED]
        out.append(p)
    return out


@pytest.mark.parametrize(
    "kind", ["kvsched", "kvsched_vocab", "kvsched_cold", "kvsched_off", "python"]
)
@pytest.mark.benchmark(group=GROUP)
def test_lookup_and_admission(benchmark, kind):
    sched = make(kind)
    _, prompt = prompt_pair()

    def once():
        sched.cancel(sched.submit("t", prompt, 256, now=1.0))

    benchmark(once)
    # Every benchmarked submit hit exactly the cached half (or nothing, cold/off).
    if kind == "python":
        assert len(sched.lookup("t", prompt)) == CACHED // BLOCK
    else:
        pc = sched.stats(now=1.0)["tenants"]["t"]["prefix_cache"]
        if kind in ("kvsched", "kvsched_vocab"):
            # The warm-up request looked up 64 blocks, each benchmarked one 127.
            submits = (pc["query_blocks"] - CACHED // BLOCK) // ((PROMPT - 1) // BLOCK)
            assert pc["hit_blocks"] == (CACHED // BLOCK) * submits > 0
        else:
            assert pc["hit_blocks"] == 0
