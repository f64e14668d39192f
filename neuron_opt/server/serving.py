"""Request -> engine -> response: tokenization, validation, structured outputs, tool calls, `n` samples, streaming
(SSE), usage, logprobs, metrics.

A request's `n` samples are `n` engine requests sharing one asyncio.Queue of (choice index, output); the engine
thread feeds it with `loop.call_soon_threadsafe`. The samples after the first wait for the first one's prompt and
then take its KV blocks from the prefix cache. When the client goes away the response task is cancelled (streaming)
or a watcher notices (non-streaming), and the unfinished samples are aborted so that their KV blocks are freed.

Work that can take long runs in worker threads, never on the event loop: tokenizing prompts, rendering chat
templates in the default executor, grammars in a bounded pool of their own with a timeout (server/grammar_pool.py;
the engine thread never compiles one either: it gets them compiled). Before any of it, the request's sizes are
checked against the server's limits (`check_limits`: prompt characters, stop strings, schemas), and before a
grammar compiles, the engine's admission (queue full: 503), so what that work costs is bounded before it starts.

A 500 (a bug or a failing backend) tells the client only an error id; the details go to the server log under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from neuron_opt.errors import NeuronOptError
from neuron_opt.runtime.engine import Engine
from neuron_opt.runtime.output import RequestOutput, TokenLogprob
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.server import media
from neuron_opt.server.grammar_pool import GrammarPool
from neuron_opt.server.limits import ServerLimits
from neuron_opt.server.metrics import ServerMetrics
from neuron_opt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ProtocolError,
    TokenizeRequest,
)
from neuron_opt.server.reasoning import ReasoningParser, ReasoningStream, Start, after_reasoning
from neuron_opt.server.scoring import echo_logprobs, vllm_prompt_logprobs
from neuron_opt.server.tool_parsers import ToolParser
from neuron_opt.server.tools import ToolRequest, ToolStream, make_parser, message, render_messages

log = logging.getLogger(__name__)


class NotFoundError(LookupError):
    """The request names a model this server does not serve (HTTP 404)."""


class EngineError(RuntimeError):
    """The engine failed while running a request (HTTP 500; not caused by the input)."""


@dataclass
class _Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # with SamplingParams.prompt_logprobs


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def internal_error_message(e: BaseException) -> str:
    """The message of a 500: generic, with an id under which `e` and its traceback are logged here."""
    error_id = uuid.uuid4().hex
    log.error("internal error, request id %s: %r", error_id, e, exc_info=e)
    return f"Internal server error (request id {error_id}); the details are in the server's log."


EncodeChat = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None", "dict[str, Any] | None"], list[int]]
PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens whose text tells where a reply starts (server/reasoning.py)


class OpenAIServing:
    """The OpenAI routes over one engine.

    Args:
        encode_chat: `(messages, tools, template kwargs) -> prompt ids` through the model's chat template.
        tool_parser: the tool-call format (default: the one the chat template writes; server/tools.py).
        reasoning_parser: the reasoning format (None: replies are not split; server/reasoning.py).
        limits: per-request bounds.
        encode_image_chat: the model's renderer of conversations with images (server/media.py's EncodeImageChat);
            None: a text-only model, whose requests with images are a 400.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        encode_chat: EncodeChat,
        model_name: str,
        metrics: ServerMetrics,
        max_model_len: int,
        *,
        tool_parser: ToolParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
        limits: ServerLimits | None = None,
        encode_image_chat: media.EncodeImageChat | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.encode_chat = engine, tokenizer, encode_chat
        self.encode_image_chat = encode_image_chat
        self.modalities: tuple[str, ...] = ("text", "image") if encode_image_chat is not None else ("text",)
        self.model_name, self.metrics, self.max_model_len = model_name, metrics, max_model_len
        self.tool_parser = tool_parser or make_parser(None, tokenizer)
        self.reasoning_parser = reasoning_parser
        self.limits = limits or ServerLimits()
        self.vocab_size = engine.runner.vocab_size
        self.grammars = GrammarPool(lambda params: engine.compile_grammar(params), self.limits)

    # ---- shared --------------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter `name` picks (None: the base model); NotFoundError for a name that is neither."""
        if name is None or name == self.model_name:
            return None
        loras = getattr(self.engine, "loras", None)
        if loras is not None and name in loras:
            return name
        raise NotFoundError(f"The model `{name}` does not exist.")

    def check_generates(self) -> None:
        """A text route on an embedding model is a 400 naming `model` (server/embeddings.py serves it)."""
        if self.engine.embeds:
            raise ProtocolError("this model is an embedding model (compiled with --task embed): it serves "
                                "/v1/embeddings, not text generation", "model")

    @staticmethod
    def _usage(n_prompt: int, results: list[_Result], reasoning_tokens: int | None = None) -> dict[str, Any]:
        completion = sum(len(r.token_ids) for r in results)
        usage: dict[str, Any] = {"prompt_tokens": n_prompt, "completion_tokens": completion,
                                 "total_tokens": n_prompt + completion}
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @staticmethod
    def _check_ids(ids: list[int], field_name: str, vocab_size: int) -> None:
        """Token ids of a request against a vocabulary: the model's (its embedding rows, config vocab_size) for ids
        it runs, the tokenizer's for ids it decodes."""
        if any(not 0 <= t < vocab_size for t in ids):
            raise ProtocolError(f"{field_name} token ids must be in [0, vocab size)", field_name)

    async def _tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = await asyncio.to_thread(self.tokenizer, text, add_special_tokens=add_special_tokens)
        return list(out["input_ids"])

    async def _encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                           template_kwargs: dict[str, Any] | None = None) -> list[int]:
        try:
            return await asyncio.to_thread(self.encode_chat, messages, tools, template_kwargs)
        except Exception as e:  # jinja TemplateError and friends: the messages do not fit the template
            raise ProtocolError(f"cannot apply the chat template: {e}", "messages") from None

    async def _submit(self, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                      params: SamplingParams, arrival: float, lora: str | None = None,
                      engine_inputs: dict[str, Any] | None = None) -> tuple[list[str], asyncio.Queue]:
        """Compile the request's grammar (worker thread) and queue its `n` samples on the engine (`engine_inputs`:
        the images' inputs, server/media.py's ImagePrompt). Raises
        ContextLengthError / ConfigError (their `param` naming the request's field) / QueueFullError; nothing stays
        queued when any sample is refused."""
        with _request_fields(req):
            self.engine.check_admission(req.num_samples)  # a request the engine refuses costs no compile
            grammar = None
            if params.structured is not None:
                params = dataclasses.replace(params, structured=dataclasses.replace(
                    params.structured, max_repeat=self.limits.max_grammar_repeat))
                grammar = await self.grammars.compile(params)
            loop = asyncio.get_running_loop()
            q: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
            rids: list[str] = []
            try:
                for i in range(req.num_samples):
                    p = params if params.seed is None or i == 0 else dataclasses.replace(
                        params, seed=(params.seed + i) % 2**63)
                    rid = uuid.uuid4().hex
                    self.engine.add_request(
                        rid, prompt_ids, p, lambda o, i=i: loop.call_soon_threadsafe(q.put_nowait, (i, o)),
                        arrival_time=arrival, grammar=grammar, share_prefix_with=rids[0] if rids else None,
                        **({"lora": lora} if lora is not None else {}), **(engine_inputs or {}))
                    self.metrics.lora_request(lora)
                    rids.append(rid)
            except BaseException:
                for rid in rids:
                    self.engine.abort(rid)
                raise
            self.metrics.request_params(req.num_samples, params.max_tokens)
            return rids, q

    async def _outputs(
        self, rids: list[str], q: asyncio.Queue, arrival: float, is_disconnected: Callable[[], Any] | None = None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (choice index, output) until every sample finished; aborts the unfinished ones if the consumer
        stops early."""
        unfinished, checked = set(range(len(rids))), time.monotonic()
        last = [arrival] * len(rids)
        first: list[float | None] = [None] * len(rids)  # the engine's stamp of each sample's first token
        most = 0  # the most tokens one sample generated
        try:
            while unfinished:
                if is_disconnected is None:
                    i, out = await q.get()
                else:  # non-streaming: nobody cancels us when the client leaves, so look every second
                    try:
                        i, out = await asyncio.wait_for(q.get(), timeout=1.0)
                    except asyncio.TimeoutError:
                        i, out = -1, None
                    if time.monotonic() - checked >= 1.0:
                        if await is_disconnected():
                            return
                        checked = time.monotonic()
                    if out is None:
                        continue
                now = time.monotonic()
                if out.new_token_ids:
                    n = len(out.new_token_ids)  # several when speculative decoding accepted proposals
                    if out.num_output_tokens == n:  # the first output: its first token is the TTFT
                        self.metrics.ttft.observe(now - last[i])
                        first[i] = out.time
                        n -= 1
                    for _ in range(n):  # the step's time spread evenly over the tokens it produced
                        self.metrics.itl.observe((now - last[i]) / len(out.new_token_ids))
                    last[i] = now
                if out.finished:
                    unfinished.discard(i)
                    if out.finish_reason == "error":
                        raise EngineError(out.error or "engine error")
                    self.metrics.request_finished(out.finish_reason or "stop", out.num_prompt_tokens,
                                                  out.num_output_tokens, now - arrival)
                    most = max(most, out.num_output_tokens)
                    if not unfinished:
                        self.metrics.max_generation.observe(most)
                    started = first[i]
                    if out.scheduled_time and started is not None:
                        self.metrics.request_phases(arrival, out.scheduled_time, started, out.time,
                                                    out.num_output_tokens)
                yield i, out
        finally:
            for i in unfinished:
                self.engine.abort(rids[i])

    async def _collect(self, rids: list[str], q: asyncio.Queue, arrival: float, is_disconnected: Callable[[], Any],
                       feed: Callable[[int, str, RequestOutput], Any] | None = None) -> list[_Result]:
        """Every sample's whole result; `feed(i, text so far, output)` sees each output as it comes."""
        results = [_Result() for _ in rids]
        async for i, out in self._outputs(rids, q, arrival, is_disconnected):
            r = results[i]
            r.text += out.text_delta
            if feed is not None:
                feed(i, r.text, out)
            r.token_ids += out.new_token_ids
            r.logprobs += out.logprobs
            r.finish_reason = out.finish_reason
            r.prompt_logprobs = out.prompt_logprobs or r.prompt_logprobs
        return results

    # ---- /v1/completions -----------------------------------------------------------------------------

    def _completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, list[Any]]:
        tokens = [self._token_str(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token_str(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    async def completions(
        self, req: CompletionRequest, arrival: float, is_disconnected: Callable[[], Any]
    ) -> dict[str, Any] | AsyncIterator[str]:
        lora = self.check_model(req.model)
        self.check_generates()
        req.check_limits(self.limits, self.max_model_len)
        self._check_ids(req.stop_token_ids or [], "stop_token_ids", self.vocab_size)
        prompt = req.prompt_input()
        ids = await self._tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_ids(ids, "prompt", self.vocab_size)
        with _request_fields(req):
            params = req.sampling_params(len(ids), self.max_model_len, self.vocab_size)
        rids, q = await self._submit(req, ids, params, arrival, lora)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": lora or self.model_name,
        }
        echoed = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if req.echo else ""
        if req.stream:
            return self._stream_completion(req, rids, q, arrival, head, ids, echoed)
        results = await self._collect(rids, q, arrival, is_disconnected)
        if req.scores_only:  # echo with max_tokens 0: the one token generated is left out
            results = [_Result(prompt_logprobs=r.prompt_logprobs, finish_reason="length") for r in results]
        choices = []
        for i, r in enumerate(results):
            lp: dict[str, Any] | None = None
            if req.logprobs is not None:
                lp = (echo_logprobs(ids, r.prompt_logprobs, r.logprobs, self._token_str) if req.echo
                      else self._completion_logprobs(r.logprobs, 0))
            choice = {"index": i, "text": echoed + r.text, "logprobs": lp, "finish_reason": r.finish_reason,
                      "stop_reason": None}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(r.prompt_logprobs, req.prompt_logprobs,
                                                                 self._token_str)
            choices.append(choice)
        return {**head, "choices": choices, "usage": self._usage(len(ids), results)}

    def _stream_completion(self, req: CompletionRequest, rids: list[str], q: asyncio.Queue, arrival: float,
                           head: dict[str, Any], ids: list[int], echoed: str) -> AsyncIterator[str]:
        """A streamed completion. With `echo` (as vLLM streams it) each choice's first chunk carries the prompt's
        text before its first generated text, and with `logprobs` the prompt tokens' logprobs (`null` first) before
        the generated ones'; the later chunks' `text_offset`s continue after the prompt, so the chunks joined are
        the unstreamed response. `max_tokens: 0`: the prompt alone, the one token generated left out."""
        prompt_lps: dict[int, tuple[TokenLogprob | None, ...]] = {}
        base = sum(len(self._token_str(t)) for t in ids) if req.echo and req.logprobs is not None else 0

        async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
            async for i, out in self._outputs(rids, q, arrival):
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = out.prompt_logprobs
                if req.scores_only and out.finished:
                    out = dataclasses.replace(out, new_token_ids=(), text_delta="", logprobs=(),
                                              num_output_tokens=0, finish_reason="length")
                yield i, out

        def choice(i: int, out: RequestOutput, lps: list[TokenLogprob], offset: int) -> list[dict[str, Any]]:
            text, lp = out.text_delta, None
            if req.echo and i not in echoed_choices:
                echoed_choices.add(i)
                text = echoed + text
                if req.logprobs is not None:
                    lp = echo_logprobs(ids, prompt_lps[i], lps, self._token_str)
            elif req.logprobs is not None:
                lp = self._completion_logprobs(lps, base + offset)
            return [{"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}]

        echoed_choices: set[int] = set()
        return self._stream(outputs(), head, len(ids), req, choice)

    # ---- /v1/chat/completions ------------------------------------------------------------------------

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(t: int, v: float) -> dict[str, Any]:
            s = self._token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in lps
            ]
        }

    async def _chat_prompt(self, req: ChatCompletionRequest
                           ) -> tuple[list[int], ToolRequest | None, dict[str, Any]]:
        """(prompt ids, the request's tools, the images' inputs for `Engine.add_request`: empty without images).
        Images are refused for a text-only model before any is loaded, then loaded and checked (server/media.py),
        and the conversation rendered by the model's image renderer (`encode_image_chat`)."""
        messages = req.message_dicts()
        tools = req.tool_request()
        media.refuse_images(messages, self.modalities, self.model_name)
        render = self.encode_image_chat
        images: list[Any] = []
        if render is not None:
            messages, images = await media.load_chat_images(messages, self.limits.media)
        with _request_fields(req):
            rendered, template_tools = render_messages(messages, self.tool_parser, tools)
        if render is None or not images:
            return await self._encode_chat(rendered, template_tools, req.template_kwargs()), tools, {}
        prompt = await asyncio.to_thread(render, rendered, template_tools, req.template_kwargs())
        return prompt.prompt_ids, tools, prompt.engine_inputs

    def chat_params(self, req: ChatCompletionRequest, ids: list[int],
                    tools: ToolRequest | None) -> tuple[SamplingParams, Start]:
        """The sampling params of a chat request whose prompt is `ids` (its tool calls or structured output
        enforced from where the thinking ends), and where its reply starts relative to the reasoning."""
        active = tools is not None and tools.active
        parser, thinker = self.tool_parser, self.reasoning_parser
        start = Start.NONE if thinker is None else thinker.start(
            self.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
        with _request_fields(req):
            params = req.sampling_params(len(ids), self.max_model_len, self.vocab_size,
                                         tools.structured(parser) if active and tools is not None else None)
            if thinker is not None and params.structured is not None:  # the grammar starts where thinking ends
                params = dataclasses.replace(params, structured=after_reasoning(params.structured, thinker, start))
            if req.thinking_token_budget is not None:
                if thinker is None:
                    raise ProtocolError("thinking_token_budget: needs a reasoning model (serve --reasoning-parser)",
                                        "thinking_token_budget")
                params = dataclasses.replace(params, thinking_budget=thinker.budget(req.thinking_token_budget,
                                                                                    start, self.tokenizer))
        if (active and not parser.skip_special_tokens) or (thinker is not None and not thinker.skip_special_tokens):
            params = dataclasses.replace(params, skip_special_tokens=False)  # its markers are special tokens
        return params, start

    async def chat(
        self, req: ChatCompletionRequest, arrival: float, is_disconnected: Callable[[], Any]
    ) -> dict[str, Any] | AsyncIterator[str]:
        lora = self.check_model(req.model)
        self.check_generates()
        req.check_limits(self.limits, self.max_model_len)
        self._check_ids(req.stop_token_ids or [], "stop_token_ids", self.vocab_size)
        ids, tools, engine_inputs = await self._chat_prompt(req)
        self._check_ids(ids, "messages", self.vocab_size)  # a tokenizer may know more ids than the model has rows
        active = tools is not None and tools.active
        parser, thinker = self.tool_parser, self.reasoning_parser
        params, start = self.chat_params(req, ids, tools)
        rids, q = await self._submit(req, ids, params, arrival, lora, engine_inputs)
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": lora or self.model_name,
        }
        thinking = [ReasoningStream(thinker, start) for _ in rids] if thinker is not None else []

        def finish(reason: str | None, called: bool) -> str | None:
            return "tool_calls" if called and reason == "stop" else reason

        def reasoning_tokens() -> int | None:
            return sum(t.tokens for t in thinking) if thinking else None

        if req.stream:
            streams = [ToolStream(parser) for _ in rids] if active else []
            texts, sent = [""] * len(rids), [""] * len(rids)

            def choice(i: int, out: RequestOutput, lps: list[TokenLogprob], offset: int) -> list[dict[str, Any]]:
                logprobs = self._chat_logprobs(lps) if req.logprobs else None
                if not active and not thinking:
                    delta = {"content": out.text_delta} if out.text_delta else {}
                    return [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": out.finish_reason}]
                texts[i] += out.text_delta
                deltas: list[dict[str, Any]] = []
                content = texts[i]
                if thinking:
                    thought, content = thinking[i].feed(texts[i], out.finished, out.num_output_tokens)
                    if thought and req.include_reasoning:
                        deltas.append({"reasoning": thought, "reasoning_content": thought})
                if active:
                    deltas += streams[i].feed(content, out.finished)
                elif len(content) > len(sent[i]):
                    deltas.append({"content": content[len(sent[i]):]})
                    sent[i] = content
                if not deltas and not out.finished:
                    return []  # nothing to show yet (a marker or a call being written): its logprobs wait
                deltas = deltas or [{}]
                chunks = [{"index": i, "delta": d, "logprobs": logprobs if j == 0 else None, "finish_reason": None}
                          for j, d in enumerate(deltas)]
                if out.finished:
                    chunks[-1]["finish_reason"] = finish(out.finish_reason, bool(streams and streams[i].calls))
                return chunks

            def first(i: int) -> dict[str, Any]:
                return {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}

            return self._stream(self._outputs(rids, q, arrival), {**head, "object": "chat.completion.chunk"},
                                len(ids), req, choice, first, reasoning_tokens)

        def feed(i: int, text: str, out: RequestOutput) -> None:
            if thinking:
                thinking[i].feed(text, out.finished, out.num_output_tokens)

        results = await self._collect(rids, q, arrival, is_disconnected, feed)
        choices = []
        for i, r in enumerate(results):
            content, thought = r.text, None
            if thinker is not None:
                split = thinker.split(r.text, start, True)
                content, thought = split.content, split.reasoning
            msg, called = message(parser.scan(content, True)) if active else (
                {"role": "assistant", "content": content}, False)
            if thinker is not None:
                msg["content"] = msg["content"] or None  # a reply that only thought has no content
                msg["reasoning"] = msg["reasoning_content"] = thought if req.include_reasoning else None
            choices.append({"index": i, "message": msg,
                            "logprobs": self._chat_logprobs(r.logprobs) if req.logprobs else None,
                            "finish_reason": finish(r.finish_reason, called), "stop_reason": None})
        return {**head, "choices": choices, "usage": self._usage(len(ids), results, reasoning_tokens())}

    async def _stream(
        self,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        head: dict[str, Any],
        n_prompt: int,
        req: CompletionRequest | ChatCompletionRequest,
        choice: Callable[[int, RequestOutput, list[TokenLogprob], int], list[dict[str, Any]]],
        first: Callable[[int], dict[str, Any]] | None = None,
        reasoning_tokens: Callable[[], int | None] = lambda: None,
    ) -> AsyncIterator[str]:
        """The SSE stream of completions and chat: `first(i)` (chat's role chunk) per choice, then the chunks
        `choice(i, output, logprobs since choice i's last chunk, text offset)` builds for each output with text or
        an end, a usage chunk if asked, then [DONE]. With continuous usage every chunk also carries the usage so
        far; `reasoning_tokens()`: the usage's reasoning tokens so far (None: no reasoning parser)."""
        results = [_Result() for _ in range(req.num_samples)]

        def chunk(c: dict[str, Any]) -> str:
            return sse({**head, "choices": [c], "usage": self._usage(n_prompt, results, reasoning_tokens())}
                       if req.continuous_usage
                       else {**head, "choices": [c]})

        try:
            if first is not None:
                for i in range(len(results)):
                    yield chunk(first(i))
            async for i, out in outputs:
                r = results[i]
                r.token_ids += out.new_token_ids
                r.logprobs += out.logprobs  # tokens whose text is held back ride along with the next chunk
                if out.text_delta or out.finished:
                    cs = choice(i, out, r.logprobs, len(r.text))
                    if cs:
                        r.logprobs = []
                    r.text += out.text_delta
                    for c in cs:
                        yield chunk(c)
        except EngineError as e:
            yield sse({"error": {"message": internal_error_message(e), "type": "InternalServerError", "param": None,
                                 "code": 500}})
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": self._usage(n_prompt, results, reasoning_tokens())})
        yield "data: [DONE]\n\n"

    # ---- /tokenize, /detokenize ----------------------------------------------------------------------

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt (special tokens added unless add_special_tokens is false), or chat messages
        through the template (and the tools, as a chat request renders them)."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ProtocolError("give either prompt or messages", "prompt")
        req.check_limits(self.limits, self.max_model_len)
        if req.prompt is not None:
            ids = await self._tokenize(req.prompt, req.add_special_tokens is not False)
        else:
            if not req.add_generation_prompt:
                raise ProtocolError("add_generation_prompt=false is not supported", "add_generation_prompt")
            if req.add_special_tokens:
                raise ProtocolError("add_special_tokens with messages is not supported (the template adds them)",
                                    "add_special_tokens")
            chat = ChatCompletionRequest(messages=req.messages or [], tools=req.tools)
            ids, _, _ = await self._chat_prompt(chat)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        req.check_limits(self.limits, self.max_model_len)
        self._check_ids(req.tokens, "tokens", len(self.tokenizer))
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, req.tokens)}


@contextlib.contextmanager
def _request_fields(req: CompletionRequest | ChatCompletionRequest) -> Iterator[None]:
    """Errors raised with a SamplingParams field as their `param` name the request's field instead."""
    try:
        yield
    except NeuronOptError as e:
        if e.param is not None:
            e.param = req.request_field(e.param)
        raise
