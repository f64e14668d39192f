"""OpenAI's Responses API: `POST /v1/responses` and `GET /v1/responses/{id}`, translated to a chat request and run
as /v1/chat/completions runs it (server/chat_bridge.py).

Design decisions
- Request types are strict (`extra="forbid"`): an unknown field, input item or tool type is a 400 naming it.
  Fields we cannot honour are declared so that their neutral values pass and anything else is a 400: reasoning
  summaries (`reasoning.summary`: none are written), `truncation` other than "disabled", `background`, `include`.
- `input` is a string (one user message) or items: messages (`input_text` / `output_text` parts; a user message's
  `input_image` parts with an `image_url` become chat's `image_url` parts, loaded and checked as chat's,
  server/media.py, errors naming the part, `input.0.content.1`; `file_id` images and `input_file` are a 400),
  `function_call` (joined into the assistant turn before it) and `function_call_output` (a tool message).
  The output items of an earlier response are taken back as input unchanged, as the Agents SDK sends them.
  `instructions` is the system message, and is not carried over from a previous response (OpenAI's rule).
  A `reasoning` item is the thinking of the assistant turn that follows it (its `content` texts, else its
  `summary` texts), the chat message's `reasoning`, rendered as the template renders reasoning.
- Reasoning (with a reasoning parser, server/reasoning.py): the reply's thinking, when not empty, is a `reasoning`
  output item (`content`: one `reasoning_text`; `summary` empty) before the message and function_call items;
  `output_tokens_details.reasoning_tokens` counts it as chat counts it. `reasoning.effort` "none" / "minimal" set the
  template's `enable_thinking` false, the others true and the template's `reasoning_effort` variable to the effort
  (GPT-OSS's template reads it); they need a reasoning parser.
- Function `tools` and `tool_choice` are chat's (grammar-enforced calls); `text.format` json_schema / json_object
  is chat's `response_format`; `max_output_tokens` is chat's `max_tokens`. Errors name the Responses field.
- A reply cut by `max_output_tokens` is `status: "incomplete"` with `incomplete_details.reason`
  "max_output_tokens" (streamed: a `response.incomplete` event in place of `response.completed`).
- Streaming sends the event sequence the official client checks (`response.created`, `response.in_progress`, per
  item `response.output_item.added` ... `response.output_item.done`, `response.completed`), every event with a
  `sequence_number` counting from 0. A function call's arguments are sent whole in one delta once the call is
  complete (it is only known valid then).
- `store` and `previous_response_id`: off unless `serve --enable-store` (vLLM: VLLM_ENABLE_RESPONSES_API_STORE).
  Then every response with `store` not false is kept in memory, the oldest dropped past MAX_STORED_RESPONSES, and
  a request may continue one by id (its conversation, the earlier input and output, goes before the new input).
  Without the store a response says `store: false`, `previous_response_id` is a 400, and `GET` is a 404.
- `usage` counts input, output and total tokens; `input_tokens_details.cached_tokens` the input tokens whose K/V
  came from the prefix cache; `output_tokens_details.reasoning_tokens` the reasoning's (0 without reasoning).
- Streamed reasoning: its item's `response.output_item.added`, `response.content_part.added` (a `reasoning_text`
  part), `response.reasoning_text.delta`..., `response.reasoning_text.done`, `response.content_part.done`,
  `response.output_item.done`, before the message's events.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag

from neuron_opt.server.chat_bridge import ChatRun, ReplyReader, chat_request, collect, outputs, start
from neuron_opt.server.protocol import ChatCompletionRequest, ProtocolError
from neuron_opt.server.serving import EngineError, NotFoundError, OpenAIServing, internal_error_message, sse
from neuron_opt.server.tool_parsers import ParsedCall

MAX_STORED_RESPONSES = 1024  # with --enable-store: the responses kept (oldest dropped first)

# chat request fields -> this API's names (for the field an error names)
FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class ResponseNotFoundError(NotFoundError):
    """A response id this server does not hold (HTTP 404 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # (an earlier output's: taken back as it came)
    logprobs: list[Any] | None = None


class ImagePart(_Strict):
    type: Literal["input_image", "input_file"]
    image_url: str | None = None
    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None
    detail: str | None = None


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None
    phase: None = None  # (newer clients echo it back with an output message: only its empty value is accepted)

    def text(self, where: str) -> str:
        content, images = self.chat_content(where)
        if images:
            raise ProtocolError(f"{images[0]}: images belong to user messages", images[0])
        assert isinstance(content, str)
        return content

    def chat_content(self, where: str) -> tuple[str | list[dict[str, Any]], list[str]]:
        """The content as chat's (its text, or text and `image_url` parts when it holds images) and the fields of
        its images in order."""
        if isinstance(self.content, str):
            return self.content, []
        parts: list[dict[str, Any]] = []
        images = []
        for j, p in enumerate(self.content):
            if isinstance(p, TextPart):
                parts.append({"type": "text", "text": p.text})
                continue
            field = f"{where}.content.{j}"
            if p.type != "input_image" or p.image_url is None or p.file_id is not None or p.file_data is not None \
                    or p.filename is not None:
                raise ProtocolError(f"{field}: only input_image parts with an image_url (a data: or http(s) URL) "
                                    f"are supported, not {p.type} {'with a file' if p.type == 'input_image' else ''}"
                                    .rstrip(), field)
            spec = {"url": p.image_url, **({"detail": p.detail} if p.detail is not None else {})}
            parts.append({"type": "image_url", "image_url": spec})
            images.append(field)
        if not images:
            return "".join(p["text"] for p in parts), []
        return parts, images


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: None = None  # (newer clients echo these back with an output call: only their empty values pass)
    caller: None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class SummaryPart(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningTextPart(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier response's reasoning, taken back as input."""

    type: Literal["reasoning"]
    summary: list[SummaryPart]
    content: list[ReasoningTextPart] | None = None
    id: str | None = None
    status: str | None = None
    encrypted_content: str | None = None  # (none of ours is encrypted: refused by name in `messages`)

    def text(self) -> str:
        return "".join(p.text for p in self.content) if self.content else "".join(p.text for p in self.summary)


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: None = None  # (no summaries are written: only their absence passes)
    generate_summary: None = None

    def template_kwargs(self, reasoning: bool) -> dict[str, Any]:
        """The effort as the template's variables (`reasoning`: the server has a reasoning parser)."""
        if self.effort is None:
            return {}
        if self.effort in ("none", "minimal"):
            return {"enable_thinking": False}
        if not reasoning:
            raise ProtocolError(f"reasoning.effort: {self.effort!r} needs a reasoning model (serve "
                                "--reasoning-parser); send 'none' or leave it out", "reasoning.effort")
        return {"enable_thinking": True, "reasoning_effort": self.effort}


def _item_type(v: Any) -> str:
    return (v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")) or "message"


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                 | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # our calls are always grammar-enforced


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the one a model without the knob has


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    background: Literal[False] | None = None
    include: list[Any] | None = Field(default=None, max_length=0)
    # "<message index in `messages`' list>.<part index>" -> this request's image part (set by `messages`)
    _image_fields: dict[str, str] = PrivateAttr(default_factory=dict)

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as chat messages (without `instructions`): `history`, then this input."""
        out = [dict(m) for m in history]
        self._image_fields = {}
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        if not self.input:
            raise ProtocolError("input: at least one item is required", "input")
        thought: str | None = None  # a reasoning item's, for the assistant turn that follows it

        def assistant(turn: dict[str, Any]) -> dict[str, Any]:
            nonlocal thought
            if thought is not None:
                turn, thought = {**turn, "reasoning": thought}, None
            return turn

        for i, item in enumerate(self.input):
            if isinstance(item, ReasoningItem):
                if item.encrypted_content is not None:
                    raise ProtocolError(f"input.{i}.encrypted_content: encrypted reasoning is not supported (this "
                                        "server writes its reasoning as text)", f"input.{i}.encrypted_content")
                thought = (thought or "") + item.text()
            elif isinstance(item, MessageItem) and item.role == "assistant":
                out.append(assistant({"role": "assistant", "content": item.text(f"input.{i}")}))
            elif isinstance(item, MessageItem) and item.role == "user":
                _no_thought(thought, i)
                content, images = item.chat_content(f"input.{i}")
                self._image_fields |= {f"{len(out)}.{j}": f for j, f in zip(
                    [j for j, p in enumerate(content) if p["type"] == "image_url"] if images else [], images,
                    strict=True)}
                out.append({"role": "user", "content": content})
            elif isinstance(item, MessageItem):
                _no_thought(thought, i)
                out.append({"role": item.role, "content": item.text(f"input.{i}")})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and thought is None:  # the calls of the turn just before
                    out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
                else:
                    out.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
            else:
                _no_thought(thought, i)
                output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        _no_thought(thought, len(self.input))
        return out

    def image_fields(self) -> dict[str, str]:
        """Chat's image parts (`messages[i].content[j]`, as `chat_request` numbers its messages) -> this request's
        image parts, for the errors about an image (`messages` sets them)."""
        offset = 1 if self.instructions is not None else 0
        return {f"messages[{int(k.split('.')[0]) + offset}].content[{k.split('.')[1]}]": f
                for k, f in self._image_fields.items()}

    def chat_request(self, conversation: list[dict[str, Any]], reasoning: bool) -> ChatCompletionRequest:
        """This request as chat's (`reasoning`: the server has a reasoning parser)."""
        msgs = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else []) + \
            conversation
        body: dict[str, Any] = {"messages": msgs}
        kwargs = self.reasoning.template_kwargs(reasoning) if self.reasoning is not None else {}
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else {
                "type": "function", "function": {"name": self.tool_choice.name}}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.name is None or fmt.schema_ is None:
                raise ProtocolError("text.format: json_schema needs `name` and `schema`", "text.format")
            body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
                exclude={"type"}, exclude_none=True, by_alias=True)}
        elif fmt is not None and (fmt.name, fmt.schema_, fmt.description, fmt.strict) != (None,) * 4:
            raise ProtocolError(f"text.format: name, schema, description and strict go with type 'json_schema', "
                                f"not {fmt.type!r}", "text.format")
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        fields = {"model": self.model, "parallel_tool_calls": self.parallel_tool_calls,
                  "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "user": self.user}
        body.update({k: v for k, v in fields.items() if v is not None})
        return chat_request(body, FIELDS, {})


def _no_thought(thought: str | None, i: int) -> None:
    """A 400 for a reasoning item (just before item `i`) that no assistant turn follows."""
    if thought is not None:
        raise ProtocolError(f"input.{i - 1}: a reasoning item goes just before the assistant message or "
                            "function_call it belongs to", f"input.{i - 1}")


class ResponseStore:
    """The responses kept with `serve --enable-store`: id -> (the response object, its conversation as chat
    messages: the input and the reply, without instructions), the oldest dropped past `capacity`."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        if rid not in self._items:
            raise ResponseNotFoundError(f"Response with id {rid!r} not found.", param)
        return self._items[rid]


def _call_item(call: ParsedCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": call.name, "arguments": call.arguments, "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(mid: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}


def _reasoning_item(rid: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": rid, "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def _reply_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the assistant's chat message (for a conversation continued from it)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in output if c["type"] == "function_call"]
    thought = [p["text"] for item in output if item["type"] == "reasoning" for p in item["content"]]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}),
             **({"reasoning": "".join(thought)} if thought else {})}]


class ResponsesServing:
    """/v1/responses over the OpenAI routes' serving. `store`: the response store (None: `--enable-store` off)."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore | None) -> None:
        self.serving, self.store = serving, store

    def retrieve(self, rid: str) -> dict[str, Any]:
        if self.store is None:
            raise ResponseNotFoundError(f"Response with id {rid!r} not found (this server stores no responses: "
                                        "serve --enable-store)", "response_id")
        return self.store.get(rid, "response_id")[0]

    def _head(self, req: ResponsesRequest, rid: str, model: str, stored: bool) -> dict[str, Any]:
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {
            "type": "text"}
        tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else (
            req.tool_choice or "auto")
        return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "error": None, "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": req.reasoning.effort, "summary": None} if req.reasoning else None,
                "store": stored,
                "temperature": 1.0 if req.temperature is None else req.temperature, "text": {"format": fmt},
                "tool_choice": tool_choice, "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
                "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": None,
                "user": req.user, "metadata": req.metadata or {}}

    @staticmethod
    def _finish(head: dict[str, Any], output: list[dict[str, Any]], finish: str, n_in: int, n_out: int,
                n_cached: int, n_reasoning: int) -> dict[str, Any]:
        incomplete = finish == "length"
        return {**head, "status": "incomplete" if incomplete else "completed", "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": n_cached},
                          "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": n_reasoning},
                          "total_tokens": n_in + n_out}}

    async def create(self, req: ResponsesRequest, arrival: float,
                     is_disconnected: Callable[[], Any]) -> dict[str, Any] | AsyncIterator[str]:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            if self.store is None:
                raise ProtocolError("previous_response_id: this server stores no responses (serve --enable-store)",
                                    "previous_response_id")
            history = self.store.get(req.previous_response_id, "previous_response_id")[1]
        conversation = req.messages(history)
        chat = req.chat_request(conversation, self.serving.reasoning_parser is not None)
        run = await start(self.serving, chat, arrival, FIELDS, req.image_fields())
        stored = self.store is not None and req.store is not False
        head = self._head(req, f"resp_{uuid.uuid4().hex}", run.model, stored)

        def keep(response: dict[str, Any]) -> None:
            if stored and self.store is not None:
                self.store.put(response, conversation + _reply_messages(response["output"]))

        if req.stream:
            return self._stream(run, head, arrival, keep)
        reply = await collect(self.serving, run, arrival, is_disconnected)
        output = [_reasoning_item(f"rs_{uuid.uuid4().hex}", reply.reasoning, "completed")] if (
            reply.reasoning) else []  # (empty reasoning: no item, as streamed)
        if reply.text or not reply.calls:
            output.append(_message_item(f"msg_{uuid.uuid4().hex}", reply.text, "completed"))
        output += [_call_item(c) for c in reply.calls]
        response = self._finish(head, output, reply.finish_reason, len(run.prompt_ids), reply.num_tokens,
                                reply.num_cached_tokens, reply.reasoning_tokens)
        keep(response)
        return response

    async def _stream(self, run: ChatRun, head: dict[str, Any], arrival: float,
                      keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
        """The reply as the Responses events: a reasoning item (when the reply thinks), a message item, function_call
        items, in that order, each done before the next is added."""
        seq = 0

        def event(kind: str, **data: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\n" + sse({"type": kind, "sequence_number": seq - 1, **data})

        yield event("response.created", response=head)
        yield event("response.in_progress", response=head)
        output: list[dict[str, Any]] = []
        current: dict[str, Any] | None = None  # the reasoning or message item being written
        said = False  # a message item was written

        def part(kind: str, text: str) -> dict[str, Any]:
            return _text_part(text) if kind == "message" else {"type": "reasoning_text", "text": text}

        def open_item(kind: str) -> list[str]:
            nonlocal current, said
            events = close_item()
            make = _message_item if kind == "message" else _reasoning_item
            current = make(f"{'msg' if kind == 'message' else 'rs'}_{uuid.uuid4().hex}", None, "in_progress")
            said = said or kind == "message"
            output.append(current)
            at = {"item_id": current["id"], "output_index": len(output) - 1, "content_index": 0}
            return events + [event("response.output_item.added", output_index=len(output) - 1, item=current),
                             event("response.content_part.added", **at, part=part(kind, ""))]

        def write(kind: str, piece: str) -> list[str]:
            events = open_item(kind) if current is None or current["type"] != kind else []
            assert current is not None
            if not current["content"]:
                current["content"] = [part(kind, "")]
            current["content"][0]["text"] += piece
            at = {"item_id": current["id"], "output_index": len(output) - 1, "content_index": 0}
            if kind == "message":
                return events + [event("response.output_text.delta", **at, delta=piece, logprobs=[])]
            return events + [event("response.reasoning_text.delta", **at, delta=piece)]

        def close_item() -> list[str]:
            nonlocal current
            if current is None:
                return []
            kind = current["type"]
            text = current["content"][0]["text"] if current["content"] else ""
            make = _message_item if kind == "message" else _reasoning_item
            done = make(current["id"], text, "completed")
            index = output.index(current)
            output[index], current = done, None
            at = {"item_id": done["id"], "output_index": index, "content_index": 0}
            text_done = (event("response.output_text.done", **at, text=text, logprobs=[]) if kind == "message"
                         else event("response.reasoning_text.done", **at, text=text))
            return [text_done, event("response.content_part.done", **at, part=part(kind, text)),
                    event("response.output_item.done", output_index=index, item=done)]

        reader = ReplyReader(run)
        if run.parser is None and run.thinker is None:  # plain text: its message opens at once
            for e in open_item("message"):
                yield e
        finish, cached = "abort", 0
        called = False
        try:
            async for _, out in outputs(self.serving, run, arrival):
                if out.finished:
                    finish, cached = out.finish_reason or "stop", out.num_cached_tokens
                if (fed := reader.read(out)) is None:
                    continue
                thought, piece, calls = fed
                for e in (write("reasoning", thought) if thought else []) + (write("message", piece) if piece else []):
                    yield e
                for call in calls:
                    for e in close_item():
                        yield e
                    item = _call_item(call, "in_progress")
                    output.append(item)
                    index = len(output) - 1
                    yield event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=item["arguments"])
                    item["status"] = "completed"
                    yield event("response.output_item.done", output_index=index, item=item)
                    called = True
        except EngineError as e:
            failed = {**head, "status": "failed", "output": output,
                      "error": {"code": "server_error", "message": internal_error_message(e)}}
            yield event("response.failed", response=failed)
            return
        if not said and not called:  # no text: one empty message, as the non-streamed reply has
            for e in open_item("message"):
                yield e
        for e in close_item():
            yield e
        response = self._finish(head, output, finish, len(run.prompt_ids), reader.num_tokens, cached,
                                 reader.reasoning_tokens)
        keep(response)
        yield event("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                    response=response)
