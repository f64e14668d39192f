"""Reasoning on Anthropic's /v1/messages and OpenAI's /v1/responses through the official `anthropic` and `openai`
clients against a live server with a reasoning parser: thinking blocks and reasoning items, created and streamed,
thinking on and off, a tool call after thinking, thinking sent back in a later turn (and carried by
`previous_response_id`), and the 400s that remain.

Oracles: /v1/chat/completions on the same server and request (its split is checked against raw completions in
test_reasoning.py) for the reasoning, text, calls and reasoning tokens; the model's tokenizer over the chat template
(`LLM.encode_chat`) and the server's /tokenize for prompts; the clients' own types for every response and event;
the non-streamed reply for the streamed one; `jsonschema` for tool inputs; hashlib for signatures.

The model is the tiny random one with the real tokenizer. Its runner is wrapped so that it closes its thinking: every
8th position its logits favour the first token of `</think>`, and after a token of the marker its next one (greedy
decoding then writes the marker within 8 tokens); the grammar's masks still apply on top.
"""

from __future__ import annotations

import hashlib
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch
from anthropic.types import Message, RawMessageStreamEvent
from helpers import live_server
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from neuron_opt.api import LLM
from neuron_opt.server.reasoning import make_reasoning_parser

MODEL = "tiny"
# ChatML as Qwen3 writes it: the generation prompt opens the thinking (closes it with enable_thinking=false), and an
# assistant turn's reasoning_content is rendered before its content
THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
USER = [{"role": "user", "content": "Why is the sky blue?"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a", "b"], "additionalProperties": False}
GREEDY = {"temperature": 0}


class ClosingRunner:
    """`runner` steered to write `marker` (token ids): see the module docstring."""

    def __init__(self, runner, marker: list[int]) -> None:
        self._runner, self._first = runner, marker[0]
        self._next = dict(zip(marker, marker[1:], strict=False))

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def decode(self, rows, candidates=None):
        logits = self._runner.decode(rows, candidates).clone()  # (an inference tensor: changed as a copy)
        for i, row in enumerate(rows):
            favoured = self._next.get(row.token, self._first if row.position % 8 == 0 else None)
            if favoured is not None:
                logits[i, favoured] += 1000.0
        return logits


@pytest.fixture(scope="module")
def llm(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(tiny_dir("smollm-tok"), batch_size=2, max_model_len=1280)
    llm.tokenizer.chat_template = THINK_TEMPLATE
    yield llm
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def url(llm):
    marker = llm.tokenizer("</think>", add_special_tokens=False)["input_ids"]
    parser = make_reasoning_parser(None, llm.tokenizer)  # from the template: qwen3
    with live_server(llm, max_num_seqs=2, runner=ClosingRunner(llm.runner, marker), reasoning_parser=parser,
                     enable_store=True) as (url, _):
        yield url


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def ant(url):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)


def _chat(oai, **kw):
    """The chat reply the other routes are checked against: (message, usage)."""
    r = oai.chat.completions.create(model=MODEL, temperature=0, **kw)
    return r.choices[0].message, r.usage


def _signature(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_messages_thinking_block_created_and_streamed(oai, ant, url):
    want, usage = _chat(oai, messages=USER, max_tokens=40)
    assert want.reasoning and want.content  # (the steered model closes its thinking)
    kw = dict(model=MODEL, max_tokens=40, messages=USER, extra_body=GREEDY, thinking={"type": "adaptive"})
    m = ant.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == want.reasoning and m.content[0].signature == _signature(want.reasoning)
    assert m.content[1].text == want.content and m.usage.output_tokens == usage.completion_tokens
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    body = {"model": MODEL, "max_tokens": 40, "messages": USER, **GREEDY}
    Message.model_validate(httpx.post(url + "/v1/messages", json=body).json())
    events = _events(url, "/v1/messages", body)
    for e in events:
        if e["type"] != "ping":
            TypeAdapter(RawMessageStreamEvent).validate_python(e)
    kinds = [e.get("content_block", {}).get("type") or e.get("delta", {}).get("type") or e["type"] for e in events]
    first_text = kinds.index("text")
    assert kinds[:3] == ["message_start", "ping", "thinking"] and set(kinds[3:first_text - 2]) == {"thinking_delta"}
    assert kinds[first_text - 2:first_text] == ["signature_delta", "content_block_stop"]
    assert events[first_text - 2]["delta"]["signature"] == _signature(want.reasoning)
    assert "".join(e["delta"]["thinking"] for e, k in zip(events, kinds, strict=True) if k == "thinking_delta") == \
        want.reasoning
    omitted = ant.messages.create(**{**kw, "thinking": {"type": "adaptive", "display": "omitted"}})
    assert omitted.content[0].thinking == "" and omitted.content[0].signature == _signature(want.reasoning)
    with ant.messages.stream(**{**kw, "thinking": {"type": "adaptive", "display": "omitted"}}) as s:
        assert s.get_final_message().content[0].model_dump() == omitted.content[0].model_dump()


def test_messages_thinking_off_and_on(llm, oai, ant):
    want, _ = _chat(oai, messages=USER, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    off = ant.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body=GREEDY,
                              thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == want.content
    for flag, thinking in ((False, {"type": "disabled"}),
                           (True, {"type": "enabled", "budget_tokens": 1024})):
        n = ant.messages.count_tokens(model=MODEL, messages=USER, thinking=thinking).input_tokens
        assert n == len(llm.encode_chat(USER, None, {"enable_thinking": flag}))
    effort = ant.messages.count_tokens(model=MODEL, messages=USER, output_config={"effort": "low"}).input_tokens
    assert effort == len(llm.encode_chat(USER))  # (this template has no reasoning_effort variable)


def test_messages_tool_use_after_thinking_and_the_thinking_sent_back(oai, ant, url):
    tool = {"name": "add", "input_schema": SCHEMA}
    want, usage = _chat(oai, messages=USER, max_tokens=1100, tool_choice="required",
                        tools=[{"type": "function", "function": {"name": "add", "parameters": SCHEMA}}])
    kw = dict(model=MODEL, max_tokens=1100, messages=USER, extra_body=GREEDY, tools=[tool],
              tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 1024})
    m = ant.messages.create(**kw)
    assert [b.type for b in m.content][:2] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].thinking == want.reasoning
    assert [(b.name, b.input) for b in m.content[1:]] == [
        (c.function.name, json.loads(c.function.arguments)) for c in want.tool_calls]
    jsonschema.validate(m.content[1].input, SCHEMA)
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in m.content] and final.stop_reason == "tool_use"
    assert final.content[0].thinking == want.reasoning and final.content[1].input == m.content[1].input
    turn = [*USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[1].id, "content": "5"}]}]
    n = ant.messages.count_tokens(model=MODEL, messages=turn, tools=[tool]).input_tokens
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in m.content[1:]]
    chat = [*USER, {"role": "assistant", "content": "", "reasoning": want.reasoning, "tool_calls": calls},
            {"role": "tool", "tool_call_id": m.content[1].id, "content": "5"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": SCHEMA}}]
    assert n == httpx.post(url + "/tokenize", json={"messages": chat, "tools": tools}).json()["count"]
    without = [turn[0], {**turn[1], "content": turn[1]["content"][1:]}, turn[2]]
    assert n > ant.messages.count_tokens(model=MODEL, messages=without, tools=[tool]).input_tokens  # it is rendered


def test_chat_takes_an_assistants_reasoning_back_to_the_template(llm, url):
    """vLLM's `reasoning` (and older `reasoning_content`) on an assistant message reaches the template as
    `reasoning_content`; on another role it is a 400."""
    turn = [*USER, {"role": "assistant", "content": "Rayleigh.", "reasoning": "Short waves scatter."},
            {"role": "user", "content": "More?"}]
    rendered = [*USER, {"role": "assistant", "content": "Rayleigh.", "reasoning_content": "Short waves scatter."},
                turn[2]]
    for msgs in (turn, rendered):
        assert httpx.post(url + "/tokenize", json={"messages": msgs}).json()["count"] == len(llm.encode_chat(rendered))
    assert len(llm.encode_chat(rendered)) > len(llm.encode_chat([*USER, {"role": "assistant", "content": "Rayleigh."},
                                                                 turn[2]]))
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{**USER[0], "reasoning": "x"}], "max_tokens": 1})
    assert r.status_code == 400 and "only assistant messages carry reasoning" in r.json()["error"]["message"]


def _strict(response: dict) -> dict:
    """`response` against the client's type (its usage field by field: see test_server_responses.py)."""
    usage = response.pop("usage")
    Response.model_validate(response)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    return usage


def test_responses_reasoning_item_created_and_streamed(oai, url):
    want, usage = _chat(oai, messages=USER, max_tokens=40)
    kw = dict(model=MODEL, input=USER[0]["content"], max_output_tokens=40, temperature=0)
    r = oai.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output[0].id.startswith("rs_")
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text == want.reasoning
    assert r.output[0].summary == [] and r.output_text == want.content
    assert r.usage.output_tokens_details.reasoning_tokens == usage.completion_tokens_details.reasoning_tokens > 0
    assert r.usage.output_tokens == usage.completion_tokens
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
    final = events[-1].response  # (cut by max_output_tokens: response.incomplete)
    types = [e.type for e in events]
    assert types[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    done = types.index("response.reasoning_text.done")
    assert set(types[4:done]) == {"response.reasoning_text.delta"}
    assert types[done + 1:done + 4] == ["response.content_part.done", "response.output_item.done",
                                        "response.output_item.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == want.reasoning
    assert [o.type for o in final.output] == [o.type for o in r.output] and final.status == r.status
    assert final.output[0].content[0].text == want.reasoning and final.output_text == want.content
    assert final.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens_details.reasoning_tokens
    body = {"model": MODEL, "input": "Hi.", "max_output_tokens": 20, "temperature": 0}
    assert _strict(httpx.post(url + "/v1/responses", json=body).json())["output_tokens_details"][
        "reasoning_tokens"] > 0
    for e in _events(url, "/v1/responses", body):
        if e["type"] in ("response.completed", "response.incomplete"):
            _strict(e["response"])
        TypeAdapter(ResponseStreamEvent).validate_python(e)


def test_responses_effort_and_reasoning_items_sent_back(llm, oai, url):
    want, _ = _chat(oai, messages=USER, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    off = oai.responses.create(model=MODEL, input=USER, max_output_tokens=12, temperature=0,
                               reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text == want.content
    assert off.usage.output_tokens_details.reasoning_tokens == 0 and off.reasoning.effort == "none"
    on = oai.responses.create(model=MODEL, input=USER, max_output_tokens=12, temperature=0,
                              reasoning={"effort": "high"})
    assert on.usage.input_tokens == len(llm.encode_chat(USER, None, {"enable_thinking": True,
                                                                    "reasoning_effort": "high"}))
    first = oai.responses.create(model=MODEL, input=USER, max_output_tokens=40, temperature=0)
    again = [*USER, *[o.model_dump(exclude_none=True) for o in first.output], {"role": "user", "content": "More?"}]
    second = oai.responses.create(model=MODEL, input=again, max_output_tokens=1, temperature=0)
    chat = [*USER, {"role": "assistant", "content": first.output_text, "reasoning": first.output[0].content[0].text},
            {"role": "user", "content": "More?"}]
    assert second.usage.input_tokens == httpx.post(url + "/tokenize", json={"messages": chat}).json()["count"]
    continued = oai.responses.create(model=MODEL, input="More?", previous_response_id=first.id, max_output_tokens=1)
    assert continued.usage.input_tokens == second.usage.input_tokens  # (the stored reply keeps its reasoning)
    assert second.usage.input_tokens > oai.responses.create(
        model=MODEL, input=[again[0], again[2], again[3]], max_output_tokens=1).usage.input_tokens


def test_responses_function_call_after_thinking(oai):
    tool = {"type": "function", "name": "add", "parameters": SCHEMA}
    want, usage = _chat(oai, messages=USER, max_tokens=300, tool_choice="required",
                        tools=[{"type": "function", "function": {"name": "add", "parameters": SCHEMA}}])
    kw = dict(model=MODEL, input=USER, max_output_tokens=300, temperature=0, tools=[tool], tool_choice="required")
    r = oai.responses.create(**kw)
    assert [o.type for o in r.output][:2] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == want.reasoning
    assert [(o.name, json.loads(o.arguments)) for o in r.output[1:]] == [
        (c.function.name, json.loads(c.function.arguments)) for c in want.tool_calls]
    assert r.usage.output_tokens_details.reasoning_tokens == usage.completion_tokens_details.reasoning_tokens
    with oai.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert [o.type for o in final.output] == [o.type for o in r.output] and final.status == r.status
    assert final.output[1].arguments == r.output[1].arguments


@pytest.mark.parametrize("body, field", [
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive", "budget_tokens": 2000}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "max_tokens"),  # (max_tokens 5 <= the budget)
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000,
      "chat_template_kwargs": {"enable_thinking": False}}, "thinking"),
    ({"thinking": {"type": "between_tools"}}, "thinking"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]}]},
     "messages.0.content.0"),
])
def test_messages_bad_thinking_is_a_400(url, body, field):
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": USER, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field), r.json()
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "reasoning": {"effort": "high", "summary": "auto"}}, "reasoning.summary"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
                {"role": "user", "content": "x"}]}, "input.0"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "abc"},
                {"role": "assistant", "content": "x"}]}, "input.0.encrypted_content"),
])
def test_responses_bad_reasoning_is_a_400(url, body, param):
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
