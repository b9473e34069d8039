"""A custom server embedding kvsched's AsyncEngine: a line protocol over TCP.

    python examples/embed_async.py [--model tiny|smollm2] [--port 8765]

Each line a client sends is a question (tenant "demo"); the server streams the
answer back as it is generated and ends it with a blank line. A refusal is one
line "ERROR <status> <reason> retry-after=<s>". The engine runs on its own
thread; the event loop only moves text.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import kvsched
from kvsched.engine.sampling import SamplingParams
from kvsched.serve import AsyncEngine, http_status


def build(model: str) -> tuple[AsyncEngine, object]:
    """An AsyncEngine over SmolLM2 (or the random tiny model), warmed up."""
    from kvsched.engine.runner import Engine

    cfg = kvsched.SchedulerConfig(num_blocks=257, block_size=16, max_num_seqs=8,
                                  max_batched_tokens=64, max_seq_len=256)  # fmt: skip
    if model == "tiny":
        from kvsched.engine.model import LlamaConfig, init_params

        m = LlamaConfig()
        engine, gg = Engine.create(m, init_params(m), cfg), None
    else:
        from kvsched import model_files
        from kvsched.engine.loaders.gguf_llama import load_gguf

        gg = load_gguf(model_files.fetch(), name=model_files.SMOLLM2_135M.model_name)
        engine = Engine.create(gg.config, gg.params, cfg, tokenizer=gg.tokenizer,
                               eos_token_ids=(gg.eos_token_id,))  # fmt: skip
    ae = AsyncEngine(engine)
    ae.start()  # warmup, then the step thread
    engine.scheduler.add_tenant(kvsched.TenantConfig("demo"))
    return ae, gg


async def serve(ae: AsyncEngine, gg: Any, host: str, port: int) -> asyncio.Server:
    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := (await reader.readline()).decode().strip():
            ids = (gg.encode_chat([{"role": "user", "content": line}]) if gg
                   else [ord(c) % 256 for c in line])  # fmt: skip
            try:
                stream = await ae.generate("demo", ids, SamplingParams(max_tokens=48))
            except kvsched.Rejected as e:
                status, _ = http_status(e)
                writer.write(f"ERROR {status} {e.reason} retry-after={e.retry_after}\n".encode())
                continue
            async with stream:  # a client that hangs up cancels its request
                async for out in stream:
                    writer.write((out.text or " ".join(map(str, out.token_ids)) + " ").encode())
                    await writer.drain()
            writer.write(b"\n\n")
        writer.close()

    return await asyncio.start_server(client, host, port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args(argv)
    ae, gg = build(args.model)

    async def run() -> None:
        server = await serve(ae, gg, args.host, args.port)
        print(f"listening on {args.host}:{args.port}", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


if __name__ == "__main__":
    main()
