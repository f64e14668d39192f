"""Tool-call formats: how a model family writes a call, how we read it back, and the grammar that enforces it.

Each parser answers two questions about a reply:
- `scan(text, final)`: the content so far (text that is not a tool call) and the complete calls so far. Both only
  grow as text is added, so the stream is the difference of successive scans and the non-streamed answer is the
  final scan: streamed and non-streamed outputs cannot disagree. A prefix of a call marker at the end of the text
  is held back until it resolves.
- `grammar(tools, choice, parallel)`: the structural tag (xgrammar) that keeps the reply in the family's format:
  with `required` or a named function, the reply is nothing but calls; with `auto`, text is free until a call
  begins, and the call is then enforced (its name one of the tools, its arguments valid for its parameters).

Formats (vLLM's parser names): `hermes` (`<tool_call>{"name", "arguments"}</tool_call>`: Qwen2.5/Qwen3, Hermes,
SmolLM3), `llama3_json` (`{"name", "parameters"}` objects separated by `; `, optionally after `<|python_tag|>`:
Llama 3.1-3.3), `mistral` (`[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`), and `generic`, ours for
templates that know no tools (SmolLM2's ChatML among them): the reply is one JSON object, `{"tool_calls": [...]}`
or `{"response": "..."}`, always grammar-enforced (server/tools.py renders the tools into the system prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from neuron_opt.runtime.structured import bound_schema, check_schema

MAX_PARALLEL_TOOL_CALLS = 4  # calls in one reply when parallel_tool_calls is on (bounded, so small models stop)
_WHITESPACE = 1  # most consecutive whitespace characters inside a call's arguments


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class Scan:
    content: str
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class ToolSpec:
    """One function tool: its name and its (checked, bounded) parameters schema."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def of(cls, name: str, parameters: dict[str, Any] | None) -> ToolSpec:
        schema = parameters if parameters is not None else {"type": "object", "properties": {}}
        check_schema(schema)  # ConfigError naming the keyword; the caller names the tool
        return cls(name, bound_schema(schema))


def _call(obj: Any, args_key: str = "arguments") -> ParsedCall | None:
    """A call from a parsed JSON object ({"name", args_key}), or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser walks: not a call
            return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _objects(text: str, start: int, sep: str) -> tuple[list[Any], int, bool]:
    """JSON values at text[start:], separated by `sep` (and whitespace): (the complete ones, where parsing stopped,
    whether the rest is blank or a separator, i.e. nothing unparseable follows)."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i = start
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out, i, True
        try:
            obj, end = dec.raw_decode(text, i)
        except (ValueError, RecursionError):
            return out, i, False
        out.append(obj)
        i = end
        while i < len(text) and text[i].isspace():
            i += 1
        if text.startswith(sep, i):
            i += len(sep)
        elif i < len(text):
            return out, i, False


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _tag(begin: str, tool: ToolSpec, end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin,
            "content": {"type": "json_schema", "json_schema": tool.parameters, "max_whitespace_cnt": _WHITESPACE},
            "end": end}


def _structural(fmt: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


def _tagged_calls(tags: list[dict[str, Any]], marker: str, sep: str, choice: str, parallel: bool) -> str:
    """The structural tag of calls written as `tags` (one per tool), `sep` between calls: only calls (at least one,
    at most MAX_PARALLEL_TOOL_CALLS, one without `parallel`), or for "auto" text free of `marker` before them."""
    one = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    calls = one if not parallel else {"type": "sequence", "elements": [one, {
        "type": "repeat", "min": 0, "max": MAX_PARALLEL_TOOL_CALLS - 1,
        "content": {"type": "sequence", "elements": [{"type": "const_string", "value": sep}, one]}}]}
    if choice != "auto":
        return _structural(calls)
    return _structural({"type": "sequence", "elements": [{"type": "any_text", "excludes": [marker]},
                                                          {"type": "optional", "content": calls}]})


class ToolParser:
    """The interface (see the module docstring). `renders_tools`: the chat template puts the tools in the prompt."""

    name = ""
    renders_tools = True
    skip_special_tokens = True  # False where the call marker is a special token that must reach the text

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def grammar(self, tools: list[ToolSpec], choice: str, parallel: bool) -> str | None:
        """The structural tag for `choice` ("auto" or "required"; a named function arrives as "required" with
        `tools` holding it alone), or None when the reply is left free."""
        raise NotImplementedError


def _valid_prefix(calls: list[ParsedCall | None]) -> list[ParsedCall]:
    """The calls before the first object that is not a call (a malformed call ends the list)."""
    out = []
    for c in calls:
        if c is None:
            break
        out.append(c)
    return out


class MarkerParser(ToolParser):
    """Calls after a marker: content is the text before the first marker (trailing whitespace dropped), the calls
    follow it. A reply whose marker leads to no valid call is content, whole."""

    marker = ""

    def _calls(self, region: str, final: bool) -> list[ParsedCall]:
        """The complete calls in `region` (the text from the first marker on), up to the first malformed one."""
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> Scan:
        at = text.find(self.marker)
        if at < 0:
            return Scan(text if final else text[:len(text) - _held(text, self.marker)].rstrip())
        calls = self._calls(text[at:], final)
        if final and not calls:
            return Scan(text)
        return Scan(text[:at].rstrip(), tuple(calls))


class HermesParser(MarkerParser):
    name = "hermes"
    marker = "<tool_call>"
    end = "</tool_call>"

    def _calls(self, region: str, final: bool) -> list[ParsedCall]:
        found: list[ParsedCall | None] = []
        for block in region.split(self.marker)[1:]:
            body, closed, _ = block.partition(self.end)
            if not closed and not final:
                break
            objs, _, clean = _objects(body, 0, "")
            found.append(_call(objs[0]) if len(objs) == 1 and clean else None)
        return _valid_prefix(found)

    def grammar(self, tools: list[ToolSpec], choice: str, parallel: bool) -> str | None:
        tags = [_tag(f'{self.marker}\n{{"name": {json.dumps(t.name)}, "arguments": ', t, f"}}\n{self.end}")
                for t in tools]
        return _tagged_calls(tags, self.marker, "\n", choice, parallel)


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3's JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` objects separated by
    `; ` (the `<|python_tag|>` before them is a special token, gone from the text)."""

    name = "llama3_json"
    start = '{"name"'

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        if not body.startswith("{"):  # content, unless it may still become a call
            maybe = not final and self.start.startswith(body)
            return Scan("" if maybe else text)
        objs, _, _ = _objects(body, 0, ";")
        calls = _valid_prefix([_call(o, "parameters") for o in objs])
        if final and not calls:
            return Scan(text)
        return Scan("", tuple(calls))

    def grammar(self, tools: list[ToolSpec], choice: str, parallel: bool) -> str | None:
        tags = [_tag(f'{{"name": {json.dumps(t.name)}, "parameters": ', t, "}") for t in tools]
        return _tagged_calls(tags, '{"name": ', "; ", choice, parallel)


class MistralParser(MarkerParser):
    """`[TOOL_CALLS]` (a special token: requests keep special tokens in the text) then a JSON array of calls."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    skip_special_tokens = False

    def _calls(self, region: str, final: bool) -> list[ParsedCall]:
        try:  # no call is complete before the array closes
            arr, _ = json.JSONDecoder().raw_decode(region[len(self.marker):].lstrip())
        except ValueError:
            return []
        return _valid_prefix([_call(o) for o in (arr if isinstance(arr, list) else [arr])])

    def grammar(self, tools: list[ToolSpec], choice: str, parallel: bool) -> str | None:
        array = {"type": "json_schema", "json_schema": _calls_array(tools, parallel), "max_whitespace_cnt": _WHITESPACE}
        tag = {"type": "tag", "begin": {"type": "token", "token": self.marker}, "content": array, "end": ""}
        if choice == "auto":
            return _structural({"type": "token_triggered_tags", "trigger_tokens": [self.marker], "tags": [tag],
                                "stop_after_first": True})
        return _structural({"type": "sequence", "elements": [{"type": "token", "token": self.marker}, array]})


def _calls_array(tools: list[ToolSpec], parallel: bool) -> dict[str, Any]:
    """JSON schema of a list of calls of `tools`: [{"name": <a tool>, "arguments": <its parameters>}, ...]."""
    items = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1,
            "maxItems": MAX_PARALLEL_TOOL_CALLS if parallel else 1}


class GenericParser(ToolParser):
    """Ours, for templates that know no tools: the reply is one JSON object, `{"tool_calls": [{"name",
    "arguments"}, ...]}` or `{"response": "<text>"}`, and is always grammar-enforced."""

    name = "generic"
    renders_tools = False
    calls_prefix = '{"tool_calls": '
    response_prefix = '{"response": "'

    def scan(self, text: str, final: bool) -> Scan:
        if text.startswith(self.response_prefix):
            return Scan(_json_string_prefix(text[len(self.response_prefix):]))
        if text.startswith(self.calls_prefix + "["):
            objs, _, _ = _objects(text, len(self.calls_prefix) + 1, ",")
            calls = _valid_prefix([_call(o) for o in objs])
            return Scan(text if final and not calls else "", tuple(calls))
        held = self.response_prefix.startswith(text) or self.calls_prefix.startswith(text)
        return Scan(text if final or not held else "")

    def grammar(self, tools: list[ToolSpec], choice: str, parallel: bool) -> str | None:
        calls = {"type": "object", "properties": {"tool_calls": _calls_array(tools, parallel)},
                 "required": ["tool_calls"], "additionalProperties": False}
        if choice == "auto":
            reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                     "additionalProperties": False}
            return json.dumps({"anyOf": [calls, reply]})
        return json.dumps(calls)


def _json_string_prefix(raw: str) -> str:
    """The decoded text of a JSON string body written so far (up to its closing quote, if written); an escape
    sequence cut off at the end is left out until it completes."""
    out, i = [], 0
    while i < len(raw):
        ch = raw[i]
        if ch == '"':
            break
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        n = 6 if raw[i + 1:i + 2] == "u" else 2
        if i + n > len(raw):
            break
        try:
            out.append(json.loads(f'"{raw[i:i + n]}"'))
        except ValueError:
            break
        i += n
    return "".join(out)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                             GenericParser)}
