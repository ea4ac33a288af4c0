"""The connector's view of vLLM's KV cache groups: what each kind keeps, skips and can restore.

Only plain numbers leave this module, so the scheduler side and tests can reason about groups without touching
vLLM's managers. vLLM's own skip rule is checked against ours when the manager is bound (`check_against_manager`),
so a vLLM change to it is refused at start-up instead of silently breaking admission.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec


class GroupKind(str, Enum):
    FULL = "full_attention"
    MLA = "mla"
    SLIDING = "sliding_window"
    SLIDING_MLA = "sliding_window_mla"
    CHUNKED = "chunked_local"
    MAMBA = "mamba"  # recurrent state (Mamba-2, gated DeltaNet), vLLM's `mamba_cache_mode: "align"` only


# Exact class names: several vLLM specs subclass FullAttentionSpec but free blocks differently (RSWA, circular
# buffers, HiSparse), so isinstance() would misclassify them.
_KIND_BY_SPEC = {
    "FullAttentionSpec": GroupKind.FULL,
    "SinkFullAttentionSpec": GroupKind.FULL,
    "MLAAttentionSpec": GroupKind.MLA,
    "SlidingWindowSpec": GroupKind.SLIDING,
    "SlidingWindowMLASpec": GroupKind.SLIDING_MLA,
    "ChunkedLocalAttentionSpec": GroupKind.CHUNKED,
    "MambaSpec": GroupKind.MAMBA,
}
_MANAGER_BY_KIND = {
    GroupKind.FULL: ("FullAttentionManager", "SinkFullAttentionManager"),
    GroupKind.MLA: ("FullAttentionManager",),
    GroupKind.SLIDING: ("SlidingWindowManager",),
    GroupKind.SLIDING_MLA: ("SlidingWindowManager",),
    GroupKind.CHUNKED: ("ChunkedLocalAttentionManager",),
    GroupKind.MAMBA: ("MambaManager",),
}


class UnsupportedLayoutError(ValueError):
    """The model's KV cache layout has a group kind this connector cannot offload."""


@dataclass(frozen=True)
class GroupInfo:
    index: int
    kind: GroupKind
    block_size: int  # tokens per block
    block_bytes: int  # bytes of one block of this group across all its layers
    num_layers: int
    sliding_window: int = 0
    extra_retained_tokens: int = 0
    chunk_size: int = 0
    # The most real blocks a request can hold at once in a recycling group (None for full attention), from
    # `live_ceiling`. Not vLLM's `max_admission_blocks_per_request`, which leaves out lookahead slots and assumes the
    # window starts anywhere in a block even where a chunk boundary cannot.
    live_ceiling: int | None = None
    # Speculative state blocks vLLM keeps at the end of a Mamba group's block table (`MambaSpec.num_speculative_blocks`,
    # the draft count under EAGLE/MTP): taken with the request's first allocation, a load's included, and moved
    # along the table after that, never multiplied by the batches in flight.
    spec_blocks: int = 0

    @property
    def recycling(self) -> bool:
        """Whether blocks leave the request as its window moves (sliding window, chunked local, Mamba state)."""
        return self.kind in (GroupKind.SLIDING, GroupKind.SLIDING_MLA, GroupKind.CHUNKED, GroupKind.MAMBA)

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens no longer attended once `num_computed` tokens are computed (vLLM's `get_num_skipped_tokens`)."""
        if self.kind in (GroupKind.SLIDING, GroupKind.SLIDING_MLA):
            return max(0, num_computed - self.sliding_window + 1 - self.extra_retained_tokens)
        if self.kind is GroupKind.CHUNKED:
            return (num_computed // self.chunk_size) * self.chunk_size
        if self.kind is GroupKind.MAMBA:
            # Only the state after the last token is needed; vLLM's `n - 1` is -1 at 0, which skips nothing either.
            return max(num_computed - 1, 0)
        return 0

    def first_live_block(self, num_computed: int) -> int:
        return self.skipped_tokens(num_computed) // self.block_size

    def restore_range(self, num_tokens: int) -> range:
        """Block indices a request resuming after `num_tokens` tokens must hold for this group.

        For a Mamba group in align mode that is one block, index `n / b - 1`: vLLM keeps the state after exactly
        `(i + 1) * b` tokens in block `i` once a chunk has ended there (chunks end on block boundaries)."""
        return range(self.first_live_block(num_tokens), num_tokens // self.block_size)


def mamba_state_bytes(spec: object) -> int | None:
    """Bytes of a Mamba/linear-attention layer's states in one block (None for attention): what the tier holds and
    the worker copies per layer.

    vLLM registers such a layer as one raw `[blocks, 1, 1, page]` view whose page is padded to the attention page;
    the layer's states (conv, SSM; 0.34 rounds each to `state_alignment`) are packed from byte 0."""
    if type(spec).__name__ != "MambaSpec":
        return None
    return int(spec.real_page_size_bytes)


def group_block_bytes(group: KVCacheGroupSpec, kv_cache_config: KVCacheConfig) -> int:
    """Bytes one block of a KV cache group holds over all its layers (an upper bound where vLLM packs layers).

    A packed group (`UniformTypeKVCacheSpecs`, DeepSeek V4, as the worker sees it) reports its whole block as one
    page; a plain group's page is per layer. The scheduler sees packed groups through one representative per-layer
    spec, whose page times the layer count overstates the block (DeepSeek-V4-Flash: 2,321,280 B against a
    1,002,240 B block id), so the count is capped by the bytes one block id spans in vLLM's allocation.
    """
    spec = group.kv_cache_spec
    if type(spec).__name__ == "UniformTypeKVCacheSpecs":
        return spec.page_size_bytes
    page = mamba_state_bytes(spec) or spec.page_size_bytes  # a Mamba block copies its states, not the padded page
    nbytes = page * len(group.layer_names)
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or []
    num_blocks = getattr(kv_cache_config, "num_blocks", 0) or 0
    if tensors and num_blocks:
        nbytes = min(nbytes, max(t.size // num_blocks for t in tensors))
    return nbytes


def tier_slots(cpu_bytes: int, kv_cache_config: KVCacheConfig) -> tuple[int, int]:
    """(slots, bytes per slot) of the CPU tier. Slots are uniform pages of the largest group block, so a slot id means
    the same bytes to the scheduler side (which hands slot ids out) and to every worker (which copies into them);
    both sides size the tier with this one function."""
    slot_bytes = max(group_block_bytes(group, kv_cache_config) for group in kv_cache_config.kv_cache_groups)
    slots = cpu_bytes // slot_bytes
    if slots < 1:
        raise ValueError(f"kv_connector_extra_config: 'cpu_bytes' ({cpu_bytes}) is smaller than one host block "
                         f"({slot_bytes} bytes for this model); give the CPU tier at least that much")
    return slots, slot_bytes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def live_ceiling(kind: GroupKind, block_size: int, extent: int, extra_retained_tokens: int,
                 max_in_flight_tokens: int, lookahead_tokens: int, batches_in_flight: int = 1,
                 checkpoint_blocks: int = 0, spec_blocks: int = 0) -> int | None:
    """The most real blocks one request can hold at once in a recycling group; None for full attention.

    vLLM frees out-of-window blocks on the processed-token basis (`remove_skipped_blocks` at computed minus
    in-flight tokens `p`) and then allocates through computed + new + lookahead, where computed + new - p is at most
    the tokens of every batch in flight. So a request holds the positions from `skipped(p)` through `p` + in-flight +
    lookahead: `span` tokens after the first kept position, which sits `r` tokens into its block. The block count is
    `cdiv(r + span, b)`, largest for the largest reachable `r`: any offset (b - 1) for a sliding window, whose start
    moves one token at a time; only multiples of gcd(chunk, b) (at most b - gcd) for chunked local attention, whose
    start is a multiple of the chunk.

    A Mamba group (align mode) holds the state block the oldest batch in flight started from, plus, for every batch
    in flight, the block its chunk ends in and its prefill checkpoint block if the layer exports one
    (`checkpoint_blocks`): vLLM allocates nothing for the positions a chunk passes over (they stay null). That is
    never more than the blocks a 2-token window would span over the same tokens. Align mode allocates for the
    scheduled tokens only (drafts included, lookahead slots not), and under speculative decoding keeps `spec_blocks`
    more at the end of the table.
    """
    if kind is GroupKind.MAMBA:
        window_like = cdiv(block_size + max_in_flight_tokens, block_size)
        return min(window_like, 1 + max(batches_in_flight, 1) * (1 + checkpoint_blocks)) + spec_blocks
    if kind in (GroupKind.SLIDING, GroupKind.SLIDING_MLA):
        span = extent - 1 + extra_retained_tokens + max_in_flight_tokens + lookahead_tokens
        return cdiv(block_size - 1 + span, block_size)
    if kind is GroupKind.CHUNKED:
        span = extent - 1 + max_in_flight_tokens + lookahead_tokens
        return cdiv(block_size - math.gcd(extent, block_size) + span, block_size)
    return None


def describe_groups(kv_cache_config: KVCacheConfig, max_in_flight_tokens: int, lookahead_tokens: int = 0,
                    batches_in_flight: int = 1) -> list[GroupInfo]:
    """Read the scheduler-side `KVCacheConfig` into `GroupInfo`s; refuse layouts we cannot offload.

    `max_in_flight_tokens`: tokens scheduled but not yet processed, over every batch in flight (vLLM's
    `VllmConfig.max_in_flight_tokens`); `lookahead_tokens`: KV slots allocated past the scheduled tokens (draft
    model / EAGLE); `batches_in_flight`: vLLM's `max_concurrent_batches`."""
    groups: list[GroupInfo] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        kind = _KIND_BY_SPEC.get(name)
        if kind is None:
            raise UnsupportedLayoutError(
                f"KV cache group {index} uses {name}, which offload_connector does not support (supported: "
                f"{sorted(_KIND_BY_SPEC)}). Cross-attention and sparse-retention groups keep state that cannot be "
                f"restored from prefix blocks.")
        checkpoint_blocks = spec_blocks = 0
        if kind is GroupKind.MAMBA:
            checkpoint_blocks = _mamba_checkpoint_blocks(index, spec)
            spec_blocks = int(getattr(spec, "num_speculative_blocks", 0) or 0)
        window = getattr(spec, "sliding_window", None) or 0
        extra = getattr(spec, "extra_retained_tokens", 0) or 0
        chunk = getattr(spec, "attention_chunk_size", None) or 0
        groups.append(GroupInfo(
            index=index,
            kind=kind,
            block_size=spec.block_size,
            block_bytes=group_block_bytes(group, kv_cache_config),
            num_layers=len(group.layer_names),
            sliding_window=window,
            extra_retained_tokens=extra,
            chunk_size=chunk,
            live_ceiling=live_ceiling(kind, spec.block_size, chunk if kind is GroupKind.CHUNKED else window, extra,
                                      max_in_flight_tokens, lookahead_tokens, batches_in_flight, checkpoint_blocks,
                                      spec_blocks),
            spec_blocks=spec_blocks,
        ))
    if not groups:
        raise UnsupportedLayoutError("the model has no KV cache groups; there is nothing to offload")
    return groups


def _mamba_checkpoint_blocks(index: int, spec: object) -> int:
    """Checks a Mamba group is one the connector can restore; returns its prefill checkpoint blocks per chunk.

    Only vLLM's align mode keeps a state per block boundary (`mamba_cache_mode: "none"` keeps one state per request
    and gives no request a block hash)."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise UnsupportedLayoutError(
            f"KV cache group {index} (MambaSpec) keeps Mamba/linear-attention state with mamba_cache_mode '{mode}'; "
            f"offload_connector restores such state only in 'align' mode (vLLM selects it with "
            f"--enable-prefix-caching)")
    return 1 if getattr(spec, "num_prefill_checkpoint_blocks", 0) else 0


def hit_alignment(groups: Sequence[GroupInfo]) -> int:
    """Hits must end on a block boundary of every group."""
    return math.lcm(*(g.block_size for g in groups))


def check_against_manager(groups: Sequence[GroupInfo], managers: Sequence[SingleTypeKVCacheManager]) -> None:
    """Refuse to run if vLLM's managers disagree with our model of a group (a vLLM change we have not seen)."""
    if len(groups) != len(managers):
        raise UnsupportedLayoutError(
            f"the scheduler has {len(managers)} KV cache groups but the connector was built for {len(groups)}")
    for g, manager in zip(groups, managers):
        mname = type(manager).__name__
        if mname not in _MANAGER_BY_KIND[g.kind]:
            raise UnsupportedLayoutError(
                f"KV cache group {g.index} ({g.kind.value}) is managed by {mname}; expected one of "
                f"{list(_MANAGER_BY_KIND[g.kind])}")
        if manager.block_size != g.block_size:
            raise UnsupportedLayoutError(
                f"KV cache group {g.index}: manager block size {manager.block_size} != spec {g.block_size} "
                f"(decode context parallelism is not supported)")
        for n in (0, 1, g.block_size, 1000, 4097, 65536, 1_000_003):
            if max(manager.get_num_skipped_tokens(n), 0) != g.skipped_tokens(n):
                raise UnsupportedLayoutError(
                    f"KV cache group {g.index}: vLLM skips {manager.get_num_skipped_tokens(n)} tokens at {n}, the "
                    f"connector expects {g.skipped_tokens(n)}")
