"""The disk tier's on-disk format: one file, `slots.bin`, in the tier's directory.

    offset 0               header block (HEADER_BYTES = 4 KiB): magic, format version, epoch, slot size, slot stride,
                           slot count, the fingerprint (JSON), CRC-32 of the header
    HEADER_BYTES + i*stride slot i: data region (`slot_bytes` rounded up to ALIGN), then one record block (ALIGN
                           bytes): magic, format version, epoch, sequence number, key (group, hash), data length,
                           CRC-32 of the data, CRC-32 of the record

Everything is 4 KiB aligned so the file can be opened with O_DIRECT. A slot is valid when its record parses, its
record CRC matches, its epoch equals the header's (a cache reset bumps the header's epoch, which invalidates every
record at once) and, when the data is read, the data CRC matches. The data CRC is what makes a torn write harmless:
a crash while a slot is rewritten leaves either the old record over new (or half-new) data or a half-written record,
and both fail a CRC. Sequence numbers order the records (LRU order after a restart; the newer of two records of one
key wins).

Plain Python (struct, zlib, json): the scheduler side may import this module without torch or numpy.
"""
from __future__ import annotations

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
_RECORD = struct.Struct("<4sHxxQQIBxHQI")  # magic, version, epoch, seq, group, key kind, key length, data length, crc
_CRC = struct.Struct("<I")
KEY_BYTES, KEY_INT = 0, 1


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


def pack_record(rec: Record, into: "bytearray | memoryview | None" = None) -> bytes | None:
    """The record block (RECORD_BYTES). With `into`, written there (zero padded) and None returned."""
    group, h = rec.key
    kind, raw = encode_key_hash(h)
    body = _RECORD.pack(RECORD_MAGIC, FORMAT_VERSION, rec.epoch, rec.seq, group, kind, len(raw), rec.length,
                        rec.crc) + raw
    body += _CRC.pack(crc32(body))
    if into is None:
        return body + bytes(RECORD_BYTES - len(body))
    into[:len(body)] = body
    into[len(body):RECORD_BYTES] = bytes(RECORD_BYTES - len(body))
    return None


def unpack_record(raw) -> Record | None:
    """The record in a record block, or None if it is empty, torn or corrupt."""
    raw = bytes(raw[:_RECORD.size + MAX_KEY_BYTES + _CRC.size])
    if len(raw) < _RECORD.size or raw[:4] != RECORD_MAGIC:
        return None
    magic, version, epoch, seq, group, kind, key_len, length, crc = _RECORD.unpack_from(raw)
    end = _RECORD.size + key_len
    if version != FORMAT_VERSION or key_len > MAX_KEY_BYTES or end + _CRC.size > len(raw):
        return None
    if _CRC.unpack_from(raw, end)[0] != crc32(raw[:end]):
        return None
    try:
        h = decode_key_hash(kind, raw[_RECORD.size:end])
    except DiskFormatError:
        return None
    return Record(epoch, seq, (group, h), length, crc)


def is_blank(raw) -> bool:
    """A record block never written (all zeros, e.g. fresh fallocated space)."""
    return bytes(raw[:4]) == b"\0\0\0\0"
