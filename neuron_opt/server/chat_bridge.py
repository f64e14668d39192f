"""What the routes that speak other APIs over chat share (Anthropic's /v1/messages, OpenAI's /v1/responses): a
request translated to a ChatCompletionRequest is run exactly as /v1/chat/completions runs it (the same limits,
template, tool grammar and sampling), and its reply is read back as text and calls.

Design decisions
- A translated request is one chat request (`n` = 1): the prompt through the chat template, the tools rendered
  and enforced by the tool parser's grammar (server/tools.py), the sampling params and their checks.
- Errors name the route's own field: a `ProtocolError` or `NeuronOptError` raised with a chat field as its `param`
  (`stop`, `max_tokens`, `messages`, ...) is renamed through the route's `fields` map before it reaches the client;
  an image's field (`messages[2].content[0]...`, server/media.py) through the map of the chat image parts the
  route's own image blocks became (`image_fields`).
- `ReplyReader` reads a reply as it grows: the text pieces and complete calls since its last look, the difference
  of successive parser scans, so a streamed reply reassembles into exactly the non-streamed one.
- Reasoning: with a reasoning parser (`serve --reasoning-parser`, server/reasoning.py) the reply's thinking is
  split off before the tool scan (`ReplyReader.feed`), exactly as chat splits it: calls and structured outputs are
  read and enforced after the thinking ends, and the reasoning tokens are counted as chat counts them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from neuron_opt.errors import NeuronOptError
from neuron_opt.runtime.output import RequestOutput
from neuron_opt.server.protocol import ChatCompletionRequest, ProtocolError
from neuron_opt.server.reasoning import ReasoningParser, ReasoningStream, Start
from neuron_opt.server.serving import OpenAIServing
from neuron_opt.server.tool_parsers import ParsedCall, ToolParser


@contextlib.contextmanager
def renamed_fields(fields: dict[str, str], image_fields: dict[str, str] | None = None) -> Iterator[None]:
    """Errors whose `param` is a chat field name the route's field (`fields`: chat name -> route name) instead,
    in their message too when it begins with the chat name. `image_fields`: chat image part (`messages[i].content[j]`)
    -> the route's field of that image, for the errors about an image."""
    try:
        yield
    except (ProtocolError, NeuronOptError) as e:
        param = getattr(e, "param", None)
        if param is not None:
            root, sep, rest = param.partition(".")
            new = fields.get(root, root) + sep + rest
            part = next((k for k in image_fields or () if param == k or param.startswith(k + ".")), None)
            if part is not None and image_fields is not None:
                new = image_fields[part]  # the route's image block, as a whole
            if new != param:
                e.param = new
                message = str(e)
                if message.startswith(param):
                    e.args = (new + message[len(param):], *e.args[1:])
        raise


def chat_request(body: dict[str, Any], fields: dict[str, str], tool_fields: dict[str, str]) -> ChatCompletionRequest:
    """`body` (a translated request) as a chat request. A rule of chat's that the route's own types do not repeat
    (a tool name's pattern) fails as a 400 naming the route's field: `fields` renames chat's top-level fields,
    `tool_fields` those of a tool's function (`tools.<i>.function.<field>` -> `tools.<i>.<renamed field>`)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(x) for x in err["loc"]]
        if loc[:1] == ["tools"] and len(loc) > 3:
            loc = ["tools", loc[1], tool_fields.get(loc[3], loc[3])]
        field = ".".join([fields.get(loc[0], loc[0]), *loc[1:]])
        raise ProtocolError(f"{field}: {err['msg']}", field) from None


@dataclass
class ChatRun:
    """One translated request queued on the engine.

    Args:
        model: the model name the reply reports (the base model's or the LoRA adapter's).
        prompt_ids: the rendered prompt's token ids.
        parser: the tool parser, when the request's tools are active (None: the reply is plain text).
        rids, queue: the engine request ids and their output queue (OpenAIServing._submit).
        stops: the request's stop strings.
        thinker: the reasoning parser (None: the reply is not split).
        start: where the reply starts relative to its reasoning.
    """

    model: str
    prompt_ids: list[int]
    parser: ToolParser | None
    rids: list[str]
    queue: Any
    stops: tuple[str, ...]
    thinker: ReasoningParser | None = None
    start: Start = Start.NONE


async def start(serving: OpenAIServing, chat: ChatCompletionRequest, arrival: float, fields: dict[str, str],
                image_fields: dict[str, str] | None = None) -> ChatRun:
    """Check, render and queue `chat` as /v1/chat/completions does (one sample); errors name the route's fields
    (`image_fields`: see renamed_fields)."""
    with renamed_fields(fields, image_fields):
        lora = serving.check_model(chat.model)
        serving.check_generates()
        chat.check_limits(serving.limits, serving.max_model_len)
        ids, tools, engine_inputs = await serving._chat_prompt(chat)
        active = tools is not None and tools.active
        params, begin = serving.chat_params(chat, ids, tools)
        # (it renames chat's fields itself)
        rids, q = await serving._submit(chat, ids, params, arrival, lora, engine_inputs)
    return ChatRun(lora or serving.model_name, ids, serving.tool_parser if active else None, rids, q, params.stop,
                   serving.reasoning_parser, begin)


def outputs(serving: OpenAIServing, run: ChatRun, arrival: float,
            is_disconnected: Callable[[], Any] | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The run's engine outputs (the unfinished request is aborted when the consumer stops early)."""
    return serving._outputs(run.rids, run.queue, arrival, is_disconnected)


@dataclass
class Reply:
    """A finished reply: its text and calls, how it ended, its token count and its prompt tokens that came from the
    prefix cache; its reasoning (None: it has none) and reasoning tokens."""

    text: str
    calls: tuple[ParsedCall, ...]
    finish_reason: str
    stop_reason: str | int | None
    num_tokens: int
    num_cached_tokens: int
    reasoning: str | None = None
    reasoning_tokens: int = 0


class ReplyReader:
    """A reply read as it grows: `feed(text so far, final, its token count)` returns the new reasoning piece, the
    new text piece ("" if none) and the calls completed since the last feed; `read(output)` adds an engine output
    to the reply's text and token count (`raw`, `num_tokens`) and feeds it."""

    def __init__(self, run: ChatRun) -> None:
        self.parser = run.parser
        self.thinking = ReasoningStream(run.thinker, run.start) if run.thinker is not None else None
        self.text = ""
        self.calls: list[ParsedCall] = []
        self.raw, self.num_tokens = "", 0  # the reply's text as generated, and its tokens, so far

    @property
    def reasoning(self) -> str | None:
        """The reasoning so far (None: the reply has none, so far)."""
        return self.thinking.reasoning if self.thinking is not None and self.thinking.had_reasoning else None

    @property
    def reasoning_tokens(self) -> int:
        return self.thinking.tokens if self.thinking is not None else 0

    def read(self, out: RequestOutput) -> tuple[str, str, list[ParsedCall]] | None:
        """`out` added to the reply; what `feed` returns for the reply so far, or None when `out` neither adds text
        nor finishes it."""
        self.raw += out.text_delta
        self.num_tokens += len(out.new_token_ids)
        if not out.text_delta and not out.finished:
            return None
        return self.feed(self.raw, out.finished, self.num_tokens)

    def feed(self, text: str, final: bool, num_tokens: int) -> tuple[str, str, list[ParsedCall]]:
        thought, content = "", text
        if self.thinking is not None:
            thought, content = self.thinking.feed(text, final, num_tokens)
        calls: tuple[ParsedCall, ...] = ()
        if self.parser is not None:
            scan = self.parser.scan(content, final)
            content, calls = scan.content, scan.calls
        piece = ""
        if len(content) > len(self.text) and content.startswith(self.text):
            piece, self.text = content[len(self.text):], content
        new = list(calls[len(self.calls):])
        self.calls += new
        return thought, piece, new


async def collect(serving: OpenAIServing, run: ChatRun, arrival: float,
                  is_disconnected: Callable[[], Any]) -> Reply:
    """The run's whole reply (non-streaming: a client gone away aborts it)."""
    text, n, last = "", 0, None
    reader = ReplyReader(run)
    async for _, out in outputs(serving, run, arrival, is_disconnected):
        text += out.text_delta
        n += len(out.new_token_ids)
        last = out
        if reader.thinking is not None and not out.finished:  # (its reasoning tokens are counted as they come)
            reader.thinking.feed(text, False, n)
    reader.feed(text, True, n)
    end = ("abort", None, 0) if last is None or not last.finished else (  # abort: the client went away
        last.finish_reason or "stop", last.stop_reason, last.num_cached_tokens)
    return Reply(reader.text, tuple(reader.calls), end[0], end[1], n, end[2], reader.reasoning,
                 reader.reasoning_tokens)


def arguments(call: ParsedCall) -> dict[str, Any]:
    """A call's arguments as an object (the parser wrote them as JSON text of one)."""
    value = json.loads(call.arguments)
    assert isinstance(value, dict)
    return value
