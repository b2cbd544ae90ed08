"""Request -> engine -> response: the OpenAI chat and text completion endpoints' logic.

Everything that can be refused is refused before the request is queued (validation, model
name, context length, full queue), so those errors carry a real HTTP status. After a stream
has started, an error is sent as one `data: {"error": ...}` frame and the stream ends.
Tokenisation runs on a single helper thread and model work on the scheduler's worker, so
the event loop only moves bytes.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.engine import ContextLengthError, GenerationEvent
from engine.sampling import SamplingParams
from server.protocol import (APIError, ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessageOut,
                             CompletionChoice, CompletionRequest, CompletionResponse, ModelCard, ModelList,
                             SpecStats, UsageInfo, parse_request)
from server.scheduler import EngineRequest, NotReadyError, QueueFullError, RequestFailed, Scheduler

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def spec_stats(req: EngineRequest) -> SpecStats:
    """The response's 'bastion' extension from the request's verification steps."""
    steps = req.steps
    n = len(steps)
    return SpecStats(
        steps=n,
        tau=round(sum(s.accepted for s in steps) / n, 4) if n else 0.0,
        mean_tree_size=round(sum(s.tree_size for s in steps) / n, 4) if n else 0.0,
        draft_tokens=sum(s.tree_size - 1 for s in steps),
        accepted_tokens=sum(min(s.accepted_depth, s.accepted) for s in steps),
    )


def sse(obj: dict | str) -> str:
    """One server-sent-events frame: 'data: <json>\\n\\n' (or the literal [DONE])."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def failure_to_api_error(err: RequestFailed) -> APIError:
    if err.client_error:
        return APIError(400, str(err), code="invalid_request")
    return APIError(500, str(err), type="server_error", code="internal_error")


CANCELLED = APIError(503, "the request was cancelled because the server is shutting down", type="server_error",
                     code="cancelled")


class OpenAIServing:
    """The endpoints' logic over one Scheduler.

    served_model_name: the id clients must send as `model` (None: the target's name once loaded).
    """

    def __init__(self, scheduler: Scheduler, served_model_name: str | None = None):
        self.scheduler = scheduler
        self._name = served_model_name
        self._tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bastion-tokenizer")
        self.created = int(time.time())

    def close(self) -> None:
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def engine(self):
        """The loaded Engine; raises APIError(503) while the model is loading."""
        eng = self.scheduler.engine
        if eng is None or not self.scheduler.ready.is_set():
            raise APIError(503, "the model is still loading; retry shortly", type="server_error",
                           code="model_not_ready", headers={"Retry-After": "5"})
        return eng

    @property
    def model_name(self) -> str:
        return self._name or self.engine.target.name

    # ---- GET /v1/models --------------------------------------------------------------------
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         max_model_len=self.engine.max_context())])

    # ---- shared preparation ----------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    async def _tokenize(self, fn, *args) -> list[int]:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._tok_pool, fn, *args)
        except Exception as e:  # jinja TemplateError, tokenizer ValueError: the input is at fault
            raise APIError(400, f"the prompt could not be tokenized: {e}", param="messages",
                           code="invalid_prompt") from None

    def _params(self, body, prompt_len: int) -> SamplingParams:
        """SamplingParams for the request; max_tokens defaults to the remaining context.

        Raises APIError(400) for a prompt + max_tokens over the context length or an invalid value.
        """
        eng = self.engine
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, eng.max_context() - prompt_len)
        params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
                                max_tokens=max_tokens, stop=body.stop_list(), seed=body.seed)
        try:
            params.validate()
            eng.check_length(prompt_len, max_tokens)
        except ContextLengthError as e:
            raise APIError(400, str(e), param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        return params

    def _submit(self, prefix: str, prompt_ids: list[int], params: SamplingParams
                ) -> tuple[EngineRequest, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(item: object) -> None:  # called on the worker thread
            loop.call_soon_threadsafe(queue.put_nowait, item)

        req = EngineRequest(self.scheduler.new_id(prefix), prompt_ids, params, sink)
        try:
            self.scheduler.submit(req)
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except NotReadyError as e:
            raise APIError(503, str(e), type="server_error", code="not_ready", headers={"Retry-After": "5"}) from None
        return req, queue

    @staticmethod
    async def _events(req: EngineRequest, queue: asyncio.Queue) -> AsyncIterator[GenerationEvent]:
        """The request's events until the one with a finish_reason; cancels the request if abandoned.

        Raises RequestFailed when the engine failed on this request.
        """
        try:
            while True:
                item = await queue.get()
                if isinstance(item, RequestFailed):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if req.finish_reason is None:
                req.cancel()

    async def _run_unary(self, req: EngineRequest, queue: asyncio.Queue, http: Request) -> tuple[str, int, str]:
        """Collect (text, completion tokens, finish_reason), cancelling if the client disconnects.

        Raises APIError on engine failure or shutdown cancellation.
        """
        async def collect():
            parts, n, finish = [], 0, None
            async for ev in self._events(req, queue):
                parts.append(ev.text)
                n += len(ev.token_ids)
                finish = ev.finish_reason
            return "".join(parts), n, finish

        task = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(_wait_disconnect(http))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                req.cancel()
        if task not in done:  # the client is gone; nobody reads this
            raise APIError(499, "client disconnected", code="client_disconnected")
        try:
            text, n, finish = task.result()
        except RequestFailed as e:
            raise failure_to_api_error(e) from None
        if finish == "cancelled":
            raise CANCELLED
        return text, n, finish

    # ---- POST /v1/chat/completions ---------------------------------------------------------
    async def chat(self, raw: bytes, http: Request):
        body: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw)
        self._check_model(body.model)
        eng = self.engine
        messages = [m.as_template_dict() for m in body.messages]
        prompt_ids = await self._tokenize(eng.chat_prompt_ids, messages)
        params = self._params(body, len(prompt_ids))
        req, queue = self._submit("chatcmpl", prompt_ids, params)
        model, created = self.model_name, int(time.time())
        if body.stream:
            gen = self._chat_stream(req, queue, model, created, body.include_usage)
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={**SSE_HEADERS, "X-Request-Id": req.request_id})
        text, n, finish = await self._run_unary(req, queue, http)
        resp = ChatCompletionResponse(
            id=req.request_id, created=created, model=model,
            choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=finish)],
            usage=UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=n, total_tokens=len(prompt_ids) + n),
            bastion=spec_stats(req),
        )
        return JSONResponse(resp.model_dump(), headers={"X-Request-Id": req.request_id})

    def _chat_stream(self, req: EngineRequest, queue: asyncio.Queue, model: str, created: int,
                     include_usage: bool) -> AsyncIterator[str]:
        head = {"id": req.request_id, "object": "chat.completion.chunk", "created": created, "model": model}

        def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
            out = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            if include_usage:
                out["usage"] = None
            return {**out, **extra}

        return self._stream_frames(
            req, queue, include_usage,
            first=chunk({"role": "assistant", "content": ""}),
            text_chunk=lambda t: chunk({"content": t}),
            final_chunk=lambda f, stats: chunk({}, f, bastion=stats),
            usage_chunk=lambda u: {**head, "choices": [], "usage": u})

    async def _stream_frames(self, req, queue, include_usage, first, text_chunk, final_chunk, usage_chunk
                             ) -> AsyncIterator[str]:
        """SSE frames: `first` (may be None), one per text delta, the finish chunk with the
        'bastion' stats, the usage chunk when asked, then [DONE]; or an error frame and the end."""
        n = 0
        try:
            if first is not None:
                yield sse(first)
            async for ev in self._events(req, queue):
                n += len(ev.token_ids)
                if ev.finish_reason == "cancelled":
                    yield sse(CANCELLED.envelope())
                    return
                if ev.text:
                    yield sse(text_chunk(ev.text))
                if ev.finish_reason is not None:
                    yield sse(final_chunk(ev.finish_reason, spec_stats(req).model_dump()))
        except RequestFailed as e:
            yield sse(failure_to_api_error(e).envelope())
            return
        finally:
            if req.finish_reason is None:  # the client left before the end (even before the first event)
                req.cancel()
        if include_usage:
            p = len(req.prompt_ids)
            yield sse(usage_chunk({"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}))
        yield sse("[DONE]")

    # ---- POST /v1/completions --------------------------------------------------------------
    async def completion(self, raw: bytes, http: Request):
        body: CompletionRequest = parse_request(CompletionRequest, raw)
        self._check_model(body.model)
        eng = self.engine
        prompt_ids = await self._tokenize(lambda p: list(eng.tokenizer(p)["input_ids"]), body.prompt)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        params = self._params(body, len(prompt_ids))
        req, queue = self._submit("cmpl", prompt_ids, params)
        model, created = self.model_name, int(time.time())
        if body.stream:
            def chunk(text: str, finish: str | None = None, **extra) -> dict:
                out = {"id": req.request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
                if body.include_usage:
                    out["usage"] = None
                out.update(extra)
                return out

            gen = self._stream_frames(
                req, queue, body.include_usage, first=None, text_chunk=chunk,
                final_chunk=lambda f, stats: chunk("", f, bastion=stats),
                usage_chunk=lambda u: {"id": req.request_id, "object": "text_completion", "created": created,
                                       "model": model, "choices": [], "usage": u})
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={**SSE_HEADERS, "X-Request-Id": req.request_id})
        text, n, finish = await self._run_unary(req, queue, http)
        resp = CompletionResponse(
            id=req.request_id, created=created, model=model,
            choices=[CompletionChoice(text=text, finish_reason=finish)],
            usage=UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=n, total_tokens=len(prompt_ids) + n),
            bastion=spec_stats(req),
        )
        return JSONResponse(resp.model_dump(), headers={"X-Request-Id": req.request_id})


async def _wait_disconnect(http: Request) -> None:
    """Return when the client disconnects (the body has been read, so receive() only reports that)."""
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return
