"""A Hugging Face model directory as transformers' `save_pretrained` writes it
(sharded safetensors, tokenizer.json, the chat template, generation_config),
loaded by kvsched.engine.loaders.hf_dir and served by `kvsched serve --model
DIR`: the chat prompt equals transformers' own `apply_chat_template`, and the
server's greedy tokens, through the official openai client, equal
transformers' `generate` on the same weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("jax")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from gguf_helpers import CHATML, byte_level_vocab  # noqa: E402

import kvsched  # noqa: E402
from kvsched.engine.loaders.hf_dir import load_hf_dir, weight_files  # noqa: E402
from kvsched.engine.model_config import UnsupportedConfig  # noqa: E402

KEY = "sk-hf"
CHAT = [{"role": "user", "content": "hello world"}]


def _tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges, _ = byte_level_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in tokens[:2]])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random tiny LlamaForCausalLM (unit-scale weights, so greedy tokens are
    far from ties) with a byte-level tokenizer, saved in 3+ shards."""
    path = tmp_path_factory.mktemp("hf") / "tiny-chat"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path, max_shard_size="100KB")
    tok = _tokenizer()
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return path, model, tok


def _generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                             pad_token_id=1)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_the_directory_loads_as_transformers_reads_it(model_dir):
    path, model, tok = model_dir
    shards = weight_files(path)
    assert len(shards) >= 3, "save_pretrained sharded the weights"
    hf = load_hf_dir(path)
    assert hf.config.name == "tiny-chat" and hf.eos_token_ids == (1,)
    assert (hf.bos_token, hf.eos_token) == ("<|im_start|>", "<|im_end|>")
    want = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert hf.tokenizer.decode(hf.encode_chat(CHAT), skip_special_tokens=False) == want
    assert hf.encode_chat(CHAT) == tok.encode(want, add_special_tokens=False)
    # The embedding as transformers holds it, whichever shard it came from.
    np.testing.assert_array_equal(np.asarray(hf.params["embed"]),
                                  model.model.embed_tokens.weight.detach().numpy())  # fmt: skip


@pytest.mark.subprocess
def test_a_directory_served_generates_what_transformers_generates(tmp_path, model_dir):
    from serve_helpers import start_serve

    openai = pytest.importorskip("openai")
    path, model, tok = model_dir
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nname = "t"\napi_key = "{KEY}"\n')
    proc, url = start_serve(
        ["--model", str(path), "--tenants", str(tenants), "--max-seq-len", "128",
         "--max-num-seqs", "4", "--max-batched-tokens", "64",
         "--checkpoint", str(tmp_path / "ck.jsonl"), "--log-level", "warning"],
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        got = client.completions.create(model="tiny-chat", prompt="hello world", max_tokens=16,
                                        temperature=0.0,
                                        extra_body={"return_token_ids": True})  # fmt: skip
        prompt = tok.encode("hello world", add_special_tokens=False)
        want = _generate(model, prompt, 16)
        assert len(want) == 16 and len(set(want)) > 4, f"a telling sequence: {want}"
        assert got.choices[0].model_extra["token_ids"] == want
        assert got.choices[0].text == tok.decode(want)
        chat = client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=16,
                                              temperature=0.0,
                                              extra_body={"return_token_ids": True})  # fmt: skip
        ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        want = _generate(model, tok.encode(ids, add_special_tokens=False), 16)
        assert chat.choices[0].model_extra["token_ids"] == want
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_incomplete_or_inconsistent_directory_is_refused_naming_what(tmp_path, model_dir):
    import shutil

    from kvsched.serve.server import load_model

    path, _, _ = model_dir
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedConfig, match="no tokenizer.json"):
        load_hf_dir(broken)
    # A tensor in two shards.
    shutil.copytree(path, broken, dirs_exist_ok=True)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    shutil.copy(broken / first, broken / second)
    with pytest.raises(ValueError, match="in another shard too"):
        load_hf_dir(broken)
    (broken / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf_dir(broken)
    with pytest.raises(kvsched.InvalidConfig, match="Hugging Face model directory"):
        load_model(str(tmp_path))  # a directory without config.json
