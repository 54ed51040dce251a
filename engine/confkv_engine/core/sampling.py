"""Sampling layer: the engine calls these once per step for the whole batch.

Pure tensor functions (no engine state). Shapes: B = sequences in the step, V = vocabulary,
T = prompt positions. Logits are fp32 and *raw* (before temperature and masks): logprobs are always
taken from the untempered log-softmax, so a request's temperature never changes its logprobs.

Sampling draws one uniform number per sampled row from that row's own ``torch.Generator`` and
inverts the row's CDF, so a seeded request gives the same tokens whatever else is in the batch.
The text side (incremental detokenization, stop strings, finish reasons) is in ``stopping``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from confkv_engine.cache.staging import send_pinned
from confkv_engine.core.outputs import TokenLogprob
from confkv_engine.core.penalties import apply_logit_bias, apply_penalties
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.core.stopping import (
    IncrementalDetokenizer,
    OutputTracker,
    StopChecker,
    find_stop,
    partial_stop_len,
)
from confkv_engine.core.structured_output import GrammarState, apply_grammar_masks

__all__ = [
    "GrammarState",
    "IncrementalDetokenizer",
    "OutputTracker",
    "StopChecker",
    "apply_min_tokens_mask",
    "distribution_stats",
    "find_stop",
    "greedy_tokens",
    "logprobs_for",
    "make_generator",
    "partial_stop_len",
    "plain_greedy",
    "processed_logits",
    "prompt_logprobs",
    "sample",
    "token_logprobs",
]

# top-k over at most this many candidates uses torch.topk instead of a full sort of the vocabulary.
_TOPK_FAST_LIMIT = 1024


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """Per-request generator for a seeded request (None: use the global RNG)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> Tensor:
    """logits [B, V] fp32 -> chosen token ids [B] (int64, on logits.device).

    Greedy rows (temperature 0) take the argmax; the others are tempered, filtered by min_p, top-k
    then top-p (renormalised after each filter, as in vLLM; at least one token survives), and drawn
    with the row's generator. ``logits`` (already biased / penalised / masked) is not modified.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"sample: logits {tuple(logits.shape)} vs {len(params)} params, "
                         f"{len(generators)} generators")
    out = greedy_tokens(logits)  # [B]; also the answer for greedy rows
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    idx = send_pinned(rows, logits.device)
    chosen = _sample_rows(logits.index_select(0, idx), [params[i] for i in rows],
                          [generators[i] for i in rows])
    out[idx] = chosen
    return out


def greedy_tokens(logits: Tensor) -> Tensor:
    """logits [B, V] in any float dtype -> the index of each row's maximum [B] (int64), the first
    one on ties, as ``argmax`` (same semantics, NaN included). ``max(dim)`` is used because it
    measured 3-4x faster than ``argmax`` on 32 x 262,144 logits on a 2-core Xeon (2.2 vs 9.5 ms
    in fp32)."""
    return logits.max(dim=-1).indices


def plain_greedy(params: Sequence[SamplingParams], num_generated: Sequence[int]) -> bool:
    """Whether every row's token is the raw logits' argmax and no row returns logprobs: no
    temperature, bias, penalty, grammar or active ``min_tokens`` ban. Such a step needs neither
    fp32 logits nor ``processed_logits``' copy of them."""
    return all(p.greedy and p.logprobs is None and not p.logit_bias and not p.has_penalties
               and p.structured is None and n >= p.min_tokens
               for p, n in zip(params, num_generated, strict=True))


def _sample_rows(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> Tensor:
    """Non-greedy rows. logits [N, V] -> token ids [N].

    Rows without top-k/top-p invert the CDF in vocabulary order (no sort); filtered rows invert it
    in descending-logit order. The order a row uses depends only on its own params, never on its
    neighbours', so a seeded row draws the same token in any batch.
    """
    vocab = logits.shape[-1]
    filtered = [0 < p.top_k < vocab or p.top_p < 1.0 for p in params]
    out = torch.empty(len(params), dtype=torch.long, device=logits.device)
    for want in (False, True):
        rows = [i for i, f in enumerate(filtered) if f == want]
        if not rows:
            continue
        idx = send_pinned(rows, logits.device)
        group = logits.index_select(0, idx)
        sub_params = [params[i] for i in rows]
        sub_gens = [generators[i] for i in rows]
        sampler = _sample_filtered if want else _sample_unfiltered
        out[idx] = sampler(group, sub_params, sub_gens)
    return out


def _tempered(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Tempered logits [N, V], with ``min_p`` applied: a token survives when its tempered
    probability is at least min_p times the best one's, i.e. its tempered logit is within
    log(min_p) of the maximum (a threshold that needs no normalisation and no sort)."""
    temps = send_pinned([p.temperature for p in params], logits.device, logits.dtype)
    scaled = logits / temps[:, None]  # [N, V]
    if any(p.min_p > 0 for p in params):
        log_min_p = send_pinned([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params],
                                logits.device, logits.dtype)
        floor = scaled.max(dim=-1, keepdim=True).values + log_min_p[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    return scaled


def _sample_unfiltered(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> Tensor:
    probs = torch.softmax(_tempered(logits, params), dim=-1)  # [N, V]
    return _inverse_cdf(probs, _uniforms(generators, logits.device, probs.dtype))


def _sample_filtered(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> Tensor:
    vocab = logits.shape[-1]
    dev = logits.device
    scaled = _tempered(logits, params)
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_k = send_pinned(ks, dev)
    top_p = send_pinned([p.top_p for p in params], dev, logits.dtype)
    k_max = max(ks)
    if k_max <= _TOPK_FAST_LIMIT:
        cand, cand_ids = torch.topk(scaled, k_max, dim=-1)  # [N, K] best first
    else:
        cand, cand_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [N, V]
    probs = torch.softmax(_filter_sorted(cand, top_k, top_p), dim=-1)
    pos = _inverse_cdf(probs, _uniforms(generators, dev, probs.dtype))  # [N]
    return cand_ids.gather(1, pos[:, None]).squeeze(1)


def _filter_sorted(sorted_logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """sorted_logits [N, K] descending; top_k [N]; top_p [N] -> logits with dropped ones at -inf."""
    ranks = torch.arange(sorted_logits.shape[1], device=sorted_logits.device)[None, :]  # [1, K]
    masked = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    # Mass strictly before each token: a token is kept while that mass is below top_p, so the
    # best token (mass 0) always survives and the kept set is the smallest reaching top_p.
    before = torch.cumsum(probs, dim=-1) - probs
    return masked.masked_fill(before >= top_p[:, None], float("-inf"))


def _uniforms(
    generators: Sequence[torch.Generator | None], device: torch.device, dtype: torch.dtype
) -> Tensor:
    """One U[0,1) draw per row from the row's own generator (its state advances by exactly one)."""
    draws = []
    for gen in generators:
        gen_device = gen.device if gen is not None else device
        draws.append(torch.rand(1, generator=gen, device=gen_device, dtype=torch.float64).to(device))
    return torch.cat(draws).to(dtype)  # [N]


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """probs [N, K] (rows sum to ~1), u [N] in [0,1) -> index [N] with P(index=j) = probs[j].

    Zero-probability entries are never chosen: the first index whose CDF exceeds u * total is
    always one where the CDF increased.
    """
    cdf = torch.cumsum(probs, dim=-1)  # [N, K]
    target = (u * cdf[:, -1])[:, None]  # scale by the real total so rounding never overshoots
    pos = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Guard the u*total == total corner (u < 1, but rounding): fall back to the last positive entry.
    last_pos = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(pos, last_pos)


def apply_min_tokens_mask(
    logits: Tensor,
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    eos_token_ids: Sequence[int],
) -> Tensor:
    """Forbid ending a sequence before it has ``min_tokens`` output tokens. In place; returns logits.

    logits [B, V]; num_generated [B] = output tokens so far (before this step's token). Masks the
    row's ``stop_token_ids`` and, unless ``ignore_eos`` (where EOS does not end anything), the EOS ids.
    Apply it to the logits used for sampling only; logprobs come from the unmasked logits.
    """
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[-1]
    for i, (p, n) in enumerate(zip(params, num_generated, strict=True)):
        if n >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        for tok in banned:
            if 0 <= tok < vocab:
                rows.append(i)
                cols.append(tok)
    if rows:
        dev = logits.device
        logits[send_pinned(rows, dev), send_pinned(cols, dev)] = float("-inf")
    return logits


def processed_logits(
    logits: Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
    grammars: Sequence[GrammarState | None] = (),
) -> Tensor:
    """The logits a step's tokens are chosen from: a copy of the raw ``logits`` [B, V] with, in
    vLLM's order, the min_tokens ban, ``logit_bias``, the repetition / frequency / presence
    penalties and the structured-output masks applied. Logprobs are taken from the raw logits.

    Where the grammar allows only tokens min_tokens forbids (a complete document: only EOS), the
    grammar wins: that row keeps its grammar mask alone, so the request ends with a valid document.
    """
    out = logits.clone()
    apply_min_tokens_mask(out, params, [len(ids) for ids in output_ids], eos_token_ids)
    apply_logit_bias(out, params)
    apply_penalties(out, params, prompt_ids, output_ids)
    if any(g is not None for g in grammars):
        apply_grammar_masks(out, grammars)
        dead = [i for i in torch.nonzero(~torch.isfinite(out).any(dim=-1)).flatten().tolist()
                if grammars[i] is not None]
        for i in dead:
            out[i] = apply_grammar_masks(logits[i:i + 1].clone(), [grammars[i]])[0]
    return out


def logprobs_for(logits: Tensor, targets: Tensor, top_n: Sequence[int | None]) -> list[TokenLogprob | None]:
    """logits [N, V] fp32 raw; targets [N]; top_n [N] (None: skip the row) -> one entry per row.

    Logprobs are the untempered log-softmax; ``top`` holds the row's top_n best tokens, best first.
    """
    if logits.shape[0] != len(top_n) or targets.shape[0] != len(top_n):
        raise ValueError(
            f"logprobs_for: {logits.shape[0]} rows, {targets.shape[0]} targets, {len(top_n)} top_n")
    rows = [i for i, n in enumerate(top_n) if n is not None]
    result: list[TokenLogprob | None] = [None] * len(top_n)
    if not rows:
        return result
    idx = send_pinned(rows, logits.device)
    logp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)  # [R, V]
    chosen = logp.gather(1, targets.index_select(0, idx).long()[:, None]).squeeze(1).tolist()  # [R]
    k = max(top_n[i] or 0 for i in rows)
    top_vals, top_ids = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    tgt = targets.index_select(0, idx).tolist()
    for r, i in enumerate(rows):
        n = top_n[i] or 0
        top = tuple(zip(top_ids[r][:n], top_vals[r][:n], strict=True))
        result[i] = TokenLogprob(token_id=int(tgt[r]), logprob=chosen[r], top=top)
    return result


def token_logprobs(logits: Tensor, chosen: Tensor, top_n: Sequence[int | None]) -> list[TokenLogprob | None]:
    """Per generated token: logits [B, V] raw fp32, chosen [B] -> TokenLogprob (None where top_n is None)."""
    return logprobs_for(logits, chosen, top_n)


def prompt_logprobs(
    logits: Tensor, prompt_ids: Sequence[int] | Tensor, top_n: int, *, first_position: int = 0
) -> list[TokenLogprob | None]:
    """Echo logprobs: logits [T, V], row i = the distribution after prompt position
    ``first_position + i``, scores prompt token ``first_position + i + 1``.

    Position 0 has no prefix and gets None (as OpenAI's echo), prepended when first_position is 0.
    Rows whose next token lies past the prompt are ignored. For chunked prefill, call it per chunk
    with first_position = the chunk start and concatenate: one entry per prompt token in total.
    """
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    start = first_position
    usable = max(0, min(logits.shape[0], ids.shape[0] - 1 - start))  # rows that predict a prompt token
    targets = ids[start + 1: start + 1 + usable].to(logits.device)
    entries = logprobs_for(logits[:usable], targets, [top_n] * usable)
    head: list[TokenLogprob | None] = [None] if start == 0 else []
    return head + entries


def distribution_stats(logits: Tensor, chosen: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Confidence signals of the sampling distribution (untempered), each [B] fp32:
    probability of the chosen token, entropy in nats, and the top-1 minus top-2 probability margin."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    probs = logp.exp()
    p_chosen = probs.gather(1, chosen.long()[:, None]).squeeze(1)
    entropy = -(probs * logp.clamp_min(-1e30)).sum(-1)  # 0 * -inf would be nan
    top2 = torch.topk(probs, min(2, probs.shape[-1]), dim=-1).values
    margin = top2[:, 0] - (top2[:, 1] if top2.shape[1] > 1 else 0.0)
    return p_chosen, entropy, margin
