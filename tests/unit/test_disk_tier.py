"""The disk tier's storage layer (`offload_connector.disk`): round trips, restart recovery, fingerprint refusal,
torn/corrupt slot detection, LRU within the budget, concurrent async I/O, O_DIRECT fallback, torch-free index."""
from __future__ import annotations

import errno
import logging
import mmap
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from offload_connector.disk import DiskFingerprint, DiskIndex, FingerprintMismatch, scan_directory
from offload_connector.disk.format import FILE_NAME, HEADER_BYTES, slot_stride
from offload_connector.disk.store import DiskStore

SLOT = 3 * 4096  # small slots keep the tests fast; the format is the same at 2.5 MiB
FP = DiskFingerprint("test-model", (SLOT, 2 * 4096), (16, 16), "bfloat16", SLOT)
STRIDE = slot_stride(SLOT)


def budget(slots: int) -> int:
    return HEADER_BYTES + slots * STRIDE


def arena(n: int, nbytes: int = SLOT, seed: int = 0) -> np.ndarray:
    """A page-aligned (n, nbytes) uint8 arena of random bytes, like the host tier (O_DIRECT straight into it)."""
    a = np.frombuffer(mmap.mmap(-1, n * nbytes), dtype=np.uint8).reshape(n, nbytes)
    a[:] = np.random.default_rng(seed).integers(0, 256, size=a.shape, dtype=np.uint8)
    return a


def slot_of(store: DiskStore, key) -> int:
    return store.index.get(key).slot


def patch_file(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct(request):
    return request.param


def test_round_trip(tmp_path, direct):
    src = arena(4)
    unaligned = np.random.default_rng(1).integers(0, 256, size=5000, dtype=np.uint8)  # bounce-buffer path
    with DiskStore(str(tmp_path), FP, budget(8), direct=direct) as s:
        if direct:
            assert s.direct, s.direct_reason  # ext4/xfs under /tmp: O_DIRECT works
        keys = [(0, b"\x01" * 32), (1, 7), (0, -(2 ** 70)), (1, b"short")]
        assert all(s.write(k, src[i]).wait() for i, k in enumerate(keys[:3]))
        assert s.write(keys[3], unaligned).wait()
        out = arena(4, seed=9)
        for i, k in enumerate(keys[:3]):
            h = s.read(k, out[i])
            assert h.wait() and h.error is None
            assert np.array_equal(out[i], src[i])
        small = bytearray(6000)
        assert s.read(keys[3], small).wait()
        assert bytes(small[:5000]) == unaligned.tobytes() and bytes(small[5000:]) == bytes(1000)
        assert s.length_of(keys[3]) == 5000
        miss = s.read((0, b"nope"), out[0])
        assert miss.done() and not miss.ok and miss.error == "miss"
        st = s.stats()
        assert (st.writes, st.hits, st.misses, st.corrupt_dropped) == (4, 4, 1, 0)
        assert st.bytes_written == st.bytes_read == 3 * SLOT + 5000
        with pytest.raises(ValueError):
            s.write((0, b"big"), np.zeros(SLOT + 1, np.uint8))
        with pytest.raises(ValueError):
            s.read(keys[0], bytearray(SLOT - 1))


def test_torch_views_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    src = torch.randn(SLOT // 2, dtype=torch.float32).to(torch.bfloat16)  # SLOT bytes of bf16
    dst = torch.zeros_like(src)
    with DiskStore(str(tmp_path), FP, budget(2)) as s:
        assert s.write((0, b"t"), src).wait()
        assert s.read((0, b"t"), dst).wait()
    assert torch.equal(src.view(torch.int16), dst.view(torch.int16))


def test_restart_recovers_index_and_lru_order(tmp_path, direct):
    src = arena(5)
    keys = [(i % 2, bytes([i]) * 32) for i in range(5)]
    s = DiskStore(str(tmp_path), FP, budget(8), direct=direct)
    for i, k in enumerate(keys):
        assert s.write(k, src[i]).wait()
    s.read(keys[0], np.empty(SLOT, np.uint8)).wait()  # reads are not persisted: order after restart = write order
    s.close()

    s2 = DiskStore(str(tmp_path), FP, budget(8), direct=direct)
    assert s2.stats().recovered_entries == 5
    assert s2.keys() == keys
    out = arena(5, seed=3)
    for i, k in enumerate(keys):
        assert s2.read(k, out[i]).wait()
        assert np.array_equal(out[i], src[i])
    # the sequence continues: a key written now is the newest after the next restart, and slots are not reused
    assert s2.write((0, 99), src[0]).wait()
    assert len({slot_of(s2, k) for k in keys + [(0, 99)]}) == 6
    s2.close()
    with DiskStore(str(tmp_path), FP, budget(8), direct=direct) as s3:
        assert s3.keys() == keys + [(0, 99)]
    # the scheduler side can rebuild the same index without opening the store
    header, found, corrupt = scan_directory(str(tmp_path), FP)
    assert {r.key for _, r in found} == set(keys + [(0, 99)]) and len(found) == 6
    assert corrupt == 0 and header.num_slots == 8


@pytest.mark.parametrize("field", ["model", "group_block_bytes", "block_sizes", "dtype", "slot_bytes", "vllm"])
def test_different_fingerprint_is_refused(tmp_path, field, caplog):
    src = arena(1)
    with DiskStore(str(tmp_path), FP, budget(4)) as s:
        assert s.write((0, b"k"), src[0]).wait()
    path = os.path.join(tmp_path, FILE_NAME)
    before = open(path, "rb").read()
    other = {"model": dict(model="other-model"), "group_block_bytes": dict(group_block_bytes=(SLOT, 4096)),
             "block_sizes": dict(block_sizes=(16, 32)), "dtype": dict(dtype="float8_e4m3fn"),
             "slot_bytes": dict(slot_bytes=2 * SLOT), "vllm": dict(vllm="0.34")}[field]
    fp2 = DiskFingerprint(**{**FP.__dict__, **other})
    with pytest.raises(FingerprintMismatch, match=field):
        DiskStore(str(tmp_path), fp2, budget(4))
    assert open(path, "rb").read() == before  # refused without touching the file
    with pytest.raises(FingerprintMismatch):
        scan_directory(str(tmp_path), fp2)
    # the opt-in alternative: an empty tier and a warning
    with caplog.at_level(logging.WARNING):
        with DiskStore(str(tmp_path), fp2, HEADER_BYTES + 4 * slot_stride(fp2.slot_bytes), on_mismatch="reset") as s:
            assert len(s) == 0 and not s.contains((0, b"k"))
    assert any("different model" in r.getMessage() for r in caplog.records)
    with DiskStore(str(tmp_path), fp2, HEADER_BYTES + 4 * slot_stride(fp2.slot_bytes)) as s:
        assert len(s) == 0  # the reset stuck: the directory is now fp2's


def test_corrupt_header_is_refused(tmp_path):
    with DiskStore(str(tmp_path), FP, budget(2)):
        pass
    patch_file(os.path.join(tmp_path, FILE_NAME), 40, b"\xff")
    from offload_connector.disk import DiskFormatError
    with pytest.raises(DiskFormatError, match="corrupt"):
        DiskStore(str(tmp_path), FP, budget(2))


def _three(tmp_path, direct=True):
    src = arena(3)
    keys = [(0, b"a"), (0, b"b"), (1, b"c")]
    with DiskStore(str(tmp_path), FP, budget(4), direct=direct) as s:
        for i, k in enumerate(keys):
            assert s.write(k, src[i]).wait()
        slots = [slot_of(s, k) for k in keys]
    return src, keys, slots, os.path.join(tmp_path, FILE_NAME)


def test_truncated_file_drops_the_torn_slot(tmp_path):
    src, keys, slots, path = _three(tmp_path)
    assert slots == [0, 1, 2]
    os.truncate(path, HEADER_BYTES + 2 * STRIDE + SLOT // 2)  # a crash mid-way through slot 2's data
    with DiskStore(str(tmp_path), FP, budget(4)) as s:
        assert s.contains(keys[0]) and s.contains(keys[1]) and not s.contains(keys[2])
        h = s.read(keys[2], np.empty(SLOT, np.uint8))
        assert not h.wait() and h.error == "miss"
        out = np.empty(SLOT, np.uint8)
        assert s.read(keys[1], out).wait() and np.array_equal(out, src[1])
        assert os.path.getsize(path) == budget(4)  # preallocated again


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_flipped_data_bytes_are_never_returned(tmp_path, direct):
    src, keys, slots, path = _three(tmp_path, direct)
    patch_file(path, HEADER_BYTES + slots[1] * STRIDE + 123, bytes([src[1][123] ^ 0x40]))
    with DiskStore(str(tmp_path), FP, budget(4), direct=direct) as s:
        assert s.contains(keys[1])  # the record is intact; the data is checked when read
        h = s.read(keys[1], np.empty(SLOT, np.uint8))
        assert not h.wait() and h.error.startswith("corrupt")
        assert not s.contains(keys[1]) and s.stats().corrupt_dropped == 1 and s.stats().hits == 0
        out = np.empty(SLOT, np.uint8)
        assert s.read(keys[0], out).wait() and np.array_equal(out, src[0])
    # verify_on_open finds it at open instead
    src, keys, slots, path = _three(tmp_path / "b", direct)
    patch_file(path, HEADER_BYTES + slots[2] * STRIDE + SLOT - 1, bytes([src[2][-1] ^ 1]))
    with DiskStore(str(tmp_path / "b"), FP, budget(4), direct=direct, verify_on_open=True) as s:
        assert not s.contains(keys[2]) and s.contains(keys[0]) and s.stats().corrupt_dropped == 1


def test_corrupt_record_is_dropped_at_open(tmp_path):
    src, keys, slots, path = _three(tmp_path)
    rec_off = HEADER_BYTES + slots[0] * STRIDE + SLOT  # SLOT is 4 KiB aligned: the record follows the data
    patch_file(path, rec_off + 30, b"\x55\xaa")
    with DiskStore(str(tmp_path), FP, budget(4)) as s:
        assert not s.contains(keys[0]) and s.contains(keys[1]) and s.contains(keys[2])
        assert s.stats().corrupt_dropped == 1 and s.stats().recovered_entries == 2
        # the slot is free again and reusable
        assert s.write((0, b"new"), src[0]).wait() and slot_of(s, (0, b"new")) == slots[0]


def test_crash_during_a_rewrite_is_detected(tmp_path):
    """The slot held key a; a crash while it was being rewritten for another key left a's record over half-new data."""
    src, keys, slots, path = _three(tmp_path)
    patch_file(path, HEADER_BYTES + slots[0] * STRIDE, bytes(SLOT // 2))
    with DiskStore(str(tmp_path), FP, budget(4)) as s:
        h = s.read(keys[0], np.empty(SLOT, np.uint8))
        assert not h.wait() and "CRC" in h.error and not s.contains(keys[0])


def test_corruption_under_an_open_store(tmp_path, direct):
    src = arena(1)
    with DiskStore(str(tmp_path), FP, budget(2), direct=direct) as s:
        assert s.write((0, b"x"), src[0]).wait()
        patch_file(os.path.join(tmp_path, FILE_NAME), HEADER_BYTES + slot_of(s, (0, b"x")) * STRIDE + 7,
                   bytes([src[0][7] ^ 0xFF]))
        assert not s.read((0, b"x"), np.empty(SLOT, np.uint8)).wait()
        assert s.stats().corrupt_dropped == 1


def test_lru_eviction_within_budget(tmp_path):
    src = arena(6)
    keys = [(0, bytes([i])) for i in range(6)]
    with DiskStore(str(tmp_path), FP, budget(4) + STRIDE - 1) as s:  # room for 4 slots, not 5
        assert s.num_slots == 4
        for i in range(4):
            assert s.write(keys[i], src[i]).wait()
        assert s.read(keys[0], np.empty(SLOT, np.uint8)).wait()  # 0 becomes most recently used
        assert s.write(keys[0], src[0]).wait()  # already stored: no second copy
        assert s.write(keys[4], src[4]).wait()  # evicts 1, the least recently used
        assert not s.contains(keys[1]) and s.contains(keys[0])
        assert s.write(keys[5], src[5]).wait()  # evicts 2
        assert s.keys() == [keys[3], keys[0], keys[4], keys[5]]
        st = s.stats()
        assert st.evictions == 2 and st.entries == 4 and st.used_slots == 4 and st.writes == 6
        assert os.path.getsize(s.path) <= budget(4) + STRIDE - 1
        out = np.empty(SLOT, np.uint8)
        assert s.read(keys[4], out).wait() and np.array_equal(out, src[4])
        assert not s.read(keys[1], out).wait()


def test_index_pins_block_eviction_and_drop_retires():
    idx = DiskIndex(2)
    entries = []
    for k in [(0, b"a"), (0, b"b")]:
        slot, ev = idx.reserve(k)
        assert slot is not None and ev == []
        e = idx.get(k)
        idx.commit(e, 10, 1, len(entries), 0)
        entries.append(e)
    assert idx.pin((0, b"a")) is entries[0] and idx.pin((0, b"b")) is entries[1]
    assert idx.reserve((0, b"c")) == (None, [])  # both pinned by reads: nothing to evict
    idx.unpin(entries[1])
    slot, ev = idx.reserve((0, b"c"))
    assert ev == [(0, b"b")] and slot == entries[1].slot
    idx.drop((0, b"a"))  # pinned: leaves the index, keeps its slot until unpinned
    assert not idx.contains((0, b"a")) and idx.reserve((0, b"d")) == (None, [])
    idx.unpin(entries[0])
    assert idx.reserve((0, b"d"))[0] == entries[0].slot


def test_budget_shrink_on_reopen(tmp_path):
    src = arena(4)
    with DiskStore(str(tmp_path), FP, budget(4)) as s:
        for i in range(4):
            assert s.write((0, i), src[i]).wait()
    with DiskStore(str(tmp_path), FP, budget(2)) as s:
        assert s.keys() == [(0, 0), (0, 1)] and os.path.getsize(s.path) == budget(2)


def test_concurrent_async_writes_and_reads(tmp_path):
    n = 48
    src = arena(n, seed=5)
    out = arena(n, seed=6)
    with DiskStore(str(tmp_path), FP, budget(n), io_threads=4) as s:
        first = [s.write((0, i), src[i]) for i in range(n // 2)]
        # reads of the first half race writes of the second half, from several caller threads
        errors: list = []

        def reader(part):
            try:
                for i in part:
                    first[i].wait(timeout=30)
                    assert s.read((0, i), out[i]).wait(timeout=30), i
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(range(j, n // 2, 3),)) for j in range(3)]
        for t in threads:
            t.start()
        second = [s.write((1, i), src[i]) for i in range(n // 2, n)]
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert all(h.wait(timeout=30) for h in first + second)
        pending = [s.read((1, i), out[i]) for i in range(n // 2, n)]
        while not all(h.done() for h in pending):  # polling, as the worker would each step
            pass
        assert all(h.ok for h in pending)
        assert np.array_equal(out, src)
        st = s.stats()
        assert st.writes == n and st.hits == n and st.corrupt_dropped == 0 and st.bytes_read == n * SLOT


def test_o_direct_refused_falls_back_to_buffered(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    src = arena(1)
    with caplog.at_level(logging.WARNING):
        with DiskStore(str(tmp_path), FP, budget(2)) as s:
            assert not s.direct and "O_DIRECT" in s.direct_reason and not s.stats().direct_io
            out = np.empty(SLOT, np.uint8)
            assert s.write((0, b"k"), src[0]).wait() and s.read((0, b"k"), out).wait()
            assert np.array_equal(out, src[0])
    assert any("buffered I/O" in r.getMessage() for r in caplog.records)


def test_one_process_per_directory_and_clear(tmp_path):
    src = arena(2)
    with DiskStore(str(tmp_path), FP, budget(2)) as s:
        with pytest.raises(BlockingIOError):
            DiskStore(str(tmp_path), FP, budget(2))
        assert s.write((0, b"a"), src[0]).wait()
        s.clear()
        assert len(s) == 0
        assert s.write((0, b"b"), src[1]).wait()
    with DiskStore(str(tmp_path), FP, budget(2)) as s:  # clear() holds across a restart
        assert s.keys() == [(0, b"b")] and s.stats().corrupt_dropped == 0
    with pytest.raises(RuntimeError):
        s.write((0, b"c"), src[0])


def test_index_imports_without_torch_or_numpy(tmp_path):
    src = arena(1)
    with DiskStore(str(tmp_path), FP, budget(2)) as s:
        assert s.write((1, 5), src[0]).wait()
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "from offload_connector.disk import DiskFingerprint, DiskIndex, scan_directory\n"
        f"fp = DiskFingerprint('test-model', ({SLOT}, 8192), (16, 16), 'bfloat16', {SLOT})\n"
        f"h, found, bad = scan_directory({str(tmp_path)!r}, fp)\n"
        "idx = DiskIndex(h.num_slots); idx.restore(found)\n"
        "assert idx.contains((1, 5)) and bad == 0, (found, bad)\n"
        "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_close_marks_the_store_closed_before_the_pool_stops(tmp_path):
    """A write after (or racing) close() is refused outright; it never reserves a slot it cannot submit."""
    s = DiskStore(str(tmp_path), FP, budget(4))
    data = arena(1)[0]
    assert s.write((0, b"a"), data).wait()
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.write((0, b"b"), data)
    assert s.index.get((0, b"b")) is None


def test_full_filesystem_without_preallocation_fails_writes_cleanly(tmp_path, monkeypatch):
    """Where the filesystem cannot preallocate (the file is sparse), a full filesystem makes writes fail with
    ENOSPC: each is a failed write (counted, slot released, never readable), reads of what landed before still
    return its bytes, and the store keeps working once space comes back. Uses a small tmpfs (root) so the
    filesystem really is full."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CI runs as root): {proc.stderr.strip()}")
    try:
        def no_prealloc(fd, off, n):
            raise OSError(errno.EOPNOTSUPP, "preallocation refused (test)")
        monkeypatch.setattr(os, "posix_fallocate", no_prealloc)
        a = arena(12)
        with DiskStore(str(mnt / "tier"), FP, budget(24), direct=False) as store:
            first = [store.write((0, b"k%d" % i), a[i]) for i in range(4)]
            assert all(io.wait(10) and io.ok for io in first)
            with open(mnt / "filler", "wb", buffering=0) as f:  # the rest of the filesystem
                try:
                    while True:
                        f.write(b"\0" * 4096)
                        f.flush()
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
            late = [store.write((0, b"k%d" % i), a[i]) for i in range(4, 12)]
            for io in late:
                io.wait(10)  # returns ok: False here, within the deadline (a hang would raise TimeoutError)
            failed = [io for io in late if not io.ok]
            assert failed and all("write failed" in io.error for io in failed), [io.error for io in late]
            assert store.stats().write_errors == len(failed)
            for io in failed:
                assert not store.contains(io.key)
            # What landed before still reads back exactly.
            out = arena(1)
            for i in range(4):
                assert store.read((0, b"k%d" % i), out[0]).wait(10)
                assert np.array_equal(out[0], a[i])
            os.unlink(mnt / "filler")
            again = store.write(failed[0].key, a[int(failed[0].key[1][1:])])
            assert again.wait(10) and again.ok
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
