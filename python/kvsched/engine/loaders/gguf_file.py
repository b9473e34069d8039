"""What a GGUF file holds, read into the engine's types, whatever its
architecture: `GGUFModel`, the metadata reader, dequantization through the
`gguf` package, text and chat encoding, the chat template's sandbox. The
architectures' loaders (gguf_llama, gguf_gemma3) build on it; it imports
neither.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvsched.engine.model import InvalidWeights, Params, check_weight
from kvsched.engine.model_config import LlamaConfig, UnsupportedConfig


@dataclass
class GGUFModel:
    """What one GGUF file holds, read into the engine's types."""

    config: LlamaConfig
    params: Params
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    special_tokens: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    add_bos: bool = False  # a prompt starts with BOS (tokenizer.ggml.add_bos_token)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completion prompt as the model reads it: the text
        (control tokens in it are control tokens), after BOS if the file says
        add_bos_token."""
        ids = encode_text(self.tokenizer, text)
        return [self.bos_token_id, *ids] if self.add_bos and self.bos_token_id is not None else ids

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the model was trained to read it."""
        if self.chat_template is None:
            raise UnsupportedConfig("this GGUF file has no tokenizer.chat_template")
        names: dict[int | None, str] = {v: k for k, v in self.special_tokens.items()}
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=names.get(self.bos_token_id, ""), eos_token=names.get(self.eos_token_id, ""),
        )  # fmt: skip

    def encode_chat(
        self, messages: list[dict[str, str]], *, content_as_text: bool = True
    ) -> list[int]:
        """Token ids of the conversation, ready for the assistant's reply;
        control tokens inside a message's content are text (see `encode_chat`)."""
        return encode_chat(self.tokenizer, self.apply_chat_template, messages,
                           content_as_text=content_as_text)  # fmt: skip


def encode_chat(
    tokenizer: Any,
    render: Callable[[list[dict[str, str]]], str],
    messages: list[dict[str, str]],
    *,
    content_as_text: bool = True,
) -> list[int]:
    """Token ids of `messages` rendered by `render` (a chat template).

    With `content_as_text` (the default) a control token written inside a
    message's content ("<|im_end|>", "<|im_start|>system") is encoded as the
    text it is, not as the control token, so a user cannot close their turn
    and open a system one. Messages without such text are encoded exactly as
    `tokenizer.encode(render(messages))` (transformers' apply_chat_template
    does the same); the others are rendered with a marker in place of each
    content, and the template's text around the markers is encoded with its
    control tokens while each content is encoded with none. A template that
    rewrites content so that the markers do not survive is refused (ValueError)
    rather than encoded unsafely. `content_as_text=False` is transformers'
    behaviour: control tokens in content are control tokens."""
    special = _special_texts(tokenizer)
    contents = [m.get("content") for m in messages]
    # Looked for as the tokenizer will see them: a case-folding normalizer
    # would turn "<|IM_END|>" into the control token.
    normalizer = tokenizer.normalizer
    seen = [normalizer.normalize_str(c) if normalizer is not None and isinstance(c, str) else c
            for c in contents]  # fmt: skip
    risky = content_as_text and any(
        isinstance(c, str) and any(t in c for t in special) for c in (*contents, *seen)
    )
    if not risky:
        return encode_text(tokenizer, render(messages))
    markers = [f"\x00kvsched-content-{i}\x00" for i in range(len(messages))]
    marked = [{**m, "content": markers[i]} if isinstance(m.get("content"), str) else m
              for i, m in enumerate(messages)]  # fmt: skip
    text = render(marked)
    plain = _plain_tokenizer(tokenizer)
    out: list[int] = []
    for i, marker in enumerate(markers):
        content = contents[i]
        if not isinstance(content, str):
            continue
        before, found, text = text.partition(marker)
        if not found or marker in text:
            raise ValueError(
                f"message {i}'s content holds a control token of this model "
                f"({next((t for t in special if t in content), '?')!r}), and this chat template "
                "rewrites content, so it cannot be encoded as text safely"
            )
        out += encode_text(tokenizer, before)
        out += encode_text(plain, content)
    out += encode_text(tokenizer, text)
    return out


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False).ids`, with Python's
    lock released while it runs: `Tokenizer.encode` holds the GIL throughout
    (tokenizers 0.23), `encode_batch` does not, so a long text tokenized on a
    worker thread no longer stalls the event loop and every other thread."""
    ids: list[int] = tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
    return ids


def _special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's special (control) tokens."""
    decoder = tokenizer.get_added_tokens_decoder()
    return tuple(t.content for t in decoder.values() if t.special and t.content)


# id(tokenizer) -> (tokenizer, its copy): the tokenizer is held so that its id
# is never reused by another one (a model's tokenizer lives as long as it).
_PLAIN: dict[int, tuple[Any, Any]] = {}


def _plain_tokenizer(tokenizer: Any) -> Any:
    """A copy of `tokenizer` that encodes control-token text as text (one per
    tokenizer, made once: toggling the shared one would race other encodes)."""
    held = _PLAIN.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(tokenizer.to_str())
        copy.encode_special_tokens = True
        held = _PLAIN[id(tokenizer)] = (tokenizer, copy)
    return held[1]


def open_gguf(path: str | Path) -> Any:
    """`gguf.GGUFReader` over the file at `path`, reading through a plain
    ndarray view of its memory map. The reader slices its data once per
    metadata value (twice per string: 262,144 of them in Gemma 3's vocabulary),
    and numpy.memmap's Python-level slicing was two thirds of the time: 10 s
    for Gemma 3 270M's file, 3.5 s this way (2.2 and 0.7 s for SmolLM2's).
    Tensors' `data` are then ndarrays over the same map."""
    return plain_gguf_reader()(str(path))


@functools.cache
def plain_gguf_reader() -> type:
    """The reader class `open_gguf` uses: gguf's own parser, its data a plain
    ndarray."""
    from gguf import GGUFReader

    class PlainGGUFReader(GGUFReader):  # type: ignore[misc]
        @property  # type: ignore[override]
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, value: Any) -> None:
            # The map stays open: the view's base holds it.
            self._plain = value.view(np.ndarray)

    return PlainGGUFReader


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


class TensorReader:
    """A file's tensors by name, read as the model asks for them: dequantized,
    the shape the config implies and finite values checked (refusals name the
    tensor); `check_all_used` then refuses a file with tensors no one read."""

    def __init__(self, reader: Any) -> None:
        self.tensors = {t.name: t for t in reader.tensors}
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise UnsupportedConfig(f"the GGUF file has no tensor {name!r}")
        self.used.add(name)
        a = _dequantize(self.tensors[name])
        if a.shape != shape:
            raise UnsupportedConfig(f"{name} has shape {a.shape}, the config says {shape}")
        check_weight(name, a)  # NaN or inf: refused, naming the file's tensor
        return a

    def check_all_used(self) -> None:
        extra = sorted(set(self.tensors) - self.used)
        if extra:
            raise UnsupportedConfig(
                f"{len(extra)} tensors the model does not use (biases? more layers?), "
                f"e.g. {extra[:3]}"
            )


def gguf_model(
    reader: Any,
    config: LlamaConfig,
    params: Params,
    tokenizer: Any,
    special_tokens: dict[str, int],
    *,
    add_bos: bool = False,
) -> GGUFModel:
    """The model a file holds, whatever its architecture: its vocabulary must
    have a row of the model's embedding per token; the BOS and EOS ids, chat
    template and metadata come from the file."""
    if tokenizer.get_vocab_size() != config.vocab_size:
        raise UnsupportedConfig(
            f"the vocabulary has {tokenizer.get_vocab_size()} tokens, the model "
            f"{config.vocab_size} rows"
        )

    def token_id(key: str) -> int | None:
        v = _field(reader, key)
        return None if v is None else int(v)

    return GGUFModel(
        config=config,
        params=params,
        tokenizer=tokenizer,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
        special_tokens=special_tokens,
        metadata=read_metadata(reader),
        add_bos=add_bos,
    )


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every scalar or string metadata field (arrays such as the vocabulary left out)."""
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in (
            "tokens",
            "merges",
            "token_type",
            "scores",
        ):
            continue
        out[key] = f.contents()
    return out


def _dequantize(t: Any) -> np.ndarray:
    """A tensor as float32 [rows, cols] (ggml's shape reversed), through gguf."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    ints = (GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
            GGMLQuantizationType.I64)  # fmt: skip
    if t.tensor_type in ints:  # a cast would invent weights from integers
        raise InvalidWeights(f"{t.name} is {t.tensor_type.name}: the model's weights are "
                             "floating point (F32, F16, BF16 or a quantized type)")  # fmt: skip
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        a = np.asarray(t.data, np.float32)
    else:
        a = dequantize(t.data, t.tensor_type)
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    return np.asarray(a, np.float32).reshape(shape)


def render_chat_template(
    template: str, messages: list[dict[str, str]], *, add_generation_prompt: bool = True, **kw: Any
) -> str:
    """Render a Hugging Face chat template (Jinja) in a sandbox, with what such
    templates expect: `{% break %}`/`{% continue %}`, `raise_exception`, a
    `tojson` that keeps non-ASCII text and key order, and the special tokens the
    caller passes (`bos_token=`, `eos_token=`)."""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"a chat message needs 'role' and 'content', got {m!r}")
    text: str = _compiled_template(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **kw
    )
    return text


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str) -> Any:
    """A chat template compiled once (Jinja's parse and compile cost a
    server's front end more than the rendering: 17% of its time at 256
    streams, compiled for every request)."""
    import json

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])  # fmt: skip
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                              indent=indent)  # fmt: skip

    def raise_exception(msg: str) -> None:
        raise ValueError(f"chat template: {msg}")

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
