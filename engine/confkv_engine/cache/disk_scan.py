"""The disk tier's log scan (rebuild) and the choice of hot chains for warm-up.

``scan_blocks`` reads every record file's header (and, when asked, its whole payload) and deletes
what cannot be served: temporary files of interrupted puts (``orphans``) and record files that are
torn, corrupt, misnamed or of another format version (``skipped``). ``select_hot_chains`` is pure.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from confkv_engine.cache.disk_format import (
    DIGEST_BYTES,
    PREFIX,
    TEMP_SUFFIX,
    CorruptRecord,
    RecordHeader,
    body_length,
    decode_header,
    key_from_name,
    record_name,
)

log = logging.getLogger(__name__)
READ_CHUNK = 1 << 20


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
            key = key_from_name(path.name)
            if key is None:
                continue  # not a record file of ours: leave it alone
            try:
                if not key or record_name(key) != (folder.name, path.name):
                    raise CorruptRecord("record file in the wrong folder or with a bad name")
                result.headers.append(read_verified_header(path, key, verify_payloads))
            except (CorruptRecord, OSError) as exc:
                log.warning("disk tier rebuild: skipping %s (%s)", path, exc)
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                result.skipped += 1
    return result


def _chain(key: bytes, nodes: dict[bytes, tuple[bytes | None, int, int]]) -> list[bytes]:
    chain = [key]
    while (parent := nodes[chain[-1]][0]) is not None:
        chain.append(parent)
    return chain[::-1]


def select_hot_chains(nodes: dict[bytes, tuple[bytes | None, int, int]], n: int) -> list[list[bytes]]:
    """Up to ``n`` chains (root first) to prefill, from ``nodes[key] = (parent, depth, hits)``.

    A chain ending at a block is worth ``hits x depth`` (prompt blocks its hits would have saved);
    chains are taken best first, a chain that is a prefix of a chosen one adds nothing and is
    skipped, and a chain that extends a chosen one replaces it (prefilling it caches both). Every
    node's parent must be in ``nodes`` (only rooted chains are given). Blocks never hit are not hot.
    """
    order = sorted((k for k, (_p, _d, hits) in nodes.items() if hits > 0),
                   key=lambda k: (-nodes[k][2] * nodes[k][1], -nodes[k][1], k))
    chosen: list[list[bytes]] = []
    covered: set[bytes] = set()  # every block on a chosen chain
    for key in order:
        if key in covered:
            continue
        chain = _chain(key, nodes)
        extended = [i for i, c in enumerate(chosen) if c[-1] in set(chain)]
        if extended:
            chosen[extended[0]] = chain
        elif len(chosen) < n:
            chosen.append(chain)
        else:
            continue
        covered.update(chain)
    return chosen
