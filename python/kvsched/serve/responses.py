"""The OpenAI response bodies of `kvsched serve`: usage, finish reasons,
logprobs in the chat and completion shapes, the whole answer of a request that
is not streamed, and the errors a request's end or refusal becomes.

Finish reasons: kvsched's "stop" and "length" are OpenAI's; any other ending
("drain_deadline", "cancelled") reports "length", with kvsched's own reason
in the choice's extra field `kvsched_finish_reason`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import kvsched
from kvsched.engine.runner import RequestOutput, TokenLogprob
from kvsched.serve.async_engine import RequestStream
from kvsched.serve.logprob_tokens import TokenText
from kvsched.serve.openai_schema import APIError, bad_request

OPENAI_FINISH = {"stop": "stop", "length": "length"}


def openai_finish_reason(reason: kvsched.FinishReason | None) -> str:
    """OpenAI's finish_reason for kvsched's (see the module)."""
    return OPENAI_FINISH.get(reason or "", "length")


@dataclass
class Job:
    """One admitted request as the endpoints see it."""

    kind: str  # "chat" or "completion"
    tenant: str
    stream: RequestStream
    model: str
    max_tokens: int
    logprobs: int | None
    include_usage: bool
    id: str
    created: int
    token_ids: bool = False  # put each choice's token ids in the response (an extension)


class Collected:
    """Everything a request produced."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.final: RequestOutput | None = None


def usage(job: Job, got: Collected) -> dict[str, int]:
    prompt = job.stream.prompt_tokens
    done = len(got.token_ids)
    if got.final is not None:
        done = max(done, got.final.completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": done,
            "total_tokens": prompt + done}  # fmt: skip


def finish_fields(final: RequestOutput | None) -> dict[str, Any]:
    reason = final.finish_reason if final is not None else "cancelled"
    out: dict[str, Any] = {"finish_reason": openai_finish_reason(reason)}
    if reason not in OPENAI_FINISH:
        out["kvsched_finish_reason"] = reason
    return out


def chat_logprobs(token_text: TokenText, lps: list[TokenLogprob]) -> dict[str, Any]:
    content = []
    for lp in lps:
        text, raw = token_text(lp.token_id)
        top = []
        for tid, v in lp.top:
            t, b = token_text(tid)
            top.append({"token": t, "logprob": v, "bytes": b})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw,
                        "top_logprobs": top})  # fmt: skip
    return {"content": content}


def completion_logprobs(
    token_text: TokenText, lps: list[TokenLogprob], offset: int
) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text, _ = token_text(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({token_text(tid)[0]: v for tid, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def response_body(job: Job, got: Collected, token_text: TokenText) -> dict[str, Any]:
    text = "".join(got.text)
    lp = None
    if job.logprobs is not None:
        lp = (chat_logprobs(token_text, got.logprobs) if job.kind == "chat"
              else completion_logprobs(token_text, got.logprobs, 0))  # fmt: skip
    choice: dict[str, Any] = {"index": 0}
    if job.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
        obj = "chat.completion"
    else:
        choice["text"] = text
        obj = "text_completion"
    choice["logprobs"] = lp
    if job.token_ids:
        choice["token_ids"] = got.token_ids
    choice.update(finish_fields(got.final))
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model,
            "choices": [choice], "usage": usage(job, got)}  # fmt: skip


def displaced(final: RequestOutput) -> APIError:
    """The 429 of a request a higher tier displaced (finish reason "shed")."""
    wait = final.retry_after
    headers = {}
    if wait is not None and math.isfinite(wait):
        headers["Retry-After"] = str(max(1, math.ceil(wait)))
    else:
        headers["Retry-After"] = "1"
    return APIError(429, "overloaded: a higher tier's request took this request's place "
                    f"after {final.completion_tokens} generated token(s); retry later",
                    code="shed", headers=headers)  # fmt: skip


def invalid(e: kvsched.Rejected, kind: str) -> APIError:
    """kvsched.InvalidRequest ("field: why") as a 400 naming the parameter."""
    msg = str(e)
    head, sep, _ = msg.partition(":")
    param = head.strip() if sep and head.strip().isidentifier() else None
    if param == "prompt_ids":
        param = "messages" if kind == "chat" else "prompt"
    if param == "logprobs" and kind == "chat":
        param = "top_logprobs"
    return bad_request(msg, param=param)
