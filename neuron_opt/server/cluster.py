"""`serve --data-parallel N`: N engine replicas behind one OpenAI endpoint, as a Ray Serve application.

    HTTP client -> Ray Serve proxy -> `Router` (1 replica, FastAPI, no CPU) -> `EngineReplica` x N

Design decisions
- Ray does what Ray is for: placement (each replica asks for its cores: `neuron_cores = tp` on Neuron, which makes
  Ray set NEURON_RT_VISIBLE_CORES for it; CPUs on the cpu/eager backends), routing (Serve's request router picks
  the replica with the fewest ongoing requests of two sampled, i.e. the least loaded of 2), restarts (the Serve
  controller replaces a dead replica), streaming and cancellation through `DeploymentHandle`s.
- A replica is the single-process server's engine and `OpenAIServing` unchanged; it answers
  `handle(route, body)` with a stream whose first item is a header `(kind, status, payload, replica_id)`: kind
  "json" carries the whole answer (or the OpenAI-shaped error, from `app.error_payload`), kind "sse" is followed
  by the SSE chunks. Validation and errors are therefore exactly the single-process server's.
- Faults: a request whose replica dies before its header reached the router is retried on another replica (the
  client has seen nothing; for non-streaming requests that is the whole request); a stream that dies after its
  header ends with an OpenAI-shaped error event (code 503) and `[DONE]`; when no replica answers after
  `RETRIES` attempts the answer is a 503. Nothing waits without a bound: the router gives up a request after
  `REQUEST_TIMEOUT_S` without output.
- Client disconnect: the proxy cancels the router's request, the router cancels the replica's stream, and the
  replica's `OpenAIServing` aborts the request in its engine (its KV blocks are freed), as in one process.
- Metrics: every replica pushes its Prometheus text to a `MetricsBoard` actor each `PUSH_PERIOD_S`; the router's
  `/metrics` merges the live replicas' metrics with a `replica` label (so they are at most that stale) and adds
  its own (`cluster_replicas`, `cluster_retries`, `cluster_failed_streams`, `cluster_rejected{reason}`). A
  replica silent for `STALE_AFTER_S` is left out (dead, or restarting).
- Backpressure: the router holds at most `max_in_flight` requests (what the replicas take at once plus
  `--max-waiting` queued for them); past it a request is answered 503 with `Retry-After` at once, as the single
  server answers a full queue. The body is read with the same bound as there (`--max-body-bytes`, 413), before
  anything is sent to a replica.
"""


import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from starlette.exceptions import HTTPException as StarletteHTTPException

from neuron_opt.server.app import (
    UNAUTHORIZED,
    BodyTooLargeError,
    authorized,
    error_body,
    error_headers,
    error_payload,
    http_error,
    read_body,
)
from neuron_opt.server.limits import ServerLimits
from neuron_opt.server.metrics import PREFIX, REJECTION_REASONS
from neuron_opt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from neuron_opt.server.serving import internal_error_message, sse

APP_NAME = "neuron_opt"
PUSH_PERIOD_S = 1.0
STALE_AFTER_S = 5.0
RETRIES = 3
REQUEST_TIMEOUT_S = 600.0
REPLICA_HEADER = "x-neuron-opt-replica"
# what Serve lets the router take beyond its own bound (max_in_flight): /health, /metrics, /v1/models, and the
# requests it answers 503 at once, so that Serve never queues what the router would refuse
ROUTER_SPARE_REQUESTS = 256


class MetricsBoard:
    """Latest metrics text and model-card facts of each replica, by replica id (a Ray actor; `metrics_board()`
    starts it)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, dict[str, Any], str]] = {}

    def put(self, replica: str, info: dict[str, Any], text: str) -> None:
        self.entries[replica] = (time.monotonic(), info, text)

    def snapshot(self, max_age_s: float = STALE_AFTER_S) -> dict[str, tuple[dict[str, Any], str]]:
        now = time.monotonic()
        return {r: (info, text) for r, (t, info, text) in self.entries.items() if now - t <= max_age_s}


def metrics_board() -> Any:
    """A new MetricsBoard actor (no CPU), owned by the caller: it ends with the `serve` command."""
    return ray.remote(num_cpus=0)(MetricsBoard).remote()


async def _never_disconnected() -> bool:
    return False  # a replica learns of a disconnect by cancellation (the router cancels its stream)


@serve.deployment
class EngineReplica:
    """One engine (the model loaded once, its tp ranks inside this replica's cores) and its OpenAI serving."""

    def __init__(self, make_engine: Callable[[], Any], model_name: str, board: Any,
                 threads: int | None, tool_call_parser: str | None = None, limits: ServerLimits | None = None) -> None:
        import torch

        from neuron_opt.server.app import engine_metrics
        from neuron_opt.server.serving import OpenAIServing
        from neuron_opt.server.tools import make_parser

        if threads is not None:
            torch.set_num_threads(threads)
        self.engine = engine = make_engine()
        self.metrics = engine_metrics(engine, model_name)
        self.serving = OpenAIServing(engine, engine.tokenizer, engine.encode_chat, model_name, self.metrics,
                                     engine.runner.max_model_len,
                                     tool_parser=make_parser(tool_call_parser, engine.tokenizer), limits=limits)
        self.id = serve.get_replica_context().replica_id.unique_id
        self.info = {"max_model_len": engine.runner.max_model_len}  # what the router's /v1/models card needs
        self.board = board
        self.engine.start()
        self._push()
        self._stop = threading.Event()
        threading.Thread(target=self._push_loop, name="metrics-push", daemon=True).start()

    def _push(self) -> None:
        self.board.put.remote(self.id, self.info, self.metrics.render().decode())

    def _push_loop(self) -> None:
        while not self._stop.wait(PUSH_PERIOD_S):
            self._push()

    def check_health(self) -> None:
        """Serve's periodic health check: a dead engine thread marks the replica unhealthy, and Serve replaces it."""
        if not self.engine.is_alive():
            raise RuntimeError(f"engine stopped: {self.engine.error}")

    def __del__(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
            self.engine.stop(timeout=5.0)

    async def handle(self, route: str, body: bytes, sent_at: float) -> AsyncIterator[Any]:
        """The header `(kind, status, payload, replica id)`, then (kind "sse") the SSE chunks."""
        arrival = time.monotonic() - max(0.0, time.time() - sent_at)  # the router's receipt on this clock
        try:
            if route == "completions":
                result = await self.serving.completions(
                    CompletionRequest.model_validate_json(body or b"null"), arrival, _never_disconnected)
            elif route == "chat":
                result = await self.serving.chat(
                    ChatCompletionRequest.model_validate_json(body or b"null"), arrival, _never_disconnected)
            elif route == "tokenize":
                result = await self.serving.tokenize(TokenizeRequest.model_validate_json(body or b"null"))
            elif route == "detokenize":
                result = await self.serving.detokenize(DetokenizeRequest.model_validate_json(body or b"null"))
            else:
                raise ValueError(f"unknown route {route!r}")
        except Exception as e:
            status, content = error_payload(e)
            self.metrics.request_rejected(status)
            yield ("json", status, content, self.id)
            return
        if isinstance(result, dict):
            yield ("json", 200, result, self.id)
            return
        yield ("sse", 200, None, self.id)
        async for chunk in result:
            yield chunk


class _Merged:
    """A collector yielding parsed metric families (prometheus_client's registry renders them)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Any:
        yield from self.families


def merge_metrics(texts: dict[str, str]) -> list[Any]:
    """Each replica's Prometheus families, merged by name, every sample labelled with its `replica`."""
    merged: dict[str, Any] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = type(fam)(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples += [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                            for s in fam.samples]
    return list(merged.values())


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
    """The OpenAI routes of the single-process server, forwarded to the least-loaded replica; with an API key, the
    `/v1/*` and tokenizer routes check it here, before anything reaches a replica. At most `max_in_flight` requests
    are forwarded or waiting for a replica at once (503 past it); `limits.max_body_bytes` bounds a body (413)."""

    def __init__(self, replicas: Any, board: Any, model_name: str, api_key: str | None = None,
                 limits: ServerLimits | None = None, max_in_flight: int = 1024) -> None:
        self.replicas, self.board, self.model_name, self.api_key = replicas, board, model_name, api_key
        self.limits, self.max_in_flight, self.in_flight = limits or ServerLimits(), max_in_flight, 0
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

    async def _snapshot(self) -> dict[str, tuple[dict[str, Any], str]]:
        snap = await self.board.snapshot.remote()
        self.live.set(len(snap))
        return snap

    @router_app.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200 if await self._snapshot() else 503)

    def _refuse(self, status: int, content: dict[str, Any]) -> Response:
        self.rejected.labels(REJECTION_REASONS[status]).inc()
        return JSONResponse(content, status, headers=error_headers(status))

    def _denied(self, request: Request) -> Response | None:
        if authorized(self.api_key, request.headers.get("authorization")):
            return None
        return self._refuse(401, UNAUTHORIZED)

    @router_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        snap = await self._snapshot()
        if not snap:
            return JSONResponse(error_body(503, "no replica is up yet", "ServiceUnavailableError"), 503)
        info = next(iter(snap.values()))[0]
        card = {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "neuron-opt",
                "root": self.model_name, "parent": None, "max_model_len": info["max_model_len"], "permission": []}
        return JSONResponse({"object": "list", "data": [card]})

    @router_app.get("/metrics")
    async def metrics(self) -> Response:
        snap = await self._snapshot()
        registry = CollectorRegistry()
        registry.register(_Merged(merge_metrics({r: text for r, (_, text) in snap.items()})))
        body = generate_latest(registry) + generate_latest(self.registry)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @router_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward("completions", request)

    @router_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._forward("chat", request)

    @router_app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._forward("tokenize", request)

    @router_app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._forward("detokenize", request)

    async def _forward(self, route: str, request: Request) -> Response:
        """The key, the body (bounded), a slot (503 past max_in_flight), then a replica's answer; the slot is given
        back once the answer is sent (a stream: when it ends, or its client leaves)."""
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            body = await read_body(request, self.limits.max_body_bytes)
        except BodyTooLargeError as e:
            return self._refuse(*error_payload(e))
        if self.in_flight >= self.max_in_flight:
            return self._refuse(503, error_body(503, f"server busy: {self.in_flight} requests in flight (the replicas' "
                                                "share and --max-waiting queued); retry later",
                                                "ServiceUnavailableError"))
        self.in_flight += 1
        try:
            response = await self._send(route, body)
        except BaseException:
            self._release()
            raise
        if not isinstance(response, _Released):
            self._release()
        return response

    def _release(self) -> None:
        self.in_flight -= 1

    async def _send(self, route: str, body: bytes) -> Response:
        sent_at = time.time()
        for attempt in range(RETRIES):
            stream = self.replicas.options(stream=True).handle.remote(route, body, sent_at)
            try:
                head = await asyncio.wait_for(stream.__anext__(), REQUEST_TIMEOUT_S)
            except (RayActorError, ActorUnavailableError):
                self.retries.inc()  # died before answering: the client has seen nothing, send it elsewhere
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            except asyncio.TimeoutError:
                stream.cancel()
                return JSONResponse(error_body(504, f"no answer from a replica in {REQUEST_TIMEOUT_S:g} s",
                                           "GatewayTimeoutError"), 504)
            except RayTaskError as e:  # a bug in the replica (errors of the request come back as a header)
                return JSONResponse(error_body(500, internal_error_message(e), "InternalServerError"), 500)
            except asyncio.CancelledError:  # the client went away
                stream.cancel()
                raise
            kind, status, payload, replica = head
            headers = {REPLICA_HEADER: replica}
            if kind == "json":
                return JSONResponse(payload, status, headers={**headers, **error_headers(status)})
            return _Released(self._relay(stream), self._release, {**headers, "Cache-Control": "no-cache"})
        return JSONResponse(error_body(503, f"no replica answered after {RETRIES} attempts (replicas restarting?); "
                                       "retry", "ServiceUnavailableError"), 503, headers=error_headers(503))

    async def _relay(self, stream: Any) -> AsyncIterator[str]:
        try:
            async for chunk in stream:
                yield chunk
        except (RayActorError, ActorUnavailableError, RayTaskError) as e:
            self.failed_streams.inc()
            yield sse(error_body(503, f"the replica serving this stream failed: {type(e).__name__}",
                                 "ServiceUnavailableError"))
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()  # no-op when finished; on a client disconnect it aborts the request on the replica
