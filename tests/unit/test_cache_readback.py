"""Reading a prefix chain back from the disk store (``cache.readback``) with a real ``DiskSink``
and ``KVCache``, without a model: the load runs on the sink's reader thread and the cache installs
it afterwards with exact block ids; nothing is read when the disk has no record of the chain's next
block; closing the sink ends the loads still queued (their requests recompute) and never hangs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from confkv_engine.cache.disk.sink import DiskSink
from tests.unit.test_prefix_cache import BS, HOT, compute, contents, make_cache, serve


@pytest.fixture
def sink(tmp_path: Path):
    sink = DiskSink(str(tmp_path / "nvme"), capacity_bytes=8 << 20)
    yield sink
    sink.close()


def spill_hot(sink: DiskSink):
    """A cache whose HOT prefix (used twice, so the disk admits it) was evicted to ``sink``."""
    cache = make_cache(9, sink=sink)
    serve(cache, HOT + [1])
    serve(cache, HOT + [2])
    serve(cache, list(range(500, 500 + 4 * BS)))  # needs the whole pool: HOT's entries are evicted
    sink.flush()
    assert cache.match(HOT + [0], 2) == [] and sink.store.stats().records == 2
    return cache


def test_a_chain_is_read_on_the_reader_thread_and_installed_with_exact_ids(sink: DiskSink) -> None:
    cache = spill_hot(sink)
    gate = threading.Event()
    real_get = sink.store.get
    sink.store.get = lambda key, **kw: (gate.wait(60), real_get(key, **kw))[1]  # type: ignore[method-assign]
    tokens = HOT + [3]
    load = cache.request_load(tokens, cache.match(tokens, 2), 2)
    assert load is not None and [link.tokens for link in load.links] == [tuple(HOT[:BS]), tuple(HOT[BS:])]
    assert not load.done.is_set() and cache.pool.num_used == 1 + 2 * 4  # nothing taken yet
    gate.set()
    assert load.done.wait(60) and len(load.pairs) == 2 and sink.stats.loaded == 2
    assert cache.install_load(load) == 2 and len(cache.eviction) == 4  # two spilled for room, two loaded
    hits = cache.match(tokens, 2)
    assert [(e.k_block, e.v_block) for e in hits] == [(8, 4), (7, 1)]  # the other chain, tail first
    seq, hit = compute(cache, tokens)
    assert hit == 2 * BS and contents(cache, seq)[0] == tokens and len(cache.eviction) == 1  # 500.. head


def test_nothing_is_read_when_the_disk_lacks_the_next_block(sink: DiskSink) -> None:
    cache = spill_hot(sink)
    assert cache.request_load([7] * (3 * BS), [], 3) is None  # never spilled
    assert cache.request_load(HOT, [], 0) is None  # nothing beyond the hit may be shared


def test_close_ends_the_queued_loads_and_returns(sink: DiskSink) -> None:
    cache = spill_hot(sink)
    gate, entered = threading.Event(), threading.Event()
    real_get = sink.store.get

    def slow_get(key: bytes, **kw: bool):
        entered.set()
        gate.wait(60)
        return real_get(key, **kw)

    sink.store.get = slow_get  # type: ignore[method-assign]
    first = cache.request_load(HOT + [3], [], 2)
    second = cache.request_load(HOT + [4], [], 2)
    assert first is not None and second is not None and entered.wait(60)
    closing = threading.Thread(target=sink.close)
    closing.start()
    assert sink._closing.wait(60)  # the close has begun before the held read returns
    gate.set()
    closing.join(60)
    assert not closing.is_alive() and first.done.is_set() and second.done.is_set()
    assert len(first.pairs) == 1 and second.pairs == {}  # the close stopped both chains early
