"""The shared tier's value format: a header that names the key, the fingerprint and the length, the block's
bytes, and, for a store opened with a secret, an HMAC-SHA256 tag. `base.RemoteStore` frames every put and checks
every get with these; plain Python (struct, zlib, hmac), no torch or numpy.

Stored value:             header, then the block's bytes, then (authenticated stores) a 32-byte tag

    header = magic "OCRV" | format version u16 | key length u16 | flags u16 | fingerprint digest 16 B |
             data length u64 | data CRC-32 u32 | key (UTF-8) | header CRC-32 u32   (little endian; 42 + key length)
    tag    = HMAC-SHA256(MAC key, header || data)                              (flags bit 0 says a tag follows)

A reader accepts a value only if the magic, version, header CRC, fingerprint digest, key, data length (equal to the
value's remaining bytes and to the caller's buffer) and data CRC all match. Anything else is a miss, counted in
`RemoteStats.rejected` by reason, so bytes written for another model or layout, under another key, or torn or
corrupted in the store are never handed to the engine.

CRCs catch accidents, not intent: whoever can write to the store can frame a value with a valid CRC under any key.
A store opened with a secret (`mac_key`, derived from the operator's secret file by `derive_mac_key`) tags every value
it writes and accepts only values whose tag verifies: the tag covers the header, so the store key, the fingerprint
and the length are bound to the bytes, and a value moved to another key, or written without the secret, is a miss
("unauthenticated": no tag; "mac": a tag that does not verify). A verified tag also covers everything the data CRC
does, so that CRC is not computed again on read.
"""
from __future__ import annotations

import hmac
import struct
import zlib

from offload_connector.tier_auth import MIN_SECRET_BYTES, derive_key

FORMAT_VERSION = 2  # 2: a flags field and an optional HMAC-SHA256 tag (version 1 values are another key space)
MAGIC = b"OCRV"

_HDR = struct.Struct("<4sHHH16sQI")  # magic, version, key length, flags, fingerprint digest, data length, data crc
_CRC = struct.Struct("<I")
FLAG_TAG = 1
TAG_BYTES = 32  # HMAC-SHA256

# Reasons a value read from the store is rejected (each is a miss, counted in RemoteStats.rejected).
# format: not a value of ours; version: another format version; fingerprint: written for another model/layout/rank;
# key: written for another block; corrupt: header or data CRC mismatch, torn or truncated; length: the block's size
# differs from the caller's buffer; unauthenticated: no tag, read by a store that requires one; mac: a tag that does
# not verify under this store's key (forged, or written with another secret).
REJECT_REASONS = ("format", "version", "fingerprint", "key", "corrupt", "length", "unauthenticated", "mac")
# Rejections that mean somebody wrote a value they could not authenticate: logged once per store and reason.
FORGERY_REASONS = ("unauthenticated", "mac")


def crc32(data) -> int:
    """CRC-32 (zlib) of a bytes-like object; zlib releases the GIL for large buffers."""
    return zlib.crc32(data) & 0xFFFFFFFF


def _as_bytes_view(buf) -> memoryview:
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("remote store buffers must be C-contiguous")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def header_bytes(key: str, tagged: bool = False) -> int:
    """Bytes a value of `key` carries besides its data (header, and the tag of an authenticated store)."""
    return _HDR.size + len(key.encode()) + _CRC.size + (TAG_BYTES if tagged else 0)


MAC_KEY_PURPOSE = b"oc-kv-mac-key"  # the shared tier's key derivation (tier_auth.derive_key)


def derive_mac_key(secret: bytes) -> bytes:
    """The 32-byte MAC key of an operator's secret (a file's bytes, any length >= MIN_SECRET_BYTES): engines given
    the same secret tag and verify alike; the secret itself never reaches the store or a log."""
    return derive_key(secret, MAC_KEY_PURPOSE)


def pack_header(digest: bytes, key: str, data, tagged: bool = False) -> bytes:
    kb = key.encode()
    mv = _as_bytes_view(data)
    body = _HDR.pack(MAGIC, FORMAT_VERSION, len(kb), FLAG_TAG if tagged else 0, digest, mv.nbytes, crc32(mv)) + kb
    return body + _CRC.pack(crc32(body))


def value_tag(mac_key: bytes, header, data) -> bytes:
    """HMAC-SHA256 over header || data (hashlib releases the GIL on large buffers)."""
    h = hmac.new(mac_key, header, "sha256")
    h.update(data)
    return h.digest()


def pack_value(digest: bytes, key: str, data, mac_key: bytes | None = None) -> bytes:
    """Header + data (+ tag, with `mac_key`) as one bytes object (what most clients want to send); one copy of the
    data."""
    mv = _as_bytes_view(data)
    header = pack_header(digest, key, mv, tagged=mac_key is not None)
    if mac_key is None:
        return b"".join((header, mv))
    return b"".join((header, mv, value_tag(mac_key, header, mv)))


def check_value(value, digest: bytes, key: str, expected_len: int | None = None,
                mac_key: bytes | None = None) -> tuple[memoryview | None, str]:
    """(the data as a view into `value`, "") if `value` is a valid value for `key` under `digest`, else (None,
    reason) with reason one of REJECT_REASONS. With `mac_key` only a value whose tag verifies is valid; without
    one, a tag is skipped unverified (a store without a secret trusts its writers)."""
    mv = _as_bytes_view(value)
    if mv.nbytes < len(MAGIC) or bytes(mv[:len(MAGIC)]) != MAGIC:
        return None, "format"
    if mv.nbytes < len(MAGIC) + 2:  # ours, truncated before the version
        return None, "corrupt"
    if struct.unpack_from("<H", mv, len(MAGIC))[0] != FORMAT_VERSION:
        return None, "version"
    if mv.nbytes < _HDR.size + _CRC.size:  # ours, truncated
        return None, "corrupt"
    magic, version, key_len, flags, vdigest, length, data_crc = _HDR.unpack_from(mv)
    hend = _HDR.size + key_len
    if hend + _CRC.size > mv.nbytes or _CRC.unpack_from(mv, hend)[0] != crc32(mv[:hend]):
        return None, "corrupt"
    if vdigest != digest:
        return None, "fingerprint"
    if bytes(mv[_HDR.size:hend]) != key.encode():
        return None, "key"
    tagged = bool(flags & FLAG_TAG)
    dstart = hend + _CRC.size
    body = mv[dstart:mv.nbytes - TAG_BYTES] if tagged else mv[dstart:]
    if tagged and mv.nbytes < dstart + TAG_BYTES:
        return None, "corrupt"
    if mac_key is not None:
        if not tagged:
            return None, "unauthenticated"
        if not hmac.compare_digest(value_tag(mac_key, mv[:dstart], body), bytes(mv[mv.nbytes - TAG_BYTES:])):
            return None, "mac"  # before any other check of the data: a forger learns nothing more from the reason
    if body.nbytes != length:  # torn or truncated value
        return None, "corrupt"
    if expected_len is not None and length != expected_len:
        return None, "length"
    if mac_key is None and crc32(body) != data_crc:  # a verified tag already covers every byte the CRC does
        return None, "corrupt"
    return body, ""
