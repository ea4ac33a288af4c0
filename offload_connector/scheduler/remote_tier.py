"""The shared tier, scheduler side: which blocks the engines sharing a store can read back, and what to write there.

Every worker writes its own shard of a block (its TP rank's heads, its PP stage's layers) under its own fingerprint
(`worker/remote_io.py`). A block is readable only once every worker of the engine that wrote it has written its
shard: the scheduler then puts one small *marker* per block, under a fingerprint every engine with the same model
and parallel layout computes alike, and lookups (of any engine) check markers only. A write that failed on one
worker never gets a marker, so no engine reads a block only some shards of which are there.

The store evicts on its own (Redis `maxmemory-policy`, Mooncake's eviction): a marker may outlive a shard. Such a
read fails; the load fails like any failed load (vLLM recomputes) and the scheduler removes the marker.

Lookups query the store (two batched `exists`, `ready_fn`) for the blocks no local tier holds, at most once every
`PRESENT_TTL_STEPS` steps per request; a marker seen present may be gone by the time the load reads it, which is
the failure above, never wrong bytes (every value is framed and checked).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from offload_connector.log import get_logger
from offload_connector.transfer_jobs import SHARED, TierStep
from offload_connector.remote.metrics import METRICS
from offload_connector.scheduler.lookup import full_prefix_tokens
from offload_connector.scheduler.write_through import WriteThrough, max_writing_blocks
from offload_connector.scheduler.tier_index import TierIndex
from offload_connector.keys import BlockKey

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from offload_connector.config import OffloadConfig
    from offload_connector.groups import GroupInfo
    from offload_connector.metrics import OffloadStatsSink
    from offload_connector.remote import RemoteStore
    from offload_connector.scheduler.lookup import BlockKeys
    from offload_connector.scheduler.second_tier import PlannerContext

logger = get_logger(__name__)

Key = BlockKey
PRESENT_TTL_STEPS = 50
# Blocks this engine knows it wrote (not written again while remembered); a bound on the scheduler's memory.
KNOWN_WRITTEN = 1 << 20
WINDOW_SPAN = 4  # windows (or chunks) of recycling-group blocks a lookup queries below the top of a hit
MARKER_TIMEOUT_S = 2.0


@dataclass
class RemoteCounters:
    writes_issued: int = 0  # blocks handed to the workers to write
    writes_landed: int = 0  # blocks every worker wrote (marker put)
    write_failures: int = 0  # blocks some worker failed to write (no marker)
    write_skips: int = 0  # blocks not written: too many writes in flight
    lookups: int = 0  # batched existence queries
    fetched_blocks: int = 0  # blocks read back into the CPU tier for loads that landed
    fetch_failures: int = 0  # loads whose shared-tier reads failed (their markers are removed)


@dataclass
class Fetch:
    """What a load reads from the shared tier (also CPU-tier entries being filled)."""
    keys: list[Key] = field(default_factory=list)


class RemoteTierPlanner:
    name = SHARED
    local = False

    def __init__(self, markers: RemoteStore, tier: TierIndex, reporters: int, max_writing: int,
                 kind: str = "") -> None:
        self.kind = kind  # the store's kind ("redis", "mooncake"), for the start-up log line
        self.markers = markers  # a RemoteStore under the engine-independent marker fingerprint
        self.epoch = 0  # cache resets so far: the shared tier's keys live in a namespace per epoch
        self.tier = tier
        self.counters = RemoteCounters()
        self.writes = WriteThrough(tier, reporters, max_writing)
        self._written: OrderedDict[Key, None] = OrderedDict()
        self._present: dict[str, dict[str, tuple[int, frozenset]]] = {}  # request -> part -> (step, keys present)

    # ----------------------------------------------------------------- lookup
    def present(self, request_id: str, keys: Iterable[Key], step: int, part: str = "") -> frozenset:
        """The keys among `keys` whose every shard is in the store, cached per request and `part` (a request's
        several queries) for PRESENT_TTL_STEPS steps."""
        answers = self._present.setdefault(request_id, {})
        cached = answers.get(part)
        if cached is not None and step - cached[0] < PRESENT_TTL_STEPS:
            return cached[1]
        ask = [k for k in keys if not self.tier.has(k)]
        found: frozenset = frozenset()
        if ask:
            self.counters.lookups += 1
            found = frozenset(k for k, ok in zip(ask, self.markers.readable(ask)) if ok)
        answers[part] = (step, found)
        return found

    def ready_fn(self, request_id: str, keys: BlockKeys, groups: Sequence[GroupInfo], alignment: int, spacing: int,
                 available: Callable[[Key], bool], upper: int, step: int) -> Callable[[Key], bool]:
        """`available` (this host's tiers) plus the blocks the shared tier holds, for a lookup up to `upper` tokens.

        Two batched queries, not one per block of every group: the full-attention blocks this host lacks up to
        `upper`; then, below the longest full-attention prefix that gives, the window blocks of the last
        `WINDOW_SPAN` windows (prompt ends and junctions near it) and the window at every checkpoint
        (`windows.store_points` with the same `spacing`: every engine stores those). Window blocks elsewhere count
        as absent: a shorter hit, never a wrong one."""
        upper = min(upper, keys.hashed_tokens())
        full = [keys(g.index, i) for g in groups if not g.recycling for i in range(upper // g.block_size)]
        found = self.present(request_id, [k for k in full if not available(k)], step, "full")
        top = full_prefix_tokens(groups, keys, lambda k: available(k) or k in found, upper)
        step_ = max(spacing - spacing % alignment, alignment) if spacing > 0 else 0
        checkpoints = range(step_, top + 1, step_) if step_ else range(0)
        windows: set[Key] = set()
        for g in groups:
            if g.recycling:
                span = WINDOW_SPAN * max(g.sliding_window or g.chunk_size or g.block_size, g.block_size)
                windows.update(keys(g.index, i) for i in range(g.first_live_block(max(0, top - span)),
                                                               top // g.block_size))
                windows.update(keys(g.index, i) for point in checkpoints for i in g.restore_range(point))
        found = found | self.present(request_id, [k for k in windows if not available(k)], step, "windows")
        if not found:
            return available
        return lambda key: available(key) or key in found

    def extend_ready(self, ready: Callable[[Key], bool], request_id: str, keys: BlockKeys,
                     groups: Sequence[GroupInfo], alignment: int, spacing: int, upper: int,
                     step: int) -> Callable[[Key], bool]:
        return self.ready_fn(request_id, keys, groups, alignment, spacing, ready, upper, step)

    def can_read(self, key: Key) -> bool:
        """Every block the nearer tiers lack: the lookup found it here (one gone since fails the load's fetch)."""
        return True

    def start_read(self, request_id: str, keys: list[Key]) -> tuple[Callable[..., None], Fetch]:
        self.forget(request_id)
        return self.fetch_finished, Fetch(list(keys))

    def describe(self) -> str:
        return self.kind

    def forget(self, request_id: str) -> None:
        """Drop `request_id`'s cached answers (its load was issued, or it finished)."""
        self._present.pop(request_id, None)

    def fetch_finished(self, fetch: Fetch, ok: bool, retired: bool = False) -> None:
        if retired:
            return
        if ok:
            self.counters.fetched_blocks += len(fetch.keys)
            return
        # Some shard was gone or bad on some worker: no engine should try these markers again.
        self.counters.fetch_failures += 1
        self.markers.remove(fetch.keys)
        for key in fetch.keys:
            self._written.pop(key, None)

    # ----------------------------------------------------------------- writes
    def stored(self, keys: Sequence[Key], job_id: int) -> None:
        """`keys` just became readable CPU-tier entries: write the ones this engine has not written."""
        chosen: list[Key] = []
        for key in keys:
            if key in self._written:
                self._written.move_to_end(key)
                continue
            if not self.writes.has_room(len(chosen)):
                self.counters.write_skips += 1
                continue
            chosen.append(key)
        if not chosen:
            return
        self.writes.issue(job_id, chosen)
        self.counters.writes_issued += len(chosen)

    def write_finished(self, job_id: int, ok: bool) -> None:
        """One worker reported shared-tier write `job_id`: once every worker wrote its shard, the markers go in."""
        keys = self.writes.report(job_id, ok)
        if keys is None:
            return
        if not ok:
            self.counters.write_failures += len(keys)
            return
        landed = self.markers.put(list(keys), [b"\x01"] * len(keys))
        for key, good in zip(keys, landed):
            if good:
                self._written[key] = None
        while len(self._written) > KNOWN_WRITTEN:
            self._written.popitem(last=False)
        self.counters.writes_landed += sum(landed)
        self.counters.write_failures += len(landed) - sum(landed)

    # ------------------------------------------------------------------ reset
    def clear(self) -> None:
        """A cache reset: this engine stops serving from the shared tier what it saw before. The pool is other
        engines' too and is not emptied: this engine moves to a new namespace epoch (markers and shards), so it
        neither reads what was written before the reset nor mixes with it. Call before `TierIndex.clear()`; see
        `after_tier_clear`."""
        self.writes.clear()
        self._written.clear()
        self._present.clear()
        self.epoch += 1
        self.markers.set_epoch(self.epoch)

    def after_tier_clear(self) -> None:
        self.writes.after_tier_clear()

    # ------------------------------------------------------------------- step
    def take_step(self) -> TierStep:
        return TierStep(writes=self.writes.take(), epoch=self.epoch)

    def busy(self) -> bool:
        return self.writes.busy()

    def record_stats(self, stats: OffloadStatsSink) -> None:
        r = self.counters
        stats.record_second_tier(METRICS, (r.fetched_blocks, r.write_skips, r.writes_landed))
        stats.record_rejections(METRICS, "markers", self.markers.stats().rejected)


def open_marker_store(config: OffloadConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                      groups: Sequence[GroupInfo]) -> RemoteStore:
    """The scheduler's client of the shared store, under the marker fingerprint: what every engine with the same
    model, KV cache groups and parallel layout computes alike (the workers' shard fingerprints hold their ranks)."""
    import hashlib

    from offload_connector.compat import lookahead_note, vllm_release
    from offload_connector.config import ConfigError
    from offload_connector.remote import RemoteConfigError, RemoteFingerprint, RemoteUnavailable, make_remote_store
    mc = getattr(vllm_config, "model_config", None)
    cc = getattr(vllm_config, "cache_config", None)
    pc = getattr(vllm_config, "parallel_config", None)
    layers = hashlib.sha256(repr([list(g.layer_names) for g in kv_cache_config.kv_cache_groups]).encode())
    fp = RemoteFingerprint(
        model=str(getattr(mc, "model", "") or ""), layout="oc-markers",
        dtype=f"{getattr(cc, 'cache_dtype', 'auto')}/{getattr(mc, 'dtype', '')}",
        group_block_bytes=tuple(1 for _ in groups), block_sizes=tuple(g.block_size for g in groups),
        tp_size=int(getattr(pc, "tensor_parallel_size", 1) or 1), pp_size=int(getattr(pc, "pipeline_parallel_size", 1)
                                                                          or 1),
        extra="; ".join(f"{g.kind.value} {g.sliding_window or g.chunk_size or ''}" for g in groups)
        + f"; layers {layers.hexdigest()[:16]}" + lookahead_note(vllm_config), vllm=vllm_release())
    try:
        options = dict(config.remote_options)
        if config.remote_store == "redis" and "socket_timeout_s" not in options:
            # The scheduler's marker calls run inside the engine step: a hung server costs at most this per call.
            options["socket_timeout_s"] = MARKER_TIMEOUT_S
        from offload_connector.remote.secret import shared_tier_mac_key
        return make_remote_store(config.remote_store, fingerprint=fp, mac_key=shared_tier_mac_key(config),
                                 **options)
    except (RemoteConfigError, RemoteUnavailable) as exc:
        raise ConfigError(f"kv_connector_extra_config: 'remote_options': {exc}") from None


def open_planner(ctx: PlannerContext) -> RemoteTierPlanner | None:
    """The registered scheduler-side factory (`second_tiers.py`): the shared tier's planner when `remote_store` is
    set, over the scheduler's marker client."""
    config = ctx.config
    if config.remote_store is None:
        return None
    markers = open_marker_store(config, ctx.vllm_config, ctx.kv_cache_config, ctx.groups)
    return RemoteTierPlanner(markers, ctx.tier, ctx.reporters, max_writing_blocks(ctx.tier.capacity_slots),
                             kind=config.remote_store)
