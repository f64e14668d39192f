"""Request -> engine -> response: tokenization, validation, streaming (SSE), usage, logprobs, metrics.

Each request gets an asyncio.Queue; the engine thread feeds it with `loop.call_soon_threadsafe`. When the
client goes away the response task is cancelled (streaming) or a watcher notices (non-streaming), and the
request is aborted so that its KV blocks are freed for the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from neuron_opt.errors import NeuronOptError
from neuron_opt.runtime.engine import Engine, RequestOutput, TokenLogprob
from neuron_opt.server.metrics import ServerMetrics
from neuron_opt.server.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError


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
    prompt_tokens: int = 0


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        encode_chat: Callable[[list[dict[str, str]]], list[int]],
        model_name: str,
        metrics: ServerMetrics,
        max_model_len: int,
    ) -> None:
        self.engine, self.tokenizer, self.encode_chat = engine, tokenizer, encode_chat
        self.model_name, self.metrics, self.max_model_len = model_name, metrics, max_model_len

    # ---- shared --------------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise NotFoundError(f"The model `{name}` does not exist.")

    def _usage(self, r: _Result) -> dict[str, int]:
        return {
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": len(r.token_ids),
            "total_tokens": r.prompt_tokens + len(r.token_ids),
        }

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _submit(
        self, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], arrival: float
    ) -> tuple[str, asyncio.Queue]:
        """Validate and queue a request on the engine. Raises ContextLengthError / ConfigError (their `param`
        naming the request's field) / QueueFullError."""
        with _request_fields(req):
            params = req.sampling_params(len(prompt_ids), self.max_model_len)
            return self._enqueue(prompt_ids, params, arrival)

    def _enqueue(self, prompt_ids: list[int], params: Any, arrival: float) -> tuple[str, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = uuid.uuid4().hex
        self.engine.add_request(
            rid,
            prompt_ids,
            params,
            lambda o: loop.call_soon_threadsafe(q.put_nowait, o),
            arrival_time=arrival,
        )
        return rid, q

    async def _outputs(
        self, rid: str, q: asyncio.Queue, arrival: float, is_disconnected: Callable[[], Any] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the engine's outputs for `rid`; aborts the request if the consumer stops early."""
        finished, last, checked = False, arrival, time.monotonic()
        try:
            while True:
                if is_disconnected is None:
                    out = await q.get()
                else:  # non-streaming: nobody cancels us when the client leaves, so look every second
                    try:
                        out = await asyncio.wait_for(q.get(), timeout=1.0)
                    except asyncio.TimeoutError:
                        out = None
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
                        self.metrics.ttft.observe(now - last)
                        n -= 1
                    for _ in range(n):  # the step's time spread evenly over the tokens it produced
                        self.metrics.itl.observe((now - last) / len(out.new_token_ids))
                    last = now
                if out.finished:
                    finished = True
                    if out.finish_reason == "error":
                        raise EngineError(out.error or "engine error")
                    self.metrics.request_finished(
                        out.finish_reason or "stop",
                        out.num_prompt_tokens,
                        out.num_output_tokens,
                        now - arrival,
                    )
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.engine.abort(rid)

    async def _collect(
        self, rid: str, q: asyncio.Queue, n_prompt: int, arrival: float, is_disconnected: Callable[[], Any]
    ) -> _Result:
        r = _Result(prompt_tokens=n_prompt)
        async for out in self._outputs(rid, q, arrival, is_disconnected):
            r.text += out.text_delta
            r.token_ids += out.new_token_ids
            r.logprobs += out.logprobs
            r.finish_reason = out.finish_reason
        return r

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
        self.check_model(req.model)
        prompt = req.prompt_input()
        ids = list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= t < len(self.tokenizer) for t in ids):
            raise ProtocolError("prompt token ids must be in [0, vocab size)", "prompt")
        rid, q = self._submit(req, ids, arrival)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if req.stream:
            def choice(out: RequestOutput, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
                lp = self._completion_logprobs(lps, offset) if req.logprobs is not None else None
                return {"index": 0, "text": out.text_delta, "logprobs": lp, "finish_reason": out.finish_reason}

            return self._stream(self._outputs(rid, q, arrival), head, len(ids), req, choice)
        r = await self._collect(rid, q, len(ids), arrival, is_disconnected)
        lp = self._completion_logprobs(r.logprobs, 0) if req.logprobs is not None else None
        return {
            **head,
            "choices": [
                {
                    "index": 0,
                    "text": r.text,
                    "logprobs": lp,
                    "finish_reason": r.finish_reason,
                    "stop_reason": None,
                }
            ],
            "usage": self._usage(r),
        }

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

    async def chat(
        self, req: ChatCompletionRequest, arrival: float, is_disconnected: Callable[[], Any]
    ) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(req.model)
        messages = req.message_dicts()
        try:
            ids = self.encode_chat(messages)
        except Exception as e:  # jinja TemplateError and friends: the messages do not fit the template
            raise ProtocolError(f"cannot apply the chat template: {e}", "messages") from None
        rid, q = self._submit(req, ids, arrival)
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if req.stream:
            def choice(out: RequestOutput, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
                return {
                    "index": 0,
                    "delta": {"content": out.text_delta} if out.text_delta else {},
                    "logprobs": self._chat_logprobs(lps) if req.logprobs else None,
                    "finish_reason": out.finish_reason,
                }

            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            return self._stream(self._outputs(rid, q, arrival), {**head, "object": "chat.completion.chunk"},
                                len(ids), req, choice, first)
        r = await self._collect(rid, q, len(ids), arrival, is_disconnected)
        lp = self._chat_logprobs(r.logprobs) if req.logprobs else None
        return {
            **head,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": r.text},
                    "logprobs": lp,
                    "finish_reason": r.finish_reason,
                    "stop_reason": None,
                }
            ],
            "usage": self._usage(r),
        }

    async def _stream(
        self,
        outputs: AsyncIterator[RequestOutput],
        head: dict[str, Any],
        n_prompt: int,
        req: CompletionRequest | ChatCompletionRequest,
        choice: Callable[[RequestOutput, list[TokenLogprob], int], dict[str, Any]],
        first: dict[str, Any] | None = None,
    ) -> AsyncIterator[str]:
        """The SSE stream of completions and chat: `first` (chat's role chunk), one chunk per text delta built
        by `choice(output, logprobs since the last chunk, text offset)`, a usage chunk if asked, then [DONE].
        With continuous usage every chunk also carries the usage so far."""
        r = _Result(prompt_tokens=n_prompt)

        def chunk(c: dict[str, Any]) -> str:
            return sse({**head, "choices": [c], "usage": self._usage(r)} if req.continuous_usage
                       else {**head, "choices": [c]})

        try:
            if first is not None:
                yield chunk(first)
            async for out in outputs:
                r.token_ids += out.new_token_ids
                r.logprobs += out.logprobs  # tokens whose text is held back ride along with the next chunk
                if out.text_delta or out.finished:
                    c = choice(out, r.logprobs, len(r.text))
                    r.logprobs = []
                    r.text += out.text_delta
                    yield chunk(c)
        except EngineError as e:
            yield sse(
                {"error": {"message": str(e), "type": "InternalServerError", "param": None, "code": 500}}
            )
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": self._usage(r)})
        yield "data: [DONE]\n\n"


@contextlib.contextmanager
def _request_fields(req: CompletionRequest | ChatCompletionRequest) -> Iterator[None]:
    """Errors raised with a SamplingParams field as their `param` name the request's field instead."""
    try:
        yield
    except NeuronOptError as e:
        if e.param is not None:
            e.param = req.request_field(e.param)
        raise
