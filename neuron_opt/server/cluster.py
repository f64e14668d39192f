"""`serve --data-parallel N`: N engine replicas behind one OpenAI endpoint, as a Ray Serve application.

    HTTP client -> Ray Serve proxy -> `Router` (1 replica, FastAPI, no CPU) -> `EngineReplica` x N

Design decisions
- Ray does what Ray is for: placement (each replica asks for its cores: `neuron_cores = tp` on Neuron, which makes
  Ray set NEURON_RT_VISIBLE_CORES for it; CPUs on the cpu/eager backends), routing (a request router on Serve's
  `RequestRouter` API, `PrefixAffinityRouter` below), restarts (the Serve controller replaces a dead replica),
  streaming and cancellation through `DeploymentHandle`s.
- Routing (`--routing prefix`, the default): a request goes to the replica that was last sent the longest chain of
  its prompt's first blocks, keyed by the hashes the engine's prefix cache uses (`hash_block` over the same token
  ids: the same tokenizer, chat template and tool rendering), so requests sharing a system prompt or a
  conversation's history find its KV blocks cached. Unless that replica has more than `balance_threshold` ongoing
  requests beyond the least loaded one (SGLang's rule): then, and for a prompt with no remembered block, the least
  loaded replica (`--routing load`: always). The router remembers at most `ROUTED_BLOCKS` keys (LRU) and forgets a
  replica's keys when it dies. `/v1/embeddings`, `/tokenize` and `/detokenize` have no keys (an embedding input
  uses no prefix cache: it is pooled whole in one call) and go by load.
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
- LoRA adapters (docs/lora.md): every replica serves the same adapters, the set the `MetricsBoard` actor holds
  (name -> path; `--lora-modules` seed it). `POST /v1/load_lora_adapter` on the router has one replica read and
  check the adapter (a bad one is its 400, and nothing changes), adds it to the set, and answers once every live
  replica reports that it holds the new set (each reconciles its engine's adapters with the set before each
  metrics push, and once before it takes requests, so a restarted replica serves them too). An adapter some
  replica cannot read is taken out of the set again and the answer is a 400 naming that replica.
  `POST /v1/unload_lora_adapter` is a 404 for a name not in the set, a 400 while a replica reports requests using
  it (as in one process), else it leaves the set and the answer waits for every replica to drop it (one whose
  requests started meanwhile drops it when they finish). At most `LORA_SYNC_TIMEOUT_S` of waiting: then a 504.
- Backpressure: the router holds at most `max_in_flight` requests (what the replicas take at once plus
  `--max-waiting` queued for them); past it a request is answered 503 with `Retry-After` at once, as the single
  server answers a full queue. The body is read with the same bound as there (`--max-body-bytes`, 413), before
  anything is sent to a replica.
"""


import asyncio
import importlib
import logging
import threading
import time
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import ray
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica
from starlette.exceptions import HTTPException as StarletteHTTPException

from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.errors import ConfigError
from neuron_opt.hub import hub_id, resolve_model
from neuron_opt.lora.adapter import read_adapter
from neuron_opt.runtime.block_manager import hash_block
from neuron_opt.runtime.threads import hand_threads_to_engine
from neuron_opt.server.app import (
    UNAUTHORIZED,
    BodyTooLargeError,
    authorized,
    engine_metrics,
    error_body,
    error_headers,
    error_payload,
    http_error,
    read_body,
)
from neuron_opt.server.embeddings import EmbeddingRequest, EmbeddingServing
from neuron_opt.server.limits import ServerLimits
from neuron_opt.server.lora_routes import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from neuron_opt.server.metrics import PREFIX, REJECTION_REASONS, VLLM
from neuron_opt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from neuron_opt.server.reasoning import make_reasoning_parser
from neuron_opt.server.serving import NotFoundError, OpenAIServing, internal_error_message, sse
from neuron_opt.server.tools import make_parser, render_messages

log = logging.getLogger(__name__)

APP_NAME = "neuron_opt"
PUSH_PERIOD_S = 1.0
STALE_AFTER_S = 5.0
RETRIES = 3
REQUEST_TIMEOUT_S = 600.0
REPLICA_HEADER = "x-neuron-opt-replica"
# what Serve lets the router take beyond its own bound (max_in_flight): /health, /metrics, /v1/models, and the
# requests it answers 503 at once, so that Serve never queues what the router would refuse
ROUTER_SPARE_REQUESTS = 256
LORA_SYNC_TIMEOUT_S = 60.0  # what a load or unload waits for every replica to hold the new adapter set


class MetricsBoard:
    """Latest metrics text and model-card facts of each replica, by replica id, and the LoRA adapters every replica
    serves (name -> path, with a version that each change raises) (a Ray actor; `metrics_board()` starts it)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, dict[str, Any], str]] = {}
        self.adapters: dict[str, str] = {}
        self.adapters_version = 0

    def set_adapter(self, name: str, path: str) -> int:
        self.adapters[name] = path
        self.adapters_version += 1
        return self.adapters_version

    def drop_adapter(self, name: str) -> int:
        self.adapters.pop(name, None)
        self.adapters_version += 1
        return self.adapters_version

    def adapter_set(self) -> tuple[int, dict[str, str]]:
        return self.adapters_version, dict(self.adapters)

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
                                     reasoning_parser=make_reasoning_parser(reasoning_parser, engine.tokenizer))
        self.embeddings = EmbeddingServing(self.serving)
        self.id = serve.get_replica_context().replica_id.unique_id
        self.info = {"max_model_len": engine.runner.max_model_len}  # what the router's /v1/models card needs
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
            elif route == "embeddings":
                result = await self.embeddings.create(EmbeddingRequest.model_validate_json(body or b"null"), arrival)
            elif route == "tokenize":
                result = await self.serving.tokenize(TokenizeRequest.model_validate_json(body or b"null"))
            elif route == "detokenize":
                result = await self.serving.detokenize(DetokenizeRequest.model_validate_json(body or b"null"))
            elif route == "check_lora":
                result = await asyncio.to_thread(self._check_adapter, body)
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


def routing_families(replica_families: list[Any]) -> list[Any]:
    """The router's own: requests routed per replica and why (`prefix`: to the replica holding the prompt's
    prefix; `balance`: away from it, past the balance threshold; `full`: it had no room; `load`: no prefix
    remembered, or `--routing load`), and the cluster's prefix-cache hit rate (the replicas' hits / queries)."""
    routed = CounterMetricFamily(PREFIX + "cluster_routed", "Requests the router sent to each replica, by reason.",
                                 labels=["replica", "reason"])
    for (replica, reason), n in sorted(ROUTING.routed.items()):
        routed.add_metric([replica, reason], n)
    totals = {name: sum(s.value for f in replica_families if f.name == VLLM + name for s in f.samples
                        if s.name.endswith("_total"))
              for name in ("prefix_cache_hits", "prefix_cache_queries")}
    rate = GaugeMetricFamily(PREFIX + "cluster_prefix_cache_hit_rate", "Prefix-cache hits / queries summed over "
                             "the live replicas (0-1).")
    rate.add_metric([], totals["prefix_cache_hits"] / totals["prefix_cache_queries"]
                    if totals["prefix_cache_queries"] else 0.0)
    return [routed, rate]


def _error(e: Exception) -> JSONResponse:
    status, content = error_payload(e)
    return JSONResponse(content, status, headers=error_headers(status))


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


ROUTED_BLOCKS = 1 << 16  # prefix keys the router remembers (LRU): 64 Ki blocks, about 4 MB
MAX_KEY_BLOCKS = 256  # of a prompt's blocks, the first this many are keyed (a chain: each key names its prefix)
ROUTING_POLICIES = ("prefix", "load")


class PrefixKeys:
    """The prefix-cache keys of a request's full prompt blocks, as its replica's engine computes them: the prompt's
    token ids (completions: the prompt as tokenized by `OpenAIServing`; chat: the messages and tools rendered as a
    chat request renders them, through the chat template), chained with `hash_block`. A request the replica will
    refuse has no keys (it is routed by load and answered there)."""

    def __init__(self, tokenizer: Any, block_size: int, tool_call_parser: str | None,
                 max_blocks: int = MAX_KEY_BLOCKS) -> None:
        self.tokenizer, self.block_size, self.max_blocks = tokenizer, block_size, max_blocks
        self.parser = make_parser(tool_call_parser, tokenizer)

    def prompt_ids(self, route: str, body: bytes) -> list[int]:
        if route == "completions":
            prompt = CompletionRequest.model_validate_json(body or b"null").prompt_input()
            return list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        if route == "chat":
            req = ChatCompletionRequest.model_validate_json(body or b"null")
            rendered, tools = render_messages(req.message_dicts(), self.parser, req.tool_request())
            kw = {"tools": tools} if tools else {}
            out = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True, **kw)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return []

    def __call__(self, route: str, body: bytes) -> tuple[bytes, ...]:
        try:
            ids = self.prompt_ids(route, body)
        except Exception:  # noqa: BLE001 -- invalid for the replica too, which answers it with the reason
            return ()
        keys, parent = [], None
        for start in range(0, min(len(ids) // self.block_size, self.max_blocks) * self.block_size, self.block_size):
            parent = hash_block(parent, ids[start:start + self.block_size])
            keys.append(parent)
        return tuple(keys)


class RoutingStats:
    """What the request router decided, per replica: read by the Router's /metrics (same process)."""

    def __init__(self) -> None:
        self.routed: Tally[tuple[str, str]] = Tally()  # (replica, reason) -> requests

    def count(self, replica: str, reason: str) -> None:
        self.routed[(replica, reason)] += 1


ROUTING = RoutingStats()


def load_tokenizer(source: dict[str, str | None]) -> Any:
    """The tokenizer the replicas use: an artifact's (`{"artifact": dir}`) or a checkpoint's (`{"model": spec,
    "revision": ..., "gguf_file": ...}`, a Hub id fetched here: neuron_opt.hub)."""
    if "artifact" in source:
        # transformers here, not at the top: a replica sets up its device runtime before importing it
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(Path(source["artifact"]) / "tokenizer")
    return open_checkpoint(resolve_model(str(source["model"]), revision=source.get("revision"),
                                         gguf_file=source.get("gguf_file"))).tokenizer()


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Serve's request router for the engine replicas (module docstring, "Routing"). `request_router_kwargs`:
    tokenizer (load_tokenizer's source), block_size, tool_call_parser, policy ("prefix" | "load"),
    balance_threshold (ongoing requests)."""

    def initialize_state(self, tokenizer: dict[str, str], block_size: int, tool_call_parser: str | None = None,
                         policy: str = "prefix", balance_threshold: int = 4) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r}: one of {ROUTING_POLICIES}")
        self.policy, self.balance_threshold = policy, balance_threshold
        self.keys = PrefixKeys(load_tokenizer(tokenizer), block_size, tool_call_parser) if policy == "prefix" else None
        self.owner: OrderedDict[bytes, ReplicaID] = OrderedDict()
        # request id -> (its keys, why it goes where it goes, the replica holding its prefix)
        self.pending: dict[str, tuple[tuple[bytes, ...], str, ReplicaID | None]] = {}

    async def _request_keys(self, request: PendingRequest) -> tuple[bytes, ...]:
        rid = request.metadata.internal_request_id
        if rid not in self.pending:  # once per request (routing may take several rounds)
            route, body = request.args[0], request.args[1]
            keys = await asyncio.to_thread(self.keys, route, body) if self.keys is not None else ()
            self.pending[rid] = (keys, "load", None)
        return self.pending[rid][0]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or self.policy == "load" or not candidate_replicas:
            return [candidate_replicas]  # Serve probes them and takes the least loaded with room
        keys = await self._request_keys(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        match = next((by_id[o] for k in reversed(keys) if (o := self.owner.get(k)) in by_id), None)
        rid = pending_request.metadata.internal_request_id
        if match is None:
            return [candidate_replicas]
        lens = [n for r in candidate_replicas if (n := self.replica_queue_len_cache.get(r.replica_id)) is not None]
        mine = self.replica_queue_len_cache.get(match.replica_id)
        if mine is not None and lens and mine - min(lens) > self.balance_threshold:
            self.pending[rid] = (keys, "balance", match.replica_id)
            return [candidate_replicas]
        self.pending[rid] = (keys, "prefix", match.replica_id)
        # the replica holding the prefix first; when it has no room, the least loaded of the others
        return [[match], [r for r in candidate_replicas if r is not match]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        keys, reason, holder = self.pending.pop(pending_request.metadata.internal_request_id, ((), "load", None))
        if reason == "prefix" and holder != replica_id:
            reason = "full"  # the prefix's replica had no room: the least loaded of the others took it
        # this module's ROUTING, which the Router's /metrics reads: Serve ships this class to the router's process by
        # value, with a copy of the module's globals
        importlib.import_module(__name__).ROUTING.count(replica_id.unique_id, reason)
        for k in keys:
            self.owner[k] = replica_id
            self.owner.move_to_end(k)
        while len(self.owner) > ROUTED_BLOCKS:
            self.owner.popitem(last=False)

    def _forget(self, alive: set[ReplicaID]) -> None:
        for k in [k for k, o in self.owner.items() if o not in alive]:
            del self.owner[k]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(set(self.curr_replicas))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget({r.replica_id for r in replicas})


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
        self._lora_lock = asyncio.Lock()  # one adapter load or unload at a time

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
        now = int(time.time())
        card = {"id": self.model_name, "object": "model", "created": now, "owned_by": "neuron-opt",
                "root": self.model_name, "parent": None, "max_model_len": info["max_model_len"], "permission": []}
        _, adapters = await self.board.adapter_set.remote()
        cards = [{**card, "id": name, "root": name, "parent": self.model_name} for name in adapters]
        return JSONResponse({"object": "list", "data": [card, *cards]})

    @router_app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """Every replica's, or none's (module docstring, "LoRA adapters")."""
        if (denied := self._denied(request)) is not None:
            return denied
        async with self._lora_lock:
            try:
                body = await read_body(request, self.limits.max_body_bytes)
                req = LoadLoraAdapterRequest.model_validate_json(body or b"null")
                if req.lora_name == self.model_name:
                    raise ConfigError(f"lora_name: {req.lora_name!r} is the base model's name", param="lora_name")
                if not Path(req.lora_path).is_absolute() and hub_id(req.lora_path) is None:
                    raise ConfigError(f"lora_path: {req.lora_path!r} is relative; give an absolute path or a Hub id "
                                      "(the replicas do not share the server's working directory)", param="lora_path")
                _, adapters = await self.board.adapter_set.remote()
                if req.lora_name in adapters:
                    raise ConfigError(f"lora_name: an adapter named {req.lora_name!r} is already loaded",
                                      param="lora_name")
            except Exception as e:  # noqa: BLE001 -- answered in the OpenAI shape, as a replica answers
                return _error(e)
            checked = await self._send("check_lora", body)  # one replica reads it: its 400 for a bad adapter
            if checked.status_code != 200:
                return checked
            version = await self.board.set_adapter.remote(req.lora_name, req.lora_path)
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
        registry.register(_Merged(families + routing_families(families)))
        body = generate_latest(registry) + generate_latest(self.registry)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @router_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward("completions", request)

    @router_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._forward("chat", request)

    @router_app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        return await self._forward("embeddings", request)

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
