"""(dst, src, size) descriptor arrays for the DMA backends: one per (group, tensor, page) of a call."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def page_descriptors(direction: str, ids: Sequence[tuple[np.ndarray, np.ndarray] | None],
                     device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                     segments: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Addresses of every page copy of one call as uint64 arrays (dsts, srcs, sizes); empty pages are skipped.

    Built with numpy per tensor (no per-page Python work), in group, tensor, page order.
    """
    dsts: list[np.ndarray] = []
    srcs: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    for g, pair in enumerate(ids):
        if pair is None:
            continue
        host_ids, dev_ids = pair
        for t in segments[g]:
            d, h = device_pages[t], host_pages[t]
            page = int(d.shape[1])
            if page == 0:
                continue
            dev_addr = np.uint64(d.data_ptr()) + dev_ids.astype(np.uint64) * np.uint64(d.stride(0))
            host_addr = np.uint64(h.data_ptr()) + host_ids.astype(np.uint64) * np.uint64(h.stride(0))
            src, dst = (host_addr, dev_addr) if direction == "h2d" else (dev_addr, host_addr)
            dsts.append(dst)
            srcs.append(src)
            sizes.append(np.full(dev_ids.size, page, dtype=np.uint64))
    if not dsts:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty.copy(), empty.copy()
    return (np.ascontiguousarray(np.concatenate(dsts)), np.ascontiguousarray(np.concatenate(srcs)),
            np.ascontiguousarray(np.concatenate(sizes)))
