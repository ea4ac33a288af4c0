"""The shared remote tier's storage layer: what every backend (Redis, Mooncake Store, ...) has in common.

Several engines share one pool of KV blocks in a distributed store. A block is addressed by its KV cache group and
its vLLM block hash, scoped by a *fingerprint* of everything that must match for the bytes to mean the same block
(model, KV layout, dtype, per-group block bytes and block sizes, TP rank/size, PP rank/size): engines with equal
fingerprints share blocks, any difference gives disjoint key spaces.

Store key (str, ASCII):   {namespace}/v{FORMAT_VERSION}/{fingerprint digest, 32 hex}/{group}/{b|i}{block hash hex}
Stored value:             framed by `framing` (header naming key, fingerprint and length; the bytes; CRC-32s; with a
                          secret, an HMAC-SHA256 tag): anything that does not verify is a miss, counted by reason.

`RemoteStore` does the keys, framing, checks and counters; a backend implements five raw operations on
(store key, value bytes). Backend failures (connection lost, server error) are logged and become misses or failed
puts: a shared cache tier must never take an engine down.

Plain Python (struct, zlib, hashlib, json): the scheduler side may import this module without torch or numpy.
Buffers are anything exposing the buffer protocol (bytes, bytearray, memoryview, numpy arrays, pinned host tensors'
memoryviews), C-contiguous.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Hashable, Iterable, Mapping, Sequence

from offload_connector.remote.framing import (  # noqa: F401 - re-exported: the value format's names live here too
    FLAG_TAG, FORGERY_REASONS, FORMAT_VERSION, MAGIC, MIN_SECRET_BYTES, REJECT_REASONS, TAG_BYTES, _as_bytes_view,
    check_value, crc32, derive_mac_key, header_bytes, pack_header, pack_value, value_tag,
)

if TYPE_CHECKING:
    import numpy as np
    from _typeshed import ReadableBuffer, WriteableBuffer

    from offload_connector.disk.format import DiskFingerprint

logger = logging.getLogger("vllm.offload_connector.remote")

MAX_KEY_BYTES = 1024
DEFAULT_NAMESPACE = "oc"


class RemoteConfigError(ValueError):
    """A remote-store option the store cannot run with (unknown kind or option, bad value). One line."""


class RemoteUnavailable(RuntimeError):
    """The remote store's client library is missing or cannot start (import failure, setup failure). One line."""


@dataclass(frozen=True)
class RemoteFingerprint:
    """What must match for two engines to share a block's bytes. Mirrors `disk.format.DiskFingerprint` (model,
    per-group block bytes and block sizes, dtype, `extra`) plus the KV layout name and the parallel position: each
    TP rank stores its own shard of a block, and each PP rank its own layers, so they never share keys.

    `slot_bytes` is the largest value a block may have (defaults to the largest group block)."""
    model: str
    layout: str
    dtype: str
    group_block_bytes: tuple[int, ...]
    block_sizes: tuple[int, ...]
    slot_bytes: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    extra: str = ""
    vllm: str = ""  # the vLLM minor release: engines of different releases never share keys

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_block_bytes", tuple(int(b) for b in self.group_block_bytes))
        object.__setattr__(self, "block_sizes", tuple(int(b) for b in self.block_sizes))
        if not self.group_block_bytes or any(b <= 0 for b in self.group_block_bytes):
            raise ValueError(f"remote fingerprint: group_block_bytes must be positive, got {self.group_block_bytes}")
        if len(self.block_sizes) != len(self.group_block_bytes):
            raise ValueError("remote fingerprint: one block size per group")
        if self.slot_bytes == 0:
            object.__setattr__(self, "slot_bytes", max(self.group_block_bytes))
        if self.slot_bytes < max(self.group_block_bytes):
            raise ValueError(f"remote fingerprint: every group block must fit slot_bytes={self.slot_bytes} "
                             f"({self.group_block_bytes})")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"remote fingerprint: bad parallel position tp {self.tp_rank}/{self.tp_size}, "
                             f"pp {self.pp_rank}/{self.pp_size}")

    @classmethod
    def from_disk(cls, disk_fp: DiskFingerprint, *, layout: str, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                  pp_size: int = 1) -> "RemoteFingerprint":
        """From a `disk.format.DiskFingerprint` (duck-typed, so this module does not import the disk package)."""
        return cls(model=disk_fp.model, layout=layout, dtype=disk_fp.dtype,
                   group_block_bytes=tuple(disk_fp.group_block_bytes), block_sizes=tuple(disk_fp.block_sizes),
                   slot_bytes=disk_fp.slot_bytes, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                   pp_size=pp_size, extra=disk_fp.extra, vllm=getattr(disk_fp, "vllm", ""))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        """16 bytes naming this fingerprint and the value format version (in every key and every value header)."""
        return hashlib.blake2b(self.to_json(), digest_size=16, person=b"ocremote%d" % FORMAT_VERSION).digest()


def encode_block_hash(h: Hashable) -> str:
    """A vLLM block hash as key text: bytes (vLLM >= 0.11) as 'b' + hex, an int (older vLLM, tests) as 'i' + the
    hex of its signed big-endian bytes. Kinds never collide."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        raw, kind = bytes(h), "b"
    elif isinstance(h, int) and not isinstance(h, bool):
        raw, kind = h.to_bytes(max(1, (h.bit_length() + 8) // 8), "big", signed=True), "i"
    else:
        raise TypeError(f"remote store keys hash bytes or ints, got {type(h).__name__}")
    return kind + raw.hex()


class RemoteKey:
    """Builds store keys for one fingerprint: `RemoteKey(fp).name(group, block_hash)`."""

    def __init__(self, fingerprint: RemoteFingerprint, namespace: str = DEFAULT_NAMESPACE) -> None:
        if not namespace or "/" in namespace or not namespace.isascii() or not namespace.isprintable() \
                or " " in namespace:
            raise RemoteConfigError(f"remote store: 'namespace' must be non-empty printable ASCII without '/' or "
                                    f"spaces; got {namespace!r}")
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.digest = fingerprint.digest()
        self.prefix = f"{namespace}/v{FORMAT_VERSION}/{self.digest.hex()}/"

    def name(self, group: int, block_hash: Hashable) -> str:
        if not isinstance(group, int) or isinstance(group, bool) or group < 0:
            raise TypeError(f"remote store: group must be a non-negative int, got {group!r}")
        key = f"{self.prefix}{group}/{encode_block_hash(block_hash)}"
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"remote store key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
        return key

    def names(self, keys: Iterable[tuple[int, Hashable]]) -> list[str]:
        return [self.name(g, h) for g, h in keys]


@dataclass
class RemoteStats:
    """Counters since the store was opened (read them with `RemoteStore.stats()`, a copy)."""
    puts: int = 0              # blocks stored (or already present)
    put_failures: int = 0      # blocks the store refused or errored on
    put_bytes: int = 0         # data bytes of stored blocks (headers excluded)
    gets: int = 0              # blocks asked for
    hits: int = 0              # blocks found, verified and copied out
    misses: int = 0            # blocks absent, rejected or errored on
    get_bytes: int = 0         # data bytes copied out
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> values found but refused (subset of misses)
    errors: int = 0            # backend calls that raised (each also makes its blocks misses / failed puts)
    put_seconds: float = 0.0
    get_seconds: float = 0.0

    def copy(self) -> "RemoteStats":
        return RemoteStats(**{**asdict(self), "rejected": dict(self.rejected)})


BlockKey = tuple[int, Hashable]


class RemoteStore(ABC):
    """A shared pool of KV blocks in a distributed store, for one fingerprint.

    `keys` are (KV cache group index, vLLM block hash) pairs; buffers are bytes-like (C-contiguous). All methods
    are thread-safe if the backend's raw operations are (both shipped backends are). Operations are batched: one
    call is one (pipelined) round trip where the backend allows."""

    kind = "abstract"

    def __init__(self, fingerprint: RemoteFingerprint, namespace: str = DEFAULT_NAMESPACE) -> None:
        # Set by `authenticate` (make_remote_store does it before the store is used): tag every value written,
        # accept only values whose tag verifies.
        self._mac_key: bytes | None = None
        self._forgeries_logged: set[str] = set()
        if not isinstance(fingerprint, RemoteFingerprint):
            raise RemoteConfigError(f"remote store '{self.kind}': 'fingerprint' must be a RemoteFingerprint; got "
                                    f"{type(fingerprint).__name__}")
        self.keys = RemoteKey(fingerprint, namespace)
        self.fingerprint = fingerprint
        self._stats = RemoteStats()
        self._lock = threading.Lock()
        self._closed = False

    def authenticate(self, mac_key: bytes | None) -> None:
        """Tag every value this store writes with `mac_key` (32 bytes, `derive_mac_key`) and accept only values
        whose tag verifies; None: untagged values, any tag skipped unverified."""
        if mac_key is not None and (not isinstance(mac_key, bytes) or len(mac_key) != 32):
            raise RemoteConfigError("remote store: the MAC key must be 32 bytes (derive_mac_key)")
        self._mac_key = mac_key

    @property
    def authenticated(self) -> bool:
        return self._mac_key is not None

    def set_epoch(self, epoch: int) -> None:
        """Move to the namespace of cache-reset epoch `epoch` (the configured namespace at 0, then "<ns>-e<n>"):
        an engine whose cache was reset (e.g. after a weight update) never reads what it could see before."""
        base = getattr(self, "_base_namespace", None) or self.keys.namespace
        self._base_namespace = base
        self.keys = RemoteKey(self.fingerprint, base if epoch == 0 else f"{base}-e{epoch}")

    # -- raw operations, one per backend -------------------------------------------------------------------------
    @abstractmethod
    def _put_raw(self, names: list[str], values: list[bytes]) -> list[bool]:
        """Store each value under its name. An existing name may be kept (blocks are content-addressed)."""

    @abstractmethod
    def _get_raw(self, names: list[str]) -> list[bytes | None]:
        """Each name's value (bytes-like) or None when absent."""

    @abstractmethod
    def _exists_raw(self, names: list[str]) -> list[bool]: ...

    @abstractmethod
    def _remove_raw(self, names: list[str]) -> None: ...

    @abstractmethod
    def _close_raw(self) -> None: ...

    # -- public API -------------------------------------------------------------------------------------------------
    # np.ndarray named as well: numpy declares the buffer protocol to type checkers only from Python 3.12 on.
    def put(self, keys: Sequence[BlockKey], buffers: Sequence[ReadableBuffer | np.ndarray]) -> list[bool]:
        """Store each buffer under its key; per-key success."""
        if len(keys) != len(buffers):
            raise ValueError(f"put: {len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        self._check_open()
        names = self.keys.names(keys)
        views = [_as_bytes_view(b) for b in buffers]
        for mv in views:
            if mv.nbytes > self.fingerprint.slot_bytes:
                raise ValueError(f"put: a block of {mv.nbytes} bytes exceeds slot_bytes="
                                 f"{self.fingerprint.slot_bytes}")
        values = [pack_value(self.keys.digest, n, mv, self._mac_key) for n, mv in zip(names, views)]
        t0 = time.perf_counter()
        try:
            ok = [bool(x) for x in self._put_raw(names, values)]
            err = False
        except Exception as e:  # noqa: BLE001 - a shared cache tier must not take the engine down
            logger.warning("remote store %s: put of %d blocks failed: %s", self.kind, len(keys), e)
            ok, err = [False] * len(keys), True
        with self._lock:
            s = self._stats
            s.errors += err
            s.put_seconds += time.perf_counter() - t0
            for good, mv in zip(ok, views):
                if good:
                    s.puts += 1
                    s.put_bytes += mv.nbytes
                else:
                    s.put_failures += 1
        return ok

    def get(self, keys: Sequence[BlockKey], out_buffers: Sequence[WriteableBuffer | np.ndarray]) -> list[bool]:
        """Fill each out buffer with its key's block; per-key success. A block is a hit only if it is present,
        verifies (format, fingerprint, key, CRC) and its length equals its buffer's; a miss leaves its buffer
        untouched. A value that fails verification is counted in `stats().rejected` and removed from the store."""
        if len(keys) != len(out_buffers):
            raise ValueError(f"get: {len(keys)} keys but {len(out_buffers)} buffers")
        if not keys:
            return []
        self._check_open()
        names = self.keys.names(keys)
        outs = [_as_bytes_view(b) for b in out_buffers]
        for mv in outs:
            if mv.readonly:
                raise ValueError("get: out buffers must be writable")
        t0 = time.perf_counter()
        try:
            values = self._get_raw(names)
            err = False
        except Exception as e:  # noqa: BLE001
            logger.warning("remote store %s: get of %d blocks failed: %s", self.kind, len(keys), e)
            values, err = [None] * len(keys), True
        ok: list[bool] = []
        rejected: list[str] = []
        bad_names: list[str] = []  # parallel to `rejected` where the value is dropped (all but "length")
        nbytes = 0
        for name, value, out in zip(names, values, outs):
            if value is None or len(value) == 0:
                ok.append(False)
                continue
            data, reason = check_value(value, self.keys.digest, name, out.nbytes, self._mac_key)
            if data is None:
                ok.append(False)
                if reason == "length":  # a wrong-sized buffer is the caller's mistake, not a bad value: kept
                    with self._lock:
                        self._stats.rejected["length"] = self._stats.rejected.get("length", 0) + 1
                else:
                    rejected.append(reason)
                    bad_names.append(name)
                continue
            out[:] = data
            nbytes += data.nbytes
            ok.append(True)
        with self._lock:
            s = self._stats
            s.errors += err
            s.get_seconds += time.perf_counter() - t0
            s.gets += len(keys)
            hits = sum(ok)
            s.hits += hits
            s.misses += len(keys) - hits
            s.get_bytes += nbytes
        if rejected:
            logger.debug("remote store %s: rejected %d values (%s)", self.kind, len(rejected), sorted(set(rejected)))
        self._count_rejections(rejected, bad_names)
        return ok

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key has a value in the store (not verified: a later `get` may still reject it)."""
        if not keys:
            return []
        self._check_open()
        try:
            return [bool(x) for x in self._exists_raw(self.keys.names(keys))]
        except Exception as e:  # noqa: BLE001
            logger.warning("remote store %s: exists of %d blocks failed: %s", self.kind, len(keys), e)
            with self._lock:
                self._stats.errors += 1
            return [False] * len(keys)

    def readable(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key has a value this store would accept: `exists` for a store without a secret (one cheap
        round trip; a later `get` still checks the value); with one, the values are fetched and their tags checked
        (meant for small values such as the scheduler's markers), so a forged value is a miss here already,
        counted in `stats().rejected` like a `get`'s."""
        if self._mac_key is None:
            return self.exists(keys)
        if not keys:
            return []
        self._check_open()
        names = self.keys.names(keys)
        try:
            values = self._get_raw(names)
        except Exception as e:  # noqa: BLE001
            logger.warning("remote store %s: lookup of %d blocks failed: %s", self.kind, len(keys), e)
            with self._lock:
                self._stats.errors += 1
            return [False] * len(keys)
        ok, rejected, bad = [], [], []
        for name, value in zip(names, values):
            if value is None or len(value) == 0:
                ok.append(False)
                continue
            data, reason = check_value(value, self.keys.digest, name, None, self._mac_key)
            ok.append(data is not None)
            if data is None:
                rejected.append(reason)
                bad.append(name)
        self._count_rejections(rejected, bad)
        return ok

    def _count_rejections(self, rejected: list[str], bad_names: list[str]) -> None:
        """Count rejected values by reason, log forgeries once per reason, and drop the values no reader can use."""
        if not rejected:
            return
        with self._lock:
            for r in rejected:
                self._stats.rejected[r] = self._stats.rejected.get(r, 0) + 1
        for reason in FORGERY_REASONS:
            if reason in rejected and reason not in self._forgeries_logged:
                self._forgeries_logged.add(reason)  # once per reason: a flood of forgeries is one line, counted
                logger.warning("remote store %s: refused a value that %s (first: %s); it is a miss and the request "
                               "recomputes. Counted in shared_tier_rejected_blocks_total{reason=%s}; logged once",
                               self.kind, "carries no tag while this store requires one" if reason ==
                               "unauthenticated" else "carries a tag that does not verify under this store's secret",
                               bad_names[rejected.index(reason)], reason)
        if bad_names:
            # Drop values no reader can use, so a later put of the block can land (some stores keep an existing key).
            try:
                self._remove_raw(bad_names)
            except Exception as e:  # noqa: BLE001
                logger.debug("remote store %s: removing %d rejected values failed: %s", self.kind, len(bad_names), e)

    def remove(self, keys: Sequence[BlockKey]) -> None:
        """Remove the keys' values (absent keys are fine)."""
        if not keys:
            return
        self._check_open()
        try:
            self._remove_raw(self.keys.names(keys))
        except Exception as e:  # noqa: BLE001
            logger.warning("remote store %s: remove of %d blocks failed: %s", self.kind, len(keys), e)
            with self._lock:
                self._stats.errors += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_raw()

    def stats(self) -> RemoteStats:
        with self._lock:
            return self._stats.copy()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"remote store '{self.kind}' is closed")

    def __enter__(self) -> "RemoteStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- option checking shared by the backends ----------------------------------------------------------------------------
def check_options(kind: str, opts: Mapping[str, object], accepted: Iterable[str]) -> None:
    accepted = sorted(accepted)
    unknown = sorted(set(opts) - set(accepted))
    if unknown:
        raise RemoteConfigError(f"remote store '{kind}': unknown option {unknown[0]!r}; accepted options are "
                                f"{accepted}")


def opt_int(kind: str, name: str, value: object, lo: int, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RemoteConfigError(f"remote store '{kind}': option {name!r} must be an integer {rng}; got {value!r}")
    return value


def opt_str(kind: str, name: str, value: object, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise RemoteConfigError(f"remote store '{kind}': option {name!r} must be a "
                                f"{'' if allow_empty else 'non-empty '}string; got {value!r}")
    if "\x00" in value:  # sockets, paths and URLs refuse it later with a bare ValueError
        raise RemoteConfigError(f"remote store '{kind}': option {name!r} must not contain a NUL byte; got {value!r}")
    return value
