"""`DiskStore`: the disk tier's bytes. Fixed-size slots in one preallocated file, written and read by a small thread
pool (pwritev/preadv straight from/into the caller's buffer, e.g. a uint8 view of a host-tier slot), with O_DIRECT
where the filesystem allows it, an index rebuilt from the file on open, per-slot CRCs, a byte budget with LRU
eviction, and counters. Format: `offload_connector.disk.format`; index: `offload_connector.disk.index`.

Threading: `write`/`read` return at once with a `DiskIO` handle (poll `done()`, or `wait()`); the caller keeps the
buffer alive and unchanged (write) or untouched (read) until the handle is done. Every index change happens under one
lock; the I/O itself runs without it. A read whose data or record fails its check is dropped from the tier and its
handle reports `ok=False` (the destination bytes are then garbage and must not be used): a corrupt slot is never
returned as a hit.

Authentication: a store opened with `mac_key` tags every record and serves a slot only if its tag verifies
(`format.record_tag`); a slot without a tag ("unauthenticated") or with one that does not verify ("mac") is dropped
like a corrupt one, counted by reason and logged once per reason. Without `mac_key` the store trusts whoever can write
its directory (it creates the directory owner-only) and checks CRCs.

Durability: this is a cache. Writes are not fsynced one by one (`flush()` / `close()` do); what a crash or power loss
leaves half written fails a CRC and is dropped, it is never returned.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from offload_connector.disk.format import (
    ALIGN, FILE_NAME, FORMAT_VERSION, HEADER_BYTES, RECORD_BYTES, DiskFingerprint, DiskFormatError, Header, Record,
    align_up, crc32, fingerprint_digest, pack_header, pack_record, record_tag, slot_stride, tag_verifies,
    unpack_record,
)
from offload_connector.disk.index import (
    DiskEntry, DiskIndex, Key, check_fingerprint, read_header, scan_records, slot_offset,
)
from offload_connector.log import get_logger

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch
    from _typeshed import ReadableBuffer

    # What a write reads from or a read fills: a CPU torch tensor, a numpy array or any other bytes-like object
    # (numpy declares the buffer protocol to type checkers only from Python 3.12 on).
    ByteBuffer: TypeAlias = torch.Tensor | np.ndarray | ReadableBuffer

logger = get_logger(__name__)


@dataclass(frozen=True)
class DiskStats:
    capacity_slots: int
    used_slots: int  # slots being written, readable, or retired (dropped while a read still used them)
    entries: int  # readable entries
    bytes_written: int
    bytes_read: int
    writes: int  # writes that landed and became readable
    hits: int  # reads that returned verified bytes
    misses: int  # reads of a key the tier does not hold
    evictions: int
    corrupt_dropped: int  # slots dropped for a bad data CRC or record (at open or on read)
    rejected_unauthenticated: int  # slots dropped on read: no tag, in a store opened with a MAC key
    rejected_mac: int  # slots dropped on read: a tag that does not verify (forged, or another secret)
    recovered_entries: int  # entries found on disk at open
    write_rejections: int  # writes refused: every slot busy being written or read
    write_errors: int
    read_errors: int
    direct_io: bool


class DiskIO:
    """Completion handle of one `DiskStore.write` or `read`. `done()` polls; `wait()` blocks and returns `ok`."""

    __slots__ = ("key", "op", "_future")

    def __init__(self, key: Key, op: str, future: Future) -> None:
        self.key, self.op, self._future = key, op, future

    @classmethod
    def finished(cls, key: Key, op: str, ok: bool, error: str | None = None) -> "DiskIO":
        f: Future = Future()
        f.set_result((ok, error))
        return cls(key, op, f)

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        return self._future.result(timeout)[0]

    @property
    def ok(self) -> bool:
        """Whether the write landed / the read returned verified bytes (blocks until done)."""
        return self._future.result()[0]

    @property
    def error(self) -> str | None:
        """Why not ok: "miss", "corrupt: ...", "no free slot", an OSError's text, ... (None when ok)."""
        return self._future.result()[1]


# `buf` is Any: a tensor is told apart by its attributes, without importing torch, which no type checker follows.
def as_byte_view(buf: Any, writable: bool) -> np.ndarray:
    """A 1-D uint8 numpy view (no copy) of a contiguous buffer: numpy array, CPU torch tensor, bytes-like."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "numpy"):  # a torch tensor, without importing torch
        if getattr(buf, "device", None) is not None and str(buf.device) != "cpu":
            raise ValueError(f"disk tier buffers live in host memory, got a tensor on {buf.device}")
        import torch  # already loaded: `buf` is a tensor
        if not buf.is_contiguous():
            raise ValueError("disk tier buffers must be contiguous")
        buf = buf.detach().reshape(-1).view(torch.uint8).numpy()
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("disk tier buffers must be contiguous")
    arr = arr.reshape(-1).view(np.uint8)
    if writable and not arr.flags.writeable:
        raise ValueError("the read destination is not writable")
    return arr


def _aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)  # anonymous mmaps are page aligned


def _vectored_all(op: Callable[[int, list[memoryview], int], int], fd: int, bufs: list, off: int, short: str) -> None:
    """Run `op` (os.pwritev / os.preadv) until every byte of `bufs` moved; `short` names a call that moved none."""
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = op(fd, views, off)
        if n <= 0:
            raise OSError(errno.EIO, short.format(off=off))
        off += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _pwritev_all(fd: int, bufs: list, off: int) -> None:
    _vectored_all(os.pwritev, fd, bufs, off, "pwritev wrote nothing")


def _preadv_all(fd: int, bufs: list, off: int) -> None:
    _vectored_all(os.preadv, fd, bufs, off, "short read at offset {off} (file truncated?)")


class DiskStore:
    """A disk tier in `directory`, sized to `budget_bytes` (header and per-slot records included).

    `fingerprint.slot_bytes` is the slot size (the CPU tier's). A directory written for another fingerprint (or
    format version), or with a corrupt header: `on_mismatch="error"` (default) raises `FingerprintMismatch` /
    `DiskFormatError` and leaves the file alone; `on_mismatch="reset"` logs a warning and starts an empty tier there,
    overwriting it. Two processes cannot open one directory at once (an flock; the second gets `BlockingIOError`).
    `direct=True` opens the file with O_DIRECT and falls back to buffered I/O, logging why, where the filesystem
    refuses it. `verify_on_open=True` reads every recovered slot's data and drops those whose CRC fails (otherwise
    that check happens on each read). `mac_key` (32 bytes, e.g. `tier_auth.mac_key_from_file`): tag every record
    written and serve only slots whose tag verifies.
    """

    def __init__(self, directory: str, fingerprint: DiskFingerprint, budget_bytes: int, *, io_threads: int = 2,
                 direct: bool = True, on_mismatch: str = "error", verify_on_open: bool = False,
                 mac_key: bytes | None = None) -> None:
        if on_mismatch not in ("error", "reset"):
            raise ValueError(f"on_mismatch must be 'error' or 'reset', got {on_mismatch!r}")
        if io_threads < 1:
            raise ValueError("io_threads must be at least 1")
        self.directory = directory
        self.fingerprint = fingerprint
        self.slot_bytes = fingerprint.slot_bytes
        self.stride = slot_stride(self.slot_bytes)
        self._data_span = align_up(self.slot_bytes)
        num_slots = (budget_bytes - HEADER_BYTES) // self.stride
        if num_slots < 1:
            raise ValueError(f"disk tier budget {budget_bytes} is smaller than one slot "
                             f"({HEADER_BYTES + self.stride} bytes with header and record)")
        self.num_slots = num_slots
        self.path = os.path.join(directory, FILE_NAME)
        self._mac_key = mac_key
        self._fp_digest = fingerprint_digest(fingerprint)
        self._warned: set[str] = set()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._closed = False
        self._c = dict(bytes_written=0, bytes_read=0, writes=0, hits=0, misses=0, corrupt_dropped=0,
                       rejected_unauthenticated=0, rejected_mac=0, recovered_entries=0, write_rejections=0,
                       write_errors=0, read_errors=0)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise BlockingIOError(errno.EWOULDBLOCK, f"disk tier {self.path} is open in another process")
        self._dfd = self._fd
        try:
            records = self._open_file(on_mismatch)
            self._dfd, self.direct_reason = self._open_direct(direct)
            self.index = DiskIndex(num_slots)
            self.index.restore(records)
            self._seq = 1 + max((r.seq for _, r in records), default=0)
            self._c["recovered_entries"] = len(records)
            if verify_on_open:
                self._verify_all()
        except BaseException:
            if self._dfd != self._fd:
                os.close(self._dfd)
            os.close(self._fd)
            raise
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="oc-disk")

    # ------------------------------------------------------------------ open
    def _open_file(self, on_mismatch: str) -> list[tuple[int, Record]]:
        size = os.fstat(self._fd).st_size
        records: list[tuple[int, Record]] = []
        header: Header | None = None
        if size > 0:
            try:
                header = read_header(self._fd)
                check_fingerprint(header, self.fingerprint)
            except DiskFormatError as exc:
                if on_mismatch == "error":
                    raise
                logger.warning("offload_connector: disk tier %s: %s; starting an empty tier (on_mismatch='reset')",
                               self.path, exc)
                header = None
            if header is not None and header.slot_bytes == self.slot_bytes and header.stride == self.stride:
                for slot, rec, status in scan_records(self._fd, header, self.num_slots):
                    if rec is not None:
                        records.append((slot, rec))
                    elif status == "corrupt":
                        self._c["corrupt_dropped"] += 1
        self._epoch = header.epoch if header is not None else 0
        if header is None:
            os.ftruncate(self._fd, 0)  # forget every record of whatever was here
        self._write_header()
        total = HEADER_BYTES + self.num_slots * self.stride
        if os.fstat(self._fd).st_size > total:
            os.ftruncate(self._fd, total)
        try:
            os.posix_fallocate(self._fd, 0, total)
        except OSError as exc:  # e.g. EOPNOTSUPP: a sparse file works, only less predictably
            logger.info("offload_connector: disk tier %s: preallocation failed (%s); using a sparse file",
                        self.path, exc)
            os.ftruncate(self._fd, total)
        os.fsync(self._fd)
        if records:
            logger.info("offload_connector: disk tier %s: recovered %d entries (%d corrupt records dropped)",
                        self.path, len(records), self._c["corrupt_dropped"])
        return records

    def _write_header(self) -> None:
        raw = pack_header(Header(FORMAT_VERSION, self._epoch, self.slot_bytes, self.stride, self.num_slots,
                                 self.fingerprint))
        os.pwrite(self._fd, raw, 0)
        os.fsync(self._fd)

    def _open_direct(self, want: bool) -> tuple[int, str | None]:
        if not want:
            return self._fd, "direct=False"
        if not hasattr(os, "O_DIRECT"):
            reason = "this platform has no O_DIRECT"
        else:
            try:
                dfd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            except OSError as exc:
                reason = f"open(O_DIRECT) failed: {exc}"
            else:
                try:  # some filesystems accept the flag at open and refuse the I/O
                    os.preadv(dfd, [_aligned(ALIGN)], 0)
                    return dfd, None
                except OSError as exc:
                    os.close(dfd)
                    reason = f"O_DIRECT read failed: {exc}"
        logger.warning("offload_connector: disk tier %s: using buffered I/O (%s); reads may be served from the page "
                       "cache and writes are cached", self.path, reason)
        return self._fd, reason

    @property
    def direct(self) -> bool:
        return self._dfd != self._fd

    def _verify_all(self) -> None:
        buf = _aligned(self._data_span)
        for key in self.index.keys():
            e = self.index.get(key)
            assert e is not None
            try:
                _preadv_all(self._fd, [buf[:e.length]], slot_offset(e.slot, self.stride))
                good = crc32(buf[:e.length]) == e.crc
            except OSError:
                good = False
            if not good:
                self.index.drop(key)
                self._c["corrupt_dropped"] += 1

    # ------------------------------------------------------------- buffers
    def _bufs(self) -> tuple[np.ndarray, np.ndarray]:
        """This thread's aligned bounce buffer (one slot's data span) and record block."""
        t = self._tls
        if not hasattr(t, "bounce"):
            t.bounce = _aligned(self._data_span)
            t.record = _aligned(RECORD_BYTES)
        return t.bounce, t.record

    def _direct_ok(self, arr: np.ndarray, length: int) -> bool:
        return length % ALIGN == 0 and arr.ctypes.data % ALIGN == 0

    # --------------------------------------------------------------- writes
    def write(self, key: Key, data: ByteBuffer) -> DiskIO:
        """Store `data` (at most slot_bytes bytes) under `key`, asynchronously. A key already stored (or being
        stored: keys are content hashes, so the bytes are the same) is only marked recently used and the handle is
        done at once with ok=True; `contains` tells when such a key is readable. Evicts the least recently
        used entries as needed; ok=False, error "no free slot" when every slot is being written or read."""
        src = as_byte_view(data, writable=False)
        length = src.nbytes
        if length > self.slot_bytes:
            raise ValueError(f"{length} bytes do not fit a {self.slot_bytes}-byte slot")
        key = (int(key[0]), key[1])
        with self._lock:
            self._check_open()
            e = self.index.get(key)
            if e is not None:
                self.index.touch(key)
                return DiskIO.finished(key, "write", True)
            slot, _evicted = self.index.reserve(key)
            if slot is None:
                self._c["write_rejections"] += 1
                return DiskIO.finished(key, "write", False, "no free slot")
            entry = self.index.get(key)
            entry.pins = 1  # a write in flight holds its slot like a read
            seq, epoch = self._seq, self._epoch
            self._seq += 1
        return DiskIO(key, "write", self._pool.submit(self._do_write, entry, src, length, seq, epoch))

    def _do_write(self, entry: DiskEntry, src: np.ndarray, length: int, seq: int, epoch: int):
        try:
            crc = crc32(src)
            bounce, rec = self._bufs()
            record = Record(epoch, seq, entry.key, length, crc)
            if self._mac_key is not None:
                record = Record(epoch, seq, entry.key, length, crc, record_tag(self._mac_key, self._fp_digest,
                                                                               record, src))
            pack_record(record, memoryview(rec))
            fd = self._dfd
            if not self.direct or self._direct_ok(src, length):
                data, span = src, length
            else:
                span = align_up(length)
                bounce[:length] = src
                bounce[length:span] = 0
                data = bounce[:span]
            off = slot_offset(entry.slot, self.stride)
            if span == self._data_span:  # data then record, one syscall
                _pwritev_all(fd, [data, rec], off)
            else:
                _pwritev_all(fd, [data], off)
                _pwritev_all(fd, [rec], off + self._data_span)
        except OSError as exc:
            with self._lock:
                self._c["write_errors"] += 1
                self.index.abort(entry)
                self.index.unpin(entry)
            logger.warning("offload_connector: disk tier write of slot %d failed: %s", entry.slot, exc)
            return False, f"write failed: {exc}"
        with self._lock:
            landed = epoch == self._epoch and self.index.commit(entry, length, crc, seq, epoch)
            self.index.unpin(entry)
            if landed:
                self._c["writes"] += 1
                self._c["bytes_written"] += length
        return (True, None) if landed else (False, "dropped while being written (clear or drop)")

    # ---------------------------------------------------------------- reads
    def read(self, key: Key, out: ByteBuffer) -> DiskIO:
        """Read `key`'s bytes into `out[:length]`, asynchronously; the handle's `ok` says whether they are there and
        verified. A miss is done at once (ok=False, error "miss"). A slot failing its CRC or record check is dropped
        and counted (`corrupt_dropped`), and its handle is not ok."""
        dst = as_byte_view(out, writable=True)
        key = (int(key[0]), key[1])
        with self._lock:
            self._check_open()
            entry = self.index.pin(key)
            if entry is None:
                self._c["misses"] += 1
                return DiskIO.finished(key, "read", False, "miss")
            if dst.nbytes < entry.length:
                self.index.unpin(entry)
                raise ValueError(f"read destination of {dst.nbytes} bytes is smaller than the entry "
                                 f"({entry.length} bytes)")
        return DiskIO(key, "read", self._pool.submit(self._do_read, entry, dst))

    def _do_read(self, entry: DiskEntry, dst: np.ndarray):
        length = entry.length
        why: str | None = None
        try:
            bounce, rec = self._bufs()
            fd = self._dfd
            if not self.direct or self._direct_ok(dst, length):
                target, span, bounced = dst[:length], length, False
            else:
                span = align_up(length)
                target, bounced = bounce[:span], True
            off = slot_offset(entry.slot, self.stride)
            if span == self._data_span:
                _preadv_all(fd, [target, rec], off)
            else:
                _preadv_all(fd, [target], off)
                _preadv_all(fd, [rec], off + self._data_span)
            if bounced:
                dst[:length] = bounce[:length]
            r = unpack_record(rec)
            if r is None or r.key != entry.key or r.seq != entry.seq or r.length != length or r.crc != entry.crc:
                why = "corrupt: slot record does not match"
            elif self._mac_key is not None:  # a verified tag covers every byte the data CRC does
                if not r.tag:
                    why = "unauthenticated: the slot has no tag (written without the secret)"
                elif not tag_verifies(self._mac_key, self._fp_digest, r, dst[:length]):
                    why = "mac: the slot's tag does not verify (forged, or written with another secret)"
            elif crc32(dst[:length]) != entry.crc:
                why = "corrupt: data CRC mismatch"
        except OSError as exc:
            why = f"read failed: {exc}"
        with self._lock:
            if why is None:
                self._c["hits"] += 1
                self._c["bytes_read"] += length
            else:
                reason = why.split(":", 1)[0]
                counter = {"corrupt": "corrupt_dropped", "unauthenticated": "rejected_unauthenticated",
                           "mac": "rejected_mac"}.get(reason, "read_errors")
                self._c[counter] += 1
                if self.index.get(entry.key) is entry:
                    self.index.drop(entry.key)
                # A forger can fill the file: a warning per reason, then debug lines (the counters keep the count).
                first = counter not in self._warned and reason in ("unauthenticated", "mac")
                self._warned.add(counter)
            self.index.unpin(entry)
        if why is not None:
            if why.startswith(("unauthenticated", "mac")) and not first:
                logger.debug("offload_connector: disk tier dropped %r (slot %d): %s", entry.key, entry.slot, why)
            else:
                logger.warning("offload_connector: disk tier dropped %r (slot %d): %s", entry.key, entry.slot, why)
            return False, why
        return True, None

    # ------------------------------------------------------------ the rest
    def contains(self, key: Key) -> bool:
        with self._lock:
            return self.index.contains((int(key[0]), key[1]))

    def __contains__(self, key: Key) -> bool:
        return self.contains(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self.index)

    def keys(self) -> list[Key]:
        """Readable keys, least recently used first."""
        with self._lock:
            return self.index.keys()

    def length_of(self, key: Key) -> int | None:
        with self._lock:
            e = self.index.get((int(key[0]), key[1]))
            return e.length if e is not None and e.ready else None

    def drop(self, key: Key) -> bool:
        """Forget `key` (its slot is reused once no read uses it). Its record stays on disk until the slot is
        rewritten, so a restart may find it again (the bytes are still valid); `clear()` forgets for good."""
        with self._lock:
            return self.index.drop((int(key[0]), key[1])) is not None

    def clear(self) -> None:
        """Forget every entry, also across restarts: the header's epoch moves on, so every record on disk is stale."""
        with self._lock:
            self._check_open()
            self.index.clear()
            self._epoch += 1
            self._write_header()

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(capacity_slots=self.num_slots, used_slots=self.index.used_slots(),
                             entries=len(self.index), evictions=self.index.evictions, direct_io=self.direct,
                             **self._c)

    def flush(self) -> None:
        """fsync the file: what has landed so far survives a power loss."""
        os.fsync(self._fd)

    def close(self) -> None:
        """Wait for the I/O in flight, fsync, close (idempotent)."""
        with self._lock:  # closed first, under the lock: no write can reserve a slot it could then never submit
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        os.fsync(self._fd)
        if self.direct:
            os.close(self._dfd)
        os.close(self._fd)  # releases the flock

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the disk tier is closed")

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
