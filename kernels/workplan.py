"""Host side of the gather/scatter kernel: its tables, one call's packed arguments, and a numpy emulator.

The emulator walks the work items exactly as `gather_scatter.cu` does (same tables, same index arithmetic, same
per-lane element order), over numpy byte buffers instead of device memory, so the decomposition can be checked on a
machine without a GPU: every destination byte written exactly once, and the result equal to the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

WARP = 32
UNROLL = 4
THREADS = 512
TABLE_WIDTH = 8  # int64 fields per tensor row and per segment row (padded so rows stay 64-byte aligned)
VECTOR_WIDTHS = (16, 8, 4, 1)


def vector_width(values: Sequence[int]) -> int:
    """Widest access (16, 8, 4 or 1 bytes) that divides every base address, row stride and page size."""
    for w in VECTOR_WIDTHS:
        if all(int(v) % w == 0 for v in values):
            return w
    return 1


def tensor_table(direction: str, device_bases: Sequence[int], device_strides: Sequence[int],
                 host_bases: Sequence[int], host_strides: Sequence[int], page_bytes: Sequence[int]) -> np.ndarray:
    """Rows (src_base, src_stride, dst_base, dst_stride, page_bytes, 0, 0, 0) per tensor for one direction."""
    n = len(page_bytes)
    table = np.zeros((n, TABLE_WIDTH), dtype=np.int64)
    dev = (np.asarray(device_bases, dtype=np.uint64).astype(np.int64), np.asarray(device_strides, dtype=np.int64))
    host = (np.asarray(host_bases, dtype=np.uint64).astype(np.int64), np.asarray(host_strides, dtype=np.int64))
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    table[:, 0], table[:, 1] = src
    table[:, 2], table[:, 3] = dst
    table[:, 4] = np.asarray(page_bytes, dtype=np.int64)
    return table


def segment_tensors(segments: Sequence[Sequence[int]]) -> tuple[np.ndarray, list[int]]:
    """Tensor indices of all segments, concatenated, and where each segment starts."""
    begins, flat = [], []
    for seg in segments:
        begins.append(len(flat))
        flat.extend(int(t) for t in seg)
    return np.asarray(flat if flat else [0], dtype=np.int64), begins


@dataclass(frozen=True)
class CallPlan:
    """Packed arguments of one launch: `buffer` = segment rows, then src ids, then dst ids (all int64)."""

    buffer: np.ndarray
    num_segs: int
    num_ids: int
    total_items: int


def pack_call(direction: str, ids: Sequence[tuple[np.ndarray, np.ndarray] | None],
              segments: Sequence[Sequence[int]], seg_begins: Sequence[int], page_bytes: Sequence[int],
              chunk_bytes: int) -> CallPlan:
    """Segment table + ids for one call; groups with no ids, no tensors or only empty pages are left out."""
    rows: list[list[int]] = []
    srcs: list[np.ndarray] = []
    dsts: list[np.ndarray] = []
    item = 0
    id_begin = 0
    for g, pair in enumerate(ids):
        if pair is None or not segments[g]:
            continue
        largest = max(int(page_bytes[t]) for t in segments[g])
        if largest == 0:
            continue
        host_ids, dev_ids = pair
        n = int(host_ids.size)
        chunks = -(-largest // chunk_bytes)
        n_t = len(segments[g])
        rows.append([item, seg_begins[g], n_t, id_begin, n, chunks, 0, 0])
        src, dst = (host_ids, dev_ids) if direction == "h2d" else (dev_ids, host_ids)
        srcs.append(src.astype(np.int64, copy=False))
        dsts.append(dst.astype(np.int64, copy=False))
        item += n * n_t * chunks
        id_begin += n
    if not rows:
        return CallPlan(np.zeros(0, dtype=np.int64), 0, 0, 0)
    buffer = np.concatenate([np.asarray(rows, dtype=np.int64).reshape(-1), *srcs, *dsts])
    return CallPlan(buffer, len(rows), id_begin, item)


def grid_size(total_items: int, ctas: int, threads: int = THREADS) -> int:
    """Persistent grid: at most `ctas` CTAs, fewer when there are not enough items to give every warp one."""
    warps_per_cta = threads // WARP
    return max(1, min(ctas, -(-total_items // warps_per_cta)))


def emulate(plan: CallPlan, table: np.ndarray, seg_flat: np.ndarray, src_mem: np.ndarray, dst_mem: np.ndarray,
            chunk_bytes: int, width: int, *, num_warps: int = 64) -> np.ndarray:
    """Run the kernel's loops over flat byte buffers; table bases are offsets into src_mem / dst_mem.

    Returns a per-byte write count of dst_mem (the caller asserts 1 on copied bytes, 0 elsewhere).
    """
    writes = np.zeros(dst_mem.size, dtype=np.int32)
    if plan.total_items == 0:
        return writes
    call = plan.buffer
    ns = plan.num_segs
    src_ids = call[TABLE_WIDTH * ns:TABLE_WIDTH * ns + plan.num_ids]
    dst_ids = call[TABLE_WIDTH * ns + plan.num_ids:]
    lanes = np.arange(WARP)
    for warp in range(num_warps):
        for item in range(warp, plan.total_items, num_warps):
            s = 0
            while s + 1 < ns and item >= call[TABLE_WIDTH * (s + 1)]:
                s += 1
            seg = call[TABLE_WIDTH * s:TABLE_WIDTH * (s + 1)]
            local = item - int(seg[0])
            chunks, n_tensors = int(seg[5]), int(seg[2])
            c, rest = local % chunks, local // chunks
            j, i = rest % n_tensors, rest // n_tensors
            row = table[int(seg_flat[int(seg[1]) + j])]
            page = int(row[4])
            off = c * chunk_bytes
            if off >= page:
                continue
            n = min(page - off, chunk_bytes)
            idx = int(seg[3]) + i
            src = int(row[0]) + int(src_ids[idx]) * int(row[1]) + off
            dst = int(row[2]) + int(dst_ids[idx]) * int(row[3]) + off
            assert src % width == 0 and dst % width == 0 and n % width == 0, "misaligned vector access"
            nvec = n // width
            for base in range(0, nvec, WARP * UNROLL):
                # UNROLL loads per lane first, then the stores, as in copy_span.
                loaded = []
                for k in range(UNROLL):
                    e = base + k * WARP + lanes
                    e = e[e < nvec]
                    byte = (e[:, None] * width + np.arange(width)[None, :]).reshape(-1)
                    loaded.append((byte, src_mem[src + byte].copy()))
                for byte, values in loaded:
                    dst_mem[dst + byte] = values
                    np.add.at(writes, dst + byte, 1)
    return writes
