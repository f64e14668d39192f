"""The API agents call, through the official `openai` client against a live server: structured outputs
(`response_format` with `client.chat.completions.parse`, vLLM's `structured_outputs` and `guided_*`), tool calls
(the generic format of a template without tools, and hermes through a template that has them), `n`,
`logit_bias`, the API key, /tokenize and /detokenize.

Oracles: the single-sequence reference loop (`LLM.chat` / `LLM.generate` with the same SamplingParams on a batch-1
model) for every greedy output, `jsonschema` and pydantic for the structured ones, the non-streamed answer for the
streamed one. The model is the tiny random one with the real tokenizer (its text is noise: schemas bound strings).
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from helpers import live_server
from pydantic import BaseModel, Field

from neuron_opt.api import LLM
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.structured import StructuredOutputs

MODEL = "tiny"
KEY = "sk-test-123"
MSGS = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]
    tags: list[Literal["x", "y"]] = Field(max_length=2)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "unit": {"type": "string", "enum": ["c", "f"]}},
                                                "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nCall a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def llms(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tiny_dir("smollm-tok")
    yield LLM(path, batch_size=8, max_model_len=768), LLM(path, batch_size=1, max_model_len=768)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(llms):
    with live_server(llms[0], max_num_seqs=8, api_key=KEY) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def chat_ref(llm: LLM, msgs, params: SamplingParams) -> str:
    return llm.chat(msgs, params).text


# ---- structured outputs ----------------------------------------------------------------------------------------

def test_parse_returns_a_valid_model_equal_to_the_reference(llms, client):
    r = client.chat.completions.parse(model=MODEL, messages=MSGS, response_format=Person, temperature=0,
                                      max_tokens=120)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    schema = openai.lib._pydantic.to_strict_json_schema(Person)
    want = chat_ref(llms[1], MSGS, SamplingParams(max_tokens=120, structured=StructuredOutputs(json=schema)))
    assert r.choices[0].message.content == want


def test_streamed_json_schema_equals_the_non_streamed_answer(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}
    whole = client.chat.completions.create(model=MODEL, messages=MSGS, response_format=fmt, temperature=0,
                                           max_tokens=120)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, response_format=fmt, temperature=0,
                                                 max_tokens=120, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    Person.model_validate_json(text)


def test_constrained_and_free_requests_together_each_equal_their_reference(llms, server):
    schema = Person.model_json_schema()
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
         StructuredOutputs(json=schema)),
        ({}, None),
        ({"extra_body": {"structured_outputs": {"regex": "[A-Z][a-z]{1,4}-[0-9]{2}"}}},
         StructuredOutputs(regex="[A-Z][a-z]{1,4}-[0-9]{2}")),
        ({"extra_body": {"guided_choice": ["red", "green", "blue"]}},
         StructuredOutputs(choice=("red", "green", "blue"))),
        ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "(" [0-9] ("," [0-9]){0,3} ")"'}}},
         StructuredOutputs(grammar='root ::= "(" [0-9] ("," [0-9]){0,3} ")"')),
        ({"extra_body": {"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}},
                                         "required": ["n"]}}},
         StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})),
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ]

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0) as ac:
            rs = await asyncio.gather(*(ac.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Item {i}."}], temperature=0, max_tokens=60,
                **kw) for i, (kw, _) in enumerate(cases)))
        return [r.choices[0].message.content for r in rs]

    got = asyncio.run(together())
    for i, (_, structured) in enumerate(cases):
        want = chat_ref(llms[1], [{"role": "user", "content": f"Item {i}."}],
                        SamplingParams(max_tokens=60, structured=structured))
        assert got[i] == want, i
    Person.model_validate_json(got[0])
    assert got[3] in ("red", "green", "blue") and isinstance(json.loads(got[6]), dict)


def test_completions_take_response_format_and_structured_outputs(llms, client):
    r = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"json": {"type": "array", "items": {
                                      "type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4}}})
    value = json.loads(r.choices[0].text)
    assert 2 <= len(value) <= 4 and all(0 <= v <= 9 for v in value)


# ---- tool calls --------------------------------------------------------------------------------------------------

def check_calls(message, names) -> list[tuple[str, dict]]:
    out = []
    for c in message.tool_calls:
        tool = next(t for t in TOOLS if t["function"]["name"] == c.function.name)
        assert c.function.name in names and c.type == "function" and c.id.startswith("call_")
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, tool["function"]["parameters"])
        out.append((c.function.name, args))
    return out


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_required_and_named_calls_are_valid_and_stream_the_same(client, choice):
    names = ["get_weather", "add"] if choice == "required" else ["add"]
    msgs = [{"role": "user", "content": "What is 2 + 3, and the weather in Oslo?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, temperature=0,
                                       max_tokens=150)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    calls = check_calls(msg, names)
    assert len(calls) >= 1 and (choice == "required" or len(calls) == 1)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice,
                                            temperature=0, max_tokens=150, stream=True)
    parts: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = parts.setdefault(d.index, ["", ""])
            entry[0] += (d.function.name or "") if d.function else ""
            entry[1] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in (parts[i] for i in sorted(parts))] == calls


def test_parallel_tool_calls_off_gives_one_call(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0.7, seed=4, max_tokens=150)
    assert len(check_calls(r.choices[0].message, ["get_weather", "add"])) == 1


def test_auto_is_text_or_valid_calls_and_none_is_plain_text(llms, client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, temperature=1.0, seed=seed,
                                           max_tokens=150)
        msg = r.choices[0].message
        if msg.tool_calls:
            check_calls(msg, ["get_weather", "add"])
            assert r.choices[0].finish_reason == "tool_calls"
        else:
            assert isinstance(msg.content, str)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=10)
    assert r.choices[0].message.content == chat_ref(llms[1], MSGS, SamplingParams(max_tokens=10))


def test_a_two_turn_conversation_with_a_tool_result(client):
    msgs = [{"role": "user", "content": "Add 2 and 3."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=150)
    msg = first.choices[0].message
    msgs += [msg.model_dump(exclude_none=True),  # echoed back as agent frameworks do
             *({"role": "tool", "tool_call_id": c.id, "content": "5"} for c in msg.tool_calls)]
    second = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, temperature=0, max_tokens=40)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_template_with_tools_gets_hermes_calls(tiny_dir):
    llm = LLM(tiny_dir("smollm-tok"), batch_size=2, max_model_len=768)
    llm.tokenizer.chat_template = HERMES_TEMPLATE
    with live_server(llm, max_num_seqs=2) as (url, _):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
                                      temperature=0, max_tokens=150)
        calls = check_calls(r.choices[0].message, ["get_weather", "add"])
        msgs = [*MSGS, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "ok"}]
        tok = httpx.post(url + "/tokenize", json={"messages": msgs, "tools": TOOLS}).json()
    text = llm.tokenizer.decode(tok["tokens"])
    assert "<tools>" in text and "<tool_response>\nok\n</tool_response>" in text
    assert f'"name": "{calls[0][0]}"' in text


# ---- n, logit_bias -----------------------------------------------------------------------------------------------

def test_n_samples_share_the_prompt(llms, client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = llms[1].generate("Once upon a time", SamplingParams(max_tokens=8, ignore_eos=True)).text
    assert [c.index for c in r.choices] == [0, 1, 2] and {c.text for c in r.choices} == {ref}
    assert r.usage.completion_tokens == 24
    seeded = [client.chat.completions.create(model=MODEL, messages=MSGS, n=2, temperature=1.0, seed=11,
                                             max_tokens=8) for _ in range(2)]
    texts = [[c.message.content for c in s.choices] for s in seeded]
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1]  # reproducible, one seed per sample
    want = [chat_ref(llms[1], MSGS, SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i)) for i in range(2)]
    assert texts[0] == want
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, n=2, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    by_index = {0: "", 1: ""}
    for ch in chunks:
        by_index[ch.choices[0].index] += ch.choices[0].text
    assert by_index[0] == by_index[1] != ""


def test_logit_bias_bans_the_greedy_token(llms, client):
    first = llms[1].generate("The sea is", SamplingParams(max_tokens=1)).token_ids[0]
    r = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=6, temperature=0,
                                  logit_bias={str(first): -100}, logprobs=0)
    assert first not in llms[1].tokenizer(r.choices[0].text, add_special_tokens=False)["input_ids"][:1]
    ref = llms[1].generate("The sea is", SamplingParams(max_tokens=6, logit_bias=((first, -100.0),)))
    assert r.choices[0].text == ref.text


# ---- API key, tokenizer routes -----------------------------------------------------------------------------------

def test_the_api_key_guards_v1_and_the_tokenizer_routes(server):
    url = server[0]
    for path, body in [("/v1/models", None), ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                       ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]:
        def send(h, p=path, b=body):
            return httpx.get(url + p, headers=h) if b is None else httpx.post(url + p, json=b, headers=h)

        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = send(headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "AuthenticationError" and r.json()["error"]["code"] == 401
        assert send({"Authorization": f"Bearer {KEY}"}).status_code == 200, path
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_tokenize_round_trips_and_counts_what_a_chat_request_costs(client, server):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server[0] + "/tokenize", json={"prompt": "Hello world, é!", "return_token_strs": True},
                   headers=h).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 768
    assert httpx.post(server[0] + "/detokenize", json={"tokens": r["tokens"]}, headers=h).json() == {
        "prompt": "Hello world, é!"}
    chat = httpx.post(server[0] + "/tokenize", json={"messages": MSGS, "tools": TOOLS}, headers=h).json()
    done = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=1, temperature=0)
    assert chat["count"] == done.usage.prompt_tokens
    bad = httpx.post(server[0] + "/detokenize", json={"tokens": [10**9]}, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(server[0] + "/tokenize", json={"prompt": "x", "messages": MSGS}, headers=h)
    assert both.status_code == 400
