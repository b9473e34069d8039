"""Checkpoint loaders: each reads one format into the engine's LlamaConfig and
params (kvsched.engine.model), strictly: a tensor or a setting the model does not
implement is an error naming it, never silently ignored.

- `safetensors_llama`: a Hugging Face Llama checkpoint (config.json + safetensors).
- `gguf_llama`: a GGUF file (weights dequantized by the `gguf` package, tokenizer
  and chat template from its metadata).
- `hf_dir`: a Hugging Face model directory (config.json, one or several
  safetensors files, tokenizer.json, the chat template and end-of-text ids).
"""

from __future__ import annotations

from pathlib import Path


def model_file(path: str | Path, kind: str, magic: bytes | None = None) -> Path:
    """`path` as a regular file of `kind` ("GGUF", "safetensors"), or a clear
    error: FileNotFoundError (missing), IsADirectoryError (a directory: name the
    file inside it), ValueError (a device, a FIFO, or a file that does not start
    with the format's `magic`). Without this, a directory reaches numpy's memory
    map as `OSError: No such device`, and a FIFO blocks the reader forever."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file (a {kind} file was expected)")
    if p.is_dir():
        raise IsADirectoryError(f"{p} is a directory: pass the {kind} file itself")
    if not p.is_file():
        raise ValueError(f"{p} is not a regular file (a device or a FIFO?): a {kind} file "
                         "was expected")  # fmt: skip
    if magic is not None:
        with open(p, "rb") as f:
            head = f.read(len(magic))
        if head != magic:
            raise ValueError(f"{p} is not a {kind} file (it starts with {head!r}, not {magic!r})")
    return p
