"""The shared tier's secret (`remote_secret_file`): read by `tier_auth` and turned into the MAC key the stores tag
and verify values with (`framing.derive_mac_key`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from offload_connector.remote.framing import derive_mac_key
from offload_connector.tier_auth import read_secret as _read_secret

if TYPE_CHECKING:
    from offload_connector.config import OffloadConfig

KEY = "remote_secret_file"


def read_secret(path: str) -> bytes:
    """The shared tier's secret; one ConfigError naming 'remote_secret_file' when it cannot be used."""
    return _read_secret(path, KEY)


def shared_tier_mac_key(config: OffloadConfig) -> bytes | None:
    """The MAC key of the shared tier's stores (None when the operator allowed unauthenticated use)."""
    if config.remote_secret_file is None:
        return None
    return derive_mac_key(read_secret(config.remote_secret_file))
