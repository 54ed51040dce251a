"""Held-out text for the KV-retention quality check over HTTP: never used to tune retention.

Retention was tuned on ``pydoc_data.topics`` (``testkit.kv_runs.pydoc_tokens``). The held-out
check uses a different kind of text, read from the machine instead of downloaded or vendored:

- *plain prose*: the GNU General Public License, version 3, as Debian ships it in
  the ``common-licenses`` directory of package ``base-files`` (``PROSE_PATH``; on every Debian and Ubuntu
  system; "Everyone is permitted to copy and distribute verbatim copies of this license document").
  It is English prose the 135M model does not recite (full-cache perplexity about 23 on a 1,024-token
  window). It is read, not copied into the repository, so that no licence text sits in the tree.
- *repeating passages from far back* (a retrieval-like probe): built deterministically from a
  later, disjoint stretch of the same prose. Each window opens with ``head`` tokens of prose; the
  rest alternates ``span`` fresh tokens with a ``span``-token passage copied verbatim from the head,
  the passages taken from the second nearest back to the first, so the copies reach back 190 to
  960 tokens in a 1,024-token window, past any recent window a small budget can hold. A model
  that kept the passage's keys predicts the copy almost exactly; one that evicted them must guess.

Everything is token ids (SmolLM2's tokenizer, no BOS), sent as token-id prompts, so windows have
exact lengths and a splice never re-tokenizes differently.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

PROSE_PATH = Path("/usr/share/common-licenses/GPL-3")
PROSE_START = 1024  # skip the preamble's first window (title, copyright lines, table-like openings)


class HeldOutTextMissing(RuntimeError):
    """The system file the held-out prose is read from is not on this machine."""


def prose_text(path: Path = PROSE_PATH) -> str:
    if not path.is_file():
        raise HeldOutTextMissing(f"{path} not found: the held-out prose is Debian's base-files copy of the "
                                 "GPL version 3 (install base-files, or pass another plain-text file)")
    return path.read_text(encoding="utf-8")


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prose_windows(tokens: list[int], count: int, size: int, start: int = PROSE_START) -> list[list[int]]:
    """``count`` consecutive ``size``-token windows from ``start``; refuses when the text is too short."""
    end = start + count * size
    if end > len(tokens):
        raise ValueError(f"{count} windows of {size} from token {start} need {end} tokens, the text has "
                         f"{len(tokens)}")
    return [tokens[start + i * size: start + (i + 1) * size] for i in range(count)]


def passage_order(n: int) -> list[int]:
    """The head's passages from the second nearest back to the first, then the nearest: each copy
    reaches further back than the one before (the nearest last, since it is the shortest reach)."""
    return list(range(n - 2, -1, -1)) + [n - 1]


def repeating_window(fresh: list[int], size: int, head: int, span: int) -> list[int]:
    """One ``size``-token window: ``fresh[:head]``, then ``span`` fresh tokens and one ``span``-token
    passage of the head, alternately, in ``passage_order``. Consumes ``unique_tokens(...)`` of ``fresh``."""
    if head % span or size <= head or head < 2 * span:
        raise ValueError(f"head {head} must be a multiple of span {span} (two passages at least) "
                         f"and below size {size}")
    need = unique_tokens(size, head, span)
    if len(fresh) < need:
        raise ValueError(f"a repeating window of {size} needs {need} fresh tokens, got {len(fresh)}")
    out, used = list(fresh[:head]), head
    order = passage_order(head // span)
    k = 0
    while len(out) < size:
        out += fresh[used: used + span]
        used += span
        p = order[k % len(order)]
        out += fresh[p * span: (p + 1) * span]
        k += 1
    return out[:size]


def unique_tokens(size: int, head: int, span: int) -> int:
    """Fresh tokens one repeating window consumes: the head plus the fresh half of the rest."""
    rest = size - head
    pairs, extra = divmod(rest, 2 * span)
    return head + pairs * span + min(extra, span)


def repeating_windows(tokens: list[int], count: int, size: int, start: int, head: int,
                      span: int) -> list[list[int]]:
    """``count`` repeating windows from consecutive, disjoint stretches of ``tokens`` after ``start``."""
    need = unique_tokens(size, head, span)
    if start + count * need > len(tokens):
        raise ValueError(f"{count} repeating windows need {start + count * need} tokens, the text has "
                         f"{len(tokens)}")
    return [repeating_window(tokens[start + i * need: start + (i + 1) * need], size, head, span)
            for i in range(count)]


def echo_perplexity(url: str, model: str, windows: list[list[int]]) -> dict[str, Any]:
    """Each window as a token-id prompt through the ``openai`` client (``max_tokens=0, echo=True,
    logprobs=0``); perplexity over every scored token pooled, over the second halves, per window."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600.0, max_retries=0)
    every: list[float] = []
    second: list[float] = []
    per_window, usage = [], []
    for w in windows:
        resp = client.completions.create(model=model, prompt=w, max_tokens=0, echo=True, logprobs=0,
                                         temperature=0.0)
        lps = resp.choices[0].logprobs.token_logprobs[1:]
        if len(lps) != len(w) - 1 or any(v is None for v in lps):
            raise RuntimeError(f"expected {len(w) - 1} prompt log-probabilities, got {len(lps)}")
        every += lps
        second += lps[len(w) // 2 - 1:]
        per_window.append(math.exp(-sum(lps) / len(lps)))
        usage.append(resp.usage.model_dump())
    return {"ppl": math.exp(-sum(every) / len(every)),
            "ppl_second_half": math.exp(-sum(second) / len(second)),
            "ppl_per_window": per_window, "tokens_scored": len(every),
            "peak_kv_bytes": max(u.get("peak_kv_bytes") or 0 for u in usage),
            "effective_kv_budget": [u.get("effective_kv_budget") for u in usage]}
