"""OpenAI request types (pydantic) and their translation to SamplingParams.

Design decisions
- `extra="forbid"`: a field we do not know is a 400 naming it, never silently ignored. Fields the OpenAI
  client may send that we cannot honour (`suffix`, `best_of > 1`, ...) are declared so that their
  harmless values (null, empty, default) pass and anything else is a 400 saying it is unsupported.
- Structured outputs come in four spellings, one per request: OpenAI's `response_format` (json_object,
  json_schema), vLLM's `structured_outputs` {json | regex | choice | grammar | json_object | structural_tag}, and
  vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. Errors in the schema or grammar
  name the field the request used.
- `n` samples share the prompt; each gets its own seed (seed + i) when a seed is given.
- Strict types (no "0.5" -> 0.5 coercion, no true -> 1): wrong types are 400s with the field's name.
- vLLM's extra sampling fields (top_k, min_p, min_tokens, ignore_eos, stop_token_ids) and
  `stream_options.continuous_usage_stats` are honoured, so vLLM-compatible clients (guidellm, vLLM's benchmarks)
  work unchanged; with the `openai` client they go in `extra_body`.
- Errors name the request's own field (`param`): SamplingParams raises with its field names, and
  `request_field` maps them back (chat's `max_completion_tokens`, `top_logprobs`).
- `chat_template_kwargs` (vLLM's) reach the chat template as variables (`{"enable_thinking": false}`); bounded like
  a schema, and a 400 for the names the server sets itself (`RESERVED_TEMPLATE_KWARGS`: messages, tools,
  add_generation_prompt, ...).
- An assistant message's earlier thinking, `reasoning` (or its older name `reasoning_content`), reaches the template
  under both names, as vLLM passes it; templates decide whether to render it (many drop earlier turns' thinking).
- Defaults follow OpenAI: temperature 1.0, completions max_tokens 16; chat max_tokens = what the context
  has left.
- Sizes are bounded before any work that grows with them (`check_limits`, server/limits.py): the prompt's characters
  before tokenizing, the stop strings before the engine scans them every token, the JSON of schemas, grammars and
  tools before compiling them. Every float a request carries is finite: the sampling fields are checked by
  SamplingParams, numbers inside schemas and tools by their JSON size check (NaN/Infinity are not JSON).
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.structured import StructuredOutputs
from neuron_opt.server.limits import ServerLimits
from neuron_opt.server.tool_parsers import ToolSpec
from neuron_opt.server.tools import ToolRequest

# The chat template's variables that the server (or `apply_chat_template` itself) sets: `chat_template_kwargs` may
# not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "chat_template", "bos_token", "eos_token", "raise_exception",
})


class ProtocolError(ValueError):
    """A request is well-formed JSON but asks for something invalid or unsupported (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ImageURL(_Strict):
    url: str
    detail: str | None = None  # (only "auto": server/media.py)


class _ContentPart(_Strict):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    # an assistant's earlier thinking (vLLM's `reasoning`, its older name `reasoning_content`)
    reasoning: str | None = None
    reasoning_content: str | None = None
    # what clients echo back with an assistant message; only their empty values are accepted
    refusal: str | None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = None

    def num_chars(self) -> int:
        """Characters of its text fields (what the chat template renders)."""
        if isinstance(self.content, list):
            n = sum(len(p.text or "") for p in self.content)
        else:
            n = len(self.content or "")
        n += sum(len(c.id) + len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return n + sum(len(x or "") for x in (self.name, self.tool_call_id, self.refusal, self.reasoning,
                                               self.reasoning_content))

    def content_value(self, i: int) -> str | list[dict[str, Any]]:
        """The content for the chat template: its text, or, when it holds images (user messages only), its text
        and `image_url` parts in order (server/media.py loads them)."""
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(self.content):
            where = f"messages[{i}].content[{j}]"
            if part.type == "text" and part.text is not None and part.image_url is None:
                parts.append({"type": "text", "text": part.text})
            elif part.type == "image_url" and part.image_url is not None and part.text is None:
                if self.role != "user":
                    raise ProtocolError(f"{where}: images belong to user messages", where)
                parts.append({"type": "image_url", "image_url": part.image_url.model_dump(exclude_none=True)})
            else:
                raise ProtocolError(f"{where}: a content part is {{\"type\": \"text\", \"text\": ...}} or "
                                    f"{{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}", where)
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts

    def as_dict(self, i: int) -> dict[str, Any]:
        if self.tool_calls and self.role != "assistant":
            raise ProtocolError(f"messages[{i}]: only assistant messages carry tool_calls", "messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ProtocolError(f"messages[{i}]: a tool message needs tool_call_id", "messages")
        if self.refusal or self.annotations:
            raise ProtocolError(f"messages[{i}]: refusal and annotations are not supported", "messages")
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None and self.role != "assistant":
            raise ProtocolError(f"messages[{i}]: only assistant messages carry reasoning", "messages")
        d: dict[str, Any] = {"role": self.role, "content": self.content_value(i)}
        if self.name is not None:  # passed on to the chat template, which may use it
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if reasoning is not None:  # under both names: templates read one or the other (Qwen3's reasoning_content)
            d["reasoning"] = d["reasoning_content"] = reasoning
        return d


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # our calls are always grammar-enforced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs` (exactly one field)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class _Sampling(_Strict):
    """Fields shared by completions and chat."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None  # informational only
    response_format: ResponseFormat | None = None
    # vLLM extras (openai client: extra_body)
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _structured_field: str = PrivateAttr(default="structured_outputs")

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    def check_limits(self, limits: ServerLimits, max_model_len: int) -> None:
        """The request's sizes against this server's bounds. The server calls it first, before tokenizing,
        rendering a template, compiling a grammar or queueing anything, so a request past them costs its parse."""
        if not 1 <= self.num_samples <= limits.max_n:
            raise ProtocolError(f"n: must be in [1, {limits.max_n}] (this server's limit), got {self.n}", "n")
        if self.logit_bias and len(self.logit_bias) > limits.max_logit_bias:
            raise ProtocolError(f"logit_bias: at most {limits.max_logit_bias} entries, got {len(self.logit_bias)}",
                                "logit_bias")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        _check_size("stop", len(stop), limits.max_stop_strings, "stop strings")
        _check_size("stop", max(map(len, stop), default=0), limits.max_stop_chars, "characters in a stop string")
        _check_size("stop_token_ids", len(self.stop_token_ids or ()), limits.max_stop_token_ids, "token ids")
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):
            _check_json(name, getattr(self, name), limits.max_schema_bytes)

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("Stream options can only be defined when `stream=True`.", "stream_options")

    def structured(self) -> StructuredOutputs | None:
        """The request's structured output, from whichever of its four spellings it used (one at most)."""
        given: list[tuple[str, StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
            raise ProtocolError("response_format: json_schema goes with type 'json_schema'", "response_format")
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ProtocolError("response_format: json_schema.schema is required", "response_format")
            given.append(("response_format", StructuredOutputs(json=rf.json_schema.schema_)))
        elif rf is not None and rf.type == "json_object":
            given.append(("response_format", StructuredOutputs(json_object=True)))
        so = self.structured_outputs
        if so is not None:
            with _as_param("structured_outputs"):
                given.append(("structured_outputs", StructuredOutputs(
                    json=so.json_, regex=so.regex, choice=None if so.choice is None else tuple(so.choice),
                    grammar=so.grammar, json_object=bool(so.json_object), structural_tag=so.structural_tag)))
        guided = {"guided_json": dict(json=self.guided_json), "guided_regex": dict(regex=self.guided_regex),
                  "guided_choice": dict(choice=None if self.guided_choice is None else tuple(self.guided_choice)),
                  "guided_grammar": dict(grammar=self.guided_grammar)}
        for name, kw in guided.items():
            if next(iter(kw.values())) is not None:
                with _as_param(name):
                    given.append((name, StructuredOutputs(**kw)))
        if len(given) > 1:
            raise ProtocolError(f"{given[1][0]}: only one of {', '.join(n for n, _ in given)} may be given",
                                given[1][0])
        if not given:
            return None
        self._structured_field = given[0][0]
        return given[0][1]

    def _logit_bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        out = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
                raise ProtocolError(f"logit_bias: {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
            if not math.isfinite(bias):
                raise ProtocolError(f"logit_bias: the bias of token {key} must be finite", "logit_bias")
            out.append((int(key), float(bias)))
        return tuple(sorted(out))

    def _params(self, max_tokens: int, logprobs: int | None, vocab_size: int,
                structured: StructuredOutputs | None, prompt_logprobs: int | None = None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(s == "" for s in stop):
            raise ProtocolError("stop strings must not be empty", "stop")
        seed = None if self.seed is None else self.seed % 2**63  # torch generators take non-negative seeds
        # SamplingParams validates ranges and raises ConfigError naming the field (-> 400)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=0 if self.top_k in (None, -1) else self.top_k,  # -1 = disabled, as in vLLM
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=logprobs,
            min_tokens=self.min_tokens or 0,
            logit_bias=self._logit_bias(vocab_size),
            structured=structured,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def request_field(self, param: str) -> str:
        """The field of this request that SamplingParams' field `param` came from."""
        return self._structured_field if param == "structured_outputs" else param

    @property
    def include_usage(self) -> bool:
        """A last chunk (no choices) with the usage."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: every chunk carries the usage so far. vLLM heeds it only together
        with include_usage; we honour it on its own too, rather than silently ignore it."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: each choice's `prompt_logprobs`, this many top ones per token

    def prompt_input(self) -> str | list[int]:
        """The single prompt as text or token ids (a list holding one prompt is unwrapped)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ProtocolError(
                    f"a list of {len(p)} prompts is not supported; send one request per prompt", "prompt"
                )
            p = p[0]
        if not p:
            raise ProtocolError("prompt must not be empty", "prompt")
        return cast("str | list[int]", p)

    def check_limits(self, limits: ServerLimits, max_model_len: int) -> None:
        super().check_limits(limits, max_model_len)
        p, bound = self.prompt, limits.prompt_chars(max_model_len)
        if isinstance(p, str):
            _check_size("prompt", len(p), bound, "characters")
        elif p and isinstance(p[0], (str, list)):  # (a list of prompts: one is served, the rest refused later)
            _check_size("prompt", sum(map(len, cast("list[str] | list[list[int]]", p))), bound,
                        "characters" if isinstance(p[0], str) else "token ids")
        else:
            _check_size("prompt", len(p), bound, "token ids")

    @property
    def scores_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt back (with its logprobs), nothing generated. The engine then
        generates one token, which the response leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    def sampling_params(self, prompt_len: int, max_model_len: int, vocab_size: int) -> SamplingParams:
        self._check_common()
        if self.stream and self.prompt_logprobs is not None:  # as vLLM: echo with logprobs streams its prompt's
            raise ProtocolError("prompt_logprobs are not available with stream (echo with logprobs streams the "
                                "prompt's logprobs)", "prompt_logprobs")
        if self.suffix:
            raise ProtocolError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise ProtocolError("best_of > 1 is not supported; use n", "best_of")
        max_tokens = max(1, max_model_len - prompt_len) if self.max_tokens is None else self.max_tokens
        # the prompt's logprobs: those vLLM's prompt_logprobs asks for, and echo's with logprobs (as many top ones)
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return self._params(1 if self.scores_only else max_tokens, self.logprobs, vocab_size, self.structured(),
                            max(wanted) if wanted else None)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras: variables for the chat template (enable_thinking, ...), and the reasoning in the reply or not
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    # vLLM's: the thinking's end marker is forced after this many of its tokens (server/reasoning.py)
    thinking_token_budget: int | None = None

    def check_limits(self, limits: ServerLimits, max_model_len: int) -> None:
        super().check_limits(limits, max_model_len)
        _check_json("chat_template_kwargs", self.chat_template_kwargs, limits.max_schema_bytes)
        _check_size("messages", len(self.messages), limits.max_messages, "messages")
        _check_size("messages", sum(m.num_chars() for m in self.messages), limits.prompt_chars(max_model_len),
                    "characters in all")
        _check_size("tools", len(self.tools or ()), limits.max_tools, "tools")
        _check_json("tools", self.tools, limits.max_schema_bytes)

    def template_kwargs(self) -> dict[str, Any] | None:
        """`chat_template_kwargs`, checked: none of the names the server itself gives the template."""
        kw = self.chat_template_kwargs
        taken = sorted(set(kw or ()) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ProtocolError(f"chat_template_kwargs: {', '.join(taken)} may not be set (the server sets them; "
                                "send messages and tools as the request's own fields)", "chat_template_kwargs")
        return kw or None

    def message_dicts(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise ProtocolError("messages must not be empty", "messages")
        return [m.as_dict(i) for i, m in enumerate(self.messages)]

    def tool_request(self) -> ToolRequest | None:
        """The request's tools and choice, checked: names unique, parameters schemas enforceable, a named choice
        among the tools."""
        tools = self.tools or []
        choice = self.tool_choice
        if not tools:
            if isinstance(choice, NamedToolChoice) or choice == "required":
                raise ProtocolError("tool_choice: a tool must be called, but no tools were given", "tool_choice")
            return None
        specs, descriptions = [], {}
        for i, t in enumerate(tools):
            name = t.function.name
            if name in descriptions:
                raise ProtocolError(f"tools[{i}]: the name {name!r} is used twice", "tools")
            try:
                specs.append(ToolSpec.of(name, t.function.parameters))
            except ValueError as e:
                raise ProtocolError(f"tools[{i}] ({name}): parameters: {e}", "tools") from None
            descriptions[name] = t.function.description
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in descriptions:
                raise ProtocolError(f"tool_choice: {choice.function.name!r} is not one of the tools "
                                    f"({', '.join(descriptions)})", "tool_choice")
            mode = choice.function.name
        else:
            mode = choice or "auto"
        return ToolRequest(tuple(specs), mode, self.parallel_tool_calls is not False, descriptions)

    def request_field(self, param: str) -> str:
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if param == "structured_outputs":
            return self._structured_field
        return "top_logprobs" if param == "logprobs" else param

    def sampling_params(self, prompt_len: int, max_model_len: int, vocab_size: int,
                        tools: StructuredOutputs | None = None) -> SamplingParams:
        """`tools`: the tool-call grammar, when the request's tools are enforced (it may not be combined with a
        structured output of the request's own)."""
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs=true", "top_logprobs")
        structured = self.structured()
        if tools is not None and structured is None:
            self._structured_field = "tools"  # a grammar error then concerns the tools
        if structured is not None and tools is not None:
            raise ProtocolError(f"{self._structured_field} cannot be combined with tools (tool_choice "
                                f"{self.tool_choice!r}); send tool_choice 'none' or drop one",
                                self._structured_field)
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = max(1, max_model_len - prompt_len) if mt is None else mt
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs, vocab_size, tools or structured)


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Tool] | None = None

    def check_limits(self, limits: ServerLimits, max_model_len: int) -> None:
        if self.prompt is not None:
            _check_size("prompt", len(self.prompt), limits.prompt_chars(max_model_len), "characters")
        if self.messages is not None:
            ChatCompletionRequest(messages=self.messages, tools=self.tools).check_limits(limits, max_model_len)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]

    def check_limits(self, limits: ServerLimits, max_model_len: int) -> None:
        _check_size("tokens", len(self.tokens), limits.prompt_chars(max_model_len), "token ids")


def _check_size(name: str, size: int, bound: int, what: str) -> None:
    if size > bound:
        raise ProtocolError(f"{name}: at most {bound} {what} (this server's limit), got {size}", name)


def _check_json(name: str, value: Any, bound: int) -> None:
    """`value`, a field holding a schema, grammar or tools, is at most `bound` bytes as JSON and holds only finite
    numbers (NaN and Infinity, which pydantic's parser accepts, are not JSON)."""
    if value is None:
        return

    def plain(v: Any) -> Any:
        return v.model_dump(by_alias=True, exclude_none=True) if isinstance(v, BaseModel) else v

    try:
        data = [plain(v) for v in value] if isinstance(value, list) else plain(value)
        size = len(json.dumps(data, allow_nan=False, ensure_ascii=False).encode())
    except ValueError:
        raise ProtocolError(f"{name}: numbers must be finite (NaN and Infinity are not JSON)", name) from None
    _check_size(name, size, bound, "bytes as JSON")


class _as_param:
    """Errors raised inside (ConfigError from StructuredOutputs) name `param` instead of theirs."""

    def __init__(self, param: str) -> None:
        self.param = param

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, e: BaseException | None, tb: Any) -> bool:
        if isinstance(e, ValueError):
            raise ProtocolError(str(e), self.param) from None
        return False
