"""Hidden states in a JSON answer (frontend process, HTTP server): a choice's `hidden_states`, its
completion's [indices asked, positions, hidden] float32 array as base64 of the little-endian bytes in C
order, with its shape and first position (docs/serving.md, "Hidden states").

Like routed experts, they travel whole in the choice's finishing piece (a stream's last chunk of that
choice): base64 pieces of arbitrary byte counts would not concatenate into the whole answer's.
"""

from __future__ import annotations

import base64

import numpy as np

from coreserve.frontend.outputs import CompletionOutput


def add_hidden_states(piece: dict, completion: CompletionOutput, which: str, num_prompt_tokens: int) -> None:
    """The finished completion's hidden states into its JSON piece; `which`: hidden_states_positions."""
    if completion.hidden_states is not None:
        piece["hidden_states"] = hidden_states_json(completion.hidden_states, which, num_prompt_tokens)


def hidden_states_json(states: np.ndarray, which: str, num_prompt_tokens: int) -> dict:
    """{shape, first_position, dtype, data}: row r of each index is position first_position + r (the
    prompt's first, or with "output" the last prompt token's, whose logits gave the first output token)."""
    data = np.ascontiguousarray(states, dtype="<f4").tobytes()
    return {
        "shape": list(states.shape),
        "first_position": num_prompt_tokens - 1 if which == "output" else 0,
        "dtype": "<f4",
        "data": base64.b64encode(data).decode("ascii"),
    }
