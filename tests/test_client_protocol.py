"""The three core clients implement the CoreClient protocol, method for method (no model, no sockets)."""

from __future__ import annotations

import inspect

import pytest

from coreserve.frontend.clients.client_protocol import CoreClient
from coreserve.frontend.clients.core_client import MPClient
from coreserve.frontend.clients.inproc_client import InprocClient
from coreserve.frontend.clients.multi_core_client import MultiCoreClient

PROTOCOL_METHODS = [
    name
    for name, member in vars(CoreClient).items()
    if inspect.isfunction(member) and not name.startswith("_")
]


def test_the_protocol_names_the_engines_calls():
    assert {"send", "abort", "get_outputs", "take_lost", "get_stats", "control", "shutdown"} <= set(
        PROTOCOL_METHODS
    )


@pytest.mark.parametrize("client_class", [MPClient, InprocClient, MultiCoreClient])
@pytest.mark.parametrize("name", PROTOCOL_METHODS)
def test_each_client_has_each_method_with_the_protocols_parameters(client_class, name):
    expected = inspect.signature(getattr(CoreClient, name)).parameters
    got = inspect.signature(getattr(client_class, name)).parameters
    assert list(got) == list(expected), f"{client_class.__name__}.{name}{list(got)}"
    for param in expected.values():
        assert got[param.name].default == param.default and got[param.name].kind == param.kind
