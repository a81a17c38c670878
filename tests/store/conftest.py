"""Fixtures for the storage-tier tests: synthetic records and a throwaway redis-server."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # _synth, whatever pytest's import mode

from _synth import free_port, make_record  # noqa: E402


@pytest.fixture
def record_factory():
    return make_record


class RedisServer:
    """A real redis-server on a loopback port, without persistence, that tests may stop, hang and restart."""

    def __init__(self, workdir: Path, extra_args: list[str]):
        self.binary = shutil.which("redis-server")
        self.port = free_port()
        self.workdir = workdir
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *extra: str) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--daemonize", "no", "--logfile", "", *self.extra_args, *extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def client(self):
        import redis
        return redis.Redis.from_url(self.url, socket_timeout=2)


@pytest.fixture
def redis_server_factory(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found on PATH (apt-get install -y redis-server)")
    pytest.importorskip("redis", reason="redis-py not installed (pip install 'kvboost[redis]')")
    servers: list[RedisServer] = []

    def factory(*extra_args: str) -> RedisServer:
        server = RedisServer(tmp_path, list(extra_args))
        server.start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop()


@pytest.fixture
def redis_server(redis_server_factory) -> RedisServer:
    return redis_server_factory()


class ReadOnlyView:
    """`source` seen through `path`, which `make_read_only()` turns read-only for everyone, root included.

    With mount privileges (root in most CI containers) `path` is a bind mount remounted read-only: writes
    fail with a real EROFS. Without them it is a symlink and the disk tier's writability probe is patched
    (`emulated` is True), since chmod does not stop root; tests that need a real EROFS skip then.
    """

    def __init__(self, source: Path, path: Path, monkeypatch):
        self.source, self.path, self._monkeypatch = source, path, monkeypatch
        self._mounts: list[Path] = []
        source.mkdir(parents=True, exist_ok=True)
        path.mkdir()
        self.emulated = not self._bind(source, path)
        if self.emulated:
            path.rmdir()
            path.symlink_to(source, target_is_directory=True)

    def make_read_only(self, sub: str | None = None) -> None:
        """The whole view read-only; or only its subdirectory `sub` (a remount is refused while files are
        open for writing under it, so a live store's directory turns read-only from its chunk folder)."""
        if not self.emulated:
            target = self.path / sub if sub else self.path
            if sub:
                assert self._bind(target, target)
            assert _mount("-o", "remount,bind,ro", str(target)), "remount read-only failed"
            return
        import kvboost.store.disk as disk_mod
        real = disk_mod._writable
        self._monkeypatch.setattr(disk_mod, "_writable", lambda d: not str(d).startswith(str(self.path)) and real(d))

    def _bind(self, source: Path, target: Path) -> bool:
        if _mount("--bind", str(source), str(target)):
            self._mounts.append(target)
            return True
        return False

    def release(self) -> None:
        for target in reversed(self._mounts):
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


def _mount(*args: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def read_only_view(tmp_path, monkeypatch):
    views: list[ReadOnlyView] = []

    def factory(name: str = "cache") -> ReadOnlyView:
        view = ReadOnlyView(tmp_path / f"{name}-src", tmp_path / f"{name}-view", monkeypatch)
        views.append(view)
        return view

    yield factory
    for view in views:
        view.release()
