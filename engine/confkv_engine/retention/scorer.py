"""Retention confidence: pure functions turning model signals into a score in [0, 1].

Two signals feed the confidence of a cached token ``j``:

Sampling signal (per token, shared by all layers and heads). From the model's *untempered*
log-softmax at the position that predicted ``j`` (request temperature/top-p never enter), we keep
the probability of the realised token ``p_j``, the normalised entropy ``H_j / log V`` and the
top-1/top-2 margin. Prompt tokens get it from the prefill logits, generated tokens from the decode
logits; token 0 has no predictor and gets the neutral value 0.5. The sampling confidence is the
*surprise* ``1 - p_j``: a token the model could not predict carries information the context cannot
regenerate, so it is worth keeping (``kind='entropy'``/``'margin'`` select the alternatives).

Attention signal (per layer and KV head). With ``a_ij`` the attention probability query ``i``
gives key ``j`` summed over the query heads sharing the KV head (GQA group, so ``a_ij`` is in
[0, G]) and ``t`` the newest query position::

    A_j(t) = sum_{i=j..t} lam^(t-i) a_ij          N_j(t) = sum_{i=j..t} lam^(t-i)
    att_j  = A_j / N_j                               (decayed mean over the queries that could see j)

Decay is applied per query *position*, so processing queries one by one or in chunks of any size
gives the same ``att_j`` (the update below is exact, see ``update_attention``). The attention
confidence compares it with uniform attention over the current context of ``L`` tokens::

    r_j = att_j * L / G        c_att = 1 - exp(-r_j / scale)

so a token receiving exactly uniform attention has ``c_att = 1 - e^-1/scale`` (0.63 at scale 1).

Combined confidence: ``c = (1 - w) * c_att + w * c_samp`` with ``w = sampling_weight``;
``mode='attention'`` is ``w = 0``, ``mode='sampling'`` is ``w = 1``. The precision chain takes its own
``w``, ``precision_sampling_weight`` (``RetentionConfig.sampling_weight``). Every quantity is in [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

ScoreMode = Literal["attention", "sampling", "combined"]
SamplingKind = Literal["surprise", "entropy", "margin"]
NEUTRAL_SAMPLING = 0.5


@dataclass(frozen=True)
class ScorerConfig:
    """Scoring knobs. Defaults were tuned on tokens [6144, 12288) (docs/notes/retention-journal.md):
    the sampling signal earned no weight there for the FULL / KEY_ONLY chain, so the default mode is
    attention-only; the precision chain weighs it by its own ``precision_sampling_weight``."""

    mode: ScoreMode = "attention"
    sampling_weight: float = 0.2  # used by mode='combined' only
    sampling_kind: SamplingKind = "surprise"
    decay: float = 0.999
    scale: float = 0.3
    # The precision chain's own scale (conf-kv with int8 / int4 / k4v2 / int2 tiers). Its budget walk
    # prices every step by the confidence, and at 0.3 every token attended above about uniform reads
    # c > 0.95: the walk could not rank the attended tokens among themselves. At 4, c is about linear
    # in the attention up to a few times uniform. Four tuning windows per text, both budgets: 3 and 4
    # beat 0.3 in all four cells (4 by the most), 5 in three (the fourth lost by 0.06 point), 1, 2 and
    # 10 lost a cell each by more (docs/notes/retention-journal.md, "A scale for the budget walk"). The FULL /
    # KEY_ONLY chain's thresholds keep ``scale`` (at 5 it lost prose at 0.25 by 10 points). Under the
    # final budget basis 2, with ``precision_decay`` 1, won all four cells (journal, "The budget basis").
    precision_scale: float = 2.0
    # The precision chain's own ``decay`` (the other chains keep 0.999): 1, a plain mean over every
    # query since the token, with scale 2 won all four tuning cells under the final budget basis.
    precision_decay: float = 1.0
    # The precision chain's weight of the sampling signal (``combine``), whatever ``mode`` says (the
    # mode and ``sampling_weight`` are the other chains'). A token the model predicted well is one
    # the context around it can stand in for; one it could not is information a later retrieval finds
    # nowhere else, however little it has been attended so far. Four tuning windows per text, final
    # basis: 0.5 took the repeating text at 0.125 from +56.04% to +48.81% (0.4 +52.03%, 0.6 +50.15%,
    # 0.8 +32.64% but prose at 0.125 +7.84%), at 0.25 +2.40% (+2.54%), prose +0.66% / +3.99%
    # (+0.63% / +3.21%) (docs/notes/retention-journal.md, "The sampling signal, for the precision chain").
    precision_sampling_weight: float = 0.5
    # Max-pool the attention signal over this many neighbouring slots (1: off). Keeps the
    # neighbours of a heavily attended token, so spans survive rather than isolated tokens.
    pool: int = 1
    # Remembered attention (0: off). At each decision a key's mean attention from the queries at
    # least ``memory_distance`` positions after it, relative to uniform over the keys each query saw,
    # raises its peak (``update_peak``), which never decays; the confidence reads
    # ``max(att * L / G, memory * peak)``. ``att`` is a decayed mean that falls with a token's age
    # once nothing attends it, so without the peak an old token ranks below a newer one with the
    # same history of attention; with it, a token once attended keeps a floor.
    memory: float = 0.0
    memory_distance: int = 16
    # The peak fades by this factor per query position (1: never), so a passage retrieved once and
    # not again gives its bytes back in time.
    memory_decay: float = 1.0
    # Queries further than this after a token do not raise its peak either (None: no limit): the
    # peak then holds how strongly the token's own neighbourhood attended it, not a retrieval.
    memory_reach: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("attention", "sampling", "combined"):
            raise ValueError(f"unknown score mode {self.mode!r}")
        if self.sampling_kind not in ("surprise", "entropy", "margin"):
            raise ValueError(f"unknown sampling kind {self.sampling_kind!r}")
        if not (0.0 <= self.sampling_weight <= 1.0 and 0.0 <= self.precision_sampling_weight <= 1.0):
            raise ValueError(f"sampling_weight and precision_sampling_weight must be in [0, 1], got "
                             f"{self.sampling_weight}, {self.precision_sampling_weight}")
        if not (0.0 < self.decay <= 1.0 and 0.0 < self.precision_decay <= 1.0):
            raise ValueError(f"decay and precision_decay must be in (0, 1], got {self.decay}, "
                             f"{self.precision_decay}")
        if self.scale <= 0 or self.precision_scale <= 0:
            raise ValueError(f"scale and precision_scale must be > 0, got {self.scale}, "
                             f"{self.precision_scale}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"pool must be an odd number >= 1, got {self.pool}")
        if not 0.0 < self.memory_decay <= 1.0:
            raise ValueError(f"memory_decay must be in (0, 1], got {self.memory_decay}")
        if self.memory_reach is not None and self.memory_reach <= self.memory_distance:
            raise ValueError(f"memory_reach must exceed memory_distance, got {self.memory_reach}")
        if self.memory < 0 or self.memory_distance < 0:
            raise ValueError(f"memory and memory_distance must be >= 0, got {self.memory}, "
                             f"{self.memory_distance}")

    @property
    def effective_weight(self) -> float:
        return {"attention": 0.0, "sampling": 1.0}.get(self.mode, self.sampling_weight)


@dataclass(frozen=True)
class SamplingSignal:
    """Per predicted token: probability of the realised token, normalised entropy, top-2 margin (the
    last two None where ``sampling_signal`` was asked for the probability alone)."""

    prob: Tensor
    entropy: Tensor | None = None
    margin: Tensor | None = None

    def rows(self, start: int, end: int) -> SamplingSignal:
        """Rows [start, end) of every field."""
        fields = (self.prob, self.entropy, self.margin)
        return SamplingSignal(*(None if t is None else t[start:end] for t in fields))

    @staticmethod
    def cat(parts: list[SamplingSignal]) -> SamplingSignal:
        def field(ts: list[Tensor | None]) -> Tensor | None:
            return None if any(t is None for t in ts) else torch.cat(ts)  # type: ignore[arg-type]

        return SamplingSignal(field([p.prob for p in parts]), field([p.entropy for p in parts]),
                              field([p.margin for p in parts]))


def sampling_signal(logits: Tensor, next_tokens: Tensor, spread: bool = True) -> SamplingSignal:
    """logits [N, V] (untempered) at positions whose realised successors are ``next_tokens`` [N].
    ``spread=False``: the probability alone (one log-sum-exp over the vocabulary, not the five
    passes the entropy and the margin take), all the default surprise reads."""
    logits = logits.float()
    if not spread:
        picked = logits.gather(-1, next_tokens.long()[:, None]).squeeze(-1)
        return SamplingSignal(prob=(picked - torch.logsumexp(logits, dim=-1)).exp())
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    prob = p.gather(-1, next_tokens.long()[:, None]).squeeze(-1)
    entropy = -(p * logp.clamp_min(-1e30)).sum(-1) / math.log(logits.shape[-1])  # 0 * -inf is nan
    top2 = p.topk(2, dim=-1).values
    return SamplingSignal(prob=prob, entropy=entropy.clamp(0.0, 1.0), margin=top2[:, 0] - top2[:, 1])


def spread_of(signal: SamplingSignal) -> tuple[Tensor, Tensor]:
    """The entropy and the margin, which a signal taken with ``spread=False`` lacks."""
    if signal.entropy is None or signal.margin is None:
        raise ValueError("this sampling signal was taken without its entropy and margin (spread=False)")
    return signal.entropy, signal.margin


def sampling_confidence(signal: SamplingSignal, kind: SamplingKind = "surprise") -> Tensor:
    """Map the sampling signal to [0, 1]; higher means 'keep'. See the module docstring."""
    if kind == "surprise":
        return 1.0 - signal.prob
    entropy, margin = spread_of(signal)
    return entropy if kind == "entropy" else 1.0 - margin


@dataclass(frozen=True)
class PeakFilter:
    """Which queries count toward a key's peak: those ``min_distance`` or more positions after it and
    at most ``reach`` (None: any) after it."""

    min_distance: int
    reach: int | None = None


@dataclass(frozen=True)
class AttentionMass:
    """One chunk of queries reduced per key ([*U, S] fp32 each): ``mass`` = sum_i w_i a_ij, ``seen`` =
    sum_i w_i [i sees j]; with a peak filter, ``peak_sum`` = sum over the far queries i of
    a_ij * n_i (``n_i``: the keys i saw) and ``peak_count`` their number (None without one). What
    ``fold_mass`` / ``raise_peak`` add to the accumulators; ``attention_mass`` computes it from the
    probabilities, ``retention.native_mass`` from the scores in one pass."""

    mass: Tensor
    seen: Tensor
    peak_sum: Tensor | None = None
    peak_count: Tensor | None = None


def query_weights(query_pos: Tensor, decay: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """lam^(t_new - i) of each query of a chunk (query_pos [T] ascending) -> [T] in ``dtype``."""
    return decay ** (int(query_pos[-1]) - query_pos.to(torch.float64)).to(dtype)


def attention_mass(probs: Tensor, key_pos: Tensor, query_pos: Tensor, weights: Tensor,
                   peak: PeakFilter | None = None) -> AttentionMass:
    """``AttentionMass`` of probs [*U, T, S] (attention of the T chunk queries to each key, summed over
    the query heads of the unit), key_pos [*U, S], query_pos [T], weights [T] (``query_weights``; the
    sums are in its dtype)."""
    probs = probs.to(weights.dtype)
    visible = key_pos[..., None, :] <= query_pos[:, None]  # [*U, T, S]
    mass = torch.einsum("t,...ts->...s", weights, probs)
    seen = torch.einsum("t,...ts->...s", weights, visible.to(weights.dtype))
    if peak is None:
        return AttentionMass(mass, seen)
    n_seen = visible.sum(-1, keepdim=True).to(weights.dtype)  # [*U, T, 1]
    far = key_pos[..., None, :] <= (query_pos - peak.min_distance)[:, None]
    if peak.reach is not None:
        far &= key_pos[..., None, :] >= (query_pos - peak.reach)[:, None]
    far = far.to(weights.dtype)
    return AttentionMass(mass, seen, (probs * n_seen * far).sum(-2), far.sum(-2))


def fold_mass(acc: Tensor, norm: Tensor, m: AttentionMass, t_new: int, last_query: int, decay: float) -> int:
    """Fold a chunk's mass into the decayed accumulators acc/norm [*U, S] in place (the chunk's
    newest query at ``t_new``); returns it as the new last query.

    Exactness: rescaling by lam^(t_new - t_old) and weighting each query by lam^(t_new - i) is the
    same sum as folding the queries one at a time, so the result does not depend on chunk size."""
    if last_query >= 0 and decay != 1.0:
        factor = decay ** (t_new - last_query)
        acc.mul_(factor)
        norm.mul_(factor)
    acc.add_(m.mass.to(acc.dtype))
    norm.add_(m.seen.to(norm.dtype))
    return t_new


def raise_peak(peak: Tensor, m: AttentionMass, group: int, fade: float = 1.0) -> None:
    """Raise ``peak`` [*U, S] (any float dtype) in place to the chunk's mean relative attention where it
    is higher (``update_peak``); ``fade`` multiplies the old peak first."""
    mean = m.peak_sum / (group * m.peak_count.clamp_min(1.0))
    old = peak.float() * fade
    peak.copy_(torch.maximum(old, torch.where(m.peak_count > 0, mean, old)))  # peak may be stored narrower


def update_attention(
    acc: Tensor, norm: Tensor, probs: Tensor, key_pos: Tensor, query_pos: Tensor, last_query: int,
    decay: float,
) -> int:
    """Fold one chunk of queries into the decayed accumulators, in place; returns the new last query.

    acc/norm [*U, S]: A_j and N_j for the S cached keys of each unit (units = KV heads of one layer,
    or of several: any leading dims), keys added this chunk start at 0.
    probs [*U, T, S]: attention of the T chunk queries to each key, already summed over the query
    heads of the unit. key_pos [*U, S], query_pos [T] (ascending) are absolute positions.
    ``last_query`` is the position of the newest query already folded in (-1 if none).
    """
    m = attention_mass(probs, key_pos, query_pos, query_weights(query_pos, decay, acc.dtype))
    return fold_mass(acc, norm, m, int(query_pos[-1]), last_query, decay)


def update_peak(peak: Tensor, probs: Tensor, key_pos: Tensor, query_pos: Tensor, group: int,
                min_distance: int, fade: float = 1.0, reach: int | None = None) -> None:
    """Raise ``peak`` [*U, S] (any float dtype) in place to this chunk's mean relative attention where
    it is higher.

    probs [*U, T, S] as in ``update_attention``. Query ``i`` gives key ``j`` the relative attention
    ``a_ij * n_i / G`` (``n_i``: the keys it saw, so uniform attention is 1); the chunk's value for
    ``j`` is the mean over its queries with ``i - j >= min_distance`` (none: ``peak`` unchanged).
    The chunk is the decision interval's queries, so the peak depends on the interval (it is fixed
    per chain, and replays run the same chunks). ``fade`` multiplies the old peak first; queries more
    than ``reach`` after the key do not count (None: all)."""
    weights = torch.ones(query_pos.numel())
    m = attention_mass(probs, key_pos, query_pos, weights, PeakFilter(min_distance, reach))
    raise_peak(peak, m, group, fade)


def attention_signal(acc: Tensor, norm: Tensor) -> Tensor:
    """att_j = A_j / N_j (0 where no query has seen the key yet)."""
    return torch.where(norm > 0, acc / norm.clamp_min(1e-30), torch.zeros_like(acc))


def pool_signal(att: Tensor, kernel: int) -> Tensor:
    """Max over each slot and its ``kernel // 2`` neighbours on either side, per unit ([U, S])."""
    if kernel <= 1 or att.shape[-1] == 0:
        return att
    return torch.nn.functional.max_pool1d(att[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]


def attention_confidence(att: Tensor, context_len: int, group: int, scale: float = 1.0) -> Tensor:
    """c_att = 1 - exp(-att * L / (G * scale)): attention relative to uniform, squashed into [0, 1]."""
    ratio = att * (context_len / (group * scale))
    return 1.0 - torch.exp(-ratio.clamp_min(0.0))


def combine(c_att: Tensor, c_samp: Tensor, w: float) -> Tensor:
    """c = (1 - w) c_att + w c_samp, broadcasting the per-token sampling term over units."""
    if w == 0.0:
        return c_att
    if w == 1.0:
        return c_samp.expand_as(c_att).clone()
    return (1.0 - w) * c_att + w * c_samp


def confidence(
    acc: Tensor, norm: Tensor, c_samp: Tensor, context_len: int, group: int, config: ScorerConfig,
    peak: Tensor | None = None, scale: float | None = None, weight: float | None = None,
) -> Tensor:
    """Combined retention confidence for [U, S] cached keys; ``c_samp`` [S] or [U, S]; ``peak``
    [U, S] (``update_peak``) is read when ``config.memory`` is on; ``scale``: the attention
    confidence's scale (None: ``config.scale``; the precision chain passes its own,
    ``RetentionConfig.scale``); ``weight``: the sampling signal's (None: ``config.effective_weight``;
    the precision chain passes ``RetentionConfig.sampling_weight``)."""
    att = attention_signal(acc, norm)
    if peak is not None and config.memory > 0:  # in att's units: att * L / G >= memory * peak
        att = torch.maximum(att, peak.to(att.dtype) * (config.memory * group / max(context_len, 1)))
    att = pool_signal(att, config.pool)
    scale = config.scale if scale is None else scale
    c_att = attention_confidence(att, context_len, group, scale)
    w = config.effective_weight if weight is None else weight
    return combine(c_att, c_samp, w).clamp(0.0, 1.0)
