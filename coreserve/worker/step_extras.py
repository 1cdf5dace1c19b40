"""The step's extras, the outputs a request asks for beside its tokens and logprob rows (engine-core
process): each token's routed experts (return_routed_experts), each sampled row's support
(return_sampling_mask), each grammar row's allowed mass (structured outputs with logprobs); the hidden
states (return_hidden_states) are kept by the forward itself (coreserve/worker/step/hidden_keep.py).

All are off by default. The runner keeps the ids of the live requests that ask for any (`asks_extras`,
as requests come and go), and builds a step's extras in one call, `step_extras`, only while that set
is not empty: a step of requests that ask for none makes no call for them.
"""

from __future__ import annotations

from collections.abc import Sequence

from coreserve.worker.sampling.sampler import SamplerOutput
from coreserve.worker.sampling.supports import sampling_masks
from coreserve.worker.step.input_batch import RequestState
from coreserve.worker.step.step_tensors import StepExtras


def asks_extras(state: RequestState) -> bool:
    params = state.params
    has_masses = params.structured_outputs is not None and state.logprobs_k is not None
    has_hidden = params.hidden_indices is not None
    return params.return_routed_experts or params.return_sampling_mask or has_masses or has_hidden


def step_extras(
    model,
    states: list[RequestState],
    num_tokens: list[int],
    sampling_states: list[RequestState],
    out: SamplerOutput | None,
    grammar_req_ids: list[str],
    by_id: dict[str, RequestState],
) -> StepExtras:
    """The forward pass just run (`states` in batch order, `num_tokens` rows each, their
    num_computed_tokens still the first position) and its sampled rows (`sampling_states`, `out`)."""
    return StepExtras(
        routed_experts=routed_rows(model, states, num_tokens),
        sampling_masks=sampling_masks(sampling_states, out),
        constraint_masses=constraint_masses(grammar_req_ids, out, by_id),
    )


def routed_rows(model, states: Sequence[RequestState], num_tokens: Sequence[int]) -> dict[str, list]:
    """Each asking request's rows of the forward pass just run (the model keeps its last forward's
    choices, `DecoderModel.routed_experts`): req_id -> [(first position, [rows, MoE layers, top_k] int16
    numpy)]; `states` in batch order, `num_tokens` rows each. {} when none asked (nothing is copied)."""
    if not any(s.params.return_routed_experts for s in states):
        return {}
    table = model.routed_experts()
    assert table is not None, "return_routed_experts on a dense model (the request rules refuse it)"
    table, parts, row = table.cpu().numpy(), {}, 0
    for state, num in zip(states, num_tokens):
        if state.params.return_routed_experts:
            parts[state.req_id] = [(state.num_computed_tokens, table[row : row + num].copy())]
        row += num
    return parts


def constraint_masses(
    grammar_req_ids: list[str], out: SamplerOutput | None, by_id: dict[str, RequestState]
) -> dict[str, list[float]]:
    """The grammar rows' allowed mass, per row of each request that asked for logprobs (a verified one
    has a row a position); a second small copy, only on steps with such a row."""
    wanted = [row for row, r in enumerate(grammar_req_ids) if by_id[r].logprobs_k is not None]
    if not wanted or out is None or out.constraint_masses is None:
        return {}
    values = out.constraint_masses.cpu().tolist()
    masses: dict[str, list[float]] = {}
    for row in wanted:
        masses.setdefault(grammar_req_ids[row], []).append(values[row])
    return masses
