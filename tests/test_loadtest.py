"""The soak and fault test, CI-sized: concurrent, cancelled and bad requests against the real app."""
from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from bastion.loadtest import rss_mb
from bench.loadtest import run_loadtest
from engine.engine import Engine, make_controller
from server.app import ServerConfig, create_app
from server.local import LocalServer


@pytest.mark.slow
def test_soak_no_5xx_no_lost_answers_no_leaked_slots(target_f32):
    engine = Engine(target_f32, None, make_controller("ar"))
    registry = CollectorRegistry()
    app = create_app(lambda: engine, ServerConfig(max_running=4, max_queue=64, loopback_only=True), registry)
    errors: list[logging.LogRecord] = []
    catcher = logging.Handler(logging.ERROR)
    catcher.emit = errors.append  # type: ignore[method-assign]
    names = ("uvicorn.error", "server.app", "server.scheduler")
    sched = app.state.scheduler
    with LocalServer(app) as srv:
        for name in names:  # after uvicorn has configured its loggers
            logging.getLogger(name).addHandler(catcher)
        try:
            rep = run_loadtest(srv.url, requests=120, clients=16, seed=1, rss=rss_mb, rss_every=20,
                               slots=lambda: (sched.num_running, sched.num_waiting))
        finally:
            for name in names:
                logging.getLogger(name).removeHandler(catcher)
    assert not errors, [r.getMessage() for r in errors][:3]  # no "Exception in ASGI application", no tracebacks
    assert rep.requests == 120 and rep.server_errors == 0, rep.summary()
    assert not rep.problems, rep.problems[:5]
    assert {"unary", "stream", "bad", "cancel_stream"} <= set(rep.by_kind)
    assert rep.status.get(200, 0) > 60
    assert registry.get_sample_value("bastion_http_errors_total", {"status": "500"}) is None
    growth = rep.rss_growth()
    assert growth is not None and growth < 0.05, rep.summary()
    with pytest.raises(ValueError):
        run_loadtest("http://example.com", requests=1)
