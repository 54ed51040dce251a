"""SQLite index of the disk store: one row per record file, with the access history eviction uses.

SQLite in WAL mode (standard library, no server): readers never wait for the writer, a killed
process leaves the database at its last commit, and ``synchronous=NORMAL`` is enough because the
index is derived from the record files, which are fsynced before their row is committed; a commit
lost to a power cut only turns a complete record into one the next rebuild adopts again.

Each thread gets its own connection (``sqlite3`` connections must not be shared across threads
while in use); the store serialises writers with its own lock, so a write never waits on SQLite.
Access times are a logical clock (an integer the store increments), which makes eviction order
exact and independent of the wall clock.

Eviction is LRU-2 restricted to leaves: among records no other record names as its parent, the one
whose second-most-recent access (the put counts as one) is oldest goes first; a record never hit
since its put has none, so one-shot blocks go before reused ones. Leaves first, because a prefix
lookup walks a chain from its root: a block whose parent is gone can never be reached.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confkv_engine.cache.disk.format import decode_tokens, encode_tokens

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    key BLOB PRIMARY KEY,
    parent BLOB,
    tokens BLOB NOT NULL,
    meta TEXT NOT NULL,
    size INTEGER NOT NULL,
    digest BLOB NOT NULL,
    gen INTEGER NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    last_access INTEGER NOT NULL,
    prev_access INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_parent ON blocks(parent);
CREATE INDEX IF NOT EXISTS blocks_lru2 ON blocks(prev_access, last_access);
"""
COLUMNS = "key, parent, tokens, meta, size, digest, gen, hits, last_access, prev_access"


@dataclass(frozen=True)
class IndexRow:
    key: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    meta: dict[str, Any]
    size: int  # bytes of the record file
    digest: bytes
    gen: int  # logical time of the put, so a reader drops only the version it read
    hits: int = 0
    last_access: int = 0
    prev_access: int = 0

    def params(self) -> tuple[Any, ...]:
        return (self.key, self.parent, encode_tokens(self.token_ids), json.dumps(self.meta, sort_keys=True),
                self.size, self.digest, self.gen, self.hits, self.last_access, self.prev_access)


def _row(r: tuple[Any, ...]) -> IndexRow:
    return IndexRow(bytes(r[0]), None if r[1] is None else bytes(r[1]), decode_tokens(r[2]), json.loads(r[3]),
                    r[4], bytes(r[5]), r[6], r[7], r[8], r[9])


@dataclass(frozen=True)
class AccessStats:
    hits: int
    last_access: int
    prev_access: int


class BlockIndex:
    """The ``blocks`` table behind per-thread connections. Callers serialise writes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._epoch = 0

    def _conn(self) -> sqlite3.Connection:
        local = self._local
        if getattr(local, "epoch", -1) != self._epoch:
            conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            with self._conns_lock:
                self._conns.append(conn)
            local.conn, local.epoch = conn, self._epoch
        return local.conn

    def open(self) -> bool:
        """Create or check the schema; False (and a fresh empty database) when the file was unusable."""
        try:
            conn = self._conn()
            healthy = conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            healthy = healthy and version in (0, SCHEMA_VERSION)
        except sqlite3.DatabaseError:
            healthy = False
        if not healthy:
            self.reset()
        conn = self._conn()
        conn.executescript(SCHEMA)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        return healthy

    def reset(self) -> None:
        """Close every connection and delete the database files (the index is derived data)."""
        self.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)

    def close(self) -> None:
        with self._conns_lock:
            conns, self._conns = self._conns, []
            self._epoch += 1
        for conn in conns:
            conn.close()

    def lookup(self, key: bytes) -> IndexRow | None:
        r = self._conn().execute(f"SELECT {COLUMNS} FROM blocks WHERE key = ?", (key,)).fetchone()
        return None if r is None else _row(r)

    def contains(self, key: bytes) -> bool:
        return self._conn().execute("SELECT 1 FROM blocks WHERE key = ?", (key,)).fetchone() is not None

    def keys(self) -> list[bytes]:
        return [bytes(k) for (k,) in self._conn().execute("SELECT key FROM blocks ORDER BY key")]

    def insert(self, row: IndexRow) -> None:
        self._conn().execute(f"INSERT OR REPLACE INTO blocks ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                             row.params())

    def touch_many(self, accesses: Iterable[tuple[bytes, int, int, int | None]]) -> None:
        """Apply buffered accesses (key, count, last tick, previous tick or None = the stored last)."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "UPDATE blocks SET hits = hits + ?, prev_access = COALESCE(?, last_access), last_access = ?"
            " WHERE key = ?", ((n, prev, last, key) for key, n, last, prev in accesses))
        conn.execute("COMMIT")

    def delete(self, key: bytes, gen: int | None = None) -> int:
        """Delete a row (only the version ``gen`` when given); returns the bytes it recorded, or 0."""
        conn = self._conn()
        r = conn.execute("SELECT size, gen FROM blocks WHERE key = ?", (key,)).fetchone()
        if r is None or (gen is not None and r[1] != gen):
            return 0
        conn.execute("DELETE FROM blocks WHERE key = ?", (key,))
        return int(r[0])

    def eviction_order(self, limit: int) -> list[tuple[bytes, int]]:
        """Up to ``limit`` (key, size) to evict first: LRU-2 over leaves (all records if none is a leaf)."""
        conn = self._conn()
        order = "ORDER BY b.prev_access, b.last_access, b.key LIMIT ?"
        rows = conn.execute(
            "SELECT b.key, b.size FROM blocks b WHERE NOT EXISTS "
            f"(SELECT 1 FROM blocks c WHERE c.parent = b.key) {order}", (limit,)).fetchall()
        if not rows:  # only a cycle of parents is left (impossible with chained hashes)
            rows = conn.execute(f"SELECT b.key, b.size FROM blocks b {order}", (limit,)).fetchall()
        return [(bytes(k), int(s)) for k, s in rows]

    def delete_many(self, keys: Iterable[bytes]) -> None:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("DELETE FROM blocks WHERE key = ?", ((k,) for k in keys))
        conn.execute("COMMIT")

    def access_stats(self) -> dict[bytes, AccessStats]:
        """Hit counts and access times of every row (kept across a rebuild); empty if unreadable."""
        try:
            rows = self._conn().execute("SELECT key, hits, last_access, prev_access FROM blocks").fetchall()
        except sqlite3.DatabaseError:
            return {}
        return {bytes(k): AccessStats(h, la, pa) for k, h, la, pa in rows}

    def replace_all(self, rows: Iterable[IndexRow]) -> None:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("DELETE FROM blocks")
            conn.executemany(f"INSERT INTO blocks ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                             (r.params() for r in rows))
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def totals(self) -> tuple[int, int, int]:
        """(records, bytes, highest access tick)."""
        n, size, tick = self._conn().execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(MAX(last_access), 0) FROM blocks").fetchone()
        return int(n), int(size), int(tick)

    def rooted_chains(self) -> list[tuple[bytes, bytes | None, int, int]]:
        """(key, parent, depth, hits) of every record whose parents all lie on disk down to a root."""
        rows = self._conn().execute(
            "WITH RECURSIVE chain(key, depth) AS ("
            " SELECT key, 1 FROM blocks WHERE parent IS NULL"
            " UNION ALL SELECT b.key, c.depth + 1 FROM blocks b JOIN chain c ON b.parent = c.key)"
            " SELECT b.key, b.parent, c.depth, b.hits FROM chain c JOIN blocks b ON b.key = c.key").fetchall()
        return [(bytes(k), None if p is None else bytes(p), int(d), int(h)) for k, p, d, h in rows]

    def tokens_of(self, keys: Iterable[bytes]) -> dict[bytes, tuple[int, ...]]:
        conn = self._conn()
        out: dict[bytes, tuple[int, ...]] = {}
        for key in keys:
            r = conn.execute("SELECT tokens FROM blocks WHERE key = ?", (key,)).fetchone()
            if r is not None:
                out[key] = decode_tokens(r[0])
        return out
