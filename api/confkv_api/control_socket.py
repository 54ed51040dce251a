"""Where the engine's gRPC control socket lives, shared by the engine (which binds it) and the agent.

The control plane is reachable only through a Unix socket, never the network. ``engine.grpcSocket``
names it (the operator sets one in the pod's shared ``emptyDir``); without it each engine gets one per
port, so two local servers and their agents never share a socket, in a directory private to the
user: ``$XDG_RUNTIME_DIR/confkv`` (the per-login, 0700 directory systemd provides, as other Unix
daemons' user sockets use), else ``$XDG_CACHE_HOME/confkv`` or ``~/.cache/confkv``. Never a fixed
name in ``/tmp``: any local user could create it first and wait for the agent.

The path is pure here (the same answer for the engine and an agent started separately by the same
user); the engine creates the directory and checks its owner and mode before binding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Longest path a sockaddr_un holds on Linux (108 bytes with the terminating NUL).
MAX_SOCKET_PATH = 107


def check_socket_address(address: str) -> str:
    """``address`` when it is an absolute Unix socket path (``unix://`` prefix allowed) short enough
    to bind; ValueError naming the problem otherwise (``host:port``, ``dns:...``, relative paths)."""
    path = address.removeprefix("unix://")
    if not path.startswith("/"):
        raise ValueError(f"must be an absolute Unix socket path such as /run/confkv/engine.sock (the "
                         f"control plane never listens on the network), got {address!r}")
    if "\0" in path:
        raise ValueError("must not contain a NUL byte")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"{path!r} is {len(path.encode())} bytes; a Unix socket path holds at most "
                         f"{MAX_SOCKET_PATH}")
    return address


def private_socket_dir(environ: Mapping[str, str] | None = None) -> str:
    """The user's private directory for control sockets (see the module docstring)."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        return os.path.join(runtime, "confkv")
    cache = env.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        home = env.get("HOME") or os.path.expanduser("~")
        cache = os.path.join(home, ".cache")
    return os.path.join(cache, "confkv")


def default_control_socket(port: int) -> str:
    return os.path.join(private_socket_dir(), f"engine-{port}.sock")
