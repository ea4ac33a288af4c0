"""The disk tier's authenticated slots (`disk_secret_file`): a store opened with a MAC key tags every record and
serves a slot only if its tag verifies. A planted slot (valid framing and CRCs, no tag or a wrong one), a slot whose
bytes were swapped and its CRCs fixed up, and a slot copied in from a directory of another layout are dropped on read
and counted by reason; a torn record stays "corrupt"; stores without a key read tagged and untagged slots alike."""
from __future__ import annotations

import logging
import mmap
import os

import numpy as np
import pytest

from offload_connector.config import ConfigError, OffloadConfig
from offload_connector.disk import DiskFingerprint
from offload_connector.disk.format import (
    FILE_NAME, HEADER_BYTES, MAC_KEY_PURPOSE, RECORD_BYTES, Record, align_up, crc32, pack_record, slot_stride,
    unpack_record,
)
from offload_connector.disk.store import DiskStore
from offload_connector.remote.framing import derive_mac_key
from offload_connector.tier_auth import derive_key, mac_key_from_file

SLOT = 2 * 4096
FP = DiskFingerprint("test-model", (SLOT,), (16,), "bfloat16", SLOT)
STRIDE = slot_stride(SLOT)
KEY_A = derive_key(b"the engines' disk secret, 32 B!!", MAC_KEY_PURPOSE)
KEY_B = derive_key(b"somebody else's secret, 32 bytes", MAC_KEY_PURPOSE)
K1, K2 = (0, b"\x01" * 32), (0, b"\x02" * 32)


def arena(n: int, seed: int = 0) -> np.ndarray:
    a = np.frombuffer(mmap.mmap(-1, n * SLOT), dtype=np.uint8).reshape(n, SLOT)
    a[:] = np.random.default_rng(seed).integers(0, 256, size=a.shape, dtype=np.uint8)
    return a


def open_store(path, mac_key=None, fp=FP) -> DiskStore:
    return DiskStore(str(path), fp, HEADER_BYTES + 4 * STRIDE, mac_key=mac_key, direct=False)


def write(path, mac_key, items, fp=FP) -> None:
    with open_store(path, mac_key, fp) as s:
        assert all(s.write(k, v).wait() for k, v in items)


def read(path, mac_key, key, fp=FP) -> tuple[bool, np.ndarray, object]:
    out = arena(1, seed=99)[0]
    with open_store(path, mac_key, fp) as s:
        ok = s.read(key, out).wait()
        return ok, out, s.stats()


def slot_span(path, key) -> tuple[int, int]:
    """(data offset, record offset) of `key`'s slot, found by scanning the file like the index does."""
    raw = open(os.path.join(path, FILE_NAME), "rb").read()
    for slot in range((len(raw) - HEADER_BYTES) // STRIDE):
        off = HEADER_BYTES + slot * STRIDE
        rec = unpack_record(raw[off + align_up(SLOT):off + STRIDE])
        if rec is not None and rec.key == key:
            return off, off + align_up(SLOT)
    raise AssertionError(f"{key} not on disk")


def rewrite_slot(path, key, data: bytes | None = None, tag: bytes | None = None) -> None:
    """What a writer of the directory without the secret can do: put other bytes in `key`'s slot and frame them
    with valid CRCs, keeping the old tag (`tag` None), dropping it (b"") or setting one."""
    doff, roff = slot_span(path, key)
    fn = os.path.join(path, FILE_NAME)
    with open(fn, "r+b") as f:
        f.seek(roff)
        rec = unpack_record(f.read(RECORD_BYTES))
        if data is None:
            f.seek(doff)
            data = f.read(rec.length)
        forged = Record(rec.epoch, rec.seq, rec.key, len(data), crc32(data), rec.tag if tag is None else tag)
        f.seek(doff)
        f.write(data)
        f.seek(roff)
        f.write(pack_record(forged))


def test_a_keyed_store_reads_back_what_it_wrote_after_a_restart(tmp_path):
    src = arena(2)
    write(tmp_path, KEY_A, [(K1, src[0]), (K2, src[1])])
    ok, out, stats = read(tmp_path, KEY_A, K2)
    assert ok and np.array_equal(out, src[1])
    assert stats.rejected_mac == stats.rejected_unauthenticated == stats.corrupt_dropped == 0


def test_a_slot_written_without_the_secret_is_unauthenticated(tmp_path, caplog):
    src = arena(2)
    write(tmp_path, None, [(K1, src[0]), (K2, src[1])])  # e.g. planted by an engine without disk_secret_file
    with caplog.at_level(logging.DEBUG, logger="vllm.offload_connector.disk"):
        with open_store(tmp_path, KEY_A) as s:
            out = arena(1, seed=5)[0]
            assert not s.read(K1, out).wait()
            assert not s.read(K2, out).wait()
            stats = s.stats()
            assert stats.rejected_unauthenticated == 2 and stats.hits == 0
            assert not s.contains(K1) and not s.contains(K2)  # dropped: never read again
    # Once per store and reason, the rest at debug (caplog may hold a record once per handler: count records).
    warnings = {id(r) for r in caplog.records if r.levelno == logging.WARNING and "unauthenticated" in r.getMessage()}
    debug = {id(r) for r in caplog.records if r.levelno == logging.DEBUG and "unauthenticated" in r.getMessage()}
    assert len(warnings) == 1 and len(debug) == 1


def test_a_slot_with_other_bytes_and_fixed_crcs_fails_its_tag(tmp_path):
    src = arena(3)
    write(tmp_path, KEY_A, [(K1, src[0]), (K2, src[1])])
    rewrite_slot(tmp_path, K1, data=bytes(src[2]))  # valid KV of something else, CRCs recomputed, old tag kept
    ok, _, stats = read(tmp_path, None, K1)
    assert ok  # the forgery is well framed: a store without a secret cannot tell
    ok, _, stats = read(tmp_path, KEY_A, K1)
    assert not ok and stats.rejected_mac == 1 and stats.corrupt_dropped == 0


def test_a_tag_made_with_another_secret_does_not_verify(tmp_path):
    src = arena(1)
    write(tmp_path, KEY_B, [(K1, src[0])])
    ok, _, stats = read(tmp_path, KEY_A, K1)
    assert not ok and stats.rejected_mac == 1


def test_a_tagged_slot_moved_to_another_layouts_directory_does_not_verify(tmp_path):
    other = DiskFingerprint("test-model", (SLOT,), (16,), "bfloat16", SLOT, extra="tp 1/2")
    src = arena(1)
    a, b = tmp_path / "a", tmp_path / "b"
    write(a, KEY_A, [(K1, src[0])])
    write(b, KEY_A, [(K2, src[0])], fp=other)
    doff_a, _ = slot_span(str(a), K1)
    doff_b, _ = slot_span(str(b), K2)
    raw = open(a / FILE_NAME, "rb").read()[doff_a:doff_a + STRIDE]
    with open(b / FILE_NAME, "r+b") as f:  # the whole slot, data, record and tag, into the other directory
        f.seek(doff_b)
        f.write(raw)
    with open_store(b, KEY_A, other) as s:
        assert s.contains(K1)  # the index takes the record at open; the tag is checked on read
        assert not s.read(K1, arena(1)[0]).wait()
        assert s.stats().rejected_mac == 1


def test_a_torn_tag_is_corrupt_not_forged(tmp_path):
    src = arena(1)
    write(tmp_path, KEY_A, [(K1, src[0])])
    _, roff = slot_span(str(tmp_path), K1)
    fn = os.path.join(tmp_path, FILE_NAME)
    with open(fn, "r+b") as f:
        f.seek(roff)
        rec = bytearray(f.read(RECORD_BYTES))
        tag_at = bytes(rec).index(unpack_record(bytes(rec)).tag)
        rec[tag_at + 3] ^= 0xFF  # the record CRC covers the tag
        f.seek(roff)
        f.write(rec)
    with open_store(tmp_path, KEY_A) as s:
        assert not s.contains(K1)  # dropped at open like any corrupt record
        assert s.stats().corrupt_dropped == 1 and s.stats().rejected_mac == 0


def test_a_store_without_a_key_reads_tagged_and_untagged_slots(tmp_path):
    src = arena(2)
    write(tmp_path, KEY_A, [(K1, src[0])])
    write(tmp_path, None, [(K2, src[1])])
    with open_store(tmp_path, None) as s:
        out = arena(1, seed=3)[0]
        assert s.read(K1, out).wait() and np.array_equal(out, src[0])
        assert s.read(K2, out).wait() and np.array_equal(out, src[1])


def test_the_disk_key_differs_from_the_shared_tiers_for_one_secret(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"one secret for both tiers, 32 B\n")
    disk = mac_key_from_file(str(secret), "disk_secret_file", MAC_KEY_PURPOSE)
    assert len(disk) == 32 and disk != derive_mac_key(secret.read_bytes().strip())
    assert mac_key_from_file(None, "disk_secret_file", MAC_KEY_PURPOSE) is None


def test_disk_secret_file_is_checked_at_the_edge(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 20)
    base = {"cpu_bytes": "1G", "disk_path": str(tmp_path / "d"), "disk_bytes": "1G"}
    cfg = OffloadConfig.from_extra_config({**base, "disk_secret_file": str(secret)})
    assert cfg.disk_secret_file == str(secret)
    (tmp_path / "short").write_bytes(b"x" * 8)
    for value, match in ((str(tmp_path / "short"), "'disk_secret_file' .* holds 8 bytes"),
                         (str(tmp_path / "missing"), "'disk_secret_file' .* is not a regular file"),
                         ("a\x00b", "'disk_secret_file' must be the path of a file"),
                         (7, "'disk_secret_file' must be the path of a file")):
        with pytest.raises(ConfigError, match=match):
            OffloadConfig.from_extra_config({**base, "disk_secret_file": value})
    with pytest.raises(ConfigError, match="'disk_secret_file' needs the disk tier"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1G", "disk_secret_file": str(secret)})


def test_a_new_store_keeps_its_directory_to_its_owner(tmp_path):
    path = tmp_path / "tier"
    with open_store(path, KEY_A):
        pass
    assert (os.stat(path).st_mode & 0o077) == 0
    assert (os.stat(path / FILE_NAME).st_mode & 0o077) == 0
