"""`EngineReplica`: one engine and its OpenAI serving, a Serve deployment the router sends requests to.

Design decisions
- A replica is the single-process server's engine and `OpenAIServing` unchanged; it answers
  `handle(route, body)` with a stream whose first item is a header `(kind, status, payload, replica_id)`: kind
  "json" carries the whole answer (or the OpenAI-shaped error, from `app.error_payload`), kind "sse" is followed
  by the SSE chunks. Validation and errors are therefore exactly the single-process server's.
- Client disconnect: the router cancels the replica's stream, and the replica's `OpenAIServing` aborts the request
  in its engine (its KV blocks are freed), as in one process.
- Health: Serve calls `check_health` periodically; a dead engine thread fails it, and Serve replaces the replica.
  Sooner still: a replica whose engine loop died (a device error) answers the requests that failed with it as
  "retry" (the router sends them elsewhere: none had an answer), streams that had made no output yet included
  (their first event would be the error: the header waits for it), and ends its own process within
  ENGINE_CHECK_S, which Serve sees at once as a dead replica: a retry routed back to it by prefix finds it gone.
  A stream that had made output ends with the error event.
- LoRA adapters: each replica reconciles its engine's adapters with the board's set before each metrics push, and
  once before it takes requests, so a restarted replica serves them too (router.py, "LoRA adapters").
"""


import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import ray
import torch
from ray import serve

from neuron_opt.errors import ConfigError
from neuron_opt.lora.adapter import read_adapter
from neuron_opt.runtime.threads import hand_threads_to_engine
from neuron_opt.server.anthropic import AnthropicServing, CountTokensRequest, MessagesRequest
from neuron_opt.server.app import engine_metrics, error_payload
from neuron_opt.server.cluster.board import PUSH_PERIOD_S
from neuron_opt.server.embeddings import EmbeddingRequest, EmbeddingServing
from neuron_opt.server.limits import ServerLimits
from neuron_opt.server.lora_routes import LoadLoraAdapterRequest
from neuron_opt.server.media import image_renderer
from neuron_opt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from neuron_opt.server.reasoning import make_reasoning_parser
from neuron_opt.server.responses import ResponsesRequest, ResponsesServing
from neuron_opt.server.scoring import tokenizer_info
from neuron_opt.server.serving import OpenAIServing
from neuron_opt.server.tools import make_parser

log = logging.getLogger(__name__)
_ERROR_EVENT = 'data: {"error"'  # how an OpenAI stream's error event begins (serving.py)
# how often a replica looks for its engine's death: the requests it answers "retry" meanwhile may come back to it
# (prefix routing), so it must be gone before the router's next attempt (router.RETRY_BACKOFF_S)
ENGINE_CHECK_S = 0.05


async def _never_disconnected() -> bool:
    return False  # a replica learns of a disconnect by cancellation (the router cancels its stream)


@serve.deployment
class EngineReplica:
    """One engine (the model loaded once, its tp ranks inside this replica's cores) and its OpenAI serving."""

    def __init__(self, make_engine: Callable[[], Any], model_name: str, board: Any,
                 threads: int | None, tool_call_parser: str | None = None, limits: ServerLimits | None = None,
                 reasoning_parser: str | None = None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.engine = engine = make_engine()
        if threads is not None:  # the engine thread takes them; this thread frees its OpenMP workers
            hand_threads_to_engine(engine.runners, threads)
        self.metrics = engine_metrics(engine, model_name, engine.runner.max_model_len)
        self.serving = OpenAIServing(engine, engine.tokenizer, engine.encode_chat, model_name, self.metrics,
                                     engine.runner.max_model_len,
                                     tool_parser=make_parser(tool_call_parser, engine.tokenizer), limits=limits,
                                     reasoning_parser=make_reasoning_parser(reasoning_parser, engine.tokenizer),
                                     encode_image_chat=image_renderer(engine))
        self.embeddings = EmbeddingServing(self.serving)
        self.anthropic = AnthropicServing(self.serving)
        self.responses = ResponsesServing(self.serving, None)  # no store: `serve` refuses --enable-store here
        self.id = serve.get_replica_context().replica_id.unique_id
        # what the router's /v1/models card needs
        self.info = {"max_model_len": engine.runner.max_model_len, "input_modalities": list(self.serving.modalities)}
        self.board = board
        self._lora_version = -1  # the adapter set this engine holds (module docstring, "LoRA adapters")
        self._lora_errors: dict[str, tuple[str, str]] = {}  # name -> (path, why this replica could not load it)
        self._sync_adapters()  # before Serve routes requests here
        self.engine.start()
        self._push()
        self._stop = threading.Event()
        threading.Thread(target=self._push_loop, name="metrics-push", daemon=True).start()

    def _sync_adapters(self) -> None:
        """Register the board's adapters in this engine and unregister the others; the info pushed with the metrics
        says which set version this engine holds, the adapters it could not load, and those requests use."""
        loras = self.engine.loras
        if loras is None:
            return
        version, wanted = ray.get(self.board.adapter_set.remote())
        wanted = {name: str(Path(path)) for name, path in wanted.items()}
        complete = True
        for name in loras.names():
            if wanted.get(name) != loras.path_of(name):
                try:
                    loras.unregister(name)
                except KeyError:
                    pass
                except ConfigError:  # requests in flight use it: dropped at a later push, once they have finished
                    complete = False
        self._lora_errors = {n: e for n, e in self._lora_errors.items() if wanted.get(n) == e[0]}
        for name, path in wanted.items():
            if name in loras or name in self._lora_errors:
                continue
            try:
                loras.register(name, path)
            except ConfigError as e:
                self._lora_errors[name] = (path, str(e))
        if complete:
            self._lora_version = version
        self.info = {**self.info, "lora_version": self._lora_version, "lora_busy": loras.in_use(),
                     "lora_errors": {n: msg for n, (_, msg) in self._lora_errors.items()}}

    def _push(self) -> None:
        try:
            self._sync_adapters()
        except Exception:  # noqa: BLE001 -- the board restarting, say: the next push tries again
            log.exception("LoRA adapter sync failed")
        self.board.put.remote(self.id, self.info, self.metrics.render().decode())

    def _check_adapter(self, body: bytes) -> dict[str, str]:
        """Read and check the adapter a load request names, registering nothing (the router's first step)."""
        req = LoadLoraAdapterRequest.model_validate_json(body or b"null")
        loras = self.engine.loras
        if loras is None:
            raise ConfigError("lora: this model was compiled without --enable-lora; it serves no adapters",
                              param="lora_name")
        read_adapter(req.lora_path, loras.model_config, loras.config)
        return {"lora_name": req.lora_name, "lora_path": req.lora_path}

    def _push_loop(self) -> None:
        pushed = time.monotonic()
        while not self._stop.wait(ENGINE_CHECK_S):
            if self.engine.error is not None:
                # the engine loop died (a device error, say): end the process, so that Serve stops routing here at
                # once and replaces it, instead of this replica failing requests fast until its health check
                # has failed enough times (a fast-failing replica looks idle and draws more requests)
                log.critical("engine stopped (%r): exiting so that Serve replaces this replica", self.engine.error)
                os._exit(1)
            if time.monotonic() - pushed >= PUSH_PERIOD_S:
                pushed = time.monotonic()
                self._push()

    def check_health(self) -> None:
        """Serve's periodic health check: a dead engine thread marks the replica unhealthy, and Serve replaces it."""
        if not self.engine.is_alive():
            raise RuntimeError(f"engine stopped: {self.engine.error}")

    def __del__(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
            self.engine.stop(timeout=5.0)

    async def _answer(self, route: str, body: bytes, arrival: float) -> dict[str, Any] | AsyncIterator[str]:
        """The single-process server's answer to `route` (the router's name of one of its routes)."""
        def parse(model: Any) -> Any:
            return model.model_validate_json(body or b"null")

        if route == "completions":
            return await self.serving.completions(parse(CompletionRequest), arrival, _never_disconnected)
        if route == "chat":
            return await self.serving.chat(parse(ChatCompletionRequest), arrival, _never_disconnected)
        if route == "messages":
            return await self.anthropic.messages(parse(MessagesRequest), arrival, _never_disconnected)
        if route == "count_tokens":
            return await self.anthropic.count_tokens(parse(CountTokensRequest))
        if route == "responses":
            return await self.responses.create(parse(ResponsesRequest), arrival, _never_disconnected)
        if route == "get_response":
            return self.responses.retrieve(body.decode())
        if route == "embeddings":
            return await self.embeddings.create(parse(EmbeddingRequest), arrival)
        if route == "tokenize":
            return await self.serving.tokenize(parse(TokenizeRequest))
        if route == "detokenize":
            return await self.serving.detokenize(parse(DetokenizeRequest))
        if route == "tokenizer_info":
            return tokenizer_info(self.engine.tokenizer)
        if route == "check_lora":
            return await asyncio.to_thread(self._check_adapter, body)
        raise ValueError(f"unknown route {route!r}")

    async def handle(self, route: str, body: bytes, sent_at: float) -> AsyncIterator[Any]:
        """The header `(kind, status, payload, replica id)`, then (kind "sse") the SSE chunks; kind "retry": this
        replica's engine died, send the request to another. An error's payload is
        OpenAI-shaped, also on the Anthropic routes (the router reshapes it, as it reshapes its own refusals)."""
        arrival = time.monotonic() - max(0.0, time.time() - sent_at)  # the router's receipt on this clock
        try:
            result = await self._answer(route, body, arrival)
        except Exception as e:
            status, content = error_payload(e)
            if self.engine.error is not None:  # failed because the engine died, before any answer: run it elsewhere
                yield ("retry", status, content, self.id)
                return
            self.metrics.request_rejected(status)
            yield ("json", status, content, self.id)
            return
        if isinstance(result, dict):
            yield ("json", 200, result, self.id)
            return
        # the first event before the header: a stream whose request had made no output when the engine died (queued
        # in it, say) ends with an error event as its first, and goes to another replica instead (it never ran)
        first = await anext(aiter(result), None)
        if self.engine.error is not None and (first is None or first.startswith(_ERROR_EVENT)):
            yield ("retry", 503, None, self.id)
            return
        yield ("sse", 200, None, self.id)
        if first is not None:
            yield first
        async for chunk in result:
            yield chunk
