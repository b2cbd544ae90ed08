"""OpenAI-compatible request and response schemas (pydantic), plus the API error type.

Requests are validated strictly (a string is not a number, a number is not a bool),
unknown fields are ignored as OpenAI does, and parameters this server cannot honour
(n != 1, logprobs, penalties, tools, ...) are refused with a message instead of being
silently ignored. Every refusal becomes an `APIError` with HTTP status 400.
"""
from __future__ import annotations

import re
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator

from engine.sampling import MAX_STOP_CHARS

#: torch.Generator.manual_seed accepts [-2**63, 2**64 - 1].
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_STOP = 4
#: Most messages in one chat request.
MAX_MESSAGES = 1024
#: max_tokens of a text completion that does not say (the OpenAI API's default).
COMPLETION_DEFAULT_MAX_TOKENS = 16


class APIError(Exception):
    """An error returned to the client in the OpenAI envelope.

    status: HTTP status; message: human-readable text (never a stack trace);
    type: OpenAI error type ('invalid_request_error', 'authentication_error', ...);
    param: the offending request field or None; code: short machine-readable code or None;
    headers: extra response headers (for example Retry-After).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def envelope(self) -> dict:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# ---- requests ----------------------------------------------------------------------------------------
class TextPart(_Strict):
    """One content part; only text parts are supported."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A chat message. 'developer' is treated as 'system' (newer OpenAI name)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs content")
        return self

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def as_template_dict(self) -> dict:
        """{'role', 'content'} for the chat template ('developer' mapped to 'system')."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class StreamOptions(_Strict):
    include_usage: bool = False


_NULLABLE_WITH_DEFAULT = {"temperature", "top_p", "top_k", "n", "stream", "presence_penalty", "frequency_penalty"}


class _SamplingFields(_Strict):
    """Fields shared by chat and text completions. Ranges follow the OpenAI API."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # extension (vLLM): 0 or -1 disables
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # The OpenAI API marks these nullable; clients send explicit nulls for "use the default".
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NULLABLE_WITH_DEFAULT)}
        return data

    @field_validator("n")
    @classmethod
    def _n_is_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"n must be 1: this server returns one choice per request (got {v})")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed (got {len(items)})")
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise ValueError(f"stop strings may be at most {MAX_STOP_CHARS} characters long")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("presence and frequency penalties are not supported (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v, info):
        # a field validator (stream is declared before it), so the error names stream_options
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported by this server")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v):
        if v is not None:
            raise ValueError("top_logprobs is not supported by this server")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tools are not supported by this server")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    """POST /v1/completions body (legacy text completion; one prompt string)."""

    prompt: str
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v is not None:
            raise ValueError("logprobs are not supported by this server")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, v):
        if v is not None and v != 1:
            raise ValueError("best_of must be 1")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported by this server")
        return v

    def requested_max_tokens(self) -> int:
        """max_tokens, or 16 when not given (the OpenAI API's default for text completions)."""
        return self.max_tokens if self.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS


def parse_request(model: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a JSON body against `model`.

    Raises APIError(400) naming the first offending field ('messages[0].role' style) for
    invalid JSON, a non-object body, a wrong type, a missing field or an out-of-range value.
    """
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        err = errors[0]
        if len(errors) > 1 and err.get("loc"):
            # A union (like content: str | list[parts]) reports one error per branch: keep the deepest.
            same = [x for x in errors if x.get("loc", ())[:1] == err["loc"][:1]]
            err = max(same, key=lambda x: len(x.get("loc", ())))
        kind = err.get("type", "")
        if kind == "json_invalid":
            why = _LONE_SURROGATE if _has_lone_surrogate(body, str(err.get("msg", ""))) else err.get("msg")
            raise APIError(400, f"the request body is not valid JSON: {why}", code="invalid_json") from None
        if kind in ("model_type", "model_attributes_type") and not err.get("loc"):
            raise APIError(400, "the request body must be a JSON object", code="invalid_body") from None
        param = _loc_to_param(err.get("loc", ()))
        msg = str(err.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        text = f"{param}: {msg}" if param else msg
        code = "missing_required_parameter" if kind == "missing" else "invalid_value"
        raise APIError(400, text, param=param, code=code) from None


_LONE_SURROGATE = ("a \\u escape in a string encodes half of a UTF-16 surrogate pair "
                   "(U+D800-U+DFFF) without the other half, which is no character")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_POSITION = re.compile(r"line (\d+) column (\d+)")


def _has_lone_surrogate(body: bytes, msg: str) -> bool:
    """True when pydantic's JSON error `msg` is a bad hex escape and the escape it points at
    encodes a surrogate (U+D800-U+DFFF): pydantic reports an unpaired one as an 'unexpected end
    of hex escape'. Reads only the few bytes before the reported position."""
    where = _POSITION.search(msg) if "hex escape" in msg else None
    if where is None:
        return False
    line_no, col = int(where.group(1)), int(where.group(2))
    lines = body.split(b"\n", line_no)
    if line_no > len(lines):
        return False
    line = lines[line_no - 1]
    return _SURROGATE_ESCAPE.search(line[max(col - 14, 0):col + 1]) is not None


_UNION_TAGS = {"str", "int", "float", "bool", "none", "TextPart"}


def _loc_to_param(loc) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'. Union branch names (like 'str') are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in str(part) or "(" in str(part):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or None


# ---- responses ---------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    """Token counts: prompt tokens as fed to the model, completion tokens as returned."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecStats(BaseModel):
    """Extension field 'bastion': speculative-decoding statistics of one response.

    steps: verification steps (target forwards after the prefill); tau: committed tokens per
    step, bonus included (1.0 for plain decoding); mean_tree_size: tree nodes verified per step,
    root included; draft_tokens: tree nodes verified, roots excluded; accepted_tokens: drafted
    tokens committed (bonus tokens excluded).
    """

    steps: int
    tau: float
    mean_tree_size: float
    draft_tokens: int
    accepted_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    bastion: SpecStats


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    bastion: SpecStats | None = None


# ---- stream chunks (SSE) ---------------------------------------------------------------------------
class ChatDelta(BaseModel):
    """What a chat chunk adds: the role (first chunk), a text delta, or nothing (final chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: ChatDelta) -> dict:
        return delta.model_dump(exclude_none=True)


class CompletionChunkChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class StreamChunk(BaseModel):
    """One SSE chunk. `usage` is sent (null until the usage chunk) only when the client asked
    for it with stream_options.include_usage; `bastion` (the SpecStats) only on the final chunk."""

    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: UsageInfo | None = None
    bastion: SpecStats | None = None

    def frame(self, include_usage: bool) -> dict:
        """The JSON object sent in one `data:` frame."""
        exclude = set() if include_usage else {"usage"}
        if self.bastion is None:
            exclude.add("bastion")
        return self.model_dump(exclude=exclude)


class ChatCompletionChunk(StreamChunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(StreamChunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "bastion"
    max_model_len: int
    dtype: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
