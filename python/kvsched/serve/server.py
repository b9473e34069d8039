"""`kvsched serve`: an OpenAI-compatible HTTP server over an `AsyncEngine`.

Endpoints
  GET  /v1/models, /v1/models/{id}   the served model (and its aliases by id)
  POST /v1/completions                prompt: a string, or token ids (no tokenizer needed)
  POST /v1/chat/completions           messages through the model's chat template
  GET  /health                        200 while the engine loop lives (no key needed)
  GET  /ready                         200 only when warm and not draining, else 503
  GET  /metrics                       Prometheus: kvsched.metrics.SchedulerCollector on the
                                      engine's scheduler, EngineLoopCollector on its step
                                      loop, plus kvsched_http_requests_total
                                      and kvsched_http_request_duration_seconds by route,
                                      method and status

Connections (kvsched.serve.asgi.guarded_h11): a request's head and body must
arrive within `read_timeout_s` of its first byte (else 408 and the connection
closes: a silent or trickling client holds nothing for long), and a head over
64 KiB is a 431. At most `max_connections` connections are open and served at
once: a request on one more gets uvicorn's plain-text 503 "Service
Unavailable", without Retry-After, and its connection is closed. The end of a
client's input ends its request (a half-close cannot be told from a client
gone).

Every /v1 request names its tenant by `Authorization: Bearer <api key>` (see
`kvsched.serve.tenants`); a missing or unknown key is a 401. Streams are
server-sent events (`data: {json}` then `data: [DONE]`), usage in the last chunk
when `stream_options.include_usage` is set. Errors are OpenAI's JSON
(`{"error": {"message", "type", "param", "code"}}`): 400 for bad input (malformed
JSON, wrong types, unsupported parameters, a prompt or max_tokens beyond the
context), 401, 404 (unknown model: code model_not_found; unknown route), 413 for
a body over `max_body_bytes`, and kvsched's refusals through
`kvsched.serve.http_status` (429 / 503 with Retry-After, code = the refusal's
reason). A refused or malformed request changes nothing in the scheduler.

Finish reasons: kvsched's "stop" and "length" are OpenAI's. A request the server
ended early ("drain_deadline": cut at the end of a drain; "cancelled") reports
OpenAI's "length" (the answer is truncated, and OpenAI clients only know
stop/length/...), with kvsched's own reason beside it in the choice's extra field
`kvsched_finish_reason`. A request whose engine loop failed gets an error event in
its stream (a 500 when not streamed). A request displaced after admission by a
higher tier's request (kvsched's "shed": a global limit was full and this one,
of a lower tier, gave up its place) is answered as the refusal it became: a 429
with code "shed" and Retry-After when not streamed, an error event with code
"shed" (and `retry_after` in seconds) in its stream otherwise.

A client that disconnects, mid-stream or while waiting for a non-streamed
answer, cancels its request at once (its KV pages are freed).

Draining (SIGTERM or SIGINT, `OpenAIServer.begin_drain()`, or `end_at`): /ready
turns 503 and new requests get 503 (code "draining", Retry-After); running
requests go on until `drain_seconds`, then every stream ends with a final chunk
(finish_reason "length", kvsched_finish_reason "drain_deadline") and [DONE]; the
engine writes its checkpoint (if it was given a path) and the process exits 0.
A second SIGTERM or SIGINT during the drain moves its deadline to now: the
running requests are handed back at the next step, every stream still gets its
final chunk, the checkpoint is still written and the exit status is still 0
(orchestrators send a second signal; that must not lose anything). A signal
during the warmup stops it after the program being compiled (nothing was
admitted). SIGHUP rereads the tenants
file (`OpenAIServer.reload()`).

/ready's 503 body says why: {"status": "warming", "warmup": {"done", "total",
"elapsed_s"}} while the programs compile (the log says the same, part by part),
"draining" or the scheduler's lifecycle otherwise.

Sampling defaults, for a request that leaves temperature, top_p or top_k out:
the model's own (`sampling_defaults`, from a Hugging Face directory's
generation_config.json, as vLLM does), else OpenAI's (temperature 1, top_p 1,
no top_k).

With `end_at` (a wall-clock time) the drain starts by itself, as late as the
running requests allow: when what they still have to generate (their remaining
max_tokens at the measured inter-token time, plus a second) no longer fits
before `end_at`, or `drain_seconds` before it at the latest; the drain's deadline
is `end_at`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import kvsched
from kvsched.engine.loaders.gguf_llama import encode_text
from kvsched.engine.runner import RequestOutput
from kvsched.engine.sampling import SamplingParams
from kvsched.metrics import EngineLoopCollector, SchedulerCollector
from kvsched.serve.asgi import (
    HTTP_LATENCY_BUCKETS,
    HTTPMetrics,
    SSEResponse,
    sse_event,
)
from kvsched.serve.async_engine import AsyncEngine
from kvsched.serve.engine_process import EngineGone
from kvsched.serve.engine_setup import LoadedModel, load_model, parse_end_at
from kvsched.serve.fleet_budget import FleetBudget
from kvsched.serve.lifecycle import ServerLifecycle
from kvsched.serve.logprob_tokens import TokenText
from kvsched.serve.openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    check_unsupported,
    message_text,
    validate_body,
)
from kvsched.serve.refusals import http_status
from kvsched.serve.responses import (
    Collected,
    Job,
    chat_logprobs,
    completion_logprobs,
    displaced,
    finish_fields,
    invalid,
    openai_finish_reason,
    response_body,
    usage,
)
from kvsched.serve.tenants import TenantRegistry

log = logging.getLogger("kvsched.serve")

MAX_BODY_BYTES = 1 << 20
# What OpenAI's API does with a sampling parameter left out (top_k 0: off).
OPENAI_SAMPLING: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


# -- per-request bookkeeping -----------------------------------------------------------------


# Renders (the render endpoints) tokenizing at once, at most.
RENDER_SLOTS = 4


@dataclass
class _Active:
    max_tokens: int
    produced: int = 0
    last: float = 0.0


# -- the server ------------------------------------------------------------------------------------


class OpenAIServer(ServerLifecycle):
    """The FastAPI app over one AsyncEngine and a tenant registry (see the module).

    `encode_chat(messages) -> token ids` renders the chat template (None: the chat
    endpoint is refused, "no tokenizer"); `encode_prompt(text) -> token ids` a
    completion's text as the model reads it (None: the text's tokens alone, no
    BOS). `aliases` are other names clients may give as `model`. `end_at` is a
    Unix time. `vllm_metrics`: /metrics also has the gauges routers read from
    vLLM, under vLLM's names (kvsched.metrics).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        tenants: TenantRegistry,
        *,
        model_name: str,
        encode_chat: Callable[[list[dict[str, str]]], list[int]] | None = None,
        encode_prompt: Callable[[str], list[int]] | None = None,
        aliases: Sequence[str] = (),
        max_body_bytes: int = MAX_BODY_BYTES,
        drain_seconds: float = 30.0,
        end_at: float | None = None,
        graceful_exit_s: float = 10.0,
        sampling_defaults: Mapping[str, float] | None = None,
        read_timeout_s: float = 30.0,
        max_connections: int | None = 1024,
        vllm_metrics: bool = True,
    ) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.tenants = tenants
        self.model_name = model_name
        self.model_ids = {model_name, *aliases}
        self.encode_chat = encode_chat
        self.encode_prompt = encode_prompt
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.engine.model.vocab_size
        self.max_body_bytes = max_body_bytes
        self.drain_seconds = float(drain_seconds)
        self.end_at = end_at
        self.graceful_exit_s = graceful_exit_s
        self.created = int(time.time())
        self.token_text = TokenText(self.tokenizer)
        # The most characters one token can stand for (an upper bound: a
        # vocabulary entry is never shorter than the text it decodes to).
        self.max_token_chars: int | None = (
            None if self.tokenizer is None
            else max(1, max(map(len, self.tokenizer.get_vocab()), default=1))
        )  # fmt: skip
        self.draining = False
        self.drain_deadline: float | None = None  # time.monotonic()
        self.drain_summary: dict[str, Any] | None = None
        self.drained: asyncio.Event | None = None  # made on the loop (lifespan)
        self.exit_code = 0
        self._drain_task: asyncio.Task[dict[str, Any]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._active: dict[int, _Active] = {}
        self._itl = 0.0  # a running estimate of the seconds between a stream's tokens
        self._warm_error: BaseException | None = None
        self._warm_thread: threading.Thread | None = None
        self.sampling_defaults = {**OPENAI_SAMPLING, **(sampling_defaults or {})}
        self.read_timeout_s = read_timeout_s  # a request's head and body, from its first byte
        self.max_connections = max_connections  # past it, uvicorn answers 503
        self.max_head_bytes = 64 * 1024  # request line and headers: past it, 431
        self.warmup_progress: dict[str, Any] | None = None  # while warming: done, total, elapsed
        self.listening_message: str | None = None  # printed once the socket listens
        # The tenants file's [scheduler] table as the server started with it (set
        # by `kvsched serve`): a reload that finds it changed says it needs a restart.
        self.scheduler_table: dict[str, Any] | None = None
        self.registry = CollectorRegistry()
        info = {**engine.engine.model_info(), "name": model_name}
        # vLLM's gauge names beside ours, for routers that scrape them (kvsched.metrics).
        vllm_name = model_name if vllm_metrics else None
        # The engine in its own process (kvsched.serve.engine_process) collects
        # its families there; /metrics adds them to this registry's.
        self._remote_engine = bool(getattr(engine, "remote", False))
        if self._remote_engine:
            client: Any = engine  # an EngineClient
            client.on_death = self._on_engine_death
        else:
            self.registry.register(SchedulerCollector(self.scheduler, model=info,
                                                      vllm_model_name=vllm_name))  # fmt: skip
            self.registry.register(EngineLoopCollector(engine))
        self._render_slots = asyncio.Semaphore(RENDER_SLOTS)
        self.tenants.apply(self.scheduler)  # the file's tenants, before any request
        # Fleet-wide rates (a [fleet] table; set by `kvsched serve` before it runs).
        self.fleet: FleetBudget | None = None
        self.app = self._build_app()

    # -- the app ---------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kvsched", lifespan=self._lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)  # fmt: skip
        app.state.server = self

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            err = APIError(exc.status_code, str(exc.detail),
                           code="not_found" if exc.status_code == 404 else None)  # fmt: skip
            return JSONResponse(err.body(), status_code=exc.status_code,
                                headers=getattr(exc, "headers", None))  # fmt: skip

        @app.exception_handler(RequestValidationError)
        async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
            return JSONResponse(bad_request(str(exc.errors()[0].get("msg"))).body(), 400)

        @app.exception_handler(ClientDisconnect)
        async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
            # The client left mid-upload: not a server error, nothing to log loudly,
            # and nobody reads this answer (499: nginx's "client closed request").
            log.debug("client disconnected on %s", request.url.path)
            return Response(status_code=499)

        @app.exception_handler(EngineGone)
        async def engine_gone(request: Request, exc: EngineGone) -> JSONResponse:
            err = APIError(503, f"the engine is not running: {exc}", code="engine_down")
            return JSONResponse(err.body(), 503)

        @app.exception_handler(Exception)
        async def internal_error(request: Request, exc: Exception) -> JSONResponse:
            log.exception("internal error on %s", request.url.path)
            return JSONResponse(APIError(500, "internal server error").body(), 500)

        @app.get("/health")
        async def health() -> JSONResponse:
            if self.live():
                return JSONResponse({"status": "ok"})
            return JSONResponse({"status": "dead"}, status_code=503)

        @app.get("/ready")
        async def ready() -> JSONResponse:
            if self.ready():
                return JSONResponse({"status": "ready"})
            body: dict[str, Any] = {"status": "draining" if self.draining else "warming"}
            warming = self.warmup_progress
            if warming is not None and not self.draining:
                body["warmup"] = dict(warming)
            elif not self.draining and self._warm_error is None:
                body["status"] = self.scheduler.lifecycle
            if self._warm_error is not None:
                body["status"], body["error"] = "failed", f"warmup failed: {self._warm_error}"
            return JSONResponse(body, status_code=503)

        @app.get("/metrics")
        async def metrics() -> Response:
            body = generate_latest(self.registry)
            if self._remote_engine:
                client: Any = self.engine  # an EngineClient
                body += await asyncio.to_thread(client.metrics_text)
            return Response(body, media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            self._authenticate(request)
            return JSONResponse({"object": "list", "data": [self._model_card()]})

        @app.get("/v1/models/{model_id:path}")
        async def model(request: Request, model_id: str) -> JSONResponse:
            self._authenticate(request)
            self._check_model(model_id, param=None)
            return JSONResponse(self._model_card())

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._handle(request, "completion")

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self._handle(request, "chat")

        @app.get("/fleet/demand")
        async def fleet_demand(request: Request) -> JSONResponse:
            # The tokens each tenant asked of this replica, for its peers'
            # fleet-wide rates (kvsched.serve.fleet_budget); 404 without [fleet].
            if self.fleet is None:
                raise APIError(404, "no [fleet] table: this replica keeps its own budgets",
                               code="not_found")  # fmt: skip
            if not self.fleet.authorized(request.headers.get("authorization", "")):
                raise APIError(401, "the fleet key is required", code="invalid_api_key")
            return JSONResponse({"demand": self.fleet.demand})

        # What a request's prompt is in tokens, as vLLM's render endpoints say:
        # KV-aware routers (vllm-router's kv_aware) ask each replica before
        # choosing one, and match the ids against the replicas' KV events.
        @app.post("/v1/completions/render")
        async def completions_render(request: Request) -> JSONResponse:
            return await self._render(request, "completion")

        @app.post("/v1/chat/completions/render")
        async def chat_render(request: Request) -> JSONResponse:
            return await self._render(request, "chat")

        requests = Counter("kvsched_http_requests", "HTTP requests answered.",
                           ["route", "method", "status"], registry=self.registry)  # fmt: skip
        latency = Histogram(
            "kvsched_http_request_duration_seconds", "Request start to response end.",
            ["route", "method", "status"], registry=self.registry, buckets=HTTP_LATENCY_BUCKETS,
        )  # fmt: skip
        app.add_middleware(HTTPMetrics, requests=requests, latency=latency)
        return app

    def _on_engine_death(self, error: BaseException) -> None:
        """The engine process died (every stream was told): exit, status 1."""
        loop = self._loop
        if loop is None:  # not serving yet: the lifespan sees the dead engine
            self.exit_code = 1
            return

        def exit_now() -> None:
            log.error("the engine process is gone (%s): exiting", error)
            self.exit_code = 1
            if self._uvicorn is not None:
                self._uvicorn.should_exit = True

        with contextlib.suppress(RuntimeError):  # the loop has closed: exiting already
            loop.call_soon_threadsafe(exit_now)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "kvsched",
                "max_model_len": self.scheduler.config.max_seq_len}  # fmt: skip

    def _check_model(self, name: str, param: str | None = "model") -> None:
        if name not in self.model_ids:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param=param, code="model_not_found",
                           type="invalid_request_error")  # fmt: skip

    def _authenticate(self, request: Request) -> str:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        tenant = self.tenants.authenticate(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            msg = ("no API key given: send Authorization: Bearer <key>" if not header
                   else "incorrect API key provided")  # fmt: skip
            raise APIError(401, msg, type="invalid_request_error", code="invalid_api_key")
        return tenant

    async def _read_body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        too_big = APIError(413, f"the request body is over {limit} bytes",
                           code="request_too_large")  # fmt: skip
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    raise too_big
            except ValueError:
                raise bad_request("Content-Length is not a number") from None
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    # -- requests ----------------------------------------------------------------------------

    @staticmethod
    def _text_len(req: Any, kind: str) -> tuple[int, str] | None:
        """(characters, parameter) of a prompt given as text; None for token ids."""
        if kind == "chat":
            return sum(len(m.content) if isinstance(m.content, str)
                       else sum(len(p.text or "") for p in m.content or ())
                       for m in req.messages), "messages"  # fmt: skip
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        return (len(prompt), "prompt") if isinstance(prompt, str) else None

    def _refuse_before_tokenizing(
        self, tenant: str, req: Any, kind: str, *, demand: bool = True
    ) -> None:
        """What can be refused from a text's length alone is, untokenized: a text
        longer than the context could hold at the vocabulary's longest token (it
        cannot fit, whatever its tokens: each covers at most `max_token_chars`
        characters), and one whose fewest possible tokens the tenant's rate limit
        cannot cover now (429 with Retry-After) or ever (400)."""
        if self.max_token_chars is None or (text := self._text_len(req, kind)) is None:
            return
        text_len, param = text
        ctx = self.scheduler.config.max_seq_len
        if text_len > ctx * self.max_token_chars:
            raise bad_request(
                f"{param}: {text_len} characters cannot fit this model's context of {ctx} "
                f"tokens (its longest token is {self.max_token_chars} characters)",
                param=param, code="context_length_exceeded",
            )  # fmt: skip
        fewest = -(-text_len // self.max_token_chars)
        if self.fleet is not None and demand:
            self.fleet.note(tenant, fewest)  # asked, whether or not it passes
        try:
            wait = self.scheduler.rate_wait(tenant, fewest)
        except kvsched.UnknownTenant:  # removed by a reload since: submit says so
            return
        if wait == math.inf:
            raise APIError(400, f"{param}: at least {fewest} tokens, more than tenant {tenant!r}'s "
                           "rate limit holds (its burst_tokens)", param=param,
                           code="rate_limited")  # fmt: skip
        if wait > 0:
            raise APIError(429, f"{param}: tenant {tenant!r} is over its rate limit for the "
                           f"{fewest} tokens this prompt holds at least",
                           code="rate_limited",
                           headers={"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip

    def _prompt_ids(self, req: Any, kind: str) -> tuple[list[int], str]:
        """Token ids of the prompt and the parameter they came from."""
        if kind == "chat":
            if self.encode_chat is None:
                raise bad_request("this model has no chat template (or no tokenizer): use "
                                  "/v1/completions", param="messages",
                                  code="no_tokenizer")  # fmt: skip
            if not req.messages:
                raise bad_request("messages: must not be empty", param="messages")
            msgs = [
                {"role": "system" if m.role == "developer" else m.role,
                 "content": message_text(i, m)}
                for i, m in enumerate(req.messages)
            ]  # fmt: skip
            try:
                return list(self.encode_chat(msgs)), "messages"
            except ValueError as e:
                raise bad_request(f"messages: {e}", param="messages") from None
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request(f"prompt: {len(prompt)} prompts in one request; this server "
                                  "takes one (send one request each)", param="prompt")  # fmt: skip
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_request("prompt: this model has no tokenizer; give the prompt as "
                                  "a list of token ids", param="prompt",
                                  code="no_tokenizer")  # fmt: skip
            # The GIL released while it runs (encode_prompt tokenizes alike).
            if self.encode_prompt is not None:
                ids = list(self.encode_prompt(prompt))
            else:
                ids = encode_text(self.tokenizer, prompt)
        else:
            ids = list(prompt)
            vocab = self.vocab_size
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise bad_request(f"prompt: token id {bad} is outside this model's vocabulary "
                                  f"(0 to {vocab - 1})", param="prompt")  # fmt: skip
        if not ids:
            raise bad_request("prompt: must not be empty", param="prompt")
        return ids, "prompt"

    def _sampling(self, req: Any, kind: str, n_prompt: int, prompt_param: str) -> SamplingParams:
        ctx = self.scheduler.config.max_seq_len
        if n_prompt >= ctx:
            raise bad_request(f"{prompt_param}: {n_prompt} tokens; this model's context is "
                              f"{ctx} tokens, with room for at least one more",
                              param=prompt_param, code="context_length_exceeded")  # fmt: skip
        param = "max_tokens"
        max_tokens = req.max_tokens
        if kind == "chat" and req.max_completion_tokens is not None:
            param, max_tokens = "max_completion_tokens", req.max_completion_tokens
        if max_tokens is None:
            max_tokens = ctx - n_prompt
        elif max_tokens < 1:
            raise bad_request(f"{param}: must be >= 1, got {max_tokens}", param=param)
        elif n_prompt + max_tokens > ctx:
            raise bad_request(
                f"{param}: {max_tokens} tokens after a prompt of {n_prompt} is more than this "
                f"model's context of {ctx} tokens (at most {ctx - n_prompt})",
                param=param, code="context_length_exceeded",
            )  # fmt: skip
        if kind == "chat":
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
        try:
            default = self.sampling_defaults
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=default["temperature"] if req.temperature is None else req.temperature,
                top_p=default["top_p"] if req.top_p is None else req.top_p,
                top_k=int(default["top_k"]) if req.top_k is None else max(0, req.top_k),
                seed=req.seed, stop=req.stop or (), logprobs=logprobs, ignore_eos=req.ignore_eos,
            )  # fmt: skip
        except kvsched.InvalidRequest as e:
            raise invalid(e, kind) from None

    async def _read_request(self, request: Request, kind: str) -> tuple[str, Any]:
        """(tenant, request) of a completion or chat body: the API key, the
        body's size and schema, the model, what is not supported."""
        tenant = self._authenticate(request)
        body = await self._read_body(request)
        model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        req = validate_body(model_cls, body)
        self._check_model(req.model)
        check_unsupported(req)
        return tenant, req

    async def _handle(self, request: Request, kind: str) -> Response:
        tenant, req = await self._read_request(request, kind)
        self._refuse_if_draining()
        self._refuse_before_tokenizing(tenant, req, kind)
        # Templates and tokenizers run off the event loop: a long prompt must not
        # stall every other request, /health included.
        ids, prompt_param = await asyncio.to_thread(self._prompt_ids, req, kind)
        try:
            params = self._sampling(req, kind, len(ids), prompt_param)
        except APIError:
            # Refused after its prompt was read (too long for the context, say):
            # charged to the tenant's rate as if admitted, or refusals would be a
            # free way to spend the server's time.
            with contextlib.suppress(kvsched.UnknownTenant):  # a reload removed it
                self.scheduler.charge_rate(tenant, len(ids))
            raise
        if self.fleet is not None:
            # What the bucket charges (less what the text's length counted).
            chars = self.max_token_chars
            text = self._text_len(req, kind) if chars is not None else None
            counted = 0 if text is None or chars is None else -(-text[0] // chars)
            self.fleet.note(tenant, max(0, len(ids) + params.max_tokens - counted))
        try:
            stream = await self.engine.generate(tenant, ids, params)
        except kvsched.Rejected as e:
            raise self._rejected(e, kind) from None
        except RuntimeError as e:  # the engine loop died
            raise APIError(503, f"the engine is not running: {e}", code="engine_down") from None
        now = time.monotonic()
        self._active[stream.request_id] = _Active(params.max_tokens, last=now)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        job = Job(kind, tenant, stream, req.model, params.max_tokens, params.logprobs,
                   include_usage, f"{prefix}-{uuid.uuid4().hex}", int(time.time()),
                   self.tokenizer is None or req.return_token_ids)  # fmt: skip
        if req.stream:
            return SSEResponse(self._events(job), lambda: self._finish(job))
        try:
            got = await self._collect(request, job)
        finally:
            await self._finish(job)
        if got is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if got.final is not None and got.final.finish_reason == "error":
            raise APIError(500, "the engine failed while generating", code="engine_error")
        if got.final is not None and got.final.finish_reason == "shed":
            raise displaced(got.final)
        return JSONResponse(response_body(job, got, self.token_text))

    async def _render(self, request: Request, kind: str) -> JSONResponse:
        """`{"token_ids": [...]}`: the prompt's tokens as the request would be
        served (chat template, BOS), nothing admitted or charged. The same
        checks as the request itself before admission: an API key, the body's
        size and schema, the model, the prompt and max_tokens against the
        context, a tenant over its rate (429). At most RENDER_SLOTS run at
        once (the others wait their turn): a router renders each request on
        every replica, and a tenant must not spend the tokenizer's time
        without bound."""
        tenant, req = await self._read_request(request, kind)
        # A router renders each request on every replica: no demand is counted.
        self._refuse_before_tokenizing(tenant, req, kind, demand=False)
        async with self._render_slots:
            ids, prompt_param = await asyncio.to_thread(self._prompt_ids, req, kind)
        self._sampling(req, kind, len(ids), prompt_param)
        return JSONResponse({"token_ids": ids})

    def _rejected(self, e: kvsched.Rejected, kind: str) -> APIError:
        if isinstance(e, kvsched.InvalidRequest) or e.reason in ("invalid", "too_long"):
            err = invalid(e, kind)
            err.code = e.reason
            return err
        status, headers = http_status(e)
        if status in (429, 503) and "Retry-After" not in headers:
            headers = {**headers, **(self._drain_retry_after() if e.reason == "draining"
                                     else {"Retry-After": "1"})}  # fmt: skip
        return APIError(status, str(e), code=e.reason, headers=headers)

    async def _finish(self, job: Job) -> None:
        """The request's end, however it came: cancel it if it is still running."""
        self._active.pop(job.stream.request_id, None)
        if not job.stream.finished:
            await job.stream.cancel()

    def _observe(self, rid: int, out: RequestOutput, got: Collected) -> None:
        got.token_ids += out.token_ids
        got.text.append(out.text)
        if out.logprobs:
            got.logprobs += out.logprobs
        if out.finished:
            got.final = out
        act = self._active.get(rid)
        if act is not None and out.token_ids:
            now = time.monotonic()
            if act.produced:
                dt = now - act.last
                self._itl = 0.8 * self._itl + 0.2 * dt if self._itl else dt
            act.produced += len(out.token_ids)
            act.last = now

    async def _collect(self, request: Request, job: Job) -> Collected | None:
        """Read the whole stream; None when the client went away first (the request
        is then cancelled by `_finish`)."""
        got = Collected()
        gone = False
        rid = job.stream.request_id
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal gone
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                gone = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            async for out in job.stream.coalesced():
                self._observe(rid, out, got)
            tg.cancel_scope.cancel()
        return None if gone else got

    async def _events(self, job: Job) -> AsyncIterator[bytes]:
        """The SSE body of a streamed request."""
        chat = job.kind == "chat"
        base: dict[str, Any] = {"id": job.id,
                                "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": job.created, "model": job.model}  # fmt: skip
        if job.include_usage:
            base["usage"] = None
        got = Collected()
        rid = job.stream.request_id
        offset = 0

        def chunk(out: RequestOutput | None, extra: dict[str, Any]) -> bytes:
            nonlocal offset
            text = out.text if out is not None else ""
            lps = (out.logprobs or []) if out is not None else []
            choice: dict[str, Any] = {"index": 0}
            lp = None
            if job.logprobs is not None:
                lp = (chat_logprobs(self.token_text, lps) if chat
                      else completion_logprobs(self.token_text, lps, offset))  # fmt: skip
            if chat:
                choice["delta"] = {"content": text} if text or not extra else {}
            else:
                choice["text"] = text
            offset += len(text)
            choice["logprobs"] = lp
            if job.token_ids:
                choice["token_ids"] = out.token_ids if out is not None else []
            choice["finish_reason"] = None
            choice.update(extra)
            return sse_event({**base, "choices": [choice]})

        if chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}  # fmt: skip
            yield sse_event({**base, "choices": [first]})
        async for out in job.stream.coalesced():
            self._observe(rid, out, got)
            if out.finished:
                break
            if out.text or (out.token_ids and (job.token_ids or job.logprobs is not None)):
                yield chunk(out, {})
        final = got.final
        if final is not None and final.finish_reason in ("error", "shed") and final.text:
            # Tokens merged into the ending (coalesced) reach the client first.
            yield chunk(final, {})
        if final is not None and final.finish_reason == "error":
            err = APIError(500, "the engine failed while generating", code="engine_error")
            yield sse_event(err.body())
        elif final is not None and final.finish_reason == "shed":
            err = displaced(final)
            body = err.body()
            body["error"]["retry_after"] = final.retry_after
            yield sse_event(body)
        else:
            yield chunk(final, finish_fields(final))
            if job.include_usage:
                yield sse_event({**base, "choices": [], "usage": usage(job, got)})
        yield b"data: [DONE]\n\n"


__all__ = ["LoadedModel", "OpenAIServer", "load_model", "openai_finish_reason", "parse_end_at"]
