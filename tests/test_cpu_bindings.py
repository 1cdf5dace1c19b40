"""The Python/C seam (coreserve/worker/cpu/bindings.py): the ctypes mirrors of the C structs have
the C side's size and field offsets, and every exported function is bound with a named signature."""

from __future__ import annotations

import ctypes

import pytest

from coreserve.worker.cpu.bindings import SIGNATURES, LayerDesc, ModelDesc, QuantPart, StepDesc
from coreserve.worker.cpu.kernels import load_cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    loaded = load_cpu_kernels()
    assert loaded is not None, "this machine has a C compiler: the kernels must build"
    return loaded


MIRRORS = [(LayerDesc, b"layer_desc"), (ModelDesc, b"model_desc"), (StepDesc, b"step_desc"),
           (QuantPart, b"quant_part")]


@pytest.mark.parametrize("mirror, c_name", MIRRORS)
def test_struct_mirrors_match_the_c_layout(kernels, mirror, c_name):
    layout = kernels.decode_forward_layout
    assert ctypes.sizeof(mirror) == layout(c_name, b"")
    for name, _ in mirror._fields_:
        assert getattr(mirror, name).offset == layout(c_name, name.encode()), name


def test_every_c_field_has_a_mirror(kernels):
    """A field the C struct gains and Python lacks would shift nothing yet be left unset: the sizes catch it."""
    layout = kernels.decode_forward_layout
    assert layout(b"layer_desc", b"no_such_field") == -1 and layout(b"no_such_struct", b"") == -1
    for mirror, c_name in MIRRORS:
        assert len(mirror._fields_) * 8 == layout(c_name, b"")  # every field is 8 bytes, no padding


def test_signatures_name_every_argument_and_are_applied(kernels):
    for name, signature in SIGNATURES.items():
        function = getattr(kernels, name)
        assert [kind for _, kind in signature.args] == list(function.argtypes or [])
        assert function.restype == signature.restype
        assert all(arg_name.isidentifier() for arg_name, _ in signature.args)
