"""The FastAPI application: routes, lifespan, access checks, body limits and the one error handler.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /metrics
(Prometheus text format), GET /health (200 once the model is ready; 503 while loading,
after a failure and while draining; never any detail of the failure).

Access: with an API key every route but /health needs `Authorization: Bearer <key>`
(/metrics takes the metrics key instead when one is set). Without a key the server still
refuses what a web page could send it from a browser (the class of DNS-rebinding and
cross-site attacks on local servers): requests whose Origin is not this server or a
loopback address, a Host header that is not a loopback name when bound to loopback, and
POST bodies that are not `application/json` (a page can send text/plain without a CORS
preflight). Every error, whatever raised it, leaves through `error_handler` as the OpenAI
envelope {"error": {"message", "type", "param", "code"}}; bodies never carry a stack trace.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from controller.metrics import REGISTRY
from engine.engine import Engine
from server.metrics import server_metrics
from server.protocol import APIError
from server.scheduler import DEFAULT_MAX_RUNNING, DEFAULT_PREFILL_CHUNK, Scheduler
from server.serving import OpenAIServing

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """Server settings (each is a `bastion serve` flag).

    served_model_name: id clients send as `model` (None: the target's name).
    api_key: bearer token required on every route but /health (None: no key; "" is refused).
    metrics_key: bearer token for /metrics instead of api_key (None: api_key guards it).
    max_queue: requests allowed to wait beyond max_running (more get HTTP 429). max_running:
    sequences decoded at once. prefill_chunk: prompt tokens prefilled between two batched
    steps (server.scheduler.Scheduler). max_body_bytes: largest request body (more get 413).
    body_timeout: seconds a client may take to send its body (slower: 408).
    stall_timeout: seconds a client may leave generated text unread before its request is cancelled.
    max_tokens_limit: the most tokens one request may generate (None: the rest of the context).
    shutdown_timeout: seconds running requests may take to finish on shutdown before being cancelled.
    loopback_only: the server is bound to a loopback address, so without a key a Host header
    that is not a loopback name (DNS rebinding) is refused (`bastion serve` sets it).
    allowed_hosts: extra Host / Origin names accepted besides loopback (e.g. the name the
    server is reached by behind a proxy).
    Raises ValueError for an empty key or bad numbers.
    """

    served_model_name: str | None = None
    api_key: str | None = None
    metrics_key: str | None = None
    max_queue: int = 64
    max_running: int = DEFAULT_MAX_RUNNING
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 30.0
    stall_timeout: float = 30.0
    max_tokens_limit: int | None = None
    shutdown_timeout: float = 30.0
    loopback_only: bool = False
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("api_key", "metrics_key"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"an empty {name.replace('_', ' ')} is refused: unset it to run without one")
        if self.max_queue < 0 or self.max_running < 1 or self.max_body_bytes < 1 or self.prefill_chunk < 1:
            raise ValueError("need max_queue >= 0, max_running >= 1, prefill_chunk >= 1 and max_body_bytes >= 1")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError("max_tokens_limit must be >= 1")
        if self.body_timeout <= 0 or self.stall_timeout <= 0 or self.shutdown_timeout < 0:
            raise ValueError("body, stall and shutdown timeouts must be positive")


def _host_name(host: str) -> str:
    """The name in a Host header or address, lower-cased, without brackets or port."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.split(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_host(host: str) -> bool:
    """'localhost' (and *.localhost) or a loopback IP address; brackets and a port are allowed."""
    name = _host_name(host)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def create_app(engine_factory: Callable[[], Engine], config: ServerConfig | None = None,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """Build the app. `engine_factory` runs on the engine worker thread when the app starts,
    so /health answers 503 while the model loads. registry: Prometheus registry
    (default: the controller's REGISTRY, shared with the controller's metrics)."""
    config = config or ServerConfig()
    registry = REGISTRY if registry is None else registry
    metrics = server_metrics(registry)
    scheduler = Scheduler(engine_factory, max_queue=config.max_queue, max_running=config.max_running,
                          metrics=metrics, stall_timeout=config.stall_timeout, prefill_chunk=config.prefill_chunk)
    serving = OpenAIServing(scheduler, config.served_model_name, config.max_tokens_limit)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        metrics.ready.set(0)
        scheduler.start()
        try:
            yield
        finally:
            # uvicorn has already waited (its graceful timeout) for open connections; cancel the rest.
            await asyncio.to_thread(scheduler.shutdown, 1.0)
            serving.close()

    app = FastAPI(title="bastion", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.scheduler = scheduler
    app.state.serving = serving
    app.state.metrics = metrics

    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.envelope(), status_code=err.status, headers=err.headers)

    async def error_handler(request: Request, exc: Exception) -> JSONResponse:
        err = to_api_error(exc)
        metrics.http_errors.labels(status=str(err.status)).inc()
        return error_response(err)

    for exc_type in (APIError, RequestValidationError, StarletteHTTPException, ClientDisconnect, Exception):
        app.add_exception_handler(exc_type, error_handler)

    allowed = {h.lower() for h in config.allowed_hosts}

    def _host_ok(host: str) -> bool:
        return is_loopback_host(host) or _host_name(host) in allowed

    def _origin_ok(netloc: str, host: str) -> bool:
        return _host_ok(netloc) or netloc.lower() == host.lower()

    async def refuse_cross_site(request: Request) -> None:
        """Without a key, refuse what only a browser page on another site would send (module docstring)."""
        if config.api_key is None:
            err = _cross_site_error(request, _host_ok if config.loopback_only else None, _origin_ok)
            if err is not None:
                raise err

    def _check_bearer(request: Request, key: str | None) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    async def require_api_key(request: Request) -> None:
        """Raises APIError(401) unless `Authorization: Bearer <api_key>` matches (when a key is set)."""
        _check_bearer(request, config.api_key)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD for load balancers' health checks
    async def health():
        # A 503 here is the probe's answer, not a failed request: it is returned, not raised, so
        # start-up and drain polls stay out of bastion_http_errors_total.
        if scheduler.draining:
            return error_response(APIError(503, "the server is shutting down", type="server_error",
                                           code="shutting_down", headers={"Retry-After": "5"}))
        if scheduler.ready.is_set():
            return {"status": "ok"}
        if scheduler.load_error is not None:
            what = "the engine worker stopped" if scheduler.worker_failed else "the model failed to load"
            return error_response(APIError(503, f"{what}; see the server log", type="server_error",
                                           code="engine_failed"))
        return error_response(APIError(503, "the model is still loading", type="server_error",
                                       code="model_not_ready", headers={"Retry-After": "5"}))

    @app.get("/metrics", dependencies=[Depends(refuse_cross_site)])
    async def prometheus_metrics(request: Request):
        _check_bearer(request, config.metrics_key if config.metrics_key is not None else config.api_key)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(refuse_cross_site), Depends(require_api_key)])

    @v1.get("/models")
    async def list_models():
        return serving.models().model_dump()

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat(await read_body(request, config.max_body_bytes, config.body_timeout), request)

    @v1.post("/completions")
    async def completions(request: Request):
        return await serving.completion(await read_body(request, config.max_body_bytes, config.body_timeout),
                                        request)

    app.include_router(v1)
    return app


def _cross_site_error(request: Request, host_ok: Callable[[str], bool] | None,
                      origin_ok: Callable[[str, str], bool]) -> APIError | None:
    """The 403 / 415 a keyless server answers to a request a foreign web page could have made.

    host_ok: None skips the Host check (a server bound beyond loopback is reached by any name).
    """
    host = request.headers.get("host", "")
    if host_ok is not None and not host_ok(host):
        return APIError(403, f"requests for host '{_host_name(host)}' are refused without an API key (start the "
                        "server with --api-key, or name the host with --allowed-host)", type="permission_error",
                        code="host_not_allowed")
    origin = request.headers.get("origin")
    if origin is not None and origin != "null":
        netloc = urlsplit(origin).netloc
        if not origin_ok(netloc, host):
            return APIError(403, "cross-origin requests are refused without an API key", type="permission_error",
                            code="origin_not_allowed")
    elif origin == "null" or request.headers.get("sec-fetch-site") == "cross-site":
        return APIError(403, "cross-site requests are refused without an API key", type="permission_error",
                        code="origin_not_allowed")
    if request.method == "POST":
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            return APIError(415, "request bodies must be sent as 'Content-Type: application/json'",
                            code="unsupported_media_type")
    return None


def to_api_error(exc: Exception) -> APIError:
    """Map any exception to the APIError sent to the client (unexpected ones become a bare 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return APIError(400, "invalid request", code="invalid_value")
    if isinstance(exc, ClientDisconnect):  # the client went away while sending its body
        return APIError(499, "client disconnected while sending the request", code="client_disconnected")
    if isinstance(exc, StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {}))
    log.error("unhandled error", exc_info=exc)
    return APIError(500, "internal server error", type="server_error", code="internal_error")


#: An oversized body is read and discarded for at most this long (and this many bytes) before
#: the 413 goes out, so a client that sends fast can read the answer (closing on unread data
#: resets the connection) while a slow one still gets it within a second.
DRAIN_SECONDS = 1.0
DRAIN_BYTES = 64 * 1024 * 1024


async def read_body(request: Request, limit: int, timeout: float = 30.0) -> bytes:
    """The request body, at most `limit` bytes, read within `timeout` seconds.

    Raises APIError(413) for a body over the limit, declared (Content-Length) or actual,
    after discarding what arrives within DRAIN_SECONDS; APIError(408) when the body takes
    longer than `timeout`; a ClientDisconnect (answered 499) when the client leaves mid-body.
    """
    declared = request.headers.get("content-length", "")
    too_big = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    buf = bytearray()
    over = declared.isdigit() and int(declared) > limit

    async def read() -> None:
        nonlocal over
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if not over:
                buf.extend(chunk)
                over = len(buf) > limit
            if over and seen > DRAIN_BYTES:
                return

    try:
        await asyncio.wait_for(read(), DRAIN_SECONDS if over else timeout)
    except asyncio.TimeoutError:
        if over:
            raise too_big from None
        raise APIError(408, f"the request body was not received within {timeout:g} s",
                       code="request_timeout") from None
    if over:
        raise too_big
    return bytes(buf)
