"""A tiny random Llama (2 layers, 4 query heads, 2 KV heads) for retention tests on the paged cache."""

from __future__ import annotations

import torch

from confkv_engine.model.llama import LlamaForCausalLM, ModelArgs


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
    m = LlamaForCausalLM(args).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.15)
    return m
