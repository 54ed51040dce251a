"""The agent's control loop: config -> collect -> evaluate -> plan -> apply -> record, one ``tick``
at a time (``main`` calls it every interval; tests call it directly).

Policy reconciliation (with a config file): the engine's live policy should equal the file's
``confkv`` section with the agent's active runtime overrides on top, and ``maxBatchSize`` the
engine's start-up value unless overridden. Each tick compares the engine's policy with that and
pushes the difference with UpdatePolicy: this is how an edited ConfigMap reaches a running engine,
and how a restarted engine gets the overrides back. Without a file the agent pushes only its own
steps and reverts (a revert restores what the engine started with).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import grpc
from pydantic import ValidationError

from confkv_api.alerts import alerts_for_device, engine_on_cpu
from confkv_api.config import ConfigError, ConfKVConfig, ConfKVSection, dump_config, load_config_file
from confkv_api.merge import merge_patch

from .apply import Applier, EngineClient, EngineError, split_overrides
from .collect import NvmlReader, observation, vram_reading
from .kube import KubeRecorder
from .logs import log_fields, utc_iso
from .metrics import AgentMetrics
from .planner import BATCH, CACHE_SIZE, HIGH, LRU_K, MEDIUM, Action, Planner, PolicyView, latency_cause
from .rules import AlertEvaluator, AlertState, Transition

log = logging.getLogger("confkv.agent")

MAX_STEPS_PER_TICK = 8  # unavailable steps are skipped within a tick; this bounds the retries


class ConfigWatcher:
    """Re-reads the mounted config when its bytes change (ConfigMap updates swap a symlink)."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self._digest: str | None = None

    def poll(self) -> ConfKVConfig | None:
        """The new config when the file changed; raises ConfigError when it changed and is invalid."""
        if self.path is None:
            return None
        file = self.path / "confkv.json" if self.path.is_dir() else self.path
        try:
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
        except OSError as err:
            digest = f"unreadable: {err}"
        if digest == self._digest:
            return None  # unchanged (or the same problem as last time: reported once)
        self._digest = digest
        if digest.startswith("unreadable: "):
            raise ConfigError(f"cannot read {file}: {digest.removeprefix('unreadable: ')}")
        return load_config_file(self.path)


def policy_view(policy: dict[str, Any], kv_bytes_total: int) -> PolicyView:
    confkv = policy["confkv"]
    th = confkv["confidenceThresholds"]
    return PolicyView(int(policy["engine"]["maxBatchSize"]), int(confkv["eviction"]["k"]),
                      float(th["high"]), float(th["medium"]), kv_bytes_total)


def flat_baseline(confkv: dict[str, Any], max_batch_size: int) -> dict[str, Any]:
    th = confkv["confidenceThresholds"]
    return {BATCH: max_batch_size, LRU_K: confkv["eviction"]["k"], CACHE_SIZE: confkv.get("maxCacheSize"),
            HIGH: th["high"], MEDIUM: th["medium"]}


class Agent:
    def __init__(self, config: ConfKVConfig, client: EngineClient, config_path: str | None = None,
                 metrics: AgentMetrics | None = None, kube: KubeRecorder | None = None,
                 nvml: NvmlReader | None = None) -> None:
        self.config = config
        self.client = client
        self.applier = Applier(client)
        self.watcher = ConfigWatcher(config_path)
        self.metrics = metrics or AgentMetrics()
        self.kube = kube or KubeRecorder()
        self.nvml = nvml or NvmlReader()
        self.evaluator = AlertEvaluator(config.alerts)
        self.planner = Planner(config.remediation)
        self.engine_up: bool | None = None
        self.on_cpu: bool | None = None  # the engine's device, once a status said it
        self.vram_source = ""
        self.last_tick: float | None = None
        self._failed_push: str | None = None
        if config_path:
            self.watcher.poll()  # the file the caller loaded is the current one
        for line in (f"Kubernetes recording off: {self.kube.reason}" if not self.kube.enabled else "",
                     f"NVML off ({self.nvml.reason}): VRAM falls back to the engine's memory report"
                     if not self.nvml.available else ""):
            if line:
                log.info(line)

    # ---- one iteration ---------------------------------------------------------------------
    def tick(self, now: float) -> None:
        self._reload_config(now)
        try:
            status = self.client.status()
        except EngineError as err:
            self._set_engine_up(False, str(err))
            self.last_tick = now
            return
        self._set_engine_up(True, "")
        self._set_device(engine_on_cpu(status.device_memory.device))
        status = self._reconcile(now, status)
        self.metrics.policy_version.set(status.policy_version)
        vram = vram_reading(self.nvml, status)
        if vram.source != self.vram_source:
            self.vram_source = vram.source
            log.info("VRAM source: %s (%s)", vram.source, vram.device or "no data")
        self.metrics.set_vram(vram.source, vram.device, vram.fraction)
        for transition in self.evaluator.evaluate(now, observation(status, vram)):
            self._record_transition(now, transition)
        for alert, rule in self.evaluator.rules.items():
            self.metrics.set_state(alert, rule.state)
            self.metrics.set_value(alert, rule.value)
        self._remediate(now, status)
        self.last_tick = now

    def _reload_config(self, now: float) -> None:
        try:
            new = self.watcher.poll()
        except ConfigError as err:
            self.metrics.config_reloads.labels(result="invalid").inc()
            log.error("config not reloaded, keeping the previous one: %s", err)
            self.kube.event(now, "ConfigInvalid", str(err), warning=True)
            return
        if new is None or dump_config(new) == dump_config(self.config):
            return
        self.config = new
        self.evaluator.configure(alerts_for_device(new.alerts, bool(self.on_cpu)))
        self.planner.configure(new.remediation)
        self._failed_push = None
        self.metrics.config_reloads.labels(result="applied").inc()
        log.info("config reloaded from %s", self.watcher.path)

    def _set_engine_up(self, up: bool, reason: str) -> None:
        self.metrics.engine_up.set(1 if up else 0)
        if up != self.engine_up:
            if up:
                log.info("engine control socket %s answers", self.client.target)
            else:
                log.warning("engine control socket %s does not answer: %s", self.client.target, reason)
        self.engine_up = up

    def _set_device(self, on_cpu: bool) -> None:
        """Alert thresholds for the engine's device (a CPU keeps its own latency default)."""
        if on_cpu == self.on_cpu:
            return
        self.on_cpu = on_cpu
        alerts = alerts_for_device(self.config.alerts, on_cpu)
        self.evaluator.configure(alerts)
        if alerts.latency_ms != self.config.alerts.latency_ms:
            rule = alerts.latency_ms
            log.info("engine on CPU: latencyMs uses the CPU threshold %g ms (p95 %s; set "
                     "alerts.latencyMs.threshold to choose another)", rule.threshold, rule.signal)

    # ---- policy reconciliation -------------------------------------------------------------
    def _desired(self, status: Any) -> tuple[dict[str, Any], int]:
        startup = json.loads(status.startup_policy_json)
        base = self.config.confkv.model_dump(mode="json", by_alias=True)
        patch, batch = split_overrides(self.planner.overrides())
        merged = merge_patch(base, patch or {})
        try:
            # null in the overrides (a revert to an unset field) removes the key; validating puts the
            # field's default back, so the document compares equal to the engine's full dump.
            confkv = ConfKVSection.model_validate(merged).model_dump(mode="json", by_alias=True)
        except ValidationError:
            confkv = merged  # pushed as it is: the engine's INVALID_ARGUMENT names the problem
        return confkv, batch if batch is not None else int(startup["engine"]["maxBatchSize"])

    def _reconcile(self, now: float, status: Any) -> Any:
        if self.watcher.path is None:
            # No config file (a local ``confkv serve --with-agent``): nobody declared a policy, so the
            # agent only pushes its own steps and reverts, never a whole document.
            return status
        confkv, batch = self._desired(status)
        live = json.loads(status.policy_json)
        desired = {"confkv": confkv, "engine": {"maxBatchSize": batch}}
        key = json.dumps(desired, sort_keys=True)
        if _normalised(live) == _normalised(desired) or key == self._failed_push:
            return status
        try:
            resp = self.client.update_policy(confkv, replace=True, max_batch_size=batch,
                                             expected_version=status.policy_version,
                                             reason="agent: configured policy + active remediations")
        except EngineError as err:
            # An invalid document stays invalid until the config changes; anything else is retried.
            self._failed_push = key if err.code is grpc.StatusCode.INVALID_ARGUMENT else None
            log.error("engine refused the configured policy: %s", err)
            self.kube.event(now, "PolicyRejected", str(err), warning=True)
            return status
        log_fields(log, logging.INFO, f"policy pushed: version {resp.version}",
                   changed=list(resp.changed_fields), deferred=list(resp.deferred_fields))
        if resp.changed_fields:
            self.kube.event(now, "PolicyUpdated", f"policy version {resp.version}: {resp.message}")
        return self.client.status()

    # ---- remediation -----------------------------------------------------------------------
    def _remediate(self, now: float, status: Any) -> None:
        policy = json.loads(status.policy_json)
        startup = json.loads(status.startup_policy_json)
        base_conf = (self.config.confkv.model_dump(mode="json", by_alias=True) if self.watcher.path
                     else startup["confkv"])
        baseline = flat_baseline(base_conf, int(startup["engine"]["maxBatchSize"]))
        states = self.evaluator.states()
        ctx = self.evaluator.latency_context()
        causes = {"latencyMs": latency_cause(ctx.signal, ctx.mean_waiting, ctx.preemptions)}
        for _ in range(MAX_STEPS_PER_TICK):
            view = policy_view(policy, status.kv_bytes_total)
            actions = self.planner.plan(now, states, view, baseline, causes)
            if not actions:
                return
            retry = False
            for action in actions:
                outcome = self.applier.apply(action, f"agent: {action.alert} {states[action.alert]}: "
                                                     f"{action.describe()}")
                self.planner.record(now, action, outcome.result)
                self._record_remediation(now, action, outcome.result, outcome.message)
                if outcome.policy_json:
                    policy = json.loads(outcome.policy_json)
                retry = retry or outcome.result == "unavailable"
            if not retry:
                return

    def _record_transition(self, now: float, t: Transition) -> None:
        value = "no data" if t.value is None else f"{t.value:.4g}"
        rule = self.evaluator.rules[t.alert].spec
        log_fields(log, logging.WARNING if t.new is AlertState.FIRING else logging.INFO,
                   f"alert {t.alert}: {t.old.value} -> {t.new.value}", alert=t.alert, value=t.value,
                   threshold=rule.threshold)
        if t.new is AlertState.FIRING:
            self.kube.event(now, "AlertFiring", f"{t.alert} = {value} (threshold {rule.threshold:g})",
                            warning=True)
        elif t.resolved:
            self.kube.event(now, "AlertResolved", f"{t.alert} = {value} (threshold {rule.threshold:g})")
            self.metrics.scale_out.labels(alert=t.alert).set(0)  # the recommendation ends with its alert

    def _record_remediation(self, now: float, action: Action, result: str, message: str) -> None:
        self.metrics.remediations.labels(alert=action.alert, action=action.name, result=result).inc()
        if action.name == "recommendScaleOut" and result == "recommended":
            # The autoscaler (HPA or KEDA, spec.autoscaling) acts on it; the agent changes no replicas.
            self.metrics.scale_out.labels(alert=action.alert).set(1)
        level = logging.WARNING if result == "failed" else logging.INFO
        log_fields(log, level, f"remediation {action.describe()} for {action.alert}: {result}: {message}",
                   alert=action.alert, action=action.name, result=result, overrides=action.overrides,
                   **({"cause": action.cause} if action.cause else {}))
        reason = {"applied": "Remediated", "unavailable": "RemediationUnavailable",
                  "failed": "RemediationFailed", "dry-run": "RemediationDryRun",
                  "recommended": "ScaleOutRecommended" if action.name == "recommendScaleOut"
                  else "TuningRecommended"}[result]
        if action.name == "revert" and result == "applied":
            reason = "RemediationReverted"
        self.kube.event(now, reason, f"{action.alert}: {action.describe()}: {message}",
                        warning=result == "failed")
        if result != "unavailable":
            self.kube.annotate({"time": utc_iso(now), "alert": action.alert, "action": action.name,
                                "result": result, "message": message[:512]})

    def health(self, now: float, interval: float) -> tuple[bool, dict[str, Any]]:
        """Alive while the loop turns; an unreachable engine is reported, not fatal (own probes)."""
        stale = self.last_tick is None or now - self.last_tick > max(30.0, 5 * interval)
        body = {"status": "stalled" if stale and self.last_tick is not None else "ok",
                "engine": {None: "unknown", True: "up", False: "down"}[self.engine_up],
                "alerts": {a: s.value for a, s in self.evaluator.states().items()}}
        return not (stale and self.last_tick is not None), body


def _normalised(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True)
