"""A simulated shared tier: an in-process store that several simulated engines share, and the worker-side client
that moves *tags* through it.

The connector's shared tier (offload_connector/scheduler/remote_tier.py, worker/remote_io.py) runs for real: the
scheduler side's `RemoteTierPlanner` plans write-through and lookups and puts one marker per block once every worker
reported its shard; the worker side (`OffloadWorker`) fetches a load's shared-tier blocks into reserved CPU-tier
slots before the GPU copy (`_start_reads`, `land_reads`). Two things are simulated here:

- `SimSharedStore`: a `RemoteStore` (the connector's store interface) whose five raw operations work on a dict
  shared by every client (`SimPool`), like tests/unit/test_shared_tier.py's DictStore. The pool may be bounded
  (`capacity_bytes`): it then evicts least-recently-used values as Redis' `allkeys-lru` does, counting a shard value
  as the block of its group it stands for (the bytes `RemoteTiming` moves) and a marker at its framed length. An
  evicted shard under a live marker is what a real store does too: the load's fetch fails, vLLM recomputes, the
  scheduler removes the markers. Everything above the raw operations is the connector's own code: keys from the
  real fingerprints (the scheduler's marker fingerprint and each worker's shard fingerprint, as
  `open_marker_store` / `WorkerRemoteTier.open` compute them), value framing, CRC and key checks.
  `sim_store_factory(pool)` makes the connector open these instead of Redis or Mooncake while an engine is built
  (it replaces `offload_connector.remote.make_remote_store` for that time only).
- `SimWorkerRemoteTier`: stands in for `worker.remote_io.WorkerRemoteTier` (same methods) in the simulated worker,
  whose CPU tier is a meta-device tensor and whose copier moves tags (`sim.tagcopy.TagCopier`). A put reads the
  tags its CPU-tier slots hold (`TagCopier.host`) and stores each as the block's value (the tag pickled and padded to
  TAG_VALUE_BYTES, framed and checked by `RemoteStore` like real bytes); a fetch gets the values back and writes the
  tags into its reserved slots, so the driver's landing check (every loaded block holds its own tokens' tag) covers
  blocks that came from the shared tier: a block fetched under the wrong key, or into the wrong slot, fails it.

Time model (`RemoteTiming`): like the real worker, which runs every shared-tier call on one background thread, each
worker's puts and fetches run one after another in issue order; one batched call (a `TierWrite`, or one load's
fetch) of B bytes takes `latency_ms` + B / `bandwidth_gbps`, B being the real bytes of its blocks (per group, as the
copies count them). It completes at that simulated time and the worker sees it at the end of the first batch that
ends after it (as `sim.tagcopy`'s ClockTiming does for copies). The value lands in the pool when the put completes,
and a fetch reads the pool when it completes. The scheduler side's marker calls (one batched `exists` per lookup,
`put` of the markers) are instantaneous in simulated time.
"""

from __future__ import annotations

import contextlib
import pickle
import struct
from collections import OrderedDict
from typing import Any, Hashable, Iterator, Sequence

from offload_connector.remote.base import RemoteFingerprint, RemoteStore
from offload_connector.transfer_jobs import SHARED

DEFAULT_SHARED_BANDWIDTH_GBPS = 10.0  # GB/s (1e9 bytes) per worker, puts and fetches together
DEFAULT_SHARED_LATENCY_MS = 0.5  # per batched call (one round trip)
TAG_VALUE_BYTES = 256  # a tag's value: 2-byte length, the pickled tag, zero padding
_LEN = struct.Struct("<H")


class SimPool:
    """The shared store's contents (store key -> framed value), shared by every client of every engine.

    With `capacity_bytes` the pool is bounded like Redis with `maxmemory` and `allkeys-lru`: a put that would
    exceed it first evicts the least recently used values (a put or a successful get is a use; `exists` is not, as
    Redis' EXISTS does not touch a key). Each value counts at the size its client gives (`put(name, value, size)`):
    a worker's shard value stands for one block of its group, so it counts as that block's bytes, not its tag's. A
    value larger than the whole capacity is refused."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int)
                                           or capacity_bytes < 1):
            raise ValueError(f"SimPool: capacity_bytes must be an int >= 1, or None for unbounded (got "
                             f"{capacity_bytes!r})")
        self.capacity_bytes = capacity_bytes
        self.values: OrderedDict[str, bytes] = OrderedDict()  # least recently used first
        self._sizes: dict[str, int] = {}
        self.used_bytes = 0
        self.puts = 0
        self.gets = 0
        self.exists_calls = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.refused = 0  # puts of a value larger than the whole capacity

    def put(self, name: str, value: bytes, size: int) -> bool:
        """Store `value` under `name`, counting `size` bytes; False (nothing changed) if it cannot fit at all."""
        self.puts += 1
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            self.refused += 1
            return False
        self.discard(name)  # an overwrite frees the old value's bytes; that is not an eviction
        if self.capacity_bytes is not None:
            while self.used_bytes + size > self.capacity_bytes:
                self._evict_oldest()
        self.values[name] = value
        self._sizes[name] = size
        self.used_bytes += size
        return True

    def get(self, name: str) -> bytes | None:
        self.gets += 1
        value = self.values.get(name)
        if value is not None:
            self.values.move_to_end(name)
        return value

    def contains(self, name: str) -> bool:
        return name in self.values

    def discard(self, name: str) -> None:
        if self.values.pop(name, None) is not None:
            self.used_bytes -= self._sizes.pop(name)

    def _evict_oldest(self) -> None:
        name, _ = self.values.popitem(last=False)
        size = self._sizes.pop(name)
        self.used_bytes -= size
        self.evictions += 1
        self.evicted_bytes += size


class SimSharedStore(RemoteStore):
    """One client of the simulated shared store: a `RemoteStore` over `pool` under `fingerprint`.

    A value counts in the pool at its framed length (the scheduler's markers), unless the client was told what its
    values stand for (`count_values_as`, which `SimWorkerRemoteTier` does): a worker's shard value is a tag standing
    for one block of its group."""

    kind = "sim"

    def __init__(self, fingerprint: RemoteFingerprint, pool: SimPool, namespace: str = "oc",
                 block_bytes: Sequence[int] | None = None) -> None:
        super().__init__(fingerprint, namespace)
        self.pool = pool
        self.block_bytes: tuple[int, ...] | None = None
        if block_bytes is not None:
            self.count_values_as(block_bytes)

    def count_values_as(self, block_bytes: Sequence[int]) -> None:
        """Count each value put from now on as one block of its group: `block_bytes[group]` bytes."""
        self.block_bytes = tuple(int(b) for b in block_bytes)

    def _size(self, name: str, value: bytes) -> int:
        if self.block_bytes is None:
            return len(value)
        # A key is `RemoteKey.prefix` + "<group>/<block hash>"; self.keys follows set_epoch, as the names do.
        group = int(name[len(self.keys.prefix):].partition("/")[0])
        return self.block_bytes[group]

    def _put_raw(self, names: list[str], values: list[bytes]) -> list[bool]:
        return [self.pool.put(n, bytes(v), self._size(n, v)) for n, v in zip(names, values)]

    def _get_raw(self, names: list[str]) -> list[Any]:
        return [self.pool.get(n) for n in names]

    def _exists_raw(self, names: list[str]) -> list[bool]:
        self.pool.exists_calls += 1
        return [self.pool.contains(n) for n in names]

    def _remove_raw(self, names: list[str]) -> None:
        for n in names:
            self.pool.discard(n)

    def _close_raw(self) -> None:
        pass


@contextlib.contextmanager
def sim_store_factory(pool: SimPool) -> Iterator[None]:
    """While an engine is built: the connector's `make_remote_store` (which both `open_marker_store` and
    `WorkerRemoteTier.open` import at call time) opens a `SimSharedStore` over `pool` under the fingerprint the
    connector computed, whatever `remote_store` kind its config names."""
    import offload_connector.remote as remote

    real = remote.make_remote_store

    def make(kind: str, **opts: Any) -> RemoteStore:
        fingerprint = opts.pop("fingerprint")
        return SimSharedStore(fingerprint, pool, opts.pop("namespace", "oc"))

    remote.make_remote_store = make  # type: ignore[assignment]
    try:
        yield
    finally:
        remote.make_remote_store = real  # type: ignore[assignment]


# ------------------------------------------------------------------------------------------------ time model
class RemoteTiming:
    """One worker's shared-tier calls on one queue (the real client's single background thread): each takes
    `latency_ms` + bytes / `bandwidth_gbps`, starting when issued (the start of the batch whose metadata carries
    it, or, for a fetch, when the worker issues it) or when the previous call ends."""

    def __init__(self, clock: Any, group_bytes: Sequence[int], bandwidth_gbps: float = DEFAULT_SHARED_BANDWIDTH_GBPS,
                 latency_ms: float = DEFAULT_SHARED_LATENCY_MS) -> None:
        if not bandwidth_gbps > 0 or not latency_ms >= 0:
            raise ValueError(f"shared tier time model: bandwidth_gbps must be > 0 and latency_ms >= 0 (got "
                             f"{bandwidth_gbps!r}, {latency_ms!r})")
        self.clock = clock
        self.group_bytes = list(group_bytes)
        self.bandwidth_gbps = bandwidth_gbps
        self.latency_ms = latency_ms
        self._free = 0.0
        self.put_bytes = 0
        self.fetch_bytes = 0
        self.busy_seconds = 0.0

    def nbytes(self, keys: Sequence[tuple[int, Hashable]]) -> int:
        return sum(self.group_bytes[int(g)] for g, _ in keys)

    def schedule(self, nbytes: int, is_put: bool) -> float:
        start = max(self.clock.batch_start, self._free)
        took = self.latency_ms * 1e-3 + nbytes / (self.bandwidth_gbps * 1e9)
        self._free = start + took
        self.busy_seconds += took
        if is_put:
            self.put_bytes += nbytes
        else:
            self.fetch_bytes += nbytes
        return self._free

    def now(self) -> float:
        # As ClockTiming: what finished by the end of the batch whose output is applied next.
        return self.clock.peek_applied_batch_end()


# ------------------------------------------------------------------------------------------------ tag values
def encode_tag(tag: Hashable) -> bytes:
    raw = pickle.dumps(tag, protocol=4)
    if len(raw) + _LEN.size > TAG_VALUE_BYTES:
        raise ValueError(f"a tag of {len(raw)} bytes does not fit a {TAG_VALUE_BYTES}-byte value")
    return (_LEN.pack(len(raw)) + raw).ljust(TAG_VALUE_BYTES, b"\0")


def decode_tag(value: bytes | bytearray | memoryview) -> Hashable:
    mv = memoryview(value)
    (n,) = _LEN.unpack_from(mv)
    return pickle.loads(bytes(mv[_LEN.size:_LEN.size + n]))


# ------------------------------------------------------------------------------------------------ worker side
class _Call:
    """A completion handle as `worker.remote_io.FetchIO` (`done()`, then `ok` and `error`); the call's effect (the
    put into the pool, or the fetch into the CPU tier's tags) happens when the simulation reaches its due time."""

    def __init__(self, tier: "SimWorkerRemoteTier", due: float, run: Any) -> None:
        self._tier = tier
        self.due = due
        self._run = run
        self._result: tuple[bool, str | None] | None = None

    def done(self) -> bool:
        if self._result is None and self._tier.timing.now() >= self.due:
            self._result = self._run()
        return self._result is not None

    @property
    def ok(self) -> bool:
        assert self._result is not None
        return self._result[0]

    @property
    def error(self) -> str | None:
        assert self._result is not None
        return self._result[1]


class SimWorkerRemoteTier:
    """`WorkerRemoteTier`'s methods over a tag-moving CPU tier (`copier.host`: slot -> tag). `store` is the client
    the connector opened (a `SimSharedStore` under this worker's shard fingerprint)."""

    name = SHARED

    def __init__(self, store: RemoteStore, copier: Any, timing: RemoteTiming, full_groups: Sequence[int] = (),
                 block_sizes: Sequence[int] = ()) -> None:
        self.store = store
        if isinstance(store, SimSharedStore):  # a bounded pool must count a tag as the block it stands for
            store.count_values_as(timing.group_bytes)
        self.copier = copier
        self.timing = timing
        self._writes: dict[int, _Call] = {}
        self._epoch = 0
        self._seen = (0, 0, 0)
        # Tokens whose KV came from the shared tier (fetches that landed): the full-attention groups' blocks.
        self._full_groups = tuple(full_groups)
        self._block_sizes = list(block_sizes)
        self.fetched_tokens = 0
        self.fetched_blocks = 0
        self.fetches = 0
        self.fetch_failures = 0
        self.puts = 0
        self.put_blocks = 0
        self.put_tag_mismatches = 0  # a slot written under a key whose tag it does not hold (must stay 0)

    def apply(self, step: Any) -> None:
        from offload_connector.worker.remote_io import follow_epoch
        self._epoch = follow_epoch(self.store, self._epoch, step)
        for write in step.writes:
            keys, slots = list(write.keys), list(write.host_slots)
            tags = [self.copier.host.get(s) for s in slots]  # the slots are pinned until every worker reported
            self.put_tag_mismatches += sum(1 for k, t in zip(keys, tags) if t != k)
            due = self.timing.schedule(self.timing.nbytes(keys), is_put=True)
            self._writes[write.job_id] = _Call(self, due, lambda keys=keys, tags=tags: self._put(keys, tags))

    def _put(self, keys: list[Any], tags: list[Hashable]) -> tuple[bool, str | None]:
        ok = all(self.store.put(keys, [encode_tag(t) for t in tags]))
        self.puts += 1
        self.put_blocks += len(keys)
        return ok, None if ok else "shared tier: put refused"

    def read_back(self, read: Any) -> list[_Call]:
        keys, slots = list(read.keys), list(read.slots)
        due = self.timing.schedule(self.timing.nbytes(keys), is_put=False)
        return [_Call(self, due, lambda: self._get(keys, slots))]

    def _get(self, keys: list[Any], slots: list[int]) -> tuple[bool, str | None]:
        outs = [bytearray(TAG_VALUE_BYTES) for _ in keys]
        got = self.store.get(keys, outs)
        self.fetches += 1
        missing = [k for k, ok in zip(keys, got) if not ok]
        if missing:
            self.fetch_failures += 1
            return False, f"shared tier: {len(missing)} of {len(got)} blocks missing or rejected (first {missing[0]!r})"
        for slot, out in zip(slots, outs):
            self.copier.host[slot] = decode_tag(out)
        self.fetched_blocks += len(keys)
        if self._full_groups:
            self.fetched_tokens += max(sum(1 for g, _ in keys if g == fg) * self._block_sizes[fg]
                                       for fg in self._full_groups)
        elif self._block_sizes:
            self.fetched_tokens += max(sum(1 for g, _ in keys if g == i) * bs for i, bs in enumerate(self._block_sizes))
        return True, None

    def finished_writes(self) -> tuple[list[int], list[int]]:
        done, failed = [], []
        for job_id, call in list(self._writes.items()):
            if call.done():
                del self._writes[job_id]
                (done if call.ok else failed).append(job_id)
        return done, failed

    def io_deltas(self) -> tuple[int, int, int]:
        from offload_connector.worker.remote_io import io_deltas
        delta, self._seen = io_deltas(self.store, self._seen)
        return delta

    def rejected(self) -> dict[str, int]:
        return self.store.stats().rejected

    def pending(self) -> int:
        return len(self._writes)

    def close(self) -> None:
        self.store.close()


def attach_sim_remote(driver: Any, timing: RemoteTiming) -> SimWorkerRemoteTier:
    """Replace the simulated worker's shared-tier client (a real `WorkerRemoteTier` over a `SimSharedStore`, opened
    by `register_kv_caches` under `sim_store_factory`) with a `SimWorkerRemoteTier` over the same store client."""
    worker = driver.worker
    real = worker.second_tiers.get(SHARED)
    if real is None:
        raise AssertionError("the simulated worker has no shared tier: build the engine with remote_store set, under "
                             "sim_store_factory")
    store = real.store
    pool = getattr(real, "_pool", None)
    if pool is not None:
        pool.shutdown(wait=False)  # nothing was submitted to it
    side = driver.side
    full = [g.index for g in side.groups if not g.recycling]
    sim = SimWorkerRemoteTier(store, driver.engine, timing, full, [g.block_size for g in side.groups])
    worker.second_tiers[SHARED] = sim
    return sim
