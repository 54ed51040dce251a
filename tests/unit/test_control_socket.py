"""Where the control socket may live: a private directory, this user's own socket, Unix paths only.

"Owned by someone else" is a directory or socket chown-ed to another uid, which needs root (as the
tests run in CI); those cases are skipped otherwise.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from confkv_api.config import ConfigError, load_config
from confkv_api.control_socket import default_control_socket, private_socket_dir
from confkv_engine.control.servicer import ControlPlane, ControlPlaneError

OTHER_UID = 4242
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def plane(sock: Path) -> ControlPlane:
    return ControlPlane(load_config({"engine": {"grpcSocket": str(sock)}}))


@pytest.fixture
def started() -> Iterator[list[ControlPlane]]:
    planes: list[ControlPlane] = []
    yield planes
    for cp in planes:
        cp.stop(grace=0)


def test_missing_directory_is_created_0700_and_socket_0600(tmp_path: Path, started: list) -> None:
    sock = tmp_path / "run" / "confkv" / "e.sock"
    cp = plane(sock)
    cp.start()
    started.append(cp)
    st = sock.parent.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert stat.S_ISSOCK(sock.lstat().st_mode) and stat.S_IMODE(sock.lstat().st_mode) == 0o600


@as_root
def test_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "theirs"
    shared.mkdir(mode=0o700)
    os.chown(shared, OTHER_UID, OTHER_UID)
    with pytest.raises(ControlPlaneError, match=f"owned by uid {OTHER_UID}"):
        plane(shared / "e.sock").start()
    assert not (shared / "e.sock").exists()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_directory_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ControlPlaneError, match="writable by group or others"):
        plane(shared / "e.sock").start()


def test_sticky_shared_directory_is_accepted(tmp_path: Path, started: list) -> None:
    # What a pod's memory emptyDir is (kubelet mounts it 1777, fsGroup adds setgid): nobody else
    # can remove or rename the engine's socket in it.
    shared = tmp_path / "volume"
    shared.mkdir()
    shared.chmod(0o3777)
    cp = plane(shared / "engine.sock")
    cp.start()
    started.append(cp)
    assert stat.S_IMODE((shared / "engine.sock").stat().st_mode) == 0o600


@as_root
def test_socket_owned_by_another_user_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "e.sock"
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(str(path))
    squatter.close()  # not listening: a dead socket, which the engine would replace if it were its own
    os.lchown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(ControlPlaneError, match=f"owned by uid {OTHER_UID}"):
        plane(path).start()
    assert path.lstat().st_uid == OTHER_UID


def test_regular_file_at_the_socket_path_is_not_deleted(tmp_path: Path) -> None:
    path = tmp_path / "e.sock"
    path.write_text("keep me")
    with pytest.raises(ControlPlaneError, match="not a Unix socket"):
        plane(path).start()
    assert path.read_text() == "keep me"


def test_dead_socket_of_this_user_is_replaced(tmp_path: Path, started: list) -> None:
    path = tmp_path / "e.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # as a SIGKILLed engine leaves it
    cp = plane(path)
    cp.start()
    started.append(cp)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(path))  # served again


@pytest.mark.parametrize("bad", ["relative.sock", "127.0.0.1:50051", "dns:///engine:50051",
                                 "unix:engine.sock", "/" + "x" * 120])
def test_invalid_grpc_socket_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="grpcSocket"):
        load_config({"engine": {"grpcSocket": bad}})


def test_invalid_grpc_socket_flag_exits_2_before_loading(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "confkv_engine.cli", "serve", "--grpc-socket", "ctl.sock"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "grpc_socket" in out.stderr and "absolute Unix socket path" in out.stderr
    assert "ctl.sock" in out.stderr
    assert not (tmp_path / "ctl.sock").exists()


def test_default_socket_is_private_to_the_user() -> None:
    runtime = {"XDG_RUNTIME_DIR": "/run/user/1000", "HOME": "/home/u"}
    assert private_socket_dir(runtime) == "/run/user/1000/confkv"
    assert private_socket_dir({"HOME": "/home/u"}) == "/home/u/.cache/confkv"
    assert private_socket_dir({"XDG_CACHE_HOME": "/c", "XDG_RUNTIME_DIR": "rel"}) == "/c/confkv"
    assert default_control_socket(8000).endswith("/confkv/engine-8000.sock")
    assert not default_control_socket(8000).startswith("/tmp/confkv/")
    assert load_config({"engine": {"port": 8123}}).engine.control_socket == default_control_socket(8123)
