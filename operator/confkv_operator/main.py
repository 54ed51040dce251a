"""``confkv-operator``: validate the settings from env, then run Kopf (standalone by default)."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

import kopf

from .handlers import register
from .kube import Kube
from .settings import OperatorSettings, SettingsError, load_settings


def build_registry(settings: OperatorSettings, kube: Kube | None = None) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    register(registry, settings, kube)
    return registry


def run_kwargs(settings: OperatorSettings) -> dict[str, object]:
    """Arguments shared by ``main`` and in-process runs (tests, benchmark)."""
    scope: dict[str, object] = (
        {"namespaces": list(settings.namespaces)} if settings.namespaces else {"clusterwide": True})
    return {
        **scope,
        "standalone": settings.standalone,
        "peering_name": settings.peering_name or None,
        "priority": settings.peering_priority,
    }


async def run_operator(settings: OperatorSettings, stop_flag: asyncio.Event | threading.Event | None = None,
                       ready_flag: asyncio.Event | threading.Event | None = None,
                       liveness: bool = True, kube: Kube | None = None) -> None:
    await kopf.operator(
        registry=build_registry(settings, kube),
        liveness_endpoint=settings.liveness_endpoint if liveness else None,
        stop_flag=stop_flag, ready_flag=ready_flag,
        **run_kwargs(settings),  # type: ignore[arg-type]
    )


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings()
    except SettingsError as err:
        print(f"confkv-operator: {err}", file=sys.stderr)
        return 2
    kopf.configure(verbose=settings.log_level == "DEBUG")  # Kopf's per-object log format
    logging.getLogger().setLevel(settings.log_level)
    asyncio.run(run_operator(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
