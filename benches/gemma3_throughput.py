"""Gemma 3 270M on CPU: the engine's tokens/s with KV-cache groups on and off,
beside transformers' `generate` on the same prompts (same GGUF file, float32).

    python benches/gemma3_throughput.py [--concurrent 8,32] [--prompt 2048]
                                        [--tokens 32] [--no-transformers]
                                        [--out gemma3_throughput.json]

Each cell: N requests of exactly `--prompt` tokens (cut from one long text at
different offsets, so no prefix is shared) and `--tokens` greedy tokens each
(no EOS stop), all submitted at once.

- `engine hybrid` / `engine uniform`: `Engine.create(..., kv_groups=...)`
  (reference attention, the CPU backend), warmed up first; the pool holds every
  request's final length in the uniform layout, the same bytes for both. Wall
  time from submit to the last token, and the step loop's prefill and decode
  time apart (a step with any prefill counts as prefill).
- `transformers`: one `generate(do_sample=False)` call on the N prompts as one
  batch (equal lengths: no padding), `min_new_tokens` = `max_new_tokens`.
- Greedy tokens are compared: the engine's hybrid and uniform runs agree, and
  each agrees with transformers' on the first tokens (float32 sums in another
  order can flip a near-tie later: the count that agree is reported).

JSON on stdout (and in --out); a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

TEXT = (
    "The harbor town wakes before the sun. Fishermen check their nets, the baker "
    "lights the ovens on the corner, and the lighthouse keeper climbs down the "
    "spiral stairs after a long night. In November the storms come in from the "
    "west and the square is empty but for the gulls; in summer the festival fills "
    "it with music, lanterns and the smell of grilled sardines. "
)


def prompts(model: Any, n: int, length: int) -> list[list[int]]:
    """n prompts of exactly `length` ids, cut at different offsets of a long text."""
    ids = model.encode_prompt(TEXT * (length // 40 + 8 * n + 8))
    step = max(1, len(TEXT) // 8)
    out = []
    for k in range(n):
        start = 1 + k * step  # after BOS
        out.append([ids[0], *ids[start : start + length - 1]])
    assert all(len(p) == length for p in out)
    return out


def engine_cell(gg: Any, work: list[list[int]], tokens: int, kv_groups: str) -> dict[str, Any]:
    import kvsched
    from kvsched.engine.runner import Engine, kv_group_layout
    from kvsched.engine.sampling import SamplingParams

    length = len(work[0]) + tokens
    # The same bytes for both layouts: every request's final length held in
    # full-attention pages of every layer; a hybrid page holds fewer layers.
    layout = kv_group_layout(gg.config, kv_groups)
    pages = len(work) * -(-length // 16) * layout.num_layers // layout.layers_per_group
    cfg = kvsched.SchedulerConfig(num_blocks=pages + 1, block_size=16, max_seq_len=length,
                                  max_num_seqs=len(work), max_batched_tokens=512,
                                  long_prefill_chunk=256, max_waiting=len(work),
                                  overhead_reserve=0.0)  # fmt: skip
    eng = Engine.create(gg.config, gg.params, cfg, backend="reference", tokenizer=gg.tokenizer,
                        kv_groups=kv_groups, pool="configured")  # fmt: skip
    eng.warmup(progress=False)
    eng.scheduler.add_tenant(kvsched.TenantConfig("bench"))
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [eng.submit("bench", p, sp) for p in work]
    got: dict[int, list[int]] = {r: [] for r in rids}
    prefill_s = decode_s = 0.0
    steps = 0
    while eng.scheduler.live_requests:
        t = time.perf_counter()
        res = eng.step()
        if res is None:
            continue
        dt = time.perf_counter() - t
        steps += 1
        if res.plan is not None and int(res.plan.cu_q_lens[len(res.plan)]) > len(res.plan):
            prefill_s += dt
        else:
            decode_s += dt
        for o in res.outputs:
            got[o.request_id] += o.token_ids
    wall = time.perf_counter() - t0
    return {"kind": f"engine {kv_groups}", "wall_s": round(wall, 2),
            "prefill_s": round(prefill_s, 2), "decode_s": round(decode_s, 2), "steps": steps,
            "decode_tokens_per_s": round(len(work) * (tokens - 1) / max(decode_s, 1e-9), 1),
            "tokens_per_s": round(len(work) * (len(work[0]) + tokens) / wall, 1),
            "tokens": [got[r] for r in rids]}  # fmt: skip


def transformers_cell(path: Any, work: list[list[int]], tokens: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor(work)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=tokens, min_new_tokens=tokens)  # fmt: skip
    wall = time.perf_counter() - t0
    return {"kind": "transformers", "wall_s": round(wall, 2),
            "tokens_per_s": round(len(work) * (len(work[0]) + tokens) / wall, 1),
            "tokens": out[:, len(work[0]) :].tolist()}  # fmt: skip


def agree(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens that agree before the first difference, summed over requests."""
    n = 0
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            n += 1
    return n


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrent", default="8,32", help="requests at once (comma-separated)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens each")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens each")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from kvsched import model_files
    from kvsched.engine.loaders.gguf_llama import load_gguf

    path = model_files.fetch(model_files.GEMMA3_270M, quiet=True)
    gg = load_gguf(path, name=model_files.GEMMA3_270M.model_name)
    result: dict[str, Any] = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       "cpus": os.cpu_count(), "prompt": args.prompt,
                                       "tokens": args.tokens}, "cells": []}  # fmt: skip
    for n in (int(x) for x in args.concurrent.split(",")):
        work = prompts(gg, n, args.prompt)
        cells = [engine_cell(gg, work, args.tokens, "hybrid"),
                 engine_cell(gg, work, args.tokens, "uniform")]  # fmt: skip
        if not args.no_transformers:
            cells.append(transformers_cell(path, work, args.tokens))
        hybrid = cells[0]["tokens"]
        for c in cells:
            c["concurrent"] = n
            c["agree_with_hybrid"] = agree(c.pop("tokens"), hybrid)
            c["of"] = n * args.tokens
            print(f"{n:>4} {c['kind']:<16} {c['wall_s']:>8.1f} s {c['tokens_per_s']:>9.1f} tok/s"
                  f"  agree {c['agree_with_hybrid']}/{c['of']}", file=sys.stderr)  # fmt: skip
            result["cells"].append(c)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
