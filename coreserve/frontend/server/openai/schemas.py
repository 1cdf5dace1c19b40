"""Request bodies of the OpenAI-compatible endpoints, as pydantic models (frontend process, HTTP server).

The field types are common/fields.py's (strict, int64, finite). An unknown field is a 400 naming it, as
OpenAI's own server answers; the fields OpenAI or vLLM define that coreserve does not implement are
declared by `unsupported.UnsupportedFields`, refused by name unless they hold their no-op value
(docs/serving.md). Ranges that depend on the engine
(max_logprobs, max_model_len, the vocabulary) are checked by the handlers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from coreserve.frontend.server.common.fields import (
    Int64,
    NonNegativeInt64,
    SharedSamplingFields,
    StreamOptions,
    StrictBody,
    Text,
)
from coreserve.frontend.server.openai.structured_fields import StructuredFields
from coreserve.frontend.server.openai.tool_choice import ChatTool, ToolChoice
from coreserve.frontend.server.openai.unsupported import ChatUnsupportedFields, CompletionUnsupportedFields

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs

Prompt = Text | list[Text] | list[Int64] | list[list[Int64]]


class SamplingFields(SharedSamplingFields):
    """The sampling fields completions and chat share (OpenAI's and vLLM's names)."""

    model: str | None = None
    seed: Int64 | None = None
    min_tokens: NonNegativeInt64 = 0
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[Int64] | None = None
    truncate_prompt_tokens: Int64 | None = None  # keep the last N prompt tokens; -1: the most that fit
    prompt_logprobs: NonNegativeInt64 | None = None  # vLLM's extension
    # vLLM's scoring names: candidate ids scored at every prompt position (a flat list), or one row per
    # position 1..P-1 of a single prompt (a chat's: of its templated prompt); and the temperature of the
    # scored prompt distribution (docs/rl.md).
    prompt_logprob_token_ids: list[Int64] | list[list[Int64]] | None = None
    prompt_logprobs_temperature: float | None = None
    return_tokens_as_token_ids: bool = False  # logprob token strings as "token_id:N"
    return_token_ids: bool = False  # prompt_token_ids and each choice's token_ids
    disable_spec_decode: bool = False  # speculative decoding off for this request (docs/speculative.md)
    # A mixture of experts' routed experts, per computed position, layer and top_k (docs/models.md)
    return_routed_experts: bool = False
    # Hidden states (SGLang's name): true, the final norm's output; a list, those indices of HF's
    # output_hidden_states; each choice's `hidden_states`, base64 (docs/serving.md, "Hidden states")
    return_hidden_states: bool | list[Int64] = False
    hidden_states_positions: Literal["all", "prompt", "output"] = "all"
    trace_decode_token_ids: list[Int64] | None = None  # trace replay: these tokens, their true logprobs
    return_sampling_mask: bool = False  # each choice's `sampling_mask`: a token's support, a list of ids
    cache_salt: str | None = None  # vLLM's: read only prefix-cache blocks computed under the same salt
    # Ignorable by definition: identifiers and hints that change nothing coreserve computes.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint; the prefix cache needs none
    metadata: dict[str, str] | None = None  # tags for stored completions; nothing is stored

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields, StructuredFields, CompletionUnsupportedFields):
    prompt: Prompt
    max_tokens: NonNegativeInt64 | None = 16  # 0 with echo: score the prompt, generate nothing
    logprobs: NonNegativeInt64 | None = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: Text | None = None  # refused: no insertion
    best_of: Int64 | None = None  # refused unless it equals n


class TextPart(StrictBody):
    type: Literal["text"]
    text: Text


class CalledFunction(StrictBody):
    model_config = ConfigDict(extra="ignore", strict=True)  # the openai client's parsed_arguments, ...
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class MessageToolCall(StrictBody):
    model_config = ConfigDict(extra="ignore", strict=True)  # a streamed call's index, ...
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictBody):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # name, ... pass on
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to that call
    reasoning_content: Text | None = None  # an assistant's reasoning, for templates that render it


class ChatCompletionRequest(SamplingFields, StructuredFields, ChatUnsupportedFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: NonNegativeInt64 | None = None
    max_completion_tokens: NonNegativeInt64 | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # extend the last (assistant) message instead of a new one
    echo: bool = False  # the content begins with the last message's, when its role is the reply's
    add_special_tokens: bool = False  # the template writes the special tokens itself
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: auto with tools, none without (tool_choice.py)
    parallel_tool_calls: bool | None = None  # false: the first call only
    include_reasoning: bool = True  # false: reasoning_content left out (needs --reasoning-parser)
    reasoning_effort: str | None = None  # harmony's low, medium, high (openai/harmony_fields.py)
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables (enable_thinking)


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None  # rendered by the template, as chat renders them
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[Int64]
