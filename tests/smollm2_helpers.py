"""The real model for tests: SmolLM2-135M-Instruct's GGUF from the per-user cache,
fetched once; tests skip with the reason when it cannot be fetched."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def _load():
    from kvsched import model_files
    from kvsched.engine.loaders.gguf_llama import load_gguf

    path, why = _fetch()
    if path is None:
        return None, why
    return load_gguf(path, name=model_files.SMOLLM2_135M.model_name), None


def smollm2():
    """The loaded GGUFModel (config, params, tokenizer, chat template)."""
    model, why = _load()
    if model is None:
        pytest.skip(f"SmolLM2-135M-Instruct cannot be fetched: {why}")
    return model


@functools.cache
def _fetch():
    from kvsched import model_files

    try:
        return model_files.fetch(quiet=True), None
    except model_files.ModelFetchError as e:
        return None, str(e)


def smollm2_file():
    """The GGUF file's path, fetched, not loaded (for tests that start a process
    that loads it), or a skip saying why it cannot be fetched."""
    path, why = _fetch()
    if path is None:
        pytest.skip(f"SmolLM2-135M-Instruct cannot be fetched: {why}")
    return path
