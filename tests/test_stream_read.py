"""The benchmark's memory read probe (scripts/csrc/stream_read.c, outside the engine's kernels)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from stream_read import load_stream_sum  # noqa: E402


def test_stream_sum_reads_every_element_once():
    """The read bench_decode_step.py takes the bandwidth from: it must be the array's sum."""
    stream_sum = load_stream_sum()
    assert stream_sum is not None, "this machine has a C compiler: the probe must build"
    values = torch.rand(1_000_003)
    assert stream_sum(values.data_ptr(), values.numel(), 2) == pytest.approx(values.double().sum().item(), rel=1e-5)


def test_the_engine_kernels_no_longer_carry_the_probe():
    from coreserve.worker.cpu.bindings import SIGNATURES

    assert "stream_sum" not in SIGNATURES
