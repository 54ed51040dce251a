"""The disk store: round trip, admission, eviction order, checksums, rebuild after damage, threads."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from array import array
from pathlib import Path

import pytest

from confkv_engine.cache.disk.format import PREFIX, encode_header, record_name
from confkv_engine.cache.disk.policy import select_hot_chains
from confkv_engine.cache.disk.store import DiskStore, admit_reused, capacity_from_volume

PAYLOAD = 1000


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def payload(i: int, size: int = PAYLOAD) -> bytes:
    seed = hashlib.blake2b(f"payload-{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def tokens(i: int) -> list[int]:
    return list(range(16 * i, 16 * i + 16))


def record_size(i: int, parent: int | None = None) -> int:
    parent_key = None if parent is None else key(parent)
    return len(encode_header(key(i), parent_key, tokens(i), payload(i), {"i": i})[0]) + PAYLOAD


def admit_all(uses: int) -> bool:
    return True


def open_store(path: Path, records: int = 100, **kw: object) -> DiskStore:
    kw.setdefault("admit", admit_all)
    return DiskStore(path, records * record_size(0), **kw)  # type: ignore[arg-type]


def file_of(store: DiskStore, k: bytes) -> Path:
    sub, name = record_name(k)
    return store.blocks_dir / sub / name


def put(store: DiskStore, i: int, parent: int | None = None, **kw: object) -> bool:
    return store.put(key(i), None if parent is None else key(parent), tokens(i), payload(i), {"i": i}, **kw)


def test_round_trip_and_reopen_keeps_records_and_hits(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        assert put(store, 0) and put(store, 1, parent=0)
        rec = store.get(key(1))
        assert rec is not None
        assert (rec.key, rec.parent, rec.token_ids, rec.payload, rec.meta, rec.hits) == (
            key(1), key(0), tuple(tokens(1)), payload(1), {"i": 1}, 1)
        assert store.get(key(7)) is None
        assert put(store, 1) is False  # already on disk
        st = store.stats()
        assert (st.records, st.hits, st.misses, st.duplicates, st.puts) == (2, 1, 1, 1, 2)
        assert st.bytes_used == sum(p.stat().st_size for p in store.blocks_dir.rglob("*.blk"))
    with open_store(tmp_path) as store:
        assert store.last_rebuild.records == 2 and store.last_rebuild.skipped == 0
        rec = store.get(key(1))
        assert rec is not None and rec.payload == payload(1) and rec.hits == 2
        assert sorted(store.keys()) == sorted([key(0), key(1)])


def test_payload_may_be_any_contiguous_buffer(tmp_path: Path) -> None:
    values = array("d", range(10000))  # 80000 bytes, written without a copy
    with open_store(tmp_path) as store:
        assert store.put(b"k", None, [1], memoryview(values), {"dtype": "float64"})
        assert store.put(b"s", None, [1], bytearray(b"small"))
        assert store.get(b"k").payload == values.tobytes()  # type: ignore[union-attr]
        assert store.get(b"s").payload == b"small"  # type: ignore[union-attr]
        assert store.stats().bytes_used == sum(p.stat().st_size for p in store.blocks_dir.rglob("*.blk"))


def test_bad_arguments_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity must be positive"):
        DiskStore(tmp_path, 0)
    with open_store(tmp_path) as store:
        with pytest.raises(TypeError, match="key must be bytes"):
            store.put("k", None, [1], b"x")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="1..64 bytes"):
            store.put(b"k" * 65, None, [1], b"x")
        with pytest.raises(ValueError, match="its own parent"):
            store.put(b"k", b"k", [1], b"x")
        with pytest.raises(ValueError, match="token ids"):
            store.put(b"k", None, [-1], b"x")
        with pytest.raises(ValueError, match="JSON"):
            store.put(b"k", None, [1], b"x", {"bad": object()})
        with pytest.raises(ValueError, match="uses must be"):
            store.put(b"k", None, [1], b"x", uses=-1)
        assert store.stats().records == 0
        with pytest.raises(RuntimeError, match="in use by another disk store"):
            DiskStore(tmp_path, 1000)
    with pytest.raises(RuntimeError, match="is closed"):
        store.get(key(0))


def test_admission_rule_and_reoffered_blocks(tmp_path: Path) -> None:
    assert [admit_reused(u, min_uses=2) for u in (0, 1, 2, 3)] == [False, False, True, True]
    assert admit_reused(1, min_uses=1) and not admit_reused(2, min_uses=3)
    with DiskStore(tmp_path, 100 * record_size(0)) as store:  # default rule: used twice
        assert put(store, 0) is False  # used once, first offer
        assert put(store, 1, uses=2) is True
        assert put(store, 0) is True  # offered again: evicted, recomputed, evicted again
        st = store.stats()
        assert (st.rejected, st.records) == (1, 2)


def test_eviction_is_lru2_and_spares_one_shot_victims_last(tmp_path: Path) -> None:
    with open_store(tmp_path, records=3) as store:
        for i in range(3):
            put(store, i)
        assert store.get(key(0)) and store.get(key(1)) and store.get(key(0))
        evicted = []
        for i in range(3, 6):
            before = set(store.keys())
            assert put(store, i)
            evicted += sorted(before - set(store.keys()))
        # 2 was never hit, then each new block is one-shot and goes before the reused 1 and 0.
        assert evicted == [key(2), key(3), key(4)]
        assert put(store, 6) and put(store, 7)  # a scan of one-shot blocks never reaches 0 and 1
        assert store.contains(key(1)) and store.contains(key(0))
        assert store.stats().evictions == 5
        assert store.stats().bytes_used <= 3 * record_size(0)


def test_eviction_takes_leaves_before_their_parents(tmp_path: Path) -> None:
    with DiskStore(tmp_path, record_size(0) + record_size(1, parent=0), admit=admit_all) as store:
        assert put(store, 0) and put(store, 1, parent=0)  # the root is older, but has a child
        assert put(store, 2)
        assert store.contains(key(0)) and not store.contains(key(1))
        assert put(store, 3)  # now the root is a leaf and the oldest
        assert not store.contains(key(0)) and store.contains(key(2))


def test_capacity_change_and_oversized_block(tmp_path: Path) -> None:
    with open_store(tmp_path, records=4) as store:
        for i in range(4):
            put(store, i)
        assert store.set_capacity(2 * record_size(0)) == 2
        assert store.stats().records == 2
        assert store.put(key(9), None, [1], b"x" * (3 * record_size(0))) is False
        assert store.stats().no_room == 1
    with open_store(tmp_path, records=1) as store:  # reopened smaller: the rebuild evicts
        assert store.last_rebuild.evicted == 1 and store.stats().records == 1


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_checksum_mismatch_is_never_served(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        for i in range(3):
            put(store, i)
        flip_byte(file_of(store, key(0)), os.path.getsize(file_of(store, key(0))) - 1)  # payload
        flip_byte(file_of(store, key(1)), PREFIX.size + 3)  # header body
        assert store.get(key(0)) is None and store.get(key(1)) is None
        assert not store.contains(key(0)) and not file_of(store, key(0)).exists()
        st = store.stats()
        assert (st.corrupt_reads, st.records, st.hits) == (2, 1, 0)
        rec = store.get(key(2))
        assert rec is not None and rec.payload == payload(2)


def damage_store(store: DiskStore) -> int:
    """Damage records 1-5 of 0-9 in five ways, add a garbage record and an orphan; returns bad files."""
    paths = {i: file_of(store, key(i)) for i in range(10)}
    os.truncate(paths[1], os.path.getsize(paths[1]) - 7)  # torn tail
    os.truncate(paths[2], 10)  # torn header
    flip_byte(paths[3], os.path.getsize(paths[3]) - 100)  # payload bit rot
    flip_byte(paths[4], 2)  # magic
    shutil.copy(paths[6], paths[5])  # a misdirected write: another key's record under 5's name
    sub, name = record_name(b"\xab" * 16)
    (store.blocks_dir / sub / name).write_bytes(b"not a record")
    (paths[7].parent / (paths[7].name + ".99-0.tmp")).write_bytes(b"half a rec")
    return 6


def test_rebuild_skips_and_counts_every_bad_record(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        for i in range(10):
            put(store, i)
        assert store.get(key(8)) and store.get(key(8))
        bad = damage_store(store)
        report = store.rebuild()
        assert (report.records, report.skipped, report.orphans, report.index_recreated) == (5, bad, 1, False)
        for i in (0, 6, 7, 8, 9):
            rec = store.get(key(i))
            assert rec is not None and rec.payload == payload(i)
        assert store.get(key(8)).hits == 4  # type: ignore[union-attr]  # hits survived the rebuild
        for i in range(1, 6):
            assert store.get(key(i)) is None
        assert store.stats().rebuild_skipped == bad  # the open's rebuild skipped nothing


def test_reopen_after_damage_and_a_corrupt_index(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        for i in range(10):
            put(store, i)
        bad = damage_store(store)
    (tmp_path / "index.sqlite3").write_bytes(b"garbage" * 1000)
    with open_store(tmp_path) as store:  # headers only: payload rot (3) is caught when read
        report = store.last_rebuild
        assert (report.skipped, report.orphans, report.index_recreated) == (bad - 1, 1, True)
        assert store.get(key(3)) is None and store.stats().corrupt_reads == 1
        served = {i: store.get(key(i)) for i in range(10)}
        assert {i for i, r in served.items() if r is not None} == {0, 6, 7, 8, 9}
        assert all(r.payload == payload(i) for i, r in served.items() if r is not None)


@pytest.mark.parametrize("damage", ["truncate", "zero the header page"])
def test_a_torn_index_is_recreated_from_the_records(tmp_path: Path, damage: str) -> None:
    with open_store(tmp_path) as store:
        for i in range(5):
            put(store, i)
    index = tmp_path / "index.sqlite3"
    if damage == "truncate":
        os.truncate(index, index.stat().st_size // 2)
    else:
        with open(index, "r+b") as f:
            f.write(bytes(100))
    with open_store(tmp_path) as store:
        assert store.last_rebuild.index_recreated and store.last_rebuild.records == 5
        assert all(store.get(key(i)).payload == payload(i) for i in range(5))  # type: ignore[union-attr]


def test_capacity_from_the_volume(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="share of its volume"):
        capacity_from_volume(tmp_path, 0)
    with pytest.raises(ValueError, match="share of its volume"):
        capacity_from_volume(tmp_path, 1.5)
    with open_store(tmp_path) as store:
        put(store, 0)
        used = store.stats().bytes_used
    assert capacity_from_volume(tmp_path, 0.5) > used * 0.5 > 0


def test_verify_on_open_catches_payload_rot(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        for i in range(10):
            put(store, i)
        bad = damage_store(store)
    with open_store(tmp_path, verify_on_open=True) as store:
        assert (store.last_rebuild.skipped, store.last_rebuild.records) == (bad, 5)


def test_failed_write_releases_its_reservation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_store(tmp_path, records=2) as store:
        def no_space(fd: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "fsync", no_space)
        assert put(store, 0) is False
        monkeypatch.undo()
        assert store.stats().write_errors == 1 and not list(store.blocks_dir.rglob("*.tmp"))
        assert put(store, 0) and put(store, 1)  # the failed put's bytes were given back
        assert store.stats().evictions == 0


def test_hot_prefixes_are_whole_rooted_chains(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        # Chains 0 -> 1 -> 2 and 3 -> 4; 6's parent 5 is not on disk, so 6 cannot be prefilled.
        for i, parent in ((0, None), (1, 0), (2, 1), (3, None), (4, 3), (6, 5)):
            assert put(store, i, parent=parent)
        for i in (0, 1, 2, 3, 3, 3, 3, 3, 6, 6, 6, 6, 6, 6):
            store.touch(key(i))
        assert store.hot_prefixes(5) == [tokens(3), tokens(0) + tokens(1) + tokens(2)]
        assert store.hot_prefixes(1) == [tokens(3)]
        assert store.hot_prefixes(0) == []


def test_select_hot_chains_prefers_tokens_saved_and_extends_chosen_chains() -> None:
    nodes = {b"a": (None, 1, 10), b"b": (b"a", 2, 9), b"c": (b"b", 3, 1), b"d": (None, 1, 15),
             b"e": (b"d", 2, 0)}
    # b: 9 x 2 = 18 beats a (10) and d (15); c (3) then extends b; e was never hit.
    assert select_hot_chains(nodes, 2) == [[b"a", b"b", b"c"], [b"d"]]
    assert select_hot_chains(nodes, 1) == [[b"a", b"b", b"c"]]


def test_threads_share_a_store_and_never_see_bad_bytes(tmp_path: Path) -> None:
    store = open_store(tmp_path, records=20)
    errors: list[BaseException] = []

    def worker(start: int) -> None:
        try:
            for i in range(start, start + 60):
                put(store, i)
                for j in (i - 1, i - 7, i - 30):
                    rec = store.get(key(j))
                    assert rec is None or (rec.payload == payload(j) and rec.meta == {"i": j})
        except BaseException as exc:  # noqa: B036 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    rebuilds = [store.rebuild() for _ in range(3)]
    for t in threads:
        t.join()
    assert not errors
    st = store.stats()
    files = list(store.blocks_dir.rglob("*.blk"))
    assert st.records == len(files) == len(store.keys()) and st.hits > 0
    assert st.bytes_used == sum(p.stat().st_size for p in files) <= 20 * record_size(0)
    assert all(r.skipped == 0 for r in rebuilds)
    store.close()
