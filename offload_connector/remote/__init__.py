"""The shared remote tier: KV blocks in a distributed store that several engines read and write.

- `base`: `RemoteStore` (the interface: put / get / exists / remove / close, per-key results), `RemoteFingerprint`
  and `RemoteKey` (store keys from a model+layout fingerprint and (group, vLLM block hash)), the value framing
  (header with version, fingerprint digest, key, length, CRC-32) and `RemoteStats`. Plain Python, no torch/numpy.
- `redis_store`: `RedisRemoteStore` (redis client, pipelined).
- `mooncake_store`: `MooncakeRemoteStore` (Mooncake Store's Python client).

`make_remote_store(kind, fingerprint=..., **opts)` builds one by name; the backend modules are imported only then,
so `import offload_connector.remote` needs neither client library.

With a secret (`kv_connector_extra_config.remote_secret_file`) every value carries an HMAC-SHA256 tag that readers
verify (`base`): a block written without the secret is a miss.
"""
from __future__ import annotations

import importlib

from offload_connector.remote.base import (
    FORMAT_VERSION, RemoteConfigError, RemoteFingerprint, RemoteKey, RemoteStats, RemoteStore, RemoteUnavailable,
    derive_mac_key,
)

# kind -> (module under offload_connector.remote, class). A new backend is one module and one line here.
REMOTE_STORES: dict[str, tuple[str, str]] = {
    "redis": ("redis_store", "RedisRemoteStore"),
    "mooncake": ("mooncake_store", "MooncakeRemoteStore"),
}


def make_remote_store(kind: str, *, mac_key: bytes | None = None, **opts: object) -> RemoteStore:
    """A `RemoteStore` of `kind` ("redis" or "mooncake"); `opts` are the backend's options plus `fingerprint`
    (required, a `RemoteFingerprint`). `mac_key` (`derive_mac_key` of the operator's secret) makes it tag what it
    writes and accept only values whose tag verifies. Bad config raises `RemoteConfigError` (one line naming the key
    and what is accepted); a missing or broken client library raises `RemoteUnavailable`."""
    if kind not in REMOTE_STORES:
        raise RemoteConfigError(f"remote store: 'kind' must be one of {sorted(REMOTE_STORES)}; got {kind!r}")
    if "fingerprint" not in opts:
        raise RemoteConfigError(f"remote store '{kind}': option 'fingerprint' is required (a RemoteFingerprint)")
    fingerprint = opts.pop("fingerprint")
    module, cls = REMOTE_STORES[kind]
    store = getattr(importlib.import_module(f"offload_connector.remote.{module}"), cls)(fingerprint, **opts)
    store.authenticate(mac_key)
    return store


__all__ = ["FORMAT_VERSION", "REMOTE_STORES", "RemoteConfigError", "RemoteFingerprint", "RemoteKey", "RemoteStats",
           "RemoteStore", "RemoteUnavailable", "derive_mac_key", "make_remote_store"]
