"""Reference backend: the semantics every other backend must match, and the CPU-backend path without a C compiler.

Two bodies with one meaning:
- both sides in host memory (vLLM's CPU backend; the compiled `host` backend in host_copy.py is about twice as fast
  and is what "auto" picks when it builds): one memcpy per (tensor, page), as a slice assignment between
  memoryviews over each tensor's bytes. Measured on this 2-core VM: torch's `index_copy_` moves uint8 rows element
  by element (2-20 % of memcpy speed), `index_select` + a scatter and numpy fancy indexing make two passes (20-55 %),
  a `ctypes.memmove` per page costs ~2 us of call overhead; a memoryview slice assignment costs ~0.6 us and is
  bounds-checked by Python (an id that slipped past validation raises instead of touching foreign memory).
- a CUDA device side: torch `index_select` on the source, `index_copy_` on the destination (simple and obviously
  right; the fast CUDA backends live elsewhere).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .api import BlockCopier, Completion

def _byte_view(t: torch.Tensor) -> memoryview:
    """A flat memoryview over every byte a (rows, page) view spans; holds a reference to the tensor's memory."""
    if t.shape[0] == 0 or t.shape[1] == 0:
        return memoryview(b"")
    span = (t.shape[0] - 1) * t.stride(0) + t.shape[1]
    return memoryview(torch.as_strided(t, (span,), (1,), t.storage_offset()).numpy())


class ReferenceCopier(BlockCopier):
    name = "reference"

    def __init__(self, device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                 segments: Sequence[Sequence[int]]) -> None:
        super().__init__(device_pages, host_pages, segments)
        self._host_only = self.device.type == "cpu"
        if self._host_only:
            self._dev_bytes = [_byte_view(t) for t in self.device_pages]
            self._host_bytes = [_byte_view(t) for t in self.host_pages]

    def _copy(self, direction: str, ids: list[tuple[np.ndarray, np.ndarray] | None],
              stream: "torch.cuda.Stream | None") -> Completion:
        if self._host_only:
            self._copy_host(direction, ids)
            return Completion()
        return self._copy_torch(direction, ids, stream)

    def _copy_host(self, direction: str, ids: list[tuple[np.ndarray, np.ndarray] | None]) -> None:
        for g, pair in enumerate(ids):
            if pair is None:
                continue
            host_ids, dev_ids = pair
            for t in self.segments[g]:
                lay = self.layouts[t]
                size = lay.page_bytes
                if size == 0:
                    continue
                dev_off = (dev_ids * lay.device_stride).tolist()
                host_off = (host_ids * lay.host_stride).tolist()
                if direction == "h2d":
                    src, dst, src_off, dst_off = self._host_bytes[t], self._dev_bytes[t], host_off, dev_off
                else:
                    src, dst, src_off, dst_off = self._dev_bytes[t], self._host_bytes[t], dev_off, host_off
                for s, d in zip(src_off, dst_off):
                    dst[d:d + size] = src[s:s + size]

    def _copy_torch(self, direction: str, ids: list[tuple[np.ndarray, np.ndarray] | None],
                    stream: "torch.cuda.Stream | None") -> Completion:
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            for g, pair in enumerate(ids):
                if pair is None:
                    continue
                host_ids, dev_ids = pair
                src_ids, dst_ids = (host_ids, dev_ids) if direction == "h2d" else (dev_ids, host_ids)
                for t in self.segments[g]:
                    src_t, dst_t = self._src_dst(direction, t)
                    si = torch.from_numpy(src_ids).to(src_t.device)
                    di = torch.from_numpy(dst_ids).to(dst_t.device)
                    rows = src_t.index_select(0, si).to(dst_t.device)
                    dst_t.index_copy_(0, di, rows)
            event = torch.cuda.Event()
            event.record(stream)
        return Completion(event)

    def _src_dst(self, direction: str, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        if direction == "h2d":
            return self.host_pages[t], self.device_pages[t]
        return self.device_pages[t], self.host_pages[t]
