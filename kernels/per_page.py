"""Per-page DMA backend: one `cuMemcpyAsync` per (tensor, page). The baseline the batched backends are measured
against, and the fallback on drivers older than 12.8 (no cuMemcpyBatchAsync).

The loop runs in Python over precomputed addresses (about a microsecond of ctypes overhead per page on top of the
driver's own per-call cost), so with small pages it is submission-bound by design of the baseline.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from . import cuda_driver as drv
from .api import BlockCopier, Completion
from .descriptors import page_descriptors


class PerPageCopier(BlockCopier):
    name = "per_page"

    def __init__(self, device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                 segments: Sequence[Sequence[int]]) -> None:
        super().__init__(device_pages, host_pages, segments)
        if self.device.type != "cuda":
            raise RuntimeError(f"backend 'per_page' needs CUDA device pages, got {self.device}")
        torch.cuda.init()
        self._fn = drv.memcpy_async()

    def _copy(self, direction: str, ids: list[tuple[np.ndarray, np.ndarray] | None],
              stream: "torch.cuda.Stream | None") -> Completion:
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        dsts, srcs, sizes = page_descriptors(direction, ids, self.device_pages, self.host_pages, self.segments)
        fn = self._fn
        handle = ctypes.c_void_p(stream.cuda_stream)
        with torch.cuda.device(self.device):
            for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
                res = fn(d, s, n, handle)
                if res != 0:
                    raise drv.DriverError(f"cuMemcpyAsync ({direction}, {n} bytes) returned CUresult {res}")
            event = torch.cuda.Event()
            event.record(stream)
        return Completion(event)
