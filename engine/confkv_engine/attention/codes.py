"""Decode rows' compressed blocks attended straight from their codes (CPU, the native codec library).

The gathering path decoded every compressed block (retention's int8 / int4 / k4v2 / int2 frozen blocks,
the cache's cold blocks) into the gathered table in every layer of every decode step, then attended
the table. Here a decode group's tables are split once per step:

- the *pool* entries (FULL and KEY_ONLY blocks) are gathered as before, compacted (the compressed
  entries left out, so the gather is narrower) and attended by the flash kernel with its log-sum-exp;
- the *compressed* entries, per (key codec, value codec) pair, go to ``codec.native.attend_codes``,
  which reads each block's codes and group parameters (fp16 or dq6) and folds the scores and values
  into the pool part's running (max, sum, accumulator), the flash-decoding identity of
  ``attention.partial``: the result is attention over the union, with no decoded element written.

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

from confkv_engine.cache.arena import SlotReads
from confkv_engine.cache.block_pool import is_compressed
from confkv_engine.cache.codec import native
from confkv_engine.cache.codec.spec import CodecSpec
from confkv_engine.cache.kv_cache import KVCache, SeqKV


@dataclass(frozen=True)
class CodesGroup:
    """One codec pair's compressed blocks of a decode group, in row order."""

    k_spec: CodecSpec
    v_spec: CodecSpec
    k_reads: SlotReads
    v_reads: SlotReads
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


# CONFKV_CODES_ATTENTION=0 turns the default off (decode-then-attend, for comparisons).
SWITCH = "CONFKV_CODES_ATTENTION"


def wanted(from_codes: bool | None) -> bool:
    """A backend's choice: ``from_codes`` when given, else on unless the environment switch says 0."""
    return os.environ.get(SWITCH, "1") != "0" if from_codes is None else from_codes


def available(cache: KVCache) -> bool:
    """Whether compressed blocks of this cache can be attended from their codes here."""
    return cache.kv.device.type == "cpu" and native.available()


def split(cache: KVCache, seqs: list[SeqKV]) -> CodesSplit | None:
    """The split of decode rows ``seqs`` (their new slot reserved), or None when no row has a
    compressed entry or one cannot be attended from codes (the caller then gathers and decodes)."""
    bs, store = cache.spec.block_size, cache.store
    k_tables, v_tables, lengths, removed = [], [], [], []
    by_pair: dict[tuple[CodecSpec, CodecSpec], list[tuple[int, int, int, int]]] = {}
    for row, s in enumerate(seqs):
        length, kt, vt, gone = s.num_slots + 1, [], [], []
        for j, (kb, vb) in enumerate(zip(s.k_blocks, s.v_blocks, strict=True)):
            if is_compressed(kb) != is_compressed(vb):
                return None
            if not is_compressed(kb):
                kt.append(kb)
                vt.append(vb)
                continue
            (k_spec, k_slot), (v_spec, v_slot) = store.slot_of(kb), store.slot_of(vb)
            if not native.codes_pair_covered(k_spec, v_spec):
                return None
            valid = min(bs, length - j * bs)
            if valid <= 0:
                continue  # a reserved block past the row's slots holds nothing visible
            by_pair.setdefault((k_spec, v_spec), []).append((row, k_slot, v_slot, valid))
            gone.append(j)
        k_tables.append(kt)
        v_tables.append(vt)
        lengths.append(length - sum(min(bs, length - j * bs) for j in gone))
        removed.append(gone)
    if not by_pair:
        return None
    dev = cache.kv.device
    groups = tuple(_group(cache, pair, entries, len(seqs), dev) for pair, entries in by_pair.items())
    return CodesSplit(k_tables, v_tables, lengths, removed, groups)


def _group(cache: KVCache, pair: tuple[CodecSpec, CodecSpec], entries: list[tuple[int, int, int, int]],
           rows: int, device: torch.device) -> CodesGroup:
    counts = [0] * rows
    for row, _, _, _ in entries:  # entries come in row order
        counts[row] += 1
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    k_spec, v_spec = pair
    return CodesGroup(k_spec, v_spec,
                      cache.store.slot_reads(k_spec, [e[1] for e in entries], device),
                      cache.store.slot_reads(v_spec, [e[2] for e in entries], device),
                      torch.tensor(starts, dtype=torch.int64),
                      torch.tensor([e[3] for e in entries], dtype=torch.int32))


def compacted(split_: CodesSplit, row: int, slot: int, block_size: int) -> int:
    """Where slot ``slot`` of row ``row``'s table lies in its compacted pool table (a pool slot)."""
    return slot - block_size * sum(1 for j in split_.removed[row] if j < slot // block_size)


def merge(cache: KVCache, layer: int, q: Tensor, split_: CodesSplit, out: Tensor, lse: Tensor) -> Tensor:
    """Attention of decode queries q [B, Hq, D] over their pool part (``out`` [B, Hq, D], ``lse``
    [B, Hq], from the flash kernel) and their compressed blocks, in q's dtype."""
    m = lse.float().contiguous()
    l = torch.ones_like(m)  # noqa: E741 (the softmax's running sum, as in the flash literature)
    acc = out.float().contiguous()
    qs = (q.float() * (1.0 / math.sqrt(q.shape[-1]))).contiguous()
    for g in split_.groups:
        keys = cache.store.slot_bytes(layer, g.k_spec, g.k_reads)
        values = cache.store.slot_bytes(layer, g.v_spec, g.v_reads)
        native.attend_codes(qs, keys, g.k_spec, values, g.v_spec, g.row_start, g.valid, (m, l, acc))
    return (acc / l[..., None]).to(q.dtype)
