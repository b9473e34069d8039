"""The int8 KV gate: the evaluation report, where it is kept, and the check
`Engine(kv_dtype="int8")` applies before it starts.

A report passes when greedy agreement >= `min_agreement` and the mean
|logprob difference| <= `max_mean_abs_logprob_diff` (kvsched.engine.kv_eval
explains both figures and produces the report). Its own module because the
engine checks reports while the evaluation runs engines: with both in one
module, the runner and the evaluation imported each other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Thresholds the gate applies unless configured otherwise: int8 must reproduce
# at least 90% of the greedy tokens and move the chosen tokens' logprobs by at
# most 0.05 nats on average.
MIN_AGREEMENT = 0.90
MAX_MEAN_ABS_LOGPROB_DIFF = 0.05


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
