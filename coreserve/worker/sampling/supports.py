"""The sampling supports of the rows that asked (return_sampling_mask), on the host by request (core
process): one int32 array of ascending token ids per sampled row, in row order."""

from __future__ import annotations

import numpy as np

from coreserve.worker.sampling.sampler import SamplerOutput
from coreserve.worker.step.input_batch import RequestState


def sampling_masks(states: list[RequestState], out: SamplerOutput | None) -> dict[str, list[np.ndarray]]:
    """`states`: the sampler's rows (a verified request's rows each); {} when no row asked."""
    if out is None or not out.supports:
        return {}
    asking = [state for state in states if state.params.return_sampling_mask]  # meta.mask_rows' order
    masks: dict[str, list[np.ndarray]] = {}
    for state, ids in zip(asking, out.supports, strict=True):
        masks.setdefault(state.req_id, []).append(ids)
    return masks
