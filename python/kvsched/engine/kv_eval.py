"""The int8 KV evaluation: measure what int8 KV does to a model's outputs
before serving with it.

`evaluate_kv` runs the same prompts greedily through two engines over the same
weights, one with float32 KV (the reference) and one with the candidate KV
dtype, and reports:

- greedy agreement: the share of the reference's generated tokens that the
  candidate reproduces before it first diverges (averaged over prompts; a
  prompt that diverges at token 3 of 32 agrees on 3/32);
- mean |logprob difference|: over every token both runs generated before
  diverging, |log p_ref(token) - log p_candidate(token)|, the model's own
  log-probability of the token it chose (a shift in confidence that has not yet
  flipped an argmax shows up here first).

A report passes when agreement >= `min_agreement` and the logprob difference
<= `max_mean_abs_logprob_diff`. `kvsched eval-kv` runs it on the real model and
saves the report under the cache directory, keyed by the weights' checksum;
`Engine(kv_dtype="int8")` refuses to start without a passing report for its
weights (or one handed to it directly).

The report and the gate's check are kvsched.engine.kv_gate, which the runner
imports; this module runs engines, so it imports the runner (never the other
way) and re-exports the gate's names for its callers.
"""

from __future__ import annotations

import time

import numpy as np

import kvsched
from kvsched.engine.kv_gate import (
    MAX_MEAN_ABS_LOGPROB_DIFF,
    MIN_AGREEMENT,
    KVEvalReport,
    KVGateError,
    check_gate,
    load_report,
    report_path,
    save_report,
)
from kvsched.engine.model import LlamaConfig, Params
from kvsched.engine.runner import Engine
from kvsched.engine.sampling import SamplingParams

__all__ = [
    "EVAL_PROMPTS",
    "MAX_MEAN_ABS_LOGPROB_DIFF",
    "MIN_AGREEMENT",
    "KVEvalReport",
    "KVGateError",
    "check_gate",
    "evaluate_kv",
    "load_report",
    "report_path",
    "save_report",
]

# Real chat prompts for evaluations and peer checks (chat-templated by the caller).
EVAL_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 10.",
    "Who wrote the play Hamlet?",
    "What is 17 times 23?",
    "Give me one tip for sleeping well.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
)


def _generate(
    engine: Engine, prompts: list[list[int]], tokens: int
) -> list[tuple[list[int], list[float]]]:
    """Greedy (tokens, chosen-token logprobs) per prompt, all at once."""
    tenant = "kv-eval"
    engine.scheduler.add_tenant(kvsched.TenantConfig(tenant))
    params = SamplingParams(max_tokens=tokens, logprobs=0, ignore_eos=True)
    rids = [engine.submit(tenant, p, params) for p in prompts]
    got: dict[int, tuple[list[int], list[float]]] = {r: ([], []) for r in rids}
    while engine.scheduler.live_requests:
        res = engine.step()
        if res is None:
            break
        for out in res.outputs:
            got[out.request_id][0].extend(out.token_ids)
            got[out.request_id][1].extend(lp.logprob for lp in out.logprobs or [])
    return [got[r] for r in rids]


def evaluate_kv(
    model: LlamaConfig,
    params: Params,
    prompts: list[list[int]],
    *,
    kv_dtype: str = "int8",
    tokens: int = 32,
    min_agreement: float = MIN_AGREEMENT,
    max_mean_abs_logprob_diff: float = MAX_MEAN_ABS_LOGPROB_DIFF,
    block_size: int = 16,
) -> KVEvalReport:
    """Greedy agreement and mean |logprob difference| of `kv_dtype` KV against
    float32 KV on `prompts` (token id lists), `tokens` generated each."""
    t0 = time.perf_counter()
    longest = max(len(p) for p in prompts) + tokens
    cfg = kvsched.SchedulerConfig(
        num_blocks=len(prompts) * -(-longest // block_size) + 2,
        block_size=block_size,
        max_num_seqs=max(1, len(prompts)),
        max_batched_tokens=256,
        max_seq_len=-(-longest // block_size) * block_size,
        overhead_reserve=0.0,
        max_waiting=max(1, len(prompts)),
    )
    runs = []
    checksum = ""
    for dtype in ("float32", kv_dtype):
        eng = Engine.create(model, params, cfg, kv_dtype=dtype, max_logprobs=1,
                            kv_eval="unchecked")  # fmt: skip
        checksum = eng.checksum
        eng.warmup(progress=False)
        runs.append(_generate(eng, prompts, tokens))
    agreements: list[float] = []
    diffs: list[float] = []
    first: list[int | None] = []
    for (ref_ids, ref_lp), (ids, lp) in zip(runs[0], runs[1], strict=True):
        n = next((i for i, (a, b) in enumerate(zip(ref_ids, ids, strict=False)) if a != b), None)
        same = len(ref_ids) if n is None else n
        first.append(n)
        agreements.append(same / max(1, len(ref_ids)))
        diffs.extend(abs(a - b) for a, b in zip(ref_lp[:same], lp[:same], strict=True))
    return KVEvalReport(
        kv_dtype=kv_dtype,
        checksum=checksum,
        model=model.name,
        prompts=len(prompts),
        tokens_per_prompt=tokens,
        greedy_agreement=float(np.mean(agreements)),
        mean_abs_logprob_diff=float(np.mean(diffs)) if diffs else 0.0,
        max_abs_logprob_diff=float(np.max(diffs)) if diffs else 0.0,
        identical_prompts=sum(1 for n in first if n is None),
        min_agreement=min_agreement,
        max_mean_abs_logprob_diff=max_mean_abs_logprob_diff,
        seconds=time.perf_counter() - t0,
        first_divergence=first,
    )
