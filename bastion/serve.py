"""`bastion serve`: run the OpenAI-compatible server with uvicorn.

Every flag also reads an environment variable BASTION_<FLAG> (for example BASTION_PORT,
BASTION_API_KEY); a flag on the command line wins. The model loads on the engine worker
thread after the socket is bound, so GET /health answers 503 until it is ready.
SIGTERM or Ctrl-C: stop accepting, let running requests finish for --shutdown-timeout
seconds, cancel the rest, exit 0.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The engine flags (bastion.settings.add_engine_arguments) plus the server's own.

    Defaults from the environment stay strings so argparse converts them with the flag's
    type: a bad value is a clean usage error of `bastion serve`, not a crash of every command.
    """
    from bastion.settings import add_engine_arguments, env_default as _env

    add_engine_arguments(p)
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=_env("PORT", "8000"), help="TCP port (default 8000)")
    p.add_argument("--api-key", default=_env("API_KEY", None),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: no key; an "
                        "empty key is refused)")
    p.add_argument("--metrics-key", default=_env("METRICS_KEY", None),
                   help="bearer token for /metrics instead of the API key (default: the API key guards it)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   default=_env("ALLOW_UNAUTHENTICATED", "") in ("1", "true", "yes"),
                   help="allow binding a non-loopback address without --api-key (default: refused)")
    p.add_argument("--allowed-host", action="append", default=[h for h in (_env("ALLOWED_HOSTS", "") or "").split(",")
                                                                  if h.strip()],
                   help="host name accepted in Host / Origin headers besides loopback (repeatable)")
    p.add_argument("--max-queue", type=int, default=_env("MAX_QUEUE", "64"),
                   help="requests allowed to wait beyond --max-running; more get HTTP 429 (default 64)")
    p.add_argument("--max-running", type=int, default=_env("MAX_RUNNING", "8"),
                   help="sequences decoded together; each step verifies all their trees in one forward, sized "
                        "by one global budget (default 8)")
    p.add_argument("--prefill-chunk", type=int, default=_env("PREFILL_CHUNK", "256"),
                   help="prompt tokens prefilled between two decoding steps, so a long prompt does not stall "
                        "the running requests (default 256)")
    p.add_argument("--max-connections", type=int, default=_env("MAX_CONNECTIONS", "256"),
                   help="open connections allowed; more get HTTP 503 from uvicorn (default 256)")
    p.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME", None),
                   help="model id clients send (default: the target's name)")
    p.add_argument("--max-body-bytes", type=int, default=_env("MAX_BODY_BYTES", str(4 * 1024 * 1024)),
                   help="largest request body in bytes; more get HTTP 413 (default 4 MiB)")
    p.add_argument("--body-timeout", type=float, default=_env("BODY_TIMEOUT", "30"),
                   help="seconds a client may take to send its request body; slower gets HTTP 408 (default 30)")
    p.add_argument("--stall-timeout", type=float, default=_env("STALL_TIMEOUT", "30"),
                   help="seconds a client may leave generated text unread before its request is cancelled "
                        "(default 30)")
    p.add_argument("--max-tokens-limit", type=int, default=_env("MAX_TOKENS_LIMIT", None),
                   help="the most tokens one request may generate (default: the rest of the context)")
    p.add_argument("--shutdown-timeout", type=float, default=_env("SHUTDOWN_TIMEOUT", "30"),
                   help="seconds running requests may take to finish on SIGTERM (default 30)")


def server_config(args):
    """ServerConfig from the parsed flags. Raises ValueError for an empty key, bad numbers, or a
    non-loopback bind address without a key (unless --allow-unauthenticated)."""
    from server.app import ServerConfig, is_loopback_host

    if not (0 < args.port < 65536):
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")
    loopback = is_loopback_host(args.host)
    if args.api_key is None and not loopback and not args.allow_unauthenticated:
        raise ValueError(f"refusing to serve {args.host} without an API key: anyone who can reach it could use "
                         "it; pass --api-key KEY (BASTION_API_KEY), or --allow-unauthenticated "
                         "(BASTION_ALLOW_UNAUTHENTICATED=1) if the network is private")
    return ServerConfig(served_model_name=args.served_model_name, api_key=args.api_key,
                        metrics_key=args.metrics_key, max_queue=args.max_queue, max_running=args.max_running,
                        prefill_chunk=args.prefill_chunk,
                        max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                        stall_timeout=args.stall_timeout, shutdown_timeout=args.shutdown_timeout,
                        max_tokens_limit=args.max_tokens_limit,
                        loopback_only=loopback, allowed_hosts=tuple(args.allowed_host))


def run(args) -> int:
    """Serve until SIGTERM/SIGINT; returns 0 after a graceful shutdown, 1 if the model failed to load.

    Shutdown: the first signal stops admission (new requests and /health get 503), lets running
    requests finish for --shutdown-timeout seconds, cancels the rest (streams get their final
    'cancelled' frame while still connected), then stops uvicorn. Raises ValueError (via the
    CLI: exit 2) for invalid settings.
    """
    import threading

    import uvicorn

    from bastion.factory import build_engine
    from bastion.settings import settings_from_args
    from server.app import create_app

    config = server_config(args)
    settings = settings_from_args(args)
    app = create_app(lambda: build_engine(settings, max_batch=config.max_running), config)
    scheduler = app.state.scheduler

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, draining the scheduler before uvicorn closes connections."""

        draining: threading.Thread | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.draining is None and scheduler.ready.is_set():
                def drain() -> None:
                    scheduler.shutdown(args.shutdown_timeout)
                    self.should_exit = True

                self.draining = threading.Thread(target=drain, name="bastion-drain", daemon=True)
                self.draining.start()
            else:  # still loading (nothing to drain), or a second signal: stop now
                super().handle_exit(sig, frame)

    server = DrainingServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5,
        limit_concurrency=args.max_connections, lifespan="on",
    ))

    def on_load_error(err: BaseException) -> None:
        server.should_exit = True

    # Printed, not logged: the default log level hides INFO, and users wait for this line.
    def on_ready() -> None:
        info = scheduler.model_info
        dtype = f"{info.dtype}; " if info is not None else ""
        print(f"bastion: ready on http://{args.host}:{args.port}/v1 ({dtype}health: /health)", file=sys.stderr,
              flush=True)

    scheduler.on_ready = on_ready
    scheduler.on_load_error = on_load_error
    # uvicorn re-raises the captured signal after its graceful shutdown, which would turn a clean
    # exit into "killed by SIGTERM"; handlers installed here absorb that re-raise.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if scheduler.load_error is not None and not scheduler.worker_failed:
        log.error("the model failed to load: %s", scheduler.load_error)
        return 1
    return 0
