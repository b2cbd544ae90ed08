"""A soak and fault test against a running server: many concurrent clients, a mix of good,
cancelled and bad requests, every answer checked.

`run_loadtest(url, ...)` first decodes every distinct temperature-0 request alone (its
reference), then sends `requests` requests from `clients` concurrent clients: streaming and
not, temperature 0 and 0.7, stop strings, cancellations mid-stream and while queued, and bad
inputs. It returns a `LoadReport` whose `problems` list every 5xx, every lost or corrupted
answer (a temperature-0 answer that differs from its reference, a stream without [DONE]),
every bad input not refused with a 4xx, and slots still held at the end. `rss` samples the
server's resident memory (a callable) every `rss_every` requests. Loopback only: the
server is the caller's (`bastion loadtest` starts one in-process).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

PROMPTS = (
    "Say hi.", "Name three colours.", "What is 2 + 2?", "Write a haiku about rain.",
    "Give one tip for sleeping well.", "Translate 'good morning' to French.", "List two prime numbers.",
    "Describe a cat in one sentence.",
)
#: Bodies the server must refuse with a 4xx (and the reason, for the report).
BAD_BODIES = (
    (b'{"messages": [{"role": "user", "content": "a"}], "temperature": 7}', "temperature out of range"),
    (b'{"messages": []}', "no messages"),
    (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}', "max_tokens 0"),
    (b'{"messages": [{"role": "user", "content": "a"}], "model": "nope"}', "unknown model"),
    (b'{"messages": [{"role": "user", "content": "a"}], "n": 3}', "n > 1"),
    (b'{"messages": [{"role": "user", "content": "a"}], "stop": ["' + b"x" * 300 + b'"]}', "stop too long"),
    (b'{"messages": [{"role": "user", "content": "a"}]', "broken JSON"),
)
KINDS = (("unary", 0.36), ("stream", 0.24), ("sampled", 0.14), ("stop", 0.08), ("cancel_stream", 0.06),
         ("cancel_queued", 0.05), ("bad", 0.07))


@dataclass
class LoadReport:
    """What a load test saw. Latencies in seconds (successful requests, send to last byte)."""

    requests: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    status: dict[int, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    rss_mb: list[tuple[int, float]] = field(default_factory=list)  # (requests done, MB)
    problems: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    clients: int = 0

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.status.items() if s >= 500)

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def rss_growth(self) -> float | None:
        """Relative RSS growth from the sample after the second batch of requests to the last one
        (samples: at the start, then every `rss_every` requests)."""
        if len(self.rss_mb) < 4:
            return None
        return self.rss_mb[-1][1] / self.rss_mb[2][1] - 1.0

    def summary(self) -> str:
        growth = self.rss_growth()
        rss = ", ".join(f"after {n}: {mb:.0f} MB" for n, mb in self.rss_mb[:1] + self.rss_mb[2:3] + self.rss_mb[-1:])
        return (f"{self.requests} requests from {self.clients} clients in {self.duration_s:.0f} s; "
                f"kinds {self.by_kind}; statuses {dict(sorted(self.status.items()))}; 5xx {self.server_errors}; "
                f"latency p50 {self.percentile(0.5):.2f} s, p99 {self.percentile(0.99):.2f} s; RSS {rss}"
                + (f" (growth {100 * growth:+.1f} % since the second batch)" if growth is not None else "")
                + f"; problems {len(self.problems)}")


def _plan(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    names = [k for k, _ in KINDS]
    weights = [w for _, w in KINDS]
    plan = []
    for i in range(n):
        kind = rng.choices(names, weights)[0]
        # Few distinct (prompt, max_tokens, stop) keys, so the references stay cheap.
        item = {"i": i, "kind": kind, "prompt": rng.choice(PROMPTS), "max_tokens": rng.choice((4, 12, 24))}
        if kind == "sampled":
            item.update(temperature=0.7, seed=rng.randint(0, 1000), stream=rng.random() < 0.5)
        elif kind == "stop":
            item.update(stop=[rng.choice([".", " the"])], stream=rng.random() < 0.5)
        elif kind == "bad":
            item["body"], item["why"] = rng.choice(BAD_BODIES)
        plan.append(item)
    return plan


def _body(item: dict, stream: bool) -> dict:
    body = {"messages": [{"role": "user", "content": item["prompt"]}], "max_tokens": item["max_tokens"],
            "temperature": item.get("temperature", 0.0), "stream": stream}
    if "seed" in item:
        body["seed"] = item["seed"]
    if "stop" in item:
        body["stop"] = item["stop"]
    return body


def _key(item: dict) -> tuple:
    return item["prompt"], item["max_tokens"], tuple(item.get("stop", ()))


async def _stream_text(http: httpx.AsyncClient, url: str, body: dict, headers: dict,
                       stop_after: int | None = None) -> tuple[int, str, bool]:
    """(status, concatenated text, whether [DONE] came); stop_after: leave after that many frames."""
    text, done, frames = [], False, 0
    async with http.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "", False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            frames += 1
            obj = json.loads(data)
            if "error" in obj:
                return 599 if obj["error"].get("type") == "server_error" else 499, "".join(text), False
            for ch in obj.get("choices", []):
                text.append(ch.get("delta", {}).get("content") or "")
            if stop_after is not None and frames >= stop_after:
                return 200, "".join(text), False
    return 200, "".join(text), done


async def _references(http: httpx.AsyncClient, url: str, headers: dict, plan: list[dict]) -> dict[tuple, str]:
    refs: dict[tuple, str] = {}
    for item in plan:
        if item["kind"] in ("unary", "stream", "stop", "cancel_stream") and _key(item) not in refs:
            r = await http.post(url, json=_body(item, False), headers=headers)
            r.raise_for_status()
            refs[_key(item)] = r.json()["choices"][0]["message"]["content"]
    return refs


async def _one(http: httpx.AsyncClient, url: str, headers: dict, item: dict, refs: dict, rep: LoadReport) -> None:
    kind, t0 = item["kind"], time.perf_counter()
    status = 0
    try:
        if kind == "bad":
            r = await http.post(url, content=item["body"], headers={**headers, "Content-Type": "application/json"})
            status = r.status_code
            if not (400 <= status < 500 and "error" in r.json()):
                rep.problems.append(f"#{item['i']} bad input ({item['why']}) answered {status}")
            return
        if kind == "cancel_queued":
            try:
                r = await asyncio.wait_for(http.post(url, json=_body(item, False), headers=headers), 0.05)
                status = r.status_code
            except asyncio.TimeoutError:
                status = 499
            return
        if kind == "cancel_stream":
            status, _, _ = await _stream_text(http, url, _body(item, True), headers, stop_after=2)
            return
        stream = kind == "stream" or item.get("stream", False)
        if stream:
            status, text, done = await _stream_text(http, url, _body(item, True), headers)
            if status == 200 and not done:
                rep.problems.append(f"#{item['i']} {kind}: stream ended without [DONE]")
        else:
            r = await http.post(url, json=_body(item, False), headers=headers)
            status = r.status_code
            text = r.json()["choices"][0]["message"]["content"] if status == 200 else ""
        if status == 200:
            rep.latencies.append(time.perf_counter() - t0)
            if item.get("temperature", 0.0) == 0.0 and text != refs[_key(item)]:
                rep.problems.append(f"#{item['i']} {kind}: {text!r} differs from its reference {refs[_key(item)]!r}")
        elif status != 429:  # a full queue is a correct answer under load
            rep.problems.append(f"#{item['i']} {kind} answered {status}")
    except httpx.HTTPError as e:
        status = 598
        rep.problems.append(f"#{item['i']} {kind}: transport error {e!r}")
    finally:
        rep.status[status] = rep.status.get(status, 0) + 1
        rep.by_kind[kind] = rep.by_kind.get(kind, 0) + 1
        rep.requests += 1


async def _run(base_url: str, requests: int, clients: int, seed: int, api_key: str | None,
               rss: Callable[[], float] | None, slots: Callable[[], tuple[int, int]] | None,
               rss_every: int) -> LoadReport:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url}/v1/chat/completions"
    plan = _plan(requests, seed)
    rep = LoadReport(clients=clients)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        refs = await _references(http, url, headers, plan)
        queue: asyncio.Queue = asyncio.Queue()
        for item in plan:
            queue.put_nowait(item)
        t0 = time.perf_counter()
        if rss is not None:
            rep.rss_mb.append((0, rss()))  # after the references: the model is loaded and warm

        async def client() -> None:
            while not queue.empty():
                item = queue.get_nowait()
                await _one(http, url, headers, item, refs, rep)
                if rss is not None and rep.requests % rss_every == 0:
                    rep.rss_mb.append((rep.requests, rss()))

        await asyncio.gather(*(client() for _ in range(clients)))
        rep.duration_s = time.perf_counter() - t0
    if slots is not None:
        deadline = time.monotonic() + 30
        while slots() != (0, 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if slots() != (0, 0):
            rep.problems.append(f"slots still held at the end (running, waiting) = {slots()}")
    return rep


def run_loadtest(base_url: str, requests: int = 1000, clients: int = 16, seed: int = 0, api_key: str | None = None,
                 rss: Callable[[], float] | None = None, slots: Callable[[], tuple[int, int]] | None = None,
                 rss_every: int = 100) -> LoadReport:
    """Run the load test against `base_url` (loopback) and return its LoadReport.

    rss() -> the server's resident memory in MB (sampled every `rss_every` requests); slots() ->
    (running, waiting) requests, which must reach (0, 0) at the end. Raises ValueError for
    a non-loopback URL or bad counts.
    """
    host = httpx.URL(base_url).host
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the load test only targets loopback servers, not {host}")
    if requests < 1 or clients < 1:
        raise ValueError("requests and clients must be >= 1")
    return asyncio.run(_run(base_url, requests, clients, seed, api_key, rss, slots, max(1, rss_every)))
