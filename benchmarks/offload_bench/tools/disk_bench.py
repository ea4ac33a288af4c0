"""Disk tier throughput: N slots written and read through `DiskStore`, against the same disk's raw sequential
bandwidth measured in the same run (one file of the same size, large sequential O_DIRECT writes and reads).

Page cache: with O_DIRECT (the default where the filesystem allows it) neither the raw pass nor the store touches
the page cache, so reads come from the device. Where O_DIRECT is refused (tmpfs, some overlay filesystems) both fall
back to buffered I/O; the bench then fsyncs and asks the kernel to drop the file's cached pages
(posix_fadvise DONTNEED) before each read pass and says so in the output: reads may still be partly cached.

A second raw pass uses slot-sized sequential I/Os (one at a time), to tell the cost of the I/O size from the
store's own (CRC, records, hand-offs). Write times include the final fsync. Store times include the per-slot CRC-32
(computed on write, verified on read), the record block and the thread pool's hand-offs; `crc32` is the
single-thread checksum speed, for scale. `--repeat` rounds run every pass in turn; the table shows medians.

Read-back latency (once, after the rounds): half the slots are written, then `--loads` read-backs of
`--load-blocks` random slots each are timed as the worker issues them for one load (every read at once, into its
own buffer, then wait for all), first on an idle store, then while a writer thread keeps writing the other half's
slots through the same store (the disk tier's write-through of newly stored blocks, with at most
`2 x threads` writes in flight). Reads and writes share the store's I/O threads, so this is what a load waits for
when the tier is also being written. Every read-back's bytes are checked.

    .venv-vllm033/bin/offload-connector disk-bench [--dir DIR] [--total-mib 2048] [--slot-bytes 2621440]
        [--threads 2] [--chunk-mib 64] [--arena-slots 32] [--repeat 3] [--load-blocks 64] [--loads 20]
        [--no-direct] [--json]
"""
from __future__ import annotations

import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections import deque

import numpy as np

from offload_bench.args import OneLineParser, fail, int_in
from offload_connector.disk.format import ALIGN, HEADER_BYTES, align_up, DiskFingerprint, slot_stride
from offload_connector.disk.store import DiskStore

GEMMA4_31B_SLOT = 2621440  # 2.5 MiB: the CPU tier's slot for Gemma-4-31B


def _fail(message: str) -> None:
    sys.exit(fail("offload-connector disk-bench", message))


def _aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


def _fill(a: np.ndarray, seed: int) -> None:
    """Random bytes, cheaply: one random MiB tiled, then every 4 KiB stamped with its index (no two pages equal)."""
    mib = np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8)
    for off in range(0, a.nbytes, mib.nbytes):
        n = min(mib.nbytes, a.nbytes - off)
        a[off:off + n] = mib[:n]
    stamps = a[: a.nbytes // 4096 * 4096].reshape(-1, 4096)
    stamps[:, :8] = np.arange(stamps.shape[0], dtype=np.uint64).view(np.uint8).reshape(-1, 8)


def _drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def raw_pass(path: str, total: int, chunk: int, want_direct: bool) -> dict:
    buf = _aligned(chunk)
    _fill(buf, 1)
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    direct, why = False, "--no-direct"
    fd = -1
    if want_direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
            os.pwrite(fd, buf[:ALIGN], 0)
            direct, why = True, None
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            why = f"O_DIRECT refused: {exc}"
    if not direct:
        fd = os.open(path, flags, 0o644)
    try:
        t0 = time.perf_counter()
        off = 0
        while off < total:
            n = min(chunk, total - off)
            off += os.pwrite(fd, buf[:n], off)
        os.fsync(fd)
        t_write = time.perf_counter() - t0
        if not direct:
            _drop_cache(fd)
        t0 = time.perf_counter()
        off = 0
        while off < total:
            n = os.preadv(fd, [buf[:min(chunk, total - off)]], off)
            if n <= 0:
                raise OSError("short read")
            off += n
        t_read = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return dict(direct=direct, why=why, write_s=t_write, read_s=t_read)


def store_pass(directory: str, total: int, slot_bytes: int, threads: int, want_direct: bool,
               arena_slots: int) -> dict:
    n = total // slot_bytes
    fp = DiskFingerprint("bench", (slot_bytes,), (16,), "bfloat16", slot_bytes)
    src = _aligned(arena_slots * slot_bytes).reshape(arena_slots, slot_bytes)
    dst = _aligned(arena_slots * slot_bytes).reshape(arena_slots, slot_bytes)
    _fill(src.reshape(-1), 2)
    dst[:] = 1  # touch every page first, as a host tier in use is: page faults are not the disk's cost
    window = max(2 * threads, 4)
    window = min(window, arena_slots)
    keys = [(0, i.to_bytes(32, "big")) for i in range(n)]
    out: dict = {}
    s = DiskStore(directory, fp, HEADER_BYTES + n * slot_stride(slot_bytes), io_threads=threads, direct=want_direct)
    try:
        out.update(direct=s.direct, why=s.direct_reason)
        t0 = time.perf_counter()
        inflight: deque = deque()
        for i, k in enumerate(keys):
            if len(inflight) >= window and not inflight.popleft().wait():
                raise RuntimeError("a store write failed")
            inflight.append(s.write(k, src[i % arena_slots]))
        if not all(h.wait() for h in inflight):
            raise RuntimeError("a store write failed")
        s.flush()
        out["write_s"] = time.perf_counter() - t0

        def read_all(order: list[int]) -> float:
            if not s.direct:
                _drop_cache(s._fd)
            t0 = time.perf_counter()
            q: deque = deque()
            for j, i in enumerate(order):
                if len(q) >= window:
                    h, jj, ii = q.popleft()
                    if not h.wait():
                        raise RuntimeError(f"store read of slot {ii} failed: {h.error}")
                q.append((s.read(keys[i], dst[j % arena_slots]), j, i))
            for h, _, ii in q:
                if not h.wait():
                    raise RuntimeError(f"store read of slot {ii} failed: {h.error}")
            dt = time.perf_counter() - t0
            # spot check the bytes of the last window (CRC already verified every slot)
            for h, jj, ii in q:
                if not np.array_equal(dst[jj % arena_slots], src[ii % arena_slots]):
                    raise RuntimeError(f"slot {ii} read back different bytes")
            return dt

        out["read_seq_s"] = read_all(list(range(n)))
        order = list(range(n))
        np.random.default_rng(3).shuffle(order)
        out["read_rand_s"] = read_all(order)
        st = s.stats()
        out["stats"] = dict(writes=st.writes, hits=st.hits, misses=st.misses, corrupt_dropped=st.corrupt_dropped,
                            bytes_written=st.bytes_written, bytes_read=st.bytes_read)
    finally:
        s.close()
    out["slots"] = n
    return out


def latency_pass(directory: str, total: int, slot_bytes: int, threads: int, want_direct: bool,
                 load_blocks: int, loads: int) -> dict:
    """Read-back latency of one load (`load_blocks` slots read at once), idle and under a concurrent writer."""
    n = total // slot_bytes
    half = max(1, n // 2)
    k = min(load_blocks, half)
    fp = DiskFingerprint("bench", (slot_bytes,), (16,), "bfloat16", slot_bytes)
    keys = [(0, i.to_bytes(32, "big")) for i in range(n)]
    src = _aligned(8 * slot_bytes).reshape(8, slot_bytes)
    _fill(src.reshape(-1), 5)
    dst = _aligned(k * slot_bytes).reshape(k, slot_bytes)
    dst[:] = 1
    rng = np.random.default_rng(7)
    out: dict = dict(load_blocks=k, loads=loads, read_set_slots=half)
    s = DiskStore(directory, fp, HEADER_BYTES + n * slot_stride(slot_bytes), io_threads=threads, direct=want_direct)
    try:
        window = max(2 * threads, 4)
        inflight: deque = deque()
        for i in range(half):
            if len(inflight) >= window and not inflight.popleft().wait():
                raise RuntimeError("a store write failed")
            inflight.append(s.write(keys[i], src[i % 8]))
        if not all(h.wait() for h in inflight):
            raise RuntimeError("a store write failed")
        s.flush()

        def timed_loads() -> list[float]:
            if not s.direct:
                _drop_cache(s._fd)
            took = []
            for _ in range(loads):
                pick = rng.choice(half, size=k, replace=False)
                t0 = time.perf_counter()
                handles = [s.read(keys[i], dst[j]) for j, i in enumerate(pick)]
                ok = [h.wait() for h in handles]
                took.append(time.perf_counter() - t0)
                if not all(ok):
                    raise RuntimeError(f"a read-back failed: {next(h.error for h, o in zip(handles, ok) if not o)}")
                for j, i in enumerate(pick):
                    if not np.array_equal(dst[j], src[i % 8]):
                        raise RuntimeError(f"slot {i} read back different bytes")
            return took

        out["idle_s"] = timed_loads()
        stop = threading.Event()
        wrote = {"slots": 0, "seconds": 0.0, "failed": 0}

        def writer() -> None:
            # Round and round the other half's slots (each dropped before it is written again: a key already stored
            # is not rewritten), so the writes last as long as the loads.
            t0 = time.perf_counter()
            q: deque = deque()
            lap = 0
            while not stop.is_set():
                for i in range(half, n):
                    if stop.is_set():
                        break
                    if len(q) >= window and not q.popleft().wait():
                        wrote["failed"] += 1
                    if lap:
                        s.drop(keys[i])
                    q.append(s.write(keys[i], src[i % 8]))
                    wrote["slots"] += 1
                lap += 1
            wrote["failed"] += sum(1 for h in q if not h.wait())
            wrote["seconds"] = time.perf_counter() - t0

        w = threading.Thread(target=writer, name="disk-bench-writer")
        w.start()
        try:
            out["loaded_s"] = timed_loads()
        finally:
            stop.set()
            w.join()
        out["writer"] = wrote
    finally:
        s.close()
    return out


def _ms(v: list[float], q: float) -> float:
    return 1e3 * float(np.quantile(np.asarray(v), q))


def crc_speed(slot_bytes: int) -> float:
    a = _aligned(slot_bytes)
    _fill(a, 4)
    reps = max(1, (256 << 20) // slot_bytes)
    t0 = time.perf_counter()
    for _ in range(reps):
        zlib.crc32(a)
    return reps * slot_bytes / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="offload-connector disk-bench",
                      description="Disk tier (DiskStore) vs raw sequential disk bandwidth.")
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir under /tmp)")
    p.add_argument("--total-mib", type=int_in(1, 1 << 24), default=2048)
    p.add_argument("--slot-bytes", type=int_in(1, 1 << 34), default=GEMMA4_31B_SLOT)
    p.add_argument("--threads", type=int_in(1, 1 << 20), default=2, help="the store's I/O threads")
    p.add_argument("--chunk-mib", type=int_in(1, 1 << 20), default=64, help="raw pass: bytes per sequential write/read")
    p.add_argument("--arena-slots", type=int_in(1, 1 << 20), default=32, help="host buffer slots the store copies from/to")
    p.add_argument("--repeat", type=int_in(1, 1 << 20), default=3, help="rounds of all passes; the table shows each pass's median")
    p.add_argument("--load-blocks", type=int_in(1, 1 << 20), default=64, help="read-back latency: slots one load reads")
    p.add_argument("--loads", type=int_in(1, 1 << 20), default=20, help="read-back latency: loads timed, idle and under writes")
    p.add_argument("--no-direct", action="store_true", help="buffered I/O for both passes")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    if a.slot_bytes <= 0:
        _fail(f"--slot-bytes must be positive, got {a.slot_bytes}")
    if a.total_mib <= 0 or (a.total_mib << 20) < a.slot_bytes:
        _fail(f"--total-mib {a.total_mib} must hold at least one {a.slot_bytes}-byte slot")
    if a.threads < 1 or a.chunk_mib < 1 or a.arena_slots < 1 or a.repeat < 1 or a.load_blocks < 1 or a.loads < 1:
        _fail("--threads, --chunk-mib, --arena-slots, --repeat, --load-blocks and --loads must be at least 1")
    total = (a.total_mib << 20) // a.slot_bytes * a.slot_bytes  # the same bytes for both passes
    made = a.dir is None
    root = tempfile.mkdtemp(prefix="disk-bench-", dir="/tmp") if made else a.dir
    if not made:
        if not os.path.isdir(root):
            _fail(f"--dir {root} is not a directory")
    need = total + (total // a.slot_bytes) * (slot_stride(a.slot_bytes) - a.slot_bytes) + (64 << 20)
    free = shutil.disk_usage(root).free
    if free < need:
        if made:
            os.rmdir(root)  # nothing was written there yet
        _fail(f"--dir {root} has {free >> 20} MiB free, the bench needs {need >> 20} MiB")
    work = tempfile.mkdtemp(prefix="run-", dir=root)
    try:
        rounds = []
        for r in range(a.repeat):  # interleaved, so a noisy neighbour hits every pass alike
            raw = raw_pass(os.path.join(work, "raw.bin"), total, min(a.chunk_mib << 20, total), not a.no_direct)
            raw_slot = raw_pass(os.path.join(work, "raw.bin"), total, align_up(a.slot_bytes), not a.no_direct)
            store = store_pass(os.path.join(work, f"tier{r}"), total, a.slot_bytes, a.threads, not a.no_direct,
                               a.arena_slots)
            shutil.rmtree(os.path.join(work, f"tier{r}"), ignore_errors=True)
            rounds.append((raw, raw_slot, store))
        samples = {name: [rd[i][k] for rd in rounds] for name, i, k in (
            ("raw_w", 0, "write_s"), ("raw_r", 0, "read_s"), ("raws_w", 1, "write_s"), ("raws_r", 1, "read_s"),
            ("st_w", 2, "write_s"), ("st_rs", 2, "read_seq_s"), ("st_rr", 2, "read_rand_s"))}
        med = {k: statistics.median(v) for k, v in samples.items()}
        lat = latency_pass(os.path.join(work, "latency"), total, a.slot_bytes, a.threads, not a.no_direct,
                           a.load_blocks, a.loads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made:
            shutil.rmtree(root, ignore_errors=True)
    crc = crc_speed(a.slot_bytes)
    gib = total / (1 << 30)
    rows = [
        ("raw write (seq, fsync)", "raw_w", None),
        ("raw write (slot-size I/Os)", "raws_w", "raw_w"),
        ("store write (+fsync)", "st_w", "raw_w"),
        ("raw read (seq)", "raw_r", None),
        ("raw read (slot-size I/Os)", "raws_r", "raw_r"),
        ("store read (slot order)", "st_rs", "raw_r"),
        ("store read (random order)", "st_rr", "raw_r"),
    ]
    page_cache = ("no: O_DIRECT for raw and store" if raw["direct"] and store["direct"] else
                  "maybe: buffered I/O (" + (raw["why"] or store["why"] or "") + "); cache dropped with "
                  "fadvise(DONTNEED) before each read pass, best effort")
    result = dict(dir=root, total_bytes=total, slot_bytes=a.slot_bytes, slots=store["slots"], threads=a.threads,
                  chunk_bytes=a.chunk_mib << 20, raw_direct=raw["direct"], store_direct=store["direct"],
                  reads_hit_page_cache=page_cache, crc32_gbps=crc / 1e9, cpus=os.cpu_count(),
                  machine=platform.platform(), store_stats=store["stats"],
                  repeat=a.repeat, read_back=lat,
                  rows={name: dict(seconds_median=med[k], seconds_all=samples[k], gib_per_s=gib / med[k],
                                   vs_raw=(med[ref] / med[k] if ref else None)) for name, k, ref in rows})
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"disk tier bench: {gib:.2f} GiB, {store['slots']} slots of {a.slot_bytes} B, {a.threads} I/O threads, "
          f"dir {root}")
    print(f"page cache on reads: {page_cache}")
    print(f"medians of {a.repeat} interleaved rounds; GiB/s per round in brackets")
    print(f"{'pass':<28}{'seconds':>9}{'GiB/s':>9}{'vs raw':>8}  rounds")
    for name, k, ref in rows:
        t = med[k]
        each = " ".join(f"{gib / x:.2f}" for x in samples[k])
        print(f"{name:<28}{t:>9.2f}{gib / t:>9.2f}{(f'{med[ref] / t:.2f}' if ref else ''):>8}  [{each}]")
    print(f"crc32 (zlib, 1 thread): {crc / 1e9:.2f} GB/s; store stats: {store['stats']}")
    mib = lat["load_blocks"] * a.slot_bytes / (1 << 20)
    wr = lat["writer"]
    print(f"\nread-back of one load: {lat['load_blocks']} slots ({mib:.0f} MiB) read at once, {lat['loads']} loads "
          f"from {lat['read_set_slots']} written slots")
    print(f"{'':<28}{'p50 ms':>9}{'p95 ms':>9}{'max ms':>9}{'GiB/s':>9}")
    for name, v in (("idle store", lat["idle_s"]), ("under write-through", lat["loaded_s"])):
        print(f"{name:<28}{_ms(v, 0.5):>9.1f}{_ms(v, 0.95):>9.1f}{1e3 * max(v):>9.1f}"
              f"{mib / 1024 / statistics.median(v):>9.2f}")
    rate = wr["slots"] * a.slot_bytes / (1 << 30) / wr["seconds"] if wr["seconds"] else 0.0
    print(f"writer during the loaded pass: {wr['slots']} slots, {rate:.2f} GiB/s"
          + (f", {wr['failed']} writes failed" if wr["failed"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
