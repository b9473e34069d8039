"""The engine behind `kvsched serve`: the model it serves and its scheduler shape,
and the `--end-at` time format."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kvsched
from kvsched.model_files import SMOLLM2_135M

SMOLLM2_ID = SMOLLM2_135M.model_name


@dataclass
class LoadedModel:
    engine: Any  # kvsched.engine.runner.Engine (cold)
    model_name: str
    aliases: tuple[str, ...]
    encode_chat: Callable[[list[dict[str, str]]], list[int]] | None
    # The model's own defaults for what a request leaves out (temperature, top_p,
    # top_k): a Hugging Face directory's generation_config.json; none for GGUF.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # A completion's text as the model reads it (a GGUF file's: BOS first where
    # the file says so); None: the text's tokens alone.
    encode_prompt: Callable[[str], list[int]] | None = None


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
    devices: int = 1,
    dtype: str = "float32",
    block_size: int = 16,
    scheduler: dict[str, Any] | None = None,
    overlap: bool = True,
    sim_step_time: Any = 0.01,
    sim_eos_rate: float = 0.0,
) -> LoadedModel:
    """A cold Engine for `kvsched serve`. `which`: "smollm2" (SmolLM2-135M-Instruct
    from its GGUF file, fetched once into the cache), "gemma3-270m" (Gemma 3
    270M, a base model: completions only, its sliding-window and global layers
    in KV-cache groups; fetched once), "tiny" (a random-weight
    model with no tokenizer: completions by token ids only), "simulated" (the
    stand-in model of kvsched.engine.simulated: SmolLM2's tokenizer and chat
    template, a device step that costs `sim_step_time`, seconds or a
    kvsched.sim.StepCost, and tokens that walk a text, the end of text at
    `sim_eos_rate`), or the path of a
    Llama-architecture GGUF file (its tokenizer, chat template and end-of-text
    token come from the file; served under the file's general.name, or its
    name without the extension, with its file name as an alias), or of a Hugging
    Face Llama model directory (kvsched.engine.loaders.hf_dir; served under the
    directory's name). `devices` > 1:
    tensor parallelism over the first `devices` local devices
    (kvsched.engine.sharding); `dtype` is the weights' and activations'
    ("float32" or "bfloat16"). `scheduler`: SchedulerConfig knobs over the
    server's defaults (a tenants file's [scheduler] table); the server's
    defaults protect tier 0: preempt_lower_tiers on, the default ladder. A bad
    choice is kvsched.InvalidConfig before anything loads. `overlap`: overlapped
    scheduling (Engine(overlap=...)), on by default."""
    from pathlib import Path

    import jax

    from kvsched import model_files
    from kvsched.engine.model import LlamaConfig, init_params
    from kvsched.engine.runner import Engine
    from kvsched.engine.sharding import make_mesh

    fetched = which in ("smollm2", "gemma3-270m")
    path = None if fetched or which in ("tiny", "simulated") else Path(which)
    if path is not None and not (path.is_file() or (path / "config.json").is_file()):
        raise kvsched.InvalidConfig(
            f"--model: smollm2, gemma3-270m, tiny, the path of a GGUF file or of a Hugging "
            f"Face model directory (with its config.json), or simulated (a stand-in); {which!r} "
            "is none of them"
        )
    if dtype not in ("float32", "bfloat16"):
        raise kvsched.InvalidConfig(f"--dtype: float32 or bfloat16, not {dtype!r}")
    if not 1 <= devices <= len(jax.devices()):
        raise kvsched.InvalidConfig(
            f"--devices {devices}: this machine has {len(jax.devices())} "
            f"{jax.default_backend()} device(s)"
        )
    mesh = make_mesh(devices) if devices > 1 else None
    # --num-blocks is the pool's size wherever it runs; without it, an
    # accelerator's free memory sizes the pool (every sequence at full length,
    # plus the null page, on CPU).
    pool = "memory" if num_blocks is None else "configured"
    if num_blocks is None:
        seqs = int((scheduler or {}).get("max_num_seqs", max_num_seqs))
        num_blocks = seqs * (-(-max_seq_len // block_size)) + 1
    knobs: dict[str, Any] = {
        "max_num_seqs": max_num_seqs, "max_batched_tokens": max_batched_tokens,
        "long_prefill_chunk": min(max_batched_tokens, 256), "max_waiting": max_waiting,
        "overhead_reserve": 0.0, "ladder": "default",
        # A waiting higher tier takes the running slot of the lowest tier's newest
        # sequence (which keeps its KV and its place): without it, a lower tier
        # that fills the running set holds tier 0 back until its requests end.
        "preempt_lower_tiers": True,
        **(scheduler or {}),
    }  # fmt: skip
    overrides = scheduler or {}
    if "max_batched_tokens" in overrides and "long_prefill_chunk" not in overrides:
        knobs["long_prefill_chunk"] = min(knobs["max_batched_tokens"], 256)
    cfg = kvsched.SchedulerConfig(num_blocks=num_blocks, block_size=block_size,
                                  max_seq_len=max_seq_len, **knobs)  # fmt: skip
    if which == "simulated":
        from kvsched.engine.simulated import simulated_engine, smollm2_tokenizer

        tok = smollm2_tokenizer()
        sim = simulated_engine(cfg, sim_step_time, tokenizer=tok.tokenizer,
                               eos_token_ids=tok.eos_token_ids, eos_rate=sim_eos_rate,
                               max_logprobs=max_logprobs, seed=seed, overlap=overlap,
                               model=tok.model)  # fmt: skip
        return LoadedModel(sim, tok.model.name, (), tok.encode_chat)
    common: dict[str, Any] = {"backend": backend, "max_logprobs": max_logprobs, "seed": seed,
                              "mesh": mesh, "pool": pool, "overlap": overlap}  # fmt: skip
    if which == "tiny":
        model = LlamaConfig(dtype=dtype)
        engine = Engine.create(model, init_params(model, seed=seed), cfg, **common)
        return LoadedModel(engine, model.name, ("tiny",), None)
    if path is not None and path.is_dir():
        from kvsched.engine.loaders.hf_dir import load_hf_dir

        hf = load_hf_dir(path, dtype=dtype)
        engine = Engine.create(hf.config, hf.params, cfg, tokenizer=hf.tokenizer,
                               eos_token_ids=hf.eos_token_ids, **common)  # fmt: skip
        return LoadedModel(engine, hf.config.name, (),
                           hf.encode_chat if hf.chat_template else None,
                           dict(hf.sampling_defaults))  # fmt: skip
    from kvsched.engine.loaders.gguf_llama import load_gguf

    if path is None:  # named as its model card and this README name it, not by general.name
        file = model_files.MODELS["smollm2-135m" if which == "smollm2" else which]
        gg = load_gguf(model_files.fetch(file), dtype=dtype, name=file.model_name)
    else:
        gg = load_gguf(path, dtype=dtype)
    if path is not None and "general.name" not in gg.metadata:
        gg.config = dataclasses.replace(gg.config, name=path.stem)
    eos = () if gg.eos_token_id is None else (gg.eos_token_id,)
    engine = Engine.create(gg.config, gg.params, cfg, tokenizer=gg.tokenizer,
                           eos_token_ids=eos, **common)  # fmt: skip
    encode_chat = gg.encode_chat if gg.chat_template else None
    if which == "smollm2":
        return LoadedModel(engine, SMOLLM2_ID, ("smollm2",), encode_chat,
                           encode_prompt=gg.encode_prompt)  # fmt: skip
    if path is None:
        return LoadedModel(engine, gg.config.name, (which,), encode_chat,
                           encode_prompt=gg.encode_prompt)  # fmt: skip
    aliases = tuple(dict.fromkeys(a for a in (path.name, path.stem) if a != gg.config.name))
    return LoadedModel(engine, gg.config.name, aliases, encode_chat,
                       encode_prompt=gg.encode_prompt)  # fmt: skip


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
