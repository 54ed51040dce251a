"""Fixtures: one API emulator and one in-process operator per module (start-up takes about a second)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from testkit.k8s_emulator import KubeEmulator
from testkit.operator_harness import OperatorThread, install_crds

RESYNC_SECONDS = 0.5  # the timer interval: drift correction and status refresh


@pytest.fixture(scope="module")
def emulator() -> Iterator[KubeEmulator]:
    with KubeEmulator() as api:
        api.activate()  # $KUBECONFIG for Kopf's login and for kubectl
        install_crds(api)
        try:
            yield api
        finally:
            api.deactivate()


@pytest.fixture(scope="module")
def operator(emulator: KubeEmulator) -> Iterator[OperatorThread]:
    with OperatorThread(emulator, resync_seconds=RESYNC_SECONDS) as running:
        yield running
        assert running.alive, "the operator thread died"


@pytest.fixture(scope="module")
def client(emulator: KubeEmulator) -> Iterator[Any]:
    api_client = emulator.api_client()
    yield api_client
    api_client.close()


@pytest.fixture(scope="module")
def custom(client: Any) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(client)


@pytest.fixture(scope="module")
def core(client: Any) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(client)


@pytest.fixture(scope="module")
def apps(client: Any) -> kubernetes.client.AppsV1Api:
    return kubernetes.client.AppsV1Api(client)
