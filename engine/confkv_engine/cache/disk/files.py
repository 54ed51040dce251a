"""Record files of the disk store: write one, read one, scan them all (the log a rebuild reads).

``write_record`` writes a temporary file, fsyncs it and renames it into place, so a record file is
complete or absent. ``scan_blocks`` reads every record file's header (and, when asked, its whole
payload) and deletes what cannot be served: temporary files of interrupted puts (``orphans``) and
record files that are torn, corrupt, misnamed or of another format version (``skipped``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from confkv_engine.cache.disk.format import (
    DIGEST_BYTES,
    PREFIX,
    RECORD_SUFFIX,
    TEMP_SUFFIX,
    Bytes,
    CorruptRecord,
    RecordHeader,
    body_length,
    decode_header,
    key_from_name,
    record_name,
)

log = logging.getLogger(__name__)
READ_CHUNK = 1 << 20


def capacity_from_volume(directory: str | os.PathLike[str], fraction: float = 0.9) -> int:
    """A byte cap for a store in ``directory``: ``fraction`` of the volume's free space plus what
    record files there already use (so reopening a full store does not shrink it)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the disk store's share of its volume must be in (0, 1], got {fraction}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    used = sum(p.stat().st_size for p in (directory / "blocks").rglob(f"*{RECORD_SUFFIX}"))
    return int(fraction * (shutil.disk_usage(directory).free + used))


def record_path(blocks_dir: Path, key: bytes) -> Path:
    sub, name = record_name(key)
    return blocks_dir / sub / name


def write_record(blocks_dir: Path, key: bytes, header: bytes, payload: Bytes, tmp_tag: str, *,
                 durable: bool) -> None:
    """Write a record file atomically (``tmp_tag`` makes the temporary name unique to the writer)."""
    final = record_path(blocks_dir, key)
    tmp = final.with_name(f"{final.name}.{tmp_tag}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        # Small records go out in one write; large ones without copying the payload.
        chunks = ([memoryview(header + bytes(payload))] if memoryview(payload).nbytes < 65536
                  else [memoryview(header), memoryview(payload)])
        for chunk in chunks:
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, final)


def read_record(blocks_dir: Path, key: bytes) -> bytes | None:
    """A record file's bytes, or None when it does not exist (evicted after the index lookup)."""
    try:
        with open(record_path(blocks_dir, key), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


@dataclass
class ScanResult:
    headers: list[RecordHeader] = field(default_factory=list)
    skipped: int = 0
    orphans: int = 0


def read_verified_header(path: Path, expect_key: bytes, verify_payload: bool) -> RecordHeader:
    """The header of one record file, checked against its name, size and (optionally) payload."""
    with open(path, "rb") as f:
        prefix = f.read(PREFIX.size)
        header = decode_header(prefix + f.read(body_length(prefix)))
        if header.key != expect_key:
            raise CorruptRecord("record holds another key than its file name")
        size = os.fstat(f.fileno()).st_size
        if size != header.total_size:
            raise CorruptRecord(f"record is {size} bytes, its header says {header.total_size}")
        if verify_payload:
            h = hashlib.blake2b(digest_size=DIGEST_BYTES)
            while chunk := f.read(READ_CHUNK):
                h.update(chunk)
            if h.digest() != header.digest:
                raise CorruptRecord("payload checksum mismatch")
    return header


def scan_blocks(blocks_dir: Path, verify_payloads: bool) -> ScanResult:
    """Headers of every good record under ``blocks_dir``; bad records and orphans are deleted."""
    result = ScanResult()
    for folder in sorted(p for p in blocks_dir.iterdir() if p.is_dir()):
        for path in sorted(folder.iterdir()):
            if path.name.endswith(TEMP_SUFFIX):
                path.unlink(missing_ok=True)
                result.orphans += 1
                continue
            if not path.name.endswith(RECORD_SUFFIX):
                continue  # not a record file of ours: leave it alone
            key = key_from_name(path.name)
            try:
                if not key or record_name(key) != (folder.name, path.name):  # garbage.blk: misnamed
                    raise CorruptRecord("record file in the wrong folder or with a bad name")
                result.headers.append(read_verified_header(path, key, verify_payloads))
            except (CorruptRecord, OSError) as exc:
                log.warning("disk store rebuild: skipping %s (%s)", path, exc)
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                result.skipped += 1
    return result
