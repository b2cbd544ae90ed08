"""Bounded request queue and the one engine worker thread that owns the model.

The asyncio event loop never runs model code: HTTP handlers call `generate(prompt_ids,
params)`, which queues an `EngineRequest` and returns a `GenerationStream`, an async
iterator over the request's `GenerationEvent`s fed from the worker thread; leaving it
early (or closing it) cancels the request. The worker
thread builds the engine (so loading never blocks the loop), times a one-token forward
for the speedup estimate, then loops: admit waiting requests in arrival order up to
`max_running`, and advance every running sequence together by one `engine.step_mixed`
(one target forward carries every running sequence's tree, each in its own KV slot; the
adaptive controller sizes all the trees under one global budget). With `max_running=1`
requests are decoded one at a time in arrival order. A newly admitted request takes its KV
slot at once and is prefilled in chunks: each loop's forward also carries at most
`prefill_chunk` prompt tokens (oldest request first), so a long prompt delays the running
sequences by one chunk's compute per step, not by its whole prefill, and no step waits for a
separate prefill forward. A request joins the batch after its prefill and leaves it when it
finishes.

Admission counts live requests only: at most `max_running + max_queue` requests are
admitted or waiting at once (so `max_queue=0` means "no waiting room", not "refuse all").
A request whose `cancel()` was called (client gone, shutdown) leaves the waiting queue at
once, or is finished with 'cancelled' before its next step if it is running, so it runs at
most one more step and its slot is free for the next request. A client that stops reading
while keeping its connection open is cancelled after `stall_timeout` seconds without
reading. Finished requests leave a small `FinishedRequest` record (bounded history).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from engine.accounting import StepStats, StepSummary, summarize
from engine.engine import Engine, GenerationEvent, ModelInfo, Sequence
from engine.sampling import RequestError, SamplingParams
from server.metrics import ServerMetrics

log = logging.getLogger(__name__)

#: Sequences decoded together by default (one batched step).
DEFAULT_MAX_RUNNING = 8
#: Prompt tokens prefilled per scheduler loop by default: about 1 s of a 2-core CPU's forward for
#: the 135M default (running requests wait that long per chunk), a few milliseconds on a GPU.
DEFAULT_PREFILL_CHUNK = 256


class QueueFullError(RuntimeError):
    """`max_running + max_queue` live requests are admitted or waiting already (HTTP 429)."""


class NotReadyError(RuntimeError):
    """The model is still loading, failed to load, or the server is shutting down (HTTP 503).

    code: 'model_not_ready' (loading), 'engine_failed' (load failed or the worker stopped),
    'shutting_down'.
    """

    def __init__(self, message: str, code: str = "model_not_ready"):
        super().__init__(message)
        self.code = code


class RequestFailed(RuntimeError):
    """Delivered through a sink when the engine raised while serving the request.

    client_error: the engine refused the input (RequestError, HTTP 400); param names the
    offending field. Otherwise an internal error (HTTP 500): the message carries only the
    request id, the details go to the log.
    """

    def __init__(self, message: str, client_error: bool = False, param: str | None = None):
        super().__init__(message)
        self.client_error = client_error
        self.param = param


@dataclass(frozen=True)
class FinishedRequest:
    """What the scheduler remembers of a finished request (a few hundred bytes, no tokens).

    Times are time.perf_counter() seconds (None when the request never got there).
    steps_after_cancel: steps run after cancel() was called (None if never cancelled).
    """

    request_id: str
    finish_reason: str
    prompt_tokens: int
    n_tokens: int
    summary: StepSummary
    steps_after_cancel: int | None
    arrival: float
    started: float | None
    first_token: float | None
    finished: float


@dataclass
class EngineRequest:
    """One request's server-side state. Times are time.perf_counter() seconds.

    sink(item) receives, from the worker thread, each GenerationEvent in order and, on
    failure, one RequestFailed; the last event delivered has a finish_reason. It must not block.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[object], None]
    arrival: float = field(default_factory=time.perf_counter)
    # Set by the worker:
    started: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    n_tokens: int = 0
    steps: list[StepStats] = field(default_factory=list)
    steps_at_cancel: int | None = None  # len(steps) when cancel() was called
    seq: Sequence | None = None
    #: Events delivered (written by the worker only) and read (by the client's loop only), when
    #: the client last read and since when the oldest unread event waits (perf_counter).
    delivered: int = 0
    read: int = 0
    last_read: float = 0.0
    unread_since: float = 0.0
    on_cancel: Callable[["EngineRequest"], None] | None = None
    final: FinishedRequest | None = None
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop this request (thread-safe, idempotent): a waiting one leaves the queue at once
        (through `on_cancel`, set by the scheduler), a running one before its next step."""
        if not self._cancel.is_set():
            self.steps_at_cancel = len(self.steps)
            self._cancel.set()
            if self.on_cancel is not None:
                self.on_cancel(self)

    def stalled(self, now: float, timeout: float) -> bool:
        """True when delivered events have waited unread, with no read at all, for `timeout` s."""
        return (self.delivered > self.read and now - self.unread_since > timeout
                and now - self.last_read > timeout)

    def record(self) -> FinishedRequest:
        """The small record kept after the request finished."""
        return FinishedRequest(self.request_id, self.finish_reason or "error", len(self.prompt_ids), self.n_tokens,
                               summarize(self.steps), self.steps_after_cancel, self.arrival, self.started,
                               self.first_token, self.finished or time.perf_counter())

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def steps_after_cancel(self) -> int | None:
        """Steps run after cancel() was called (None if never cancelled)."""
        return None if self.steps_at_cancel is None else len(self.steps) - self.steps_at_cancel


class GenerationStream:
    """One queued request's events, as an async iterator (made by `Scheduler.generate`).

    Iterating yields each GenerationEvent in order, the last one with a finish_reason, and
    raises RequestFailed when the engine failed on the request. `close()` (also on leaving
    `async with`, or after iterating ends early) cancels a request that has not finished, so
    an abandoned request runs at most one more step. Use it on the event loop that made it.
    """

    def __init__(self, request: EngineRequest, queue: asyncio.Queue):
        self.request = request
        self._queue = queue
        self._done = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    def summary(self) -> StepSummary:
        """The request's speculative figures so far (steps, tau, tree size, token counts)."""
        req = self.request
        return req.final.summary if req.final is not None else summarize(req.steps)

    def __aiter__(self) -> "GenerationStream":
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # the consumer was cancelled while waiting: nobody will read on
            self.close()
            raise
        req = self.request
        req.read += 1
        req.last_read = time.perf_counter()
        if isinstance(item, RequestFailed):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    def close(self) -> None:
        """Stop reading; cancel the request unless it has finished (idempotent)."""
        self._done = True
        if self.request.finish_reason is None:
            self.request.cancel()

    async def __aenter__(self) -> "GenerationStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class Scheduler:
    """FIFO admission from a bounded queue into at most `max_running` sequences, one worker thread.

    engine_factory: called once on the worker thread; returns the Engine.
    max_queue: requests allowed to wait beyond the `max_running` being decoded (submit
    raises QueueFullError beyond `max_running + max_queue` live requests).
    max_running: sequences decoded together (one `engine.step_mixed` per loop).
    prefill_chunk: prompt tokens prefilled per loop, across the requests still prefilling, in
    the same forward as the running sequences' step (a long prompt delays them by at most one
    chunk per step).
    metrics: ServerMetrics to update (None: no metrics).
    history: how many FinishedRequest records `recent` keeps (for tests and debugging).
    stall_timeout: seconds a client may leave delivered events unread before its request is
    cancelled (it stopped reading but kept the connection open).
    """

    def __init__(self, engine_factory: Callable[[], Engine], max_queue: int = 64, max_running: int = DEFAULT_MAX_RUNNING,
                 metrics: ServerMetrics | None = None, history: int = 256, stall_timeout: float = 30.0,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if max_queue < 0 or max_running < 1 or prefill_chunk < 1:
            raise ValueError(f"need max_queue >= 0, max_running >= 1 and prefill_chunk >= 1, got {max_queue}, "
                             f"{max_running}, {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk)
        self.stall_timeout = float(stall_timeout)
        self._factory = engine_factory
        self.max_queue = max_queue
        self.max_running = max_running
        self.metrics = metrics
        self.engine: Engine | None = None
        self._info: ModelInfo | None = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.recent: deque[FinishedRequest] = deque(maxlen=history)
        self.worker_failed = False
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._cv = threading.Condition()
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.on_ready: Callable[[], None] | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (it loads the engine, then serves)."""
        self._thread = threading.Thread(target=self._main, name="bastion-engine", daemon=True)
        self._thread.start()

    @property
    def draining(self) -> bool:
        """True once shutdown began: new requests are refused (HTTP 503)."""
        return not self._accepting

    def begin_drain(self) -> None:
        """Stop admitting new requests; those already queued or running go on."""
        with self._cv:
            self._accepting = False
            self._cv.notify_all()

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Stop accepting; let queued and running requests finish for up to `timeout` seconds,
        then cancel what remains (their streams get the final 'cancelled' event) and join the
        worker. Returns True if the worker exited; False (logged) when it is still busy, e.g.
        inside a long prefill."""
        self.begin_drain()
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cv:
            while (self._waiting or self._running) and time.monotonic() < deadline:
                self._cv.wait(timeout=0.05)
            for req in list(self._waiting) + list(self._running):
                req.cancel()
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, timeout))
            if self._thread.is_alive():
                log.warning("the engine worker did not stop within %.0f s (busy in a forward); exiting anyway",
                            max(5.0, timeout))
                return False
        return True

    # ---- the HTTP side ---------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo | None:
        """What the HTTP layer may know of the loaded model (None until it is ready)."""
        return self._info if self.ready.is_set() else None

    def generate(self, prompt_ids: list[int], params: SamplingParams, prefix: str = "cmpl") -> GenerationStream:
        """Queue a request and return its event stream; call it on the event loop that will read it.

        prefix: start of the request id ('chatcmpl', 'cmpl'). Raises NotReadyError or
        QueueFullError at once (before anything is queued), as `submit` does.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(item: object) -> None:  # called on the worker thread
            loop.call_soon_threadsafe(queue.put_nowait, item)

        req = EngineRequest(self.new_id(prefix), list(prompt_ids), params, sink)
        self.submit(req)
        return GenerationStream(req, queue)

    def submit(self, req: EngineRequest) -> None:
        """Queue a request (thread-safe; never blocks on model work).

        Raises NotReadyError while loading, after a failure or once shutdown began, and
        QueueFullError when `max_running + max_queue` live requests are admitted or waiting.
        """
        with self._cv:
            self._check_admission()
            req.on_cancel = self._withdraw
            self._waiting.append(req)
            self._gauges()
            self._cv.notify_all()

    def check_admission(self) -> None:
        """Raise what `submit` would raise now (cheap: lets the HTTP layer refuse before
        tokenising); a later submit may still be refused."""
        with self._cv:
            self._check_admission()

    def _check_admission(self) -> None:
        if not self._accepting:
            raise NotReadyError("the server is shutting down", "shutting_down")
        if self.worker_failed or (self.load_error is not None and not self.ready.is_set()):
            what = "the engine worker stopped" if self.worker_failed else "the model failed to load"
            raise NotReadyError(f"{what}; see the server log", "engine_failed")
        if not self.ready.is_set():
            raise NotReadyError("the model is still loading", "model_not_ready")
        live = len(self._waiting) + sum(1 for r in self._running if r.finish_reason is None)
        if live >= self.max_running + self.max_queue:
            raise QueueFullError(f"the server is at capacity ({self.max_running} running, {self.max_queue} "
                                 "waiting); retry later")

    def _withdraw(self, req: EngineRequest) -> None:
        """A cancelled request still waiting leaves the queue now and is finished 'cancelled'."""
        with self._cv:
            try:
                self._waiting.remove(req)
            except ValueError:  # already admitted (the worker finishes it) or gone
                return
            self._gauges()
            self._cv.notify_all()
        self._finish(req, "cancelled", GenerationEvent([], "", "cancelled"))

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000) % 100000000}"

    def find_finished(self, request_id: str) -> FinishedRequest | None:
        """The record of the finished request with this id among the last `history` ones, else None."""
        with self._cv:
            return next((r for r in self.recent if r.request_id == request_id), None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---- the worker ------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine = self._factory()
            reserve = getattr(self.engine, "reserve_slots", None)
            if reserve is not None:
                reserve(self.max_running)
            self.engine.accounting.ar_probe_s = self._time_one_token()
            self._info = self.engine.info()
            if self.metrics is not None:
                engine = self.engine
                self.metrics.steps.source = lambda: engine.accounting
        except BaseException as e:  # noqa: BLE001 - reported to /health and the CLI
            log.exception("engine failed to load")
            self.load_error = e
            if self.on_load_error is not None:
                self.on_load_error(e)
            return
        self.ready.set()
        if self.metrics is not None:
            self.metrics.ready.set(1)
        log.info("engine ready (one-token forward %.1f ms)", 1e3 * (self.engine.accounting.ar_probe_s or 0))
        if self.on_ready is not None:
            self.on_ready()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a scheduler bug: stop serving visibly, never hang clients
            log.exception("engine worker stopped")
            self.worker_failed = True
            self.ready.clear()
            self.load_error = e
            if self.metrics is not None:
                self.metrics.ready.set(0)
            with self._cv:
                pending = list(self._waiting) + list(self._running)
                self._waiting.clear()
                self._running.clear()
            for req in pending:
                if req.finish_reason is None:
                    self._fail(req, RequestFailed(f"internal error (request {req.request_id}): the engine "
                                                  "worker stopped"))

    def _time_one_token(self) -> float:
        """Seconds of a one-token prefill (the AR step time before any root-only step is seen)."""
        eng = self.engine
        ids = [0]  # any token: a one-token forward costs the same for every id
        params = SamplingParams(temperature=0.0, max_tokens=1)
        eng.release(eng.start(ids, params))  # warm-up
        t0 = time.perf_counter()
        seq = eng.start(ids, params)
        dt = time.perf_counter() - t0
        eng.release(seq)
        return dt

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._running:
                    self._cv.wait()
                if self._stop:
                    pending = list(self._waiting) + list(self._running)
                    self._waiting.clear()
                    self._running.clear()
                else:
                    pending = []
                    admitted = []
                    while self._waiting and len(self._running) + len(admitted) < self.max_running:
                        admitted.append(self._waiting.popleft())
                    self._running.extend(admitted)
                self._gauges()
            if self._stop:
                for req in pending:
                    if req.finish_reason is None:
                        self._finish(req, "cancelled", GenerationEvent([], "", "cancelled"))
                return
            for req in admitted:
                self._guarded(self._admit, req)
            now = time.perf_counter()
            batch, prefilling = [], []
            for req in list(self._running):
                if req.finish_reason is None and req.seq is not None:
                    if req.stalled(now, self.stall_timeout):
                        log.info("%s: the client read nothing for %.0f s; cancelled", req.request_id,
                                 now - req.last_read)
                        req.cancel()
                    if req.cancelled:
                        self._guarded(self._cancel_running, req)
                    elif req.seq.root < 0:
                        prefilling.append(req)
                    elif all(req is not a for a in admitted):
                        batch.append(req)
            budget = self.prefill_chunk
            chunks = []
            for req in prefilling:  # FIFO: the oldest prompt first, one chunk's worth of tokens in all
                if budget <= 0:
                    break
                n = min(budget, len(req.prompt_ids) - req.seq.prefilled)
                budget -= n
                chunks.append((req, n))
            if batch or chunks:
                self._step(batch, chunks)
            with self._cv:
                self._running = [r for r in self._running if r.finish_reason is None]
                self._gauges()
                self._cv.notify_all()

    def _guarded(self, fn: Callable[[EngineRequest], None], req: EngineRequest) -> None:
        """Run fn(req); a bug in it fails this request only (HTTP 500), never the worker."""
        try:
            fn(req)
        except Exception:  # noqa: BLE001
            log.exception("scheduler error on %s", req.request_id)
            if req.finish_reason is None:
                self._fail(req, self._internal(req))

    def _admit(self, req: EngineRequest) -> None:
        """Take a KV slot for a newly admitted request (no forward yet); bad input fails it with a 4xx."""
        now = time.perf_counter()
        req.started = now
        if self.metrics is not None:
            self.metrics.queue_time.observe(now - req.arrival)
        if req.cancelled:
            self._finish(req, "cancelled", GenerationEvent([], "", "cancelled"))
            return
        try:
            req.seq = self.engine.begin(req.prompt_ids, req.params)
        except RequestError as e:  # the engine refused the input before any work
            self._fail(req, RequestFailed(str(e), client_error=True, param=e.param))
        except Exception:  # noqa: BLE001 - one request's failure must not stop the worker
            log.exception("admission failed for %s", req.request_id)
            self._fail(req, self._internal(req))

    def _cancel_running(self, req: EngineRequest) -> None:
        self._finish(req, "cancelled", GenerationEvent([], req.seq.detok.release(final=True), "cancelled"))

    def _step(self, reqs: list[EngineRequest], chunks: list[tuple[EngineRequest, int]]) -> None:
        """One engine step for every running request at once (their trees in one forward), with the
        next prompt chunk of each request in `chunks` (request, tokens) in the same forward; a
        request whose prompt is done gets its first token.

        A request whose own work failed gets its error (HTTP 500) and the others go on; a
        failure of the shared step fails the requests of that step only, never the worker. When
        a step that carries prompt chunks fails, their requests fail and the running ones get
        their step again without them (a chunk must not take the running requests down with it).
        """
        try:
            outs, firsts = self.engine.step_mixed([req.seq for req in reqs], [(req.seq, n) for req, n in chunks])
        except Exception:  # noqa: BLE001
            prefilling = [req for req, _ in chunks]
            log.exception("decoding step failed for %s", ", ".join(r.request_id for r in reqs + prefilling))
            retry = bool(reqs and prefilling)  # the running requests get their step again, alone
            for req in prefilling if retry else reqs + prefilling:
                if req.finish_reason is None:
                    self._fail(req, self._internal(req))
            if retry:
                self._step(reqs, [])
            return
        for req, out in zip(reqs, outs):
            if isinstance(out, Exception):
                log.error("decoding step failed for %s", req.request_id, exc_info=out)
                self._fail(req, self._internal(req))
                continue
            req.steps.append(out.step)
            self._guarded(lambda r, ev=out: self._deliver(r, ev), req)
        for (req, _), ev in zip(chunks, firsts):
            if isinstance(ev, Exception):
                log.error("prefill failed for %s", req.request_id, exc_info=ev)
                self._fail(req, self._internal(req))
            elif ev is not None:  # the prompt is done: its first token
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(len(req.prompt_ids))
                self._guarded(lambda r, e=ev: self._deliver(r, e), req)

    @staticmethod
    def _internal(req: EngineRequest) -> RequestFailed:
        """An internal error as the client sees it: the request id, no internals (those are logged)."""
        return RequestFailed(f"internal error while serving request {req.request_id}; the details are in the "
                             "server log")

    def _deliver(self, req: EngineRequest, ev: GenerationEvent) -> None:
        now = time.perf_counter()
        n = len(ev.token_ids)
        if n:
            if req.first_token is None:
                req.first_token = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - req.arrival)
            elif self.metrics is not None:
                per = (now - req.last_token) / n
                for _ in range(n):
                    self.metrics.itl.observe(per)
            req.last_token = now
            req.n_tokens += n
            if self.metrics is not None:
                self.metrics.generation_tokens.inc(n)
        if ev.finish_reason is not None:
            self._finish(req, ev.finish_reason, ev)
        else:
            self._send(req, ev)

    def _finish(self, req: EngineRequest, reason: str, ev: object) -> None:
        req.finish_reason = reason
        req.finished = time.perf_counter()
        if self.metrics is not None:
            self.metrics.requests.labels(finish_reason=reason).inc()
            self.metrics.e2e.observe(req.finished - req.arrival)
        if req.seq is not None and self.engine is not None:
            self.engine.release(req.seq)  # its KV slot goes back to the pool at once
        req.seq = None  # frees the drafter state
        record = req.final = req.record()
        with self._cv:
            self.recent.append(record)
        self._send(req, ev)
        req.steps = []  # the record holds the summary; keep nothing per step

    def _fail(self, req: EngineRequest, err: RequestFailed) -> None:
        self._finish(req, "error", err)

    @staticmethod
    def _send(req: EngineRequest, item: object) -> None:
        if req.delivered == req.read:
            req.unread_since = time.perf_counter()
        req.delivered += 1
        try:
            req.sink(item)
        except Exception:  # noqa: BLE001 - the client's loop may be gone (shutdown); never kill the worker
            log.debug("could not deliver to %s", req.request_id, exc_info=True)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.waiting.set(len(self._waiting))
            self.metrics.running.set(len(self._running))
