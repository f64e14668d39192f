"""OpenAI's Responses API through the official `openai` client against a live server: `responses.create` (plain,
function tools and a function_call_output turn, `text.format` json_schema), `responses.stream` (the client checks
the event sequence), `max_output_tokens` as an incomplete response, `previous_response_id` and
`GET /v1/responses/{id}` with the store on, their 400/404 with it off, and bad input as a 400 naming the field.

Oracles: the single-sequence reference loop (`LLM.chat` on a batch-1 model) for greedy text, the model's tokenizer
over the chat template for token counts, `jsonschema` / pydantic for calls and structured replies, the non-streamed
response for the streamed one, and the client's own parsing and stream-state checks.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from helpers import live_server, one_thread_llms
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from neuron_opt.runtime.sampling import SamplingParams

MODEL = "tiny"
ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                       "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                      "required": ["a", "b"], "additionalProperties": False}}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    label: str = Field(max_length=6)


@pytest.fixture(scope="module")
def llms(tiny_dir):
    with one_thread_llms(tiny_dir("smollm-tok"), 768) as pair:
        yield pair


@pytest.fixture(scope="module")
def server(llms):
    with live_server(llms[0], max_num_seqs=4, enable_store=True) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def test_create_equals_the_reference(llms, client):
    r = client.responses.create(model=MODEL, input="Tell me a story.", instructions="Be brief.", temperature=0,
                                max_output_tokens=30)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    want = llms[1].chat(msgs, SamplingParams(max_tokens=30, temperature=0))
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == ("completed" if want.finish_reason == "stop" else "incomplete")
    assert r.output_text == want.text and [o.type for o in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == len(llms[1].encode_chat(msgs)) and r.usage.output_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def strict(response: dict) -> None:
    """`response` against the client's own type, strictly. Its usage field by field: this client's type also
    requires `input_tokens_details.cache_write_tokens`, which is not tracked here."""
    usage = response.pop("usage")
    Response.model_validate(response)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 <= usage["input_tokens_details"]["cached_tokens"] <= usage["input_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


def test_the_wire_format_is_the_clients_types_strictly(server):
    body = {"model": MODEL, "input": "What is 2 + 3?", "tools": [WEATHER, ADD], "tool_choice": "required",
            "max_output_tokens": 150, "temperature": 0, "instructions": "Use the tools. " * 30}
    first = httpx.post(server[0] + "/v1/responses", json=body).json()
    again = httpx.post(server[0] + "/v1/responses", json=body).json()
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the same prompt: from the prefix cache
    strict(first)
    with httpx.stream("POST", server[0] + "/v1/responses", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for e in events:
        if e["type"] in ("response.completed", "response.incomplete"):
            strict(e["response"])
        TypeAdapter(ResponseStreamEvent).validate_python(e)
    assert events[-1]["response"]["output"][0]["type"] == "function_call"


def test_max_output_tokens_gives_an_incomplete_response(client):
    r = client.responses.create(model=MODEL, input="Tell me a story.", temperature=0, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    events = [e.type for e in client.responses.create(model=MODEL, input="Tell me a story.", temperature=0,
                                                      max_output_tokens=5, stream=True)]
    assert events[-1] == "response.incomplete" and "response.completed" not in events


def test_stream_events_and_the_final_response_equal_the_created_one(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there."}]}],
              temperature=0, max_output_tokens=60,  # (a schema, so that the random model's reply ends)
              text={"format": {"type": "json_schema", "name": "point", "schema": Point.model_json_schema()}})
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == "completed"


def _calls(response, tools) -> list[tuple[str, dict]]:
    out = []
    for item in response.output:
        if item.type != "function_call":
            continue
        tool = next(t for t in tools if t["name"] == item.name)
        args = json.loads(item.arguments)
        jsonschema.validate(args, tool["parameters"])
        assert item.call_id.startswith("call_") and item.id.startswith("fc_")
        out.append((item.name, args))
    return out


def test_function_tools_and_a_function_call_output_turn(client):
    ask = [{"role": "user", "content": "What is 2 + 3?"}]
    r = client.responses.create(model=MODEL, input=ask, tools=[WEATHER, ADD], temperature=0, max_output_tokens=150,
                                tool_choice={"type": "function", "name": "add"})
    calls = _calls(r, [ADD])
    assert [o.type for o in r.output] == ["function_call"] and len(calls) == 1
    with client.responses.stream(model=MODEL, input=ask, tools=[WEATHER, ADD], temperature=0, max_output_tokens=150,
                                 tool_choice={"type": "function", "name": "add"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _calls(final, [ADD]) == calls
    assert [e.type for e in events if "function_call" in e.type] == [
        "response.function_call_arguments.delta", "response.function_call_arguments.done"]
    call = r.output[0]
    turn = [*ask, call,  # the output item taken back as input, as the client serializes it
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    second = client.responses.create(model=MODEL, input=turn, tools=[WEATHER, ADD], temperature=0,
                                     max_output_tokens=40)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > r.usage.input_tokens
    required = client.responses.create(model=MODEL, input="Anything.", tools=[WEATHER, ADD], temperature=0,
                                       tool_choice="required", parallel_tool_calls=False, max_output_tokens=150)
    assert len(_calls(required, [WEATHER, ADD])) == 1


def test_text_format_json_schema_is_enforced(client):
    fmt = {"type": "json_schema", "name": "point", "schema": Point.model_json_schema()}
    r = client.responses.create(model=MODEL, input="A point.", temperature=0, max_output_tokens=60,
                                text={"format": fmt})
    Point.model_validate_json(r.output_text)
    assert r.text.format.type == "json_schema"
    parsed = client.responses.parse(model=MODEL, input="A point.", temperature=0, max_output_tokens=60,
                                    text_format=Point)
    assert isinstance(parsed.output_parsed, Point)
    obj = client.responses.create(model=MODEL, input="JSON please.", temperature=0, max_output_tokens=60,
                                  text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


def test_previous_response_id_continues_the_conversation(llms, client, server):
    first = client.responses.create(model=MODEL, input="Name a colour.", temperature=0, max_output_tokens=8,
                                    instructions="Answer in one word.")
    second = client.responses.create(model=MODEL, input="And another?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=8)
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"}]  # (instructions are not carried over)
    assert second.usage.input_tokens == len(llms[1].encode_chat(msgs))
    assert second.previous_response_id == first.id and second.store is True
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_without_the_store_previous_response_id_is_a_400_and_get_a_404(llms):
    with live_server(llms[1], max_num_seqs=1) as (url, _):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = c.responses.create(model=MODEL, input="Hi.", max_output_tokens=2)
        assert r.store is False
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=MODEL, input="Hi.", previous_response_id=r.id, max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"input": "x", "tools": [ADD], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": {
        "type": "string", "format": "bogus"}}}}, "text.format"),
    ({"input": "x", "tools": [ADD], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": []}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(server, client, body, param):
    r = httpx.post(server[0] + "/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and err["type"] == "BadRequestError", err
    assert client.responses.create(model=MODEL, input="ok", max_output_tokens=1).usage.output_tokens == 1
