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
