"""A completion's new tokens into its text (frontend process): detokenized, stop strings found, and the
token that ended it kept as an id without its text.

With stop strings the tokens go in one at a time, so that tokens after the one completing a stop string
(several arrive at once under multi-step and speculation) are dropped with their logprobs; what the
final flush releases is checked too. The EOS or stop token id that ended a completion stays in its
`token_ids` (with its logprob), and its text is left out unless include_stop_str_in_output, as vLLM's:
with skip_special_tokens false an EOS would otherwise end every text.
"""

from __future__ import annotations

from coreserve.protocol.messages import EngineCoreOutput, FinishReason


def append_tokens(completion, output: EngineCoreOutput) -> tuple[int, bool]:
    """Appends a core output's new tokens to `completion` (output_processor's CompletionState).
    Returns (tokens kept, whether a stop string ended the completion)."""
    token_ids = output.new_token_ids
    is_core_done = output.finish_reason is not None
    ends_on_stop_token = _ends_on_stop_token(output, completion.params)
    text_ids = token_ids[:-1] if ends_on_stop_token else token_ids
    num_kept, is_stopped = _append_text(completion, text_ids, is_core_done)
    if is_stopped:
        return num_kept, True
    if ends_on_stop_token:
        completion.detokenizer.token_ids.append(token_ids[-1])  # the id, without its text
    return len(token_ids), False


def _append_text(completion, token_ids: list[int], is_core_done: bool) -> tuple[int, bool]:
    detokenizer = completion.detokenizer
    if not completion.params.stop:
        detokenizer.append(token_ids)
        if is_core_done:
            detokenizer.flush()
        return len(token_ids), False
    for num, token_id in enumerate(token_ids, start=1):
        num_chars_before = len(detokenizer.text)
        detokenizer.append([token_id])
        if check_stop_strings(completion, num_chars_before):
            return num, True
    if is_core_done:
        num_chars_before = len(detokenizer.text)
        detokenizer.flush()
        if check_stop_strings(completion, num_chars_before):
            return len(token_ids), True
    return len(token_ids), False


def check_stop_strings(completion, num_chars_before: int) -> bool:
    """Whether the text from `num_chars_before` on completes a stop string (past min_tokens); if so, the
    completion is cut there (or after it, with include_stop_str_in_output) and finished."""
    params = completion.params
    if not params.stop or completion.finish_reason == "error":
        return False
    if len(completion.token_ids) <= params.min_tokens:
        return False
    text = completion.detokenizer.text
    start = max(0, num_chars_before - max(len(s) for s in params.stop) + 1)
    hits = [(text.find(s, start), s) for s in params.stop]
    hits = [(pos, s) for pos, s in hits if pos != -1]
    if not hits:
        return False
    pos, stop = min(hits)
    completion.text_end = pos + len(stop) if params.include_stop_str_in_output else pos
    completion.finish_reason, completion.stop_reason = str(FinishReason.STOP), stop
    return True


def _ends_on_stop_token(output: EngineCoreOutput, params) -> bool:
    """Whether the core finished the completion on an EOS or stop token id (its last new token)."""
    return (
        output.finish_reason == FinishReason.STOP
        and not isinstance(output.stop_reason, str)
        and not params.include_stop_str_in_output
        and bool(output.new_token_ids)
    )
