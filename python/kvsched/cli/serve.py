"""`kvsched serve`, `fetch-model` and `eval-kv`: the engine and its real model."""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

import kvsched

# OpenAI's sampling defaults, named here without importing the server (FastAPI).
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def parse_step_time(spec: str) -> Any:
    """A step time from the command line: milliseconds ("10", "2.5ms"), a cost
    model preset "MODEL:ACCELERATOR" (kvsched.shapes' names, e.g.
    "llama-3-8b:h100"), or the path of a step-cost file (`kvsched calibrate`).
    kvsched.InvalidConfig for anything else."""
    from pathlib import Path

    from kvsched.shapes import ACCELERATORS, MODELS
    from kvsched.sim.simulator import StepCost

    text = spec.strip()
    ms = text[:-2] if text.endswith("ms") else text
    try:
        value = float(ms)
    except ValueError:
        pass
    else:
        if not value >= 0 or value == float("inf"):
            raise kvsched.InvalidConfig(f"step time: milliseconds >= 0, not {spec!r}")
        return value / 1000.0
    if Path(text).is_file():
        return StepCost.load(text)
    model, sep, acc = text.rpartition(":")
    if not sep or model not in MODELS or acc not in ACCELERATORS:
        raise kvsched.InvalidConfig(
            f"step cost {spec!r}: MODEL:ACCELERATOR (models {', '.join(MODELS)}; accelerators "
            f"{', '.join(ACCELERATORS)}) or the path of a step-cost file"
        )
    return StepCost.preset(model, acc)


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from kvsched import model_files

    model = model_files.MODELS[args.model]
    path = model_files.fetch(model)
    model_files.verify(path, model)
    print(f"{path} ({model.size:,} bytes, sha256 checked)")
    return 0


def cmd_eval_kv(args: argparse.Namespace) -> int:
    """The quantized-KV gate on SmolLM2-135M-Instruct: greedy agreement and mean
    |logprob difference| against float32 KV; the report is saved for the engine."""
    from kvsched import model_files
    from kvsched.engine import kv_eval
    from kvsched.engine.loaders.gguf_llama import load_gguf

    gg = load_gguf(model_files.fetch(), name=model_files.SMOLLM2_135M.model_name)
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
    """The OpenAI-compatible server (kvsched.serve.server) until SIGTERM drains it.

    What can be refused is refused before the model loads: the tenants file,
    the options, a checkpoint another live server holds, a port in use."""
    import logging
    import os
    import signal
    import sys
    import time

    from kvsched.serve import process
    from kvsched.serve.engine_setup import parse_end_at
    from kvsched.serve.tenants import TenantRegistry

    tenants = TenantRegistry.from_file(args.tenants)  # a bad file fails before the model loads
    from kvsched.serve.fleet_budget import load_fleet_table

    fleet = load_fleet_table(args.tenants)
    end_at = parse_end_at(args.end_at) if args.end_at else None
    if end_at is not None and end_at <= time.time():
        raise ValueError(f"--end-at {args.end_at} is in the past")
    if args.drain_seconds < 0:
        raise ValueError("--drain-seconds must be >= 0")
    if not args.read_timeout > 0:
        raise ValueError("--read-timeout must be > 0")
    if args.max_connections < 0:
        raise ValueError("--max-connections must be >= 0 (0: no limit)")
    _check_simulated(args)
    _check_kv_events(args)
    # Only where asked: the file holds every tenant's prompts and nothing here
    # reads it back (each client was told at the drain what it got).
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    lock = process.CheckpointLock(checkpoint).acquire() if checkpoint is not None else None
    sock = process.bind_socket(args.host, args.port)
    process.configure_logging(args.log_level)
    # The engine process starts loading now, while this one imports the server.
    spawned = None
    if args.engine_process:
        from kvsched.serve.engine_spawn import spawn_engine

        spawned = spawn_engine(functools.partial(load_engine_process, args),
                               log_level=args.log_level)  # fmt: skip
    process.quiet_probes(not args.access_log_probes)
    log = logging.getLogger("kvsched.serve")

    serving = [False]

    def before_serving(sig: int, _frame: object) -> None:
        # Before uvicorn runs (it takes SIGTERM / SIGINT to drain, SIGHUP to
        # reload): nothing is admitted yet, so stop cleanly. uvicorn puts this
        # handler back when it ends: by then the server has drained and the
        # exit status is decided, so a late signal changes nothing.
        if serving[0]:
            return
        if sig == signal.SIGHUP:
            log.info("SIGHUP while loading: ignored (send it again once serving to reread "
                     "the tenants file)")  # fmt: skip
            return
        print(f"kvsched serve: {signal.Signals(sig).name} while loading the model: nothing "
              "was admitted; exiting", file=sys.stderr, flush=True)  # fmt: skip
        # At once: an exception raised here could land inside an import or a lock
        # of the loader and hang the exit. Nothing is owed to anyone yet, and
        # the kernel frees the port and the checkpoint's lock.
        os._exit(0)

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in signals:
        signal.signal(sig, before_serving)
    try:
        with process.LoadingResponder(sock):  # answers "loading" until uvicorn takes over
            server = _load(args, tenants, end_at, checkpoint, log, spawned)
            if fleet is not None:
                from kvsched.serve.fleet_budget import FleetBudget

                server.fleet = FleetBudget(fleet)
                log.info("fleet: rate limits are fleet-wide over %d replicas (peers %s), "
                         "rebalanced every %g s", 1 + len(fleet.peers), ", ".join(fleet.peers),
                         fleet.interval_s)  # fmt: skip
        serving[0] = True
        try:
            return int(server.run(args.host, args.port, sock=sock, log_level=args.log_level))
        finally:
            # Drained: the exit status is decided. A signal now, or while the
            # interpreter shuts down (which resets Python's handlers, not an
            # ignored signal), must not kill the process on its way out.
            for sig in signals:
                signal.signal(sig, signal.SIG_IGN)
    finally:
        sock.close()
        if lock is not None:
            lock.release()


def _load(args: argparse.Namespace, tenants: Any, end_at: float | None,
          checkpoint: Path | None, log: Any, spawned: Any = None) -> Any:  # fmt: skip
    """The OpenAIServer over the loaded model (cold: it warms up once serving):
    the engine in its own process (kvsched.serve.engine_process), or with
    --no-engine-process on a thread of this one."""
    from kvsched.serve.server import OpenAIServer
    from kvsched.serve.tenants import load_scheduler_table

    keep = None if checkpoint is None else str(checkpoint)
    engine: Any
    if args.engine_process:
        from kvsched.serve.engine_process import EngineClient

        assert spawned is not None  # cmd_serve started it, before this imported the server
        engine = EngineClient(spawned, checkpoint_path=keep, log_level=args.log_level)
        card = engine.card
        names = [card.model_name, *card.aliases]
        encode_chat, encode_prompt = card.encode_chat, card.encode_prompt
        defaults = card.sampling_defaults
    else:
        from kvsched.serve import AsyncEngine

        m, names, encode_chat = _load_model(args, log)
        encode_prompt, defaults = m.encode_prompt, m.sampling_defaults
        engine = AsyncEngine(m.engine, checkpoint_path=keep, freeze_gc=True)
    server = OpenAIServer(engine, tenants, model_name=names[0], encode_chat=encode_chat,
                          encode_prompt=encode_prompt,
                          aliases=names[1:], max_body_bytes=args.max_body_bytes,
                          drain_seconds=args.drain_seconds, end_at=end_at,
                          sampling_defaults=defaults, read_timeout_s=args.read_timeout,
                          max_connections=args.max_connections or None,
                          vllm_metrics=not args.no_vllm_metrics)  # fmt: skip
    if not args.engine_process:
        for collector in _engine_collectors(args, m.engine):
            server.registry.register(collector)
    server.scheduler_table = load_scheduler_table(args.tenants)
    kept = "" if checkpoint is None else f" (checkpoint {checkpoint})"
    server.listening_message = (
        f"serving {names[0]} to {len(tenants.names)} tenant(s) on "
        f"http://{args.host}:{args.port}/v1{kept}; warming up, /ready answers 200 once warm"
    )
    return server


def _load_model(args: argparse.Namespace, log: Any) -> tuple[Any, list[str], Any]:
    """The cold model (kvsched.serve.engine_setup.LoadedModel), the names it is
    served under, and its chat encoder, with what the log says of them."""
    from kvsched.serve.server import load_model
    from kvsched.serve.tenants import load_scheduler_table

    # The scheduler: the tenants file's [scheduler] table, under the flags given.
    knobs = load_scheduler_table(args.tenants)
    ladder = None if args.ladder is None else [] if args.ladder == "off" else "default"
    flags = {"max_num_seqs": args.max_num_seqs, "max_batched_tokens": args.max_batched_tokens,
             "admission": args.admission, "preempt_lower_tiers": args.preempt_lower_tiers,
             "ladder": ladder, "long_prefill_chunk": args.long_prefill_chunk,
             "max_waiting": args.max_waiting}  # fmt: skip
    knobs.update({k: v for k, v in flags.items() if v is not None})
    what = {"smollm2": "SmolLM2-135M-Instruct", "tiny": "the tiny random model"}
    log.info("loading %s", what.get(args.model, args.model))
    t0 = time.perf_counter()
    m = load_model(args.model, max_seq_len=args.max_seq_len, num_blocks=args.num_blocks,
                   max_logprobs=args.max_logprobs, backend=args.backend,
                   seed=args.seed, devices=args.devices, dtype=args.dtype,
                   block_size=args.block_size, scheduler=knobs,
                   overlap=args.overlap, **_simulated_options(args))  # fmt: skip
    cfg = m.engine.scheduler.config
    log.info("scheduler: %s admission, preempt_lower_tiers %s, ladder %s, max_num_seqs %d, "
             "max_batched_tokens %d, long_prefill_chunk %d", cfg.admission,
             cfg.preempt_lower_tiers, "on" if cfg.ladder else "off", cfg.max_num_seqs,
             cfg.max_batched_tokens, cfg.long_prefill_chunk)  # fmt: skip
    names = args.served_model_name or [m.model_name, *m.aliases]
    encode_chat = m.encode_chat
    if encode_chat is not None and args.special_tokens_in_content:
        loader_encode: Any = encode_chat  # the loaders' encode_chat takes content_as_text
        encode_chat = functools.partial(loader_encode, content_as_text=False)
    log.info("loaded %s in %.1f s", m.model_name, time.perf_counter() - t0)
    _start_kv_events(args, m.engine, log)
    defaults = m.sampling_defaults
    log.info("sampling defaults: %s (%s)",
             ", ".join(f"{k} {v}" for k, v in {**OPENAI_SAMPLING, **defaults}.items()),
             "the model's generation_config.json" if defaults
             else "OpenAI's: the model sets none")  # fmt: skip
    device = getattr(m.engine, "device", None)
    if args.model == "simulated" and device is not None:
        from kvsched.engine.simulated import describe_step_time

        log.info("simulated device: %s, end of text at rate %g; overlap %s",
                 describe_step_time(device.step_time), args.sim_eos_rate,
                 "on" if args.overlap else "off")  # fmt: skip
    replicas = m.engine.kv_replicas
    if args.devices > 1:
        print(f"tensor parallel over {args.devices} {m.engine.mesh.devices.flat[0].platform} "
              f"devices{f', each KV head on {replicas}' if replicas > 1 else ''}",
              flush=True)  # fmt: skip
    return m, list(names), encode_chat


def _engine_collectors(args: argparse.Namespace, engine: Any) -> list[Any]:
    """Collectors of what only the engine's process knows, beyond the
    scheduler's: the stand-in device's clock (--model simulated)."""
    device = getattr(engine, "device", None)
    if args.model != "simulated" or device is None:
        return []
    from kvsched.engine.simulated import SimulatedDeviceCollector

    return [SimulatedDeviceCollector(device)]


def load_engine_process(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """In the engine process (kvsched.serve.engine_process): the cold Engine,
    the card the front end builds its server from, and the registry of the
    engine's collectors (its /metrics families)."""
    import logging

    from prometheus_client import CollectorRegistry

    from kvsched.metrics import SchedulerCollector
    from kvsched.serve.engine_process import EngineCard, config_view, without_weights

    m, names, encode_chat = _load_model(args, logging.getLogger("kvsched.serve"))
    engine = m.engine
    info = {**engine.model_info(), "name": names[0]}
    card = EngineCard(
        model_name=names[0], aliases=tuple(names[1:]), tokenizer=engine.tokenizer,
        encode_chat=without_weights(encode_chat), encode_prompt=without_weights(m.encode_prompt),
        sampling_defaults=dict(m.sampling_defaults), vocab_size=int(engine.model.vocab_size),
        model_info=info, compiles=bool(getattr(engine, "compiles", True)),
        config=config_view(engine.scheduler.config),
        token_buckets=list(engine.scheduler.token_buckets),
    )  # fmt: skip
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(engine.scheduler, model=info,
                                         vllm_model_name=None if args.no_vllm_metrics
                                         else names[0]))  # fmt: skip
    for collector in _engine_collectors(args, engine):
        registry.register(collector)
    return engine, card, registry


def _check_kv_events(args: argparse.Namespace) -> None:
    """The KV-event endpoints, normalized (a bad one fails before the model loads)."""
    from kvsched.serve.kv_events import endpoint

    if args.kv_events_replay and not args.kv_events:
        raise ValueError("--kv-events-replay needs --kv-events")
    if args.kv_events:
        args.kv_events = endpoint(args.kv_events)
    if args.kv_events_replay:
        args.kv_events_replay = endpoint(args.kv_events_replay)


def _start_kv_events(args: argparse.Namespace, engine: Any, log: Any) -> None:
    """--kv-events: the engine hands its prefix cache's changes to a publisher
    each step (in whichever process runs the step loop)."""
    if not args.kv_events:
        return
    import atexit

    from kvsched.serve.kv_events import KvEventPublisher

    if not engine.scheduler.config.prefix_caching:
        log.warning("--kv-events: prefix caching is off, so no block is ever cached and "
                    "nothing is published")  # fmt: skip
    pub = KvEventPublisher(args.kv_events, replay_address=args.kv_events_replay,
                           topic=args.kv_events_topic)  # fmt: skip
    engine.publish_kv_events(pub.publish)
    # Closed when the engine stops (the engine process, before it exits) or
    # at this interpreter's exit (the engine on a thread of the server's).
    engine.kv_event_publisher = pub
    atexit.register(pub.close)
    log.info("KV events: published on %s (topic %r)%s", pub.address, args.kv_events_topic,
             f", replay on {pub.replay_address}" if pub.replay_address else "")  # fmt: skip


def _check_simulated(args: argparse.Namespace) -> None:
    """The --sim-* options: only with --model simulated, and well-formed (a
    ValueError before anything loads)."""
    options = (("--sim-step-ms", args.sim_step_ms), ("--sim-step-cost", args.sim_step_cost),
               ("--sim-eos-rate", args.sim_eos_rate or None))  # fmt: skip
    given = [flag for flag, v in options if v is not None]
    if args.model != "simulated":
        if given:
            raise ValueError(f"{given[0]} is an option of --model simulated")
        return
    if not 0.0 <= args.sim_eos_rate <= 1.0:
        raise ValueError(f"--sim-eos-rate: a chance in [0, 1], not {args.sim_eos_rate}")
    _simulated_options(args)


def _simulated_options(args: argparse.Namespace) -> dict[str, Any]:
    """load_model's options for --model simulated (none for another model)."""
    if args.model != "simulated":
        return {}

    if args.sim_step_cost is not None:
        spec = args.sim_step_cost
        if ":" not in spec and not Path(spec).is_file():
            raise ValueError(f"--sim-step-cost: MODEL:ACCELERATOR or a step-cost file, "
                             f"not {spec!r}")  # fmt: skip
        step = parse_step_time(spec)  # kvsched.InvalidConfig: an unknown model or accelerator
    else:
        ms = 10.0 if args.sim_step_ms is None else args.sim_step_ms
        if not 0 <= ms < float("inf"):
            raise ValueError(f"--sim-step-ms: milliseconds >= 0, not {ms}")
        step = ms / 1000.0
    return {"sim_step_time": step, "sim_eos_rate": args.sim_eos_rate}


def add_parsers(sub: Any) -> None:
    """The `fetch-model`, `eval-kv` and `serve` sub-commands."""
    from kvsched.model_files import MODELS

    f = sub.add_parser("fetch-model", help="fetch a model's GGUF file into the cache")
    f.add_argument("model", nargs="?", default="smollm2-135m", choices=sorted(MODELS),
                   help="which model (default smollm2-135m: SmolLM2-135M-Instruct; "
                   "gemma3-270m: Gemma 3 270M, Gemma terms of use)")  # fmt: skip
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
        help="smollm2 (SmolLM2-135M-Instruct), gemma3-270m (Gemma 3 270M, a base model: "
        "completions), tiny (random weights, no tokenizer), simulated (a stand-in for load "
        "tests: SmolLM2's tokenizer, a device step that costs --sim-step-ms), the "
        "path of a Llama or Gemma 3 GGUF file, or of a Hugging Face Llama model directory "
        "(config.json, safetensors, tokenizer.json), served with its own tokenizer and chat "
        "template (default smollm2)",
    )
    v.add_argument("--devices", type=int, default=1,
                   help="tensor parallel over this many local devices "
                   "(count; default 1)")  # fmt: skip
    v.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights and activations (default float32)")  # fmt: skip
    v.add_argument("--tenants", required=True, help="the tenants TOML file (names, API keys)")
    v.add_argument(
        "--served-model-name", nargs="+", metavar="NAME",
        help="the name clients send as `model` and responses carry (the first; the others "
        "are accepted too); default: the model's own, e.g. SmolLM2-135M-Instruct",
    )  # fmt: skip
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
        help="write the scheduler checkpoint here when the drain ends (0600, one live server "
        "per file; default: none, as kvsched serve never reads one back)",
    )
    v.add_argument("--max-seq-len", type=int, default=1024,
                   help="longest prompt + output in tokens (default 1024)")  # fmt: skip
    v.add_argument("--max-num-seqs", type=int,
                   help="sequences running at once (count; default 16)")  # fmt: skip
    v.add_argument("--max-batched-tokens", type=int,
                   help="step budget in tokens (default 256)")  # fmt: skip
    v.add_argument("--long-prefill-chunk", type=int,
                   help="prefill chunk in tokens (default min(256, the step budget))")  # fmt: skip
    v.add_argument("--max-waiting", type=int,
                   help="admitted requests that may wait beyond max_num_seqs (count; "
                   "default 64)")  # fmt: skip
    v.add_argument("--admission", choices=["reserve", "overcommit"],
                   help="reserve each request's final length (default), or over-commit "
                   "with preemption")  # fmt: skip
    v.add_argument("--preempt-lower-tiers", action=argparse.BooleanOptionalAction,
                   help="a waiting higher tier takes a lower tier's running slot "
                   "(default: on)")  # fmt: skip
    v.add_argument("--ladder", choices=["default", "off"],
                   help="the degradation ladder (default: default; a [scheduler] table's "
                   "`ladder` may list rungs)")  # fmt: skip
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
        "KVSCHED_TPU_ATTENTION=kvsched), jax (JAX's kernel on TPU, its jnp reference elsewhere); "
        "default reference",
    )  # fmt: skip
    v.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    v.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine (model, scheduler, step loop) in its own process, "
                   "off the HTTP front end's interpreter (default: on)")  # fmt: skip
    v.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="overlapped scheduling: the host plans step N+1 while the device "
                   "runs step N (default: on)")  # fmt: skip
    sim = v.add_mutually_exclusive_group()
    sim.add_argument("--sim-step-ms", type=float, metavar="MS",
                     help="--model simulated: the device step time (milliseconds; "
                     "default 10)")  # fmt: skip
    sim.add_argument("--sim-step-cost", metavar="MODEL:ACCELERATOR",
                     help="--model simulated: each step costs what kvsched's step-cost model "
                     "charges its plan on this model and accelerator (e.g. llama-3-8b:h100), or "
                     "as a step-cost file from `kvsched calibrate` says")  # fmt: skip
    v.add_argument("--sim-eos-rate", type=float, default=0.0, metavar="P",
                   help="--model simulated: the chance each token is the end of text "
                   "(default 0: requests end at max_tokens or a stop)")  # fmt: skip
    v.add_argument("--read-timeout", type=float, default=30.0,
                   help="a request's head and body must arrive within this of its first "
                   "byte, else 408 (seconds; default 30)")  # fmt: skip
    v.add_argument("--max-connections", type=int, default=1024,
                   help="connections served at once, 503 past them (count; 0: no limit; "
                   "default 1024)")  # fmt: skip
    v.add_argument("--special-tokens-in-content", action="store_true",
                   help="control tokens written in a chat message's content (<|im_end|>...) "
                   "act as control tokens, as transformers does; default: they are text, so "
                   "a user cannot end their turn and fake a system one")  # fmt: skip
    v.add_argument("--no-vllm-metrics", action="store_true",
                   help="leave out of /metrics the vllm:* gauges: what routers read from "
                   "vLLM, under vLLM's names (default: exported)")  # fmt: skip
    v.add_argument("--kv-events", metavar="ENDPOINT",
                   help="publish the prefix cache's changes for KV-aware routers, in vLLM's "
                   "KV-event format (ZMQ PUB): PORT (on 127.0.0.1), HOST:PORT or a ZMQ "
                   "endpoint (tcp://*:5557 for every interface; the events carry prompt token "
                   "ids). Default: off")  # fmt: skip
    v.add_argument("--kv-events-replay", metavar="ENDPOINT",
                   help="--kv-events: where a subscriber that missed batches asks for them "
                   "again (ZMQ ROUTER; the last 10000 are kept)")  # fmt: skip
    v.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="--kv-events: the topic each message starts with (default: empty; "
                   "llm-d reads kv@POD@MODEL)")  # fmt: skip
    v.add_argument("--access-log-probes", action="store_true",
                   help="access-log /health, /ready and /metrics too (default: not)")  # fmt: skip
    v.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log level (default info)")  # fmt: skip
    v.set_defaults(func=cmd_serve)
