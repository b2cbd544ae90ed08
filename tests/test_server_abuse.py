"""Serving under abuse: freed slots, no 500 from valid input, access checks, bounded work, draining.

Most tests run the real app over a scripted fake engine (fast, deterministic timing); the
model-backed paths are covered in test_server.py and by the soak test.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engine.accounting import StepAccounting, StepStats
from engine.engine import ContextLengthError, GenerationEvent, ModelInfo
from engine.sampling import RequestError
from server.app import ServerConfig, create_app
from server.local import LocalServer
from server.scheduler import EngineRequest, NotReadyError, QueueFullError, RequestFailed, Scheduler

C = "/v1/chat/completions"


# ---- a scripted engine ----------------------------------------------------------------------------------------
class _Detok:
    def release(self, final: bool = False) -> str:
        return ""


class _Seq:
    def __init__(self, params, prompt_len):
        self.params = params
        self.n = 1
        self.detok = _Detok()
        self.prompt_len = prompt_len
        self.prefilled = 0
        self.root = -1
        self.pending = None


class FakeEngine:
    """Emits one token 'a' per step after `step_s` seconds; `fail_start` makes start raise it."""

    def __init__(self, step_s: float = 0.01, max_context: int = 4096):
        self.step_s = step_s
        self.max_context = max_context
        self.accounting = StepAccounting()
        self.fail_start: BaseException | None = None
        self.fail_template: BaseException | None = None
        self.held: set[int] = set()  # ids of sequences whose KV slot is not given back
        self.prefill_chunks: list[int] = []  # max_tokens of every prefill_step call
        self.reserved: list[int] = []  # every reserve_slots call

    def tokenizer(self, text, add_special_tokens=False):
        return {"input_ids": [1]}

    def check_length(self, prompt_len: int, max_tokens: int) -> None:
        if max_tokens >= self.max_context:  # as engine.Engine.check_length
            raise ContextLengthError(f"max_tokens {max_tokens} >= {self.max_context}", "max_tokens")
        if prompt_len + max_tokens > self.max_context:
            raise ContextLengthError(f"{prompt_len} + {max_tokens} > {self.max_context}")

    def encode_chat(self, messages):
        if self.fail_template is not None:
            raise self.fail_template
        return [1, 2, 3]

    def info(self) -> ModelInfo:
        return ModelInfo(name="fake", max_context=self.max_context, dtype="float32", encode_chat=self.encode_chat,
                         encode_text=lambda text: [1, 2], check_length=self.check_length)

    def start(self, prompt_ids, params):
        seq = self.begin(prompt_ids, params)
        while self.prefill_step(seq, 4) is None:
            pass
        return seq

    def begin(self, prompt_ids, params):
        if self.fail_start is not None:
            raise self.fail_start
        params.validate()
        seq = _Seq(params, len(prompt_ids))
        self.held.add(id(seq))
        return seq

    def prefill_step(self, seq, max_tokens):
        """Prefill in chunks of max_tokens (each takes step_s); the last one yields the first token."""
        time.sleep(self.step_s)
        seq.prefilled = min(seq.prefilled + max_tokens, seq.prompt_len)
        self.prefill_chunks.append(max_tokens)
        if seq.prefilled < seq.prompt_len:
            return None
        seq.root = 7
        finish = "length" if seq.params.max_tokens <= 1 else None
        seq.pending = GenerationEvent([7], "a", finish, None)
        if finish is not None:
            self.release(seq)
        return seq.pending

    def release(self, seq) -> None:
        self.held.discard(id(seq))

    def reserve_slots(self, slots: int) -> None:
        self.reserved.append(slots)

    def step_mixed(self, seqs, prefills=()):
        firsts = [self.prefill_step(seq, n) for seq, n in prefills]
        return [self.step(seq) for seq in seqs], firsts

    def step(self, seq):
        time.sleep(self.step_s)
        seq.n += 1
        st = StepStats(tree_size=1, accepted=1, accepted_depth=0, context_len=seq.n, a_hat=1.0, drafted=False,
                       draft_s=0.0, verify_s=self.step_s, other_s=0.0)
        finish = "length" if seq.n >= seq.params.max_tokens else None
        return GenerationEvent([7], "a", finish, st)


def factory(engine: FakeEngine):
    return lambda: engine


def started(scheduler: Scheduler) -> Scheduler:
    scheduler.start()
    assert scheduler.ready.wait(10)
    return scheduler


def request(rid: str, max_tokens: int = 1000, sink=None) -> EngineRequest:
    from engine.sampling import SamplingParams

    events: list = []
    req = EngineRequest(rid, [1, 2], SamplingParams(max_tokens=max_tokens), sink or events.append)
    req.events = events  # type: ignore[attr-defined]
    return req


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# ---- slots -----------------------------------------------------------------------------------------------------
def test_a_cancelled_waiting_request_frees_its_slot_at_once():
    sched = started(Scheduler(factory(FakeEngine(step_s=0.02)), max_queue=3, max_running=1))
    try:
        long = request("long")
        sched.submit(long)
        wait_for(lambda: sched.num_running == 1)
        waiting = [request(f"w{i}") for i in range(3)]
        for r in waiting:
            sched.submit(r)
        with pytest.raises(QueueFullError):
            sched.submit(request("over"))
        for r in waiting:  # their clients disconnect while queued
            r.cancel()
        assert sched.num_waiting == 0  # at once, not when the worker reaches them
        assert [r.events[-1].finish_reason for r in waiting] == ["cancelled"] * 3
        sched.submit(request("new", max_tokens=2))  # the slots are free again
        assert sched.find_finished("w0").finish_reason == "cancelled"
    finally:
        sched.shutdown(1.0)


def test_admission_counts_running_slots_so_max_queue_zero_is_no_waiting_room():
    sched = started(Scheduler(factory(FakeEngine(step_s=0.05)), max_queue=0, max_running=1))
    try:
        sched.submit(request("a"))  # an idle server with no waiting room still serves
        with pytest.raises(QueueFullError):
            sched.submit(request("b"))
    finally:
        sched.shutdown(1.0)
    sched = started(Scheduler(factory(FakeEngine(step_s=0.05)), max_queue=1, max_running=4))
    try:
        for i in range(5):  # simultaneous arrivals on an idle server: 4 running + 1 waiting
            sched.submit(request(f"r{i}"))
        with pytest.raises(QueueFullError):
            sched.submit(request("r5"))
    finally:
        sched.shutdown(1.0)


def test_a_client_that_stops_reading_is_cancelled_and_its_slot_freed():
    engine = FakeEngine(step_s=0.01)
    sched = started(Scheduler(factory(engine), max_queue=0, max_running=1, stall_timeout=0.3))
    try:
        async def scenario():
            stream = sched.generate([1, 2], __import__("engine.sampling", fromlist=["x"]).SamplingParams(
                max_tokens=100000), "chatcmpl")
            first = await stream.__anext__()  # reads once, then stops reading
            assert first.token_ids == [7]
            await asyncio.sleep(1.0)
            return stream

        stream = asyncio.run(scenario())
        wait_for(lambda: stream.request.finish_reason is not None)
        assert stream.request.finish_reason == "cancelled"
        assert stream.request.n_tokens < 1000  # it did not generate on for nobody
        assert not engine.held  # the cancelled sequence gave its KV slot back
        sched.submit(request("next", max_tokens=2))
    finally:
        sched.shutdown(1.0)


def test_finished_requests_leave_a_small_record_only():
    sched = started(Scheduler(factory(FakeEngine(step_s=0.0)), max_queue=4, max_running=1, history=3))
    try:
        reqs = [request(f"r{i}", max_tokens=5) for i in range(5)]
        for r in reqs:
            sched.submit(r)
        wait_for(lambda: all(r.finish_reason for r in reqs))
        assert [f.request_id for f in sched.recent] == ["r2", "r3", "r4"]
        rec = sched.find_finished("r4")
        assert rec.n_tokens == 5 and rec.summary.steps == 4 and rec.finish_reason == "length"
        assert not hasattr(rec, "prompt_ids") and not hasattr(rec, "sink")
        assert reqs[-1].seq is None and reqs[-1].steps == []  # the live object dropped its per-step data too
    finally:
        sched.shutdown(1.0)


# ---- errors ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exc,client", [(RequestError("bad value", "top_p"), True),
                                        (ValueError("feature shape mismatch at /secret/path"), False),
                                        (MemoryError(), False)])
def test_only_request_errors_are_client_errors(exc, client):
    eng = FakeEngine()
    sched = started(Scheduler(factory(eng), max_queue=4, max_running=1))
    try:
        eng.fail_start = exc
        r = request("x")
        sched.submit(r)
        wait_for(lambda: r.finish_reason is not None)
        err = r.events[-1]
        assert isinstance(err, RequestFailed) and err.client_error is client
        if client:
            assert err.param == "top_p"
        else:
            assert "secret" not in str(err) and "x" in str(err) and "MemoryError" not in str(err)
    finally:
        sched.shutdown(1.0)


def test_a_dead_worker_says_so_instead_of_still_loading(monkeypatch):
    sched = Scheduler(factory(FakeEngine()), max_queue=4, max_running=1)
    monkeypatch.setattr(sched, "_loop", lambda: (_ for _ in ()).throw(RuntimeError("scheduler bug")))
    sched.start()
    wait_for(lambda: sched.worker_failed)
    with pytest.raises(NotReadyError) as e:
        sched.submit(request("x"))
    assert e.value.code == "engine_failed" and "bug" not in str(e.value)


# ---- the HTTP layer --------------------------------------------------------------------------------------------
class Server(LocalServer):
    """The real app over a FakeEngine on a loopback port."""

    def __init__(self, config: ServerConfig, engine: FakeEngine | None = None):
        self.engine = engine or FakeEngine()
        self.registry = CollectorRegistry()
        super().__init__(create_app(lambda: self.engine, config, self.registry), ready_timeout=20)

    @property
    def scheduler(self) -> Scheduler:
        return self.app.state.scheduler

    def metric(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def chat(content: str = "hi", **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def test_disconnected_unary_clients_free_their_queue_slots():
    with Server(ServerConfig(max_queue=8, max_running=1), FakeEngine(step_s=0.01)) as srv:
        long = threading.Thread(target=lambda: httpx.post(f"{srv.url}{C}", json=chat(max_tokens=400), timeout=30))
        long.start()
        wait_for(lambda: srv.scheduler.num_running == 1)

        async def queue_and_leave():
            async with httpx.AsyncClient(timeout=30) as http:
                tasks = [asyncio.create_task(http.post(f"{srv.url}{C}", json=chat())) for _ in range(8)]
                await asyncio.sleep(0.3)
                assert srv.scheduler.num_waiting == 8
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(queue_and_leave())
        wait_for(lambda: srv.scheduler.num_waiting == 0, 5)  # before: 8 dead entries held every slot
        assert srv.metric("bastion_requests_waiting") == 0
        r = httpx.post(f"{srv.url}{C}", json=chat(max_tokens=2), timeout=30)
        assert r.status_code == 200
        long.join(30)


def test_tiny_temperature_is_not_a_500():
    with Server(ServerConfig()) as srv:
        for t in (1e-300, 1e-40):
            r = httpx.post(f"{srv.url}{C}", json=chat(temperature=t), timeout=30)
            assert r.status_code == 200, r.text


def test_template_and_tokenizer_failures():
    eng = FakeEngine()
    with Server(ServerConfig(), eng) as srv:
        from jinja2.exceptions import TemplateError

        eng.fail_template = TemplateError("Conversation roles must alternate user/assistant")
        r = httpx.post(f"{srv.url}{C}", json=chat(), timeout=30)
        assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]
        eng.fail_template = MemoryError("no memory at /opt/secret")
        r = httpx.post(f"{srv.url}{C}", json=chat(), timeout=30)
        assert r.status_code == 500 and "secret" not in r.text and r.json()["error"]["type"] == "server_error"


def test_request_limits_name_their_parameter():
    with Server(ServerConfig(max_tokens_limit=50)) as srv:
        cases = [(chat(stop=["x" * 257]), "stop"), (chat(max_tokens=51), "max_tokens"),
                 ({"messages": [{"role": "user", "content": "a"}] * 1025}, "messages")]
        for body, param in cases:
            r = httpx.post(f"{srv.url}{C}", json=body, timeout=30)
            assert r.status_code == 400, (param, r.text)
            assert r.json()["error"]["param"] == param
        for raw, param in ((b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}', "temperature"),
                           (b'{"messages": [{"role": "user", "content": "a"}], "top_p": Infinity}', "top_p")):
            r = httpx.post(f"{srv.url}{C}", content=raw, headers={"Content-Type": "application/json"}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        # A text completion that does not say how long gets OpenAI's 16, not the whole context.
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    with Server(ServerConfig()) as srv:  # no server limit: the context length names the culprit
        for body, param in ((chat(max_tokens=10 ** 9), "max_tokens"), (chat(max_tokens=4094), "messages")):
            r = httpx.post(f"{srv.url}{C}", json=body, timeout=30)
            assert r.status_code == 400, (param, r.text)
            assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "context_length_exceeded"


def test_without_a_key_cross_site_browser_requests_are_refused():
    with Server(ServerConfig(loopback_only=True)) as srv:
        ok = httpx.post(f"{srv.url}{C}", json=chat(), timeout=30)
        assert ok.status_code == 200
        evil = httpx.post(f"{srv.url}{C}", content=json.dumps(chat()), timeout=30,
                          headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
        assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
        plain = httpx.post(f"{srv.url}{C}", content=json.dumps(chat()), headers={"Content-Type": "text/plain"},
                           timeout=30)
        assert plain.status_code == 415
        rebinding = httpx.post(f"{srv.url}{C}", json=chat(), headers={"Host": "attacker.example:8000"}, timeout=30)
        assert rebinding.status_code == 403 and rebinding.json()["error"]["code"] == "host_not_allowed"
        same_origin = httpx.post(f"{srv.url}{C}", json=chat(), headers={"Origin": srv.url}, timeout=30)
        assert same_origin.status_code == 200
        assert httpx.get(f"{srv.url}/health", headers={"Host": "attacker.example"}, timeout=5).status_code == 200


def test_a_key_guards_every_route_but_health_and_metrics_can_have_their_own():
    with Server(ServerConfig(api_key="sk-a", metrics_key="sk-m")) as srv:
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", C), ("POST", "/v1/completions")):
            r = httpx.request(method, f"{srv.url}{path}", json=chat(), timeout=30)
            assert r.status_code == 401, path
        assert httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer sk-a"}).status_code == 401
        assert httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer sk-m"}).status_code == 200
        assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer sk-a"}).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200
    for empty in ("", "  "):
        with pytest.raises(ValueError):
            ServerConfig(api_key=empty)


def raw_exchange(port: int, head: bytes, body: bytes = b"", wait: float = 3.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(head + body)
        s.settimeout(wait)
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            pass
        return data


def test_oversized_slow_and_aborted_bodies(caplog):
    with Server(ServerConfig(max_body_bytes=1024, body_timeout=0.5)) as srv:
        head = (f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Content-Length: 8388609\r\n\r\n").encode()
        t0 = time.monotonic()
        answer = raw_exchange(srv.port, head, b"{", wait=3.0)  # the body never comes
        assert answer.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 2.0
        slow = (f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Content-Length: 200\r\n\r\n").encode()
        answer = raw_exchange(srv.port, slow, b'{"messages": [', wait=3.0)
        assert answer.startswith(b"HTTP/1.1 408")
        caplog.set_level(logging.ERROR, logger="server.app")
        with socket.create_connection(("127.0.0.1", srv.port)) as s:  # aborts mid-body
            s.sendall(slow + b'{"messages"')
        wait_for(lambda: srv.metric("bastion_http_errors_total", status="499") == 1, 5)
        assert srv.metric("bastion_http_errors_total", status="500") == 0
        assert "unhandled error" not in caplog.text


def test_draining_refuses_new_work_and_health_says_so():
    with Server(ServerConfig(max_running=1), FakeEngine(step_s=0.01)) as srv:
        srv.scheduler.begin_drain()
        r = httpx.post(f"{srv.url}{C}", json=chat(), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down" and "retry-after" in r.headers
        h = httpx.get(f"{srv.url}/health", timeout=5)
        assert h.status_code == 503 and h.json()["error"]["code"] == "shutting_down"


def test_load_failure_does_not_leak_paths_to_health():
    def broken():
        raise OSError("cannot open /home/user/secret/model.safetensors")

    app = create_app(broken, ServerConfig(), CollectorRegistry())

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
                wait = 0
                while app.state.scheduler.load_error is None and wait < 200:
                    await asyncio.sleep(0.01)
                    wait += 1
                r = await http.get("/health")
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
                assert "secret" not in r.text
                r = await http.post(C, json=chat())
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"

    asyncio.run(scenario())


def test_serve_refuses_an_open_bind_without_a_key():
    import argparse

    from bastion.serve import add_arguments, server_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="without an API key"):
        server_config(p.parse_args(["--host", "0.0.0.0"]))
    assert server_config(p.parse_args(["--host", "0.0.0.0", "--api-key", "k"])).api_key == "k"
    assert not server_config(p.parse_args(["--host", "0.0.0.0", "--allow-unauthenticated"])).loopback_only
    assert server_config(p.parse_args([])).loopback_only
    with pytest.raises(ValueError, match="empty"):
        server_config(p.parse_args(["--api-key", ""]))


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_requests_steps():
    """A prompt of 40 tokens with prefill_chunk=4 takes 10 loops; the running request gets a token
    in each of them instead of waiting for the whole prefill."""
    from engine.sampling import SamplingParams

    eng = FakeEngine(step_s=0.005)
    sched = started(Scheduler(factory(eng), max_queue=4, max_running=2, prefill_chunk=4))
    try:
        running = request("running", max_tokens=400)
        sched.submit(running)
        wait_for(lambda: len(running.events) >= 2)
        long = EngineRequest("long", list(range(40)), SamplingParams(max_tokens=3), lambda ev: None)
        sched.submit(long)
        wait_for(lambda: long.seq is not None)
        before = len(running.events)
        wait_for(lambda: long.first_token is not None)
        during = len(running.events) - before
        assert during >= 8  # about one step of the running request per 4-token chunk
        assert eng.prefill_chunks[-10:] == [4] * 10
        wait_for(lambda: long.finish_reason == "length")
        running.cancel()
        wait_for(lambda: running.finish_reason == "cancelled")
        assert not eng.held
    finally:
        sched.shutdown(1.0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Scheduler(factory(eng), prefill_chunk=0)


def test_a_failing_prompt_chunk_fails_its_request_only_and_the_running_one_goes_on():
    """A step whose forward carries a prompt chunk fails: the new request gets its error, the
    running one its step again without the chunk, and it finishes normally; no slot is held."""
    from engine.sampling import SamplingParams

    class ChunkBreaks(FakeEngine):
        def step_mixed(self, seqs, prefills=()):
            if seqs and prefills:
                raise RuntimeError("the forward ran out of memory")
            return super().step_mixed(seqs, prefills)

    eng = ChunkBreaks(step_s=0.005)
    sched = started(Scheduler(factory(eng), max_queue=4, max_running=2, prefill_chunk=4))
    try:
        running = request("running", max_tokens=40)
        sched.submit(running)
        wait_for(lambda: len(running.events) >= 2)
        new = request("new", max_tokens=3)
        sched.submit(new)
        wait_for(lambda: new.finish_reason is not None and running.finish_reason is not None)
        assert new.finish_reason == "error" and not hasattr(new.events[-1], "token_ids")  # a RequestFailed
        assert running.finish_reason == "length" and sum(len(e.token_ids) for e in running.events) == 40
        assert not eng.held  # both slots given back
    finally:
        sched.shutdown(1.0)


def test_the_engine_reserves_max_running_slots_before_ready():
    eng = FakeEngine()
    sched = started(Scheduler(factory(eng), max_queue=4, max_running=3))
    try:
        assert eng.reserved == [3]
    finally:
        sched.shutdown(5)
