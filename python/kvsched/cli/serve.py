"""`kvsched serve`, `fetch-model` and `eval-kv`: the engine and its real model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from kvsched import model_files

    path = model_files.fetch()
    model_files.verify(path)
    print(f"{path} ({model_files.SMOLLM2_135M.size:,} bytes, sha256 checked)")
    return 0


def cmd_eval_kv(args: argparse.Namespace) -> int:
    """The quantized-KV gate on SmolLM2-135M-Instruct: greedy agreement and mean
    |logprob difference| against float32 KV; the report is saved for the engine."""
    from kvsched import model_files
    from kvsched.engine import kv_eval
    from kvsched.engine.loaders.gguf_llama import load_gguf

    gg = load_gguf(model_files.fetch())
    prompts = [gg.encode_chat([{"role": "user", "content": p}])
               for p in kv_eval.EVAL_PROMPTS[: args.prompts]]  # fmt: skip
    # Judged by the engine's default thresholds; an engine configured with others
    # (kv_min_agreement, kv_max_logprob_diff) checks the saved figures itself.
    report = kv_eval.evaluate_kv(gg.config, gg.params, prompts, kv_dtype=args.kv_dtype,
                                 tokens=args.tokens)  # fmt: skip
    path = kv_eval.save_report(report)
    verdict = "PASS" if report.passed else "FAIL"
    print(f"{args.kv_dtype} KV vs float32 KV on {report.model} ({report.checksum}), "
          f"{report.prompts} prompts x {report.tokens_per_prompt} greedy tokens:")  # fmt: skip
    print(
        f"  greedy agreement       {report.greedy_agreement:.3f} (gate >= "
        f"{report.min_agreement}); {report.identical_prompts}/{report.prompts} identical"
    )
    print(
        f"  mean |logprob diff|    {report.mean_abs_logprob_diff:.4f} (gate <= "
        f"{report.max_mean_abs_logprob_diff}); max {report.max_abs_logprob_diff:.4f}"
    )
    print(f"  {verdict} in {report.seconds:.0f} s; report {path}")
    return 0 if report.passed else 1


def cmd_serve(args: argparse.Namespace) -> int:
    """The OpenAI-compatible server (kvsched.serve.server) until SIGTERM drains it."""
    import logging
    import time

    from kvsched.model_files import cache_dir
    from kvsched.serve import AsyncEngine
    from kvsched.serve.server import OpenAIServer, load_model, parse_end_at
    from kvsched.serve.tenants import TenantRegistry

    tenants = TenantRegistry.from_file(args.tenants)  # a bad file fails before the model loads
    end_at = parse_end_at(args.end_at) if args.end_at else None
    if end_at is not None and end_at <= time.time():
        raise ValueError(f"--end-at {args.end_at} is in the past")
    if args.drain_seconds < 0:
        raise ValueError("--drain-seconds must be >= 0")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    m = load_model(args.model, max_seq_len=args.max_seq_len, max_num_seqs=args.max_num_seqs,
                   num_blocks=args.num_blocks, max_batched_tokens=args.max_batched_tokens,
                   max_logprobs=args.max_logprobs, backend=args.backend,
                   seed=args.seed, devices=args.devices, dtype=args.dtype,
                   block_size=args.block_size)  # fmt: skip
    checkpoint = (
        Path(args.checkpoint) if args.checkpoint else cache_dir() / "serve-checkpoint.jsonl"
    )
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    engine = AsyncEngine(m.engine, checkpoint_path=str(checkpoint))
    server = OpenAIServer(engine, tenants, model_name=m.model_name, encode_chat=m.encode_chat,
                          aliases=m.aliases, max_body_bytes=args.max_body_bytes,
                          drain_seconds=args.drain_seconds, end_at=end_at)  # fmt: skip
    replicas = m.engine.kv_replicas
    if args.devices > 1:
        print(f"tensor parallel over {args.devices} {m.engine.mesh.devices.flat[0].platform} "
              f"devices{f', each KV head on {replicas}' if replicas > 1 else ''}",
              flush=True)  # fmt: skip
    print(f"serving {m.model_name} to {len(tenants.names)} tenant(s) on "
          f"http://{args.host}:{args.port}/v1 (checkpoint {checkpoint})", flush=True)  # fmt: skip
    return server.run(args.host, args.port, log_level=args.log_level)


def add_parsers(sub: Any) -> None:
    """The `fetch-model`, `eval-kv` and `serve` sub-commands."""
    f = sub.add_parser("fetch-model", help="fetch SmolLM2-135M-Instruct's GGUF into the cache")
    f.set_defaults(func=cmd_fetch_model)

    e = sub.add_parser("eval-kv", help="the quantized-KV gate, measured on the real model")
    e.add_argument("--kv-dtype", default="int8", choices=["int8"],
                   help="the KV dtype judged (default int8)")  # fmt: skip
    e.add_argument("--prompts", type=int, default=8, choices=range(1, 11), metavar="1..10",
                   help="evaluation prompts (count; default 8)")  # fmt: skip
    e.add_argument("--tokens", type=int, default=32,
                   help="greedy tokens per prompt (default 32)")  # fmt: skip
    e.set_defaults(func=cmd_eval_kv)

    v = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    v.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (SmolLM2-135M-Instruct), tiny (random weights, no tokenizer), the "
        "path of a Llama-architecture GGUF file, or of a Hugging Face Llama model directory "
        "(config.json, safetensors, tokenizer.json), served with its own tokenizer and chat "
        "template (default smollm2)",
    )
    v.add_argument("--devices", type=int, default=1,
                   help="tensor parallel over this many local devices "
                   "(count; default 1)")  # fmt: skip
    v.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights and activations (default float32)")  # fmt: skip
    v.add_argument("--tenants", required=True, help="the tenants TOML file (names, API keys)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    v.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long running requests may go on (seconds; default 30)",
    )
    v.add_argument("--end-at", help="drain and exit by this time (ISO 8601 or Unix seconds)")
    v.add_argument(
        "--checkpoint",
        help="where the drain writes the scheduler checkpoint (default: the kvsched cache folder)",
    )
    v.add_argument("--max-seq-len", type=int, default=1024,
                   help="longest prompt + output in tokens (default 1024)")  # fmt: skip
    v.add_argument("--max-num-seqs", type=int, default=16,
                   help="sequences running at once (count; default 16)")  # fmt: skip
    v.add_argument("--max-batched-tokens", type=int, default=256,
                   help="step budget in tokens (default 256)")  # fmt: skip
    v.add_argument(
        "--num-blocks",
        type=int,
        help="KV pages, on any device (count; default: as many as an accelerator's free "
        "memory holds, every sequence at full length on CPU)",
    )
    v.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV page (default 16; 64 or 128 suit TPUs)")  # fmt: skip
    v.add_argument("--max-logprobs", type=int, default=5,
                   help="top logprobs a request may ask (count; default 5)")  # fmt: skip
    v.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body in bytes (default 1048576)")  # fmt: skip
    v.add_argument(
        "--backend", choices=["reference", "pallas", "jax"], default="reference",
        help="attention: reference (jnp), pallas (kvsched's kernel; on TPU JAX's unless "
        "KVSCHED_TPU_ATTENTION=ours), jax (JAX's kernel on TPU, its jnp reference elsewhere); "
        "default reference",
    )  # fmt: skip
    v.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    v.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log level (default info)")  # fmt: skip
    v.set_defaults(func=cmd_serve)
