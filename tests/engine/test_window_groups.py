"""Sliding-window layers keep only their window (``cache.groups``).

- The grouping of real layer patterns (Gemma 3 270M, its llama.cpp form) and the models that keep
  one table (Llama, Mistral with its window on every layer).
- Exact block ids: which window blocks go back to the pool as the window moves, and that a
  sequence's held blocks stay bounded while the global group grows.
- Logits through the grouped cache equal the dense reference (``DenseAttention``, every key kept)
  far past the window: tiny random Gemma 3 models (HF layer types, and llama.cpp's 5:1 pattern),
  prefilled in chunks and decoded token by token beside a second sequence; decode-only steps read
  the window groups' tables with the native kernel (every layer), or gather them (``native=False``).
"""

from __future__ import annotations

import pytest
import torch

from confkv_engine.attention.kernels import native_decode
from confkv_engine.attention.paged import PagedAttention
from confkv_engine.cache.groups import GLOBAL, LayerGroups
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.model.loader import load_model
from tests.engine.tiny_models import dense_logits, make_tiny_hf_model

GEMMA3_270M_WINDOWS = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))


def test_gemma3_270m_layers_group_by_three():
    groups = LayerGroups.plan(GEMMA3_270M_WINDOWS, 18)
    assert groups is not None
    assert groups.global_layers == (5, 11, 17)
    assert groups.local_groups == ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert groups.place(11) == (GLOBAL, 1)
    assert groups.place(6) == (1, 2)
    assert groups.held_window_blocks(16) == 33  # 511 earlier tokens straddle 33 blocks of 16


@pytest.mark.parametrize("windows", [(), (16, 16, 16), (8, 0, 16)])
def test_one_table_without_a_mixed_pattern(windows):
    """Llama (no windows), Mistral (every layer windowed) and two window sizes keep one table."""
    assert LayerGroups.plan(windows, 3) is None


def _grouped_cache(num_blocks: int = 64) -> KVCache:
    groups = LayerGroups.plan((8, 0, 8), 3)  # local, global, local: two window groups of one layer
    spec = CacheSpec(1, 1, 4, 4, torch.float32, torch.device("cpu"), layer_groups=groups)
    return KVCache(spec, num_blocks)


def test_window_blocks_freed_as_the_window_moves():
    cache = _grouped_cache()
    seq = SeqKV()
    cache.reserve(seq, 10)  # 3 blocks per table: main K 1-3, V 4-6; group 0 K 7-9, V 10-12; group 1 ...
    assert (seq.k_blocks, seq.v_blocks) == ([1, 2, 3], [4, 5, 6])
    assert [(w.k_blocks, w.v_blocks) for w in seq.windows] == [([7, 8, 9], [10, 11, 12]),
                                                               ([13, 14, 15], [16, 17, 18])]
    cache.commit(seq, 10)  # the next query (token 10) sees tokens 3..10: block 0 is still read
    assert seq.window_first == 0
    cache.reserve(seq, 1)
    cache.commit(seq, 1)  # token 11 sees 4..11: block 0 of every window table goes back
    assert seq.window_first == 1
    assert [(w.k_blocks, w.v_blocks) for w in seq.windows] == [([0, 8, 9], [0, 11, 12]),
                                                               ([0, 14, 15], [0, 17, 18])]
    assert cache.pool.free_block_ids()[-4:] == [7, 10, 13, 16]  # freed per group, K then V
    for _ in range(2):
        cache.reserve(seq, 1)
        cache.commit(seq, 1)
    # token 12 needs block 3: the main tables take 19 and 20, the window groups 21-22 and 23-24
    assert [w.k_blocks for w in seq.windows] == [[0, 8, 9, 21], [0, 14, 15, 23]]
    cache.reserve(seq, 2)
    cache.commit(seq, 2)  # 15 tokens: the next query sees 8..15, so blocks 0 and 1 are gone
    assert seq.window_first == 2
    assert cache.pool.free_block_ids()[-4:] == [8, 11, 14, 17]
    cache.free(seq)
    assert cache.pool.num_used == 1  # the null block only


def test_held_blocks_stay_bounded_while_the_global_group_grows():
    cache = _grouped_cache(256)
    seq = SeqKV()
    for n in (12, 12, 12, 12):  # 48 tokens in chunks of 12, then decode steps
        cache.reserve(seq, n)
        cache.commit(seq, n)
    for _ in range(20):
        cache.reserve(seq, 1)
        cache.commit(seq, 1)
    length, bs = 68, 4
    main = 2 * -(-length // bs)
    assert len(seq.k_blocks) + len(seq.v_blocks) == main
    windows = cache.held_blocks(seq) - main
    # token 68 sees 61..68: blocks 15 and 16 of each of the 4 window tables (token 68's block comes
    # with the next step's reservation); 3 per table at most, when the window straddles one more
    assert windows == 4 * 2
    assert windows <= 4 * LayerGroups.plan((8, 0, 8), 3).held_window_blocks(bs)
    assert cache.held_blocks(seq) <= cache.blocks_for_tokens(length)
    assert cache.window_bytes(seq) == windows * cache.spec.block_bytes
    assert cache.seq_bytes(seq) == main * cache.spec.block_bytes  # budgets see the global group only


def test_reserve_takes_nothing_when_the_windows_do_not_fit():
    cache = _grouped_cache(8)  # 7 usable blocks: one block per table is 6, two are 12
    seq = SeqKV()
    cache.reserve(seq, 4)
    cache.commit(seq, 4)
    free = cache.num_free
    with pytest.raises(RuntimeError):
        cache.reserve(seq, 4)
    assert cache.num_free == free and len(seq.k_blocks) == 1


@torch.inference_mode()
def _grouped_logits(model, tokens: list[int], prompt_len: int, chunk: int, block: int,
                    native: bool) -> torch.Tensor:
    """Logits of ``tokens`` through a grouped cache: prompt chunks of ``chunk``, then one token per
    step, beside a second sequence decoding on its own (so decode rows batch)."""
    args = model.args
    groups = LayerGroups.plan(args.layer_windows, args.num_layers)
    assert groups is not None
    spec = CacheSpec(groups.group_size, args.num_kv_heads, args.head_dim, block, torch.float32,
                     torch.device("cpu"), layer_groups=groups)
    cache = KVCache(spec, 256)
    backend = PagedAttention(cache, args.num_heads, native=native)
    assert backend.native_ok is (native and native_decode.available())
    main, other, other_next = SeqKV(), SeqKV(), 3
    rows, done = [], 0
    while done < len(tokens):
        n = min(chunk, prompt_len - done) if done < prompt_len else 1
        seqs, counts = [other, main], [1, n]
        pos = [other.window_slots, *range(done, done + n)]
        for s, c in zip(seqs, counts, strict=True):
            cache.reserve(s, c)
        backend.begin_step(seqs, counts, torch.tensor(pos))
        hidden = model(torch.tensor([other_next, *tokens[done:done + n]]), torch.tensor(pos), backend)
        backend.end_step()
        logits = model.compute_logits(hidden)
        other_next = int(logits[0].argmax())
        rows.append(logits[1:])
        done += n
        assert cache.held_blocks(main) <= cache.blocks_for_tokens(done) + 2 * groups.num_window_groups * 2
    return torch.cat(rows)


@pytest.mark.parametrize("native", [True, False], ids=["native", "gather"])
@pytest.mark.parametrize(("arch", "chunk", "block"), [("gemma3", 8, 4), ("gemma3-llamacpp", 12, 4)])
def test_grouped_cache_logits_equal_dense(arch, chunk, block, native, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    if native and not native_decode.available():
        pytest.skip("the native decode library is not built")
    calls = []
    kernel = native_decode.decode_attention
    monkeypatch.setattr(native_decode, "decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    torch.manual_seed(0)
    _, model_dir = make_tiny_hf_model(arch, tmp_path)
    model = load_model(str(model_dir)).model
    tokens = [(i * 37 + 11) % 250 for i in range(48)]  # window 8: six windows past the first
    prompt_len = 30
    ref = dense_logits(model, tokens, prompt_len)
    ours = _grouped_logits(model, tokens, prompt_len, chunk, block, native)
    decode_steps = len(tokens) - prompt_len
    assert len(calls) == (decode_steps * model.args.num_layers if native else 0)
    assert (ours - ref).abs().max().item() <= 1e-4
    assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()


def _tiny_engine(tmp_path, blocks: int | None = None):
    """The tiny Gemma 3 served by ``LLMEngine`` (fp32, 16-token blocks), ``blocks`` usable blocks."""
    from confkv_api.config import ConfKVConfig
    from confkv_engine.core.engine import LLMEngine

    pytest.importorskip("transformers")
    _, model_dir = make_tiny_hf_model("gemma3", tmp_path)
    loaded = load_model(str(model_dir))
    args = loaded.model.args  # one global layer: blocks of one layer
    block_bytes = args.num_kv_heads * (args.head_dim * 4 + 4) * 16
    size = "8Mi" if blocks is None else str((blocks + 1) * block_bytes)
    cfg = ConfKVConfig.model_validate({
        "engine": {"prefillChunk": 16, "maxNumBatchedTokens": 64, "blockSize": 16, "maxBatchSize": 4},
        "confkv": {"maxCacheSize": size}})
    return loaded, LLMEngine(loaded, cfg)


def _run(eng, prompts: list[list[int]], params) -> dict:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    final = {}
    while eng.has_unfinished():
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    return final


def test_engine_greedy_equals_dense_and_retention_acts_on_the_global_group(tmp_path):
    from confkv_engine.core.sampling_params import SamplingParams

    loaded, eng = _tiny_engine(tmp_path)
    assert eng.cache.spec.layer_groups is not None and not eng.cache.prefix_enabled
    prompts = [[(i * k + 11) % 250 for i in range(60 + 9 * k)] for k in (1, 2, 3)]
    full = _run(eng, prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for i, p in enumerate(prompts):  # batched through the grouped cache = dense, every key kept
        out = full[f"r{i}"].output_token_ids
        ref = dense_logits(loaded.model, p + list(out[:-1]), len(p))[len(p) - 1:]
        assert ref.argmax(-1).tolist() == list(out)
    assert eng.cache.used_bytes == 0
    kept = _run(eng, prompts[:1], SamplingParams(max_tokens=24, temperature=0.0, kv_policy="conf-kv",
                                                 kv_budget=0.3))["r0"]
    assert len(kept.output_token_ids) == 24
    u = kept.kv_usage  # it acted: the default precision chain quantizes or drops global-group tokens
    assert u.tokens_discarded + u.tokens_int8 + u.tokens_int4 + u.tokens_k4v2 + u.tokens_int2 > 0
    assert kept.kv_usage.peak_kv_bytes < full["r0"].kv_usage.peak_kv_bytes
    assert eng.cache.used_bytes == 0


def test_engine_preempts_and_replays_grouped_sequences(tmp_path):
    """A pool too small for three sequences at once: preemption frees their window tables too, and
    the replays give the dense reference's tokens."""
    from confkv_engine.core.sampling_params import SamplingParams

    loaded, eng = _tiny_engine(tmp_path, blocks=40)
    assert eng.cache.num_blocks == 40
    prompts = [[(i * k + 5) % 250 for i in range(70 + 7 * k)] for k in (1, 2, 3)]
    final = _run(eng, prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert eng.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        out = final[f"r{i}"].output_token_ids
        ref = dense_logits(loaded.model, p + list(out[:-1]), len(p))[len(p) - 1:]
        assert ref.argmax(-1).tolist() == list(out)
    assert eng.cache.used_bytes == 0
