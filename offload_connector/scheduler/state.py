"""What the parts of the scheduler side share: the model's layout, the bound KV cache manager, per-request state and
the counters. Kept apart so that admission, store planning and job bookkeeping depend on these facts and not on the
`OffloadScheduler` facade (admission and store planning hand their jobs to the job book)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from offload_connector.compat import reprefillable_tokens
from offload_connector.groups import GroupInfo, describe_groups, hit_alignment
from offload_connector.keys import BlockKey
from offload_connector.scheduler.lookup import BlockKeys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass(frozen=True)
class Layout:
    """The model's KV cache groups and the token bounds a request is planned to; fixed at start-up."""
    groups: tuple[GroupInfo, ...]
    alignment: int  # every hit is a multiple of it (all groups' block sizes)
    hash_block_size: int
    num_blocks: int  # of vLLM's GPU pool, the null block included
    max_model_len: int
    num_spec_tokens: int
    num_lookahead_tokens: int
    has_full: bool  # some group keeps every block (full attention, MLA)
    has_recycling: bool  # some group frees blocks behind a window or chunk
    reprefillable_tokens: int = 0  # trailing computed tokens whose KV may still change (compat.reprefillable_tokens)
    pipeline_stages: int = 1
    step_tokens: int = 0  # vLLM's token budget per step (`max_num_batched_tokens`); 0: not known
    batches_in_flight: int = 1  # batches vLLM schedules ahead of their outputs (async scheduling, PP)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Layout:
        spec_cfg = getattr(vllm_config, "speculative_config", None)
        num_spec = getattr(spec_cfg, "num_speculative_tokens", 0) or 0 if spec_cfg else 0
        lookahead = getattr(vllm_config, "num_lookahead_tokens", 0) or 0
        groups = tuple(describe_groups(kv_cache_config, _max_in_flight_tokens(vllm_config), lookahead,
                                       _batches_in_flight(vllm_config)))
        return cls(
            groups=groups,
            alignment=hit_alignment(list(groups)),
            hash_block_size=getattr(kv_cache_config, "hash_block_size", None) or _gcd_block(groups),
            num_blocks=kv_cache_config.num_blocks,
            max_model_len=vllm_config.model_config.max_model_len,
            num_spec_tokens=num_spec,
            num_lookahead_tokens=lookahead,
            has_full=any(not g.recycling for g in groups),
            has_recycling=any(g.recycling for g in groups),
            reprefillable_tokens=reprefillable_tokens(vllm_config),
            pipeline_stages=int(getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1)
                                or 1),
            step_tokens=int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", 0) or 0),
            batches_in_flight=_batches_in_flight(vllm_config),
        )

    @property
    def state_behind_drafts(self) -> bool:
        """Whether some Mamba group keeps speculative state blocks (EAGLE/MTP next to recurrent state): a decode step
        with drafts writes a boundary's state into a speculative block, and vLLM copies the accepted one into the
        boundary's block only after sampling, later than the step's stores are issued."""
        return any(g.spec_blocks for g in self.groups)

    @property
    def decode_states_after_sampling(self) -> bool:
        """Whether states past the prompt are stored next to speculative state blocks, by stores issued after vLLM's
        copy (`TransferJob.after_sampling`). vLLM runs `wait_for_save` after sampling when drafts are on (0.32-0.34;
        the V2 runner's `finalize_step`), behind the copy on the compute stream. Under pipeline parallelism each stage
        copies its own layers' states once the last stage's sampled tokens reach it, an order not read here: no
        state past the prompt is stored there."""
        return self.state_behind_drafts and self.pipeline_stages == 1

    def keys(self, request: Request) -> BlockKeys:
        """The tier keys of `request`'s blocks, per group."""
        return BlockKeys(request.block_hashes, self.hash_block_size, self.groups)

    def target_tokens(self, request: Request) -> int:
        """The tokens a request is planned to: its prompt, then one decode step (plus speculative and lookahead
        slots), the least it needs to run at all."""
        return min(request.num_tokens + 1 + self.num_spec_tokens + self.num_lookahead_tokens, self.max_model_len)


@dataclass(frozen=True)
class KVBinding:
    """vLLM's KV cache manager, known only once vLLM binds it (after the connector is built)."""
    managers: tuple[SingleTypeKVCacheManager, ...]  # one single-type manager per group
    pool: BlockPool
    kv_manager: KVCacheManager
    watermark: int


@dataclass(frozen=True)
class OfferedLoad:
    """A load as the lookup found it and the ledger judged it, issued by `start_load` as it is: its blocks are
    computed once, at the lookup."""
    local: int  # tokens vLLM already has (its GPU prefix hit), which the load skips
    hit: int  # tokens restored once it lands: `local` + the load's
    blocks: tuple[tuple[int, int, BlockKey], ...]  # (group, block index, key) of every block it copies


@dataclass
class ReqState:
    request: Request
    full_stored: list[int]  # per group: blocks [0, n) already handed to the tier (or found there)
    window_scanned: int = 0  # boundaries up to here were considered for window stores
    junctions: set[int] = field(default_factory=set)  # shared-prefix ends found at lookup without a window
    window_next: list[int] = field(default_factory=list)  # per group: window blocks below this were handed over
    # per group: window blocks below this were handed over as spare entries (`spare_windows`); absent: 0
    spare_next: dict[int, int] = field(default_factory=dict)
    # (group, column) of Mamba blocks that hold another position's state than their boundary's: a prefill checkpoint
    # block whose checkpoint is not its column's end. Never stored as that boundary's state.
    foreign_states: set[tuple[int, int]] = field(default_factory=set)
    deferred_since: int | None = None
    no_load: bool = False  # gave up loading (aged deferral); recompute instead
    # Its load failed: skip its next lookup once (see `Admission.match`), so that vLLM moves it out of the queue of
    # requests holding blocks, where it no longer belongs and can block every landed load behind it.
    requeue: bool = False
    # Its load failed and vLLM has not scheduled it since: vLLM's gate for async loads still reserves its whole
    # prompt (it stays in `_inflight_prefills`; 0.34: its parked reservation is refreshed at promotion), although it
    # may hold no block. Only scheduling it clears that.
    gated_unscheduled: bool = False
    pending_stores: set[int] = field(default_factory=set)
    finished: bool = False
    offered_hit: int = 0  # the hit (local + external) last offered to vLLM
    offer: OfferedLoad | None = None  # the load offered at this step's lookup, until vLLM starts it
    # The step of an admission vLLM has not started yet (no update_state_after_alloc followed). Still set at the
    # next lookup means vLLM held the load back (0.34's --max-num-inflight-kv-loads, or its own allocation).
    admitted_step: int | None = None
    load_step: int | None = None  # the step its last load was admitted at (kept while the load is in flight)
    # The last load's tokens by the tier that held them ("host", "disk", "shared"), for vLLM's hit-source metrics.
    hit_sources: dict[str, int] = field(default_factory=dict)
    counted_hit: bool = False  # its CPU hit is in counters.cpu_hit_tokens
    # At its first lookup the prompt shared no prefix with the GPU prefix cache or a tier (None: not looked up yet).
    # Its stores say so to the eviction policy (`EvictionPolicy.unshared`).
    unshared: bool | None = None

    def stores_resume_at(self, hit: int, groups: tuple[GroupInfo, ...]) -> None:
        """A load of `hit` tokens was issued: blocks below it are on the GPU once it lands (and were in a tier),
        so store planning starts after them."""
        self.full_stored = [hit // g.block_size if not g.recycling else 0 for g in groups]
        self.window_scanned = hit
        self.window_next = [hit // g.block_size for g in groups]
        self.spare_next = {}

    def restart_windows(self) -> None:
        """Plan every window point from the start again (the blocks of points the tier still holds are skipped)."""
        self.window_next = [0] * len(self.window_next)
        self.spare_next = {}
        self.window_scanned = 0

    def restart_stores(self) -> None:
        """Plan every store from the start again: the full-attention blocks too."""
        self.full_stored = [0] * len(self.full_stored)
        self.restart_windows()


@dataclass
class SchedulerCounters:
    lookups: int = 0
    hits: int = 0
    loads_admitted: int = 0
    loaded_tokens: int = 0
    deferrals: int = 0
    deferral_timeouts: int = 0
    held_for_older: int = 0  # steps a request waited behind an older deferred load (admission_policy "fair")
    held_behind_load: int = 0  # steps a long prefill waited for an older request's load in flight ("fair")
    cpu_hit_tokens: int = 0  # tokens the tier could serve, counted once per request at its first lookup with a hit
    aged_out_tokens: int = 0  # of those, tokens given up after max_deferral_steps and recomputed
    too_big_tokens: int = 0  # of those, tokens recomputed because the request could not fit an idle pool
    too_big: int = 0
    stores: int = 0
    stored_blocks: int = 0
    load_failures: int = 0
    not_started: int = 0  # lookups of a load admitted at the previous one that vLLM did not start (its load cap)


def _gcd_block(groups: tuple[GroupInfo, ...]) -> int:
    return math.gcd(*(g.block_size for g in groups))


def _batches_in_flight(vllm_config: VllmConfig) -> int:
    return int(getattr(vllm_config, "max_concurrent_batches", 1) or 1)


def _max_in_flight_tokens(vllm_config: VllmConfig) -> int:
    value = getattr(vllm_config, "max_in_flight_tokens", None)
    if value is not None:
        return int(value)
    return _batches_in_flight(vllm_config) * vllm_config.scheduler_config.max_num_batched_tokens
