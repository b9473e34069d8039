"""The engine behind `kvsched serve`: the model it serves and its scheduler shape,
and the `--end-at` time format."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kvsched

SMOLLM2_ID = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    engine: Any  # kvsched.engine.runner.Engine (cold)
    model_name: str
    aliases: tuple[str, ...]
    encode_chat: Callable[[list[dict[str, str]]], list[int]] | None


def load_model(
    which: str = "smollm2",
    *,
    max_seq_len: int = 1024,
    max_num_seqs: int = 16,
    num_blocks: int | None = None,
    max_batched_tokens: int = 256,
    max_logprobs: int = 5,
    backend: str = "reference",
    seed: int = 0,
    max_waiting: int = 64,
) -> LoadedModel:
    """A cold Engine for `kvsched serve`: SmolLM2-135M-Instruct from its GGUF file
    (tokenizer and chat template included), or `tiny`, a random-weight model with
    no tokenizer (completions by token ids only)."""
    from kvsched.engine.model import LlamaConfig, init_params
    from kvsched.engine.runner import Engine

    block = 16
    if num_blocks is None:  # every sequence at full length, plus the null page
        num_blocks = max_num_seqs * (-(-max_seq_len // block)) + 1
    cfg = kvsched.SchedulerConfig(
        num_blocks=num_blocks, block_size=block, max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens, max_seq_len=max_seq_len,
        long_prefill_chunk=min(max_batched_tokens, 256), max_waiting=max_waiting,
        overhead_reserve=0.0, ladder="default",
    )  # fmt: skip
    if which == "tiny":
        model = LlamaConfig()
        engine = Engine.create(model, init_params(model, seed=seed), cfg, backend=backend,
                               max_logprobs=max_logprobs, seed=seed)  # fmt: skip
        return LoadedModel(engine, model.name, ("tiny",), None)
    if which != "smollm2":
        raise ValueError(f"--model: smollm2 or tiny, not {which!r}")
    from kvsched import model_files
    from kvsched.engine.loaders.gguf_llama import load_gguf

    gg = load_gguf(model_files.fetch())
    eos = () if gg.eos_token_id is None else (gg.eos_token_id,)
    engine = Engine.create(gg.config, gg.params, cfg, backend=backend, tokenizer=gg.tokenizer,
                           eos_token_ids=eos, max_logprobs=max_logprobs, seed=seed)  # fmt: skip
    return LoadedModel(engine, SMOLLM2_ID, ("smollm2", gg.config.name), gg.encode_chat)


def parse_end_at(value: str) -> float:
    """`--end-at`: Unix seconds, or an ISO 8601 time (local time when it has no zone)."""
    from datetime import datetime

    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise ValueError(f"--end-at: Unix seconds or an ISO 8601 time, not {value!r}") from None
