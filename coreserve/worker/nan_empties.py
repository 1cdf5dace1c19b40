"""A debug switch (`EngineConfig.fill_empty_with_nan`): while an engine that asked for it runs, every
floating `torch.empty`, `empty_like`, `empty_strided` and `Tensor.new_empty` comes back filled with NaN
(engine-core process, or the user's for an in-process engine).

The buffers the kernels write (attention outputs, products, fused decode scratch) are allocated
uninitialized for speed; each must be written whole before anything reads it. Under this switch a byte
left unwritten is a NaN that reaches the logprobs, so a test that runs under it and still gets its bits
proves no uninitialized memory reached an output (tests/test_batch_invariance.py runs so). The patch is
of the torch module, process-wide, for as long as any engine holds it; it costs one fill per allocation.
"""

from __future__ import annotations

import functools
import threading

import torch

_LOCK = threading.Lock()
_HOLDERS = [0]  # engines holding the patch: one process, one patch (the switch is for tests and debugging)
_ORIGINALS: dict[str, object] = {}


def hold() -> None:
    """Turns the NaN fill on (for this engine; it stays on until every holder released it)."""
    with _LOCK:
        _HOLDERS[0] += 1
        if _HOLDERS[0] == 1:
            _ORIGINALS.update(empty=torch.empty, empty_like=torch.empty_like, empty_strided=torch.empty_strided,
                              new_empty=torch.Tensor.new_empty)
            for name in ("empty", "empty_like", "empty_strided"):
                setattr(torch, name, _filled(_ORIGINALS[name]))
            torch.Tensor.new_empty = _filled(_ORIGINALS["new_empty"])


def release() -> None:
    with _LOCK:
        _HOLDERS[0] -= 1
        if _HOLDERS[0] == 0:
            for name in ("empty", "empty_like", "empty_strided"):
                setattr(torch, name, _ORIGINALS[name])
            torch.Tensor.new_empty = _ORIGINALS["new_empty"]


def _filled(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        tensor = factory(*args, **kwargs)
        if tensor.dtype.is_floating_point and tensor.device.type != "meta":
            tensor.fill_(float("nan"))
        return tensor

    return make
