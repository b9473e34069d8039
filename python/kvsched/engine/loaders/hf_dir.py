"""A Hugging Face Llama model directory, as `save_pretrained` writes it and the
hub serves it: config.json, the weights (model.safetensors, or shards named by
model.safetensors.index.json), the fast tokenizer (tokenizer.json), and what
the tokenizer's settings and the generation config say about special tokens
and the chat template.

- Config: `LlamaConfig.from_hf` (strict: a setting the engine does not
  implement is an error naming it). Weights: `load_llama_safetensors`.
- Tokenizer: tokenizer.json through `tokenizers` (a slow-only tokenizer, e.g.
  a lone tokenizer.model, is refused). The vocabulary may be smaller than the
  embedding (checkpoints pad it), never larger.
- Chat template: chat_template.jinja (transformers 4.43 and later save it
  there), else tokenizer_config.json's `chat_template` (a string, or a list of
  named templates: "default" is used). None when neither has one: the model
  then serves completions only.
- End of text: generation_config.json's `eos_token_id` (an id or a list),
  else config.json's, else tokenizer_config.json's `eos_token` looked up in the
  vocabulary. Every one of them stops a request.
- Sampling defaults: generation_config.json's `temperature`, `top_p` and
  `top_k`, the ones the engine implements, as vLLM reads them (its
  `do_sample` is not read: the values are the model's recommendation); a
  server uses them for a request that leaves them out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsched.engine.loaders.gguf_llama import encode_chat, render_chat_template
from kvsched.engine.loaders.safetensors_llama import load_llama_safetensors
from kvsched.engine.model import Params
from kvsched.engine.model_config import LlamaConfig, UnsupportedConfig


@dataclass
class HFModel:
    """What one model directory holds, read into the engine's types."""

    config: LlamaConfig
    params: Params
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    bos_token: str
    eos_token: str
    sampling_defaults: dict[str, float] = field(default_factory=dict)

    def encode_chat(
        self, messages: list[dict[str, str]], *, content_as_text: bool = True
    ) -> list[int]:
        """Token ids of the conversation, ready for the assistant's reply;
        control tokens inside a message's content are text (gguf_llama.encode_chat)."""
        if self.chat_template is None:
            raise UnsupportedConfig(f"{self.config.name} has no chat template")
        template = self.chat_template

        def render(msgs: list[dict[str, str]]) -> str:
            return render_chat_template(template, msgs, add_generation_prompt=True,
                                        bos_token=self.bos_token,
                                        eos_token=self.eos_token)  # fmt: skip

        return encode_chat(self.tokenizer, render, messages, content_as_text=content_as_text)


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON object was expected")
    return data


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an
    AddedToken dict with its `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory: the shards its index names
    (each once, in name order), or its one model.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(p.name for p in directory.iterdir())[:8]
    raise FileNotFoundError(
        f"{directory}: no model.safetensors nor model.safetensors.index.json (it holds "
        f"{', '.join(found) or 'nothing'}); only safetensors weights are read"
    )


def load_hf_dir(path: str | Path, *, dtype: str | None = None, name: str | None = None) -> HFModel:
    """Config, params, tokenizer, chat template and end-of-text ids from a model
    directory. `dtype`: as LlamaConfig.from_hf (default: the checkpoint's);
    `name`: the model's (default: the directory's name)."""
    from tokenizers import Tokenizer

    directory = Path(path)
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory}: a Hugging Face model directory was expected")
    cfg = _json(directory / "config.json")
    if not cfg:
        raise FileNotFoundError(f"{directory}: no config.json")
    config = LlamaConfig.from_hf(cfg, name or directory.resolve().name, dtype=dtype)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise UnsupportedConfig(
            f"{directory}: no tokenizer.json (only fast tokenizers are implemented; a "
            "tokenizer.model alone is not read)"
        )
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise UnsupportedConfig(
            f"{directory}: the tokenizer has {tokenizer.get_vocab_size()} tokens, more than "
            f"the model's {config.vocab_size} embedding rows"
        )
    tok_cfg = _json(directory / "tokenizer_config.json")
    template_file = directory / "chat_template.jinja"
    template: Any = (template_file.read_text() if template_file.is_file()
                     else tok_cfg.get("chat_template"))  # fmt: skip
    if isinstance(template, list):  # named templates
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory}: chat_template is neither a string nor named templates")
    bos, eos = _token_text(tok_cfg.get("bos_token")), _token_text(tok_cfg.get("eos_token"))
    generation = _json(directory / "generation_config.json")
    ids: Any = generation.get("eos_token_id")
    if ids is None:
        ids = cfg.get("eos_token_id")
    if ids is None and eos:
        ids = tokenizer.token_to_id(eos)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else ids
    if not all(isinstance(i, int) and 0 <= i < config.vocab_size for i in ids):
        raise ValueError(f"{directory}: eos_token_id {ids!r} is not a list of token ids")
    defaults = sampling_defaults(generation, directory / "generation_config.json")
    params = load_llama_safetensors(weight_files(directory), config)
    return HFModel(config, params, tokenizer, template, tuple(dict.fromkeys(ids)), bos, eos,
                   defaults)  # fmt: skip


def sampling_defaults(generation: dict[str, Any], where: Path) -> dict[str, float]:
    """temperature, top_p and top_k from a generation config, checked: a value
    the sampler would refuse for every request is refused here, naming it."""
    out: dict[str, float] = {}
    for key in ("temperature", "top_p", "top_k"):
        value = generation.get(key)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        ok = number and (
            (key == "temperature" and 0 <= value < float("inf"))
            or (key == "top_p" and 0 < value <= 1)
            or (key == "top_k" and value == int(value) and value >= 0)
        )
        if not ok:
            raise ValueError(f"{where}: {key} = {value!r} is not a usable sampling default")
        out[key] = int(value) if key == "top_k" else float(value)
    return out
