"""Tool-call formats: each parser on recorded model replies, streamed scans against the final one, and the
grammars that enforce `required`, a named function and `auto`.

Oracles: the calls written out by hand for each recorded reply; the final scan for the stream (the deltas of
successive scans must reassemble into exactly the non-streamed message); `jsonschema` and the tool list for every
reply a grammar accepts (random walks over the real tokenizer, as in test_structured.py).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers import grammar_walk

from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.runtime.structured import GrammarCompiler, StructuredOutputs
from neuron_opt.server.tool_parsers import (
    MAX_PARALLEL_TOOL_CALLS,
    GenericParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolSpec,
)
from neuron_opt.server.tools import ToolRequest, ToolStream, message, parser_for_template, render_messages

EOS = 2


def calls(*pairs):
    return [(name, json.loads(args) if isinstance(args, str) else args) for name, args in pairs]


RECORDED = [  # (parser, reply, content, [(name, arguments)])
    (HermesParser(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     calls(("get_weather", {"city": "Paris"}))),
    (HermesParser(), 'Let me check both.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
                     '{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>', "Let me check both.",
     calls(("a", {}), ("b", {"x": [1, 2]}))),
    (HermesParser(), 'The answer is 4.', "The answer is 4.", []),
    (HermesParser(), '<tool_call>\n{"name": "a", "arguments": {broken}\n</tool_call>',
     '<tool_call>\n{"name": "a", "arguments": {broken}\n</tool_call>', []),
    (HermesParser(), '<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None,
     calls(("a", {"x": 1}))),
    (HermesParser(), 'I use <tool_ to show', "I use <tool_ to show", []),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
     calls(("get_weather", {"city": "Paris", "days": 3}))),
    (Llama3JsonParser(), '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}', None,
     calls(("a", {}), ("b", {"y": 2}))),
    (Llama3JsonParser(), 'Hello! How can I help?', "Hello! How can I help?", []),
    (Llama3JsonParser(), '{"foo": 1}', '{"foo": 1}', []),
    (MistralParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     calls(("get_weather", {"city": "Paris"}))),
    (MistralParser(), 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"z": true}}]',
     "Sure.", calls(("a", {}), ("b", {"z": True}))),
    (MistralParser(), 'No tools needed.', "No tools needed.", []),
    (GenericParser(), '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]}', None,
     calls(("f", {"a": 1}), ("g", {}))),
    (GenericParser(), '{"response": "Hi \\"there\\"\\n\\u00e9"}', 'Hi "there"\né', []),
]


@pytest.mark.parametrize("parser,reply,content,want", RECORDED,
                         ids=[f"{i}-{r[0].name}" for i, r in enumerate(RECORDED)])
def test_recorded_replies_give_their_calls_streamed_or_not(parser, reply, content, want):
    msg, called = message(parser.scan(reply, True))
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
    assert (msg["content"], got, called) == (content, want, bool(want))
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg.get("tool_calls", []))
    stream = ToolStream(parser)
    deltas = [d for i in range(1, len(reply) + 1) for d in stream.feed(reply[:i], i == len(reply))]
    text = "".join(d.get("content", "") for d in deltas)
    assert text == (content or "")
    streamed: dict[int, list] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            entry = streamed.setdefault(tc["index"], ["", ""])
            if "id" in tc:  # the id and the name come first, alone
                assert tc["function"]["arguments"] == "" and not entry[0]
                entry[0] = tc["function"]["name"]
            entry[1] += tc["function"]["arguments"]
    assert [(n, json.loads(a)) for n, a in (streamed[i] for i in sorted(streamed))] == want


def test_the_template_names_its_format():
    assert parser_for_template("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert parser_for_template("<|python_tag|>{{ x }}") == "llama3_json"
    assert parser_for_template("[TOOL_CALLS]") == "mistral"
    assert parser_for_template("<|im_start|>{{ m.role }}") == "generic" and parser_for_template(None) == "generic"


# ---- grammars ---------------------------------------------------------------------------------------------------

PARAMS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]},
    "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number", "minimum": 0}},
            "required": ["a", "b"], "additionalProperties": False},
    "ping": None,
}
TOOLS = tuple(ToolSpec.of(n, p) for n, p in PARAMS.items())


@pytest.fixture(scope="module")
def tok():
    t = open_checkpoint("default").tokenizer()
    t.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})  # Mistral's marker, a special token
    return t


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, len(tok), (EOS,))


def walk(compiler, tok, structured, seed: int) -> str:
    return grammar_walk(compiler, tok, structured, seed, max_steps=600, skip_special_tokens=False)


def check_calls(scan, allowed: dict[str, dict], most: int) -> None:
    assert 1 <= len(scan.calls) <= most, scan
    for c in scan.calls:
        assert c.name in allowed
        jsonschema.validate(json.loads(c.arguments), allowed[c.name] or {"type": "object", "maxProperties": 0})


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), MistralParser(), GenericParser()],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), ("add", False)])
def test_required_and_named_replies_are_only_valid_calls(compiler, tok, parser, choice, parallel):
    req = ToolRequest(TOOLS, choice, parallel)
    structured = req.structured(parser)
    allowed = {n: p for n, p in PARAMS.items() if choice == "required" or n == choice}
    for seed in range(6):
        reply = walk(compiler, tok, structured, seed)
        scan = parser.scan(reply, True)
        assert not scan.content or not scan.content.strip(), reply  # nothing but calls
        check_calls(scan, allowed, MAX_PARALLEL_TOOL_CALLS if parallel and choice == "required" else 1)


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), GenericParser()], ids=lambda p: p.name)
def test_auto_replies_are_text_or_valid_calls(compiler, tok, parser):
    structured = ToolRequest(TOOLS, "auto", True).structured(parser)
    for seed in range(10):
        scan = parser.scan(walk(compiler, tok, structured, seed), True)
        if scan.calls:
            check_calls(scan, PARAMS, MAX_PARALLEL_TOOL_CALLS)


def test_generic_format_renders_tools_and_history_into_the_conversation():
    req = ToolRequest(TOOLS, "auto", False, {"get_weather": "Weather now"})
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is 18 C."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    out, tools = render_messages(history, GenericParser(), req)
    assert tools is None and [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\nYou can call these tools") and "Weather now" in out[0]["content"]
    assert "Call at most one tool per reply." in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert json.loads(out[3]["content"]) == {"tool_response": {"tool_call_id": "call_1", "name": "get_weather",
                                                               "content": "18 C"}}
    assert json.loads(out[4]["content"]) == {"response": "It is 18 C."}


def test_native_formats_pass_tools_and_history_to_the_template():
    req = ToolRequest(TOOLS, "add", True, {"add": "Adds"})
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c9"}]
    out, tools = render_messages(history, HermesParser(), req)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}  # a mapping, as templates take it
    assert out[1]["name"] == "add"
    assert tools == [{"type": "function", "function": {"name": "add", "parameters": TOOLS[1].parameters,
                                                       "description": "Adds"}}]
    assert render_messages(history, HermesParser(), ToolRequest(TOOLS, "none"))[1] is None


def test_structured_outputs_of_each_format_compile(compiler):
    for parser in (HermesParser(), Llama3JsonParser(), MistralParser(), GenericParser()):
        for choice in ("auto", "required", "ping"):
            s = ToolRequest(TOOLS, choice, True).structured(parser)
            assert isinstance(s, StructuredOutputs)
            compiler.compile(s)
