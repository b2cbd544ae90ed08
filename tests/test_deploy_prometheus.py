"""The Grafana dashboard's queries against a real Prometheus scraping a real server.

Starts the server on the embedded default target (uvicorn on 127.0.0.1, in this process) and
Debian's `prometheus` binary with docker/prometheus/prometheus.yml, its discovery rewritten to
that server and its interval to 1 s; sends a few requests, then asks Prometheus' HTTP API for
every PromQL expression of docker/grafana/dashboards/*.json (Grafana variables substituted)
and requires each to be valid and to return at least one finite sample.

The server runs in mode bastion so every panel has data: the adaptive controller publishes
the latency model (parameters, fit error, latency table, predicted vs measured verify time),
and a suffix drafter gets real acceptances on prompts that ask to repeat their own text (a
random DFlash drafter accepts nothing, leaving the per-depth counters empty). Its latency
model comes from a small, quick calibration grid instead of the full CPU grid.
Skipped, with the reason, where the prometheus binary is absent (.ci/run installs it).
"""
from __future__ import annotations

import math
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import httpx
import pytest
import yaml

from test_deploy_config import PROMETHEUS_CONFIG, dashboard_expressions, load_dashboards

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed: "
                       "apt-get install prometheus (as .ci/run does) to run the Prometheus integration test"),
]

#: (prompt, stream). The first and third ask to repeat their own text, which the suffix drafter predicts.
PROMPTS = [
    ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.", False),
    ("Count from 1 to 10.", True),
    ("Repeat exactly: one two three four five six seven eight nine ten.", True),
    ("What is the capital of France?", False),
]
MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def speculative_engine(target, registry):
    """Engine in mode bastion: suffix drafter, adaptive controller on `registry`, quick calibration."""
    from controller.calibration import CalibrationGrid, calibrate
    from controller.budget import BudgetController
    from controller.gate import SpeculationGate
    from drafting.suffix import SuffixDrafter
    from engine.engine import Engine
    from engine.timing import verify_timer

    drafter = SuffixDrafter()
    with tempfile.TemporaryDirectory() as cache:
        result = calibrate(verify_timer(target.model, drafter.feature_layers), target.config, target.dtype,
                           CalibrationGrid((1, 4, 16, 64), (32, 128)), model_name=f"{target.name}-deploy-test",
                           cache_dir=cache, warmup=1, repeats=2, time_budget_s=3.0, progress=False)
    # table_every=4: the latency-table gauge appears after 4 steps rather than 16. The gate drafts
    # every step: which arm 16-token requests settle on is the gate's own test's business
    # (tests/test_controller_gate.py), the panels here need drafted steps.
    controller = BudgetController.from_calibration(result, None, "cpu", registry=registry,
                                                    max_depth=drafter.max_depth, table_every=4,
                                                    gate=SpeculationGate(arms=("draft",)))
    return Engine(target, drafter, controller)


@pytest.fixture(scope="module")
def server(target_f32):
    """A live server in mode bastion: yields (url, registry)."""
    import torch
    import uvicorn
    from prometheus_client import CollectorRegistry

    from server.app import ServerConfig, create_app

    # One torch thread, as BASTION_THREADS=1: two OpenMP threads on two busy shared cores crawl.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        registry = CollectorRegistry()
        engine = speculative_engine(target_f32, registry)
        app = create_app(lambda: engine, ServerConfig(served_model_name="smollm2", max_running=2), registry)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            wait_for(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 120, "the server")
            yield url, registry
        finally:
            uv.should_exit = True
            thread.join(timeout=30)
            sock.close()
    finally:
        torch.set_num_threads(threads)


def scrape_config_for(target: str) -> dict:
    """The project's Prometheus config with the bastion job pointed at `target`, every 1 s."""
    cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    jobs = [j for j in cfg["scrape_configs"] if j["job_name"] == "bastion"]
    assert jobs, "docker/prometheus/prometheus.yml has no bastion job"
    for job in jobs:
        for key in [k for k in job if k.endswith("_sd_configs") or k == "static_configs"]:
            del job[key]
        job.update(static_configs=[{"targets": [target]}], scrape_interval="1s", scrape_timeout="1s")
    cfg["scrape_configs"] = jobs
    return cfg


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """Debian's prometheus scraping the server: yields its base URL."""
    url, _ = server
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(scrape_config_for(url.removeprefix("http://"))))
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def ready():
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-3000:]
            return httpx.get(f"{base}/-/ready", timeout=2).status_code == 200
        wait_for(ready, 60, "prometheus to be ready")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(base: str, expr: str) -> list[dict]:
    """Instant query; asserts Prometheus accepted the expression. Returns data.result."""
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}\n-> {body.get('error', body)}"
    return body["data"]["result"]


def values(result: list[dict]) -> list[float]:
    return [float(s["value"][1]) for s in result]


def chat(url: str, prompt: str, stream: bool) -> int:
    """POST one chat completion; returns the HTTP status (200 expected)."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "stream": stream}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        r.read()
        return r.status_code


@pytest.fixture(scope="module")
def traffic(server, prometheus):
    """Requests (an error, a drafted one, three two at a time, an error), then waits until
    Prometheus holds the final counters."""
    url, registry = server
    # Prometheus' first scrape must come before the traffic, or the counters start at their final values.
    wait_for(lambda: values(query(prometheus, "bastion_model_ready")) == [1.0], 30, "the first scrape")
    assert httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}, timeout=10).status_code == 400
    assert chat(url, *PROMPTS[0]) == 200
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda a: statuses.append(chat(url, *a)), args=(a,)) for a in PROMPTS[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * len(PROMPTS[1:])
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=10).status_code == 400
    accepted = registry.get_sample_value("bastion_accepted_tokens_per_depth_total", {"depth": "1"})
    assert accepted, "the suffix drafter had no accepted token: the per-depth panel would be empty"
    final = {name: sum(s.value for m in registry.collect() for s in m.samples if s.name == name)
             for name in ("bastion_generation_tokens_total", "bastion_http_errors_total", "bastion_drafts_total")}

    def scraped_the_end():
        return all(values(query(prometheus, f"sum({name})")) == [want] for name, want in final.items())
    wait_for(scraped_the_end, 30, f"prometheus to scrape the final counters {final}", interval=0.5)
    time.sleep(2.5)  # a few more scrapes after the last change
    return prometheus


def test_every_dashboard_query_is_valid_and_returns_data(traffic):
    empty = []
    for where, expr in dashboard_expressions():
        result = query(traffic, expr)
        if not any(math.isfinite(v) for v in values(result)):
            empty.append(f"{where}: {expr} -> {result}")
    assert len(dashboard_expressions()) >= 30
    assert not empty, "queries without data (no sample, or only NaN):\n" + "\n".join(empty)


def test_template_variable_lists_the_scraped_server(traffic, server):
    url, _ = server
    for var in (v for d in load_dashboards() for v in d["templating"]["list"]):
        metric, label = (s.strip() for s in var["definition"].removeprefix("label_values(").rstrip(")").split(","))
        r = httpx.get(f"{traffic}/api/v1/label/{label}/values", params={"match[]": metric}, timeout=10).json()
        assert r["status"] == "success" and url.removeprefix("http://") in r["data"], (var["definition"], r)


def test_prometheus_sees_the_target_up(traffic):
    (up,) = query(traffic, 'up{job="bastion"}')
    assert up["value"][1] == "1"
