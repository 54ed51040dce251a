"""Parity with Hugging Face transformers through the paged cache.

Tiny random Llama (llama3 rope scaling) and Qwen2 (q/k/v bias, tied embeddings) models: a 70-token
prompt (5 blocks of 16) prefilled in chunks of 32 through ``KVCache`` + ``PagedAttention``, batched
with a second sequence, then 20 greedy decode steps; every logit within 1e-4 of transformers.
"""

from __future__ import annotations

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.attention.paged import PagedAttention
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from tests.engine.tiny_models import ARCHS, hf_greedy_reference, make_tiny_hf_model

pytest.importorskip("transformers")

PROMPT = [(i * 37 + 11) % 250 for i in range(70)]
OTHER = [(i * 13 + 5) % 250 for i in range(41)]
CHUNK, BLOCK, STEPS = 32, 16, 20


@torch.inference_mode()
def paged_logits(model, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits at every position of ``tokens``: prefill chunks of CHUNK, then one token per step,
    always batched with a second sequence (prefilling, then decoding its own greedy tokens)."""
    args = model.args
    spec = CacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, BLOCK, torch.float32,
                     torch.device("cpu"))
    cache = KVCache(spec, 64)
    backend = PagedAttention(cache, args.num_heads)
    main, other = SeqKV(), SeqKV()
    other_tokens, done, rows = list(OTHER), 0, []
    while done < len(tokens):
        n = min(CHUNK, prompt_len - done) if done < prompt_len else 1
        n_other = min(CHUNK, len(other_tokens) - other.num_slots) or 1
        if other.num_slots + n_other > len(other_tokens):
            n_other = 1
        seqs, counts = [other, main], [n_other, n]
        ids = other_tokens[other.num_slots:other.num_slots + n_other] + tokens[done:done + n]
        pos = list(range(other.num_slots, other.num_slots + n_other)) + list(range(done, done + n))
        for s, c in zip(seqs, counts, strict=True):
            cache.reserve(s, c)
        backend.begin_step(seqs, counts, torch.tensor(pos))
        hidden = model(torch.tensor(ids), torch.tensor(pos), backend)
        backend.end_step()
        logits = model.compute_logits(hidden)
        rows.append(logits[n_other:])
        if other.num_slots == len(other_tokens):
            other_tokens.append(int(logits[n_other - 1].argmax()))
        done += n
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_logits_match_transformers(arch, tmp_path):
    hf_model, model_dir = make_tiny_hf_model(arch, tmp_path)
    loaded = load_model(str(model_dir), dtype=torch.float32, device="cpu")
    tokens, ref = hf_greedy_reference(hf_model, PROMPT, steps=STEPS)
    ours = paged_logits(loaded.model, tokens, prompt_len=len(PROMPT))
    assert ours.shape == ref.shape == (len(PROMPT) + STEPS, loaded.args.vocab_size)
    assert (ours - ref).abs().max().item() <= 1e-4

    # The same through the engine's scheduler: greedy tokens equal transformers'.
    cfg = ConfKVConfig.model_validate({"engine": {"prefillChunk": CHUNK, "blockSize": BLOCK},
                                       "confkv": {"maxCacheSize": "8Mi"}})
    engine = LLMEngine(loaded, cfg)
    out = engine.generate([PROMPT, OTHER], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    assert out[0].output_token_ids == tokens[len(PROMPT):]
