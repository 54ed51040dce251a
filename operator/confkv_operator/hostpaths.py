"""Which node directories a ConfKVDeployment may mount (``cacheStorage.type: hostPath``), and how.

A hostPath volume is a way out of the container: ``hostPath: /`` would hand the node's root filesystem to
whoever may create a ConfKVDeployment. So the operator refuses every hostPath unless the cluster admin
started it with an allow-list of prefixes (``CONFKV_HOST_PATH_PREFIXES``), and then only paths at or
below one of them.

- Paths are compared segment by segment, never as strings: prefix ``/data`` allows ``/data/x`` but not
  ``/database``. Both sides are canonical (no ``.``/``..``/empty segments, no trailing slash; the CR
  model and the settings check that), so ``/data/../etc`` never reaches the comparison.
- Symlinks: the kubelet follows symlinks in a hostPath. If a pod could write into an allowed directory,
  a symlink ``/data/x/escape -> /`` plus a second CR with ``hostPath: /data/x/escape`` would mount the
  node's root. The volume is therefore always the allowed prefix itself (``type: Directory``: it must
  exist, nothing is created outside it) and the CR's remainder is the mount's ``subPath``, which the
  kubelet resolves inside the volume and refuses when a symlink leads out of it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from confkv_api.deployment import HOST_PATH_PATTERN


class HostPathRefused(ValueError):
    """The spec asks for a node directory the operator does not allow; the message says why."""


def _segments(path: str) -> list[str]:
    return path.strip("/").split("/")


def split_host_path(path: str, prefixes: Sequence[str]) -> tuple[str, str]:
    """(volume path, subPath) for a canonical ``path``: the longest allowed prefix and the rest
    ("" when ``path`` is the prefix itself). Raises HostPathRefused when no prefix covers it."""
    if not prefixes:
        raise HostPathRefused(
            f"cacheStorage.hostPath {path!r} refused: this operator allows no hostPath volumes "
            "(the cluster admin sets CONFKV_HOST_PATH_PREFIXES; use type emptyDir or pvc)")
    if not re.fullmatch(HOST_PATH_PATTERN, path):
        raise HostPathRefused(f"cacheStorage.hostPath {path!r} refused: not a canonical absolute path")
    wanted = _segments(path)
    best: list[str] | None = None
    for prefix in prefixes:
        allowed = _segments(prefix)
        if wanted[:len(allowed)] == allowed and (best is None or len(allowed) > len(best)):
            best = allowed
    if best is None:
        raise HostPathRefused(
            f"cacheStorage.hostPath {path!r} refused: not under an allowed prefix ({', '.join(prefixes)})")
    return "/" + "/".join(best), "/".join(wanted[len(best):])
