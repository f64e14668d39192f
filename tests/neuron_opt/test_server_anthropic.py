"""Anthropic's Messages API through the official `anthropic` client against a live server: `messages.create`,
`messages.stream`, forced and automatic tool use with a tool-result turn, `count_tokens`, `stop_sequences`, the API
key as `x-api-key` and as a bearer token, and bad input answered in Anthropic's error shape.

Oracles: the single-sequence reference loop (`LLM.chat` on a batch-1 model, same prompt and SamplingParams) for
greedy text, the model's tokenizer over the chat template for token counts, `jsonschema` for tool inputs, the
non-streamed message for the streamed one, and the client's own parsing of every response and event.
"""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from helpers import live_server, one_thread_llms
from pydantic import BaseModel, TypeAdapter

from neuron_opt.runtime.sampling import SamplingParams

MODEL = "tiny"
KEY = "sk-ant-test"
ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                        "required": ["a", "b"], "additionalProperties": False}}
WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}
USER = [{"role": "user", "content": "Tell me a story."}]
GREEDY = {"temperature": 0}  # (the client takes the sampling fields as extra_body)


@pytest.fixture(scope="module")
def llms(tiny_dir):
    with one_thread_llms(tiny_dir("smollm-tok"), 768) as pair:
        yield pair


@pytest.fixture(scope="module")
def server(llms):
    with live_server(llms[0], max_num_seqs=4, api_key=KEY) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0)


def test_create_equals_the_reference_and_reports_usage(llms, client):
    system = "You are terse."
    r = client.messages.create(model=MODEL, max_tokens=12, system=system, messages=USER, extra_body=GREEDY)
    msgs = [{"role": "system", "content": system}, *USER]
    want = llms[1].chat(msgs, SamplingParams(max_tokens=12, temperature=0))
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want.text
    assert r.usage.input_tokens == len(llms[1].encode_chat(msgs)) and r.usage.output_tokens == len(want.token_ids)
    assert r.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert r.stop_sequence is None


def test_stream_reassembles_the_created_message(server, client):
    kw = dict(model=MODEL, max_tokens=20, messages=USER, extra_body=GREEDY, system=[{"type": "text", "text": "Hi."}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text == final.content[0].text
    assert len(pieces) > 1
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    with httpx.stream("POST", server[0] + "/v1/messages", json={**kw.pop("extra_body"), **kw, "stream": True},
                      headers={"x-api-key": KEY}) as r:  # (the client drops pings: read the wire)
        lines = [line for line in r.iter_lines() if line.startswith("event: ")]
    raw = [line.removeprefix("event: ") for line in lines]
    assert raw[:3] == ["message_start", "content_block_start", "ping"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[3:-3]) == {"content_block_delta"} and len(raw) - 6 == len(pieces)


def test_stop_sequences_end_the_reply_and_name_the_sequence(llms, client):
    free = client.messages.create(model=MODEL, max_tokens=30, messages=USER, extra_body=GREEDY).content[0].text
    words = free.split()
    stop = next(w for w in words[1:] if w.isalpha())
    r = client.messages.create(model=MODEL, max_tokens=30, messages=USER, extra_body=GREEDY,
                               stop_sequences=["\x00never", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == free[:free.index(stop)]
    with client.messages.stream(model=MODEL, max_tokens=30, messages=USER, extra_body=GREEDY,
                                stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == r.content[0].text


def test_the_wire_format_is_the_clients_types_strictly(server):
    body = {"model": MODEL, "max_tokens": 150, "messages": USER, "tools": [WEATHER, ADD],
            "tool_choice": {"type": "any"}, "temperature": 0}
    h = {"x-api-key": KEY}
    Message.model_validate(httpx.post(server[0] + "/v1/messages", json=body, headers=h).json())
    with httpx.stream("POST", server[0] + "/v1/messages", json={**body, "stream": True}, headers=h) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for e in events:
        if e["type"] != "ping":  # (not one of the client's event types: it skips pings)
            TypeAdapter(RawMessageStreamEvent).validate_python(e)
    assert [e["type"] for e in events[-5:]] == ["content_block_start", "content_block_delta", "content_block_stop",
                                                "message_delta", "message_stop"]
    assert events[-4]["delta"]["type"] == "input_json_delta" and events[-2]["delta"]["stop_reason"] == "tool_use"


def _tool_input(block, tool) -> dict:
    assert block.type == "tool_use" and block.name == tool["name"] and block.id.startswith("toolu_")
    jsonschema.validate(block.input, tool["input_schema"])
    return block.input


def test_a_forced_tool_gives_a_valid_tool_use_then_a_tool_result_turn(client):
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    r = client.messages.create(model=MODEL, max_tokens=150, messages=msgs, tools=[WEATHER, ADD], extra_body=GREEDY,
                               tool_choice={"type": "tool", "name": "add"})
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    args = _tool_input(r.content[0], ADD)
    with client.messages.stream(model=MODEL, max_tokens=150, messages=msgs, tools=[WEATHER, ADD], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "add"}) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use" and _tool_input(streamed.content[0], ADD) == args
    turn = [*msgs, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r.content[0].id,
                                          "content": str(args["a"] + args["b"])}]}]
    second = client.messages.create(model=MODEL, max_tokens=40, messages=turn, tools=[WEATHER, ADD],
                                    extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.usage.input_tokens > r.usage.input_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=turn, tools=[WEATHER, ADD])
    assert counted.input_tokens == second.usage.input_tokens
    plain = client.messages.create(model=MODEL, max_tokens=5, messages=turn, tools=[WEATHER, ADD],
                                   extra_body=GREEDY, tool_choice={"type": "none"})
    assert [b.type for b in plain.content] == ["text"]
    assert plain.usage.input_tokens == client.messages.count_tokens(
        model=MODEL, messages=turn, tools=[WEATHER, ADD], tool_choice={"type": "none"}).input_tokens


def test_any_and_auto_give_valid_calls_or_text(client):
    r = client.messages.create(model=MODEL, max_tokens=150, messages=USER, tools=[WEATHER, ADD],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert r.stop_reason == "tool_use" and len(r.content) == 1
    _tool_input(r.content[0], ADD if r.content[0].name == "add" else WEATHER)
    for seed_text in ("Hello.", "Weather?"):
        r = client.messages.create(model=MODEL, max_tokens=150, tools=[WEATHER, ADD], extra_body={"temperature": 1.0},
                                   messages=[{"role": "user", "content": seed_text}])
        for b in r.content:
            if b.type == "tool_use":
                _tool_input(b, ADD if b.name == "add" else WEATHER)
        assert (r.stop_reason == "tool_use") == any(b.type == "tool_use" for b in r.content)


class Point(BaseModel):  # (the client drops numeric bounds from the schema it sends: none here)
    x: int
    label: Literal["a", "b"]


def test_output_format_is_enforced(client):
    parsed = client.messages.parse(model=MODEL, max_tokens=60, messages=USER, output_format=Point,
                                   extra_body=GREEDY)
    assert isinstance(parsed.parsed_output, Point) and parsed.stop_reason == "end_turn"
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
              "maxItems": 3}
    with client.messages.stream(model=MODEL, max_tokens=60, messages=USER, extra_body=GREEDY,
                                output_config={"format": {"type": "json_schema", "schema": schema}}) as s:
        text = "".join(s.text_stream)
    jsonschema.validate(json.loads(text), schema)


def test_count_tokens_is_the_rendered_prompt(llms, client):
    system = "Be brief."
    n = client.messages.count_tokens(model=MODEL, system=system, messages=USER).input_tokens
    assert n == len(llms[1].encode_chat([{"role": "system", "content": system}, *USER]))
    created = client.messages.create(model=MODEL, max_tokens=1, system=system, messages=USER)
    assert created.usage.input_tokens == n


def test_the_api_key_is_taken_as_x_api_key_or_bearer(server):
    url = server[0]
    for c in (anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0),
              anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)):
        assert c.messages.count_tokens(model=MODEL, messages=USER).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=1, messages=USER)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body, field", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "messages.0.content.0"),
    ({"max_tokens": 5, "messages": USER, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": USER, "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 5, "messages": USER, "tools": [ADD], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"name": "x", "input_schema": {"type": "object", "properties": {
        "a": {"type": "string", "format": "bogus"}}}}]}, "tools"),
    ({"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 5, "messages": USER, "bogus": 1}, "bogus"),
    ({"max_tokens": 5, "messages": USER, "output_config": {"format": {"type": "json_schema", "schema": {
        "type": "string", "format": "bogus"}}}}, "output_config.format"),
    ({"max_tokens": 5, "messages": USER, "tools": [ADD], "output_config": {"format": {"type": "json_schema",
                                                                                    "schema": {}}}},
     "output_config.format"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]},
     "tools.0.name"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "add",
                                                                   "input": {}}]}]}, "messages.0.content.0"),
])
def test_bad_input_is_an_anthropic_400_naming_the_field(server, client, body, field):
    r = httpx.post(server[0] + "/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(field), err
    with pytest.raises(anthropic.BadRequestError):  # the client reads it as Anthropic's
        client.post("/v1/messages", body={"model": MODEL, **body}, cast_to=httpx.Response)
    assert client.messages.create(model=MODEL, max_tokens=1, messages=USER).usage.output_tokens == 1


def test_an_unknown_model_is_an_anthropic_404(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=1, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
