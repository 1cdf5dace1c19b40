"""Request bodies of the OpenAI-compatible endpoints, as pydantic models (frontend process, HTTP server).

Strict types (a string is not a number, 5.0 is not an int), every integer within the wire's int64, every
float finite; unknown fields are accepted and ignored, as OpenAI's own server does. Ranges that depend on
the engine (max_logprobs, max_model_len) are checked by the handlers.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs


def _valid_unicode(text: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"); they are no text and no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("is not valid Unicode text (a lone surrogate)") from exc
    return text


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
Text = Annotated[str, AfterValidator(_valid_unicode)]
Prompt = Text | list[Text] | list[Int64] | list[list[Int64]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """The sampling fields completions and chat share (OpenAI's and vLLM's names)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=INT64_MAX)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int64] | None = None
    min_tokens: NonNegativeInt64 = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # refused when non-empty: it would be silently ignored

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: NonNegativeInt64 | None = 16  # 0 with echo: score the prompt, generate nothing
    logprobs: NonNegativeInt64 | None = None
    echo: bool = False
    prompt_logprobs: NonNegativeInt64 | None = None  # vLLM's extension: choices[i].prompt_logprobs
    suffix: Text | None = None  # refused: no insertion
    best_of: Int64 | None = None  # refused unless it equals n


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # name, tool fields pass on
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: NonNegativeInt64 | None = None
    max_completion_tokens: NonNegativeInt64 | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    prompt_logprobs: NonNegativeInt64 | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int64]
