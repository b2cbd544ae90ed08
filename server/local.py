"""The app on a free loopback port, served by uvicorn in a background thread (tests, `bastion loadtest`)."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn


class LocalServer:
    """Context manager: serve `app` on 127.0.0.1 (a free port) until exit.

    Entering waits until GET /health answers 200 (the model is loaded), at most `ready_timeout`
    seconds; raises TimeoutError otherwise. `url` is the base URL.
    """

    def __init__(self, app, ready_timeout: float = 120.0, log_level: str = "warning"):
        self.app = app
        self.ready_timeout = ready_timeout
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LocalServer":
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.__exit__(None, None, None)
                raise TimeoutError(f"the server on {self.url} did not become ready")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
