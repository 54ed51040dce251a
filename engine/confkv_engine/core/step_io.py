"""What one engine step reads out of the model's hidden states and hands back: sampled tokens,
prompt logprobs, and the request outputs; plus the checks a request passes before it is queued.

Pure functions over a step's sequences, so ``engine.LLMEngine`` stays the loop that calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from confkv_engine.cache.kv_cache import KVCache
from confkv_engine.cache.usage import KVUsage
from confkv_engine.core import sampling
from confkv_engine.core.outputs import RequestOutput
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams
from confkv_engine.core.sequence import Sequence
from confkv_engine.retention.manager import RetentionManager
from confkv_engine.retention.policies import RetentionConfig


def sample_step(model: Any, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                scheduled: list[tuple[Sequence, int]], hidden: torch.Tensor,
                send: Callable[[list[int]], torch.Tensor] | None = None,
                shared: Callable[[list[int]], torch.Tensor | None] | None = None) -> dict[Sequence, Any]:
    """Per sequence whose step ends its known tokens: (token id, logprob entry). Prompt logprobs of
    the rows that need them are appended to their sequences on the way. ``send``: how the sampling
    rows reach the device (the cache's pinned staging; default ``torch.tensor``). ``shared``: the
    fp32 logits of exactly these rows where the step has them already (the sampling signal's,
    ``StepSignal.sampled_logits``), else None."""
    rows: list[int] = []
    samplers: list[Sequence] = []
    offset = 0
    for seq, n in scheduled:
        end = seq.num_computed + n
        if seq.wants_prompt_logprobs and len(seq.prompt_logprobs) < min(end + 1, seq.prompt_len):
            add_prompt_logprobs(model, seq, hidden[offset:offset + n])
        if end == seq.num_tokens and len(seq.output_token_ids) < seq.params.max_tokens:
            rows.append(offset + n - 1)
            samplers.append(seq)
        offset += n
    if not samplers:
        return {}
    logits = shared(rows) if shared is not None else None
    params = [s.params for s in samplers]
    if sampling.plain_greedy(params, [len(s.output_token_ids) for s in samplers]):
        tokens = (_greedy(model, _rows_hidden(hidden, rows, send)) if logits is None
                  else sampling.greedy_tokens(logits)).tolist()
        return {s: (t, None) for s, t in zip(samplers, tokens, strict=True)}
    if logits is None:
        logits = model.compute_logits(_rows_hidden(hidden, rows, send))
    for s in samplers:  # the grammar is compiled on the sequence's first sampling step
        if s.params.structured is not None and s.grammar is None:
            s.grammar = sampling.GrammarState(s.params.structured, tokenizer, vocab_size, eos_token_ids)
    masked = sampling.processed_logits(
        logits, params, [s.prompt_token_ids for s in samplers], [s.output_token_ids for s in samplers],
        eos_token_ids, [s.grammar for s in samplers])
    chosen = sampling.sample(masked, params, [s.generator for s in samplers])
    lps = sampling.token_logprobs(logits, chosen, [p.logprobs for p in params])  # raw: unprocessed
    tokens = chosen.tolist()
    for s, t in zip(samplers, tokens, strict=True):
        if s.grammar is not None:
            s.grammar.accept(t)
    return {s: (t, lp) for s, t, lp in zip(samplers, tokens, lps, strict=True)}


def _rows_hidden(hidden: torch.Tensor, rows: list[int],
                 send: Callable[[list[int]], torch.Tensor] | None) -> torch.Tensor:
    index = send(rows) if send is not None else torch.tensor(rows, device=hidden.device)
    return hidden[index]


def _greedy(model: Any, rows_hidden: torch.Tensor) -> torch.Tensor:
    """The raw logits' argmax in the head's dtype: no fp32 copy, no processed copy; no logits at
    all where the head's kernel fuses the argmax (``greedy_tokens`` None: it does not)."""
    fused = model.greedy_tokens(rows_hidden) if hasattr(model, "greedy_tokens") else None
    if fused is not None:
        return fused
    return sampling.greedy_tokens(model.compute_logits(rows_hidden, fp32=False))


def add_prompt_logprobs(model: Any, seq: Sequence, hidden: torch.Tensor) -> None:
    """Entries for the prompt tokens this chunk's rows predict (row r scores token start+r+1)."""
    start, n, plen = seq.num_computed, hidden.shape[0], seq.prompt_len
    logits = model.compute_logits(hidden[: max(0, min(n, plen - 1 - start))])
    entries = sampling.prompt_logprobs(logits, seq.prompt_token_ids, seq.params.prompt_logprobs or 0,
                                       first_position=start)
    first = 0 if start == 0 else start + 1  # prompt index of entries[0]
    have, upto = len(seq.prompt_logprobs), min(start + n + 1, plen)
    seq.prompt_logprobs.extend(entries[have - first:upto - first])


def request_output(seq: Sequence, kv_usage: KVUsage) -> RequestOutput:
    """The sequence's output since the last one it reported (which it then counts as reported)."""
    new_ids = seq.output_token_ids[seq.reported_tokens:]
    seq.reported_tokens = len(seq.output_token_ids)
    new_text, seq.pending_text = seq.pending_text, ""
    prompt_done = seq.num_computed >= seq.prompt_len or seq.finished
    return RequestOutput(
        request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
        output_token_ids=list(seq.output_token_ids), new_token_ids=new_ids,
        text=seq.tracker.text[:seq.tracker.emitted], new_text=new_text,
        logprobs=list(seq.logprobs),
        prompt_logprobs=list(seq.prompt_logprobs) if seq.wants_prompt_logprobs and prompt_done else None,
        finished=seq.finished, finish_reason=seq.finish_reason, error=seq.error,
        arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
        finish_time=seq.finish_time, num_preemptions=seq.num_preemptions,
        num_cached_tokens=seq.prefix_len, kv_usage=kv_usage)


def check_request(prompt: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  retention: RetentionManager, cache: KVCache) -> RetentionConfig:
    """Check a request (InvalidRequest names the parameter); returns the retention config it keeps
    for its whole life."""
    if not prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if any(not 0 <= t < vocab_size for t in prompt):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    if len(prompt) > max_model_len:
        raise InvalidRequest(
            f"the prompt has {len(prompt)} tokens; this model's maximum context length is "
            f"{max_model_len}", param="prompt", code="context_length_exceeded")
    try:
        cfg = retention.config_for(params.kv_policy, params.kv_budget, params.kv_tiers)
    except ValueError as err:
        param = "kv_tiers" if params.kv_tiers is not None and "tier" in str(err) else "kv_policy"
        raise InvalidRequest(str(err), param=param) from None
    total = len(prompt) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens; the prompt "
            f"({len(prompt)}) plus max_tokens ({params.max_tokens}) needs {total}",
            param="max_tokens", code="context_length_exceeded")
    # A binding retention budget is what the request can ever hold, not its full length.
    needed = retention.reserve_blocks(cfg, total) or cache.blocks_for_tokens(total)
    if needed > cache.num_blocks:
        raise InvalidRequest(
            f"the KV cache holds {cache.num_blocks // 2 * cache.spec.block_size} tokens; "
            f"prompt plus max_tokens ({total}) needs {needed} blocks under its kv policy and "
            f"can never fit (raise maxCacheSize or lower kv_budget)",
            param="max_tokens", code="kv_cache_too_small")
    return cfg
