"""OpenAI API request and response models (pydantic), with the vLLM sampling extensions.

The request models double as the server's OpenAPI schema, so their bounds are the engine's own
(``SamplingParams.validate``): a schema-valid request is a request the engine accepts, except for what
needs the tokenizer (prompt length, token ids within the vocabulary), which the engine checks itself.
Unknown fields are ignored (as OpenAI and vLLM do); fields dspark does not implement are rejected
with a 400 that names them rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr

from dspark.sampling_params import InvalidRequestError, SamplingParams

# Bounds shared by the schema and the engine's validation.
MAX_LOGPROBS = 20
MAX_N = 64  # choices per prompt (each is one engine request)
MAX_STOP = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_CHOICES = 256  # prompts x n in one request
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class BadRequest(InvalidRequestError):
    """A client mistake found by the server (400), naming the offending field in ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _json_int(v: Any) -> Any:
    """JSON integers: ints and integer-valued floats (1.0); never booleans or strings."""
    if isinstance(v, bool):
        raise ValueError("Input should be a valid integer, not a boolean")
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _json_float(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("Input should be a valid number, not a boolean")
    return v


def Int(**bounds: Any) -> Any:
    """A JSON integer with bounds (ge/gt/le) that show up in the OpenAPI schema."""
    return Annotated[int, Field(strict=True, **bounds), BeforeValidator(_json_int)]


def Float(**bounds: Any) -> Any:
    """A finite JSON number with bounds that show up in the OpenAPI schema."""
    return Annotated[float, Field(strict=True, allow_inf_nan=False, **bounds), BeforeValidator(_json_float)]


NonEmptyStr = Annotated[str, Field(strict=True, min_length=1)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _SamplingFields(OpenAIBaseModel):
    """Sampling fields common to completions and chat (OpenAI names, then vLLM extras)."""

    model: StrictStr | None = Field(None, description="served model name; omitted = the served model")
    n: Int(ge=1, le=MAX_N) | None = Field(1)
    temperature: Float(ge=0.0) | None = Field(None, description="0 = greedy; default 1.0")
    top_p: Float(gt=0.0, le=1.0) | None = Field(None)
    presence_penalty: Float(ge=-2.0, le=2.0) | None = Field(0.0)
    frequency_penalty: Float(ge=-2.0, le=2.0) | None = Field(0.0)
    seed: Int(ge=SEED_MIN, le=SEED_MAX) | None = Field(None)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"up to {MAX_STOP} stop strings")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="not supported: empty or null")
    # vLLM extensions
    top_k: Int(ge=-1) | None = Field(None)
    min_p: Float(ge=0.0, le=1.0) | None = Field(None)
    repetition_penalty: Float(gt=0.0, le=100.0) | None = Field(None)
    stop_token_ids: list[Int(ge=0)] | None = Field(None, max_length=256)
    ignore_eos: StrictBool | None = False
    include_stop_str_in_output: StrictBool | None = False

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")

    def _stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise BadRequest(f"at most {MAX_STOP} stop strings are allowed, got {len(stop)}", param="stop")
        for s in stop:
            if not s:
                raise BadRequest("stop strings must be non-empty", param="stop")
        return stop

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Engine params; max_tokens None means 'fill the context' and is resolved once the prompt
        length is known (the placeholder 1 passes validation)."""
        try:
            return SamplingParams(
                max_tokens=1 if max_tokens is None else max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                frequency_penalty=self.frequency_penalty or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                seed=self.seed,
                stop=self._stop_list(),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=bool(self.ignore_eos),
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                logprobs=logprobs,
            )
        except InvalidRequestError:
            raise
        except (TypeError, ValueError) as e:  # defensive: SamplingParams only raises InvalidRequestError
            raise BadRequest(str(e)) from None

    def seeds(self) -> list[int | None]:
        """Per-choice seeds: seed + i when seeded (so n choices differ), else engine-drawn."""
        if self.seed is None:
            return [None] * self.num_choices
        return [self.seed + i for i in range(self.num_choices)]

    @property
    def num_choices(self) -> int:
        return self.n or 1


# ------------------------------------------------------------------ /v1/completions
TokenIds = Annotated[list[Int(ge=0)], Field(min_length=1)]
PromptType = Union[
    NonEmptyStr,
    Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)],
    TokenIds,
    Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)],
]


class CompletionRequest(_SamplingFields):
    prompt: PromptType = Field(..., description="a string, a list of strings, token ids, or lists of token ids")
    max_tokens: Int(ge=1) | None = Field(16, description="default 16; null = up to the context length")
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(None)
    echo: StrictBool | None = False
    best_of: Int(ge=1, le=MAX_N) | None = Field(None, description="only best_of == n is supported")
    suffix: StrictStr | None = Field(None, max_length=0, description="not supported: empty or null")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif not p:
            raise BadRequest("prompt must not be empty", param="prompt")
        elif all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # list[str] or list[list[int]]
        if len(out) > MAX_PROMPTS:
            raise BadRequest(f"at most {MAX_PROMPTS} prompts per request, got {len(out)}", param="prompt")
        if len(out) * self.num_choices > MAX_CHOICES:
            raise BadRequest(f"prompts x n must be at most {MAX_CHOICES}, got {len(out)} x {self.num_choices}",
                             param="n")
        for x in out:
            if (isinstance(x, str) and not x) or (isinstance(x, list) and not x):
                raise BadRequest("prompt must not be empty", param="prompt")
        return out

    def to_sampling_params(self) -> SamplingParams:
        self._check_unsupported()
        if self.suffix:
            raise BadRequest("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise BadRequest("best_of other than n is not supported", param="best_of")
        if self.echo and self.logprobs is not None:
            raise BadRequest("echo together with logprobs (prompt logprobs) is not supported", param="echo")
        return self._sampling_params(self.max_tokens, self.logprobs)


# ------------------------------------------------------------------ /v1/chat/completions
class ContentPart(OpenAIBaseModel):
    type: Literal["text"] = Field(..., description="only text parts are supported")
    text: StrictStr


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text"]


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

    def text(self, i: int) -> str:
        c = self.content
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        return "".join(part.text for part in c)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, description="the conversation; at least one message")
    max_tokens: Int(ge=1) | None = Field(None, description="deprecated OpenAI name of max_completion_tokens")
    max_completion_tokens: Int(ge=1) | None = Field(None, description="default: up to the context length")
    logprobs: StrictBool | None = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(None)
    tools: list[dict[str, Any]] | None = Field(None, max_length=0, description="not supported: empty or null")
    tool_choice: Literal["none"] | None = Field(None, description="not supported: null or 'none'")
    response_format: ResponseFormat | None = Field(None, description="only {'type': 'text'} is supported")

    def conversation(self) -> list[dict[str, str]]:
        if not self.messages:
            raise BadRequest("messages must contain at least one message", param="messages")
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def to_sampling_params(self) -> SamplingParams:
        self._check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    @property
    def explicit_max_tokens(self) -> bool:
        return self.max_completion_tokens is not None or self.max_tokens is not None


# ------------------------------------------------------------------ responses
def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class CompletionLogprobs(OpenAIBaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dspark"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
