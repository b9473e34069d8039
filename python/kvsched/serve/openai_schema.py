"""The OpenAI API's request bodies (the parts kvsched serves) and its error shape.

Requests are validated strictly (`validate_body`): a JSON number where a string
belongs, a float for an integer, a string for a number are all 400s naming the
parameter, as OpenAI answers them. Fields OpenAI defines that kvsched does not
implement are accepted at their neutral values only (n=1, best_of=1, echo=false,
no penalties, no logit_bias, no tools, text responses) and refused otherwise;
fields nobody defines are ignored (clients send extras such as `user`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error answered in OpenAI's shape:
    {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip


def error_type(status: int) -> str:
    """OpenAI's error `type` for a status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class _Common(_Body):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM's); 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # an extension (vLLM's)
    return_token_ids: bool = False  # an extension (vLLM's): each choice's token ids


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


_UNION_HINTS = {
    "prompt": "must be a string, a list of token ids, or a list of one of those",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts",
}


def _describe(err: ValidationError) -> APIError:
    e = err.errors(include_url=False)[0]
    if e["type"] == "json_invalid":
        msg = e["msg"]
        if "hex escape" in msg and "surrogate" not in msg or "lone" in msg:
            # The parser's words for a \\uD800-\\uDFFF escape with no partner.
            msg += (" (a \\u escape cut short, or a UTF-16 surrogate without its pair: "
                    "neither is a character)")  # fmt: skip
        return bad_request(f"the body is not valid JSON: {msg}", code="invalid_json")
    if e["type"] == "model_type" and not e["loc"]:
        return bad_request("the body must be a JSON object")
    # Union branches show up in `loc` as type names ("str", "list[int]"); keep fields.
    loc = [p for p in e["loc"] if isinstance(p, int) or ("[" not in p and p not in _TYPES)]
    param = ".".join(str(p) for p in loc) or None
    last = next((p for p in reversed(loc) if isinstance(p, str)), None)
    if e["type"] == "missing":
        msg = f"{param}: a required parameter is missing"
    elif e["type"] == "literal_error":
        msg = f"{param}: {e['msg']}"
    elif last in _UNION_HINTS and len(err.errors()) > 1:
        msg = f"{param}: {_UNION_HINTS[last]}"
    else:
        msg = f"{param}: {e['msg'].replace('Input should', 'should')}"
    return bad_request(msg, param=param)


_TYPES = {"str", "int", "float", "bool", "list", "dict", "TextPart", "none"}


def validate_body(model: type[BaseModel], body: bytes) -> Any:
    """Parse and check a request body; APIError(400) naming the parameter."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as err:
        raise _describe(err) from None


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse OpenAI features kvsched does not implement (400, naming them)."""

    def refuse(param: str, what: str) -> None:
        raise bad_request(f"{param}: {what} is not supported by this server", param=param)

    if req.n is not None and req.n != 1:
        refuse("n", "n other than 1")
    if req.presence_penalty:
        refuse("presence_penalty", "a presence penalty")
    if req.frequency_penalty:
        refuse("frequency_penalty", "a frequency penalty")
    if req.logit_bias:
        refuse("logit_bias", "logit_bias")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k: must be a positive count, or 0 or -1 for none; got "
                          f"{req.top_k}", param="top_k")  # fmt: skip
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings", param="stop")
    if isinstance(req, CompletionRequest):
        if req.echo:
            refuse("echo", "echo")
        if req.best_of is not None and req.best_of != 1:
            refuse("best_of", "best_of other than 1")
        if req.suffix:
            refuse("suffix", "suffix")
    else:
        if req.tools or req.functions:
            refuse("tools", "tool calling")
        if req.response_format and req.response_format.get("type", "text") != "text":
            refuse("response_format", "a response_format other than text")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: needs logprobs=true", param="top_logprobs")


def message_text(i: int, msg: ChatMessage) -> str:
    """A chat message's text (text parts joined); 400 for other part types."""
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    out = []
    for j, part in enumerate(msg.content):
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages.{i}.content.{j}: only text parts are supported, "
                              f"not {part.type!r}", param=f"messages.{i}.content")  # fmt: skip
        out.append(part.text)
    return "".join(out)
