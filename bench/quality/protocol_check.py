"""Protocol check for the retention benchmark: StreamingLLM as a plain dense attention mask.

No paging, no chunks, no engine: a causal mask that keeps the 4 sinks and a recent window, over
the three 2,048-token test windows of ``kv_quality.py``. Two protocols:

- ``current``: window = f x the current length, NLL over the second halves (the definition the targets use,
  what ``kv_quality.py`` measures through the engine);
- ``fixed``: window = f x 2,048 tokens kept, NLL over the whole window.

Usage: ``python -m bench.quality.protocol_check`` (fp32, 1 thread, ~5 minutes on one core).
"""

from __future__ import annotations

import math
import sys

import torch

from testkit.kv_runs import pydoc_tokens, windows

SIZE = 2048


class MaskedAttention:
    """Dense attention over the whole window with ``keep(i, j)`` deciding what query i sees."""

    def __init__(self, keep) -> None:
        self.keep = keep

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, hq, d = q.shape
        g = hq // k.shape[1]
        kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
        scores = torch.einsum("thd,shd->hts", q.float(), kf) / math.sqrt(d)  # [Hq, T, T]
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        scores = scores.masked_fill(~((j <= i) & self.keep(i, j))[None], float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), vf)


def logprobs(model, wins: list[list[int]], keep) -> torch.Tensor:
    """[windows, SIZE - 1] log-probability of each next token."""
    out = []
    for w in wins:
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(w), torch.arange(len(w)), MaskedAttention(keep)))
        lp = torch.log_softmax(logits[:-1].float(), -1)
        out.append(lp.gather(-1, torch.tensor(w[1:])[:, None]).squeeze(-1).double())
    return torch.stack(out)


def increase(lp: torch.Tensor, full: torch.Tensor, half: bool) -> float:
    cut = SIZE // 2 - 1 if half else 0
    return 100 * (math.exp(-(lp[:, cut:].mean() - full[:, cut:].mean())) - 1)


def main() -> int:
    from confkv_engine.model.loader import load_model

    torch.set_num_threads(1)
    loaded = load_model("builtin:smollm2-135m", torch.float32, "cpu")
    wins = windows(pydoc_tokens(loaded.tokenizer), False, False)
    full = logprobs(loaded.model, wins, lambda i, j: torch.ones_like(i + j, dtype=torch.bool))
    for f in (0.5, 0.25):
        cur = logprobs(loaded.model, wins, lambda i, j, f=f: (j < 4) | (j > i - (f * (i + 1)).floor()))
        fixed = logprobs(loaded.model, wins, lambda i, j, f=f: (j < 4) | (j > i - int(f * SIZE)))
        print(f"f={f}: current-length window, second halves {increase(cur, full, True):+.2f}%; "
              f"fixed f x {SIZE} window, whole window {increase(fixed, full, False):+.2f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
