"""The disk tier's on-disk format: one file, `slots.bin`, in the tier's directory.

    offset 0               header block (HEADER_BYTES = 4 KiB): magic, format version, epoch, slot size, slot stride,
                           slot count, the fingerprint (JSON), CRC-32 of the header
    HEADER_BYTES + i*stride slot i: data region (`slot_bytes` rounded up to ALIGN), then one record block (ALIGN
                           bytes): magic, format version, flags, epoch, sequence number, key (group, hash), data
                           length, CRC-32 of the data, (flags bit 0) a 32-byte tag, CRC-32 of the record

Everything is 4 KiB aligned so the file can be opened with O_DIRECT. A slot is valid when its record parses, its
record CRC matches, its epoch equals the header's (a cache reset bumps the header's epoch, which invalidates every
record at once) and, when the data is read, the data CRC matches. The data CRC is what makes a torn write harmless:
a crash while a slot is rewritten leaves either the old record over new (or half-new) data or a half-written record,
and both fail a CRC. Sequence numbers order the records (LRU order after a restart; the newer of two records of one
key wins).

CRCs catch accidents, not intent: whoever can write the file can plant bytes with valid CRCs under any key. A tier
opened with a secret (`disk_secret_file`) tags every record with HMAC-SHA256(MAC key, fingerprint digest || record
fields || data) and reads only slots whose tag verifies (`record_tag`), so a slot written without the secret, moved
from a directory of another layout, or whose key, length or bytes were changed is never served. Records of a tier
without a secret carry no tag (flags 0: the files of earlier builds read as such).

Plain Python (struct, zlib, json, hmac): the scheduler side may import this module without torch or numpy.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
import zlib
from dataclasses import asdict, dataclass
from typing import Hashable

FORMAT_VERSION = 1
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers (covers 512 B and 4 KiB logical blocks)
HEADER_BYTES = ALIGN
RECORD_BYTES = ALIGN
FILE_NAME = "slots.bin"
HEADER_MAGIC = b"OCDISK01"
RECORD_MAGIC = b"OCDR"
MAX_KEY_BYTES = 1024

_HEADER = struct.Struct("<8sIQQQQI")  # magic, version, epoch, slot_bytes, stride, num_slots, fingerprint json length
# magic, version, flags, epoch, seq, group, key kind, key length, data length, data crc (flags: bytes that were padding
# in the first records, so those read as untagged)
_RECORD = struct.Struct("<4sHHQQIBxHQI")
_CRC = struct.Struct("<I")
KEY_BYTES, KEY_INT = 0, 1
FLAG_TAG = 1
TAG_BYTES = 32  # HMAC-SHA256
MAC_KEY_PURPOSE = b"oc-disk-mac-key"  # tier_auth.derive_key: the disk tier's key differs from the shared tier's


class DiskFormatError(ValueError):
    """The directory holds a file this version cannot read (bad magic, bad header CRC, unknown version)."""


class FingerprintMismatch(DiskFormatError):
    """The directory was written for another model, KV layout, dtype or format version."""


def crc32(data) -> int:
    """CRC-32 (zlib) of a bytes-like object; zlib releases the GIL for large buffers."""
    return zlib.crc32(data) & 0xFFFFFFFF


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class DiskFingerprint:
    """What must match for a directory's bytes to mean the same KV blocks: the model, each KV cache group's block
    bytes and block size (tokens), the KV dtype, the slot size, and anything else the caller folds into `extra`
    (e.g. TP rank/size, KV layout name, cache dtype scaling). The format version is checked separately."""
    model: str
    group_block_bytes: tuple[int, ...]
    block_sizes: tuple[int, ...]
    dtype: str
    slot_bytes: int
    extra: str = ""
    vllm: str = ""  # the vLLM minor release that wrote the blocks (files from before this field read as "")

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_block_bytes", tuple(int(b) for b in self.group_block_bytes))
        object.__setattr__(self, "block_sizes", tuple(int(b) for b in self.block_sizes))
        if self.slot_bytes <= 0 or any(b <= 0 or b > self.slot_bytes for b in self.group_block_bytes):
            raise ValueError(f"fingerprint: every group block must fit one slot ({self.group_block_bytes} vs "
                             f"slot_bytes={self.slot_bytes})")
        if len(self.block_sizes) != len(self.group_block_bytes):
            raise ValueError("fingerprint: one block size per group")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "DiskFingerprint":
        d = json.loads(raw.decode())
        return cls(model=d["model"], group_block_bytes=tuple(d["group_block_bytes"]),
                   block_sizes=tuple(d["block_sizes"]), dtype=d["dtype"], slot_bytes=d["slot_bytes"],
                   extra=d.get("extra", ""), vllm=d.get("vllm", ""))

    def differences(self, other: "DiskFingerprint") -> list[str]:
        a, b = asdict(self), asdict(other)
        return [f"{k}: {b[k]!r} on disk, {a[k]!r} wanted" for k in a if a[k] != b[k]]


def slot_stride(slot_bytes: int) -> int:
    return align_up(slot_bytes) + RECORD_BYTES


@dataclass(frozen=True)
class Header:
    version: int
    epoch: int
    slot_bytes: int
    stride: int
    num_slots: int
    fingerprint: DiskFingerprint


def pack_header(h: Header) -> bytes:
    fp = h.fingerprint.to_json()
    body = _HEADER.pack(HEADER_MAGIC, h.version, h.epoch, h.slot_bytes, h.stride, h.num_slots, len(fp)) + fp
    if len(body) + _CRC.size > HEADER_BYTES:
        raise ValueError(f"fingerprint too long for the {HEADER_BYTES}-byte header ({len(fp)} bytes of JSON)")
    body += _CRC.pack(crc32(body))
    return body + bytes(HEADER_BYTES - len(body))


def unpack_header(raw: bytes) -> Header:
    if len(raw) < _HEADER.size or raw[:8] != HEADER_MAGIC:
        raise DiskFormatError("not a disk-tier file (bad magic)")
    magic, version, epoch, slot_bytes, stride, num_slots, fp_len = _HEADER.unpack_from(raw)
    end = _HEADER.size + fp_len
    if end + _CRC.size > len(raw) or _CRC.unpack_from(raw, end)[0] != crc32(raw[:end]):
        raise DiskFormatError("disk-tier header is corrupt (CRC mismatch)")
    if version != FORMAT_VERSION:
        raise FingerprintMismatch(f"format version {version} on disk, this build reads version {FORMAT_VERSION}")
    return Header(version, epoch, slot_bytes, stride, num_slots, DiskFingerprint.from_json(raw[_HEADER.size:end]))


def encode_key_hash(h: Hashable) -> tuple[int, bytes]:
    """A vLLM block hash as (kind, bytes): bytes as themselves, an int as signed big-endian."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        raw = bytes(h)
        kind = KEY_BYTES
    elif isinstance(h, int) and not isinstance(h, bool):
        raw = h.to_bytes(max(1, (h.bit_length() + 8) // 8), "big", signed=True)
        kind = KEY_INT
    else:
        raise TypeError(f"disk tier keys hash bytes or ints, got {type(h).__name__}")
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"block hash of {len(raw)} bytes exceeds {MAX_KEY_BYTES}")
    return kind, raw


def decode_key_hash(kind: int, raw: bytes) -> Hashable:
    if kind == KEY_BYTES:
        return raw
    if kind == KEY_INT:
        return int.from_bytes(raw, "big", signed=True)
    raise DiskFormatError(f"unknown key kind {kind}")


@dataclass(frozen=True)
class Record:
    epoch: int
    seq: int
    key: tuple[int, Hashable]
    length: int
    crc: int
    tag: bytes = b""  # the record's MAC (TAG_BYTES) when its tier has a secret, else empty


def record_fields(rec: Record, tagged: bool) -> bytes:
    """The record's fields as stored (before the tag and the record CRC): what a tag covers besides the data."""
    group, h = rec.key
    kind, raw = encode_key_hash(h)
    return _RECORD.pack(RECORD_MAGIC, FORMAT_VERSION, FLAG_TAG if tagged else 0, rec.epoch, rec.seq, group, kind,
                        len(raw), rec.length, rec.crc) + raw


def fingerprint_digest(fp: DiskFingerprint) -> bytes:
    """16 bytes naming the directory's model, layout and release in every tag (a tagged slot copied into a directory
    of another layout does not verify there)."""
    return hashlib.blake2b(fp.to_json(), digest_size=16, person=b"ocdisk-fp").digest()


def record_tag(mac_key: bytes, fp_digest: bytes, rec: Record, data) -> bytes:
    """HMAC-SHA256 over the fingerprint digest, the record's fields (epoch, sequence, key, length, data CRC) and the
    data; hashlib releases the GIL on large buffers."""
    h = hmac.new(mac_key, fp_digest, "sha256")
    h.update(record_fields(rec, tagged=True))
    h.update(data)
    return h.digest()


def tag_verifies(mac_key: bytes, fp_digest: bytes, rec: Record, data) -> bool:
    return bool(rec.tag) and hmac.compare_digest(record_tag(mac_key, fp_digest, rec, data), rec.tag)


def pack_record(rec: Record, into: "bytearray | memoryview | None" = None) -> bytes | None:
    """The record block (RECORD_BYTES), tagged when `rec.tag` is set. With `into`, written there (zero padded) and
    None returned. The record CRC covers the tag, so a torn record is corrupt, never a bad tag."""
    if rec.tag and len(rec.tag) != TAG_BYTES:
        raise ValueError(f"a record tag is {TAG_BYTES} bytes, got {len(rec.tag)}")
    body = record_fields(rec, tagged=bool(rec.tag)) + rec.tag
    body += _CRC.pack(crc32(body))
    if into is None:
        return body + bytes(RECORD_BYTES - len(body))
    into[:len(body)] = body
    into[len(body):RECORD_BYTES] = bytes(RECORD_BYTES - len(body))
    return None


def unpack_record(raw) -> Record | None:
    """The record in a record block, or None if it is empty, torn or corrupt."""
    raw = bytes(raw[:_RECORD.size + MAX_KEY_BYTES + TAG_BYTES + _CRC.size])
    if len(raw) < _RECORD.size or raw[:4] != RECORD_MAGIC:
        return None
    magic, version, flags, epoch, seq, group, kind, key_len, length, crc = _RECORD.unpack_from(raw)
    kend = _RECORD.size + key_len
    end = kend + (TAG_BYTES if flags & FLAG_TAG else 0)
    if version != FORMAT_VERSION or key_len > MAX_KEY_BYTES or end + _CRC.size > len(raw):
        return None
    if _CRC.unpack_from(raw, end)[0] != crc32(raw[:end]):
        return None
    try:
        h = decode_key_hash(kind, raw[_RECORD.size:kend])
    except DiskFormatError:
        return None
    return Record(epoch, seq, (group, h), length, crc, raw[kend:end])


def is_blank(raw) -> bool:
    """A record block never written (all zeros, e.g. fresh fallocated space)."""
    return bytes(raw[:4]) == b"\0\0\0\0"
