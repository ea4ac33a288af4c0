"""Batched-DMA backend: every page of a call in one `cuMemcpyBatchAsync` (the copy engines, no SMs).

The same driver call vLLM 0.33's `swap_blocks_batch` makes. Stores (d2h) read live KV, so their sources are read in
stream order; loads (h2d) read host pages, which are stable only if no store into the same slot is still queued, so
stream order is the default there too and `h2d_any_order=True` (vLLM's choice) is an opt-in for callers that
guarantee it. The driver consumes the descriptor arrays before returning, so they need not outlive the call.
`cuMemcpyBatchAsync` rejects the legacy default stream (CUresult 1, seen on an H200 when "auto" handed a default-stream
caller this backend): a call on it runs on a private stream fenced on both sides, so it keeps stream order.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from . import cuda_driver as drv
from .api import BlockCopier, Completion
from .descriptors import page_descriptors


class BatchCopier(BlockCopier):
    name = "batch"

    def __init__(self, device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                 segments: Sequence[Sequence[int]], *, h2d_any_order: bool = False) -> None:
        super().__init__(device_pages, host_pages, segments)
        if self.device.type != "cuda":
            raise RuntimeError(f"backend 'batch' needs CUDA device pages, got {self.device}")
        torch.cuda.init()
        self._fn = drv.batch_memcpy()
        order_h2d = drv.SRC_ACCESS_ORDER_ANY if h2d_any_order else drv.SRC_ACCESS_ORDER_STREAM
        self._attrs = {"h2d": drv.CUmemcpyAttributes(srcAccessOrder=order_h2d),
                       "d2h": drv.CUmemcpyAttributes(srcAccessOrder=drv.SRC_ACCESS_ORDER_STREAM)}
        if h2d_any_order:
            self.name = "batch_any"
        self._side: torch.cuda.Stream | None = None

    def _copy(self, direction: str, ids: list[tuple[np.ndarray, np.ndarray] | None],
              stream: "torch.cuda.Stream | None") -> Completion:
        caller = stream if stream is not None else torch.cuda.current_stream(self.device)
        stream = caller
        dsts, srcs, sizes = page_descriptors(direction, ids, self.device_pages, self.host_pages, self.segments)
        with torch.cuda.device(self.device):
            if caller.cuda_stream == 0:
                if self._side is None:
                    self._side = torch.cuda.Stream(self.device)
                stream = self._side
                stream.wait_stream(caller)
            if dsts.size:
                attrs_idx = ctypes.c_size_t(0)  # one attribute set, applying from descriptor 0 on
                fail_idx = ctypes.c_size_t(0)
                res = self._fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, dsts.size,
                               ctypes.byref(self._attrs[direction]), ctypes.byref(attrs_idx), 1,
                               ctypes.byref(fail_idx), ctypes.c_void_p(stream.cuda_stream))
                if res != 0:
                    raise drv.DriverError(f"cuMemcpyBatchAsync ({direction}, {dsts.size} pages) returned CUresult "
                                          f"{res}, failing descriptor {fail_idx.value}")
            event = torch.cuda.Event()
            event.record(stream)
            if stream is not caller:
                caller.wait_event(event)
        return Completion(event)
