"""Fixtures shared by the emulator's own tests: one emulator per module, reset before each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.k8s_emulator import KubeEmulator


@pytest.fixture(scope="module")
def emulator() -> Iterator[KubeEmulator]:
    with KubeEmulator() as api:
        yield api


@pytest.fixture
def api(emulator: KubeEmulator) -> Iterator[KubeEmulator]:
    emulator.reset()
    yield emulator
