"""Remediation planner: an ordered playbook per alert, as a pure state machine (time passed in).

While an alert fires, the planner proposes the next step of its playbook; after an applied step it
waits ``cooldown`` and, if the alert still fires (the step did not help: that is the verification),
proposes the next one. A step the engine cannot do (``unavailable``), a step ``allowedActions``
excludes and a step that would change nothing (LRU-K already at its maximum, batch size 1) are
skipped at once. Policy steps are runtime overrides of the configured policy; once the alert has
been inactive for ``revert_after`` (default: the cooldown) the planner proposes a revert that
restores those fields (to the other alerts' overrides where they still hold one, else to the
baseline). In dry-run every step is proposed and recorded but nothing reaches the engine.

Playbooks (the deployment guide's section 5.2):
  hitRate    -> raiseLruK (K + 1 up to ``max_lru_k``), warmup
  vram       -> compress, lowerMaxCacheSize (-20 %), stricterThresholds
  oomPerHour -> halveBatchSize, compress
  latencyMs  -> by cause, fixed when the incident's first step is chosen (``latency_cause``):
    preemption (sequences were preempted in the window)   -> smallerBatches, recommendScaleOut
    decode     (time per output token; e2e, queue empty)  -> smallerBatches, recommendScaleOut
    queueing   (requests waited in the queue: on average
                at least half a request waiting)          -> recommendScaleOut
    prefill    (time to first token, queue empty)         -> warmup, recommendPrefillTuning
  A smaller batch shortens each decode step (every running sequence is in it) and causes fewer
  preemptions, but it serves fewer requests at once: with a queue it makes the wait, and so the time
  to first token, longer; with an empty queue the first token waits for the prompt's own prefill,
  which the batch size does not change, and a warm prefix cache does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from confkv_api.config import RemediationSection
from confkv_api.units import parse_duration

from .rules import AlertState

LATENCY_PLAYBOOKS: dict[str, tuple[str, ...]] = {
    "preemption": ("smallerBatches", "recommendScaleOut"),
    "decode": ("smallerBatches", "recommendScaleOut"),
    "queueing": ("recommendScaleOut",),
    "prefill": ("warmup", "recommendPrefillTuning"),
}
PLAYBOOKS: dict[str, tuple[str, ...]] = {
    "oomPerHour": ("halveBatchSize", "compress"),
    "vram": ("compress", "lowerMaxCacheSize", "stricterThresholds"),
    "latencyMs": LATENCY_PLAYBOOKS["decode"],  # the playbook of an unknown cause
    "hitRate": ("raiseLruK", "warmup"),
}
ENGINE_ACTIONS = frozenset({"compress", "warmup"})  # an RPC of their own
RECORD_ONLY = frozenset({"recommendScaleOut", "recommendPrefillTuning"})  # recorded, nothing to change
REVERT = "revert"

BATCH = "engine.maxBatchSize"
LRU_K = "confkv.eviction.k"
CACHE_SIZE = "confkv.maxCacheSize"
HIGH = "confkv.confidenceThresholds.high"
MEDIUM = "confkv.confidenceThresholds.medium"

Result = Literal["applied", "unavailable", "failed", "dry-run", "recommended", "skipped"]

# Several alerts may override one field: the most conservative value wins.
_COMBINE: dict[str, Callable[[list[Any]], Any]] = {
    BATCH: min, LRU_K: max, HIGH: max, MEDIUM: max, CACHE_SIZE: lambda vs: min(vs, key=float),
}


@dataclass(frozen=True)
class PolicyView:
    """The engine's current policy, as far as the playbooks need it."""

    max_batch_size: int
    lru_k: int
    high: float
    medium: float
    kv_bytes_total: int


#: Requests waiting, averaged over the window, from which the queue explains the latency. By Little's
#: law the mean queue length is the arrival rate times the mean wait: at half a request the wait is a
#: real part of the latency, while a request that waits for one scheduler step now and then stays far
#: below it.
QUEUE_MEAN_WAITING = 0.5


def latency_cause(signal: str, mean_waiting: float, preemptions: float) -> str:
    """Why the latency signal is high, from what the rule's window saw (see the module docstring)."""
    if preemptions > 0:
        return "preemption"
    if signal == "tpot":
        return "decode"
    if mean_waiting >= QUEUE_MEAN_WAITING:
        return "queueing"
    return "prefill" if signal == "ttft" else "decode"


@dataclass(frozen=True)
class Action:
    alert: str
    name: str
    step: int  # index in the playbook; -1 for a revert
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted field -> new value
    dry_run: bool = False
    cause: str = ""  # latencyMs: the cause its playbook was chosen for

    @property
    def kind(self) -> str:
        if self.name == REVERT:
            return "revert"
        if self.name in ENGINE_ACTIONS:
            return "engine"
        return "record" if self.name in RECORD_ONLY else "policy"

    def describe(self) -> str:
        changes = ", ".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))
        return f"{self.name}({changes})" if changes else self.name


def policy_change(name: str, view: PolicyView, max_lru_k: int) -> dict[str, Any] | None:
    """The fields a policy step sets, or None when it would change nothing."""
    b = view.max_batch_size
    if name == "halveBatchSize":
        return {BATCH: max(1, b // 2)} if b > 1 else None
    if name == "smallerBatches":
        return {BATCH: max(1, b - max(1, b // 4))} if b > 1 else None
    if name == "raiseLruK":
        return {LRU_K: view.lru_k + 1} if view.lru_k < max_lru_k else None
    if name == "lowerMaxCacheSize":  # the engine's kv_bytes_total is in maxCacheSize's unit: -20% exactly
        return {CACHE_SIZE: str(int(view.kv_bytes_total * 0.8))} if view.kv_bytes_total > 0 else None
    if name == "stricterThresholds":
        high = min(0.99, round(view.high + 0.02, 4))
        medium = min(round(high - 0.01, 4), round(view.medium + 0.05, 4))
        return {HIGH: high, MEDIUM: medium} if (high, medium) != (view.high, view.medium) else None
    return {}


@dataclass
class _Track:
    step: int = 0
    last_action_at: float | None = None
    healthy_since: float | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    cause: str = ""  # latencyMs: the incident's cause, chosen at its first step


class Planner:
    def __init__(self, remediation: RemediationSection, max_lru_k: int = 3,
                 revert_after: float | None = None) -> None:
        self.max_lru_k = max_lru_k
        self._revert_after = revert_after
        self.tracks = {alert: _Track() for alert in PLAYBOOKS}
        self.configure(remediation)

    def configure(self, remediation: RemediationSection) -> None:
        if not remediation.enabled:
            # Switched off: forget every step and override (the agent's policy reconciliation then
            # restores the configured policy in the engine).
            self.tracks = {alert: _Track() for alert in PLAYBOOKS}
        self.enabled = remediation.enabled
        self.dry_run = remediation.dry_run
        self.cooldown = parse_duration(remediation.cooldown)
        self.allowed = frozenset(remediation.allowed_actions)
        self.revert_after = self.cooldown if self._revert_after is None else self._revert_after

    # ---- planning --------------------------------------------------------------------------
    def plan(self, now: float, states: Mapping[str, AlertState], view: PolicyView,
             baseline: Mapping[str, Any], causes: Mapping[str, str] | None = None) -> list[Action]:
        """At most one action per alert. ``baseline``: the configured value of every dotted field a
        policy step may override (what a revert restores when no other alert overrides it).
        ``causes``: alert -> cause (``latency_cause``) for alerts whose playbook depends on it."""
        if not self.enabled:
            return []
        actions = []
        for alert in PLAYBOOKS:
            track = self.tracks[alert]
            state = states.get(alert, AlertState.INACTIVE)
            if state is AlertState.FIRING:
                if track.step == 0 and track.last_action_at is None:  # a new incident
                    track.cause = (causes or {}).get(alert, "")
                action = self._next_step(now, alert, self.playbook(alert, track.cause), track, view)
            else:
                action = self._maybe_revert(now, alert, state, track, baseline)
            if action is not None:
                actions.append(action)
        return actions

    def _next_step(self, now: float, alert: str, playbook: tuple[str, ...], track: _Track,
                   view: PolicyView) -> Action | None:
        track.healthy_since = None
        if track.last_action_at is not None and now - track.last_action_at < self.cooldown:
            return None
        while track.step < len(playbook):
            name = playbook[track.step]
            change = policy_change(name, view, self.max_lru_k)
            if name in self.allowed and change is not None:
                return Action(alert, name, track.step, change, self.dry_run, track.cause)
            track.step += 1  # excluded, or it would change nothing: the next step
        return None

    def _maybe_revert(self, now: float, alert: str, state: AlertState, track: _Track,
                      baseline: Mapping[str, Any]) -> Action | None:
        if state is not AlertState.INACTIVE:  # pending is not healthy
            track.healthy_since = None
            return None
        if track.step == 0 and not track.overrides:
            return None
        if track.healthy_since is None:
            track.healthy_since = now
        if now - track.healthy_since < self.revert_after:
            return None
        if not track.overrides:  # nothing reached the engine (dry-run, or engine-only steps)
            self.tracks[alert] = _Track()
            return None
        others = self.overrides(excluding=alert)
        restore = {f: others.get(f, baseline.get(f)) for f in track.overrides}
        return Action(alert, REVERT, -1, restore, self.dry_run)

    @staticmethod
    def playbook(alert: str, cause: str = "") -> tuple[str, ...]:
        if alert == "latencyMs" and cause in LATENCY_PLAYBOOKS:
            return LATENCY_PLAYBOOKS[cause]
        return PLAYBOOKS[alert]

    # ---- feedback --------------------------------------------------------------------------
    def record(self, now: float, action: Action, result: Result) -> None:
        """Feed an action's outcome back; call ``plan`` again after ``unavailable`` for the next step."""
        track = self.tracks[action.alert]
        if action.name == REVERT:
            if result in ("applied", "dry-run"):
                self.tracks[action.alert] = _Track()
            return
        if result == "unavailable":
            track.step = action.step + 1
            return
        track.last_action_at = now
        if result in ("applied", "dry-run", "recommended"):
            track.step = action.step + 1
            if result == "applied" and action.kind == "policy":
                track.overrides.update(action.overrides)

    def overrides(self, excluding: str | None = None) -> dict[str, Any]:
        """The combined runtime overrides of every alert (``excluding`` one)."""
        values: dict[str, list[Any]] = {}
        for alert, track in self.tracks.items():
            if alert != excluding:
                for key, value in track.overrides.items():
                    values.setdefault(key, []).append(value)
        return {k: _COMBINE.get(k, lambda vs: vs[-1])(vs) for k, vs in values.items()}
