"""The copier interface shared by every backend: layout checks, id validation, completion handles.

A copier moves whole pages between a device KV cache and its host tier. The layout is fixed at construction
(one page table per unique KV tensor, grouped into segments = KV cache groups); each `copy` call names, per group,
which host slots pair with which device blocks.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch

Direction = Literal["h2d", "d2h"]
DIRECTIONS: tuple[str, ...] = ("h2d", "d2h")


class Completion:
    """Completion handle of one `copy` call.

    Wraps the CUDA event recorded after the copy on its stream; without an event (reference path on CPU) the copy
    ran synchronously and is already complete.

    `error`: why the copy failed, read once `query()` is true (None: it succeeded). The byte-moving backends raise
    from `copy()` instead and leave it None; a backend that learns of a failure only when the copy lands (the
    benchmarks' simulated backend, which injects failures) sets it, and the worker reports the job failed.
    """

    error: str | None = None

    def __init__(self, event: "torch.cuda.Event | None" = None) -> None:
        self._event = event

    def query(self) -> bool:
        """True when every byte of the copy has landed (non-blocking)."""
        return True if self._event is None else bool(self._event.query())

    def wait(self) -> None:
        """Block the calling thread until the copy has landed."""
        if self._event is not None:
            self._event.synchronize()

    def order_before(self, stream: "torch.cuda.Stream | None") -> None:
        """Make work queued on `stream` from now on start only after the copy has landed (no host wait)."""
        if self._event is not None and stream is not None:
            stream.wait_event(self._event)


@dataclass(frozen=True)
class TensorLayout:
    """One unique KV tensor as a copier sees it: a row per block, `page_bytes` used bytes per row."""

    page_bytes: int
    device_blocks: int
    host_blocks: int
    device_stride: int
    host_stride: int


def check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r} is not one of {DIRECTIONS}")


def _check_page_view(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8 or t.dim() != 2:
        raise ValueError(f"{what} must be a 2-D uint8 view (num_blocks, page_bytes), got {t.dtype} {tuple(t.shape)}")
    # Pages must be contiguous runs of bytes; only the distance between rows may exceed the page (vLLM's stride).
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{what} rows must be contiguous (stride(1) == 1), got strides {t.stride()}")
    if t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        raise ValueError(f"{what} rows overlap: stride(0) {t.stride(0)} < page_bytes {t.shape[1]}")


def check_layout(device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                 segments: Sequence[Sequence[int]]) -> tuple[list[TensorLayout], list[list[int]]]:
    """Validate the page views and segments; returns per-tensor layouts and segments as int lists."""
    if len(device_pages) != len(host_pages):
        raise ValueError(f"device_pages has {len(device_pages)} tensors but host_pages has {len(host_pages)}")
    layouts: list[TensorLayout] = []
    for t, (d, h) in enumerate(zip(device_pages, host_pages)):
        _check_page_view(d, f"device_pages[{t}]")
        _check_page_view(h, f"host_pages[{t}]")
        if d.shape[1] != h.shape[1]:
            raise ValueError(f"tensor {t}: device page_bytes {d.shape[1]} != host page_bytes {h.shape[1]}")
        if h.device.type != "cpu":
            raise ValueError(f"host_pages[{t}] must live in host memory, got device {h.device}")
        if d.device != device_pages[0].device:
            raise ValueError(f"device_pages[{t}] is on {d.device}, device_pages[0] on {device_pages[0].device}")
        layouts.append(TensorLayout(page_bytes=int(d.shape[1]), device_blocks=int(d.shape[0]),
                                    host_blocks=int(h.shape[0]), device_stride=int(d.stride(0)),
                                    host_stride=int(h.stride(0))))
    segs: list[list[int]] = []
    owner: dict[int, int] = {}
    for g, seg in enumerate(segments):
        s = [int(t) for t in seg]
        for t in s:
            if not 0 <= t < len(layouts):
                raise ValueError(f"segments[{g}] names tensor {t}; accepted: 0..{len(layouts) - 1}")
            # A tensor in two groups would let two groups write the same destination page in one call.
            if t in owner:
                raise ValueError(f"tensor {t} appears in segments[{owner[t]}] and segments[{g}]; segments must be "
                                 "disjoint")
            owner[t] = g
        segs.append(s)
    return layouts, segs


def normalize_ids(direction: str, ids: Sequence[object], layouts: Sequence[TensorLayout],
                  segments: Sequence[Sequence[int]]) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Check one call's ids against the layout; returns per group (host_ids, device_ids) int64 arrays or None.

    Raises ValueError naming the group and the problem: unequal lengths, an id out of range, a repeated destination
    (the destination side is the device for h2d and the host for d2h; repeated sources are fine).
    """
    check_direction(direction)
    if len(ids) != len(segments):
        raise ValueError(f"ids has {len(ids)} entries, one per KV cache group expected ({len(segments)})")
    out: list[tuple[np.ndarray, np.ndarray] | None] = []
    for g, entry in enumerate(ids):
        if entry is None:
            out.append(None)
            continue
        if len(entry) != 2:  # type: ignore[arg-type]
            raise ValueError(f"ids[{g}] must be (host_slot_ids, device_block_ids) or None")
        host = np.asarray(entry[0]).reshape(-1)  # type: ignore[index]
        dev = np.asarray(entry[1]).reshape(-1)  # type: ignore[index]
        for name, a in (("host_slot_ids", host), ("device_block_ids", dev)):
            if a.size and not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"ids[{g}] {name} must be integers, got dtype {a.dtype}")
        if host.size != dev.size:
            raise ValueError(f"ids[{g}]: {host.size} host_slot_ids but {dev.size} device_block_ids")
        if host.size == 0:
            out.append(None)
            continue
        host = host.astype(np.int64, copy=False)
        dev = dev.astype(np.int64, copy=False)
        seg = segments[g]
        if seg:
            host_lim = min(layouts[t].host_blocks for t in seg)
            dev_lim = min(layouts[t].device_blocks for t in seg)
            for name, a, lim in (("host_slot_ids", host, host_lim), ("device_block_ids", dev, dev_lim)):
                lo, hi = int(a.min()), int(a.max())
                if lo < 0 or hi >= lim:
                    bad = lo if lo < 0 else hi
                    raise ValueError(f"ids[{g}] {name} contains {bad}; accepted range 0..{lim - 1}")
        dst, dst_name = (dev, "device_block_ids") if direction == "h2d" else (host, "host_slot_ids")
        uniq = np.unique(dst)
        if uniq.size != dst.size:
            vals, counts = np.unique(dst, return_counts=True)
            raise ValueError(f"ids[{g}] {dst_name} (the {direction} destination) repeats block {int(vals[counts > 1][0])}; "
                             "destinations must be unique")
        out.append((host, dev))
    return out


class BlockCopier(abc.ABC):
    """Copies pages between a device KV cache and its host tier, for every tensor of each named group.

    device_pages[t] / host_pages[t]: uint8 2-D views (num_blocks_t, page_bytes_t) of one unique KV tensor and its
    host-tier counterpart (row stride may exceed page_bytes). segments[g]: indices t of the tensors of group g.
    """

    name: str = "abstract"

    def __init__(self, device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                 segments: Sequence[Sequence[int]]) -> None:
        self.layouts, self.segments = check_layout(device_pages, host_pages, segments)
        self.device_pages = list(device_pages)
        self.host_pages = list(host_pages)
        self.device = device_pages[0].device if device_pages else torch.device("cpu")

    def copy(self, direction: Direction, ids: Sequence[object],
             stream: "torch.cuda.Stream | None" = None) -> Completion:
        """h2d: device_pages[t][dev[i]] = host_pages[t][host[i]] for every t of group g; d2h the reverse.

        The copy is ordered on `stream` (default: the current stream of the device); the returned handle says when
        it has landed. Source pages must not change and destination pages must not be read until then.
        """
        norm = normalize_ids(direction, ids, self.layouts, self.segments)
        return self._copy(direction, norm, stream)

    @abc.abstractmethod
    def _copy(self, direction: str, ids: list[tuple[np.ndarray, np.ndarray] | None],
              stream: "torch.cuda.Stream | None") -> Completion:
        """Backend body; `ids` are validated int64 arrays (None = no blocks for that group)."""

    def close(self) -> None:
        """Release backend resources (device tables, modules); the page tensors stay with their owner."""
