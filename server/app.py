"""The FastAPI application: routes, lifespan, API-key check, body limit and the one error handler.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (API key required
when one is configured), GET /health (200 once the model is ready, else 503), GET /metrics
(Prometheus text format). Every error, whatever raised it, leaves through `error_handler`
as the OpenAI envelope {"error": {"message", "type", "param", "code"}}; bodies never carry
a stack trace.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from controller.metrics import REGISTRY
from engine.engine import Engine
from server.metrics import server_metrics
from server.protocol import APIError
from server.scheduler import Scheduler
from server.serving import OpenAIServing

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """Server settings (each is a `bastion serve` flag).

    served_model_name: id clients send as `model` (None: the target's name).
    api_key: required bearer token for /v1/* (None: no authentication).
    max_queue: requests allowed to wait (more get HTTP 429). max_running: sequences decoded
    at once (interleaved step by step). max_body_bytes: largest request body (more get 413).
    shutdown_timeout: seconds running requests may take to finish on shutdown before being cancelled.
    """

    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int = 64
    max_running: int = 1
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout: float = 30.0


def create_app(engine_factory: Callable[[], Engine], config: ServerConfig | None = None,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """Build the app. `engine_factory` runs on the engine worker thread when the app starts,
    so /health answers 503 while the model loads. registry: Prometheus registry
    (default: the controller's REGISTRY, shared with the controller's metrics)."""
    config = config or ServerConfig()
    registry = REGISTRY if registry is None else registry
    metrics = server_metrics(registry)
    scheduler = Scheduler(engine_factory, max_queue=config.max_queue, max_running=config.max_running,
                          metrics=metrics)
    serving = OpenAIServing(scheduler, config.served_model_name)

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

    async def error_handler(request: Request, exc: Exception) -> JSONResponse:
        err = to_api_error(exc)
        metrics.http_errors.labels(status=str(err.status)).inc()
        return JSONResponse(err.envelope(), status_code=err.status, headers=err.headers)

    for exc_type in (APIError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, error_handler)

    async def require_api_key(request: Request) -> None:
        """Raises APIError(401) unless `Authorization: Bearer <api_key>` matches (when a key is set)."""
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if scheduler.ready.is_set():
            return {"status": "ok"}
        if scheduler.load_error is not None:
            what = "the model failed to load" if scheduler.engine is None else "the engine worker stopped"
            raise APIError(503, f"{what}: {scheduler.load_error}", type="server_error", code="engine_failed")
        raise APIError(503, "the model is still loading", type="server_error", code="model_not_ready",
                       headers={"Retry-After": "5"})

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

    @v1.get("/models")
    async def list_models():
        return serving.models().model_dump()

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat(await read_body(request, config.max_body_bytes), request)

    @v1.post("/completions")
    async def completions(request: Request):
        return await serving.completion(await read_body(request, config.max_body_bytes), request)

    app.include_router(v1)
    return app


def to_api_error(exc: Exception) -> APIError:
    """Map any exception to the APIError sent to the client (unexpected ones become a bare 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return APIError(400, "invalid request", code="invalid_value")
    if isinstance(exc, StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {}))
    log.error("unhandled error", exc_info=exc)
    return APIError(500, "internal server error", type="server_error", code="internal_error")


#: How much of an oversized body is read and discarded before the connection is given up.
DRAIN_BYTES = 64 * 1024 * 1024


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes.

    Raises APIError(413) for a larger body (declared or actual). The excess is read and
    discarded (up to DRAIN_BYTES or 8x the limit) so the client can read the answer on a sane connection.
    """
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    buf = bytearray()
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if not too_big:
            buf += chunk
            too_big = seen > limit
        if seen > max(8 * limit, DRAIN_BYTES):
            break
    if too_big:
        raise APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    return bytes(buf)
