"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, translated to a chat request
and run as /v1/chat/completions runs it (server/chat_bridge.py).

Design decisions
- Request types are strict (`extra="forbid"`), as our OpenAI ones: an unknown field or content block type is a 400
  naming it. `cache_control` on blocks and tools is accepted: prompt caching is automatic here (the prefix cache).
- `system` (a string or text blocks, joined by newlines) becomes the system message; a user turn's `tool_result`
  blocks become tool messages (before the turn's text), an assistant turn's `tool_use` blocks its tool calls.
  `is_error` results reach the template as "Error: <content>". A user turn's `image` blocks (`source` base64 with
  its `media_type`, or `url`) become chat's `image_url` parts in their place among the turn's text, loaded and checked
  as chat's (server/media.py); errors name the block (`messages.0.content.1`). Images in `tool_result` blocks are
  a 400.
- Thinking (with a reasoning parser, server/reasoning.py): the reply's reasoning, when not empty, is a `thinking`
  block before the text and tool_use blocks. `thinking: {"type": "enabled"}` sets the template's `enable_thinking` true,
  `{"type": "disabled"}` false, `{"type": "adaptive"}` leaves the template's default; enabled and adaptive need a
  reasoning parser. `budget_tokens` is checked as Anthropic checks it (at least 1024, below `max_tokens`) and is
  enforced as chat's `thinking_token_budget` (vLLM's): after that many thinking tokens the end marker is forced and
  the answer follows (server/reasoning.py); the thinking counts toward `max_tokens`. `display: "omitted"` sends the
  block with empty `thinking` (and its signature). `output_config.effort` is the template's `reasoning_effort` variable
  (as vLLM passes it; GPT-OSS's template reads it). vLLM's `chat_template_kwargs` is accepted too; a value it
  gives `enable_thinking` / `reasoning_effort` that contradicts `thinking` / `effort` is a 400.
- A thinking block's `signature` is the SHA-256 hex digest of its `thinking` text: a checksum, not a proof of
  origin (nothing in it is secret), so thinking blocks sent back in assistant turns are not checked: their text is
  the turn's `reasoning` (rendered as the template renders reasoning: many drop earlier turns'), and
  `redacted_thinking` blocks (opaque: none of ours) are dropped.
- `output_config.format` (json_schema: structured outputs) is chat's `response_format`, grammar-enforced; with
  active tools it is refused as chat refuses the pair.
- `tool_choice` maps to chat's: auto -> "auto", any -> "required", tool -> the named function, none -> "none";
  `disable_parallel_tool_use` -> `parallel_tool_calls: false`. Calls are grammar-enforced as in chat.
- `stop_reason`: "tool_use" when the reply holds calls and ended on its own, "max_tokens" at the limit,
  "stop_sequence" (with `stop_sequence` set to the one that matched), else "end_turn".
- Streaming sends Anthropic's events (`message_start`, `content_block_start`, `ping`, `content_block_delta` with
  `text_delta` / `input_json_delta` / `thinking_delta`, then a thinking block's `signature_delta` just before its
  `content_block_stop`, `message_delta`, `message_stop`); a tool call's input is sent whole in one
  `input_json_delta` once the call is complete (it is only known valid then).
- Errors are Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with the status our OpenAI routes
  give the same failure (`anthropic_error`); the message begins with the field it concerns.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from neuron_opt.server.chat_bridge import (
    ChatRun,
    ReplyReader,
    arguments,
    chat_request,
    collect,
    outputs,
    renamed_fields,
    start,
)
from neuron_opt.server.protocol import ChatCompletionRequest, ProtocolError
from neuron_opt.server.serving import EngineError, OpenAIServing, internal_error_message
from neuron_opt.server.tool_parsers import ParsedCall

# chat request fields -> this API's names (for the field an error names)
FIELDS = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice", "response_format": "output_config.format",
          "thinking_token_budget": "thinking.budget_tokens"}
TOOL_FIELDS = {"parameters": "input_schema"}

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status; the message starts with `param` when it names a field."""
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None


class ImageBlock(_Strict):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None

    def chat_part(self, where: str) -> dict[str, Any]:
        """This image as chat's `image_url` part (a base64 source as a data URL)."""
        src = self.source
        if src.get("type") == "base64" and set(src) == {"type", "media_type", "data"} and all(
                isinstance(src[k], str) for k in ("media_type", "data")):
            url = f"data:{src['media_type']};base64,{src['data']}"
        elif src.get("type") == "url" and set(src) == {"type", "url"} and isinstance(src["url"], str):
            url = src["url"]
        else:
            raise ProtocolError(f"{where}.source: {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                                f"{{\"type\": \"url\", \"url\"}}", f"{where}.source")
        return {"type": "image_url", "image_url": {"url": url}}


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str  # (not checked: see the module docstring)
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self, where: str) -> str:
        if not isinstance(self.content, list):
            text = self.content or ""
        else:
            if any(isinstance(b, ImageBlock) for b in self.content):
                raise ProtocolError(f"{where}: images in tool results are not supported (send them in the "
                                    "user turn's own content)", where)
            text = "\n".join(b.text for b in self.content if isinstance(b, TextBlock))
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ImageBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def chat_messages(self, i: int) -> tuple[list[dict[str, Any]], list[str]]:
        """This turn as OpenAI chat messages, and the fields of its image blocks (in the order of the last message's
        image parts)."""
        where = f"messages.{i}.content"
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}], []
        texts: list[dict[str, Any]] = []  # text and image parts
        calls, results, thoughts, images = [], [], [], []
        for j, b in enumerate(self.content):
            if isinstance(b, ImageBlock):
                if self.role != "user":
                    raise ProtocolError(f"{where}.{j}: image blocks belong to user turns", f"{where}.{j}")
                texts.append(b.chat_part(f"{where}.{j}"))
                images.append(f"{where}.{j}")
            elif isinstance(b, (ThinkingBlock, RedactedThinkingBlock)):
                if self.role != "assistant":
                    raise ProtocolError(f"{where}.{j}: {b.type} blocks belong to assistant turns", f"{where}.{j}")
                if isinstance(b, ThinkingBlock):
                    thoughts.append(b.thinking)
            elif isinstance(b, TextBlock):
                texts.append({"type": "text", "text": b.text})
            elif isinstance(b, ToolUseBlock):
                if self.role != "assistant":
                    raise ProtocolError(f"{where}.{j}: tool_use blocks belong to assistant turns", f"{where}.{j}")
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            else:
                if self.role != "user":
                    raise ProtocolError(f"{where}.{j}: tool_result blocks belong to user turns", f"{where}.{j}")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text(f"{where}.{j}")})
        content: str | list[dict[str, Any]] = texts if images else "".join(t["text"] for t in texts)
        if self.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"] = calls
            if thoughts:
                msg["reasoning"] = "".join(thoughts)
            return [msg], []
        return results + ([{"role": "user", "content": content}] if texts or not results else []), images


class Tool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict):
    user_id: str | None = None  # informational, as OpenAI's `user`


class JsonOutputFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None

    def check(self, max_tokens: int | None) -> None:
        """Anthropic's rules for the budget (`max_tokens`: the request's; None: count_tokens, which has none)."""
        if self.type != "enabled":
            if self.budget_tokens is not None:
                raise ProtocolError(f"thinking.budget_tokens: goes with type 'enabled' only, not {self.type!r}",
                                    "thinking.budget_tokens")
            return
        if self.budget_tokens is None:
            raise ProtocolError("thinking.budget_tokens: required with type 'enabled'", "thinking.budget_tokens")
        if self.budget_tokens < 1024:
            raise ProtocolError(f"thinking.budget_tokens: must be at least 1024, got {self.budget_tokens}",
                                "thinking.budget_tokens")
        if max_tokens is not None and max_tokens <= self.budget_tokens:
            raise ProtocolError(f"max_tokens: must be greater than thinking.budget_tokens ({max_tokens} <= "
                                f"{self.budget_tokens}); the thinking counts toward max_tokens", "max_tokens")


class _Prompt(_Strict):
    """What renders the prompt: shared by /v1/messages and /v1/messages/count_tokens."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: the chat template's variables
    # chat's image parts -> this request's image blocks (set by chat_fields; errors name the block)
    _image_fields: dict[str, str] = PrivateAttr(default_factory=dict)

    def template_kwargs(self, reasoning: bool) -> dict[str, Any] | None:
        """`chat_template_kwargs` with `thinking` and `output_config.effort` as the template's variables
        (`reasoning`: the server has a reasoning parser)."""
        kwargs = dict(self.chat_template_kwargs or {})
        think = self.thinking
        effort = self.output_config.effort if self.output_config is not None else None
        wanted: list[tuple[str, str, Any]] = []  # (field, template variable, value)
        if think is not None:
            if think.type != "disabled" and not reasoning:
                raise ProtocolError(f"thinking: type {think.type!r} needs a reasoning model (serve "
                                    "--reasoning-parser); send {\"type\": \"disabled\"} or leave it out",
                                    "thinking")
            if think.type != "adaptive":
                wanted.append(("thinking", "enable_thinking", think.type == "enabled"))
        if effort is not None:
            wanted.append(("output_config.effort", "reasoning_effort", effort))
        for field, name, value in wanted:
            if name in kwargs and kwargs[name] != value:
                raise ProtocolError(f"{field}: contradicts chat_template_kwargs.{name} ({kwargs[name]!r})", field)
            kwargs[name] = value
        return kwargs or None

    def chat_fields(self, reasoning: bool) -> dict[str, Any]:
        """The chat request's messages, tools, tool choice and template variables."""
        if not self.messages:
            raise ProtocolError("messages: at least one message is required", "messages")
        msgs: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            msgs.append({"role": "system", "content": system})
        self._image_fields = {}
        for i, m in enumerate(self.messages):
            turn, images = m.chat_messages(i)
            msgs += turn
            parts = [j for j, p in enumerate(msgs[-1]["content"]) if p["type"] == "image_url"] if images else []
            self._image_fields |= {f"messages[{len(msgs) - 1}].content[{j}]": f for j, f in zip(parts, images,
                                                                                                  strict=True)}
        out: dict[str, Any] = {"model": self.model, "messages": msgs}
        if self.tools:
            out["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            if (choice.type == "tool") != (choice.name is not None):
                raise ProtocolError("tool_choice: `name` goes with type 'tool', and only with it", "tool_choice")
            if choice.type == "none" and choice.disable_parallel_tool_use is not None:
                raise ProtocolError("tool_choice: disable_parallel_tool_use does not go with type 'none'",
                                    "tool_choice")
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name}})
            if choice.disable_parallel_tool_use:
                out["parallel_tool_calls"] = False
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        kwargs = self.template_kwargs(reasoning)
        if kwargs is not None:
            out["chat_template_kwargs"] = kwargs
        return out


class MessagesRequest(_Prompt):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None

    def chat_request(self, reasoning: bool) -> ChatCompletionRequest:
        """This request as chat's (`reasoning`: the server has a reasoning parser)."""
        if self.max_tokens < 1:
            raise ProtocolError("max_tokens: must be at least 1", "max_tokens")
        if self.temperature is not None and not 0.0 <= self.temperature <= 1.0:
            raise ProtocolError(f"temperature: must be in [0, 1], got {self.temperature}", "temperature")
        fields = self.chat_fields(reasoning)
        if self.thinking is not None:
            self.thinking.check(self.max_tokens)
        sampling = {"max_tokens": self.max_tokens, "stop": self.stop_sequences, "temperature": self.temperature,
                    "top_p": self.top_p, "top_k": self.top_k,
                    "user": self.metadata.user_id if self.metadata else None,
                    "thinking_token_budget": self.thinking.budget_tokens if self.thinking is not None else None}
        return chat_request({**fields, **{k: v for k, v in sampling.items() if v is not None}}, FIELDS,
                            TOOL_FIELDS)


class CountTokensRequest(_Prompt):
    def chat_request(self, reasoning: bool) -> ChatCompletionRequest:
        fields = self.chat_fields(reasoning)
        if self.thinking is not None:
            self.thinking.check(None)
        return chat_request(fields, FIELDS, TOOL_FIELDS)


def _stop_reason(finish: str, stop: str | int | None, called: bool) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, stop_sequence)."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _tool_use(call: ParsedCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": arguments(call)}


def _signature(thinking: str) -> str:
    """A thinking block's signature (see the module docstring)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def _thinking(thinking: str, shown: bool) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking if shown else "", "signature": _signature(thinking)}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class AnthropicServing:
    """/v1/messages and /v1/messages/count_tokens over the OpenAI routes' serving."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, Any]:
        """The prompt's token count, rendered exactly as /v1/messages renders it."""
        s = self.serving
        chat = req.chat_request(s.reasoning_parser is not None)
        with renamed_fields(FIELDS, req._image_fields):
            s.check_model(chat.model)
            chat.check_limits(s.limits, s.max_model_len)
            ids, _, _ = await s._chat_prompt(chat)
        return {"input_tokens": len(ids)}

    async def messages(self, req: MessagesRequest, arrival: float,
                       is_disconnected: Callable[[], Any]) -> dict[str, Any] | AsyncIterator[str]:
        chat = req.chat_request(self.serving.reasoning_parser is not None)
        run = await start(self.serving, chat, arrival, FIELDS, req._image_fields)
        mid = f"msg_{uuid.uuid4().hex}"
        shown = req.thinking is None or req.thinking.display != "omitted"
        if req.stream:
            return self._stream(run, mid, arrival, shown)
        reply = await collect(self.serving, run, arrival, is_disconnected)
        content: list[dict[str, Any]] = [_thinking(reply.reasoning, shown)] if reply.reasoning else []  # (as streamed)
        if reply.text or not reply.calls:
            content.append({"type": "text", "text": reply.text})
        content += [_tool_use(c) for c in reply.calls]
        reason, sequence = _stop_reason(reply.finish_reason, reply.stop_reason, bool(reply.calls))
        return {"id": mid, "type": "message", "role": "assistant", "model": run.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": len(run.prompt_ids), "output_tokens": reply.num_tokens}}

    async def _stream(self, run: ChatRun, mid: str, arrival: float, shown: bool) -> AsyncIterator[str]:
        """The reply as Anthropic's events: a thinking block (when the reply thinks), a text block, tool_use
        blocks, in that order, each closed before the next opens."""
        head = {"id": mid, "type": "message", "role": "assistant", "model": run.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(run.prompt_ids), "output_tokens": 0}}
        yield _event("message_start", {"message": head})
        reader = ReplyReader(run)
        index, open_block, texted = 0, None, False  # the block being written: "thinking" / "text" / None

        def begin(block: dict[str, Any]) -> str:
            nonlocal open_block, texted
            open_block, texted = block["type"], texted or block["type"] == "text"
            return _event("content_block_start", {"index": index, "content_block": block})

        def close() -> list[str]:
            nonlocal index, open_block
            events = []
            if open_block == "thinking":
                events.append(_event("content_block_delta", {"index": index, "delta": {
                    "type": "signature_delta", "signature": _signature(reader.reasoning or "")}}))
            if open_block is not None:
                events.append(_event("content_block_stop", {"index": index}))
                index, open_block = index + 1, None
            return events

        if run.parser is None and run.thinker is None:  # plain text: its block opens at once, as Anthropic's does
            yield begin({"type": "text", "text": ""})
        yield _event("ping", {})
        finish, stop = "abort", None
        called = False
        try:
            async for _, out in outputs(self.serving, run, arrival):
                if out.finished:
                    finish, stop = out.finish_reason or "stop", out.stop_reason
                if (fed := reader.read(out)) is None:
                    continue
                thought, piece, calls = fed
                if thought:
                    if open_block != "thinking":
                        for e in close():
                            yield e
                        yield begin({"type": "thinking", "thinking": "", "signature": ""})
                    if shown:
                        yield _event("content_block_delta", {"index": index,
                                                             "delta": {"type": "thinking_delta", "thinking": thought}})
                if piece:
                    if open_block != "text":
                        for e in close():
                            yield e
                        yield begin({"type": "text", "text": ""})
                    yield _event("content_block_delta", {"index": index,
                                                         "delta": {"type": "text_delta", "text": piece}})
                for call in calls:
                    for e in close():
                        yield e
                    block = _tool_use(call)
                    yield begin({**block, "input": {}})
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                    for e in close():
                        yield e
                    called = True
        except EngineError as e:
            yield _event("error", anthropic_error(500, internal_error_message(e)))
            return
        if not texted and not called:  # no text: one empty text block, as the non-streamed reply has
            for e in close():
                yield e
            yield begin({"type": "text", "text": ""})
        for e in close():
            yield e
        reason, sequence = _stop_reason(finish, stop, called)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": {"output_tokens": reader.num_tokens}})
        yield _event("message_stop", {})
