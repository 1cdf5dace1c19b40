"""Socket addresses: the core listens on two endpoints derived from one address (input and output)."""

from __future__ import annotations

import ipaddress


def split_address(address: str) -> tuple[str, str]:
    """`ipc://PATH` -> (`ipc://PATH.in`, `ipc://PATH.out`); `tcp://HOST:PORT` -> ports PORT and PORT + 1."""
    if address.startswith("ipc://"):
        return address + ".in", address + ".out"
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        if not port.isdigit():
            raise ValueError(f"a tcp address needs a port: {address!r}")
        return f"tcp://{host}:{port}", f"tcp://{host}:{int(port) + 1}"
    raise ValueError(f"address must start with ipc:// or tcp://, got {address!r}")


def is_loopback(address: str) -> bool:
    if address.startswith("ipc://"):
        return True
    host = address[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
