"""Secrets of the second tiers: read from a file the operator names in the config (never inline: vLLM logs its
configuration), and turned into the 32-byte MAC key a tier tags and verifies its blocks with. Each tier derives its
own key (`purpose`), so one secret file may serve the disk and the shared tier without a tag of one verifying in the
other. Errors are one `ConfigError` line naming the config key; no message shows the file's contents."""
from __future__ import annotations

import hashlib
import os

from offload_connector.errors import ConfigError

MIN_SECRET_BYTES = 16
MAX_SECRET_FILE_BYTES = 1 << 16


def read_secret(path: str, key: str) -> bytes:
    """The file's bytes, surrounding whitespace stripped (a trailing newline from `echo` or an editor is not part of
    the secret). One ConfigError naming `key` when it cannot be used."""
    try:
        if not os.path.isfile(path):
            raise ConfigError(f"kv_connector_extra_config: '{key}' {path!r} is not a regular file")
        with open(path, "rb") as f:
            secret = f.read(MAX_SECRET_FILE_BYTES).strip()
    except OSError as err:
        raise ConfigError(f"kv_connector_extra_config: '{key}' {path!r} cannot be read ({err.strerror})") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"kv_connector_extra_config: '{key}' {path!r} holds {len(secret)} bytes; a secret needs "
                          f"at least {MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    return secret


def derive_key(secret: bytes, purpose: bytes) -> bytes:
    """The 32-byte MAC key of `secret` for one tier (`purpose`, at most 16 bytes)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a tier secret must hold at least {MIN_SECRET_BYTES} bytes; got {len(secret)}")
    return hashlib.blake2b(secret, digest_size=32, person=purpose).digest()


def mac_key_from_file(path: str | None, key: str, purpose: bytes) -> bytes | None:
    """The MAC key of the secret in `path` (None: the tier runs without one)."""
    return None if path is None else derive_key(read_secret(path, key), purpose)
