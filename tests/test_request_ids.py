"""The ids a request takes to the core: submissions and their completions, made and parsed back."""

from __future__ import annotations

import pytest

from coreserve.frontend.request_ids import child_ids, parent_of, request_id_of, submission_id


@pytest.mark.parametrize("request_id", ["7", "chat-1", "a#b", "x@y", "a@b#c", "#", "@", ""])
def test_every_child_parses_back_to_its_submission_whatever_the_user_id_holds(request_id):
    submission = submission_id(request_id, 41)
    assert request_id_of(submission) == request_id
    children = child_ids(submission, 3)
    assert len(set(children)) == 3 and submission not in children
    assert [parent_of(c) for c in children] == [submission] * 3


@pytest.mark.parametrize("request_id", ["7", "a#b", "a#1", "x@y#2"])
def test_a_single_completion_is_its_own_submission(request_id):
    submission = submission_id(request_id, 0)
    assert child_ids(submission, 1) == [submission]
    assert parent_of(submission) == submission


def test_submissions_of_one_request_id_never_share_a_core_id():
    first, second = submission_id("r", 1), submission_id("r", 2)
    assert not set(child_ids(first, 4) + [first]) & set(child_ids(second, 4) + [second])
    assert {parent_of(c) for c in child_ids(first, 4) + child_ids(second, 4)} == {first, second}


def test_the_output_processor_names_completions_with_these_ids(tokenizer):
    from coreserve.frontend.engine.output_processor import OutputProcessor
    from coreserve.frontend.engine.token_text import TokenTable
    from coreserve.protocol.sampling_params import SamplingParams

    processor = OutputProcessor(TokenTable(tokenizer))
    # FrontendEngine.prepare makes the submission id; the processor names the completions after it
    submission = submission_id("a#b", 0)
    children = processor.add_request(submission, None, [1, 2], SamplingParams(n=3, seed=5, prompt_logprobs=1))
    assert {parent_of(core_id) for core_id, _ in children} == {parent_of(children[0][0])}
    assert request_id_of(parent_of(children[0][0])) == "a#b"
    assert [p.seed for _, p in children] == [5, 6, 7] and [p.prompt_logprobs for _, p in children] == [
        1,
        None,
        None,
    ]
