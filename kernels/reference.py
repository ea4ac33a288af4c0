"""Reference backend: the semantics every other backend must match, and the CPU-backend data path.

Two bodies with one meaning:
- both sides in host memory (vLLM's CPU backend): one `memmove` per (tensor, page) from precomputed addresses.
  Measured here (benchmarks/cpu_copy_bench.py) torch's `index_copy_` moves uint8 rows element by element (a few
  percent of memcpy speed) and `index_select` + scatter makes two passes; a single pass of row memmoves keeps up with
  one large copy of the same bytes. Ids are validated before any address is formed, so every access is in bounds.
- a CUDA device side: torch `index_select` on the source, `index_copy_` on the destination (simple and obviously
  right; the fast CUDA backends live elsewhere).
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from .api import BlockCopier, Completion

_memmove = ctypes.memmove


def _row_addresses(t: torch.Tensor, ids: np.ndarray) -> np.ndarray:
    return t.data_ptr() + ids * t.stride(0)


class ReferenceCopier(BlockCopier):
    name = "reference"

    def __init__(self, device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                 segments: Sequence[Sequence[int]]) -> None:
        super().__init__(device_pages, host_pages, segments)
        self._host_only = self.device.type == "cpu"

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
                src_t, dst_t = self._src_dst(direction, t)
                src_ids, dst_ids = (host_ids, dev_ids) if direction == "h2d" else (dev_ids, host_ids)
                size = self.layouts[t].page_bytes
                if size == 0:
                    continue
                for s, d in zip(_row_addresses(src_t, src_ids).tolist(), _row_addresses(dst_t, dst_ids).tolist()):
                    _memmove(d, s, size)

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
