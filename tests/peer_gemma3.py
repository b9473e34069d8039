"""Peer check: kvsched's Gemma 3 270M against transformers on the same GGUF file
(CPU torch, float32), the independent implementation.

    python tests/peer_gemma3.py [--tokens 24] [--lengths 600,1200,2000] [--chunk 200]
                                [--golden tests/data/gemma3_golden.json]

1. Architecture: transformers' `layer_types` and sliding_window against the
   config's layer kinds (derived from llama.cpp's every-sixth-layer rule).
2. Tokenization: kvsched's tokenizer (a `tokenizers` BPE built from the GGUF's
   SentencePiece vocabulary) gives transformers' ids, BOS included, on awkward
   strings (digits, whitespace runs, emoji, non-Latin scripts) and every prompt.
3. Logits: `forward_dense` against transformers at every position of the short
   prompts, and at positions before, at and past the 512-token window of the
   long ones (the max |difference| and the logit scale are reported).
4. Greedy: `--tokens` tokens per prompt through `forward_paged` with the model's
   KV-cache groups (kvsched.shapes.group_layers: a full group and five
   sliding-window groups), driven by hand-built step plans (tests/gemma3_helpers.py:
   chunked prefill of `--chunk` tokens, smaller than the window, several
   sequences per step, out-of-window pages returned to the pool and poisoned),
   against transformers' `generate(do_sample=False)` one prompt at a time:
   identical token for token, long prompts (--lengths tokens and more) included.
5. `--golden PATH` writes what transformers produced (prompt texts, their ids,
   greedy tokens, and logits rows: top 16 and 64 fixed ids) for
   tests/test_gemma3_golden.py, so CI without torch still checks the model
   against transformers' numbers.

`--against-golden tests/data/gemma3_golden.json` runs transformers alone and
checks it still computes what that file says (1-4 against the file's ids,
logits and greedy tokens): what tests/test_gemma3_peer.py runs in CI, where
tests/test_gemma3_golden.py checks kvsched against the same file.

Prints a summary and, last, one JSON line (what tests/test_gemma3_peer.py reads).
Needs torch, transformers and accelerate (not kvsched dependencies).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

AWKWARD = [
    "1234567890 apples, 3.14159 and 1e-9",
    "  leading spaces\n\ttabs   and     runs      of spaces",
    "naïve café — 你好，世界 🙂",
    "Привет, мир! مرحبا بالعالم שלום עולם नमस्ते दुनिया",
    "emoji 👩‍👩‍👧‍👦 🇫🇷 🤖✨ and ZWJ",
    "日本語のテキストです。한국어 텍스트 ภาษาไทย",
    "def f(x):\n    return x**2  # square\n\n\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<b>bold</b>",
    "𝔹𝕠𝕝𝕕 \u200b zero width, \x01 control",
]
SHORT = [
    "The capital of France is",
    "Photosynthesis is the process by which",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]
TOP = 16  # logits rows in the golden file: the top 16 and these fixed ids
N_FIXED = 64


def long_text() -> str:
    """Plain prose and code from kvsched's own manual (docs/*.md), in a fixed order."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(docs.glob("*.md")))


def cut_to_tokens(model, text: str, n: int, start: int) -> str:
    """The shortest whole lines of `text` from the line at char `start` on that
    make at least n tokens."""
    lines = text[text.index("\n", start) + 1 :].splitlines(keepends=True)
    for i in range(1, len(lines) + 1):
        # Counted as returned (without the trailing newlines, which are tokens too).
        out = "".join(lines[:i]).rstrip("\n")
        if len(model.encode_prompt(out)) >= n:
            return out
    raise ValueError(f"the manual has fewer than {n} tokens from {start}")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_transformers(gguf: Path):
    """transformers' tokenizer and model (float32) from the GGUF file, and its
    layer pattern in kvsched's words."""
    import gguf as gguf_py
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvsched.engine.loaders.gguf_file import plain_gguf_reader

    # transformers parses the file three times with gguf's reader (tokenizer,
    # config, weights), 10 s each for this vocabulary; gguf's parser over a
    # plain view of the map (open_gguf) reads the same values in a third of it.
    gguf_py.GGUFReader = plain_gguf_reader()
    hf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    hf_kinds = ["full" if t == "full_attention" else f"sliding_window:{hf.config.sliding_window}"
                for t in hf.config.layer_types]  # fmt: skip
    return hf_tok, hf, hf_kinds


def hf_greedy(hf, ids: list[int], tokens: int) -> list[int]:
    """transformers' greedy generation of exactly `tokens` tokens after `ids`
    (no EOS stop: a fixed number compares more)."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    ap.add_argument("--lengths", default="600,1200,2000", help="long prompts' token counts")
    ap.add_argument("--chunk", type=int, default=200, help="prefill chunk (< the window)")
    ap.add_argument("--golden", type=Path, default=None, help="write the golden file here")
    ap.add_argument("--against-golden", type=Path, default=None, metavar="PATH",
                    help="check only that transformers computes what the golden file "
                    "says (tests/test_gemma3_golden.py checks kvsched against it)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.against_golden is not None:
        return against_golden(args.against_golden, args.tokens)

    import jax.numpy as jnp
    import numpy as np
    import torch
    from gemma3_helpers import HandPlan

    from kvsched import model_files
    from kvsched.engine.loaders.gguf_llama import load_gguf
    from kvsched.engine.model import forward_dense

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t_start = time.perf_counter()
    path = model_files.fetch(model_files.GEMMA3_270M)
    t0 = time.perf_counter()
    ours = load_gguf(path)
    load_s = time.perf_counter() - t0
    c = ours.config
    hf_tok, hf, hf_kinds = load_transformers(path)

    say(f"loaded ({time.perf_counter() - t_start:.0f} s)")
    text = long_text()
    lengths = [int(n) for n in args.lengths.split(",") if n]
    longs = [cut_to_tokens(ours, text, n, start=997 * i) for i, n in enumerate(lengths)]
    texts = SHORT + longs
    prompts = [ours.encode_prompt(t) for t in texts]
    token_mismatch = [s for s in AWKWARD + texts
                      if ours.encode_prompt(s) != hf_tok(s)["input_ids"]]  # fmt: skip

    say(f"prompts of {[len(p) for p in prompts]} tokens; logits ...")
    rng = np.random.default_rng(0)
    fixed = np.sort(rng.choice(c.vocab_size, N_FIXED, replace=False))
    w = c.sliding_window
    diffs, scales, rows_out = [], [], []
    for ids, is_long in zip(prompts, [False] * len(SHORT) + [True] * len(longs), strict=True):
        n = len(ids)
        rows = sorted({w - 2, w - 1, w, w + 1, n // 2, n - 1}) if is_long else list(range(n))
        rows = [r for r in rows if 0 <= r < n]
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].float().numpy()[rows]
        got = np.asarray(forward_dense(ours.params, c, jnp.asarray(ids, jnp.int32),
                                       rows=jnp.asarray(rows, jnp.int32)))  # fmt: skip
        diffs.append(float(np.abs(got - want).max()))
        scales.append(float(np.abs(want).max()))
        keep = sorted({w - 1, w, n - 1} if is_long else {n - 1})
        rows_out.append(
            [{"position": r, "top_ids": np.argsort(-want[rows.index(r)])[:TOP].tolist(),
              "top_logits": np.sort(want[rows.index(r)])[::-1][:TOP].tolist(),
              "fixed_logits": want[rows.index(r)][fixed].tolist()}
             for r in keep if r < n]
        )  # fmt: skip

    say(f"transformers generate ... ({time.perf_counter() - t_start:.0f} s)")
    # transformers' greedy generation, one prompt at a time (no EOS stop: a
    # fixed number of tokens compares more).
    t0 = time.perf_counter()
    want_out = []
    for ids in prompts:
        want_out.append(hf_greedy(hf, ids, args.tokens))
    hf_s = time.perf_counter() - t0

    say(f"forward_paged ... ({time.perf_counter() - t_start:.0f} s)")
    t0 = time.perf_counter()
    longest = max(len(p) for p in prompts) + args.tokens
    pages = sum(-(-(len(p) + args.tokens) // 16) for p in prompts)
    plan = HandPlan(ours.params, c, block_size=16, num_blocks=6 * pages + 1,
                    max_seqs=4, max_len=longest + 16, tokens_per_step=256)  # fmt: skip
    got = plan.generate(dict(enumerate(prompts)), args.tokens, chunk=args.chunk)
    got_out = [got[i] for i in range(len(prompts))]
    paged_s = time.perf_counter() - t0
    agree = [g == wnt for g, wnt in zip(got_out, want_out, strict=True)]
    first_diff = [next((i for i, (a, b) in enumerate(zip(g, wnt, strict=True)) if a != b), None)
                  for g, wnt in zip(got_out, want_out, strict=True)]  # fmt: skip

    result = {
        "model": c.name,
        "layer_kinds_match": list(c.layer_kinds) == hf_kinds,
        "hf_sliding_window": hf.config.sliding_window,
        "tokenizer_strings": len(AWKWARD) + len(texts),
        "tokenizer_mismatches": token_mismatch,
        "prompt_lengths": [len(p) for p in prompts],
        "max_abs_logit_diff": max(diffs),
        "logit_diffs": diffs,
        "logit_scale": max(scales),
        "rel_logit_diff": max(d / s for d, s in zip(diffs, scales, strict=True)),
        "greedy_tokens": args.tokens,
        "greedy_identical": agree,
        "first_divergence": first_diff,
        "chunk": args.chunk,
        "kv_groups": list(plan.layout.groups),
        "load_s": load_s,
        "transformers_s": hf_s,
        "paged_s": paged_s,
    }
    if args.golden is not None:
        golden = {
            "about": "what transformers computed on gemma-3-270m-q4_k_m.gguf (float32, CPU); "
            "written by tests/peer_gemma3.py --golden, read by tests/test_gemma3_golden.py",
            "sha256": model_files.GEMMA3_270M.sha256,
            "transformers": __import__("transformers").__version__,
            "fixed_ids": fixed.tolist(),
            "awkward": [{"text": s, "ids": hf_tok(s)["input_ids"]} for s in AWKWARD],
            "prompts": [{"text": t, "ids": p, "greedy": g, "logits": r}
                        for t, p, g, r in zip(texts, prompts, want_out, rows_out, strict=True)],
        }  # fmt: skip
        args.golden.write_text(json.dumps(golden, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"layer kinds as transformers' layer_types: {result['layer_kinds_match']}")
    print(f"tokenizer: {len(token_mismatch)} mismatches over {result['tokenizer_strings']} strings")
    print(f"logits: max |diff| {result['max_abs_logit_diff']:.2e} at logit scale "
          f"{result['logit_scale']:.1f} (relative {result['rel_logit_diff']:.1e}); "
          f"prompt lengths {result['prompt_lengths']}")  # fmt: skip
    print(f"greedy {args.tokens} tokens through forward_paged ({len(plan.layout.groups)} KV "
          f"groups, chunk {args.chunk}): {sum(agree)}/{len(agree)} identical, first "
          f"divergence {first_diff}; {paged_s:.0f} s (transformers {hf_s:.0f} s)")  # fmt: skip
    print(json.dumps(result))
    return result


def against_golden(path: Path, tokens: int) -> dict:
    """Half of the peer check, in CI's time: transformers, run now on the same
    GGUF file, computes what the golden file says (the layer pattern of the
    config kvsched derives, every token id, the logits rows, the first
    `tokens` greedy tokens). tests/test_gemma3_golden.py checks kvsched
    against the same file, so kvsched agrees with transformers through it."""
    import numpy as np
    import torch

    from kvsched import model_files
    from kvsched.engine.loaders.gguf_file import open_gguf
    from kvsched.engine.loaders.gguf_gemma3 import config_from_gguf_gemma3

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    golden = json.loads(path.read_text(encoding="utf-8"))
    t_start = time.perf_counter()
    gguf = model_files.fetch(model_files.GEMMA3_270M)
    if golden["sha256"] != model_files.GEMMA3_270M.sha256:
        raise SystemExit(f"{path} is for another model file")
    c = config_from_gguf_gemma3(open_gguf(gguf))
    hf_tok, hf, hf_kinds = load_transformers(gguf)
    say(f"loaded ({time.perf_counter() - t_start:.0f} s)")
    cases = golden["awkward"] + golden["prompts"]
    token_mismatch = [x["text"] for x in cases if hf_tok(x["text"])["input_ids"] != x["ids"]]
    fixed = np.asarray(golden["fixed_ids"])
    diffs, scales, top_same = [], [], []
    greedy_same, first_diff = [], []
    for p in golden["prompts"]:
        ids = p["ids"]
        rows = [r["position"] for r in p["logits"]]
        with torch.no_grad():
            # Only the rows the file holds: all of a 2,000-token prompt's
            # would be 2 GB of logits and most of this check's time.
            got = hf(torch.tensor([ids]), logits_to_keep=torch.tensor(rows)).logits[0]
            got = got.float().numpy()
        new = hf_greedy(hf, ids, tokens)
        for row, want in zip(got, p["logits"], strict=True):
            top_same.append(int(np.argmax(row)) == want["top_ids"][0])
            d = np.concatenate([row[want["top_ids"]] - want["top_logits"],
                                row[fixed] - want["fixed_logits"]])  # fmt: skip
            diffs.append(float(np.abs(d).max()))
            scales.append(float(np.abs(want["top_logits"]).max()))
        want_greedy = p["greedy"][:tokens]
        greedy_same.append(new == want_greedy)
        pairs = enumerate(zip(new, want_greedy, strict=False))
        first_diff.append(next((i for i, (a, b) in pairs if a != b), None))
    result = {
        "mode": "against_golden",
        "model": c.name,
        "layer_kinds_match": list(c.layer_kinds) == hf_kinds,
        "hf_sliding_window": hf.config.sliding_window,
        "tokenizer_strings": len(cases),
        "tokenizer_mismatches": token_mismatch,
        "prompt_lengths": [len(p["ids"]) for p in golden["prompts"]],
        "top_ids_match": all(top_same),
        "max_abs_logit_diff": max(diffs),
        "rel_logit_diff": max(d / s for d, s in zip(diffs, scales, strict=True)),
        "greedy_tokens": tokens,
        "greedy_identical": greedy_same,
        "first_divergence": first_diff,
        "golden_transformers": golden.get("transformers"),
        "transformers": __import__("transformers").__version__,
        "seconds": time.perf_counter() - t_start,
    }
    print(f"transformers {result['transformers']} against the golden file (written with "
          f"{result['golden_transformers']}): layer kinds {result['layer_kinds_match']}, "
          f"{len(token_mismatch)} token mismatches over {len(cases)} strings, logits max |diff| "
          f"{result['max_abs_logit_diff']:.2e}, greedy {sum(greedy_same)}/{len(greedy_same)} "
          f"identical")  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
