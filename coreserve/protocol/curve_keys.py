"""CURVE key files, shared by the daemon and its clients: made by `python -m coreserve.engine_core keygen DIR`,
read with their permissions checked. ZeroMQ's own certificate format (`zmq.auth`): `NAME.key` holds a
public key, `NAME.key_secret` the key pair; a secret file must be readable by its owner alone (0600).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq.auth


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes  # z85, 40 bytes


def make_key_pair(folder: str, name: str) -> tuple[Path, Path]:
    """Writes NAME.key (public, 0644) and NAME.key_secret (0600) into `folder` (made 0700 if new)."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    public, secret = zmq.auth.create_certificates(folder, name)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return Path(public), Path(secret)


def load_key_pair(path: str) -> KeyPair:
    """A `.key_secret` file; refused (ValueError) when others than its owner may read it."""
    _check_private(path)
    public, secret = _load(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key: give the NAME.key_secret file")
    return KeyPair(public, secret)


def load_public_key(path: str) -> bytes:
    return _load(path)[0]


def load_allowed_keys(folder: str) -> set[bytes]:
    """The public keys of every `*.key` file in `folder`."""
    if not os.path.isdir(folder):
        raise ValueError(f"{folder} is not a folder of authorised client keys (NAME.key files)")
    return {load_public_key(str(path)) for path in sorted(Path(folder).glob("*.key"))}


def _check_private(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ValueError(f"cannot read the key file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path} may be read by others (mode {stat.S_IMODE(mode):o}): chmod 600 it")


def _load(path: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a ZeroMQ key file: {exc}") from None
