"""A misnamed file in the disk store's blocks directory is handled as the disk store documents: a
``.blk`` file whose name is not a record's (``garbage.blk``, a key in the wrong fan-out folder) is
deleted and counted as skipped by a rebuild, on open and on demand; files without the record suffix
are not the store's and are left alone; good records survive."""

from __future__ import annotations

import hashlib
from pathlib import Path

from confkv_engine.cache.disk import DiskStore

PAYLOAD = b"kv" * 512


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def put(store: DiskStore, i: int) -> None:
    assert store.put(key(i), None, list(range(16)), PAYLOAD, {"i": i})


def misname(blocks: Path) -> list[Path]:
    """Three misnamed record files and one foreign file; returns the misnamed ones."""
    wrong_folder = "00" if key(0).hex()[:2] != "00" else "01"
    bad = [blocks / "00" / "garbage.blk", blocks / wrong_folder / f"{key(0).hex()}.blk",
           blocks / "ab" / ".blk"]
    for path in bad:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not a record")
    (blocks / "00" / "README").write_text("not the store's")
    return bad


def test_misnamed_record_files_are_deleted_and_counted(tmp_path: Path) -> None:
    with DiskStore(tmp_path, 1 << 20, admit=lambda uses: True) as store:
        put(store, 0)
        bad = misname(store.blocks_dir)
        report = store.rebuild()
        assert (report.records, report.skipped) == (1, len(bad))
        assert not any(p.exists() for p in bad)
        assert (store.blocks_dir / "00" / "README").exists()
        assert store.get(key(0)) is not None and store.get(key(0)).payload == PAYLOAD  # type: ignore[union-attr]
    bad = misname(tmp_path / "blocks")
    with DiskStore(tmp_path, 1 << 20) as store:  # the rebuild on open applies the same rule
        assert (store.last_rebuild.records, store.last_rebuild.skipped) == (1, len(bad))
        assert not any(p.exists() for p in bad)
