"""KubeEmulator: runs the emulator app on a free localhost port in a background thread."""

from __future__ import annotations

import asyncio
import copy
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import yaml
from aiohttp import web

from . import patching
from .app import EmulatorApp
from .registry import Registry, ResourceType
from .routing import RequestRecord
from .store import Obj, Store

T = TypeVar("T")


class KubeEmulator:
    """An in-process Kubernetes API server emulator (see the package docstring for the full API)."""

    def __init__(
        self,
        *,
        namespaces: tuple[str, ...] = ("default", "kube-system"),
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.registry = Registry()
        self.store = Store(self.registry, namespaces)
        self.request_log: list[RequestRecord] = []
        self._rbac: list[tuple[str, str, str]] = []
        self._log_lock = threading.Lock()
        self._host, self._port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self.url = ""
        self.kubeconfig_path = ""
        self._saved_env: tuple[str | None, str] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> KubeEmulator:
        if self._thread is not None:
            raise RuntimeError("KubeEmulator is already started")
        started = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                errors.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="kube-emulator", daemon=True)
        self._thread.start()
        if not started.wait(timeout=30) or errors:
            raise RuntimeError(f"KubeEmulator failed to start: {errors[0] if errors else 'timeout'}")
        self._write_kubeconfig()
        return self

    async def _serve(self) -> None:
        emulator_app = EmulatorApp(self.store, self._record)
        self._runner = web.AppRunner(
            emulator_app.app, handle_signals=False, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self._host}:{port}"

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        self.deactivate()
        self.store.close_watchers()
        loop, runner = self._loop, self._runner

        async def shutdown() -> None:
            if runner is not None:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=15)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=15)
        self._thread = self._loop = self._runner = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def activate(self) -> None:
        """Make this emulator the process default cluster until `deactivate()`/`stop()`.

        Sets $KUBECONFIG, the kubernetes client's default kubeconfig location (read at import time,
        so setting the variable alone is not enough for Kopf's `login_via_client`) and its default
        Configuration, so `kubernetes.client.CoreV1Api()` and an in-process Kopf both talk to it.
        """
        import kubernetes.config.kube_config as kube_config

        if self._saved_env is None:
            self._saved_env = (os.environ.get("KUBECONFIG"), kube_config.KUBE_CONFIG_DEFAULT_LOCATION)
        os.environ["KUBECONFIG"] = self.kubeconfig_path
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = self.kubeconfig_path
        kube_config.load_kube_config(config_file=self.kubeconfig_path)

    def deactivate(self) -> None:
        if self._saved_env is None:
            return
        import kubernetes.config.kube_config as kube_config

        previous, kube_config.KUBE_CONFIG_DEFAULT_LOCATION = self._saved_env
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
        self._saved_env = None

    def api_client(self) -> Any:
        """A fresh `kubernetes.client.ApiClient` for this emulator (does not touch process defaults)."""
        import kubernetes

        return kubernetes.config.new_client_from_config(config_file=self.kubeconfig_path)

    def _write_kubeconfig(self) -> None:
        self._tmpdir = tempfile.TemporaryDirectory(prefix="kube-emulator-")
        self.kubeconfig_path = os.path.join(self._tmpdir.name, "kubeconfig")
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "preferences": {},
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            # A dummy token: some clients insist on credentials; the emulator ignores them.
            "users": [{"name": "emulator", "user": {"token": "emulator"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": "default"},
                }
            ],
        }
        with open(self.kubeconfig_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)

    # ------------------------------------------------------------------ request log
    def _record(self, record: RequestRecord, group: str) -> None:
        with self._log_lock:
            self.request_log.append(record)
            self._rbac.append((group, record.resource, record.verb))

    def rbac_usage(self) -> set[tuple[str, str, str]]:
        """(apiGroup, resource, verb) triples of every resource request so far, for ClusterRole checks."""
        with self._log_lock:
            return set(self._rbac)

    def clear_log(self) -> None:
        with self._log_lock:
            self.request_log.clear()
            self._rbac.clear()

    def reset(self) -> None:
        """Back to the initial state: built-in types only, initial namespaces, empty log, watches closed."""
        self.store.reset()
        self.clear_log()

    # ------------------------------------------------------------------ direct (non-HTTP) helpers
    def resource(self, api_version: str, resource: str) -> ResourceType:
        """A served type by apiVersion and plural, singular, kind or short name (KeyError if unknown)."""
        return self.registry.find(api_version, resource)

    def get(self, api_version: str, resource: str, name: str, namespace: str | None = None) -> Obj | None:
        return self.store.find(self.resource(api_version, resource), namespace, name)

    def list(self, api_version: str, resource: str, namespace: str | None = None) -> list[Obj]:
        return self.store.list(self.resource(api_version, resource), namespace)[0]

    def create(self, obj: Obj) -> Obj:
        """Create an object from a manifest dict (apiVersion + kind pick the type)."""
        rtype = self.resource(obj["apiVersion"], obj["kind"])
        return self.store.create(rtype, obj.get("metadata", {}).get("namespace"), obj)

    def apply(self, obj: Obj) -> Obj:
        """Create, or strategic-merge into the existing object (the emulator's server-side apply)."""
        rtype = self.resource(obj["apiVersion"], obj["kind"])
        meta = obj.get("metadata", {})
        if self.store.find(rtype, meta.get("namespace"), meta["name"]) is None:
            return self.store.create(rtype, meta.get("namespace"), obj)
        return self.store.modify(
            rtype, meta.get("namespace"), meta["name"], lambda current: patching.strategic_merge(current, obj)
        )

    def patch(
        self,
        api_version: str,
        resource: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        content_type: str = patching.MERGE,
        subresource: str | None = None,
    ) -> Obj:
        rtype = self.resource(api_version, resource)
        return self.store.modify(
            rtype,
            namespace,
            name,
            lambda current: patching.apply_patch(content_type, current, patch),
            subresource,
        )

    def patch_status(
        self, api_version: str, resource: str, name: str, status: dict[str, Any], namespace: str | None = None
    ) -> Obj:
        """Merge-patch `status` (through the status subresource when the type has one)."""
        rtype = self.resource(api_version, resource)
        return self.patch(
            api_version,
            resource,
            name,
            {"status": status},
            namespace,
            subresource="status" if rtype.status else None,
        )

    def delete(self, api_version: str, resource: str, name: str, namespace: str | None = None) -> Obj:
        return self.store.delete(self.resource(api_version, resource), namespace, name)

    def patch_deployment_status(
        self,
        name: str,
        namespace: str = "default",
        *,
        ready: bool = True,
        replicas: int | None = None,
        ready_replicas: int | None = None,
        progress: str = "NewReplicaSetAvailable",
    ) -> Obj:
        """Play the Deployment controller once: report the deployment as rolled out (or not ready).

        Sets replicas/updatedReplicas (spec.replicas unless `replicas` is given), readyReplicas and
        availableReplicas (all when `ready`, else 0, unless `ready_replicas`), observedGeneration and
        the Available/Progressing conditions. `progress` is the Progressing condition's reason:
        NewReplicaSetAvailable (rolled out), ReplicaSetUpdated (pods still starting) or
        ProgressDeadlineExceeded (status False, as the controller reports a stuck rollout).
        """
        deployment = self.get("apps/v1", "deployments", name, namespace)
        if deployment is None:
            raise KeyError(f"deployment {namespace}/{name} does not exist")
        total = replicas if replicas is not None else deployment.get("spec", {}).get("replicas", 1)
        up = ready_replicas if ready_replicas is not None else (total if ready else 0)
        available = "True" if up >= total else "False"
        conditions = [
            {
                "type": "Available",
                "status": available,
                "reason": "MinimumReplicasAvailable" if available == "True" else "MinimumReplicasUnavailable",
            },
            {"type": "Progressing", "status": "False" if progress == "ProgressDeadlineExceeded" else "True",
             "reason": progress},
        ]
        status = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": total,
            "updatedReplicas": total,
            "readyReplicas": up,
            "availableReplicas": up,
            "unavailableReplicas": max(total - up, 0),
            "conditions": conditions,
        }
        return self.patch_status("apps/v1", "deployments", name, status, namespace)

    def serves(self, api_version: str, resource: str) -> bool:
        """Whether a type is served now (e.g. after its CRD was created)."""
        try:
            self.resource(api_version, resource)
        except KeyError:
            return False
        return True

    @staticmethod
    def wait_for(
        condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, message: str = "condition"
    ) -> T:
        """Poll `condition` until it returns something truthy; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {message}")
            time.sleep(interval)

    def snapshot(self) -> dict[str, list[Obj]]:
        """All stored objects by 'group/plural' (core types as 'plural'), for debugging failed tests."""
        result: dict[str, list[Obj]] = {}
        for rtype in self.registry.all():
            items = self.store.list(rtype, None)[0]
            if items:
                result[f"{rtype.group}/{rtype.plural}" if rtype.group else rtype.plural] = copy.deepcopy(
                    items
                )
        return result
