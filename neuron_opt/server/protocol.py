"""OpenAI request types (pydantic) and their translation to SamplingParams.

Design decisions
- `extra="forbid"`: a field we do not know is a 400 naming it, never silently ignored. Fields the OpenAI
  client may send that we cannot honour (`logit_bias`, `tools`, `suffix`, `echo`, `n > 1`, ...) are
  declared so that their harmless values (null, empty, default) pass and anything else is a 400 saying it
  is unsupported.
- Strict types (no "0.5" -> 0.5 coercion, no true -> 1): wrong types are 400s with the field's name.
- vLLM's extra sampling fields (top_k, min_tokens, ignore_eos, stop_token_ids) and
  `stream_options.continuous_usage_stats` are honoured, so vLLM-compatible clients (guidellm, vLLM's benchmarks)
  work unchanged; with the `openai` client they go in `extra_body`.
- Errors name the request's own field (`param`): SamplingParams raises with its field names, and
  `request_field` maps them back (chat's `max_completion_tokens`, `top_logprobs`).
- Defaults follow OpenAI: temperature 1.0, completions max_tokens 16; chat max_tokens = what the context
  has left.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from neuron_opt.runtime.sampling import SamplingParams


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


class _ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[_ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ProtocolError(
                    f"message content of type {part.type!r} is not supported (text only)", "messages"
                )
        return "".join(p.text or "" for p in self.content)


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
    # vLLM extras (openai client: extra_body)
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    def _check_common(self) -> None:
        if self.n not in (None, 1):
            raise ProtocolError(f"n={self.n} is not supported (only n=1); send one request per sample", "n")
        if self.logit_bias:
            raise ProtocolError("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("Stream options can only be defined when `stream=True`.", "stream_options")

    def _params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=logprobs,
            min_tokens=self.min_tokens or 0,
        )

    def request_field(self, param: str) -> str:
        """The field of this request that SamplingParams' field `param` came from."""
        return param

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

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        self._check_common()
        if self.echo:
            raise ProtocolError("echo is not supported", "echo")
        if self.suffix:
            raise ProtocolError("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise ProtocolError("best_of > 1 is not supported", "best_of")
        max_tokens = max(1, max_model_len - prompt_len) if self.max_tokens is None else self.max_tokens
        return self._params(max_tokens, self.logprobs)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def message_dicts(self) -> list[dict[str, str]]:
        if not self.messages:
            raise ProtocolError("messages must not be empty", "messages")
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name is not None:  # passed on to the chat template, which may use it
                d["name"] = m.name
            out.append(d)
        return out

    def request_field(self, param: str) -> str:
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if param == "logprobs" else param

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        self._check_common()
        if self.tools:
            raise ProtocolError("tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise ProtocolError("tool_choice is not supported", "tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            raise ProtocolError(
                "response_format other than {'type': 'text'} is not supported", "response_format"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs=true", "top_logprobs")
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = max(1, max_model_len - prompt_len) if mt is None else mt
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs)
