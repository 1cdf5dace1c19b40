"""CURVE authentication of the daemon's sockets (engine-core process).

ZeroMQ encrypts the connection and asks a ZAP handler (pyzmq's authenticator thread) about each client
key; only keys in the authorised folder pass. A client with another key, or one that speaks plain TCP,
fails the handshake: ZeroMQ drops the connection before any of its bytes reach a socket, so none
reaches the decoder. Each refusal is logged, at most one line per client key or kind per minute.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from coreserve.protocol.curve_keys import KeyPair, load_allowed_keys

logger = logging.getLogger(__name__)

LOG_EVERY_S = 60.0
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class AllowList:
    """The ZAP callback: a client key is allowed when it is one of the authorised keys."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed
        self._last_log: dict[bytes, float] = {}

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key in self.allowed:
            return True
        now = time.monotonic()
        if now - self._last_log.get(client_key, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[client_key] = now
            logger.warning("refused a client whose CURVE key is not authorised: %s", client_key.decode())
        return False


class CurveServer:
    """Starts the authenticator on `ctx`; `secure(socket)` makes a socket a CURVE server (before bind)."""

    def __init__(self, ctx: zmq.Context, keys: KeyPair, authorized_clients: str) -> None:
        allowed = load_allowed_keys(authorized_clients)
        if not allowed:
            raise ValueError(
                f"{authorized_clients} has no client keys (NAME.key files): no one could connect"
            )
        self.keys = keys
        self.authenticator = ThreadAuthenticator(ctx)
        self.authenticator.start()
        self.authenticator.configure_curve_callback("*", credentials_provider=AllowList(allowed))
        self._last_log = -LOG_EVERY_S

    def secure(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def watch(self, sock: zmq.Socket) -> zmq.Socket:
        """A monitor of failed handshakes (plain clients, a wrong server key), read by `log_failures`."""
        return sock.get_monitor_socket(_HANDSHAKE_FAILURES)

    def log_failures(self, monitor: zmq.Socket) -> None:
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())
            now = time.monotonic()
            if now - self._last_log >= LOG_EVERY_S:
                self._last_log = now
                logger.warning(
                    "refused a connection on %s: the CURVE handshake failed (%s; a client without CURVE "
                    "or with the wrong server key)",
                    event["endpoint"].decode(errors="replace"),
                    zmq.Event(event["event"]).name,
                )

    def stop(self) -> None:
        self.authenticator.stop()
