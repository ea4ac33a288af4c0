"""KV cache events for the CPU tier, in vLLM's format (`vllm.distributed.kv_events`), medium "CPU".

vLLM publishes them with its own GPU prefix-cache events when `--kv-events-config` enables KV cache events: after
every step `Scheduler.update_from_output` drains the connector's `take_events()` into the same `KVEventBatch` as
the GPU block pool's events and hands it to the configured publisher (ZMQ). vLLM's own `OffloadingConnector` does the
same through its scheduler side. What the tier announces:

* `BlockStored(medium="CPU")` when a store job's blocks become readable in the tier (the copy finished on every
  worker), one event per run of consecutive blocks of one KV cache group, shaped like the GPU pool's events:
  `block_hashes` (the group's block hashes, vLLM's chained prefix hashes), `parent_block_hash` (the group's block
  before the run, None at the prompt's start), the run's `token_ids`, the group's `block_size`, `group_idx`, the
  group's `kv_cache_spec_kind` / `kv_cache_spec_sliding_window`, LoRA, `extra_keys` and `session_id` as vLLM's pool
  sets them. Sliding-window groups store windows, not every block, so their runs start anywhere in the prompt;
* `BlockRemoved(medium="CPU", group_idx=g)` when readable entries leave the tier: LRU eviction, a failed load's
  entries dropped, and every entry at a cache reset (`reset_cache`). A store that failed or was overtaken by a reset
  is never announced, so it is never removed either.

No `AllBlocksCleared` is sent for a reset: that event has no medium, and a consumer would drop the GPU prefix cache's
blocks too (vLLM sends its own `AllBlocksCleared` when the GPU cache is reset; with `reset_external=true` the GPU reset
can fail while ours happens). A reset announces the tier's blocks one by one instead.

Hashes are converted as the GPU pool converts them (`maybe_convert_block_hash`: bytes, or 64-bit ints with
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`). Nothing is recorded unless KV cache events are enabled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from offload_connector.groups import GroupInfo
from offload_connector.keys import BlockKey

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import BlockStored, KVCacheEvent
    from vllm.v1.core.kv_cache_utils import ExternalBlockHash
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

MEDIUM = "CPU"

Key = BlockKey


def events_enabled(vllm_config: VllmConfig) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


class TierEvents:
    """Pending CPU-tier events, in the order they happened, drained by `take()` once per step."""

    def __init__(self, enabled: bool, groups: Sequence[GroupInfo],
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        self.enabled = enabled
        self.groups = list(groups)
        self._pending: list[BlockStored | list[Any]] = []  # or [group, hashes] for removals coalesced per group
        self._spec: list[tuple[str | None, int | None]] = [(None, None)] * len(self.groups)
        if not enabled:
            return
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )
        self._stored_cls, self._removed_cls = BlockStored, BlockRemoved
        # Takes Any: our keys hold the hash as a Hashable (vLLM's BlockHash bytes in an engine, ints in tests).
        self._convert: Callable[[Any], ExternalBlockHash] = maybe_convert_block_hash
        self._extra_keys, self._to_event_extra_keys = generate_block_hash_extra_keys, to_event_extra_keys
        specs = getattr(kv_cache_config, "kv_cache_groups", None)
        if specs is not None:
            try:
                from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
                self._spec = [(get_kv_cache_spec_kind(g.kv_cache_spec).value,
                               get_kv_cache_spec_sliding_window(g.kv_cache_spec)) for g in specs]
            except (ImportError, AttributeError):  # pragma: no cover - both supported vLLMs have them
                pass

    def __bool__(self) -> bool:
        return bool(self._pending)

    # ------------------------------------------------------------------ stores
    def describe_store(self, request: Request, blocks: Sequence[tuple[int, int]],
                       key_of: Callable[[int, int], Key]) -> list[BlockStored] | None:
        """The `BlockStored` events for a store job of `request`: `blocks` are its (group, block index) pairs.

        Built when the job is planned (the request may be gone when the copy lands) and published by `stored()`."""
        if not self.enabled or not blocks:
            return None
        by_group: dict[int, list[int]] = {}
        for group, index in blocks:
            by_group.setdefault(group, []).append(index)
        lora = getattr(request, "lora_request", None)
        lora_id = getattr(lora, "adapter_id", None) if lora is not None else None
        lora_name = getattr(lora, "name", None) if lora is not None else None
        session_id = getattr(request, "session_id", None)
        tokens = request.all_token_ids
        events = []
        for group in sorted(by_group):
            size = self.groups[group].block_size
            indices = sorted(set(by_group[group]))
            runs: list[list[int]] = []
            for i in indices:
                if runs and runs[-1][-1] + 1 == i:
                    runs[-1].append(i)
                else:
                    runs.append([i])
            kind, window = self._spec[group] if group < len(self._spec) else (None, None)
            for run in runs:
                first, last = run[0], run[-1]
                extra: list[tuple[object, ...] | None] = []
                mm_idx = 0
                for i in run:
                    keys, mm_idx = self._extra_keys(request, i * size, (i + 1) * size, mm_idx)
                    extra.append(keys)
                fields: dict[str, Any] = dict(  # keyword arguments of BlockStored, each of its own type
                    block_hashes=[self._convert(key_of(group, i)[1]) for i in run],
                    parent_block_hash=self._convert(key_of(group, first - 1)[1]) if first > 0 else None,
                    token_ids=list(tokens[first * size:(last + 1) * size]),
                    block_size=size,
                    lora_id=lora_id,
                    medium=MEDIUM,
                    lora_name=lora_name,
                    extra_keys=self._to_event_extra_keys(extra),
                    group_idx=group,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                )
                if session_id is not None:
                    fields["session_id"] = session_id
                events.append(self._stored_cls(**fields))
        return events

    def stored(self, events: list[BlockStored] | None) -> None:
        """A store job's blocks became readable: publish what `describe_store` built for it."""
        if self.enabled and events:
            self._pending.extend(events)

    # ---------------------------------------------------------------- removals
    def removed(self, key: Key) -> None:
        """A readable entry left the tier (the tier's `on_removed`)."""
        if not self.enabled:
            return
        group, block_hash = key
        last = self._pending[-1] if self._pending else None
        if isinstance(last, list) and last[0] == group:
            last[1].append(self._convert(block_hash))
        else:
            self._pending.append([group, [self._convert(block_hash)]])

    # ------------------------------------------------------------------- drain
    def take(self) -> list[KVCacheEvent]:
        """Everything since the last call, oldest first (the connector's `take_events()`)."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        return [self._removed_cls(block_hashes=e[1], medium=MEDIUM, group_idx=e[0]) if isinstance(e, list) else e
                for e in pending]
