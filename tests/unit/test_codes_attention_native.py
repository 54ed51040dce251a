"""Decode attention straight from the codes (``codec.native.attend_codes``) equals decoding the blocks
(``codec.blocks.decode_rows``) and attending the decoded keys and values, merged exactly with a part
attended elsewhere (the pool's rows): random real encodings, int8 / int4 / int2 and int4 keys with int2
values, fp16 and dq6 key parameters, ragged rows (one with no compressed block), a partly valid
block, GQA 1 and 3, head dims 64, 128 and 256, value groups of 32 (the generic fold) and of head_dim (the
codecs' usual shape, compiled per shape), the latter in both its forms (arrays; AVX2 vectors where the
CPU has them)."""

from __future__ import annotations

import math

import pytest
import torch

from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.codec import native
from confkv_engine.cache.codec.blocks import decode_rows, encode_rows

pytestmark = pytest.mark.skipif(not native.available(), reason="the native codec library is not built")

BS, HEADS = 16, 2


def _pair(bits: tuple[int, int], dim: int, element_bytes: int, value_group: int = 32):
    k_spec, _ = block_codecs(BS, HEADS, dim, bits[0], dim, element_bytes=element_bytes)
    _, v_spec = block_codecs(BS, HEADS, dim, bits[1], value_group, element_bytes=element_bytes)
    return k_spec, v_spec


@pytest.fixture(params=["generic", "arrays", "vectors"])
def fold(request):
    """Which fold the library runs: the generic one (value groups of 32), or for the usual shape (value
    groups of head_dim) its array form or its vector form (skipped where the CPU has no x86-64-v3)."""
    if request.param == "vectors" and not native.vector_folds(True):
        pytest.skip("no AVX2 / FMA / F16C here: the vector folds do not run")
    native.vector_folds(request.param == "vectors")
    yield request.param
    native.vector_folds(True)  # back to the library's own choice (vectors where the CPU has them)


def _reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Hq, D], keys/vals [S, Hkv, D] (float64) -> out [Hq, D], lse [Hq]."""
    g = q.shape[0] // keys.shape[1]
    k, v = keys.repeat_interleave(g, 1).transpose(0, 1), vals.repeat_interleave(g, 1).transpose(0, 1)
    scores = torch.einsum("hd,hsd->hs", q, k) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("hs,hsd->hd", torch.exp(scores - lse[:, None]), v), lse


@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (2, 2), (4, 2)])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("element_bytes", [4, 2])  # fp16 key parameters (fp32 pool), dq6 (bf16 pool)
def test_codes_attention_equals_decode_then_attend(bits, group, dim, element_bytes, fold):
    torch.manual_seed(sum(bits) * 100 + group * 10 + dim + element_bytes)
    k_spec, v_spec = _pair(bits, dim, element_bytes, 32 if fold == "generic" else dim)
    counts = [3, 0, 40, 1]  # compressed blocks per row; 40 splits over several work items
    n, hq = sum(counts), HEADS * group
    k_rows = encode_rows(torch.randn(n, BS, HEADS, dim) * 2, k_spec)
    v_rows = encode_rows(torch.randn(n, BS, HEADS, dim), v_spec)
    valid = torch.full((n,), BS, dtype=torch.int32)
    valid[2] = 5  # the last block of row 0 partly written
    row_start = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    q = torch.randn(len(counts), hq, dim)
    own_k, own_v = torch.randn(len(counts), 7, HEADS, dim), torch.randn(len(counts), 7, HEADS, dim)
    keys, vals = decode_rows(k_rows, k_spec).double(), decode_rows(v_rows, v_spec).double()
    state = [torch.empty(len(counts), hq), torch.ones(len(counts), hq), torch.empty(len(counts), hq, dim)]
    for r in range(len(counts)):  # the pool's part of each row, as the backend passes it in
        state[2][r], state[0][r] = _reference(q[r].double(), own_k[r].double(), own_v[r].double())
    native.attend_codes((q / math.sqrt(dim)).contiguous(), native.row_bytes(k_rows), k_spec,
                        native.row_bytes(v_rows), v_spec, row_start, valid, (state[0], state[1], state[2]))
    for r in range(len(counts)):
        blocks = range(int(row_start[r]), int(row_start[r + 1]))
        ks = [keys[i, :int(valid[i])] for i in blocks] + [own_k[r].double()]
        vs = [vals[i, :int(valid[i])] for i in blocks] + [own_v[r].double()]
        out, lse = _reference(q[r].double(), torch.cat(ks), torch.cat(vs))
        got = state[2][r] / state[1][r][:, None]
        assert (got.double() - out).abs().max() < 1e-5
        assert (state[0][r] + state[1][r].log() - lse).abs().max() < 1e-5


def test_codes_attention_refuses_what_it_does_not_cover():
    k_spec, v_spec = _pair((4, 4), 64, 4)
    state = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, 64))
    k_rows = torch.zeros(1, k_spec.nbytes, dtype=torch.uint8)
    v_rows = torch.zeros(1, v_spec.nbytes, dtype=torch.uint8)
    one, valid = torch.tensor([0, 1]), torch.tensor([16], dtype=torch.int32)
    with pytest.raises(ValueError):  # row_start names a block that is not there
        native.attend_codes(torch.zeros(1, 2, 64), native.row_bytes(k_rows), k_spec, native.row_bytes(v_rows),
                            v_spec, torch.tensor([0, 2]), valid, state)
    with pytest.raises(ValueError):  # an offset past the bytes: the library never reads outside them
        native.attend_codes(torch.zeros(1, 2, 64), (k_rows.view(-1), torch.tensor([1]), None), k_spec,
                            native.row_bytes(v_rows), v_spec, one, valid, state)
    stream = torch.zeros(2 * k_spec.nbytes, dtype=torch.uint8)
    for tail in ([[100, 2 * k_spec.nbytes - 10]], [[0, 0]]):  # the rest past the bytes; an empty first piece
        with pytest.raises(ValueError):
            keys = (stream, torch.tensor([0]), torch.tensor(tail))
            values = native.row_bytes(v_rows)
            native.attend_codes(torch.zeros(1, 2, 64), keys, k_spec, values, v_spec, one, valid, state)
    with pytest.raises(ValueError):  # keys grouped along head_dim are not what the library reads
        native.attend_codes(torch.zeros(1, 2, 64), native.row_bytes(v_rows), v_spec, native.row_bytes(v_rows),
                            v_spec, one, valid, state)


@pytest.mark.parametrize("bits", [(4, 4), (4, 2)])
def test_blocks_in_two_pieces_equal_the_same_blocks_whole(bits):
    """A slot straddling two pool blocks that are not neighbours is read in two pieces (``tails``),
    joined inside the library: the same state to the bit as the blocks read whole."""
    torch.manual_seed(7)
    k_spec, v_spec = _pair(bits, 64, 2)
    n, hq = 12, HEADS * 3
    k_rows = encode_rows(torch.randn(n, BS, HEADS, 64), k_spec)
    v_rows = encode_rows(torch.randn(n, BS, HEADS, 64), v_spec)
    valid, row_start = torch.full((n,), BS, dtype=torch.int32), torch.tensor([0, 5, 12])
    q = torch.randn(2, hq, 64)

    def scattered(rows: torch.Tensor, cuts: list[int]):
        """Each block's first ``cut`` bytes in one half of a stream, the rest in the other half."""
        nb = rows.shape[1]
        stream = torch.randint(0, 256, (2 * n * nb,), dtype=torch.uint8)
        off, rest = torch.arange(n) * nb, n * nb + torch.arange(n).flip(0) * nb
        for i, c in enumerate(cuts):
            stream[off[i]:off[i] + c] = rows[i, :c]
            stream[rest[i]:rest[i] + nb - c] = rows[i, c:]
        return stream, off, torch.stack([torch.tensor(cuts), rest], 1)

    def attend(keys, values):
        state = (torch.zeros(2, hq), torch.ones(2, hq), torch.zeros(2, hq, 64))
        native.attend_codes(q.contiguous(), keys, k_spec, values, v_spec, row_start, valid, state)
        return state

    want = attend(native.row_bytes(k_rows), native.row_bytes(v_rows))
    k_cuts = [k_spec.nbytes if i % 3 == 0 else 1 + 97 * i % (k_spec.nbytes - 1) for i in range(n)]
    v_cuts = [v_spec.nbytes if i % 4 == 1 else 1 + 89 * i % (v_spec.nbytes - 1) for i in range(n)]
    got = attend(scattered(k_rows, k_cuts), scattered(v_rows, v_cuts))
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
