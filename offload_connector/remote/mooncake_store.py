"""The shared remote tier over Mooncake Store (https://github.com/kvcache-ai/Mooncake), via its Python client
`mooncake.store.MooncakeDistributedStore` (PyPI: mooncake-transfer-engine).

Topology: one `mooncake_master` (with its HTTP metadata server, `--enable_http_metadata_server=true`, or an etcd)
and any number of clients. Each client may contribute `global_segment_size` bytes of its own memory to the pool;
values live in some client's segment and disappear with it, so at least one long-lived client (an engine, or
`mooncake_client`) must hold the pool. Clients with `global_segment_size=0` only read and write.

Values are framed by `base` (header + bytes). Puts use `put_batch` (a key already present is kept: blocks are
content-addressed), gets `get_batch`, exists `batch_is_exist`, removes `batch_remove(force=True)`.

On hosts without RDMA or a GPU the wheel's `store.so` still links libibverbs, libmlx5, libnl, libcuda and libcudart
(0.3.13.post1). TCP works once those load: `scripts/mooncake-cpu-shim DIR` puts Debian's libibverbs/libnl, the
CUDA runtime from PyPI and a stub libcuda (every driver call answers "no device") in DIR; pass DIR as the
`lib_path` option or in `OC_MOONCAKE_LIB_PATH` (colon-separated) and this module preloads them before importing
the client. Without them, opening the store fails with one `RemoteUnavailable` line naming the missing library.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from offload_connector.remote.base import (
    DEFAULT_NAMESPACE, RemoteConfigError, RemoteFingerprint, RemoteStore, RemoteUnavailable, check_options,
    header_bytes, opt_int, opt_str,
)

KIND = "mooncake"
OPTIONS = ("master_server_address", "metadata_server", "local_hostname", "protocol", "device_name",
           "global_segment_size", "local_buffer_size", "replica_num", "lib_path", "namespace", "client")
PROTOCOLS = ("tcp", "rdma")
LIB_PATH_ENV = "OC_MOONCAKE_LIB_PATH"
# Libraries store.so links that a GPU-less, RDMA-less host may lack, in load order (dependencies first).
_SHIM_SONAMES = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1", "libmlx5.so.1", "libcuda.so.1",
                 "libcudart.so.12")


def check_static(opts: Mapping[str, object]) -> None:
    """What `config` checks before start-up, without a master: the string options and the protocol."""
    for name in ("master_server_address", "metadata_server", "local_hostname", "lib_path", "namespace"):
        if name in opts:
            opt_str(KIND, name, opts[name])
    if "device_name" in opts:
        opt_str(KIND, "device_name", opts["device_name"], allow_empty=True)
    if opts.get("protocol", "tcp") not in PROTOCOLS:
        raise RemoteConfigError(f"remote store 'mooncake': option 'protocol' must be one of {list(PROTOCOLS)}; "
                                f"got {opts['protocol']!r}")


def _preload(lib_path: str) -> list[str]:
    """Load the shim libraries found in `lib_path` (dirs, colon-separated) with RTLD_GLOBAL, so the dynamic
    loader satisfies store.so's dependencies by soname. Returns the files loaded."""
    import ctypes
    loaded = []
    dirs = [d for d in lib_path.split(os.pathsep) if d]
    for soname in _SHIM_SONAMES:
        for d in dirs:
            path = os.path.join(d, soname)
            if os.path.exists(path):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                loaded.append(path)
                break
    return loaded


def import_client(lib_path: str | None = None):
    """`mooncake.store` (the module), preloading the shim libraries first; RemoteUnavailable if it cannot load."""
    lib_path = lib_path if lib_path is not None else os.environ.get(LIB_PATH_ENV, "")
    if lib_path:
        try:
            _preload(lib_path)
        except OSError as e:
            raise RemoteUnavailable(f"remote store 'mooncake': cannot preload a library from {lib_path!r}: {e}") \
                from None
    try:
        from mooncake import store
    except ImportError as e:
        if getattr(e, "name", None) in ("mooncake", "mooncake.store") and "cannot open shared object" not in str(e):
            raise RemoteUnavailable("remote store 'mooncake' needs Mooncake Store's client: pip install "
                                    f"mooncake-transfer-engine ({e})") from None
        raise RemoteUnavailable(
            f"remote store 'mooncake': mooncake.store is installed but does not load: {e} (on a host without RDMA "
            f"or CUDA, build a shim with scripts/mooncake-cpu-shim DIR and set {LIB_PATH_ENV}=DIR)") from None
    return store


class MooncakeRemoteStore(RemoteStore):
    """`MooncakeRemoteStore(fp, master_server_address="host:50051", local_hostname="this-host-ip")` (metadata
    defaults to "P2PHANDSHAKE", i.e. no metadata server; or give "http://host:8080/metadata" or an etcd address), or
    an already set-up `MooncakeDistributedStore` as `client` (not closed by `close()`).

    Setup against an unreachable master retries for about 90 s (20 tries, inside the client) before failing."""

    kind = KIND

    # Options stay Any: each is checked where it is read and then handed to the client as it came.
    def __init__(self, fingerprint: RemoteFingerprint, **opts: Any) -> None:
        check_options(KIND, opts, OPTIONS)
        super().__init__(fingerprint, opts.get("namespace", DEFAULT_NAMESPACE))
        self._replicas = opt_int(KIND, "replica_num", opts.get("replica_num", 1), 1)
        client = opts.get("client")
        self._own_client = client is None
        if client is not None:
            others = sorted(set(opts) - {"client", "namespace", "replica_num", "lib_path"})
            if others:
                raise RemoteConfigError(f"remote store 'mooncake': option {others[0]!r} cannot be combined with "
                                        f"'client' (an already set-up MooncakeDistributedStore)")
            if not hasattr(client, "get_batch"):
                raise RemoteConfigError(f"remote store 'mooncake': option 'client' must be a "
                                        f"MooncakeDistributedStore; got {type(client).__name__}")
            mc = import_client(opts.get("lib_path"))
            self._config = mc.ReplicateConfig()
            self._config.replica_num = self._replicas
            self._store = client
            return
        if "master_server_address" not in opts:
            raise RemoteConfigError("remote store 'mooncake': option 'master_server_address' is required "
                                    "(host:port of mooncake_master)")
        check_static(opts)  # the string options and the protocol, as config checks them at the edge
        master = opt_str(KIND, "master_server_address", opts["master_server_address"])
        metadata = opt_str(KIND, "metadata_server", opts.get("metadata_server", "P2PHANDSHAKE"))
        hostname = opt_str(KIND, "local_hostname", opts.get("local_hostname", "127.0.0.1"))
        protocol = opts.get("protocol", "tcp")
        device = opt_str(KIND, "device_name", opts.get("device_name", ""), allow_empty=True)
        segment = opt_int(KIND, "global_segment_size", opts.get("global_segment_size", 512 << 20), 0)
        need = fingerprint.slot_bytes + header_bytes(self.keys.name(0, b"\0" * 64), tagged=True)
        local = opt_int(KIND, "local_buffer_size", opts.get("local_buffer_size", max(64 << 20, 2 * need)), need)
        lib_path = opts.get("lib_path")
        mc = import_client(lib_path)
        self._config = mc.ReplicateConfig()
        self._config.replica_num = self._replicas
        self._store = mc.MooncakeDistributedStore()
        rc = self._store.setup(hostname, metadata, segment, local, protocol, device, master)
        if rc != 0:
            raise RemoteUnavailable(f"remote store 'mooncake': setup(local_hostname={hostname!r}, metadata_server="
                                    f"{metadata!r}, protocol={protocol!r}, master_server_address={master!r}) "
                                    f"returned {rc}")

    @property
    def client(self):
        """The underlying `MooncakeDistributedStore` (tests use it to reach raw values)."""
        return self._store

    def _put_raw(self, names: list[str], values: list[bytes]) -> list[bool]:
        if self._store.put_batch(names, values, self._config) == 0:
            return [True] * len(names)
        # The batch call reports one code; learn which keys failed one by one.
        return [self._store.put(n, v, self._config) == 0 for n, v in zip(names, values)]

    def _get_raw(self, names: list[str]) -> list[bytes | None]:
        return [v if len(v) else None for v in self._store.get_batch(names)]

    def _exists_raw(self, names: list[str]) -> list[bool]:
        return [r == 1 for r in self._store.batch_is_exist(names)]

    def _remove_raw(self, names: list[str]) -> None:
        self._store.batch_remove(names, True)

    def _close_raw(self) -> None:
        if self._own_client:
            self._store.close()
