"""Side streams for cache work (``cache.streams``) on CPU, where there are none: the roles of
``engine.cudaStreams``, and a spill's bytes copied at spill time (the pool block is reused at once,
so bytes read later by the disk writer must not see its next contents)."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.cache.kv_cache import SeqKV
from confkv_engine.cache.streams import CacheStreams
from tests.unit.test_cache_compression import BS, fill, make_cache


def test_the_roles_of_the_side_streams() -> None:
    one = CacheStreams(torch.device("cpu"), 1)
    assert one.spill is one.readback is one.for_compression() is one.for_compression()
    four = CacheStreams(torch.device("cpu"), 4)
    assert len({id(four.spill), id(four.readback)}) == 2
    rotation = [four.for_compression() for _ in range(4)]
    assert rotation[0] is rotation[2] and rotation[1] is rotation[3] and rotation[0] is not rotation[1]
    assert not {id(s) for s in rotation} & {id(four.spill), id(four.readback)}
    assert four.compute is None and four.fence() is None  # CPU: no streams, no events
    with pytest.raises(ValueError, match="at least one"):
        CacheStreams(torch.device("cpu"), 0)


def test_a_spill_payload_is_the_block_as_it_was_when_spilled() -> None:
    cache = make_cache(12, prefix=True)
    a = SeqKV()
    fill(cache, a, 2 * BS)
    cache.register(a, list(range(2 * BS)))
    entry = cache.prefix.get(a.block_keys[0])
    expected = cache.entry_payload(entry)
    pending = cache.spill_payload(entry)
    cache.kv[:, entry.k_block] = 7.0  # the block is rewritten before the writer reads the payload
    assert pending.bytes() == expected
