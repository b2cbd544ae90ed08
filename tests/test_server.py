"""The server end to end: a real uvicorn on 127.0.0.1 (one per session) over the embedded target in AR mode.

References are the engine's own temperature-0 outputs, computed in-process while the
server is idle. Prompts are short and max_tokens small: the suite runs on 2 shared CPU cores.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from engine.engine import Engine
from engine.engine import make_controller as fixed_mode
from engine.sampling import SamplingParams
from server.app import ServerConfig, create_app
from server.local import LocalServer

KEY = "sk-test-key"
MODEL = "smollm2"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 10


class Live:
    """The running server: base URL, the app's scheduler and registry, the engine."""

    def __init__(self, url, app, engine, registry):
        self.url = url
        self.app = app
        self.engine = engine
        self.registry = registry
        self.scheduler = app.state.scheduler
        self._refs: dict = {}

    def ref(self, prompt: str, max_tokens: int = MAX_TOKENS, stop=None):
        """The engine's serial temperature-0 result for one user message (cached)."""
        key = (prompt, max_tokens, tuple(stop or ()))
        if key not in self._refs:
            ids = self.engine.chat_prompt_ids([{"role": "user", "content": prompt}])
            res = self.engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop or []))
            self._refs[key] = (ids, res)
        return self._refs[key]

    def metric(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.scheduler.num_running or self.scheduler.num_waiting:
            assert time.monotonic() < deadline, "server did not become idle"
            time.sleep(0.05)

    def finished(self, request_id: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            r = self.scheduler.find_finished(request_id)
            if r is not None:
                return r
            assert time.monotonic() < deadline, f"request {request_id} never finished"
            time.sleep(0.05)


@pytest.fixture(scope="session")
def live(target_f32):
    """One uvicorn server for the session, on a free port, API key required, 4 interleaved sequences."""
    engine = Engine(target_f32, None, fixed_mode("ar"))
    registry = CollectorRegistry()
    app = create_app(lambda: engine, ServerConfig(served_model_name=MODEL, api_key=KEY, max_queue=16,
                                                   max_running=4, max_body_bytes=1024 * 1024), registry)
    with LocalServer(app) as srv:
        yield Live(srv.url, app, engine, registry)


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def sse_frames(resp: httpx.Response) -> list[str]:
    """Raw SSE payloads after checking each frame is exactly 'data: <payload>\\n\\n'."""
    raw = resp.read().decode()
    assert raw.endswith("\n\n")
    frames = raw.split("\n\n")[:-1]
    out = []
    for f in frames:
        assert f.startswith("data: ") and "\n" not in f, f"bad frame {f!r}"
        out.append(f[len("data: "):])
    return out


def chat_body(prompt: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": MAX_TOKENS, **kw}


# ---- health, models -------------------------------------------------------------------------------
def test_health_and_models(live, client):
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == live.engine.max_context()


# ---- the official client ----------------------------------------------------------------------------
def test_openai_client_chat_stream_equals_nonstream_equals_engine(live, client):
    prompt = "Name a color."
    ids, ref = live.ref(prompt)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                         temperature=0, max_tokens=MAX_TOKENS)
    text = out.choices[0].message.content
    assert text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.completion_tokens == len(live.engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert out.usage.prompt_tokens == len(ids) and out.usage.total_tokens == len(ids) + len(ref.token_ids)
    stats = out.model_extra["bastion"]
    assert stats["steps"] == len(ref.steps) and stats["tau"] == 1.0 and stats["mean_tree_size"] == 1.0
    assert stats["draft_tokens"] == 0 and stats["accepted_tokens"] == 0

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_openai_client_text_completions(live, client):
    prompt = "The capital of France is"
    ids = live.engine.tokenizer(prompt)["input_ids"]
    ref = live.engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=6))
    out = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=6, stream=True) if c.choices)
    assert streamed == ref.text


def test_stop_string_never_leaks_into_the_stream(live):
    ids, ref = live.ref("Say hi")
    # Stop at a word in the middle of the known output: nothing from it on may be streamed.
    cut = ref.text.index(" ", 4)
    stop = ref.text[cut:cut + 6]
    body = chat_body("Say hi", stop=[stop, "zzzz"], stream=True)
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        payloads = [json.loads(p) for p in sse_frames(r) if p != "[DONE]"]
    deltas = [p["choices"][0]["delta"].get("content") or "" for p in payloads]
    assert "".join(deltas) == ref.text[:cut]
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any(stop[:k] in d for d in deltas for k in range(2, len(stop) + 1) if stop[:k].strip())


# ---- raw SSE ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("include_usage", [False, True])
def test_raw_sse_format(live, include_usage):
    ids, ref = live.ref("Name a color.")
    body = chat_body("Name a color.", stream=True)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_frames(r)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    ids_seen = {c["id"] for c in chunks}
    assert len(ids_seen) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in with_choices[1:])
    finishes = [c["choices"][0]["finish_reason"] for c in with_choices]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] == ref.finish_reason
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in with_choices) == ref.text
    assert with_choices[-1]["bastion"]["steps"] == len(ref.steps)
    usage_chunks = [c for c in chunks if not c["choices"]]
    if include_usage:
        assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
        assert usage_chunks[0]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(ref.token_ids),
                                            "total_tokens": len(ids) + len(ref.token_ids)}
        assert all(c["usage"] is None for c in with_choices)
    else:
        assert usage_chunks == [] and all("usage" not in c for c in chunks)


# ---- bad inputs -----------------------------------------------------------------------------------------
M = [{"role": "user", "content": "hi"}]
C = "/v1/chat/completions"
BAD = [
    # (name, path, body (dict | bytes), extra headers, status, expected param prefix or None, words in message)
    ("non-JSON body", C, b"this is not json", {}, 400, None, "JSON"),
    ("JSON array body", C, b"[1, 2, 3]", {}, 400, None, "object"),
    ("missing messages", C, {"model": MODEL}, {}, 400, "messages", "required"),
    ("empty messages", C, {"messages": []}, {}, 400, "messages", "at least 1"),
    ("messages is a string", C, {"messages": "hi"}, {}, 400, "messages", ""),
    ("unknown role", C, {"messages": [{"role": "wizard", "content": "x"}]}, {}, 400, "messages[0].role", ""),
    ("tool role", C, {"messages": [{"role": "tool", "content": "x"}]}, {}, 400, "messages[0].role", ""),
    ("content is a number", C, {"messages": [{"role": "user", "content": 5}]}, {}, 400, "messages[0].content", ""),
    ("user message without content", C, {"messages": [{"role": "user"}]}, {}, 400, "messages[0]", "content"),
    ("image part", C, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     {}, 400, "messages[0].content", ""),
    ("negative max_tokens", C, {"messages": M, "max_tokens": -1}, {}, 400, "max_tokens", ""),
    ("zero max_tokens", C, {"messages": M, "max_tokens": 0}, {}, 400, "max_tokens", ""),
    ("max_tokens as string", C, {"messages": M, "max_tokens": "10"}, {}, 400, "max_tokens", "integer"),
    ("huge max_tokens", C, {"messages": M, "max_tokens": 10**9}, {}, 400, "max_tokens", "context length"),
    ("fractional max_completion_tokens", C, {"messages": M, "max_completion_tokens": 1.5}, {}, 400,
     "max_completion_tokens", ""),
    ("temperature too high", C, {"messages": M, "temperature": 3.0}, {}, 400, "temperature", ""),
    ("negative temperature", C, {"messages": M, "temperature": -0.5}, {}, 400, "temperature", ""),
    ("temperature as string", C, {"messages": M, "temperature": "hot"}, {}, 400, "temperature", ""),
    ("temperature NaN", C, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', {}, 400,
     None, ""),
    ("top_p zero", C, {"messages": M, "top_p": 0}, {}, 400, "top_p", ""),
    ("top_p above one", C, {"messages": M, "top_p": 1.5}, {}, 400, "top_p", ""),
    ("top_k negative", C, {"messages": M, "top_k": -5}, {}, 400, "top_k", ""),
    ("n=3", C, {"messages": M, "n": 3}, {}, 400, "n", "n must be 1"),
    ("five stop strings", C, {"messages": M, "stop": ["a", "b", "c", "d", "e"]}, {}, 400, "stop", "at most 4"),
    ("stop is a number", C, {"messages": M, "stop": 5}, {}, 400, "stop", ""),
    ("empty stop string", C, {"messages": M, "stop": [""]}, {}, 400, "stop", "non-empty"),
    ("stream as string", C, {"messages": M, "stream": "yes"}, {}, 400, "stream", "boolean"),
    ("stream_options without stream", C, {"messages": M, "stream_options": {"include_usage": True}}, {}, 400,
     "stream_options", "stream_options"),
    ("logprobs", C, {"messages": M, "logprobs": True}, {}, 400, "logprobs", "not supported"),
    ("top_logprobs", C, {"messages": M, "top_logprobs": 2}, {}, 400, "top_logprobs", "not supported"),
    ("presence penalty", C, {"messages": M, "presence_penalty": 0.5}, {}, 400, "presence_penalty", "not supported"),
    ("tools", C, {"messages": M, "tools": [{"type": "function"}]}, {}, 400, "tools", "not supported"),
    ("seed as string", C, {"messages": M, "seed": "abc"}, {}, 400, "seed", ""),
    ("seed out of range", C, {"messages": M, "seed": 2**70}, {}, 400, "seed", ""),
    ("unknown model", C, {"model": "gpt-4", "messages": M}, {}, 404, "model", "gpt-4"),
    ("10 MB body", C, b'{"messages": [{"role": "user", "content": "' + b"a" * (10 * 1024 * 1024) + b'"}]}',
     {}, 413, None, "exceeds"),
    ("over-long prompt", C, {"messages": [{"role": "user", "content": "hello " * 9000}], "max_tokens": 4}, {},
     400, "messages", "context length"),
    ("missing API key", C, {"messages": M}, {"Authorization": ""}, 401, None, "API key"),
    ("wrong API key", C, {"messages": M}, {"Authorization": "Bearer sk-wrong"}, 401, None, "API key"),
    ("basic auth instead of bearer", C, {"messages": M}, {"Authorization": f"Basic {KEY}"}, 401, None, "API key"),
    ("models without key", "/v1/models", None, {"Authorization": ""}, 401, None, "API key"),
    ("completion without prompt", "/v1/completions", {"max_tokens": 2}, {}, 400, "prompt", "required"),
    ("completion empty prompt", "/v1/completions", {"prompt": ""}, {}, 400, "prompt", "empty"),
    ("completion echo", "/v1/completions", {"prompt": "a", "echo": True}, {}, 400, "echo", "not supported"),
    ("completion best_of", "/v1/completions", {"prompt": "a", "best_of": 2}, {}, 400, "best_of", ""),
    ("unknown route", "/v1/engines", {"x": 1}, {}, 404, None, ""),
    ("GET on a POST route", C, None, {}, 405, None, ""),
]


def test_bad_inputs_get_the_right_4xx_and_envelope_then_server_still_serves(live):
    assert len(BAD) >= 25
    errors_before = live.metric("bastion_http_errors_total", status="400")
    n400 = 0
    with httpx.Client(base_url=live.url, timeout=120) as http:
        for name, path, body, headers, status, param, words in BAD:
            hdrs = {**AUTH, **headers}
            hdrs = {k: v for k, v in hdrs.items() if v}
            if body is None:
                r = http.get(path, headers=hdrs)
            elif isinstance(body, bytes):
                r = http.post(path, content=body, headers={**hdrs, "Content-Type": "application/json"})
            else:
                r = http.post(path, json=body, headers=hdrs)
            assert r.status_code == status, (name, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert isinstance(err["message"], str) and err["message"], name
            assert words in err["message"], (name, err["message"])
            assert "Traceback" not in r.text and 'File "' not in r.text, name
            if param is not None:
                assert err["param"] is not None and err["param"].startswith(param), (name, err)
            if status == 401:
                assert err["type"] == "authentication_error"
            n400 += status == 400
    assert live.metric("bastion_http_errors_total", status="400") - errors_before == n400
    # Still serving correct answers (an unknown extra field is ignored, as OpenAI does).
    live.wait_idle()
    ids, ref = live.ref("Say hi")
    r = httpx.post(f"{live.url}{C}", json=chat_body("Say hi", some_future_field={"x": 1}), headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text


# ---- concurrency, cancellation, failures --------------------------------------------------------------------
PROMPTS = ["Say hi", "Name a color.", "What is 2+2?", "Name a fruit.", "Say bye", "Name an animal.",
           "Count to three.", "Name a country."]


def test_eight_concurrent_streams_equal_their_serial_outputs(live, client):
    refs = {p: live.ref(p, max_tokens=6)[1] for p in PROMPTS}  # serial, server idle
    results: dict[str, tuple[str, str | None, str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(PROMPTS))

    def one(prompt: str) -> None:
        try:
            start.wait()
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=6,
                stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            results[prompt] = (text, chunks[-1].choices[0].finish_reason, chunks[0].id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert set(results) == set(PROMPTS)
    for p in PROMPTS:
        assert results[p][0] == refs[p].text, p
        assert results[p][1] == refs[p].finish_reason, p
    # They really overlapped: the server interleaved several sequences.
    reqs = [live.finished(results[p][2]) for p in PROMPTS]
    overlapping = sum(1 for a in reqs for b in reqs if a is not b and a.started < b.started < a.finished)
    assert overlapping >= 1


def test_disconnect_cancels_within_one_step_and_next_request_is_served(live):
    live.wait_idle()
    cancelled_before = live.metric("bastion_requests_total", finish_reason="cancelled")
    body = chat_body("Tell me a long story about a dragon.", max_tokens=200, stream=True)
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{live.url}{C}", json=body, headers=AUTH) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            content_chunks = 0
            for line in lines:
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    content_chunks += 1
                    if content_chunks == 2:
                        break
        # leaving the block closes the connection mid-stream
    req = live.finished(first["id"])
    assert req.finish_reason == "cancelled"
    assert req.steps_after_cancel is not None and req.steps_after_cancel <= 1
    assert req.n_tokens < 50  # far from the 200 asked for
    assert live.metric("bastion_requests_total", finish_reason="cancelled") == cancelled_before + 1
    live.wait_idle()
    ids, ref = live.ref("Say hi")
    r = httpx.post(f"{live.url}{C}", json=chat_body("Say hi"), headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text


def test_full_queue_is_429_with_retry_after(live, monkeypatch):
    live.wait_idle()
    monkeypatch.setattr(live.scheduler, "max_running", 1)
    monkeypatch.setattr(live.scheduler, "max_queue", 1)
    # Hold the worker inside its first decode step so that A surely occupies the one slot (A could
    # otherwise reach EOS before B arrives on a fast machine).
    release = threading.Event()
    step_mixed = live.engine.step_mixed

    def held_step(seqs, prefills=()):
        if seqs:  # a decoding step, not A's prefill
            release.wait(60)
        return step_mixed(seqs, prefills)

    monkeypatch.setattr(live.engine, "step_mixed", held_step)
    body = chat_body("Tell me a long story about a dragon.", max_tokens=200, stream=True)
    try:
        with httpx.Client(base_url=live.url, timeout=120, headers=AUTH) as a, \
                httpx.Client(base_url=live.url, timeout=120, headers=AUTH) as b:
            with a.stream("POST", C, json=body) as ra:
                assert ra.status_code == 200
                next(ra.iter_lines())
                deadline = time.monotonic() + 30
                while live.scheduler.num_running < 1:  # A is running
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                with b.stream("POST", C, json=body) as rb:
                    assert rb.status_code == 200  # accepted, waiting
                    deadline = time.monotonic() + 30
                    while live.scheduler.num_waiting < 1:
                        assert time.monotonic() < deadline
                        time.sleep(0.02)
                    r = httpx.post(f"{live.url}{C}", json=chat_body("Say hi"), headers=AUTH, timeout=30)
                    assert r.status_code == 429
                    assert r.headers["retry-after"] == "1"
                    assert r.json()["error"]["code"] == "queue_full"
                    assert r.json()["error"]["type"] == "rate_limit_error"
                    release.set()
    finally:
        release.set()
    live.wait_idle()


def test_engine_failure_is_500_without_trace_and_server_survives(live, monkeypatch):
    live.wait_idle()

    step_mixed = live.engine.step_mixed

    def broken_step(seqs, prefills=()):
        if seqs:  # decoding steps fail; a prompt alone is still prefilled (its first token streams)
            raise RuntimeError("secret internal detail")
        return step_mixed(seqs, prefills)

    errors_before = live.metric("bastion_requests_total", finish_reason="error")
    monkeypatch.setattr(live.engine, "step_mixed", broken_step)
    r = httpx.post(f"{live.url}{C}", json=chat_body("Say hi"), headers=AUTH, timeout=120)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "secret" not in r.text and "Traceback" not in r.text
    # Streaming: the failure comes after the 200, as one error frame, and the stream ends without [DONE].
    with httpx.stream("POST", f"{live.url}{C}", json=chat_body("Say hi", stream=True), headers=AUTH,
                      timeout=120) as rs:
        assert rs.status_code == 200
        payloads = sse_frames(rs)
    assert "[DONE]" not in payloads
    last = json.loads(payloads[-1])
    assert set(last) == {"error"} and last["error"]["type"] == "server_error"
    assert live.metric("bastion_requests_total", finish_reason="error") == errors_before + 2
    monkeypatch.undo()
    # A bug in the scheduler's own bookkeeping fails that request only; the worker keeps serving.
    def broken_deliver(req, ev):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(live.scheduler, "_deliver", broken_deliver)
    r = httpx.post(f"{live.url}{C}", json=chat_body("Say hi"), headers=AUTH, timeout=120)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    monkeypatch.undo()
    ids, ref = live.ref("Say hi")
    r = httpx.post(f"{live.url}{C}", json=chat_body("Say hi"), headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text


# ---- metrics --------------------------------------------------------------------------------------------------
COUNTERS = ["bastion_prompt_tokens_total", "bastion_generation_tokens_total", "bastion_drafts_total",
            "bastion_draft_tokens_total", "bastion_accepted_tokens_total", "bastion_tree_size_nodes_count",
            "bastion_time_to_first_token_seconds_count", "bastion_e2e_request_latency_seconds_count"]


def scrape(live) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{live.url}/metrics", headers=AUTH, timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def test_metrics_consistent_with_usage(live, client):
    live.wait_idle()
    before = scrape(live)
    a = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say bye"}],
                                       temperature=0, max_tokens=5)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], temperature=0, max_tokens=7,
        stream=True, stream_options={"include_usage": True}))
    b_usage = chunks[-1].usage
    b_stats = [c for c in chunks if c.choices][-1].model_extra["bastion"]
    after = scrape(live)

    def d(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert d("bastion_prompt_tokens_total") == a.usage.prompt_tokens + b_usage.prompt_tokens
    assert d("bastion_generation_tokens_total") == a.usage.completion_tokens + b_usage.completion_tokens
    steps = a.model_extra["bastion"]["steps"] + b_stats["steps"]
    assert d("bastion_drafts_total") == steps == d("bastion_tree_size_nodes_count")
    assert d("bastion_tree_size_nodes_sum") == steps  # AR: root-only trees
    assert d("bastion_draft_tokens_total") == 0 and d("bastion_accepted_tokens_total") == 0
    reasons = [a.choices[0].finish_reason, [c for c in chunks if c.choices][-1].choices[0].finish_reason]
    assert sum(d(f"bastion_requests_total|finish_reason={f}") for f in set(reasons)) == 2
    assert d("bastion_time_to_first_token_seconds_count") == 2 and d("bastion_e2e_request_latency_seconds_count") == 2
    assert d("bastion_request_queue_time_seconds_count") == 2
    # Inter-token latency: one observation per token after the first of each request.
    assert d("bastion_inter_token_latency_seconds_count") == (a.usage.completion_tokens - 1
                                                              + b_usage.completion_tokens - 1)
    assert after["bastion_requests_running"] == 0 and after["bastion_requests_waiting"] == 0
    assert after["bastion_model_ready"] == 1 and after["bastion_estimated_speedup"] == 1.0
    for name in COUNTERS:
        assert name in after, name


# ---- readiness and a speculative engine (in-process ASGI, no second uvicorn) ------------------------------------
def test_health_is_503_until_the_model_is_ready(live):
    release = threading.Event()

    def slow_factory():
        release.wait(30)
        return live.engine

    registry = CollectorRegistry()
    app = create_app(slow_factory, ServerConfig(served_model_name=MODEL), registry)

    def errors_503():
        return registry.get_sample_value("bastion_http_errors_total", {"status": "503"}) or 0.0

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                for _ in range(3):  # a readiness probe polling during start-up
                    r = await http.get("/health")
                    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
                    assert r.headers["retry-after"] == "5"
                assert errors_503() == 0  # the probe's answer is not an error response
                r = await http.post(C, json=chat_body("Say hi"))
                assert r.status_code == 503 and r.headers["retry-after"] == "5"
                assert errors_503() == 1  # a refused request is
                release.set()
                for _ in range(300):
                    if (await http.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                assert (await http.get("/health")).json() == {"status": "ok"}
                head = await http.head("/health")  # load balancers probe with HEAD
                assert head.status_code == 200 and head.content == b""

    asyncio.run(scenario())


def test_speculative_engine_matches_ar_and_reports_stats(live, target_f32, random_drafter):
    live.wait_idle()
    engine = Engine(target_f32, random_drafter, fixed_mode("tree", 16))
    registry = CollectorRegistry()
    app = create_app(lambda: engine, ServerConfig(served_model_name=MODEL), registry)
    ids, ref = live.ref("Name a color.", max_tokens=8)

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as http:
                for _ in range(600):
                    if (await http.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                r = await http.post(C, json=chat_body("Name a color.", max_tokens=8))
                return r.status_code, r.json()

    status, out = asyncio.run(scenario())
    assert status == 200
    assert out["choices"][0]["message"]["content"] == ref.text  # lossless at temperature 0
    usage, stats = out["usage"], out["bastion"]
    assert usage["completion_tokens"] == len(ref.token_ids)
    assert stats["draft_tokens"] > 0 and stats["mean_tree_size"] > 1
    assert usage["completion_tokens"] == 1 + round(stats["tau"] * stats["steps"])  # prefill token + committed
    assert registry.get_sample_value("bastion_draft_tokens_total") == stats["draft_tokens"]
    assert registry.get_sample_value("bastion_accepted_tokens_total") == stats["accepted_tokens"]
    assert registry.get_sample_value("bastion_drafts_total") == stats["steps"]
    per_depth = sum(registry.get_sample_value("bastion_accepted_tokens_per_depth_total", {"depth": str(k)}) or 0
                    for k in range(1, 16))
    assert per_depth == stats["accepted_tokens"]
    speedup = registry.get_sample_value("bastion_estimated_speedup")
    assert speedup == pytest.approx(app.state.scheduler.engine.accounting.speedup()) and 0 < speedup
