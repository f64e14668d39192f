"""FastAPI routes and OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Design decisions
- Bodies are parsed by us (`model_validate_json` on the raw bytes), not by FastAPI's injection, so malformed
  JSON and wrong types are 400 BadRequestError with the field named — never FastAPI's 422 or a 500.
- User input never causes a 500: invalid parameters, over-long prompts and input nested too deeply to parse
  (RecursionError) are 400, an unknown model is 404, a body past `--max-body-bytes` is 413 (refused from its
  Content-Length, or as soon as a chunked body passes the bound: never buffered beyond it), a full queue is 503
  with `Retry-After`. A 500 means a bug or a failing backend; its body says only a request id, under which the
  details are logged, and the server stays up.
- Every refusal is counted on `/metrics`: `neuron_opt:request_rejected_total{reason}`.
- `/docs`, `/redoc` and `/openapi.json` are off unless `serve --enable-docs`.
- The engine starts with the app (lifespan) and stops after the server has drained in-flight requests (SIGTERM:
  new requests get 503 with Retry-After, `/health` 503, open responses finish; server/drain.py).
- With an API key (`serve --api-key`), every `/v1/*` route and `/tokenize`, `/detokenize` need
  `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY` (compared in constant time); `/health` and
  `/metrics` stay open, as in vLLM.
- Anthropic's routes (`/v1/messages*`, server/anthropic.py) answer errors, 401 included, in Anthropic's shape.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from neuron_opt.errors import NeuronOptError, QueueFullError
from neuron_opt.runtime.engine import Engine
from neuron_opt.server.anthropic import AnthropicServing, CountTokensRequest, MessagesRequest, anthropic_error
from neuron_opt.server.drain import Drain, DrainMiddleware
from neuron_opt.server.embeddings import EmbeddingRequest, EmbeddingServing
from neuron_opt.server.limits import ServerLimits
from neuron_opt.server.lora_routes import LoraRuntimeLoading, add_lora_routes, lora_cards
from neuron_opt.server.media import EncodeImageChat
from neuron_opt.server.metrics import ServerMetrics
from neuron_opt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ProtocolError,
    TokenizeRequest,
)
from neuron_opt.server.reasoning import ReasoningParser
from neuron_opt.server.responses import ResponsesRequest, ResponsesServing, ResponseStore
from neuron_opt.server.scoring import tokenizer_info
from neuron_opt.server.serving import EncodeChat, EngineError, NotFoundError, OpenAIServing, internal_error_message
from neuron_opt.server.tool_parsers import ToolParser

RETRY_AFTER_S = 1  # what a 503 tells the client to wait before retrying
ANTHROPIC_PREFIX = "/v1/messages"  # the routes that answer in Anthropic's shapes


class BodyTooLargeError(ValueError):
    """The request body is larger than this server takes (HTTP 413)."""


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status, headers=error_headers(status))


def bad_request(message: str, param: str | None = None) -> JSONResponse:
    return error_response(400, message, "BadRequestError", param)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    errs = e.errors(include_url=False)
    if errs and errs[0]["type"] == "json_invalid":
        return f"Invalid JSON body: {errs[0].get('ctx', {}).get('error', errs[0]['msg'])}", None
    if errs and not errs[0]["loc"]:
        return "the request body must be a JSON object", None
    parts = []
    for err in errs[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        msg = (
            "unsupported parameter (not part of the API this server implements)"
            if err["type"] == "extra_forbidden"
            else err["msg"]
        )
        parts.append(f"{loc}: {msg}")
    param = ".".join(str(x) for x in errs[0]["loc"]) if errs and errs[0]["loc"] else None
    return "; ".join(parts), param


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused (BodyTooLargeError) past `max_bytes`: from its Content-Length before reading
    anything, else (chunked) as soon as the bytes read pass the bound, so no more than that is ever held."""
    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and (len(length) > 18 or int(length) > max_bytes):
        raise BodyTooLargeError(f"the request body is larger than this server takes ({max_bytes} bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLargeError(f"the request body is larger than this server takes ({max_bytes} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    return model.model_validate_json(await read_body(request, max_bytes) or b"null")


def error_payload(e: Exception) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI-shaped error body) of an exception raised while serving a request: the one mapping the
    single-process app and every `serve --data-parallel` replica use."""

    def body(status: int, message: str, type_: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
        return status, error_body(status, message, type_, param)

    if isinstance(e, ValidationError):
        message, param = _validation_message(e)
        return body(400, message, "BadRequestError", param)
    if isinstance(e, ProtocolError):
        return body(400, str(e), "BadRequestError", e.param)
    if isinstance(e, NotFoundError):
        return body(404, str(e), "NotFoundError", getattr(e, "param", "model"))
    if isinstance(e, BodyTooLargeError):
        return body(413, str(e), "RequestTooLargeError")
    if isinstance(e, QueueFullError):
        return body(503, str(e), "ServiceUnavailableError")
    if isinstance(e, RecursionError):  # input nested past what a parser walks, wherever it was caught late
        return body(400, "the request is nested too deeply to parse", "BadRequestError")
    if isinstance(e, NeuronOptError) and isinstance(e, ValueError):  # ConfigError (ranges), ContextLengthError
        return body(400, str(e), "BadRequestError", e.param)  # set where it was raised, never read off the message
    return body(500, internal_error_message(e), "InternalServerError")  # never the exception's text


def error_headers(status: int) -> dict[str, str]:
    """The headers that go with an error status: a 503 says when to retry."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {}


async def http_error(_: Request, e: Exception) -> JSONResponse:
    """Starlette's own HTTP errors (unknown route, wrong method) in the OpenAI shape."""
    assert isinstance(e, StarletteHTTPException)
    type_ = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(e.status_code, "BadRequestError")
    return error_response(e.status_code, str(e.detail), type_)


def needs_key(path: str) -> bool:
    """The routes an API key protects."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def authorized(api_key: str | None, authorization: str | None, x_api_key: str | None = None) -> bool:
    """`Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (always true without a key)."""
    if api_key is None:
        return True
    if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), api_key.encode()):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


UNAUTHORIZED_MESSAGE = "Incorrect or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
UNAUTHORIZED = error_body(401, UNAUTHORIZED_MESSAGE, "AuthenticationError")


class ApiKeyMiddleware:
    """Answers 401 before routing when a protected route comes without the key (plain ASGI: streaming responses
    and disconnect detection pass through untouched)."""

    def __init__(self, app: Any, api_key: str, metrics: ServerMetrics) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and needs_key(scope["path"]):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            x_key = headers.get(b"x-api-key")
            if not authorized(self.api_key, auth, None if x_key is None else x_key.decode("latin-1")):
                self.metrics.request_rejected(401)
                body = (anthropic_error(401, UNAUTHORIZED_MESSAGE) if scope["path"].startswith(ANTHROPIC_PREFIX)
                        else UNAUTHORIZED)
                await JSONResponse(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def engine_metrics(engine: Engine, model_name: str, max_model_len: int) -> ServerMetrics:
    """The Prometheus metrics of one engine (gauges read it at scrape time; token-count buckets up to
    `max_model_len`)."""
    return ServerMetrics(
        model_name,
        lambda: engine.num_running,
        lambda: engine.num_waiting,
        lambda: engine.kv_usage,
        (lambda: engine.spec_stats) if engine.spec is not None else None,
        lambda: engine.prefix_cache_stats,
        lambda: engine.stats.preemptions,
        getattr(engine, "loras", None),
        max_model_len,
        lambda: engine.stats.step_tokens,
        lambda: engine.lora_adapters,
        getattr(engine, "kv_tier", None),
        lambda: (engine.runner.stats, engine.stats.step_s),
    )


def create_app(
    engine: Engine,
    tokenizer: Any,
    encode_chat: EncodeChat,
    model_name: str,
    max_model_len: int,
    *,
    api_key: str | None = None,
    tool_parser: ToolParser | None = None,
    reasoning_parser: ReasoningParser | None = None,
    limits: ServerLimits | None = None,
    enable_docs: bool = False,
    enable_tokenizer_info: bool = False,
    enable_store: bool = False,
    lora_runtime: LoraRuntimeLoading | None = None,
    encode_image_chat: EncodeImageChat | None = None,
) -> FastAPI:
    """The single-process server's app. `api_key`: required on the `/v1/*` and tokenizer routes; `tool_parser`,
    `reasoning_parser`, `limits`: see OpenAIServing; `enable_docs`: serve `/docs`, `/redoc` and `/openapi.json`;
    `enable_tokenizer_info`: serve vLLM's `GET /tokenizer_info` (the tokenizer's configuration, chat template
    included); `enable_store`: keep /v1/responses results for `previous_response_id` and `GET /v1/responses/{id}`
    (server/responses.py); `lora_runtime`: what `/v1/load_lora_adapter` may load (None: runtime loading off);
    `encode_image_chat`: an image-capable model's renderer of conversations with images (server/media.py; None: a
    text-only model, whose requests with images are a 400).
    `app.state.drain` is the app's Drain (SIGTERM: server/drain.py)."""
    metrics = engine_metrics(engine, model_name, max_model_len)
    serving = OpenAIServing(engine, tokenizer, encode_chat, model_name, metrics, max_model_len,
                            tool_parser=tool_parser, reasoning_parser=reasoning_parser, limits=limits,
                            encode_image_chat=encode_image_chat)
    max_body = serving.limits.max_body_bytes

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="neuron-opt", lifespan=lifespan, docs_url="/docs" if enable_docs else None,
                  redoc_url="/redoc" if enable_docs else None, openapi_url="/openapi.json" if enable_docs else None)
    app.state.engine, app.state.serving = engine, serving

    async def _error(_: Request, e: Exception) -> JSONResponse:
        status, content = error_payload(e)
        metrics.request_rejected(status)
        return JSONResponse(content, status, headers=error_headers(status))

    for exc in (ValidationError, ProtocolError, NotFoundError, BodyTooLargeError, NeuronOptError, EngineError):
        app.add_exception_handler(exc, _error)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(_: Request, e: RequestValidationError) -> JSONResponse:
        metrics.request_rejected(400)
        return bad_request("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:5]))

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, _error)

    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, metrics=metrics)

    def draining() -> JSONResponse:
        metrics.request_rejected(503)
        return error_response(503, "the server is shutting down; retry on another replica", "ServiceUnavailableError")

    app.state.drain = Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain, refusal=draining)  # the outermost: it counts all

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive() else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "neuron-opt",
            "root": model_name,
            "parent": None,
            "max_model_len": max_model_len,
            "input_modalities": list(serving.modalities),  # (OpenRouter's name; vLLM's cards have none)
            "permission": [],
        }
        return {"object": "list", "data": [card, *lora_cards(engine, model_name, max_model_len)]}

    add_lora_routes(app, engine, model_name, lambda request, model: _parse(request, model, max_body), lora_runtime)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def respond(result: dict[str, Any] | AsyncIterator[str]) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(
            result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, CompletionRequest, max_body)
        return respond(await serving.completions(req, arrival, request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, ChatCompletionRequest, max_body)
        return respond(await serving.chat(req, arrival, request.is_disconnected))

    embeddings = EmbeddingServing(serving)

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, EmbeddingRequest, max_body)
        return JSONResponse(await embeddings.create(req, arrival))

    if enable_tokenizer_info:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> Response:
            return JSONResponse(tokenizer_info(tokenizer))
    anthropic = AnthropicServing(serving)

    def anthropic_failure(e: Exception) -> JSONResponse:
        status, content = error_payload(e)
        metrics.request_rejected(status)
        err = content["error"]
        return JSONResponse(anthropic_error(status, err["message"], err["param"]), status,
                            headers=error_headers(status))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        arrival = time.monotonic()
        try:
            req = await _parse(request, MessagesRequest, max_body)
            return respond(await anthropic.messages(req, arrival, request.is_disconnected))
        except Exception as e:  # every failure in Anthropic's shape (a 500 says only its log id)
            return anthropic_failure(e)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            return JSONResponse(await anthropic.count_tokens(await _parse(request, CountTokensRequest, max_body)))
        except Exception as e:
            return anthropic_failure(e)

    responses = ResponsesServing(serving, ResponseStore() if enable_store else None)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, ResponsesRequest, max_body)
        return respond(await responses.create(req, arrival, request.is_disconnected))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return JSONResponse(responses.retrieve(response_id))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return JSONResponse(await serving.tokenize(await _parse(request, TokenizeRequest, max_body)))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return JSONResponse(await serving.detokenize(await _parse(request, DetokenizeRequest, max_body)))

    return app
