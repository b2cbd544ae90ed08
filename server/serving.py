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
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jinja2.exceptions import TemplateError

from engine.engine import ContextLengthError, ModelInfo
from engine.sampling import RequestError, SamplingParams
from server.protocol import (APIError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                             ChatCompletionResponse, ChatDelta, ChatMessageOut, CompletionChoice, CompletionChunk,
                             CompletionChunkChoice, CompletionRequest, CompletionResponse, ModelCard, ModelList,
                             SpecStats, StreamChunk, UsageInfo, parse_request)
from server.scheduler import GenerationStream, NotReadyError, QueueFullError, RequestFailed, Scheduler

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def spec_stats(stream: GenerationStream) -> SpecStats:
    """The response's 'bastion' extension from the request's step summary (engine/accounting.py)."""
    s = stream.summary()
    return SpecStats(steps=s.steps, tau=round(s.tau, 4), mean_tree_size=round(s.mean_tree_size, 4),
                     draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens)


def sse(obj: dict | str) -> str:
    """One server-sent-events frame: 'data: <json>\\n\\n' (or the literal [DONE])."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def failure_to_api_error(err: RequestFailed) -> APIError:
    if err.client_error:
        return APIError(400, str(err), param=err.param, code="invalid_request")
    return APIError(500, str(err), type="server_error", code="internal_error")


def not_ready_error(err: NotReadyError) -> APIError:
    """503 with Retry-After; the message never carries internals (paths, exception text)."""
    return APIError(503, str(err), type="server_error", code=err.code, headers={"Retry-After": "5"})


#: Tokenisations allowed to wait for the tokenizer thread; more get HTTP 429 (bounds the work
#: done in front of the scheduler's admission check).
MAX_PENDING_TOKENIZE = 64


CANCELLED = APIError(503, "the request was cancelled because the server is shutting down", type="server_error",
                     code="cancelled")


class OpenAIServing:
    """The endpoints' logic over one Scheduler; it sees the model only as a ModelInfo.

    served_model_name: the id clients must send as `model` (None: the target's name once loaded).
    max_tokens_limit: the most tokens one request may generate (None: the rest of the context);
    requests asking for more are refused with 400, those that do not say get at most this.
    """

    def __init__(self, scheduler: Scheduler, served_model_name: str | None = None,
                 max_tokens_limit: int | None = None):
        self.scheduler = scheduler
        self._name = served_model_name
        self.max_tokens_limit = max_tokens_limit
        self._tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bastion-tokenizer")
        self._tok_pending = 0
        self.created = int(time.time())

    def close(self) -> None:
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def model(self) -> ModelInfo:
        """The loaded model's ModelInfo; raises APIError(503) while it is loading, after a
        failure and while the server shuts down (the code says which)."""
        info = self.scheduler.model_info
        if info is None or self.scheduler.draining:
            try:
                self.scheduler.check_admission()
            except NotReadyError as e:
                raise not_ready_error(e) from None
            except QueueFullError:
                pass
            raise APIError(503, "the model is not ready", type="server_error", code="model_not_ready",
                           headers={"Retry-After": "5"})
        return info

    @property
    def model_name(self) -> str:
        return self._name or self.model.name

    # ---- GET /v1/models --------------------------------------------------------------------
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         max_model_len=self.model.max_context, dtype=self.model.dtype)])

    # ---- shared preparation ----------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    async def _tokenize(self, fn, *args, param: str = "messages") -> list[int]:
        """Run a tokenisation on the tokenizer thread, after a cheap admission check.

        Raises APIError 429/503 when the request would be refused anyway (nothing is
        tokenised then), 429 when MAX_PENDING_TOKENIZE tokenisations already wait, 400 when
        the chat template refuses the messages, 500 (logged, no details) for anything else.
        """
        self._admission()
        if self._tok_pending >= MAX_PENDING_TOKENIZE:
            raise APIError(429, "too many requests are being prepared; retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()
        self._tok_pending += 1
        try:
            return await loop.run_in_executor(self._tok_pool, fn, *args)
        except TemplateError as e:  # the template's own check (e.g. roles must alternate): the input's fault
            raise APIError(400, f"the chat template refused the messages: {e.message}", param=param,
                           code="invalid_prompt") from None
        except Exception:  # noqa: BLE001 - tokenizer internals are not the client's business
            log.exception("tokenisation failed")
            raise APIError(500, "internal error while tokenising the prompt; the details are in the server log",
                           type="server_error", code="internal_error") from None
        finally:
            self._tok_pending -= 1

    def _admission(self) -> None:
        """Refuse now what the scheduler would refuse at submit (full, loading, draining)."""
        try:
            self.scheduler.check_admission()
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except NotReadyError as e:
            raise not_ready_error(e) from None

    def _params(self, body, prompt_len: int) -> SamplingParams:
        """SamplingParams for the request; max_tokens defaults to the remaining context.

        Raises APIError(400) for a prompt + max_tokens over the context length or an invalid value.
        """
        info = self.model
        max_tokens = body.requested_max_tokens()
        limit = self.max_tokens_limit
        if max_tokens is None:
            max_tokens = max(1, info.max_context - prompt_len)
            if limit is not None:
                max_tokens = min(max_tokens, limit)
        elif limit is not None and max_tokens > limit:
            raise APIError(400, f"max_tokens ({max_tokens}) exceeds this server's limit of {limit} tokens",
                           param="max_tokens", code="invalid_value")
        params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
                                max_tokens=max_tokens, stop=body.stop_list(), seed=body.seed)
        prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        try:
            params.validate()
            info.check_length(prompt_len, max_tokens)
        except ContextLengthError as e:
            param = prompt_param if e.param == "messages" else e.param
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except RequestError as e:
            param = prompt_param if e.param == "messages" else e.param
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        return params

    def _generate(self, prefix: str, prompt_ids: list[int], params: SamplingParams) -> GenerationStream:
        """Queue the request (Scheduler.generate); refusals become their HTTP errors."""
        try:
            return self.scheduler.generate(prompt_ids, params, prefix)
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except NotReadyError as e:
            raise not_ready_error(e) from None

    async def _run_unary(self, stream: GenerationStream, http: Request) -> tuple[str, int, str]:
        """Collect (text, completion tokens, finish_reason), cancelling if the client disconnects.

        Raises APIError on engine failure or shutdown cancellation.
        """
        async def collect():
            parts, n, finish = [], 0, None
            async with stream:
                async for ev in stream:
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
                stream.close()
        if task not in done:  # the client is gone; nobody reads this
            raise APIError(499, "client disconnected", code="client_disconnected")
        try:
            text, n, finish = task.result()
        except RequestFailed as e:
            raise failure_to_api_error(e) from None
        if finish == "cancelled":
            raise CANCELLED
        return text, n, finish

    async def _stream_frames(self, stream: GenerationStream, include_usage: bool, first: StreamChunk | None,
                             text_chunk: Callable[[str], StreamChunk],
                             final_chunk: Callable[[str, SpecStats], StreamChunk],
                             usage_chunk: Callable[[UsageInfo], StreamChunk]) -> AsyncIterator[str]:
        """SSE frames: `first` (may be None), one per text delta, the finish chunk with the
        'bastion' stats, the usage chunk when asked, then [DONE]; or an error frame and the end."""
        n = 0
        async with stream:  # a client that leaves before the end cancels the request
            try:
                if first is not None:
                    yield sse(first.frame(include_usage))
                async for ev in stream:
                    n += len(ev.token_ids)
                    if ev.finish_reason == "cancelled":
                        yield sse(CANCELLED.envelope())
                        return
                    if ev.text:
                        yield sse(text_chunk(ev.text).frame(include_usage))
                    if ev.finish_reason is not None:
                        yield sse(final_chunk(ev.finish_reason, spec_stats(stream)).frame(include_usage))
            except RequestFailed as e:
                yield sse(failure_to_api_error(e).envelope())
                return
        if include_usage:
            p = stream.prompt_tokens
            yield sse(usage_chunk(UsageInfo(prompt_tokens=p, completion_tokens=n, total_tokens=p + n)).frame(True))
        yield sse("[DONE]")

    # ---- POST /v1/chat/completions ---------------------------------------------------------
    async def chat(self, raw: bytes, http: Request):
        body: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw)
        self._check_model(body.model)
        info = self.model
        messages = [m.as_template_dict() for m in body.messages]
        prompt_ids = await self._tokenize(info.encode_chat, messages)
        params = self._params(body, len(prompt_ids))
        stream = self._generate("chatcmpl", prompt_ids, params)
        model, created = self.model_name, int(time.time())
        rid = stream.request_id
        if body.stream:
            def chunk(delta: ChatDelta, finish: str | None = None, stats: SpecStats | None = None):
                return ChatCompletionChunk(id=rid, created=created, model=model, bastion=stats,
                                           choices=[ChatChunkChoice(delta=delta, finish_reason=finish)])

            gen = self._stream_frames(
                stream, body.include_usage,
                first=chunk(ChatDelta(role="assistant", content="")),
                text_chunk=lambda t: chunk(ChatDelta(content=t)),
                final_chunk=lambda f, stats: chunk(ChatDelta(), f, stats),
                usage_chunk=lambda u: ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=u))
            return StreamingResponse(gen, media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": rid})
        text, n, finish = await self._run_unary(stream, http)
        resp = ChatCompletionResponse(
            id=rid, created=created, model=model,
            choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=finish)],
            usage=UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=n, total_tokens=len(prompt_ids) + n),
            bastion=spec_stats(stream),
        )
        return JSONResponse(resp.model_dump(), headers={"X-Request-Id": rid})

    # ---- POST /v1/completions --------------------------------------------------------------
    async def completion(self, raw: bytes, http: Request):
        body: CompletionRequest = parse_request(CompletionRequest, raw)
        self._check_model(body.model)
        info = self.model
        prompt_ids = await self._tokenize(info.encode_text, body.prompt, param="prompt")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        params = self._params(body, len(prompt_ids))
        stream = self._generate("cmpl", prompt_ids, params)
        model, created = self.model_name, int(time.time())
        rid = stream.request_id
        if body.stream:
            def chunk(text: str, finish: str | None = None, stats: SpecStats | None = None):
                return CompletionChunk(id=rid, created=created, model=model, bastion=stats,
                                       choices=[CompletionChunkChoice(text=text, finish_reason=finish)])

            gen = self._stream_frames(
                stream, body.include_usage, first=None, text_chunk=chunk,
                final_chunk=lambda f, stats: chunk("", f, stats),
                usage_chunk=lambda u: CompletionChunk(id=rid, created=created, model=model, choices=[], usage=u))
            return StreamingResponse(gen, media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": rid})
        text, n, finish = await self._run_unary(stream, http)
        resp = CompletionResponse(
            id=rid, created=created, model=model,
            choices=[CompletionChoice(text=text, finish_reason=finish)],
            usage=UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=n, total_tokens=len(prompt_ids) + n),
            bastion=spec_stats(stream),
        )
        return JSONResponse(resp.model_dump(), headers={"X-Request-Id": rid})


async def _wait_disconnect(http: Request) -> None:
    """Return when the client disconnects (the body has been read, so receive() only reports that)."""
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return
