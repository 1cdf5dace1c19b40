"""CompletionChoice (coreserve/frontend/server/openai/completions.py) without a server: echo waits for the prompt's
logprobs (n > 1: another completion may bring them), max_tokens 0 drops the scoring token."""

from __future__ import annotations

from types import SimpleNamespace

from coreserve.frontend.engine.token_text import TokenTable
from coreserve.frontend.outputs import CompletionOutput, Logprob
from coreserve.frontend.server.common.generation import PromptInput
from coreserve.frontend.server.openai.completions import CompletionChoice
from coreserve.frontend.server.openai.schemas import CompletionRequest


def make_choice(tokenizer, **fields) -> tuple[CompletionChoice, list[int]]:
    ids = tokenizer("Hello world").input_ids
    server = SimpleNamespace(table=TokenTable(tokenizer), tokenizer=tokenizer)
    body = CompletionRequest(prompt="Hello world", **fields)
    return CompletionChoice(0, PromptInput("Hello world", ids), body, server), ids


def position(table: TokenTable, token_id: int, value: float) -> dict:
    return {token_id: Logprob(value, 1, table.decode_token(token_id))}


def test_echo_holds_tokens_until_the_prompt_logprobs_arrive(tokenizer):
    choice, ids = make_choice(tokenizer, echo=True, logprobs=0, max_tokens=2)
    table = choice.logprobs.table
    first = CompletionOutput(0, " a", [257], None, [position(table, 257, -1.0)])
    assert choice.piece(first, None) is None
    second = CompletionOutput(0, " b", [275], None, [position(table, 275, -2.0)], "length")
    prompt_positions = [None, position(table, ids[1], -3.0)]
    piece = choice.piece(second, prompt_positions)
    assert piece["text"] == "Hello world a b" and piece["finish_reason"] == "length"
    assert piece["logprobs"]["token_logprobs"] == [None, -3.0, -1.0, -2.0]
    assert choice.num_tokens == 2


def test_max_tokens_zero_scores_the_prompt_and_drops_the_generated_token(tokenizer):
    choice, ids = make_choice(tokenizer, echo=True, logprobs=1, max_tokens=0)
    table = choice.logprobs.table
    out = CompletionOutput(0, " a", [257], None, [position(table, 257, -1.0)], "length")
    piece = choice.piece(out, [None, position(table, ids[1], -3.0)])
    assert piece["text"] == "Hello world" and piece["logprobs"]["token_logprobs"] == [None, -3.0]
    assert piece["finish_reason"] == "length" and choice.num_tokens == 0
