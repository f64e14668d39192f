"""Bad requests get the right 4xx with an OpenAI-shaped error naming the problem; the server stays healthy.
Also: `neuron-opt serve` as a subprocess prints its curl line, and SIGTERM drains an in-flight stream before
it exits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from test_server_openai import MODEL, live_server

from neuron_opt.api import LLM

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LONG = "word " * 400  # > 256 tokens: the context of the test model

# (path, body: dict or raw bytes, status, substring of the message)
CASES = [
    (C, b'{"prompt": "x",', 400, "Invalid JSON"),
    (C, b"[1, 2]", 400, "body must be a JSON object"),
    (C, b"", 400, "body must be a JSON object"),
    (C, {"max_tokens": 5}, 400, "prompt: Field required"),
    (C, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens: must be at least 1, got -1"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens: must be at least 1, got 0"),
    (C, {"prompt": "x", "max_tokens": 100000}, 400, "'max_tokens' is too large: 100000"),
    (C, {"prompt": LONG, "max_tokens": 5}, 400, "maximum context length is 256 tokens (max_model_len)"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400,
     "maximum context length is 256 tokens (max_model_len)"),
    (C, {"prompt": "x", "temperature": -0.5}, 400, "temperature: must be non-negative"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -3}, 400, "top_k"),
    (C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist."),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "does not exist"),
    (C, {"prompt": ""}, 400, "prompt must not be empty"),
    (C, {"prompt": ["a", "b"]}, 400, "list of 2 prompts is not supported"),
    (C, {"prompt": [1, 10**9]}, 400, "token ids"),
    (C, {"prompt": "x", "foo_bar": 1}, 400, "foo_bar: unsupported parameter"),
    (C, {"prompt": "x", "n": 0}, 400, "n: must be in [1, 16] (this server's limit), got 0"),
    (C, {"prompt": "x", "n": 17}, 400, "n: must be in [1, 16]"),
    (C, {"prompt": "x", "best_of": 2}, 400, "best_of > 1 is not supported"),
    (C, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "the bias of token 5 must be in [-100, 100]"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "'abc' is not a token id"),
    (C, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "is not a token id in [0, 49152)"),
    (C, {"prompt": "x", "temperature": float("nan")}, 400, "temperature: must be a finite number"),
    (C, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}}}}}}, 400,
     "JSON schema keyword 'not' at #/properties/a is not supported"),
    (C, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "json_schema.schema is required"),
    (C, {"prompt": "x", "structured_outputs": {"regex": "a(b"}}, 400, "regex does not compile"),
    (C, {"prompt": "x", "structured_outputs": {"grammar": "root ::= a"}}, 400, "Rule \"a\" is not defined"),
    (C, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "give exactly one of"),
    (C, {"prompt": "x", "structured_outputs": {"json": "{bad"}}, 400, "JSON schema is not valid JSON"),
    (C, {"prompt": "x", "structured_outputs": {"whitespace_pattern": " "}}, 400, "whitespace_pattern: unsupported"),
    (C, {"prompt": "x", "guided_choice": []}, 400, "choice must be a non-empty list"),
    (C, {"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}, 400,
     "only one of response_format, guided_regex"),
    (C, {"prompt": "x", "prompt_logprobs": 0, "stream": True}, 400, "prompt_logprobs are not available with stream"),
    (C, {"prompt": "x", "suffix": "end"}, 400, "suffix is not supported"),
    (
        C,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "only be defined when `stream=True`",
    ),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop strings must not be empty"),
    (C, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens: must be at most max_tokens (4)"),
    (C, {"prompt": "x", "stream": True, "stream_options": {"foo": 1}}, 400, "stream_options.foo: unsupported"),
    (CHAT, {"messages": [{"role": "tool", "content": "42"}]}, 400, "a tool message needs tool_call_id"),
    (CHAT, {"messages": MSG, "add_generation_prompt": False}, 400, "add_generation_prompt: unsupported"),
    (CHAT, {"messages": []}, 400, "messages must not be empty"),
    (CHAT, {"messages": MSG, "thinking_token_budget": 8}, 400, "thinking_token_budget: needs a reasoning model"),
    (CHAT, {"prompt": "x"}, 400, "messages: Field required"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "image_url"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools.0.function: Field required"),
    (CHAT, {"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "tool_choice: 'nope' is not one of the tools (get_weather)"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "no tools were given"),
    (CHAT, {"messages": MSG, "tools": [TOOL, TOOL]}, 400, "the name 'get_weather' is used twice"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}]}, 400,
     "tools[0] (f): parameters: JSON schema keyword 'uniqueItems' at #/properties/xs is not supported"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400,
     "tools.0.function.name"),
    (CHAT, {"messages": MSG, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     400, "response_format cannot be combined with tools"),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "get_weather", "arguments": "{not json"}}]}, *MSG]}, 400,
     "function.arguments is not JSON"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "only assistant messages carry tool_calls"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs requires logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -4}, 400, "max_tokens: must be at least 1, got -4"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, 400,
     "json_schema goes with type 'json_schema'"),
    (CHAT, {"messages": MSG, "functions": []}, 400, "functions: unsupported parameter"),
]


@pytest.fixture(scope="module")
def server(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with live_server(LLM(tiny_dir("smollm-tok"), batch_size=2, max_model_len=256), max_num_seqs=2) as (url, _):
        yield url
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "path,body,status,message", CASES, ids=[f"{i}-{c[3][:30]}" for i, c in enumerate(CASES)]
)
def test_bad_request(server, path, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"], err
    assert err["code"] == status and err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


# (path, body, the `param` the error must name). Messages may mention other parameters (min_tokens vs max_tokens);
# the param comes from the error itself, never from its wording.
PARAMS = [
    (C, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    (C, {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (C, {"prompt": LONG, "max_tokens": 5}, None),
    (C, {"prompt": "x", "temperature": -0.5}, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, "top_p"),
    (C, {"prompt": "x", "top_k": -3}, "top_k"),
    (C, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    (C, {"prompt": "x", "logprobs": 50}, "logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -4}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 100000}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 100000}, "max_tokens"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    (CHAT, {"messages": MSG, "min_tokens": -1}, "min_tokens"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "phone"}}}}, "response_format"),
    (C, {"prompt": "x", "guided_regex": "(("}, "guided_regex"),
    (C, {"prompt": "x", "guided_json": {"type": "strang"}}, "guided_json"),
    (C, {"prompt": "x", "structured_outputs": {"regex": "(("}}, "structured_outputs"),
    (CHAT, {"messages": MSG, "tools": [TOOL, TOOL]}, "tools"),
    (CHAT, {"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    (C, {"prompt": "x", "logit_bias": {"1": 200}}, "logit_bias"),
    (C, {"prompt": "x", "n": 99}, "n"),
    (C, {"prompt": "x", "top_p": float("inf")}, "top_p"),
]


@pytest.mark.parametrize("path,body,param", PARAMS, ids=[f"{i}-{c[2]}" for i, c in enumerate(PARAMS)])
def test_error_names_the_param_at_fault(server, path, body, param):
    r = httpx.post(server + path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_param_comes_from_the_error_not_its_message():
    """An error about one parameter whose message names another reports the one it was raised for."""
    from fastapi.testclient import TestClient

    from neuron_opt.errors import ConfigError
    from neuron_opt.server.app import create_app

    class Engine:  # raises, as SamplingParams would for a bad top_k whose message mentions max_tokens
        num_running = num_waiting = 0
        kv_usage = 0.0
        spec = None  # not speculating
        embeds = False  # a generation model's engine
        runner = type("Runner", (), {"vocab_size": 10})

        def check_admission(self, n=1): ...

        def add_request(self, *a, **k):
            raise ConfigError("top_k: must not exceed max_tokens here", param="top_k")

        def start(self): ...
        def stop(self): ...

    class Tok:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1, 2]}

        def __len__(self):
            return 10

    app = create_app(Engine(), Tok(), lambda m, tools: [1], "tiny", 64)
    with TestClient(app) as http:
        r = http.post(C, json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.json()


def test_wrong_route_and_method_are_openai_shaped(server):
    r = httpx.get(server + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    r = httpx.post(server + "/v1/audio/transcriptions", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_still_healthy_after_bad_requests(server):
    for path, body, *_ in CASES:  # again, back to back, then a normal request must still work
        httpx.post(server + path, content=body if isinstance(body, bytes) else json.dumps(body).encode())
    assert httpx.get(server + "/health").status_code == 200
    r = httpx.post(server + C, json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw(port: int, request: bytes) -> bytes:
    """Send `request` on a new connection; what the server answers before it closes the connection (or 30 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_serve_cli_connection_limits_and_sigterm_drain(tiny_dir):
    """`serve` as a process: its banner; uvicorn's connection bounds (connections at once, idle keep-alive, request
    head size); then SIGTERM during a stream: new requests and /health get 503 with Retry-After, the stream runs to
    its end, and the process exits 0."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("NEURON_OPT_NUM_THREADS", "NEURON_OPT_THREAD_POLICY")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "neuron_opt.cli", "serve", "--model", str(tiny_dir("smollm-tok")), "--port", str(port),
         "--max-num-seqs", "2", "--max-model-len", "1024", "--max-connections", "4", "--timeout-keep-alive", "1",
         "--shutdown-timeout", "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        banner = proc.stdout.readline() + proc.stdout.readline()
        assert f"curl {url}/v1/chat/completions" in banner, banner
        # NEURON_OPT_NUM_THREADS unset: the default policy's count (all: every core for every graph call)
        want = f"{len(os.sched_getaffinity(0))} torch thread(s), 'all' policy"
        assert want in banner, banner
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)

        # --max-connections 4: four idle connections held, the next request is refused
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        time.sleep(0.5)  # the server has accepted them
        assert httpx.get(url + "/health").status_code == 503
        for s in idle:
            s.close()
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline + 60
            time.sleep(0.1)
        # --timeout-keep-alive 1: an idle keep-alive connection is closed by the server (_raw returns at the close)
        answer = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1
        # a request head that grows past 16 KiB unfinished (a client trickling headers): 400, connection closed
        assert _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20_000).startswith(b"HTTP/1.1 400")

        events: list[tuple[float, str]] = []
        body = {
            "prompt": "drain me",
            "max_tokens": 120,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }

        def consume() -> None:
            with httpx.stream("POST", url + C, json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line:
                        events.append((time.monotonic(), line))

        t = threading.Thread(target=consume)
        t.start()
        while len(events) < 5:
            assert t.is_alive() and proc.poll() is None
            time.sleep(0.005)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while True:  # the signal is handled between two ticks of the server's loop
            refused = httpx.post(url + C, json={"prompt": "new", "max_tokens": 2}, timeout=30)
            if refused.status_code != 200:
                break
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "1"
        assert t.is_alive()  # the stream was still running when the new request was refused
        t.join(300)
        assert proc.wait(60) == 0
        assert events[-1][1] == "data: [DONE]"
        usage = json.loads(events[-2][1][len("data: ") :])["usage"]
        assert usage["completion_tokens"] == 120  # the in-flight request ran to completion
        assert sum(ts > signalled for ts, _ in events) > 10  # ... and was still streaming after the signal
    finally:
        if proc.poll() is None:
            proc.kill()
