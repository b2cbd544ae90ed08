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
    """The engine flags (bastion.factory.add_engine_arguments) plus the server's own.

    Defaults from the environment stay strings so argparse converts them with the flag's
    type: a bad value is a clean usage error of `bastion serve`, not a crash of every command.
    """
    from bastion.settings import add_engine_arguments, env_default as _env

    add_engine_arguments(p)
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=_env("PORT", "8000"), help="TCP port (default 8000)")
    p.add_argument("--api-key", default=_env("API_KEY", None),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    p.add_argument("--max-queue", type=int, default=_env("MAX_QUEUE", "64"),
                   help="requests allowed to wait; more get HTTP 429 (default 64)")
    p.add_argument("--max-running", type=int, default=_env("MAX_RUNNING", "1"),
                   help="sequences decoded at once, interleaved step by step (default 1)")
    p.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME", None),
                   help="model id clients send (default: the target's name)")
    p.add_argument("--max-body-bytes", type=int, default=_env("MAX_BODY_BYTES", str(4 * 1024 * 1024)),
                   help="largest request body in bytes; more get HTTP 413 (default 4 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=_env("SHUTDOWN_TIMEOUT", "30"),
                   help="seconds running requests may take to finish on SIGTERM (default 30)")


def run(args) -> int:
    """Serve until SIGTERM/SIGINT; returns 0 after a graceful shutdown, 1 if the model failed to load.

    Raises ValueError (via the CLI: exit 2) for invalid numeric settings.
    """
    import uvicorn

    from bastion.factory import build_engine
    from bastion.settings import settings_from_args
    from server.app import ServerConfig, create_app

    if not (0 < args.port < 65536):
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue < 0 or args.max_running < 1 or args.max_body_bytes < 1:
        raise ValueError("--max-queue must be >= 0, --max-running and --max-body-bytes >= 1")
    settings = settings_from_args(args)
    config = ServerConfig(served_model_name=args.served_model_name, api_key=args.api_key or None,
                          max_queue=args.max_queue, max_running=args.max_running,
                          max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout)
    app = create_app(lambda: build_engine(settings), config)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="on",
    ))
    scheduler = app.state.scheduler

    def on_load_error(err: BaseException) -> None:
        server.should_exit = True

    # Printed, not logged: the default log level hides INFO, and users wait for this line.
    scheduler.on_ready = lambda: print(f"bastion: ready on http://{args.host}:{args.port}/v1 (health: /health)",
                                       file=sys.stderr, flush=True)
    scheduler.on_load_error = on_load_error
    # uvicorn re-raises the captured signal after its graceful shutdown, which would turn a clean
    # exit into "killed by SIGTERM"; handlers installed here absorb that re-raise.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if scheduler.load_error is not None:
        log.error("the model failed to load: %s", scheduler.load_error)
        return 1
    return 0
