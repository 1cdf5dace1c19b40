"""What a completion gets beside its tokens, from the core's `TokenExtras` (frontend process): grammar
masses and sampling supports of the kept tokens, routed experts and hidden states by computed position; a
pooling request's vector."""

from __future__ import annotations

import numpy as np

from coreserve.protocol.messages import TokenExtras


def apply_extras(completion, extras: TokenExtras, num_kept: int) -> None:
    """`completion`: output_processor's CompletionState; `num_kept`: the new tokens a stop string left."""
    if extras.constraint_masses is not None and completion.constraint_masses is not None:
        completion.constraint_masses.extend(extras.constraint_masses[:num_kept])
    if extras.sampling_mask is not None and completion.mask_rows is not None:
        completion.mask_rows.extend(row.copy() for row in extras.sampling_mask.rows()[:num_kept])
    if extras.routed_experts is not None and completion.routed_parts is not None:
        completion.routed_parts.append(extras.routed_experts.to_numpy().copy())
    if extras.hidden_states is not None and completion.hidden_parts is not None:
        completion.hidden_parts.append(extras.hidden_states.to_numpy().copy())
    if extras.pooled is not None and completion.params.pooling is not None:
        completion.pooled = extras.pooled.to_numpy().copy()


def routed_experts(parts: list[np.ndarray] | None, num_positions: int) -> np.ndarray | None:
    """[positions, MoE layers, top_k] int16: every position the model computed for the tokens kept (the
    prompt's, then each kept token but the last); None when not asked or nothing arrived."""
    if not parts:
        return None
    return np.concatenate(parts)[:num_positions]


def hidden_states(parts: list[np.ndarray] | None, which: str, num_prompt: int, num_tokens: int) -> np.ndarray | None:
    """[indices, positions, hidden] float32 at the positions `which` names (hidden_states_positions) for
    the `num_tokens` tokens kept (the core's rows past a stop string cut off); None when not asked."""
    if parts is None:
        return None
    num_rows = {"prompt": num_prompt, "output": num_tokens, "all": num_prompt + num_tokens - 1}[which]
    if not parts:
        return np.zeros((0, 0, 0), dtype=np.float32)
    whole = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return whole[:, :num_rows]
