"""POST /v1/chat/completions: messages through the chat template, OpenAI's chat logprobs with each
token's exact bytes (frontend process, HTTP server).

Streamed chunks and the whole response come from the same per-choice pieces, so the chunks' content
and logprobs concatenate to the whole response's.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from frontend.chat_template import render_chat
from frontend.outputs import CompletionOutput
from frontend.server.errors import APIError
from frontend.server.generation import Generation, PromptInput
from frontend.server.inputs import check_logprobs, check_prompts, sampling_params, start_checked
from frontend.server.json_response import JSONBytesResponse
from frontend.server.logprob_json import chat_content, vllm_prompt_logprobs
from frontend.server.schemas import ChatCompletionRequest
from frontend.server.state import ServerState
from frontend.server.transport import sse_response, until_disconnected


async def create_chat_completion(request: Request, body: ChatCompletionRequest) -> Response:
    server: ServerState = request.app.state.server
    server.check_model(body.model)
    prompt = chat_prompt(server, body)
    generation = Generation(
        server.engine,
        server.new_request_id("chatcmpl"),
        [prompt],
        _params(server, body, prompt),
        server.metrics,
    )
    response = ChatResponse(server, body, generation)
    if body.stream:
        await start_checked(generation, body)
        return sse_response(response.chunks(), generation.close)
    return await until_disconnected(request, response.whole())


def chat_prompt(server: ServerState, body: ChatCompletionRequest) -> PromptInput:
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        text = render_chat(server.tokenizer, messages, server.chat_template, body.add_generation_prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), "messages") from exc
    return PromptInput(text, list(server.tokenizer(text, add_special_tokens=False).input_ids))


def _params(server: ServerState, body: ChatCompletionRequest, prompt: PromptInput):
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    check_prompts([prompt], server.facts, max_tokens, param="messages")
    if max_tokens is None:  # as vLLM: whatever room the context leaves
        max_tokens = server.facts.max_model_len - len(prompt.token_ids)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    check_logprobs("top_logprobs", logprobs, server.facts)
    check_logprobs("prompt_logprobs", body.prompt_logprobs, server.facts)
    return sampling_params(body, max_tokens, logprobs, body.prompt_logprobs)


class ChatResponse:
    def __init__(self, server: ServerState, body: ChatCompletionRequest, generation: Generation) -> None:
        self.server, self.body, self.generation = server, body, generation
        self.created = int(time.time())
        self.num_tokens = [0] * body.n
        self.prompt_logprobs = None

    async def whole(self) -> Response:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(self.body.n)
        ]
        try:
            await start_checked(self.generation, self.body)
            async for piece in self._pieces():
                _merge(choices[piece["index"]], piece)
        finally:
            await self.generation.close()
        body = self._envelope("chat.completion", choices)
        body["usage"] = self._usage()
        if self.body.prompt_logprobs is not None:
            positions = self.prompt_logprobs or []
            body["prompt_logprobs"] = vllm_prompt_logprobs(positions, self.body.prompt_logprobs)
        return JSONBytesResponse(body)

    async def chunks(self):
        for i in range(self.body.n):
            first = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield self._envelope("chat.completion.chunk", [first])
        async for piece in self._pieces():
            choice = {
                "index": piece["index"],
                "delta": {"content": piece["text"]},
                "logprobs": piece["logprobs"],
                "finish_reason": piece["finish_reason"],
                "stop_reason": piece["stop_reason"],
            }
            yield self._envelope("chat.completion.chunk", [choice])
        if self.body.include_usage:
            yield {**self._envelope("chat.completion.chunk", []), "usage": self._usage()}

    async def _pieces(self):
        k = self.body.top_logprobs or 0
        async for _, out in self.generation.deltas():
            if self.prompt_logprobs is None and out.prompt_logprobs is not None:
                self.prompt_logprobs = out.prompt_logprobs
            for completion in out.outputs:
                if completion.token_ids or completion.text or completion.finish_reason is not None:
                    self.num_tokens[completion.index] += len(completion.token_ids)
                    yield _piece(completion, k)

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {
            "id": self.generation.request_id,
            "object": kind,
            "created": self.created,
            "model": self.server.served_model_name,
            "choices": choices,
        }

    def _usage(self) -> dict:
        num_prompt = len(self.generation.prompts[0].token_ids)
        num_completion = sum(self.num_tokens)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
        }


def _piece(completion: CompletionOutput, k: int) -> dict:
    logprobs = None
    if completion.logprobs is not None:
        logprobs = {"content": chat_content(completion.token_ids, completion.logprobs, k)}
    return {
        "index": completion.index,
        "text": completion.text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


def _merge(choice: dict, piece: dict) -> None:
    choice["message"]["content"] += piece["text"]
    if piece["logprobs"] is not None:
        if choice["logprobs"] is None:
            choice["logprobs"] = {"content": []}
        choice["logprobs"]["content"].extend(piece["logprobs"]["content"])
    if piece["finish_reason"] is not None:
        choice["finish_reason"], choice["stop_reason"] = piece["finish_reason"], piece["stop_reason"]
