"""The core's two listening sockets (engine-core process): ipc folder and stale-file hygiene, refusal of
an address a live core holds, ZeroMQ limits on what a peer can make the core buffer, and cleanup.

Limits (coreserve/protocol/limits.py, docs/decisions.md): a frame on the input socket is at most
MAX_INPUT_FRAME_BYTES (a peer that sends more is disconnected by ZeroMQ before the bytes are
buffered); at most INPUT_HWM frames wait per peer. The output socket only sends: a peer that writes to it is cut off at OUTPUT_MAX_INBOUND_BYTES and
whatever arrives below that is read and thrown away by the output thread.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import zmq

from coreserve.engine_core.curve_auth import CurveServer
from coreserve.protocol.addresses import split_address
from coreserve.protocol.limits import INPUT_HWM, MAX_INPUT_FRAME_BYTES, OUTPUT_MAX_INBOUND_BYTES

CLOSE_LINGER_MS = 1000  # time for the last frames (a fatal error's message) to leave on exit


class Endpoints:
    """`curve`: sockets that accept only authenticated, encrypted connections (coreserve/engine_core/curve_auth.py)."""

    def __init__(self, ctx: zmq.Context, address: str, curve: CurveServer | None = None) -> None:
        in_address, out_address = split_address(address)
        self.ipc_paths = [a[len("ipc://") :] for a in (in_address, out_address) if a.startswith("ipc://")]
        for path in self.ipc_paths:
            _prepare_ipc_path(path, address)
        self.curve = curve
        self.in_socket = _bind(ctx, zmq.ROUTER, in_address, MAX_INPUT_FRAME_BYTES, curve)
        self.in_socket.setsockopt(zmq.RCVHWM, INPUT_HWM)
        self.monitor = curve.watch(self.in_socket) if curve is not None else None
        self.out_socket = _bind(ctx, zmq.ROUTER, out_address, OUTPUT_MAX_INBOUND_BYTES, curve)
        self.out_socket.setsockopt(zmq.RCVHWM, 1)
        self.out_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer is an error, not a drop
        self.out_socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow client's outputs

    def log_refusals(self) -> None:
        """Logs connections refused at the CURVE handshake (called by the input thread)."""
        if self.monitor is not None:
            self.curve.log_failures(self.monitor)

    def close(self) -> None:
        if self.monitor is not None:
            self.in_socket.disable_monitor()
            self.monitor.close(linger=0)
        self.in_socket.close(linger=0)
        self.out_socket.close(linger=CLOSE_LINGER_MS)
        for path in self.ipc_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self.curve is not None:
            self.curve.stop()


def _bind(
    ctx: zmq.Context, kind: int, address: str, max_frame_bytes: int, curve: CurveServer | None
) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if curve is not None:
        curve.secure(sock)
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"{address} is in use by another process") from None
        raise ValueError(f"cannot listen on {address}: {exc}") from None
    return sock


def _prepare_ipc_path(path: str, address: str) -> None:
    """Creates the folder; a socket file a live core answers on is refused, a stale one removed."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # left by a core that did not exit cleanly
        return
    except OSError as exc:
        raise ValueError(f"cannot use {address}: {path} exists and is not a socket ({exc})") from None
    finally:
        probe.close()
    raise ValueError(f"{address} is in use by a running engine core; choose another address")
