"""The control socket's file-system side: where it may live, and binding it so only its owner connects.

Whoever can connect to the control socket can change the engine's policy, so the socket must never be
reachable by another local user, nor be one another user put there for the agent to talk to. The
rules, checked before the gRPC server binds:

- The directory is created 0700 when missing. An existing one must belong to this user (or to root)
  and be writable by nobody else, unless it is sticky (``/tmp``, and the memory ``emptyDir`` a pod
  shares between the engine and its agent: kubelet mounts it 1777 owned by root): in a sticky
  directory no other user can remove or rename this user's socket.
- An existing entry at the socket path must be this user's own Unix socket. A live one belongs to a
  running engine and is left alone; a dead one (an engine that was killed) is replaced. Anything else
  (another user's socket, a regular file, a symlink) is refused, never deleted.
- The socket is created under umask 0177 and chmod 0600, so there is no moment when others may connect.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from confkv_api.control_socket import check_socket_address


class ControlSocketError(RuntimeError):
    """The control socket cannot be served safely at this path."""


def socket_path(address: str) -> str:
    """``/run/x.sock`` or ``unix:///run/x.sock`` -> ``/run/x.sock``; anything network-like is refused."""
    try:
        return check_socket_address(address).removeprefix("unix://")
    except ValueError as err:
        raise ControlSocketError(f"engine.grpcSocket {err}") from None


def socket_is_live(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


def _owner_problem(kind: str, path: str, st: os.stat_result) -> str | None:
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"the control socket {kind} {path} is owned by uid {st.st_uid}, not by this user (uid {me})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return (f"the control socket {kind} {path} is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}) without the sticky bit: another user could replace "
                f"the socket")
    return None


def ensure_private_dir(directory: str) -> None:
    """Create ``directory`` 0700 (parents as needed) or check that an existing one is safe."""
    try:
        os.makedirs(os.path.dirname(directory) or "/", mode=0o700, exist_ok=True)
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)  # a umask could have taken the owner's bits; ours, just created
    except FileExistsError:
        pass  # there already (or someone else was first): checked below like any existing one
    except OSError as err:
        raise ControlSocketError(f"cannot create the control socket directory {directory}: {err.strerror} "
                                 f"(set engine.grpcSocket / --grpc-socket, or XDG_RUNTIME_DIR)") from None
    try:
        st = os.stat(directory)
    except OSError as err:
        raise ControlSocketError(f"the control socket directory {directory}: {err.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ControlSocketError(f"the control socket directory {directory} is not a directory")
    problem = _owner_problem("directory", directory, st)
    if problem:
        raise ControlSocketError(problem)


def clear_stale_socket(path: str, is_live: Callable[[str], bool] = socket_is_live) -> None:
    """Remove this user's dead socket at ``path``; refuse anything that is not one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid():
        raise ControlSocketError(f"{path} is owned by uid {st.st_uid}, not by this user (uid "
                                 f"{os.geteuid()}): refusing to serve (or let the agent use) a socket "
                                 f"another user made")
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlSocketError(f"{path} exists and is not a Unix socket; not touching it")
    if is_live(path):
        raise ControlSocketError(f"another process is serving the control socket {path}")
    os.unlink(path)  # left behind by an engine that was killed


def prepare(address: str) -> str:
    """The checked socket path, its directory ready and no stale socket in the way."""
    path = socket_path(address)
    ensure_private_dir(os.path.dirname(path))
    clear_stale_socket(path)
    return path


@contextmanager
def owner_only_umask() -> Iterator[None]:
    """Files (the socket) created inside are 0600 from the start."""
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)
