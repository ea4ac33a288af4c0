"""The worker's view of vLLM's KV cache: per KV cache group, the byte pages one block id occupies.

vLLM hands `register_kv_caches` one typed tensor per attention layer with the block id in dim 0 (after
`group_kernel_blocks` undoes kernel-block splitting), and one raw byte view per Mamba/linear-attention layer, whose
states fill the start of each block's page (`groups.mamba_state_bytes`). A block's data for one layer is one
contiguous run of `page_bytes` (K and V share it); consecutive blocks are `stride(0)` apart, which exceeds the page
when the layout packs several layers or groups into one block. Layers can alias the same bytes: vLLM lays every
group's i-th layer over the same buffer (a block id belongs to one group at a time), and KV-sharing layers reuse
their target's tensor. So pages are deduplicated per group by (address, stride, size), and each group copies only
its own pages.

The host tier mirrors this block-first: one host slot holds, for the group that owns it, that group's pages back to
back. Slots are as large as the largest group's block, which is what the scheduler side sizes the tier with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from offload_connector.groups import mamba_state_bytes

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


class LayoutError(ValueError):
    """A KV cache tensor the worker cannot view as (num_blocks, page_bytes) pages."""


@dataclass(frozen=True)
class PageRef:
    """One unique page run of one group: bytes [offset, offset + page_bytes) of each block row."""
    group: int
    layers: tuple[str, ...]  # the layers that alias this run (copied once)
    page_bytes: int
    host_offset: int  # where this page sits inside a host slot of this group


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    slot_bytes: int  # host bytes per slot: the largest group's block
    group_bytes: tuple[int, ...]  # bytes one block id holds per group, over that group's unique pages
    pages: tuple[PageRef, ...]
    segments: tuple[tuple[int, ...], ...]  # per group: indices into `pages`


def _byte_view(t: torch.Tensor, num_blocks: int, name: str) -> tuple[torch.Tensor, int]:
    """(num_blocks, page_bytes) uint8 view of a layer's cache with its real row stride, and the page size."""
    if t.dim() >= 1 and t.shape[0] != num_blocks and t.shape[0] % num_blocks == 0:
        # Kernel-block splitting: (num_blocks * ratio, ...) rows, grouped back into manager blocks.
        t = t.unflatten(0, (num_blocks, -1))
    if t.dim() < 2 or t.shape[0] != num_blocks:
        raise LayoutError(f"KV cache of layer {name!r} has {t.shape[0]} rows in dim 0, expected {num_blocks} blocks "
                          f"(shape {tuple(t.shape)}); block-outermost layouts are required")
    elem = t.element_size()
    inner_sizes, inner_strides = t.shape[1:], t.stride()[1:]
    page_elems = 1
    for s in inner_sizes:
        page_elems *= s
    # A page must be one dense run (any dim order): its last element sits page_elems - 1 after its first.
    span = 1 + sum((s - 1) * st for s, st in zip(inner_sizes, inner_strides) if s > 0)
    if span != page_elems or min((st for s, st in zip(inner_sizes, inner_strides) if s > 1), default=1) < 1:
        raise LayoutError(f"KV cache of layer {name!r} (shape {tuple(t.shape)}, stride {t.stride()}) does not keep "
                          "a block's data for the layer in one dense run; this layout is not supported")
    page = page_elems * elem
    row = t.stride(0) * elem
    view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * elem, (num_blocks, page), (row, 1))
    return view, page


def build_layout(kv_caches: Mapping[str, object], kv_cache_config: KVCacheConfig
                 ) -> tuple[KVLayout, list[torch.Tensor]]:
    """Page views for every group's layers, deduplicated; returns the layout and one device view per page."""
    num_blocks = int(kv_cache_config.num_blocks)
    pages: list[PageRef] = []
    views: list[torch.Tensor] = []
    segments: list[tuple[int, ...]] = []
    group_bytes: list[int] = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        seen: dict[tuple[int, int, int], int] = {}
        seg: list[int] = []
        offset = 0
        state_bytes = mamba_state_bytes(group.kv_cache_spec)
        for name in group.layer_names:
            if name not in kv_caches:
                raise LayoutError(f"KV cache group {g} names layer {name!r}, which register_kv_caches did not get")
            cache = kv_caches[name]
            if not isinstance(cache, torch.Tensor):
                raise LayoutError(f"KV cache of layer {name!r} is a {type(cache).__name__}, not one tensor; "
                                  "split K/V caches are not supported")
            view, page = _byte_view(cache, num_blocks, name)
            if state_bytes is not None and state_bytes < page:
                # A Mamba layer's page is padded to the attention page; its states sit packed at the start.
                view, page = view[:, :state_bytes], state_bytes
            key = (view.data_ptr(), view.stride(0), page)
            if key in seen:
                i = seen[key]
                pages[i] = PageRef(g, pages[i].layers + (name,), page, pages[i].host_offset)
                continue
            seen[key] = len(pages)
            seg.append(len(pages))
            pages.append(PageRef(g, (name,), page, offset))
            views.append(view)
            offset += page
        segments.append(tuple(seg))
        group_bytes.append(offset)
    return KVLayout(num_blocks, max(group_bytes), tuple(group_bytes), tuple(pages), tuple(segments)), views


def host_views(tier: torch.Tensor, layout: KVLayout) -> list[torch.Tensor]:
    """Per page of `layout`, the matching (num_slots, page_bytes) view into a block-first host arena."""
    if tier.dim() != 2 or tier.dtype != torch.uint8 or tier.shape[1] < layout.slot_bytes:
        raise LayoutError(f"host tier must be a uint8 (num_slots, >= {layout.slot_bytes}) tensor, got "
                          f"{tier.dtype} {tuple(tier.shape)}")
    return [tier[:, p.host_offset:p.host_offset + p.page_bytes] for p in layout.pages]
