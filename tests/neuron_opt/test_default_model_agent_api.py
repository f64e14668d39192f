"""The default model (SmolLM2-135M-Instruct) served by `neuron-opt serve --api-key` as a user starts it, with the
official `openai` client as an agent framework drives it: a pydantic model through `parse`, and tool calls.

Oracles: pydantic and `jsonschema` (every structured answer and every call's arguments validate), the tool list
(every call names one of them), and HF-free ones: the key (401 without it). The model's choices are its own;
what is checked is that the server makes them well-formed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

KEY = "sk-default-model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.fixture(scope="module")
def url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NEURON_OPT_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "neuron_opt.cli", "serve", "--model", "default", "--port",
                             str(port), "--max-num-seqs", "4", "--max-model-len", "1024"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(60)


def test_the_key_from_the_environment_is_required(url):
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"] == \
        "default"


@pytest.mark.slow  # ~70 s of the real model generating (make test-slow)
def test_parse_and_tool_calls_are_well_formed(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.parse(model="default", response_format=City, temperature=0, max_tokens=80,
                                      messages=[{"role": "user", "content": "Give me the capital of France as JSON."}])
    assert isinstance(r.choices[0].message.parsed, City) and r.choices[0].finish_reason == "stop"
    msgs = [{"role": "user", "content": "What is the weather like in Paris?"}]
    r = client.chat.completions.create(model="default", messages=msgs, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"}]
    r = client.chat.completions.create(model="default", messages=msgs, tools=[WEATHER], temperature=0, max_tokens=60)
    msg = r.choices[0].message
    assert (msg.tool_calls and r.choices[0].finish_reason == "tool_calls") or isinstance(msg.content, str)


# ---- every schema feature under every engine feature (make test-slow) --------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "nickname": {"type": "string"}},
     "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                                 "maxItems": 3}}, "required": ["colors"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "kind": {"const": "poll"}},
     "required": ["answer", "kind"]},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 999},
                                                       {"type": "null"}]},
                                      "owner": {"$ref": "#/$defs/person"}},
     "required": ["id", "owner"], "$defs": {"person": {"type": "object", "properties": {
         "first": {"type": "string", "minLength": 1, "maxLength": 20}}, "required": ["first"]}}},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "price": {"type": "number", "minimum": 0, "maximum": 1000},
                                      "in_stock": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["code", "price", "in_stock", "note"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {
        "type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 3}, "maxItems": 3},
        "meta": {"type": "object", "properties": {"when": {"type": "string", "format": "date"}},
                 "required": ["when"]}}, "required": ["matrix", "meta"]},
]


@pytest.mark.slow
@pytest.mark.parametrize("features", ["chunked+prefix", "preemption", "speculative"])
def test_default_model_schemas_under_every_engine_feature(features):
    """Six schemas covering the supported keywords, each asked twice (streamed and not) beside two free requests,
    all at once, on the default model: every constrained answer that ends with the grammar validates, and each
    streamed answer equals its non-streamed twin (greedy)."""
    import asyncio

    import torch
    from helpers import live_server

    from neuron_opt.api import LLM
    from neuron_opt.backends.eager import EagerExecutor
    from neuron_opt.config import CacheConfig
    from neuron_opt.runtime.runner import ModelRunner
    from neuron_opt.runtime.speculative import SpeculativeConfig

    torch.set_num_threads(2)
    spec = SpeculativeConfig(3) if features == "speculative" else None
    llm = LLM("default", batch_size=8, max_model_len=256, num_speculative_tokens=3 if spec else None)
    runner = None
    if features == "preemption":  # 10 blocks of 32 positions: one sequence's worth, for 8 running at once
        cache = CacheConfig(max_batch=8, max_model_len=256, block_size=32, num_blocks=10)
        runner = ModelRunner(EagerExecutor(llm.runner.executor.model, cache), llm.runner.buckets, cache,
                             llm.runner.vocab_size)
    # live_server's engine: prefix caching and chunked prefill on, 64 tokens a step (the prompts run as chunks)
    with live_server(llm, max_num_seqs=8, runner=runner, speculative=spec, model="default") as (url, engine):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

        async def ask(i: int, schema: dict | None, stream: bool) -> tuple[str, str]:
            msgs = [{"role": "system", "content": "You answer in JSON. " * 16},  # a shared prefix of > 64 tokens
                    {"role": "user", "content": f"Request {i}: fill in the fields."}]
            fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}} \
                if schema else {}
            if not stream:
                r = await client.chat.completions.create(model="default", messages=msgs, temperature=0,
                                                         max_tokens=120, **fmt)
                return r.choices[0].message.content, r.choices[0].finish_reason
            text, finish = "", None
            async for ch in await client.chat.completions.create(model="default", messages=msgs, temperature=0,
                                                                 max_tokens=120, stream=True, **fmt):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
            return text, finish

        async def everything() -> list[tuple[str, str]]:
            jobs = [ask(i, s, stream) for i, s in enumerate([*SCHEMAS, None, None]) for stream in (False, True)]
            return await asyncio.gather(*jobs)

        got = asyncio.run(everything())
        if spec is not None:
            assert engine.spec_stats.verify_steps > 0
        if runner is not None:
            assert engine.stats.preemptions > 0
        if features == "chunked+prefix":
            assert engine.prefix_cache_stats.hits > 0 and engine.stats.prefills > len(got)
    for i, schema in enumerate([*SCHEMAS, None, None]):
        (whole, f1), (streamed, f2) = got[2 * i], got[2 * i + 1]
        assert (whole, f1) == (streamed, f2), i
        if schema is not None and f1 == "stop":
            jsonschema.validate(json.loads(whole), schema)
    assert sum(f == "stop" for (_, f), s in zip(got[::2], SCHEMAS, strict=False) if s) >= 4
