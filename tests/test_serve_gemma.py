"""`kvsched serve --model gemma3-270m`: Gemma 3 270M (a base model, its window
and global layers in KV-cache groups) serves completions through the official
openai client with transformers' greedy tokens (tests/data/gemma3_golden.json),
BOS first as the file says; a chat is refused, the model having no template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")
openai = pytest.importorskip("openai")

from gemma3_helpers import gemma3_270m  # noqa: E402

from serve_helpers import start_serve  # noqa: E402

pytestmark = [pytest.mark.gemma, pytest.mark.slow, pytest.mark.subprocess]

KEY = "sk-gemma"
GOLDEN = json.loads((Path(__file__).parent / "data" / "gemma3_golden.json").read_text("utf-8"))


def test_gemma3_serves_transformers_greedy_completions_and_refuses_chat(tmp_path):
    gg = gemma3_270m()  # fetched once (or a skip saying why not)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nname = "t"\napi_key = "{KEY}"\n')
    proc, url = start_serve(
        ["--model", "gemma3-270m", "--tenants", str(tenants), "--max-seq-len", "256",
         "--max-num-seqs", "4", "--max-batched-tokens", "64", "--log-level", "warning"],
        timeout=400,
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        names = [m.id for m in client.models.list().data]
        assert "gemma3-270m" in names or any("gemma" in n.lower() for n in names), names
        for p in GOLDEN["prompts"][:3]:
            got = client.completions.create(model="gemma3-270m", prompt=p["text"], max_tokens=8,
                                            temperature=0.0,
                                            extra_body={"return_token_ids": True})  # fmt: skip
            assert got.choices[0].model_extra["token_ids"] == p["greedy"][:8], p["text"]
            assert got.usage.prompt_tokens == len(p["ids"]), "BOS first, as transformers reads it"
            assert got.choices[0].text == gg.tokenizer.decode(p["greedy"][:8])
        hi = [{"role": "user", "content": "Hi"}]
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(model="gemma3-270m", max_tokens=4, messages=hi)
    finally:
        proc.terminate()
        proc.wait(60)
