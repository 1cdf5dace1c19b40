"""Each request's grammar in the core: compiled off the step loop, then one matcher per request that
advances with each accepted token and fills the step's token bitmask (engine-core process).

The scheduler holds a request here until its grammar is compiled (others are scheduled meanwhile),
asks for the bitmask of the rows that sample under a grammar, and feeds each accepted token back.
Compilation (xgrammar, in coreserve/engine_core/grammar_compiler.py's thread) and the matchers run on the CPU.
docs/structured_outputs.md.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np

from coreserve.engine_core.grammar_compiler import GrammarCompiler
from coreserve.engine_core.request import Request
from coreserve.protocol.sampling_params import SamplingParams
from coreserve.protocol.step import SchedulerOutput

WAIT_S = 0.02  # how long an idle step waits for a compile before the loop looks at its sockets again


class RequestGrammar:
    """A request's compile future, then its matcher (xgrammar.GrammarMatcher)."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future
        self.matcher = None

    @property
    def is_compiled(self) -> bool:
        return self.future.done()

    def error(self) -> str | None:
        """Why the grammar did not compile, once compiled; None when it did."""
        exc = self.future.exception()
        return None if exc is None else str(exc)

    def has_ended_after(self, token_id: int) -> bool:
        """Advances past an accepted token; True when the grammar has ended (its stop token accepted)
        or refused the token (which its mask never lets be sampled): the output is complete."""
        is_accepted = self.matcher.accept_token(token_id)
        return not is_accepted or bool(self.matcher.is_terminated())


class Grammars:
    """The core's compiler (made with the first grammar) and the bitmask of each step."""

    def __init__(self, model: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.compiler: GrammarCompiler | None = None

    def for_request(self, params: SamplingParams) -> RequestGrammar:
        if self.compiler is None:
            self.compiler = GrammarCompiler(self.model, self.vocab_size, self.eos_token_ids)
        return RequestGrammar(self.compiler.submit(params.structured_outputs))

    def start(self, grammar: RequestGrammar) -> None:
        """The matcher, once the grammar compiled."""
        grammar.matcher = self.compiler.new_matcher(grammar.future.result())

    def add_bitmask(self, output: SchedulerOutput, reqs: list[Request]) -> None:
        """The allowed next tokens of each of `reqs` (the step's, in batch order) that samples under a
        grammar this step (its last scheduled token is its last token): [G, ceil(V / 32)] int32."""
        sampling = [r for r in reqs if r.grammar is not None and r.num_computed_tokens >= r.num_tokens]
        if not sampling:
            return
        drafts = output.spec_drafts
        num_rows = len(sampling) + sum(len(drafts.get(r.req_id, ())) for r in sampling)
        bitmask = np.zeros((num_rows, -(-self.vocab_size // 32)), dtype=np.int32)
        row, req_ids = 0, []
        for req in sampling:
            matcher = req.grammar.matcher
            num_kept = _walk(matcher, drafts.get(req.req_id, []))
            if req.req_id in drafts:  # speculation: the proposals the grammar takes, or none
                if num_kept:
                    drafts[req.req_id] = drafts[req.req_id][:num_kept]
                else:
                    del drafts[req.req_id]
                    output.spec_tokens.pop(req.req_id, None)
            for j in range(num_kept + 1):  # a row for each verified position: row j follows proposal j
                matcher.fill_next_token_bitmask(bitmask, row)
                row += 1
                req_ids.append(req.req_id)
                if j < num_kept:
                    matcher.accept_token(drafts[req.req_id][j])
            if num_kept:
                matcher.rollback(num_kept)
        output.grammar_req_ids = req_ids
        output.grammar_bitmask = bitmask[:row].astype("<i4", copy=False).tobytes()

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()


def _walk(matcher, proposed: list[int]) -> int:
    """How many of the proposals, in order, the grammar takes before one it refuses or one that ends it
    (the model's own token ends a grammar, unproposed); the matcher is left where it was."""
    num_taken = 0
    for token in proposed:
        if not matcher.accept_token(token):
            break
        if matcher.is_terminated():
            matcher.rollback(1)
            break
        num_taken += 1
    if num_taken:
        matcher.rollback(num_taken)
    return num_taken


def wait_for_any(grammars: list[RequestGrammar], timeout_s: float = WAIT_S) -> None:
    """Blocks until one of them compiled, or `timeout_s` passed (an idle core's step, never a busy one)."""
    concurrent.futures.wait([g.future for g in grammars], timeout_s, concurrent.futures.FIRST_COMPLETED)
