"""Apply: the gRPC client of ``confkv.v1.EngineControl`` over the shared Unix socket, and the
translation of planned actions into RPCs.

FAILED_PRECONDITION / UNIMPLEMENTED from the engine mean "this engine cannot do that" and become
the ``unavailable`` result (the planner moves to the next step); INVALID_ARGUMENT and an
unreachable engine become ``failed`` (retried after the cooldown).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc

from confkv_api.v1 import control_pb2 as pb
from confkv_api.v1 import control_pb2_grpc as pb_grpc

from .planner import BATCH, Action, Result

_UNAVAILABLE_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)


class EngineError(Exception):
    """A failed call; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def unavailable(self) -> bool:
        """The engine lacks the capability (or cannot apply the change live)."""
        return self.code in _UNAVAILABLE_CODES

    @property
    def unreachable(self) -> bool:
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class EngineClient:
    def __init__(self, socket_path: str, timeout: float = 5.0) -> None:
        path = socket_path.removeprefix("unix://")
        self.target = f"unix://{path}"
        self.timeout = timeout
        self._channel = grpc.insecure_channel(self.target)
        self._stub = pb_grpc.EngineControlStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
            details = err.details() if hasattr(err, "details") else str(err)
            raise EngineError(code, details or code.name) from None

    def status(self) -> pb.EngineStatus:
        return self._call(self._stub.GetStatus, pb.GetStatusRequest())

    def update_policy(self, confkv_patch: dict[str, Any] | None = None, *, replace: bool = False,
                      max_batch_size: int | None = None, require_live: bool = False,
                      expected_version: int = 0, reason: str = "") -> pb.UpdatePolicyResponse:
        request = pb.UpdatePolicyRequest(
            confkv_json=json.dumps(confkv_patch) if confkv_patch is not None else "", replace=replace,
            require_live=require_live, expected_version=expected_version, reason=reason)
        if max_batch_size is not None:
            request.max_batch_size = max_batch_size
        return self._call(self._stub.UpdatePolicy, request)

    def compress(self, strategy: str = "", force: bool = True) -> pb.ActionResponse:
        return self._call(self._stub.Compress, pb.CompressRequest(strategy=strategy, force=force))

    def warmup(self, top_k: int = 0) -> pb.ActionResponse:
        return self._call(self._stub.Warmup, pb.WarmupRequest(top_k=top_k))


def split_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any] | None, int | None]:
    """Dotted overrides -> (a merge patch of the confkv section, maxBatchSize)."""
    patch: dict[str, Any] = {}
    batch = None
    for key, value in overrides.items():
        if key == BATCH:
            batch = int(value)
            continue
        section, *path = key.split(".")
        if section != "confkv" or not path:
            raise ValueError(f"cannot override {key!r} live")
        node = patch
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value  # None resets the field to its default (merge-patch null)
    return (patch or None), batch


@dataclass(frozen=True)
class Outcome:
    result: Result
    message: str
    policy_json: str = ""  # the engine's policy after an applied policy change


_SCALE_OUT = "add replicas (ConfKVDeployment spec.replicas) or GPUs"
#: What a recommendation says, by action and latency cause ("" when the cause is unknown).
RECOMMENDATIONS: dict[tuple[str, str], str] = {
    ("recommendScaleOut", "queueing"): "requests wait in the queue, and the wait is part of their latency: "
                                       f"{_SCALE_OUT} (smaller batches would make the queue longer)",
    ("recommendScaleOut", "preemption"): "sequences are still preempted with smaller batches: the KV cache "
                                         f"is too small for the load; {_SCALE_OUT}",
    ("recommendScaleOut", ""): f"latency stays above its threshold with smaller batches: {_SCALE_OUT}",
    ("recommendPrefillTuning", "prefill"): (
        "the queue is empty, so the first token waits for the prompt's own prefill (long prompts): put "
        "shared text (system prompt, instructions) first so the prefix cache serves it, shorten prompts, "
        "or serve on a faster device; a lower engine.prefillChunk (restart) shortens other requests' "
        "decode stalls, not this first token"),
}


def recommendation(action: Action) -> str:
    return RECOMMENDATIONS.get((action.name, action.cause)) or RECOMMENDATIONS.get(
        (action.name, ""), f"{action.name}: nothing to change in the engine")


class Applier:
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def apply(self, action: Action, reason: str) -> Outcome:
        if action.dry_run:
            return Outcome("dry-run", f"dry run: would {action.describe()}")
        if action.kind == "record":
            return Outcome("recommended", recommendation(action))
        try:
            if action.name == "compress":
                return Outcome("applied", self.client.compress().message)
            if action.name == "warmup":
                return Outcome("applied", self.client.warmup().message)
            patch, batch = split_overrides(action.overrides)
            resp = self.client.update_policy(patch, max_batch_size=batch, reason=reason,
                                             require_live=action.kind == "policy")
            return Outcome("applied", resp.message, resp.policy_json)
        except EngineError as err:
            return Outcome("unavailable" if err.unavailable else "failed", f"{err.code.name}: {err}")
