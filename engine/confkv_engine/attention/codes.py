"""Compressed blocks attended straight from their codes (CPU, the native codec library): decode rows',
and a prefill chunk's cached part (its T queries fold into the head axis: every cached block is
before the chunk, so all of them see it, and the library decodes each block once for them all).

The gathering path decoded every compressed block (retention's int8 / int4 / k4v2 / int2 frozen blocks,
the cache's cold blocks) into the gathered table in every layer of every decode step, then attended
the table. Here a decode group's tables are split once per step (``SplitMemo``: reused from the step
before while a row's table and its compressed blocks are unchanged, i.e. between decision steps):

- the *pool* entries (FULL and KEY_ONLY blocks) are gathered as before, compacted (the compressed
  entries left out, so the gather is narrower) and attended by the flash kernel with its log-sum-exp;
- the *compressed* entries, per (key codec, value codec) pair, go to ``codec.native.attend_codes``,
  which reads each block's codes and group parameters (fp16 or dq6) where the pool holds them (a slot
  straddling two pool blocks that are not neighbours in two pieces, joined in the library) and folds
  the scores and values into the pool part's running (max, sum, accumulator), the flash-decoding
  identity of ``attention.partial``: the result is attention over the union, with no decoded element
  written and no codes copied.

Leaving entries out of the gathered table reorders no key a query sees: the cache holds keys after
RoPE and a decode row sees every slot of its sequence, so attention is a sum over a set of slots.
The table is only split when every compressed K entry has a compressed V entry at the same index and
the native library covers both codecs; anything else (and sliding-window layers, whose visible slots
are counted in the uncompacted table) keeps the gathering path with decode-on-read.

On by default for decode rows where the library is (measured faster than decode-then-attend in the
engine step, docs/performance.md, "Attention over the codes"); ``CONFKV_CODES_ATTENTION=0`` in the
environment, or ``from_codes=False`` to the backend, keeps decode-then-attend.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from confkv_engine.cache.arena import SlotPieces, SlotReads
from confkv_engine.cache.block_pool import is_compressed
from confkv_engine.cache.codec import native
from confkv_engine.cache.codec.spec import CodecSpec
from confkv_engine.cache.kv_cache import KVCache, SeqKV


@dataclass(frozen=True)
class CodesGroup:
    """One codec pair's compressed blocks of a decode group, in row order: where their K and V slots lie
    (read there, a slot straddling two hosts in its two pieces; ``SlotReads``, copied per layer, only
    where a slot spans more hosts, in a pool of one-byte elements)."""

    k_spec: CodecSpec
    v_spec: CodecSpec
    k_reads: SlotPieces | SlotReads
    v_reads: SlotPieces | SlotReads
    row_start: Tensor  # int64 [B + 1]: row r owns blocks row_start[r]:row_start[r + 1]
    valid: Tensor  # int32 [N]: tokens held by each block


@dataclass(frozen=True)
class CodesSplit:
    """A decode group's tables split into pool entries (gathered) and compressed ones (from codes)."""

    k_tables: list[list[int]]  # per row, its pool K entries in table order
    v_tables: list[list[int]]
    lengths: list[int]  # per row, slots visible in the compacted pool tables
    removed: list[list[int]]  # per row, the table indices attended from codes (ascending)
    groups: tuple[CodesGroup, ...]


Pair = tuple[CodecSpec, CodecSpec]


@dataclass(frozen=True)
class _RowSplit:
    """One table pair's split, independent of the row's length: pool entries and compressed ones
    as (table index, codec pair, K handle, V handle)."""

    k_table: list[int]
    v_table: list[int]
    compressed: tuple[tuple[int, Pair, int, int], ...]


class SplitMemo:
    """Row splits and codec groups of the last two steps, reused while their entries are unchanged:
    between decision steps a decode row's table gains at most a pool block, so the step's split is
    mostly last step's. Keys hold block ids and handles, never slots: a handle is never reused and
    a live handle's slot never moves (nor its arena's hosts), so an equal key reads the same bytes."""

    def __init__(self) -> None:
        self._now: dict[object, object] = {}
        self._before: dict[object, object] = {}

    def next_step(self) -> None:
        """Keep what this step used, drop what the step before used and this one did not."""
        self._before, self._now = self._now, {}

    def get(self, key: object) -> object | None:
        value = self._now.get(key)
        if value is None:
            value = self._before.get(key)
            if value is not None:
                self._now[key] = value
        return value

    def put(self, key: object, value: object) -> None:
        self._now[key] = value


# CONFKV_CODES_ATTENTION=0 turns the default off (decode-then-attend, for comparisons).
SWITCH = "CONFKV_CODES_ATTENTION"
_UNCOVERED = "uncovered"  # memo value of a table pair that cannot be attended from codes


def wanted(from_codes: bool | None) -> bool:
    """A backend's choice: ``from_codes`` when given, else on unless the environment switch says 0."""
    return os.environ.get(SWITCH, "1") != "0" if from_codes is None else from_codes


def available(cache: KVCache) -> bool:
    """Whether compressed blocks of this cache can be attended from their codes here."""
    return cache.kv.device.type == "cpu" and native.available()


def split(cache: KVCache, seqs: list[SeqKV], memo: SplitMemo | None = None,
          visible: list[int] | None = None) -> CodesSplit | None:
    """The split of decode rows ``seqs`` (their new slot reserved), or None when no row has a
    compressed entry or one cannot be attended from codes (the caller then gathers and decodes).
    ``visible``: the slots each row sees (default ``num_slots + 1``, a decode row's; a prefill
    chunk's cached part passes ``num_slots``)."""
    memo = memo or SplitMemo()
    bs = cache.spec.block_size
    k_tables, v_tables, lengths, removed = [], [], [], []
    by_pair: dict[Pair, list[tuple[int, int, int, int]]] = {}
    for row, s in enumerate(seqs):
        rs = _row_split(cache, s, memo)
        if rs is None:
            return None
        length, gone = s.num_slots + 1 if visible is None else visible[row], []
        for j, pair, kb, vb in rs.compressed:
            valid = min(bs, length - j * bs)
            if valid <= 0:
                continue  # a reserved block past the row's slots holds nothing visible
            by_pair.setdefault(pair, []).append((row, kb, vb, valid))
            gone.append(j)
        k_tables.append(rs.k_table)
        v_tables.append(rs.v_table)
        lengths.append(length - sum(min(bs, length - j * bs) for j in gone))
        removed.append(gone)
    if not by_pair:
        return None
    groups = []
    for pair, entries in by_pair.items():
        key = (pair, len(seqs), tuple(entries))
        group = memo.get(key)
        if group is None:
            group = _group(cache, pair, entries, len(seqs))
            memo.put(key, group)
        groups.append(group)
    return CodesSplit(k_tables, v_tables, lengths, removed, tuple(groups))


def _row_split(cache: KVCache, s: SeqKV, memo: SplitMemo) -> _RowSplit | None:
    key = (tuple(s.k_blocks), tuple(s.v_blocks))
    found = memo.get(key)
    if found is None:
        found = _split_tables(cache, s.k_blocks, s.v_blocks) or _UNCOVERED
        memo.put(key, found)
    return found if isinstance(found, _RowSplit) else None


def _split_tables(cache: KVCache, k_blocks: list[int], v_blocks: list[int]) -> _RowSplit | None:
    store = cache.store
    kt, vt, compressed = [], [], []
    for j, (kb, vb) in enumerate(zip(k_blocks, v_blocks, strict=True)):
        if is_compressed(kb) != is_compressed(vb):
            return None
        if not is_compressed(kb):
            kt.append(kb)
            vt.append(vb)
            continue
        k_spec, v_spec = store.spec(kb), store.spec(vb)
        if not native.codes_pair_covered(k_spec, v_spec):
            return None
        compressed.append((j, (k_spec, v_spec), kb, vb))
    return _RowSplit(kt, vt, tuple(compressed))


def _group(cache: KVCache, pair: Pair, entries: list[tuple[int, int, int, int]], rows: int) -> CodesGroup:
    """A codec pair's blocks, ``entries`` (row, K handle, V handle, valid tokens) in row order."""
    k_spec, v_spec = pair
    store, dev = cache.store, cache.kv.device
    k_slots = [store.slot_of(e[1])[1] for e in entries]
    v_slots = [store.slot_of(e[2])[1] for e in entries]
    k_reads = store.slot_pieces(k_spec, k_slots, dev) or store.slot_reads(k_spec, k_slots, dev)
    v_reads = store.slot_pieces(v_spec, v_slots, dev) or store.slot_reads(v_spec, v_slots, dev)
    counts = [0] * rows
    for row, _, _, _ in entries:  # entries come in row order
        counts[row] += 1
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return CodesGroup(k_spec, v_spec, k_reads, v_reads, torch.tensor(starts, dtype=torch.int64),
                      torch.tensor([e[3] for e in entries], dtype=torch.int32))


def compacted(split_: CodesSplit, row: int, slot: int, block_size: int) -> int:
    """Where slot ``slot`` of row ``row``'s table lies in its compacted pool table (a pool slot)."""
    return slot - block_size * sum(1 for j in split_.removed[row] if j < slot // block_size)


def merge(cache: KVCache, layer: int, q: Tensor, split_: CodesSplit, out: Tensor, lse: Tensor) -> Tensor:
    """Attention of decode queries q [B, Hq, D] over their pool part (``out`` [B, Hq, D], ``lse``
    [B, Hq], from the flash kernel) and their compressed blocks, in q's dtype."""
    return merge_lse(cache, layer, q, split_, out, lse)[0]


def merge_lse(cache: KVCache, layer: int, q: Tensor, split_: CodesSplit, out: Tensor,
              lse: Tensor) -> tuple[Tensor, Tensor]:
    """``merge`` and the union's log-sum-exp [B, Hq] (fp32), for a caller that combines further.
    The library maps query head h to KV head h // (Hq / Hkv), so a prefill chunk's T queries of one
    sequence go in as one row of Hkv x G x T heads (ordered by KV head), every cached block
    visible to all of them."""
    m = lse.float().contiguous()
    l = torch.ones_like(m)  # noqa: E741 (the softmax's running sum, as in the flash literature)
    acc = out.float().contiguous()
    qs = (q.float() * (1.0 / math.sqrt(q.shape[-1]))).contiguous()
    for g in split_.groups:
        keys, values = _source(cache, layer, g.k_spec, g.k_reads), _source(cache, layer, g.v_spec, g.v_reads)
        native.attend_codes(qs, keys, g.k_spec, values, g.v_spec, g.row_start, g.valid, (m, l, acc))
    return (acc / l[..., None]).to(q.dtype), m + torch.log(l)


def _source(cache: KVCache, layer: int, spec: CodecSpec, reads: SlotPieces | SlotReads) -> native.Source:
    """A group's K or V blocks of ``layer`` as ``attend_codes`` reads them."""
    if isinstance(reads, SlotPieces):
        return cache.store.bytes[layer], reads.starts, reads.tails
    return (*cache.store.slot_bytes(layer, spec, reads), None)
