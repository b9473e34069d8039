"""Peer check: kvsched serving SmolLM2-135M-Instruct against transformers on the
same GGUF file (CPU torch, f32), the independent implementation.

    python tests/peer_smollm2.py [--backend reference|pallas] [--prompts 8] [--tokens 64]
                                 [--admission reserve|overcommit] [--json]

1. Tokenization: kvsched's tokenizer (built from the GGUF vocabulary with
   `tokenizers`) gives the ids transformers' GGUF tokenizer gives, on every
   chat-templated prompt and on a few awkward strings.
2. Logits: for each chat-templated prompt, kvsched's model (forward_dense) and
   transformers' give logits at every position; the max abs difference is
   reported relative to the logit scale (max |logit|).
3. Greedy generation: `--tokens` tokens per prompt through kvsched's paged engine
   (chunked prefill of 32 tokens, several requests at once, a second wave that
   hits the prefix cache on the shared system prompt; with `--admission
   overcommit` a pool too small for all, so requests are preempted and
   recomputed) against transformers' `generate(do_sample=False)` one prompt at a
   time, both stopping at the model's EOS: identical token for token.

Prints a summary and, last, one JSON line (what tests/test_peer_smollm2.py reads).
Needs torch, transformers and accelerate (not part of kvsched's dependencies).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 10.",
    "Who wrote the play Hamlet?",
    "What is 17 times 23?",
    "Give me one tip for sleeping well.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
]
AWKWARD = ["1234567890 apples", "naïve café — 你好 🙂", "  leading spaces\n\ttabs", "<|im_end|>"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["reference", "pallas"], default="reference")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--admission", choices=["reserve", "overcommit"], default="reserve")
    ap.add_argument("--skip-logits", action="store_true")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvsched
    from kvsched import model_files
    from kvsched.engine.loaders.gguf_llama import load_gguf
    from kvsched.engine.model import forward_dense
    from kvsched.engine.runner import Engine

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = model_files.fetch()
    t0 = time.perf_counter()
    ours = load_gguf(path)
    load_s = time.perf_counter() - t0
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()

    chats = [ours.apply_chat_template([{"role": "user", "content": p}])
             for p in PROMPTS[: args.prompts]]  # fmt: skip
    prompts = [ours.tokenizer.encode(c, add_special_tokens=False).ids for c in chats]
    token_mismatch = [
        s for s in chats + AWKWARD
        if ours.tokenizer.encode(s, add_special_tokens=False).ids
        != hf_tok(s, add_special_tokens=False)["input_ids"]
    ]  # fmt: skip

    # Logits at every position of every prompt.
    import jax.numpy as jnp

    diffs, scales = [], []
    if not args.skip_logits:
        for ids in prompts:
            with torch.no_grad():
                want = hf(torch.tensor([ids])).logits[0].float().numpy()
            got = np.asarray(forward_dense(ours.params, ours.config, jnp.asarray(ids, jnp.int32)))
            diffs.append(float(np.abs(got - want).max()))
            scales.append(float(np.abs(want).max()))

    # transformers' greedy generation, one prompt at a time, to EOS or --tokens.
    eos = ours.eos_token_id
    t0 = time.perf_counter()
    want_out = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=args.tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos,
            )  # fmt: skip
        want_out.append(out[0, len(ids) :].tolist())
    hf_s = time.perf_counter() - t0
    hf_tokens = sum(len(o) for o in want_out)

    # kvsched's paged engine: two waves so the second hits the prefix cache.
    longest = max(len(p) for p in prompts) + args.tokens
    cfg = dict(block_size=16, max_num_seqs=8, max_batched_tokens=64, max_seq_len=256,
               long_prefill_chunk=32, max_waiting=32, num_blocks=257)  # fmt: skip
    if args.admission == "overcommit":
        # Room for about three sequences at their final length: the rest are
        # preempted and recomputed when pages run out.
        cfg.update(admission="overcommit", watermark_blocks=0,
                   num_blocks=3 * -(-longest // 16) + 1, overhead_reserve=0.0)  # fmt: skip
    eng = Engine.create(ours.config, ours.params, kvsched.SchedulerConfig(**cfg),
                        backend=args.backend)  # fmt: skip
    eng.warmup(progress=False)
    sched = eng.scheduler
    sched.add_tenant(kvsched.TenantConfig("peer"))
    got_out: dict[int, list[int]] = {}
    order = []
    first, second = prompts[: (len(prompts) + 1) // 2], prompts[(len(prompts) + 1) // 2 :]
    t0 = time.perf_counter()
    steps = 0

    def run_until(done) -> None:
        nonlocal steps
        while not done():
            res = eng.step()
            if res is None:
                break
            steps += 1
            for f in res.events.finished:
                got_out[f.request_id] = f.output_ids.tolist()

    for p in first:
        order.append(sched.submit("peer", np.asarray(p, np.int32), args.tokens,
                                  stop_token_ids=[eos]))  # fmt: skip
    # Let the first wave's prompts (and so the shared system prompt) be written.
    run_until(lambda: sched.stats()["tenants"]["peer"]["prefill_tokens"] >= sum(map(len, first)))
    for p in second:
        order.append(sched.submit("peer", np.asarray(p, np.int32), args.tokens,
                                  stop_token_ids=[eos]))  # fmt: skip
    run_until(lambda: sched.live_requests == 0)
    eng_s = time.perf_counter() - t0
    got = [got_out[r] for r in order]
    st = sched.stats()
    tenant = st["tenants"]["peer"]
    agree = [g == w for g, w in zip(got, want_out, strict=True)]
    first_diff = [next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b),
                       None if len(g) == len(w) else min(len(g), len(w)))
                  for g, w in zip(got, want_out, strict=True)]  # fmt: skip
    result = {
        "backend": args.backend,
        "admission": args.admission,
        "prompts": len(prompts),
        "tokenizer_mismatches": token_mismatch,
        "max_abs_logit_diff": max(diffs) if diffs else None,
        "logit_scale": max(scales) if scales else None,
        "rel_logit_diff": (
            max(d / s for d, s in zip(diffs, scales, strict=True)) if diffs else None
        ),  # fmt: skip
        "greedy_identical": agree,
        "first_divergence": first_diff,
        "generated_tokens": sum(len(g) for g in got),
        "prefix_hit_tokens": tenant["prefix_cache"]["hit_tokens"],
        "preemptions": st["preemptions"],
        "engine_steps": steps,
        "engine_s": eng_s,
        "engine_tok_s": sum(len(g) for g in got) / eng_s,
        "transformers_s": hf_s,
        "transformers_tok_s": hf_tokens / hf_s,
        "load_s": load_s,
        "sample": ours.tokenizer.decode(got[0]),
    }
    print(f"tokenizer: {len(token_mismatch)} mismatches over {len(chats) + len(AWKWARD)} strings")
    if diffs:
        print(f"logits: max |diff| {result['max_abs_logit_diff']:.2e} at logit scale "
              f"{result['logit_scale']:.1f} (relative {result['rel_logit_diff']:.1e})")  # fmt: skip
    print(f"greedy {args.tokens} tokens ({args.backend}, {args.admission}): "
          f"{sum(agree)}/{len(agree)} identical; prefix-cache hit tokens "
          f"{result['prefix_hit_tokens']}, preemptions {result['preemptions']}")  # fmt: skip
    print(
        f"engine {result['engine_tok_s']:.1f} tok/s ({steps} steps, {len(prompts)} at once) vs "
        f"transformers generate {result['transformers_tok_s']:.1f} tok/s (one at a time)"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
