"""`Router`: the HTTP ingress of `serve --data-parallel` (one Serve replica, FastAPI, no CPU).

Design decisions
- Routes: those of the single-process server (OpenAI's, Anthropic's `/v1/messages*`, `/v1/responses` without the
  store, the tokenizer routes, `/tokenizer_info` with --enable-tokenizer-info-endpoint), each forwarded whole to
  one replica, which answers exactly as one process does; the router speaks for itself only in its refusals and
  in the events that end a failed stream, in each API's shapes (answers.py).
- Faults: a replica whose process dies (OOM kill, a device error) or cannot be reached before the client has seen
  a byte of its answer (a non-streaming answer: all of it; a stream: its first event) costs a retry on another
  replica: the request never reached the client, so re-running it is safe; after `RETRIES` attempts the answer is
  a 503 with Retry-After. A stream that fails after its first event ends with the API's error event (OpenAI's:
  `data: {"error": {...}}` then `[DONE]`), never a silent end that reads as a finish. Nothing waits without a
  bound: `REQUEST_TIMEOUT_S` without output from a replica (first or next) ends the request with a 504.
  Serve sends nothing to a replica whose actor died, or that failed `check_health`, or that is stopping.
- Drain: `begin_drain` (what `serve` calls on SIGTERM) makes every route but `/metrics` a 503 with Retry-After,
  `/health` included, and returns once the forwarded requests, streams to their end, are done, or after
  `--shutdown-timeout`; then `serve` deletes the application (server/drain.py's contract).
- Client disconnect: the proxy cancels the router's request, and the router cancels the replica's stream.
- Metrics: `/metrics` merges the live replicas' (prometheus.py) and adds the router's own (`cluster_replicas`,
  `cluster_retries`, `cluster_failed_streams`, `cluster_rejected{reason}`).
- LoRA adapters (docs/lora.md): runtime loading is gated as in one process (lora_routes.py): off (404) without
  --enable-lora-runtime-loading, adapters only from under --lora-runtime-root (a directory every replica reads at
  the same path), at most --max-cpu-loras in the set, one load at a time (503 for another meanwhile).
  `POST /v1/load_lora_adapter` on the router has one replica read and check the
  adapter (a bad one is its 400, and nothing changes), adds it to the board's set, and answers once every live
  replica reports that it holds the new set. An adapter some replica cannot read is taken out of the set again and
  the answer is a 400 naming that replica. `POST /v1/unload_lora_adapter` is a 404 for a name not in the set, a
  400 while a replica reports requests using it (as in one process), else it leaves the set and the answer waits
  for every replica to drop it (one whose requests started meanwhile drops it when they finish). At most
  `LORA_SYNC_TIMEOUT_S` of waiting: then a 504.
- Backpressure, checked in this order before any work for a request: the key (401), then a slot: the router holds
  at most `max_in_flight` requests (what the replicas take at once plus `--max-waiting` queued for them); past it
  a request is answered 503 with `Retry-After` at once, its body unread, as the single server answers a full
  queue. Then the body, read with the same bound as there (`--max-body-bytes`, 413). Only then does routing parse
  and tokenize it (routing.py, `PrefixKeys`: bounded by the keys' reach, not the body), and a replica validate it.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from starlette.exceptions import HTTPException as StarletteHTTPException

from neuron_opt.errors import ConfigError, QueueFullError
from neuron_opt.server.app import (
    UNAUTHORIZED_MESSAGE,
    BodyTooLargeError,
    authorized,
    error_body,
    error_headers,
    error_payload,
    http_error,
    needs_key,
    read_body,
)
from neuron_opt.server.cluster.answers import ANTHROPIC, OPENAI, RESPONSES, error_content, failed_stream
from neuron_opt.server.cluster.board import PUSH_PERIOD_S, STALE_AFTER_S
from neuron_opt.server.cluster.prometheus import Merged, merge_metrics, routing_families
from neuron_opt.server.drain import Drain
from neuron_opt.server.limits import LoraRuntimeLoading, ServerLimits
from neuron_opt.server.lora_routes import RUNTIME_LOADING_OFF, LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from neuron_opt.server.metrics import PREFIX, REJECTION_REASONS
from neuron_opt.server.serving import NotFoundError, internal_error_message

APP_NAME = "neuron_opt"
RETRIES = 3
RETRY_BACKOFF_S = 0.5  # before the i-th retry, i x this: Serve learns of a dead replica meanwhile
REQUEST_TIMEOUT_S = 600.0  # the most the router waits for a replica's next output (its first included)
REPLICA_HEADER = "x-neuron-opt-replica"
# what Serve lets the router take beyond its own bound (max_in_flight): /health, /metrics, /v1/models, and the
# requests it answers 503 at once, so that Serve never queues what the router would refuse
ROUTER_SPARE_REQUESTS = 256
LORA_SYNC_TIMEOUT_S = 60.0  # what a load or unload waits for every replica to hold the new adapter set
REPLICA_FAILURES = (RayActorError, ActorUnavailableError)  # the replica's process died or cannot be reached


def _error(e: Exception, api: str = OPENAI) -> JSONResponse:
    status, content = error_payload(e)
    return JSONResponse(error_content(api, status, content), status, headers=error_headers(status))


router_app = FastAPI(title="neuron-opt (data parallel)", docs_url=None, redoc_url=None, openapi_url=None)
router_app.add_exception_handler(StarletteHTTPException, http_error)


class _Released(StreamingResponse):
    """A stream that gives its router slot back once sent, or abandoned by its client."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(router_app)
class Router:
    """The routes of the single-process server, forwarded to a replica (routing.py picks it); with an API key, the
    `/v1/*` and tokenizer routes check it here, before anything reaches a replica. At most `max_in_flight` requests
    are forwarded or waiting for a replica at once (503 past it); `limits.max_body_bytes` bounds a body (413);
    `lora_runtime`: what `/v1/load_lora_adapter` may load (None: runtime loading off, the routes a 404);
    `enable_tokenizer_info`: serve `GET /tokenizer_info`."""

    def __init__(self, replicas: Any, board: Any, model_name: str, api_key: str | None = None,
                 limits: ServerLimits | None = None, max_in_flight: int = 1024,
                 lora_runtime: LoraRuntimeLoading | None = None, enable_tokenizer_info: bool = False) -> None:
        self.replicas, self.board, self.model_name, self.api_key = replicas, board, model_name, api_key
        self.limits, self.max_in_flight = limits or ServerLimits(), max_in_flight
        self.lora_runtime, self.enable_tokenizer_info = lora_runtime, enable_tokenizer_info
        self.shutdown = Drain()  # its in_flight: the forwarded requests, a stream until its end
        self.registry = CollectorRegistry()
        self.retries = Counter(PREFIX + "cluster_retries", "Requests re-sent because their replica died before "
                               "answering.", registry=self.registry)
        self.failed_streams = Counter(PREFIX + "cluster_failed_streams", "Streams ended by an error event because "
                                      "their replica died after the stream had started.", registry=self.registry)
        self.live = Gauge(PREFIX + "cluster_replicas", "Replicas that reported metrics in the last "
                          f"{STALE_AFTER_S:g} s.", registry=self.registry)
        self.rejected = Counter(PREFIX + "cluster_rejected", "Requests the router refused (the replicas count "
                                "theirs in request_rejected), by reason.", ["reason"], registry=self.registry)
        for reason in REJECTION_REASONS.values():
            self.rejected.labels(reason)
        self._lora_lock = asyncio.Lock()  # one adapter load or unload at a time

    @property
    def in_flight(self) -> int:
        return self.shutdown.in_flight

    async def begin_drain(self, timeout_s: float) -> int:
        """SIGTERM on `serve` (server/drain.py's contract): from now on every route but `/metrics` is a 503 with
        Retry-After, `/health` included; returns once no request is in flight, or `timeout_s` after the call, with
        the number of requests still in flight then."""
        self.shutdown.begin(timeout_s)
        while not self.shutdown.done():
            await asyncio.sleep(0.05)
        return self.in_flight

    async def _snapshot(self) -> dict[str, tuple[dict[str, Any], str]]:
        snap = await self.board.snapshot.remote()
        self.live.set(len(snap))
        return snap

    @router_app.get("/health")
    async def health(self) -> Response:
        if self.shutdown.draining:
            return self._draining()
        return Response(status_code=200 if await self._snapshot() else 503)

    def _refuse(self, status: int, content: dict[str, Any], api: str = OPENAI) -> Response:
        self.rejected.labels(REJECTION_REASONS[status]).inc()
        return JSONResponse(error_content(api, status, content), status, headers=error_headers(status))

    def _draining(self, api: str = OPENAI) -> Response:
        return self._refuse(503, error_body(503, "the server is shutting down; retry on another instance",
                                            "ServiceUnavailableError"), api)

    def _denied(self, request: Request, api: str = OPENAI) -> Response | None:
        if self.shutdown.draining:
            return self._draining(api)
        if not needs_key(request.url.path) or authorized(self.api_key, request.headers.get("authorization"),
                                                         request.headers.get("x-api-key")):
            return None
        return self._refuse(401, error_body(401, UNAUTHORIZED_MESSAGE, "AuthenticationError"), api)

    @router_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        snap = await self._snapshot()
        if not snap:
            return JSONResponse(error_body(503, "no replica is up yet", "ServiceUnavailableError"), 503)
        info = next(iter(snap.values()))[0]
        now = int(time.time())
        card = {"id": self.model_name, "object": "model", "created": now, "owned_by": "neuron-opt",
                "root": self.model_name, "parent": None, "max_model_len": info["max_model_len"],
                "input_modalities": info["input_modalities"], "permission": []}
        _, adapters = await self.board.adapter_set.remote()
        cards = [{**card, "id": name, "root": name, "parent": self.model_name} for name in adapters]
        return JSONResponse({"object": "list", "data": [card, *cards]})

    @router_app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """Every replica's, or none's (module docstring, "LoRA adapters"); gated as in one process (lora_routes.py):
        off without --enable-lora-runtime-loading, from under --lora-runtime-root only, at most --max-cpu-loras
        adapters, one load at a time (503 for another meanwhile)."""
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            if self.lora_runtime is None:
                raise NotFoundError(RUNTIME_LOADING_OFF)
            body = await read_body(request, self.limits.max_body_bytes)
            req = LoadLoraAdapterRequest.model_validate_json(body or b"null")
            if req.lora_name == self.model_name:
                raise ConfigError(f"lora_name: {req.lora_name!r} is the base model's name", param="lora_name")
            path = str(self.lora_runtime.resolve(req.lora_path))
            if self._lora_lock.locked():
                raise QueueFullError("another LoRA adapter is loading; retry later")
        except Exception as e:  # noqa: BLE001 -- answered in the OpenAI shape, as a replica answers
            return _error(e)
        async with self._lora_lock:
            try:
                _, adapters = await self.board.adapter_set.remote()
                if req.lora_name in adapters:
                    raise ConfigError(f"lora_name: an adapter named {req.lora_name!r} is already loaded",
                                      param="lora_name")
                if len(adapters) >= self.lora_runtime.max_cpu_loras:
                    raise ConfigError(f"lora_name: {self.lora_runtime.max_cpu_loras} adapters are registered, the "
                                      "most this server keeps (--max-cpu-loras); unload one first", param="lora_name")
            except Exception as e:  # noqa: BLE001
                return _error(e)
            # one replica reads it (its 400 for a bad adapter), by the path the root resolved
            checked = await self._send("check_lora", json.dumps({"lora_name": req.lora_name,
                                                                 "lora_path": path}).encode())
            if checked.status_code != 200:
                return checked
            version = await self.board.set_adapter.remote(req.lora_name, path)
            try:
                failed = await self._await_adapters(version, req.lora_name)
            except TimeoutError as e:
                await self.board.drop_adapter.remote(req.lora_name)
                return JSONResponse(error_body(504, str(e), "GatewayTimeoutError"), 504)
            if failed:
                await self.board.drop_adapter.remote(req.lora_name)
                return _error(ConfigError("; ".join(f"replica {r}: {msg}" for r, msg in failed), param="lora_path"))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router_app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        async with self._lora_lock:
            try:
                if self.lora_runtime is None:
                    raise NotFoundError(RUNTIME_LOADING_OFF)
                body = await read_body(request, self.limits.max_body_bytes)
                req = UnloadLoraAdapterRequest.model_validate_json(body or b"null")
                _, adapters = await self.board.adapter_set.remote()
                if req.lora_name not in adapters:
                    raise NotFoundError(f"The lora adapter `{req.lora_name}` cannot be found.")
                busy = sorted(r for r, (info, _) in (await self._snapshot()).items()
                              if req.lora_name in info.get("lora_busy", ()))
                if busy:
                    raise ConfigError(f"lora_name: adapter {req.lora_name!r} is in use by requests on replica(s) "
                                      f"{', '.join(busy)}; unload it once they finish", param="lora_name")
            except Exception as e:  # noqa: BLE001 -- answered in the OpenAI shape, as a replica answers
                return _error(e)
            version = await self.board.drop_adapter.remote(req.lora_name)
            try:
                await self._await_adapters(version, None)
            except TimeoutError as e:
                return JSONResponse(error_body(504, f"{e}; the adapter is out of the set, and the replicas still "
                                               "holding it drop it once their requests under it finish",
                                               "GatewayTimeoutError"), 504)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def _await_adapters(self, version: int, name: str | None) -> list[tuple[str, str]]:
        """Until every live replica holds adapter set `version`; the (replica, reason) of those that could not
        load adapter `name`. TimeoutError after LORA_SYNC_TIMEOUT_S."""
        deadline = time.monotonic() + LORA_SYNC_TIMEOUT_S
        while True:
            snap = await self._snapshot()
            synced = {r: info for r, (info, _) in snap.items() if info.get("lora_version", -1) >= version}
            if snap and len(synced) == len(snap):
                return sorted((r, info["lora_errors"][name]) for r, info in synced.items()
                              if name is not None and name in info.get("lora_errors", {}))
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica(s) {', '.join(sorted(set(snap) - set(synced)))} did not apply the adapter "
                                   f"change in {LORA_SYNC_TIMEOUT_S:g} s")
            await asyncio.sleep(PUSH_PERIOD_S / 4)

    @router_app.get("/metrics")
    async def metrics(self) -> Response:
        snap = await self._snapshot()
        registry = CollectorRegistry()
        families = merge_metrics({r: text for r, (_, text) in snap.items()})
        registry.register(Merged(families + routing_families(families)))
        body = generate_latest(registry) + generate_latest(self.registry)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @router_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward("completions", request)

    @router_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._forward("chat", request)

    @router_app.post("/v1/messages")
    async def messages(self, request: Request) -> Response:
        return await self._forward("messages", request, ANTHROPIC)

    @router_app.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request) -> Response:
        return await self._forward("count_tokens", request, ANTHROPIC)

    @router_app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await self._forward("responses", request, RESPONSES)

    @router_app.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request) -> Response:
        """`serve` refuses --enable-store with --data-parallel: a replica answers as one process without it."""
        return await self._forward("get_response", request, body=response_id.encode())

    @router_app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        return await self._forward("embeddings", request)

    @router_app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._forward("tokenize", request)

    @router_app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._forward("detokenize", request)

    @router_app.get("/tokenizer_info")
    async def get_tokenizer_info(self, request: Request) -> Response:
        if not self.enable_tokenizer_info:  # what one process answers without --enable-tokenizer-info-endpoint
            raise StarletteHTTPException(404, "Not Found")
        return await self._forward("tokenizer_info", request, body=b"")

    async def _forward(self, route: str, request: Request, api: str = OPENAI, body: bytes | None = None) -> Response:
        """The key, a slot (503 past max_in_flight), the body (bounded), then a replica's answer; nothing is parsed,
        tokenized or rendered before the slot and the body's bound. The slot is given back once the answer is sent
        (a stream: when it ends, or its client leaves)."""
        if (denied := self._denied(request, api)) is not None:
            return denied
        if self.in_flight >= self.max_in_flight:
            return self._refuse(503, error_body(503, f"server busy: {self.in_flight} requests in flight (the replicas' "
                                                "share and --max-waiting queued); retry later",
                                                "ServiceUnavailableError"), api)
        self.shutdown.in_flight += 1
        try:
            if body is None:
                body = await read_body(request, self.limits.max_body_bytes)
            response = await self._send(route, body, api)
        except BodyTooLargeError as e:
            self._release()
            return self._refuse(*error_payload(e), api)
        except BaseException:
            self._release()
            raise
        if not isinstance(response, _Released):
            self._release()
        return response

    def _release(self) -> None:
        self.shutdown.in_flight -= 1

    async def _send(self, route: str, body: bytes, api: str = OPENAI) -> Response:
        """A replica's answer. Until its first byte goes to the client (a JSON answer whole; a stream's first
        event), a replica that dies or cannot be reached costs nothing but a retry on another (module docstring,
        "Faults")."""
        sent_at = time.time()
        for attempt in range(RETRIES):
            stream = self.replicas.options(stream=True).handle.remote(route, body, sent_at)
            try:
                kind, status, payload, replica = await asyncio.wait_for(stream.__anext__(), REQUEST_TIMEOUT_S)
                first = await self._first_event(stream) if kind == "sse" else None
            except REPLICA_FAILURES:
                kind = "retry"  # died before answering: the client has seen nothing, send it elsewhere
            except asyncio.TimeoutError:
                stream.cancel()
                return JSONResponse(error_content(api, 504, error_body(
                    504, f"no answer from a replica in {REQUEST_TIMEOUT_S:g} s", "GatewayTimeoutError")), 504)
            except RayTaskError as e:  # a bug in the replica (errors of the request come back as a header)
                return JSONResponse(error_content(api, 500, error_body(500, internal_error_message(e),
                                                                       "InternalServerError")), 500)
            except asyncio.CancelledError:  # the client went away
                stream.cancel()
                raise
            if kind == "retry":
                self.retries.inc()
                stream.cancel()
                await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))
                continue
            headers = {REPLICA_HEADER: replica}
            if kind == "json":
                content = payload if status < 400 else error_content(api, status, payload)
                return JSONResponse(content, status, headers={**headers, **error_headers(status)})
            return _Released(self._relay(stream, first, api), self._release, {**headers, "Cache-Control": "no-cache"})
        return JSONResponse(error_content(api, 503, error_body(
            503, f"no replica answered after {RETRIES} attempts (replicas restarting?); retry",
            "ServiceUnavailableError")), 503, headers=error_headers(503))

    @staticmethod
    async def _first_event(stream: Any) -> str | None:
        try:
            return await asyncio.wait_for(stream.__anext__(), REQUEST_TIMEOUT_S)
        except StopAsyncIteration:
            return None

    async def _relay(self, stream: Any, first: str | None, api: str) -> AsyncIterator[str]:
        """The stream's events, `first` first; a replica that fails or falls silent for REQUEST_TIMEOUT_S ends it
        with the API's error event (answers.py), never a hang nor a stream that looks complete."""
        sent = 0
        try:
            chunk = first
            while chunk is not None:
                yield chunk
                sent += 1
                try:
                    chunk = await asyncio.wait_for(stream.__anext__(), REQUEST_TIMEOUT_S)
                except StopAsyncIteration:
                    chunk = None
        except (*REPLICA_FAILURES, RayTaskError) as e:
            self.failed_streams.inc()
            for event in failed_stream(api, 503, f"the replica serving this stream failed: {type(e).__name__}", sent):
                yield event
        except asyncio.TimeoutError:
            self.failed_streams.inc()
            for event in failed_stream(api, 504, f"no output from the replica in {REQUEST_TIMEOUT_S:g} s", sent):
                yield event
        finally:
            stream.cancel()  # no-op when finished; on a client disconnect it aborts the request on the replica
