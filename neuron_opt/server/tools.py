"""Tool calling for /v1/chat/completions: the prompt, the grammar, and the reply read back as calls.

Design decisions
- The format is the model's own where its chat template has one (chosen from the template, or by
  `serve --tool-call-parser NAME`, vLLM's names; server/tool_parsers.py); the template renders `tools` and the
  conversation's earlier calls and results. A template that knows no tools (SmolLM2's ChatML) gets the `generic`
  format: the tools and the reply's JSON form go into the system prompt in our words, earlier calls become the
  assistant's JSON replies and tool results become user turns, as llama.cpp's server does for such templates.
- `tool_choice` "required" and a named function are grammar-enforced in every format: the reply is only calls,
  each naming a given tool with arguments valid for its parameters. "auto" is enforced once a call begins (free
  text before it); in the generic format the whole reply is one JSON object. "none" renders no tools and parses
  nothing.
- The reply is read by the parser's `scan`: content and calls, streamed as the difference of successive scans, so
  streamed deltas reassemble into exactly the non-streamed message. A reply with calls that ended normally has
  finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from neuron_opt.errors import ConfigError
from neuron_opt.runtime.structured import StructuredOutputs
from neuron_opt.server.tool_parsers import PARSERS, GenericParser, ParsedCall, Scan, ToolParser, ToolSpec


def parser_for_template(template: str | None) -> str:
    """The tool-call format a chat template writes (by the markers it mentions); generic when it has none."""
    t = template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t:
        return "llama3_json"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    return "generic"


def make_parser(name: str | None, tokenizer: Any) -> ToolParser:
    """`serve --tool-call-parser NAME`, or the one the tokenizer's chat template calls for."""
    name = name or parser_for_template(getattr(tokenizer, "chat_template", None))
    if name not in PARSERS:
        raise ConfigError(f"--tool-call-parser: unknown parser {name!r}; choose one of {', '.join(PARSERS)}",
                          param="tool_call_parser")
    return PARSERS[name]()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools as the server uses them.

    Args:
        tools: the function tools offered (checked parameters schemas).
        choice: "auto" | "required" | "none" | a function's name (forced).
        parallel: several calls in one reply may be made.
        descriptions: name -> the tool's description, for the generic prompt.
    """

    tools: tuple[ToolSpec, ...]
    choice: str
    parallel: bool = True
    descriptions: dict[str, str | None] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def offered(self) -> list[ToolSpec]:
        """The tools the reply may call: all of them, or the forced one."""
        if self.choice in ("auto", "required", "none"):
            return list(self.tools)
        return [t for t in self.tools if t.name == self.choice]

    def structured(self, parser: ToolParser) -> StructuredOutputs | None:
        if not self.active:
            return None
        mode = "auto" if self.choice == "auto" else "required"
        text = parser.grammar(self.offered(), mode, self.parallel and self.choice in ("auto", "required"))
        if text is None:
            return None
        return StructuredOutputs(json=text) if isinstance(parser, GenericParser) else StructuredOutputs(
            structural_tag=text)


def _generic_prompt(req: ToolRequest) -> str:
    lines = [json.dumps({"name": t.name, "description": req.descriptions.get(t.name) or "",
                         "parameters": t.parameters}, ensure_ascii=False) for t in req.offered()]
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments, as the tool\'s parameters describe>}}]}'
    how = {"auto": f"To call tools, reply with only this JSON object: {call}\n"
                   'To answer without a tool, reply with only: {"response": "<your answer>"}',
           "required": f"Reply with only this JSON object, calling at least one tool: {call}"}.get(
        req.choice, f"Reply with only this JSON object, calling the tool {req.choice!r}: {call}")
    many = "You may call several tools in one reply." if req.parallel else "Call at most one tool per reply."
    return "You can call these tools (one JSON description per line):\n" + "\n".join(lines) + f"\n\n{how}\n{many}"


def _thought(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's earlier thinking (its reasoning keys), kept when the message is rewritten."""
    return {k: message[k] for k in ("reasoning", "reasoning_content") if k in message}


def render_messages(messages: list[dict[str, Any]], parser: ToolParser,
                    req: ToolRequest | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the chat template, `tools` for the template or None). `messages` are OpenAI's (assistant
    `tool_calls` with `function.arguments` as JSON text, `role: "tool"` results with `tool_call_id`)."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    active = req is not None and req.active
    if parser.renders_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):  # templates take the arguments as a mapping (HF's convention)
                m["tool_calls"] = [{**c, "function": {"name": c["function"]["name"],
                                                      "arguments": _arguments(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
                m["name"] = names[m["tool_call_id"]]
            out.append(m)
        tools = [_openai_tool(t, req.descriptions.get(t.name)) for t in req.offered()] if active and req else None
        return out, tools
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False),
                        **_thought(m)})
        elif m["role"] == "tool":
            result = {"tool_call_id": m.get("tool_call_id"), "name": names.get(m.get("tool_call_id")),
                      "content": m.get("content") or ""}
            out.append({"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)})
        elif m["role"] == "assistant" and active:  # earlier answers in the form the model is asked to use
            out.append({"role": "assistant", "content": json.dumps({"response": m.get("content") or ""},
                                                                   ensure_ascii=False), **_thought(m)})
        else:
            out.append(m)
    if active and req is not None:
        prompt = _generic_prompt(req)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ConfigError(f"messages: a tool call's function.arguments is not JSON: {text[:80]!r}",
                          param="messages") from None
    except RecursionError:
        raise ConfigError("messages: a tool call's function.arguments is nested too deeply", param="messages") from None


def _openai_tool(t: ToolSpec, description: str | None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name, "parameters": t.parameters}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


class ToolStream:
    """One choice's reply read as it is generated: `feed` takes the text so far and returns the deltas to send
    (OpenAI's streamed `delta` objects: content pieces, and per call its id and name, then its arguments)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content = ""
        self.calls: list[tuple[str, ParsedCall]] = []  # (id, call) sent so far

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        scan = self.parser.scan(text, final)
        deltas: list[dict[str, Any]] = []
        if len(scan.content) > len(self.content) and scan.content.startswith(self.content):
            deltas.append({"content": scan.content[len(self.content):]})
            self.content = scan.content
        for call in scan.calls[len(self.calls):]:
            cid, i = new_call_id(), len(self.calls)
            self.calls.append((cid, call))
            deltas.append({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        return deltas


def message(scan: Scan) -> tuple[dict[str, Any], bool]:
    """The non-streamed assistant message of a reply's final scan, and whether it holds calls."""
    if not scan.calls:
        return {"role": "assistant", "content": scan.content}, False
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in scan.calls]
    return {"role": "assistant", "content": scan.content or None, "tool_calls": calls}, True
