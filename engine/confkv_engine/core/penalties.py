"""Logit processors applied before sampling: ``logit_bias`` and the repetition penalties.

Both follow vLLM (which follows OpenAI and Hugging Face): the bias is added to the raw logits,
then ``repetition_penalty`` (prompt and output tokens alike; CTRL's rule: a positive logit is
divided by the penalty, a negative one multiplied, so the token always becomes less likely for a
penalty > 1), then ``frequency_penalty * count`` and ``presence_penalty * [count > 0]`` are
subtracted, counting output tokens only. They run on the logits used to choose the token; the
logprobs a request returns stay the raw model's (vLLM's default ``raw_logprobs``).

Pure tensor functions on ``logits`` [B, V] fp32, in place; rows without any of these settings are
not touched, so a batch of plain requests pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from confkv_engine.cache.staging import send_pinned
from confkv_engine.core.sampling_params import SamplingParams


def apply_logit_bias(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Add each row's ``logit_bias``; ids outside the vocabulary are ignored. In place; returns logits."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            if 0 <= token_id < vocab:
                rows.append(i)
                cols.append(token_id)
                values.append(bias)
    if rows:
        dev = logits.device
        index = (send_pinned(rows, dev), send_pinned(cols, dev))
        logits.index_put_(index, send_pinned(values, dev, logits.dtype), accumulate=True)
    return logits


def apply_penalties(
    logits: Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> Tensor:
    """Repetition, frequency and presence penalties per row (see the module docstring). In place."""
    for i, p in enumerate(params):
        if not p.has_penalties:
            continue
        row = logits[i]
        counts = _counts(output_ids[i], row.shape[0], row.device)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen |= _counts(prompt_ids[i], row.shape[0], row.device) > 0
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        if p.frequency_penalty:
            row.sub_(p.frequency_penalty * counts.to(row.dtype))
        if p.presence_penalty:
            row.sub_(p.presence_penalty * (counts > 0).to(row.dtype))
    return logits


def _counts(token_ids: Sequence[int], vocab: int, device: torch.device) -> Tensor:
    """Occurrences of every vocabulary id in ``token_ids`` -> [V] int64 (ids outside are dropped)."""
    if not token_ids:
        return torch.zeros(vocab, dtype=torch.long, device=device)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
    ids = ids[(ids >= 0) & (ids < vocab)]
    return torch.bincount(ids, minlength=vocab)[:vocab]
