"""The shared tier's secret: read from the file the operator names (`remote_secret_file`), never from the JSON vLLM
logs, and turned into the MAC key the stores tag and verify values with (`base.derive_mac_key`). Errors are one
`ConfigError` line naming the key; no message shows the file's contents."""
from __future__ import annotations

import os
from typing import Any

from offload_connector.remote.base import MIN_SECRET_BYTES, derive_mac_key


def read_secret(path: str) -> bytes:
    """The shared tier's secret: the file's bytes, surrounding whitespace stripped (a trailing newline from `echo`
    or an editor is not part of it). One ConfigError naming 'remote_secret_file' when it cannot be used; the
    message never shows the file's contents."""
    from offload_connector.config import ConfigError
    try:
        if not os.path.isfile(path):
            raise ConfigError(f"kv_connector_extra_config: 'remote_secret_file' {path!r} is not a regular file")
        with open(path, "rb") as f:
            secret = f.read(1 << 16).strip()
    except OSError as err:
        raise ConfigError(f"kv_connector_extra_config: 'remote_secret_file' {path!r} cannot be read "
                          f"({err.strerror})") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"kv_connector_extra_config: 'remote_secret_file' {path!r} holds {len(secret)} bytes; a "
                          f"secret needs at least {MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    return secret


def shared_tier_mac_key(config: Any) -> bytes | None:
    """The MAC key of the shared tier's stores (None when the operator allowed unauthenticated use)."""
    if config.remote_secret_file is None:
        return None
    return derive_mac_key(read_secret(config.remote_secret_file))
