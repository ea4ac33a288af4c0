"""Block checksums for `verify_loads`: one 64-bit integer per (group, block), computed where the KV cache lives.

What one checksum covers: every byte the worker copies for one block of one KV cache group, i.e. the group's unique
pages (every layer, aliased layers once) for that block id, which is exactly what one host slot holds. The same
function runs on the source blocks of a store (when it is issued, in stream order right after its copy, so it reads
the bytes the copy read) and on the destination blocks of a load (in stream order right after its copy), so a match
says that the bytes the model will read are the bytes the GPU had when they were stored: the device->host copy, the
host tier's memory and the host->device copy are all covered.

The function: each page row is viewed as signed little-endian integer words (int64 when the page size, row stride
and offset allow it, else int32, int16 or int8), cut into equal chunks of at most 512 bytes (as many words as the
largest divisor of the row's word count that fits); each chunk's words are summed (wrapping, mod 2^64) and the chunk
sums are combined with odd 64-bit weights that depend on the chunk's byte offset inside the slot:

    checksum(block) = sum over pages p, chunks j of  chunk_sum(p, j) * ((2 * offset(p, j) + 1) * K)   (mod 2^64)

with K = 0x9E3779B97F4A7C15. Integer addition and multiplication mod 2^64 do not depend on the order of the
reduction, so CPU and CUDA (and any thread count) give the same bits. It detects any change of a single word, any
change that alters one chunk's sum, and chunks, pages or whole blocks that land in the wrong place (their weights
differ); it is not a cryptographic hash (a change that keeps every chunk sum, e.g. two words swapped inside one
512-byte chunk, passes).

Everything is torch: on CUDA the reduction runs on the device in the copy's stream and only the n 8-byte results
cross to the host (through a pinned buffer, asynchronously); on the CPU backend it is the same function on host
tensors, in ops small enough to stay on the calling thread (both bodies run on CPU in the tests and must agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Sequence

import numpy as np
import torch

from offload_connector.kernels.api import Completion

CHUNK_BYTES = 512
_K = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
# Rows gathered per batch, in bytes ("gather" body): large batches keep the CUDA launch count low; the bound keeps
# the temporary small next to the KV cache, and a device too full for it halves it (`BlockChecksummer._gathered`).
CPU_BATCH_BYTES = 1 << 20
CUDA_BATCH_BYTES = 256 << 20
# The "serial" body's largest op, in words: below torch's intra-op grain (at::internal::GRAIN_SIZE, 32,768 elements),
# so torch runs it on the calling thread.
SERIAL_WORDS = 30_000


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


def _word_view(page: torch.Tensor) -> torch.Tensor:
    """`page` ((num_blocks, page_bytes) uint8, rows contiguous) as the widest integer words its layout allows."""
    nbytes = int(page.shape[1])
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if (nbytes % size == 0 and page.stride(0) % size == 0 and page.storage_offset() % size == 0
                and (page.data_ptr() % size == 0)):
            return page.view(dtype)
    return page.view(torch.int8)  # words are signed at every width


@dataclass(frozen=True)
class _Page:
    words: torch.Tensor  # (num_blocks, num_words) integer view of one page tensor
    chunks: int  # chunks per row
    chunk_words: int
    weights: torch.Tensor  # (chunks,) int64 on the page's device
    row_bytes: int


class BlockChecksummer:
    """Checksums of whole blocks of each group over `device_pages` (the worker's page views), on their device."""

    def __init__(self, device_pages: Sequence[torch.Tensor], segments: Sequence[Sequence[int]],
                 host_offsets: Sequence[int], batch_bytes: int | None = None) -> None:
        if len(host_offsets) != len(device_pages):
            raise ValueError("one host offset per page view expected")
        self.device = device_pages[0].device if device_pages else torch.device("cpu")
        self.segments = [list(s) for s in segments]
        self.batch_bytes = batch_bytes or (CUDA_BATCH_BYTES if self.device.type == "cuda" else CPU_BATCH_BYTES)
        self._pages: list[_Page] = []
        for page, offset in zip(device_pages, host_offsets):
            words = _word_view(page)
            n = int(words.shape[1])
            word_bytes = words.element_size()
            chunk_words = gcd(n, max(1, CHUNK_BYTES // word_bytes)) if n else 1
            chunks = n // chunk_words if n else 0
            weights = [_signed((2 * (int(offset) + j * chunk_words * word_bytes) + 1) * _K) for j in range(chunks)]
            self._pages.append(_Page(words, chunks, chunk_words,
                                     torch.tensor(weights, dtype=torch.int64, device=page.device),
                                     int(page.shape[1])))

    def compute(self, group: int, block_ids: Sequence[int] | np.ndarray, method: str | None = None) -> torch.Tensor:
        """(len(block_ids),) int64 checksums of `group`'s blocks `block_ids`, on the pages' device; queued on the
        current stream on CUDA (no host synchronisation).

        Two bodies, same result: "gather" (CUDA's: large batches of rows gathered with `index_select`, then reduced)
        and "serial" (the CPU backend's: every torch op kept under torch's intra-op grain, so it runs on the calling
        thread; small rows gathered a few at a time, large rows reduced in place piece by piece). On vLLM's CPU
        backend the OpenMP pool belongs to the model, and with it two-thread integer reductions measured 0.16 GB/s
        on this shared 2-core VM where one thread reads 5-10 GB/s.
        """
        method = method or ("gather" if self.device.type == "cuda" else "serial")
        ids_np = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        n = int(ids_np.size)
        out = torch.zeros(n, dtype=torch.int64, device=self.device)
        if n == 0:
            return out
        ids = torch.from_numpy(ids_np)
        if self.device.type == "cuda":
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        for t in self.segments[group]:
            page = self._pages[t]
            if page.chunks == 0:
                continue
            blocks = page.words.view(-1, page.chunks, page.chunk_words)
            row_words = page.chunks * page.chunk_words
            if method == "gather":
                start = self._gathered(page, blocks, ids, out)
                if start < n:  # not even one row's temporaries fit on the device: the rest in place
                    self._in_place(page, blocks, ids_np[start:], out[start:])
            elif row_words <= SERIAL_WORDS:
                per_batch = SERIAL_WORDS // row_words
                for start in range(0, n, per_batch):
                    self._add_batch(page, blocks, ids[start:start + per_batch], out[start:start + per_batch])
            else:
                self._in_place(page, blocks, ids_np, out)
        return out

    @staticmethod
    def _add_batch(page: _Page, blocks: torch.Tensor, sel: torch.Tensor, out: torch.Tensor) -> None:
        sums = blocks.index_select(0, sel).sum(-1, dtype=torch.int64)
        out += (sums * page.weights).sum(-1)

    def _gathered(self, page: _Page, blocks: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> int:
        """Adds the checksums of `ids` to `out` in batches of `batch_bytes`; returns how many rows it covered (all
        of them unless a single row's temporaries do not fit on the device).

        vLLM sizes the KV cache to the memory limit before the connector gets it, so a batch's temporaries may not
        fit: the batch is halved until they do and stays that size (`out` is only added to once a batch's sums
        exist, so a batch that failed is simply done again)."""
        n, start = int(ids.numel()), 0
        while start < n:
            per_batch = max(1, self.batch_bytes // max(1, page.row_bytes))
            try:
                self._add_batch(page, blocks, ids[start:start + per_batch], out[start:start + per_batch])
            except torch.OutOfMemoryError:
                if per_batch == 1:
                    return start
                self.batch_bytes = max(1, per_batch // 2) * page.row_bytes
                continue
            start += per_batch
        return n

    @staticmethod
    def _in_place(page: _Page, blocks: torch.Tensor, ids_np: np.ndarray, out: torch.Tensor) -> None:
        """One row at a time, reduced piece by piece into a buffer of one int64 per chunk: no row-sized temporary."""
        per_piece = max(1, SERIAL_WORDS // page.chunk_words)  # chunks reduced per call
        sums = torch.empty(page.chunks, dtype=torch.int64, device=out.device)
        for j, b in enumerate(ids_np.tolist()):
            row = blocks[b]
            for c0 in range(0, page.chunks, per_piece):
                torch.sum(row[c0:c0 + per_piece], -1, dtype=torch.int64, out=sums[c0:c0 + per_piece])
            out[j] += (sums * page.weights).sum()


class PendingSums(Completion):
    """Checksums queued after a copy: `values()` once `query()` is true. On CUDA the device results are copied into
    a pinned host buffer in the same stream and an event marks when they are there (the copy's own completion
    handle, so it is queried, waited on and ordered the same way); on the CPU they are ready."""

    def __init__(self, device_sums: torch.Tensor, stream: torch.cuda.Stream | None = None,
                 order: np.ndarray | None = None) -> None:
        self._device = device_sums
        self._order = order  # values()[order[i]] is device_sums[i]
        event = None
        if device_sums.device.type == "cuda":
            self._host = torch.empty(device_sums.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(device_sums, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream if stream is not None else torch.cuda.current_stream(device_sums.device))
        else:
            self._host = device_sums
        super().__init__(event)

    def values(self) -> np.ndarray:
        self.wait()
        host = self._host.numpy()
        if self._order is None:
            return host
        out = np.empty_like(host)
        out[self._order] = host
        return out


class SlotChecksums:
    """The stored checksum of every host slot, and the check of loaded blocks against it.

    `measure(job)` queues the checksums of a job's GPU blocks (call it in the job's stream, after its copy);
    `record` keeps a landed store's values per slot; `mismatches` compares a landed load's values with its slots'.
    A slot being rewritten by a store has no checksum until that store lands (and none if it fails).
    """

    def __init__(self, checksummer: BlockChecksummer, num_slots: int) -> None:
        self.checksummer = checksummer
        self._sums = np.zeros(num_slots, dtype=np.int64)
        self._valid = np.zeros(num_slots, dtype=bool)

    def measure(self, groups: Sequence[int], gpu_blocks: Sequence[int], stream: torch.cuda.Stream | None = None
                ) -> PendingSums:
        groups_a = np.asarray(groups, dtype=np.int64)
        blocks_a = np.asarray(gpu_blocks, dtype=np.int64)
        parts, order = [], []
        for g in np.unique(groups_a).tolist():
            pos = np.nonzero(groups_a == g)[0]
            parts.append(self.checksummer.compute(int(g), blocks_a[pos]))
            order.append(pos)
        if not parts:
            return PendingSums(torch.zeros(0, dtype=torch.int64, device=self.checksummer.device), stream)
        # Per group on the device, back in the job's order on the host (no index tensor has to cross).
        return PendingSums(parts[0] if len(parts) == 1 else torch.cat(parts), stream, np.concatenate(order))

    def invalidate(self, host_slots: Sequence[int]) -> None:
        self._valid[np.asarray(host_slots, dtype=np.int64)] = False

    def record(self, host_slots: Sequence[int], values: np.ndarray) -> None:
        slots = np.asarray(host_slots, dtype=np.int64)
        self._sums[slots] = values
        self._valid[slots] = True

    def mismatches(self, host_slots: Sequence[int], values: np.ndarray) -> np.ndarray:
        """Indices (into the job's blocks) whose loaded checksum differs from the stored one, or has none."""
        slots = np.asarray(host_slots, dtype=np.int64)
        return np.nonzero(~self._valid[slots] | (self._sums[slots] != values))[0]
