"""On-disk record format of the disk store: one self-describing, checksummed file per block.

A record file is ``PREFIX | body | payload``:

- ``PREFIX`` (fixed, little-endian): magic ``CKVB``, format version, key and parent lengths, token
  count, meta length, payload length, the payload's BLAKE2b-128 digest, and a CRC-32 over the prefix
  fields and the body (so a torn or scribbled header is recognised without reading the payload).
- ``body``: key bytes, parent bytes (empty for a chain root), token ids as int32, meta as UTF-8 JSON.
- ``payload``: opaque bytes (the cache manager's encoded K/V block, compressed or not).

Because a file carries everything the index holds, the directory of record files *is* the log the
index is rebuilt from: the SQLite index is derived data plus hit statistics. BLAKE2b (not CRC) guards
the payload because its digest also sits in the index, where it must tell two payloads apart, and the
standard library computes it at memory speed for blocks of this size.

Everything here is pure (bytes in, values or ``CorruptRecord`` out); file I/O lives in ``files`` and
``store``.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAGIC = b"CKVB"
VERSION = 1
PREFIX = struct.Struct("<4sHHHHIIQ16sI")
DIGEST_BYTES = 16
MAX_KEY_BYTES = 64
MAX_META_BYTES = 64 * 1024
MAX_TOKEN_ID = 2**31 - 1
RECORD_SUFFIX = ".blk"
TEMP_SUFFIX = ".tmp"
Bytes = bytes | bytearray | memoryview


class CorruptRecord(ValueError):
    """A record's bytes do not decode or do not match their checksums (``reason`` says which)."""


@dataclass(frozen=True)
class RecordHeader:
    key: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    meta: dict[str, Any]
    payload_len: int
    digest: bytes
    header_len: int

    @property
    def total_size(self) -> int:
        return self.header_len + self.payload_len


def payload_digest(payload: Bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest()


def _check_key(name: str, key: object) -> bytes:
    if not isinstance(key, bytes):
        raise TypeError(f"{name} must be bytes, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"{name} must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def validate_block(key: bytes, parent: bytes | None, token_ids: Sequence[int]) -> None:
    """Clear errors for what a caller can get wrong (the engine passes hashes and token ids)."""
    _check_key("key", key)
    if parent is not None:
        _check_key("parent", parent)
        if parent == key:
            raise ValueError("a block cannot be its own parent")
    for t in token_ids:
        if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"token ids must be ints in 0..{MAX_TOKEN_ID}, got {t!r}")


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    arr = array("i", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def decode_tokens(raw: bytes) -> tuple[int, ...]:
    arr = array("i")
    arr.frombytes(raw)
    if sys.byteorder == "big":
        arr.byteswap()
    return tuple(arr)


def encode_meta(meta: dict[str, Any] | None) -> bytes:
    try:
        raw = json.dumps(meta or {}, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"block meta must be JSON-serialisable: {exc}") from None
    if len(raw) > MAX_META_BYTES:
        raise ValueError(f"block meta is {len(raw)} bytes as JSON, at most {MAX_META_BYTES} are allowed")
    return raw


def encode_header(key: bytes, parent: bytes | None, token_ids: Sequence[int],
                  payload: Bytes, meta: dict[str, Any] | None) -> tuple[bytes, bytes]:
    """The record bytes before the payload, and the payload digest (validates the arguments)."""
    validate_block(key, parent, token_ids)
    parent_raw = parent or b""
    tokens_raw, meta_raw = encode_tokens(token_ids), encode_meta(meta)
    digest = payload_digest(payload)
    body = key + parent_raw + tokens_raw + meta_raw
    fields = (MAGIC, VERSION, len(key), len(parent_raw), 0, len(token_ids), len(meta_raw),
              memoryview(payload).nbytes, digest)
    crc = zlib.crc32(body, zlib.crc32(PREFIX.pack(*fields, 0)[:-4]))
    return PREFIX.pack(*fields, crc) + body, digest


def body_length(prefix: bytes) -> int:
    """Bytes of body that follow a fixed prefix (raises CorruptRecord for a bad prefix)."""
    if len(prefix) < PREFIX.size:
        raise CorruptRecord(f"truncated header: {len(prefix)} of {PREFIX.size} bytes")
    magic, version, key_len, parent_len, _r, n_tokens, meta_len, _p, _d, _c = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptRecord("bad magic")
    if version != VERSION:
        raise CorruptRecord(f"unknown format version {version}")
    if not 1 <= key_len <= MAX_KEY_BYTES or parent_len > MAX_KEY_BYTES or meta_len > MAX_META_BYTES:
        raise CorruptRecord("header lengths out of range")
    return key_len + parent_len + 4 * n_tokens + meta_len


def decode_header(buf: bytes | memoryview) -> RecordHeader:
    """Parse and CRC-check the prefix and body at the start of ``buf`` (the payload may follow)."""
    need = body_length(bytes(buf[:PREFIX.size]))
    header_len = PREFIX.size + need
    if len(buf) < header_len:
        raise CorruptRecord(f"truncated header: {len(buf)} of {header_len} bytes")
    _m, _v, key_len, parent_len, _r, n_tokens, meta_len, payload_len, digest, crc = PREFIX.unpack_from(buf)
    body = bytes(buf[PREFIX.size:header_len])
    if zlib.crc32(body, zlib.crc32(bytes(buf[:PREFIX.size - 4]))) != crc:
        raise CorruptRecord("header checksum mismatch")
    key, rest = body[:key_len], body[key_len:]
    parent, rest = rest[:parent_len] or None, rest[parent_len:]
    tokens_raw, meta_raw = rest[:4 * n_tokens], rest[4 * n_tokens:]
    try:
        meta = json.loads(meta_raw)
    except ValueError:
        raise CorruptRecord("meta is not JSON") from None
    return RecordHeader(key, parent, decode_tokens(tokens_raw), meta, payload_len, digest, header_len)


def decode_record(data: Bytes, expect_key: bytes, expect_digest: bytes) -> tuple[RecordHeader, bytes]:
    """Header and payload of a whole record file, verified against the index's key and digest."""
    header = decode_header(data)
    if header.key != expect_key:
        raise CorruptRecord("record holds another key")
    if len(data) != header.total_size:
        raise CorruptRecord(f"record is {len(data)} bytes, its header says {header.total_size}")
    if header.digest != expect_digest:
        raise CorruptRecord("payload digest differs from the index")
    payload = bytes(data[header.header_len:])
    if payload_digest(payload) != expect_digest:
        raise CorruptRecord("payload checksum mismatch")
    return header, payload


def record_name(key: bytes) -> tuple[str, str]:
    """(fan-out folder, file name) of a key's record: 256 folders keep directories small."""
    hexkey = key.hex()
    return hexkey[:2], hexkey + RECORD_SUFFIX


def key_from_name(name: str) -> bytes | None:
    if not name.endswith(RECORD_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:-len(RECORD_SUFFIX)])
    except ValueError:
        return None
