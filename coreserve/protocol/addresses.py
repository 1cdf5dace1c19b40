"""Socket addresses: the core listens on two endpoints derived from one address (input and output)."""

from __future__ import annotations

import ipaddress


def split_address(address: str) -> tuple[str, str]:
    """`ipc://PATH` -> (`ipc://PATH.in`, `ipc://PATH.out`); `tcp://HOST:PORT` -> ports PORT and PORT + 1.
    IPv6 hosts are written in brackets: `tcp://[::1]:PORT`. A malformed address is a ValueError."""
    if address.startswith("ipc://"):
        if len(address) == len("ipc://"):
            raise ValueError(f"an ipc address needs a path: {address!r}")
        return address + ".in", address + ".out"
    if address.startswith("tcp://"):
        host, port = _host_and_port(address)
        return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"
    raise ValueError(f"address must start with ipc:// or tcp://, got {address!r}")


def is_loopback(address: str) -> bool:
    if address.startswith("ipc://"):
        return True
    host = _host_and_port(address)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_and_port(address: str) -> tuple[str, int]:
    host, colon, port = address[len("tcp://") :].rpartition(":")
    if not colon or not port.isdigit() or not host or host.endswith(":"):
        raise ValueError(f"a tcp address needs a host and a port, as tcp://127.0.0.1:5555: {address!r}")
    if not 1 <= int(port) <= 65534:  # PORT + 1 is the output socket
        raise ValueError(f"the port must be in 1..65534 (PORT + 1 is used too): {address!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"write an IPv6 host in brackets, as tcp://[::1]:5555: {address!r}")
    return host, int(port)
