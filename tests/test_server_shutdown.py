"""`bastion serve` as a real process: env-var flags, readiness, and SIGTERM graceful shutdown (exit 0)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bastion_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "bastion"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("bastion")
    return [found] if found else [sys.executable, "-m", "bastion.cli"]


def stream_chat(url: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    """Stream one chat completion; record the payloads, whether [DONE] came, and any transport error."""
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    out["payloads"] = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["payloads"].append(line[6:])
                    if len(out["payloads"]) >= 2:
                        started.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    finally:
        started.set()


@pytest.mark.slow
def test_sigterm_finishes_short_requests_cancels_long_ones_and_exits_0(tmp_path):
    port = free_port()
    env = {**os.environ, "BASTION_PORT": str(port), "BASTION_MODE": "ar", "BASTION_MAX_RUNNING": "2",
           "BASTION_SHUTDOWN_TIMEOUT": "6", "BASTION_SERVED_MODEL_NAME": "tiny",
           "BASTION_THREADS": "1"}  # 2 OpenMP threads on 2 busy shared cores run ~30x slower
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(bastion_cmd() + ["serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                r = httpx.get(f"{url}/health", timeout=2)
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.1)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]  # BASTION_SERVED_MODEL_NAME applied

        short, long_ = {}, {}
        s_started, l_started = threading.Event(), threading.Event()
        t_long = threading.Thread(target=stream_chat, args=(url, 4000, long_, l_started))
        t_short = threading.Thread(target=stream_chat, args=(url, 6, short, s_started))
        t_long.start()
        assert l_started.wait(60)
        t_short.start()
        assert s_started.wait(60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # Draining: no new work, and /health says so (so a load balancer stops sending).
        health = httpx.get(f"{url}/health", timeout=5)
        refused = httpx.post(f"{url}/v1/chat/completions", timeout=5,
                             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        rc = proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        t_short.join(30)
        t_long.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert rc == 0, text[-3000:]
    assert elapsed < 30, elapsed
    # The short request, already running, finished normally.
    assert short.get("status") == 200 and short["payloads"][-1] == "[DONE]", (short, text[-2000:])
    finish = [json.loads(p)["choices"][0]["finish_reason"] for p in short["payloads"][:-1]
              if json.loads(p).get("choices")]
    assert finish[-1] in ("length", "stop")
    assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
    assert refused.status_code == 503 and refused.headers.get("retry-after")
    # The long one was cut at the shutdown timeout, far from its 4000 tokens: its last frame says
    # so (while the connection was still open), and it never saw [DONE].
    assert "[DONE]" not in long_["payloads"]
    assert len(long_["payloads"]) < 4000
    assert json.loads(long_["payloads"][-1])["error"]["code"] == "cancelled", long_["payloads"][-3:]
    # Nothing listens any more.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)
