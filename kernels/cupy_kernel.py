"""Kernel backend: `gather_scatter.cu` JIT-compiled by CuPy (NVRTC) and launched once per call on torch's stream.

The kernel reads and writes host pages directly through mapped pinned memory, so the host tier must be registered
(`allocate_host_tier(pin=True)` or any pinned torch tensor); the device addresses of host pages come from the
driver. Per call the host packs the segment table and ids (a few KB) into one int64 buffer, copies it to the device
on the copy's stream, and launches one persistent grid over every (group, page, tensor, chunk) work item.
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from . import cuda_driver as drv
from . import workplan
from .api import BlockCopier, Completion

if TYPE_CHECKING:
    from types import ModuleType

    from cupy import RawModule
    from cupy.cuda import ExternalStream

SOURCE = Path(__file__).with_name("gather_scatter.cu")
DEFAULT_CTAS = 16
DEFAULT_CHUNK_BYTES = 16 << 10


def _cupy() -> ModuleType:
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(f"backend 'kernel' needs CuPy (pip install cupy-cuda13x): {exc}") from exc
    return cupy


@functools.cache
def _module(device_index: int) -> RawModule:
    """The compiled module for one device (NVRTC via CuPy, cached on disk by CuPy as well)."""
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        # NVRTC's default dialect (C++17) is what the source is written for; CuPy adds -arch for the device.
        module = cupy.RawModule(code=SOURCE.read_text())
        module.compile()
    return module


def _host_device_base(t: int, h: torch.Tensor) -> int:
    """Device address of host_pages[t]; the whole view must sit in one registration (contiguous mapping)."""
    start = h.data_ptr()
    end = start + (h.shape[0] - 1) * h.stride(0) + h.shape[1] - 1
    d_start, d_end = drv.host_device_pointer(start), drv.host_device_pointer(end)
    if d_start is None or d_end is None:
        raise RuntimeError(f"host_pages[{t}] is not registered (pinned) host memory; the kernel backend reads host "
                           "memory directly: allocate the tier with allocate_host_tier(pin=True)")
    if d_end - d_start != end - start:
        raise RuntimeError(f"host_pages[{t}] spans two host registrations; the kernel backend needs each host tensor "
                           "inside one registration chunk")
    return d_start


def _launch_stream(cupy: ModuleType, handle: int, device_index: int) -> ExternalStream:
    """CuPy view of torch's stream, so the launch is ordered with the rest of the caller's work."""
    with warnings.catch_warnings():
        # Deprecated in CuPy 14 in favour of Stream.from_external(obj with __cuda_stream__), which not every torch
        # release's Stream implements; the raw-handle form works in both.
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device_index)


class KernelCopier(BlockCopier):
    name = "kernel"

    def __init__(self, device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                 segments: Sequence[Sequence[int]], *, ctas: int = DEFAULT_CTAS,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__(device_pages, host_pages, segments)
        if not isinstance(ctas, int) or ctas <= 0:
            raise ValueError(f"ctas must be a positive int, got {ctas!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % 16 or chunk_bytes > 1 << 30:
            raise ValueError(f"chunk_bytes must be a positive multiple of 16 up to 1 GiB, got {chunk_bytes!r}")
        if self.device.type != "cuda":
            raise RuntimeError(f"backend 'kernel' needs CUDA device pages, got {self.device}")
        self.ctas, self.chunk_bytes = ctas, chunk_bytes
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._device_index = index
        cupy = _cupy()
        with torch.cuda.device(index):
            live = [t for t, lay in enumerate(self.layouts) if lay.page_bytes and lay.device_blocks
                    and lay.host_blocks]
            host_bases = [0] * len(self.layouts)
            for t in live:
                host_bases[t] = _host_device_base(t, self.host_pages[t])
            dev_bases = [d.data_ptr() for d in self.device_pages]
            page = [lay.page_bytes for lay in self.layouts]
            dstride = [lay.device_stride for lay in self.layouts]
            hstride = [lay.host_stride for lay in self.layouts]
            self.width = workplan.vector_width(
                [v for t in live for v in (dev_bases[t], host_bases[t], dstride[t], hstride[t], page[t])])
            self._tables = {d: torch.from_numpy(workplan.tensor_table(d, dev_bases, dstride, host_bases, hstride,
                                                                      page)).to(self.device)
                            for d in ("h2d", "d2h")}
            seg_flat, self._seg_begins = workplan.segment_tensors(self.segments)
            self._seg_flat = torch.from_numpy(seg_flat).to(self.device)
            self._page_bytes = page
            with cupy.cuda.Device(index):  # the function is loaded into this device's (primary) context
                self._fn = _module(index).get_function(f"kv_gather_scatter_v{self.width}")
            torch.cuda.synchronize(index)  # tables are on the device before the first launch reads them
        self._cupy = cupy

    def _copy(self, direction: str, ids: list[tuple[np.ndarray, np.ndarray] | None],
              stream: "torch.cuda.Stream | None") -> Completion:
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        plan = workplan.pack_call(direction, ids, self.segments, self._seg_begins, self._page_bytes,
                                  self.chunk_bytes)
        with torch.cuda.device(self._device_index), torch.cuda.stream(stream):
            if plan.total_items:
                # Allocated on `stream`, so the caching allocator will not hand the buffer out again before the
                # launch that reads it has run; the pinned staging copy is likewise held until its copy completes.
                buf = torch.from_numpy(plan.buffer).pin_memory().to(self.device, non_blocking=True)
                grid = workplan.grid_size(plan.total_items, self.ctas)
                args = (np.uint64(self._tables[direction].data_ptr()), np.uint64(self._seg_flat.data_ptr()),
                        np.uint64(buf.data_ptr()), np.int32(plan.num_segs), np.int64(plan.num_ids),
                        np.int64(plan.total_items), np.int64(self.chunk_bytes))
                cupy = self._cupy
                with cupy.cuda.Device(self._device_index), _launch_stream(cupy, stream.cuda_stream,
                                                                          self._device_index):
                    self._fn((grid,), (workplan.THREADS,), args)
            event = torch.cuda.Event()
            event.record(stream)
        return Completion(event)
