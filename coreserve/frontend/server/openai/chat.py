"""POST /v1/chat/completions: messages through the chat template, OpenAI's chat logprobs with each
token's exact bytes (frontend process, HTTP server).

Streamed chunks and the whole response come from the same per-choice pieces, so the chunks' content
and logprobs concatenate to the whole response's. Both carry the keys vLLM's carry, null where unset
(response_shapes.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.engine.structured_outputs import check_structured_outputs
from coreserve.frontend.outputs import CompletionOutput
from coreserve.frontend.server.common.accumulate import WholeChoices
from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.generation import Generation, PromptInput
from coreserve.frontend.server.common.inputs import check_logprobs, check_prompts, start_checked
from coreserve.frontend.server.common.logprob_json import (
    JSONBytesResponse,
    add_hidden_states,
    chat_content,
    vllm_prompt_logprobs,
)
from coreserve.frontend.server.common.transport import (
    CLIENT_CLOSED_REQUEST,
    ClientGone,
    sse_response,
    unless_disconnected,
    until_disconnected,
)
from coreserve.frontend.server.openai.chat_prompt import chat_prompt, echo_text
from coreserve.frontend.server.openai.harmony_fields import call_grammar, check_reasoning_effort
from coreserve.frontend.server.openai.inputs import check_body_fields, prompt_scoring_k, sampling_params
from coreserve.frontend.server.openai.message_parts import ChoiceParser
from coreserve.frontend.server.openai.response_shapes import (
    CHAT_CHOICE,
    CHAT_CHUNK_CHOICE,
    CHAT_COMPLETION,
    chat_delta,
    chat_message,
    with_defaults,
)
from coreserve.frontend.server.openai.schemas import ChatCompletionRequest
from coreserve.frontend.server.openai.structured_fields import (
    parse_grammar_off_the_loop,
    structured_outputs_of,
)
from coreserve.frontend.server.openai.tool_choice import NO_TOOLS, ToolPlan, tool_plan
from coreserve.frontend.server.parsers.reasoning import reasoning_splitter
from coreserve.frontend.server.state import ServerState


async def create_chat_completion(request: Request, body: ChatCompletionRequest) -> Response:
    try:  # a client gone while its template renders stops the render
        response = await unless_disconnected(request, start_chat(request.app.state.server, body))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if body.stream:
        await start_checked(response.generation, body)
        return sse_response(response.chunks(), response.generation.close)
    return await until_disconnected(request, response.whole())


async def start_chat(server: ServerState, body: ChatCompletionRequest, prefix: str = "chatcmpl") -> ChatResponse:
    """A checked chat request's prompt and generation, not yet started (the Responses API's too)."""
    lora = server.check_model(body.model)
    check_body_fields(body)
    plan = tool_plan(server, body)
    if plan.mode in ("required", "named") and structured_outputs_of(body) is not None:
        message = "tool_choice required or a named function cannot be combined with structured outputs"
        raise APIError(400, message, "tool_choice")
    if not body.include_reasoning and server.reasoning_parser is None:
        raise APIError(400, "include_reasoning: false needs a server started with --reasoning-parser", "include_reasoning")
    check_reasoning_effort(server, body.reasoning_effort, "reasoning_effort")
    await parse_grammar_off_the_loop(body)
    plan = await _tools_grammar_off_the_loop(plan)
    prompt = await chat_prompt(server, body)
    generation = Generation(
        server.engine,
        server.new_request_id(prefix),
        [prompt],
        _params(server, body, prompt, plan),
        server.metrics,
        server.admission,
        lora,
    )
    return ChatResponse(server, body, generation, plan)


async def _tools_grammar_off_the_loop(plan: ToolPlan) -> ToolPlan:
    """The tools' grammar built (harmony's) and checked on a worker thread; a bad schema named `tools`."""
    if plan.harmony_calls:
        plan = dataclasses.replace(plan, grammar=await asyncio.to_thread(call_grammar, list(plan.harmony_calls)))
    if plan.grammar is not None:
        try:
            await asyncio.to_thread(check_structured_outputs, plan.grammar)
        except ValueError as exc:
            raise APIError(400, f"tools: the tools' schemas make no grammar: {exc}", "tools") from exc
    return plan


def _params(server: ServerState, body: ChatCompletionRequest, prompt: PromptInput, plan: ToolPlan):
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    check_prompts([prompt], server.facts, max_tokens, param="messages")
    if max_tokens is None:  # as vLLM: whatever room the context leaves
        max_tokens = server.facts.max_model_len - len(prompt.token_ids)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    check_logprobs("top_logprobs", logprobs, server.facts)
    check_logprobs("prompt_logprobs", body.prompt_logprobs, server.facts)
    overrides: dict = {}
    if plan.grammar is not None:
        overrides["structured_outputs"] = plan.grammar
    if plan.fmt is not None and plan.fmt.keep_special_tokens:
        overrides["skip_special_tokens"] = False  # the format's markers may be special tokens (as vLLM)
    return sampling_params(body, max_tokens, logprobs, prompt_scoring_k(body), server.facts.vocab_size, overrides)


class ChatResponse:
    def __init__(
        self, server: ServerState, body: ChatCompletionRequest, generation: Generation, plan: ToolPlan = NO_TOOLS
    ) -> None:
        self.server, self.body, self.generation, self.plan = server, body, generation, plan
        self.created = int(time.time())
        self.num_tokens = [0] * body.n
        self.is_finished = [False] * body.n
        self.prompt_logprobs = None
        self.echo = echo_text(body)
        self.parsers = [self._parser() for _ in range(body.n)]  # streaming's, one per choice

    def _parser(self) -> ChoiceParser:
        name = self.server.reasoning_parser
        is_held = self.plan.grammar is not None  # required's and named's grammar: the calls from its start
        think = reasoning_splitter(name, self.body.chat_template_kwargs, is_held) if name else None
        return ChoiceParser(self.plan, think, self.body.include_reasoning)

    async def whole(self) -> Response:
        return JSONBytesResponse(await self.whole_body())

    async def whole_body(self) -> dict:
        merged = WholeChoices()
        try:
            await start_checked(self.generation, self.body)
            async for piece in self._pieces():
                merged.add(piece)
        finally:
            await self.generation.close()
        choices = [self._message(i, merged.get(i) or {}) for i in range(self.body.n)]
        body = self._envelope("chat.completion", choices)
        body["usage"] = self._usage()
        k = prompt_scoring_k(self.body)
        if k is not None:
            positions = self.prompt_logprobs or []
            body["prompt_logprobs"] = vllm_prompt_logprobs(positions, k, self.body.prompt_logprob_token_ids)
        if self.body.return_token_ids:
            body["prompt_token_ids"] = list(self.generation.prompts[0].token_ids)
        return with_defaults(body, CHAT_COMPLETION)  # vLLM's fields, null when not asked for

    def _message(self, index: int, merged: dict) -> dict:
        """A whole answer's choice from its merged pieces: the content after the echo, as a message
        (its reasoning and tool calls parsed out where the request and the server ask)."""
        parser = self._parser()
        text = merged.get("text", "")
        message = chat_message(parser.message(parser.feed(text, final=True), self.echo))
        choice = {
            "index": index,
            "message": message,
            "logprobs": merged.get("logprobs"),
            "finish_reason": parser.finish_reason(merged.get("finish_reason")),
        }
        if parser.is_parsing:
            choice["raw_text"] = text
        if self.body.return_token_ids:
            choice["token_ids"] = merged.get("token_ids", [])
        if merged.get("finish_reason") is not None:
            choice["stop_reason"] = merged["stop_reason"]
        for key in ("routed_experts", "sampling_mask", "hidden_states"):
            if key in merged:
                choice[key] = merged[key]
        return with_defaults(choice, CHAT_CHOICE)

    async def chunks(self):
        for i in range(self.body.n):
            yield self._first_chunk(i)
        async for piece in self._pieces():
            parser = self.parsers[piece["index"]]
            is_final = piece["finish_reason"] is not None
            delta = parser.feed(piece["text"], is_final) if parser.is_parsing else {"content": piece["text"]}
            choice = {
                "index": piece["index"],
                "delta": chat_delta(delta),
                "logprobs": piece["logprobs"],
                "finish_reason": parser.finish_reason(piece["finish_reason"]),
                "stop_reason": piece["stop_reason"],
            }
            if parser.is_parsing:
                choice["raw_text"] = piece["text"]
            if self.body.return_token_ids:
                choice["token_ids"] = piece["token_ids"]
            for key in ("routed_experts", "sampling_mask", "hidden_states"):
                if key in piece:
                    choice[key] = piece[key]
            yield self._chunk([with_defaults(choice, CHAT_CHUNK_CHOICE)])
        if self.body.include_usage:
            yield {**self._envelope("chat.completion.chunk", []), "usage": self._usage()}

    def _first_chunk(self, index: int) -> dict:
        """A choice's first chunk: the role and the echo; the prompt's ids (null unless asked), as vLLM's."""
        asked_ids = self.body.return_token_ids
        first = {
            "index": index,
            "delta": chat_delta({"role": "assistant", "content": self.echo}),
            "logprobs": None,
            "finish_reason": None,
            "token_ids": [] if asked_ids else None,
        }
        chunk = self._chunk([first])
        chunk["prompt_token_ids"] = list(self.generation.prompts[0].token_ids) if asked_ids else None
        return chunk

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = self._envelope("chat.completion.chunk", choices)
        if self.body.continuous_usage:
            chunk["usage"] = self._usage()
        return chunk

    async def _pieces(self):
        k = self.body.top_logprobs or 0
        async for _, out in self.generation.deltas():
            if self.prompt_logprobs is None and out.prompt_logprobs is not None:
                self.prompt_logprobs = out.prompt_logprobs
            for completion in out.outputs:
                if self.is_finished[completion.index]:
                    continue  # a finished choice is sent once (n > 1 streams, issue 20)
                if completion.token_ids or completion.text or completion.finish_reason is not None:
                    self.num_tokens[completion.index] += len(completion.token_ids)
                    self.is_finished[completion.index] = completion.finish_reason is not None
                    piece = _piece(completion, k, self.body.return_tokens_as_token_ids)
                    num_prompt = len(self.generation.prompts[0].token_ids)
                    add_hidden_states(piece, completion, self.body.hidden_states_positions, num_prompt)
                    yield piece

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {
            "id": self.generation.request_id,
            "object": kind,
            "created": self.created,
            "model": self.server.answer_name(self.generation.params.lora),
            "choices": choices,
        }

    def _usage(self) -> dict:
        return self.generation.usage(sum(self.num_tokens), self.server.enable_prompt_tokens_details)


def _piece(completion: CompletionOutput, k: int, as_token_ids: bool) -> dict:
    logprobs = None
    if completion.logprobs is not None:
        content = chat_content(
            completion.token_ids, completion.logprobs, k, as_token_ids, completion.constraint_masses
        )
        logprobs = {"content": content}
    piece = {
        "index": completion.index,
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }
    if completion.routed_experts is not None:  # in the finished completion: every position's
        piece["routed_experts"] = completion.routed_experts.tolist()
    if completion.sampling_mask is not None:  # each new token's support
        mask = completion.sampling_mask
        piece["sampling_mask"] = [mask[i].tolist() for i in range(len(mask))]
    return piece

