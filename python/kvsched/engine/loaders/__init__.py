"""Checkpoint loaders: each reads one format into the engine's LlamaConfig and
params (kvsched.engine.model), strictly: a tensor or a setting the model does not
implement is an error naming it, never silently ignored.

- `safetensors_llama`: a Hugging Face Llama checkpoint (config.json + safetensors).
- `gguf_llama`: a GGUF file (weights dequantized by the `gguf` package, tokenizer
  and chat template from its metadata).
"""
