"""Server pieces that need no model: request validation, error envelope, SSE framing, stream chunks."""
import json

import pytest
from prometheus_client import CollectorRegistry

from server.metrics import server_metrics
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from server.serving import sse

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> bytes:
    return json.dumps({"messages": MSG, **kw}).encode()


def test_valid_request_defaults_and_aliases():
    r = parse_request(ChatCompletionRequest, chat(max_tokens=5, max_completion_tokens=7, stop="x", unknown=1))
    assert r.requested_max_tokens() == 7  # max_completion_tokens wins
    assert r.stop_list() == ["x"]
    assert r.temperature == 1.0 and r.top_p == 1.0 and r.n == 1 and r.stream is False
    r = parse_request(ChatCompletionRequest, json.dumps({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "q"}]}).encode())
    assert [m.as_template_dict() for m in r.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "q"}]
    assert parse_request(ChatCompletionRequest, chat(temperature=1)).temperature == 1.0  # int accepted as float


@pytest.mark.parametrize("body, param, words", [
    (b"{", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    (json.dumps({"messages": []}).encode(), "messages", "at least 1"),
    (json.dumps({"messages": [{"role": "bot", "content": "x"}]}).encode(), "messages[0].role", "'user'"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
     "messages[0].content[0]", "text"),
    (chat(n=2), "n", "n must be 1"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (chat(logprobs=True), "logprobs", "not supported"),
    (chat(max_tokens="5"), "max_tokens", "integer"),
    (chat(stream_options={"include_usage": True}), None, "stream_options"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None, ""),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', None, "surrogate pair (U+D800-U+DFFF) without"),
    (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', None, "surrogate pair"),
])
def test_invalid_requests_name_the_field(body, param, words):
    with pytest.raises(APIError) as ei:
        parse_request(ChatCompletionRequest, body)
    e = ei.value
    assert e.status == 400 and e.type == "invalid_request_error"
    if param is not None:
        assert e.param is not None and e.param.startswith(param)
    assert words in e.message
    env = e.envelope()["error"]
    assert set(env) == {"message", "type", "param", "code"} and env["message"] == e.message


def test_only_surrogate_escapes_are_called_unpaired_surrogates():
    """The surrogate message needs a \\uD800-\\uDFFF escape at the reported position: on another
    line than the first it is found, raw surrogate bytes (invalid UTF-8) and other bad escapes keep
    the parser's own message."""
    with pytest.raises(APIError, match="surrogate pair"):
        parse_request(ChatCompletionRequest, b'{"messages": [\n{"role": "user",\n"content": "\\udc00"}]}')
    for body, words in ((b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}', "invalid unicode code point"),
                        (b'{"messages": [{"role": "user", "content": "\\u12"}]}', "invalid escape")):
        with pytest.raises(APIError) as ei:
            parse_request(ChatCompletionRequest, body)
        assert words in ei.value.message and "surrogate" not in ei.value.message


def test_completion_request_refuses_unsupported_options():
    assert parse_request(CompletionRequest, b'{"prompt": "a"}').prompt == "a"
    for extra in ({"echo": True}, {"best_of": 3}, {"logprobs": 2}, {"suffix": "z"}):
        with pytest.raises(APIError):
            parse_request(CompletionRequest, json.dumps({"prompt": "a", **extra}).encode())


def test_sse_frames():
    assert sse("[DONE]") == "data: [DONE]\n\n"
    frame = sse({"a": "é"})
    assert frame == 'data: {"a":"é"}\n\n'


def test_server_metrics_once_per_registry():
    reg = CollectorRegistry()
    assert server_metrics(reg) is server_metrics(reg)  # no duplicate registration
    other = server_metrics(CollectorRegistry())
    assert other is not server_metrics(reg)
    m = server_metrics(reg)
    m.generation_tokens.inc(3)
    assert reg.get_sample_value("bastion_generation_tokens_total") == 3.0
    assert reg.get_sample_value("bastion_estimated_speedup") == 1.0


def test_serve_flags_read_environment_and_command_line_wins(monkeypatch):
    import argparse

    from bastion.serve import add_arguments

    for k, v in {"HOST": "0.0.0.0", "PORT": "9001", "API_KEY": "sk-env", "MAX_QUEUE": "3", "MAX_RUNNING": "2",
                 "SERVED_MODEL_NAME": "m", "MAX_BODY_BYTES": "1000", "SHUTDOWN_TIMEOUT": "2.5", "MODE": "ar"}.items():
        monkeypatch.setenv(f"BASTION_{k}", v)
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    assert (a.host, a.port, a.api_key, a.max_queue, a.max_running, a.served_model_name, a.max_body_bytes,
            a.shutdown_timeout, a.mode) == ("0.0.0.0", 9001, "sk-env", 3, 2, "m", 1000, 2.5, "ar")
    assert p.parse_args(["--port", "9002"]).port == 9002
    monkeypatch.delenv("BASTION_PORT")
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).port == 8000 and p.parse_args([]).host == "0.0.0.0"
    monkeypatch.setenv("BASTION_PORT", "not-a-number")
    p = argparse.ArgumentParser()
    add_arguments(p)  # building the parser never fails on a bad environment value...
    with pytest.raises(SystemExit):
        p.parse_args([])  # ...parsing reports it as a usage error


def test_stream_chunks_are_typed_and_framed_like_openai():
    from server.protocol import (ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChunk,
                                 CompletionChunkChoice, SpecStats, UsageInfo)

    first = ChatCompletionChunk(id="c1", created=5, model="m", choices=[ChatChunkChoice(
        delta=ChatDelta(role="assistant", content=""))])
    assert first.frame(False) == {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
                                  "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "finish_reason": None, "logprobs": None}]}
    stats = SpecStats(steps=2, tau=1.5, mean_tree_size=4.0, draft_tokens=6, accepted_tokens=1)
    final = ChatCompletionChunk(id="c1", created=5, model="m", bastion=stats,
                                choices=[ChatChunkChoice(delta=ChatDelta(), finish_reason="stop")])
    frame = final.frame(True)
    assert frame["choices"][0]["delta"] == {} and frame["usage"] is None and frame["bastion"]["tau"] == 1.5
    usage = ChatCompletionChunk(id="c1", created=5, model="m", choices=[],
                                usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5))
    assert usage.frame(True)["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    text = CompletionChunk(id="t", created=1, model="m", choices=[CompletionChunkChoice(text="hi")])
    assert text.frame(False) == {"id": "t", "object": "text_completion", "created": 1, "model": "m",
                                 "choices": [{"index": 0, "text": "hi", "finish_reason": None, "logprobs": None}]}
