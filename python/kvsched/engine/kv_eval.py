"""The int8 KV gate: measure what int8 KV does to a model's outputs before
serving with it.

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
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Thresholds the gate applies unless configured otherwise: int8 must reproduce
# at least 90% of the greedy tokens and move the chosen tokens' logprobs by at
# most 0.05 nats on average.
MIN_AGREEMENT = 0.90
MAX_MEAN_ABS_LOGPROB_DIFF = 0.05


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


class KVGateError(RuntimeError):
    """A quantized KV dtype was asked for without a passing evaluation."""


@dataclass
class KVEvalReport:
    kv_dtype: str
    checksum: str  # the weights the figures belong to
    model: str
    prompts: int
    tokens_per_prompt: int
    greedy_agreement: float
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    identical_prompts: int
    min_agreement: float = MIN_AGREEMENT
    max_mean_abs_logprob_diff: float = MAX_MEAN_ABS_LOGPROB_DIFF
    seconds: float = 0.0
    first_divergence: list[int | None] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            self.greedy_agreement >= self.min_agreement
            and self.mean_abs_logprob_diff <= self.max_mean_abs_logprob_diff
        )

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "passed": self.passed}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> KVEvalReport:
        d = json.loads(text)
        d.pop("passed", None)
        return cls(**d)


def report_path(checksum: str, kv_dtype: str, directory: Path | None = None) -> Path:
    """Where `kvsched eval-kv` keeps a report (KVSCHED_CACHE/kv-eval/...)."""
    from kvsched.model_files import cache_dir

    return (directory or cache_dir() / "kv-eval") / f"{checksum}-{kv_dtype}.json"


def load_report(checksum: str, kv_dtype: str) -> KVEvalReport | None:
    path = report_path(checksum, kv_dtype)
    if not path.is_file():
        return None
    return KVEvalReport.from_json(path.read_text())


def save_report(report: KVEvalReport) -> Path:
    path = report_path(report.checksum, report.kv_dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(report.to_json())
    tmp.replace(path)
    return path


def check_gate(
    report: KVEvalReport | None,
    *,
    kv_dtype: str,
    checksum: str,
    min_agreement: float = MIN_AGREEMENT,
    max_mean_abs_logprob_diff: float = MAX_MEAN_ABS_LOGPROB_DIFF,
) -> KVEvalReport:
    """The report if it is for these weights and this dtype and passes these
    thresholds; KVGateError saying what to run otherwise."""
    how = "run `kvsched eval-kv` (or pass kv_eval=evaluate_kv(...)) first"
    if report is None:
        raise KVGateError(f"kv_dtype={kv_dtype!r} needs a passing KV evaluation for weights "
                          f"{checksum}; none found: {how}")  # fmt: skip
    if report.checksum != checksum or report.kv_dtype != kv_dtype:
        raise KVGateError(
            f"the KV evaluation is for weights {report.checksum} / {report.kv_dtype}, not "
            f"{checksum} / {kv_dtype}: {how}"
        )
    passes = (report.greedy_agreement >= min_agreement
              and report.mean_abs_logprob_diff <= max_mean_abs_logprob_diff)  # fmt: skip
    if not passes:  # written so that a NaN figure fails
        raise KVGateError(
            f"kv_dtype={kv_dtype!r} fails the gate: greedy agreement "
            f"{report.greedy_agreement:.3f} (needs >= {min_agreement}), mean |logprob diff| "
            f"{report.mean_abs_logprob_diff:.4f} (needs <= {max_mean_abs_logprob_diff})"
        )
    return report


def _generate(engine: Any, prompts: list[list[int]], tokens: int) -> list[tuple[list, list]]:
    """Greedy (tokens, chosen-token logprobs) per prompt, all at once."""
    import kvsched
    from kvsched.engine.sampling import SamplingParams

    tenant = "kv-eval"
    engine.scheduler.add_tenant(kvsched.TenantConfig(tenant))
    params = SamplingParams(max_tokens=tokens, logprobs=0, ignore_eos=True)
    rids = [engine.submit(tenant, p, params) for p in prompts]
    got: dict[int, tuple[list, list]] = {r: ([], []) for r in rids}
    while engine.scheduler.live_requests:
        res = engine.step()
        if res is None:
            break
        for out in res.outputs:
            got[out.request_id][0].extend(out.token_ids)
            got[out.request_id][1].extend(lp.logprob for lp in out.logprobs or [])
    return [got[r] for r in rids]


def evaluate_kv(
    model: Any,
    params: Any,
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
    import kvsched
    from kvsched.engine.runner import Engine

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
    agreements, diffs, first = [], [], []
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
