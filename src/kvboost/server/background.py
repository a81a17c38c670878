"""Run an app with uvicorn on a loopback port in a background thread (tests, benchmarks, notebooks)."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn


class BackgroundServer:
    """`with BackgroundServer(app) as srv:` serves on srv.base_url (a free loopback port) until the block ends;
    warm_up: run kvboost.server.app.warm_up first, as `kvboost serve` does."""

    def __init__(self, app, warm_up: bool = False):
        self.app, self.warm_up, self.base_url = app, warm_up, ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BackgroundServer:
        if self.warm_up:
            from .app import warm_up

            warm_up(self.app)
        sock = bind_socket("127.0.0.1", 0)
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on",
                                                     timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="kvboost-uvicorn",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"server on {self.base_url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(30.0)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one, read it back with getsockname)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    # (create_server would make an IPv6 socket v6-only; Linux's default, dual-stack, is kept)
    dual = family == socket.AF_INET6 and socket.has_dualstack_ipv6()
    sock = socket.create_server(address, family=family, backlog=2048, dualstack_ipv6=dual)
    sock.set_inheritable(True)
    return sock
