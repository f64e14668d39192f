"""The LoRA routes (vLLM's shapes; docs/lora.md): the adapters' cards in /v1/models, and
`POST /v1/load_lora_adapter {lora_name, lora_path}` / `POST /v1/unload_lora_adapter {lora_name}` at run time.

Loading reads and validates the adapter in a worker thread (a bad one is a 400 naming the reason, and nothing of it
stays registered); the engine thread writes it into a slot when a request first needs it. Unloading an adapter
that a request in flight uses is a 400; an unknown one a 404.

Runtime loading is off unless `serve --enable-lora-runtime-loading` (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true;
both routes are a 404 saying so otherwise), and then:
- adapters load only from under `--lora-runtime-root` (a path given relative to it, or absolute inside it; symlinks
  resolved first). A path outside is refused with one message whether or not it exists, so the route tells nothing
  about the filesystem outside the root;
- at most `--max-cpu-loras` adapters are registered (those of `--lora-modules` count): one more is a 400;
- one load runs at a time: another arriving meanwhile is a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from neuron_opt.errors import ConfigError, QueueFullError
from neuron_opt.server.limits import LoraRuntimeLoading
from neuron_opt.server.serving import NotFoundError

RUNTIME_LOADING_OFF = ("runtime LoRA adapter loading is off: start serve with --enable-lora-runtime-loading "
                       "--lora-runtime-root DIR")


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)


def lora_cards(engine: Any, model_name: str, max_model_len: int) -> list[dict[str, Any]]:
    """A card per registered adapter, after the base model's, with `parent` the base (as vLLM lists them)."""
    loras = getattr(engine, "loras", None)  # None: a model without LoRA (or an engine stand-in without the field)
    if loras is None:
        return []
    now = int(time.time())
    return [{"id": name, "object": "model", "created": now, "owned_by": "neuron-opt", "root": name,
             "parent": model_name, "max_model_len": max_model_len, "permission": []} for name in loras.names()]


def add_lora_routes(app: FastAPI, engine: Any, model_name: str, parse: Any,
                    runtime: LoraRuntimeLoading | None = None) -> None:
    """`parse(request, model)`: the app's bounded JSON body parser; `runtime`: None keeps runtime loading off."""
    loading = asyncio.Lock()

    def manager() -> Any:
        if runtime is None:
            raise NotFoundError(RUNTIME_LOADING_OFF)
        loras = getattr(engine, "loras", None)
        if loras is None:
            raise ConfigError("lora: this model was compiled without --enable-lora; it serves no adapters",
                              param="lora_name")
        return loras

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        loras = manager()
        req = await parse(request, LoadLoraAdapterRequest)
        if req.lora_name == model_name:
            raise ConfigError(f"lora_name: {req.lora_name!r} is the base model's name", param="lora_name")
        assert runtime is not None  # manager() refused otherwise
        path = runtime.resolve(req.lora_path)
        if loading.locked():
            raise QueueFullError("another LoRA adapter is loading; retry later")
        async with loading:
            if len(loras.names()) >= runtime.max_cpu_loras:
                raise ConfigError(f"lora_name: {runtime.max_cpu_loras} adapters are registered, the most this server "
                                  "keeps (--max-cpu-loras); unload one first", param="lora_name")
            await asyncio.to_thread(loras.register, req.lora_name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        loras = manager()
        req = await parse(request, UnloadLoraAdapterRequest)
        try:
            loras.unregister(req.lora_name)
        except KeyError:
            raise NotFoundError(f"The lora adapter `{req.lora_name}` cannot be found.") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
