"""The events that end a `serve --data-parallel` stream whose replica failed (server/cluster/answers.py), read by
the official `openai` and `anthropic` clients: each client must see an error, never a stream that ends as if
finished. The events are served by a FastAPI app as the router serves them (no Ray needed here; the router's use of
them under a real replica kill is tests/cluster/test_faults.py)."""

from __future__ import annotations

import anthropic
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from neuron_opt.server.cluster.answers import ANTHROPIC, OPENAI, RESPONSES, error_content, failed_stream
from neuron_opt.server.serving import sse

MESSAGE = "the replica serving this stream failed: ActorDiedError"


def _app() -> FastAPI:
    app = FastAPI()
    completion = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                  "choices": [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None}]}

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        return StreamingResponse(iter([sse(completion), *failed_stream(OPENAI, 503, MESSAGE, 1)]),
                                 media_type="text/event-stream")

    @app.post("/v1/messages")
    async def messages() -> StreamingResponse:
        return StreamingResponse(iter(failed_stream(ANTHROPIC, 503, MESSAGE, 0)), media_type="text/event-stream")

    @app.post("/v1/responses")
    async def responses() -> StreamingResponse:
        return StreamingResponse(iter(failed_stream(RESPONSES, 503, MESSAGE, 2)), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def http():
    with TestClient(_app(), base_url="http://router") as client:
        yield client


def test_openai_stream_ends_with_an_error_the_client_raises(http):
    client = openai.OpenAI(base_url="http://router/v1", api_key="x", http_client=http, max_retries=0)
    texts = []
    with pytest.raises(openai.APIError, match="replica serving this stream failed"):
        for chunk in client.completions.create(model="m", prompt="hi", stream=True):
            texts.append(chunk.choices[0].text)
    assert texts == ["Hel"]
    assert failed_stream(OPENAI, 504, "silent", 3)[-1] == "data: [DONE]\n\n"


def test_anthropic_stream_ends_with_anthropics_error_event(http):
    client = anthropic.Anthropic(base_url="http://router", api_key="x", http_client=http, max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="replica serving this stream failed") as e:
        for _ in client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                        stream=True):
            pass
    assert e.value.body["error"]["type"] == "overloaded_error"


def test_responses_stream_ends_with_its_error_event(http):
    client = openai.OpenAI(base_url="http://router/v1", api_key="x", http_client=http, max_retries=0)
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert [(e.type, e.sequence_number, e.message) for e in events] == [("error", 2, MESSAGE)]


def test_error_bodies_take_each_apis_shape():
    body = {"error": {"message": "messages: empty", "type": "BadRequestError", "param": "messages", "code": 400}}
    assert error_content(OPENAI, 400, body) is body and error_content(RESPONSES, 400, body) is body
    assert error_content(ANTHROPIC, 400, body) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "messages: empty"}}
