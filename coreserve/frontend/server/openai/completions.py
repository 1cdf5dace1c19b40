"""POST /v1/completions: OpenAI's legacy completions with vLLM's extensions (frontend process, HTTP).

`echo` puts the prompt (its tokens and prompt logprobs) before the completion; `max_tokens: 0` with
echo scores the prompt without generating: the engine needs max_tokens >= 1, so it runs with 1 and the
token is dropped (completion_tokens 0). Streamed chunks are built by the same code as the whole
response, so they concatenate to it exactly. Both carry the keys vLLM's carry, null where unset
(response_shapes.py).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from coreserve.frontend.outputs import CompletionOutput, PositionLogprobs
from coreserve.frontend.server.common.accumulate import WholeChoices
from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.generation import Generation, PromptInput
from coreserve.frontend.server.common.inputs import check_logprobs, check_prompts, start_checked
from coreserve.frontend.server.common.logprob_json import (
    JSONBytesResponse,
    LegacyLogprobs,
    add_hidden_states,
    vllm_prompt_logprobs,
)
from coreserve.frontend.server.common.transport import sse_response, until_disconnected
from coreserve.frontend.server.openai.inputs import (
    check_body_fields,
    completion_prompts,
    prompt_scoring_k,
    sampling_params,
)
from coreserve.frontend.server.openai.response_shapes import (
    COMPLETION,
    COMPLETION_CHOICE,
    COMPLETION_CHUNK,
    COMPLETION_CHUNK_CHOICE,
    with_defaults,
)
from coreserve.frontend.server.openai.schemas import CompletionRequest
from coreserve.frontend.server.openai.structured_fields import parse_grammar_off_the_loop
from coreserve.frontend.server.state import ServerState


async def create_completion(request: Request, body: CompletionRequest) -> Response:
    server: ServerState = request.app.state.server
    lora = server.check_model(body.model)
    check_body_fields(body)
    await parse_grammar_off_the_loop(body)
    prompts = await completion_prompts(server, body)
    generation = Generation(
        server.engine, server.new_request_id("cmpl"), prompts, _params(server, body, prompts), server.metrics, server.admission,
        lora,
    )
    response = CompletionResponse(server, body, generation)
    if body.stream:
        await start_checked(generation, body)
        return sse_response(response.chunks(), generation.close)
    return await until_disconnected(request, response.whole())


def _params(server: ServerState, body: CompletionRequest, prompts: list[PromptInput]):
    if body.suffix:
        raise APIError(400, "suffix (insertion) is not supported by this server", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported by this server", "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens=0 is only allowed with echo=true (scoring the prompt)", "max_tokens")
    check_prompts(prompts, server.facts, max(body.max_tokens, 1) if body.max_tokens is not None else None)
    check_logprobs("logprobs", body.logprobs, server.facts)
    check_logprobs("prompt_logprobs", body.prompt_logprobs, server.facts)
    echo_k = body.logprobs if body.echo else None
    asked = [k for k in (echo_k, body.prompt_logprobs) if k is not None]
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    prompt_logprobs = max(asked) if asked else None
    return sampling_params(body, max_tokens, body.logprobs, prompt_logprobs, server.facts.vocab_size)


class CompletionResponse:
    def __init__(self, server: ServerState, body: CompletionRequest, generation: Generation) -> None:
        self.server, self.body, self.generation = server, body, generation
        self.created = int(time.time())
        n = body.n
        self.choices = [
            CompletionChoice(i * n + j, prompt, body, server)
            for i, prompt in enumerate(generation.prompts)
            for j in range(n)
        ]
        self.prompt_positions: list[list[PositionLogprobs | None] | None] = [None] * len(generation.prompts)

    async def whole(self) -> Response:
        try:
            await start_checked(self.generation, self.body)
            merged = WholeChoices()
            async for piece in self._pieces():
                merged.add(piece)
        finally:
            await self.generation.close()
        choices = [merged.get(c.index) or _empty_choice(c.index) for c in self.choices]
        body = self._envelope([with_defaults(choice, COMPLETION_CHOICE) for choice in choices])
        body["usage"] = self._usage()
        return JSONBytesResponse(with_defaults(body, COMPLETION))  # vLLM's fields, null when not asked for

    async def chunks(self):
        async for piece in self._pieces():
            chunk = self._envelope([with_defaults(piece, COMPLETION_CHUNK_CHOICE)])
            if self.body.continuous_usage:
                chunk["usage"] = self._usage()
            yield with_defaults(chunk, COMPLETION_CHUNK)
        if self.body.include_usage:
            yield {**self._envelope([]), "usage": self._usage()}

    async def _pieces(self):
        n = self.body.n
        async for prompt_index, out in self.generation.deltas():
            if out.prompt_logprobs is not None and self.prompt_positions[prompt_index] is None:
                self.prompt_positions[prompt_index] = out.prompt_logprobs
            for completion in out.outputs:
                choice = self.choices[prompt_index * n + completion.index]
                piece = choice.piece(completion, self.prompt_positions[prompt_index])
                if piece is not None:
                    yield piece

    def _envelope(self, choices: list[dict]) -> dict:
        return {
            "id": self.generation.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.server.answer_name(self.generation.params.lora),
            "choices": choices,
        }

    def _usage(self) -> dict:
        num_tokens = sum(c.num_tokens for c in self.choices)
        return self.generation.usage(num_tokens, self.server.enable_prompt_tokens_details)


class CompletionChoice:
    """One choice's text and logprobs as its deltas arrive; `piece()` is what a delta adds to it."""

    def __init__(self, index: int, prompt: PromptInput, body: CompletionRequest, server: ServerState) -> None:
        self.index, self.prompt, self.body = index, prompt, body
        self.is_scoring = body.max_tokens == 0
        self.prompt_k = prompt_scoring_k(body)  # the k of the prompt logprobs the choice shows; None: none
        self.logprobs = (
            LegacyLogprobs(server.table, body.skip_special_tokens, body.return_tokens_as_token_ids)
            if body.logprobs is not None
            else None
        )
        self.tokenizer = server.tokenizer
        self.is_started = False
        self.is_finished = False  # a finished choice takes no more pieces (n > 1 streams, issue 20)
        self.num_tokens = 0
        self._held: list[CompletionOutput] = []  # deltas that came before the prompt's logprobs

    def piece(self, completion: CompletionOutput, prompt_positions) -> dict | None:
        needs_prompt = (self.body.echo and self.logprobs is not None) or self.prompt_k is not None
        if self.is_finished:
            return None
        if not self.is_started and needs_prompt and prompt_positions is None:
            self._held.append(completion)
            return None
        piece = self.start_piece(prompt_positions) if not self.is_started else self._empty()
        for held in [*self._held, completion]:
            self._add(piece, held)
        self._held = []
        if self.logprobs is not None:
            piece["logprobs"] = self.logprobs.take()
        self.is_finished = piece["finish_reason"] is not None
        if piece["text"] or piece["finish_reason"] or (piece["logprobs"] and piece["logprobs"]["tokens"]):
            return piece
        return piece if "prompt_logprobs" in piece or "prompt_token_ids" in piece else None

    def start_piece(self, prompt_positions=None) -> dict:
        """The choice's first piece: the prompt's parts that were asked for (echo, prompt logprobs, ids)."""
        self.is_started = True
        piece = self._empty()
        if self.body.return_token_ids:
            piece["prompt_token_ids"] = list(self.prompt.token_ids)
        if self.prompt_k is not None:
            candidates = self.body.prompt_logprob_token_ids
            piece["prompt_logprobs"] = vllm_prompt_logprobs(prompt_positions or [], self.prompt_k, candidates)
        if not self.body.echo:
            return piece
        prompt = self.prompt
        piece["text"] = prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)
        if self.logprobs is not None:
            self.logprobs.add(prompt.token_ids, prompt_positions, self.body.logprobs, is_prompt=True)
        return piece

    def _empty(self) -> dict:
        piece = _empty_choice(self.index)
        if self.body.return_token_ids:
            piece["token_ids"] = []
        return piece

    def _add(self, piece: dict, completion: CompletionOutput) -> None:
        if completion.finish_reason is not None:
            piece["finish_reason"] = "length" if self.is_scoring else completion.finish_reason
            piece["stop_reason"] = None if self.is_scoring else completion.stop_reason
        add_hidden_states(piece, completion, self.body.hidden_states_positions, len(self.prompt.token_ids))
        if self.is_scoring:
            return
        piece["text"] += completion.text
        if completion.routed_experts is not None:  # in the finished completion: every position's
            piece["routed_experts"] = completion.routed_experts.tolist()
        if completion.sampling_mask is not None:  # each new token's support
            mask = completion.sampling_mask
            piece.setdefault("sampling_mask", []).extend(mask[i].tolist() for i in range(len(mask)))
        self.num_tokens += len(completion.token_ids)
        if "token_ids" in piece:
            piece["token_ids"].extend(completion.token_ids)
        if self.logprobs is not None and completion.logprobs is not None:
            self.logprobs.add(
                completion.token_ids,
                completion.logprobs,
                self.body.logprobs,
                masses=completion.constraint_masses,
            )


def _empty_choice(index: int) -> dict:
    return {"index": index, "text": "", "logprobs": None, "finish_reason": None, "stop_reason": None}

