"""Run `workbench serve`: the engine worker plus the ASGI app under uvicorn.

    server = Server(model, tokenizer, ServeOptions(model_name="builtin:demo", trace_root=Path("traces/serve")),
                    AppConfig(model_id="builtin:demo", hosts=HostPolicy.for_server("127.0.0.1")),
                    host="127.0.0.1", port=8000)
    server.run()                      # blocks; Ctrl-C or SIGTERM stops it and closes every conversation's trace
    # or, in tests: server.start_in_thread(); ...; server.stop()

A stop signal (SIGINT, SIGTERM) ends the serving cleanly: the listener closes, the engine stops the
running request after its current prefill chunk or token (its client gets a 503, or its stream an
error event and its end), queued requests get a 503, every conversation's trace is closed, and
`run` returns, so the command exits 0. A second signal changes nothing (uvicorn's would cancel the
handlers mid-response: a 500 or a cut stream): the engine stops within one step and the wait for
open connections is bounded (`timeout_graceful_shutdown`). uvicorn's
own handling would re-raise the signal once it has stopped (a SIGTERM then kills the process before
the traces are closed), so the signals are caught here instead.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable, Iterator

import uvicorn

from apps.serve.app import AppConfig, create_app
from apps.serve.ranks import RankChannel
from apps.serve.worker import EngineWorker, ServeOptions
from engine.errors import InputError


class Server:
    """One model served over HTTP (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, options: ServeOptions, config: AppConfig, *,
                 host: str = "127.0.0.1", port: int = 8000, channel: RankChannel | None = None) -> None:
        self.worker = EngineWorker(model, tokenizer, options, channel)
        self.app = create_app(self.worker, config)
        self.host = host
        self.socket = _bind(host, port)
        self.port = self.socket.getsockname()[1]
        self._uvicorn = _Uvicorn(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                timeout_graceful_shutdown=10, lifespan="off"),
                                 on_exit=self.worker.begin_shutdown)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def run(self) -> None:
        """Serve until SIGINT or SIGTERM; then stop the running request and close every trace."""
        self.worker.start()
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            if not self.worker.stop():
                # the engine thread is inside a step that never ended: leaving the interpreter under it aborts
                print("the engine did not stop in time; the traces still open stay 'recording'", file=sys.stderr)
                sys.stderr.flush()
                os._exit(1)

    def start_in_thread(self, timeout: float = 30.0) -> None:
        self.worker.start()
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self.socket]},
                                        name="k3wb-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        """What a stop signal does (see the module docstring), for a server started in a thread."""
        self.worker.begin_shutdown()
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.worker.stop()
        self.socket.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, told when a stop begins (`on_exit`, from the signal handler), never forced by a
    second signal and never re-raising the signal it stopped for."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # only the main thread receives signals (tests run the server in a thread)
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now, so a port in use is one clear error before anything else runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise InputError(f"port {port} on {host} is already in use; choose another with --port") from None
        raise InputError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock
