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

AWKWARD = ["1234567890 apples", "naïve café — 你好 🙂", "  leading spaces\n\ttabs", "<|im_end|>"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="reference:reserve,reference:overcommit",
                    help="backend:admission pairs, comma-separated")  # fmt: skip
    ap.add_argument("--pallas-prompts", type=int, default=2, help="prompts for pallas runs")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip-logits", action="store_true")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvsched import model_files
    from kvsched.engine.kv_eval import EVAL_PROMPTS as PROMPTS
    from kvsched.engine.loaders.gguf_llama import load_gguf
    from kvsched.engine.model import forward_dense

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

    runs = []
    for spec in args.runs.split(","):
        backend, admission = spec.split(":")
        n = args.pallas_prompts if backend == "pallas" else len(prompts)
        runs.append(run_engine(ours, prompts[:n], want_out[:n], backend, admission, args.tokens))
    result = {
        "prompts": len(prompts),
        "tokenizer_mismatches": token_mismatch,
        "max_abs_logit_diff": max(diffs) if diffs else None,
        "logit_scale": max(scales) if scales else None,
        "rel_logit_diff": max(d / s for d, s in zip(diffs, scales, strict=True)) if diffs else None,
        "transformers_s": hf_s,
        "transformers_tok_s": hf_tokens / hf_s,
        "load_s": load_s,
        "runs": runs,
    }
    print(f"tokenizer: {len(token_mismatch)} mismatches over {len(chats) + len(AWKWARD)} strings")
    if diffs:
        print(f"logits: max |diff| {result['max_abs_logit_diff']:.2e} at logit scale "
              f"{result['logit_scale']:.1f} (relative {result['rel_logit_diff']:.1e})")  # fmt: skip
    print(f"transformers generate: {result['transformers_tok_s']:.1f} tok/s (one at a time)")
    for r in runs:
        print(f"greedy {args.tokens} tokens ({r['backend']}, {r['admission']}): "
              f"{sum(r['greedy_identical'])}/{len(r['greedy_identical'])} identical; prefix-cache "
              f"hit tokens {r['prefix_hit_tokens']}, preemptions {r['preemptions']}; "
              f"{r['engine_tok_s']:.1f} tok/s ({r['engine_steps']} steps)")  # fmt: skip
    print(json.dumps(result))
    return result


def run_engine(ours, prompts, want_out, backend: str, admission: str, tokens: int) -> dict:
    """Greedy generation through kvsched's paged engine, in two waves so the second
    hits the prefix cache on the shared system prompt."""
    import time

    import kvsched
    from kvsched.engine.runner import Engine
    from kvsched.engine.sampling import SamplingParams

    eos = ours.eos_token_id
    cfg = dict(block_size=16, max_num_seqs=8, max_batched_tokens=64, max_seq_len=256,
               long_prefill_chunk=32, max_waiting=32, num_blocks=257)  # fmt: skip
    if admission == "overcommit":
        # A pool that holds every prompt and little more: as the answers grow,
        # pages run out and requests are preempted and recomputed.
        prompt_blocks = sum(-(-len(p) // 16) for p in prompts)
        longest = max(-(-(len(p) + len(w)) // 16) for p, w in zip(prompts, want_out, strict=True))
        cfg.update(admission="overcommit", watermark_blocks=0, overhead_reserve=0.0,
                   num_blocks=max(longest, prompt_blocks) + 2)  # fmt: skip
    eng = Engine.create(ours.config, ours.params, kvsched.SchedulerConfig(**cfg),
                        backend=backend, tokenizer=ours.tokenizer,
                        eos_token_ids=(eos,))  # fmt: skip
    warm_s = eng.warmup(progress=False)
    sched = eng.scheduler
    sched.add_tenant(kvsched.TenantConfig("peer"))
    got_out: dict[int, list[int]] = {}
    order = []
    # Two waves, so the second finds the system prompt cached (over-commit: one
    # wave, so the pool is short from the start).
    half = len(prompts) if admission == "overcommit" else (len(prompts) + 1) // 2
    first, second = prompts[:half], prompts[half:]
    t0 = time.perf_counter()
    steps = 0

    def run_until(done) -> None:
        nonlocal steps
        while not done():
            res = eng.step()
            if res is None:
                break
            steps += 1
            for out in res.outputs:  # the engine's per-request stream
                got_out.setdefault(out.request_id, []).extend(out.token_ids)

    for p in first:
        order.append(eng.submit("peer", p, SamplingParams(max_tokens=tokens)))
    # Let the first wave's prompts (and so the shared system prompt) be written.
    run_until(lambda: sched.stats()["tenants"]["peer"]["prefill_tokens"] >= sum(map(len, first)))
    for p in second:
        order.append(eng.submit("peer", p, SamplingParams(max_tokens=tokens)))
    run_until(lambda: sched.live_requests == 0)
    eng_s = time.perf_counter() - t0
    got = [got_out[r] for r in order]
    st = sched.stats()
    tenant = st["tenants"]["peer"]
    agree = [g == w for g, w in zip(got, want_out, strict=True)]
    first_diff = [next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b),
                       None if len(g) == len(w) else min(len(g), len(w)))
                  for g, w in zip(got, want_out, strict=True)]  # fmt: skip
    return {
        "backend": backend,
        "admission": admission,
        "prompts": len(prompts),
        "greedy_identical": agree,
        "first_divergence": first_diff,
        "generated_tokens": sum(len(g) for g in got),
        "prefix_hit_tokens": tenant["prefix_cache"]["hit_tokens"],
        "preemptions": st["preemptions"],
        "engine_steps": steps,
        "engine_s": eng_s,
        "engine_tok_s": sum(len(g) for g in got) / eng_s,
        "warmup_s": warm_s,
        "programs": eng.compiled_programs(),
        "buckets": len(sched.token_buckets),
        "sample": ours.tokenizer.decode(got[0]),
    }


if __name__ == "__main__":
    main(sys.argv[1:])
