"""Abuse of the HTTP server, each attack against a live server (tiny random model, real tokenizer, loopback): bodies
past the size limit (413, with and without Content-Length), prompts far past the context (400 before tokenizing,
while other clients are served), stop-string and stop-id floods, non-finite numbers in every float field, bursts
past the queue (only 200 and 503 with Retry-After), API docs off by default, 500s that name only a request id,
and refusals counted on /metrics. The slow soak at the end mixes all of it with valid traffic."""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
import typing
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from helpers import live_server, one_thread_llm

from neuron_opt.api import LLM
from neuron_opt.cli import main
from neuron_opt.runtime.runner import RunnerStats
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.server.limits import ServerLimits
from neuron_opt.server.protocol import ChatCompletionRequest, CompletionRequest

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
MB = 2**20
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with one_thread_llm(tiny_dir("smollm-tok"), 2, 256) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with live_server(llm, max_num_seqs=2) as (url, engine):
        yield url, engine


def post(url: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=content, headers=JSON, timeout=60, **kw)


def rejected(url: str) -> dict[str, float]:
    """neuron_opt:request_rejected_total by reason."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("neuron_opt:request_rejected_total{"):
            out[line.split('reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


# ---- body size ---------------------------------------------------------------------------------------------


def test_a_body_past_the_limit_is_413_with_or_without_content_length(server):
    url, _ = server
    before = rejected(url)["body_too_large"]
    body = json.dumps({"prompt": "x" * (20 * MB)}).encode()
    r = post(url + C, body)
    assert r.status_code == 413, r.text
    assert r.json()["error"] == {"message": "the request body is larger than this server takes (8388608 bytes)",
                                 "type": "RequestTooLargeError", "param": None, "code": 413}

    def chunks() -> typing.Iterator[bytes]:  # no Content-Length: chunked transfer, counted while read
        for i in range(0, len(body), MB):
            yield body[i:i + MB]

    r = httpx.post(url + C, content=chunks(), headers=JSON, timeout=60)
    assert r.request.headers["transfer-encoding"] == "chunked" and "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    r = httpx.post(url + "/tokenize", content=chunks(), headers=JSON, timeout=60)
    assert r.status_code == 413, r.text
    assert rejected(url)["body_too_large"] == before + 3
    assert post(url + C, {"prompt": "hello", "max_tokens": 2}).status_code == 200  # and it keeps serving


def test_a_body_within_the_limit_is_read_whole_when_chunked(server):
    url, _ = server
    body = json.dumps({"prompt": "hello", "max_tokens": 2, "user": "u" * MB}).encode()
    r = httpx.post(url + C, content=(body[i:i + 4096] for i in range(0, len(body), 4096)), headers=JSON)
    assert r.status_code == 200, r.text


# ---- prompt size -------------------------------------------------------------------------------------------

HUGE = "hello world " * (4 * MB // 12)  # 4 MB of text: seconds of tokenizing


def test_a_huge_prompt_is_refused_before_tokenizing_while_others_are_served(server):
    """Prompts, messages and id lists far past the limits are 400 within their parse, and meanwhile another client's
    /health and completions are answered within a second each."""
    url, _ = server
    latencies: list[float] = []
    stop = threading.Event()

    def other_client() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                for send in (lambda: http.get(url + "/health"),
                             lambda: http.post(url + C, json={"prompt": "hi", "max_tokens": 2})):
                    t = time.monotonic()
                    assert send().status_code == 200
                    latencies.append(time.monotonic() - t)

    t = threading.Thread(target=other_client)
    t.start()
    try:
        cases = [(C, {"prompt": HUGE}, "prompt"), (C, {"prompt": [HUGE]}, "prompt"),
                 (C, {"prompt": list(range(10)) * 10_000}, "prompt"),
                 (CHAT, {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
                 (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": HUGE}]}]}, "messages"),
                 ("/tokenize", {"prompt": HUGE}, "prompt"), ("/tokenize", {"messages": [
                     {"role": "user", "content": HUGE}]}, "messages"),
                 ("/detokenize", {"tokens": [1] * 100_000}, "tokens")]
        for path, body, param in cases:
            start = time.monotonic()
            r = post(url + path, body)
            took = time.monotonic() - start
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
            assert "this server's limit" in r.json()["error"]["message"]
            assert took < 2.0, (path, took)  # its parse, no tokenizing (which takes seconds)
    finally:
        stop.set()
        t.join(60)
    assert latencies and max(latencies) < 1.0, sorted(latencies)[-5:]


def test_the_prompt_limit_follows_max_model_len_or_the_flag(llm):
    assert ServerLimits().prompt_chars(256) == 32 * 256 and ServerLimits(max_prompt_chars=10).prompt_chars(256) == 10
    with live_server(llm, max_num_seqs=1, limits=ServerLimits(max_prompt_chars=10)) as (url, _):
        r = post(url + C, {"prompt": "x" * 11})
        assert r.status_code == 400 and "prompt: at most 10 characters" in r.json()["error"]["message"]
        assert post(url + C, {"prompt": "x" * 10, "max_tokens": 1}).status_code == 200


# ---- stop floods, schema sizes, counts ---------------------------------------------------------------------

# (path, body, param, message)
FLOODS = [
    (C, {"prompt": "x", "stop": [f"s{i}" for i in range(1000)]}, "stop", "stop: at most 16 stop strings"),
    (C, {"prompt": "x", "stop": ["y" * 1000] * 1000}, "stop", "stop: at most 16 stop strings"),
    (C, {"prompt": "x", "stop": "y" * 257}, "stop", "stop: at most 256 characters in a stop string"),
    (CHAT, {"messages": MSG, "stop": ["a", "b" * 1000]}, "stop", "at most 256 characters in a stop string"),
    (C, {"prompt": "x", "stop_token_ids": [1] * 257}, "stop_token_ids", "stop_token_ids: at most 256 token ids"),
    (C, {"prompt": "x", "stop_token_ids": [1] * 1_000_000}, "stop_token_ids", "at most 256 token ids"),
    (C, {"prompt": "x", "stop_token_ids": [10**30]}, "stop_token_ids", "token ids must be in [0, vocab size)"),
    (CHAT, {"messages": MSG, "stop_token_ids": [-1]}, "stop_token_ids", "token ids must be in [0, vocab size)"),
    (C, {"prompt": "x", "guided_choice": ["a" * 1000] * 300}, "guided_choice", "at most 262144 bytes as JSON"),
    (C, {"prompt": "x", "guided_regex": "a" * (300 * 1024)}, "guided_regex", "at most 262144 bytes as JSON"),
    (C, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "d" * (300 * 1024)}}}}, "response_format", "bytes as JSON"),
    (C, {"prompt": "x", "structured_outputs": {"grammar": "g" * (300 * 1024)}}, "structured_outputs",
     "bytes as JSON"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 4000}}
                                       for i in range(100)]}, "tools", "tools: at most 262144 bytes as JSON"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools", "tools: at most 128 tools"),
    (CHAT, {"messages": MSG * 1025}, "messages", "messages: at most 1024 messages"),
    (C, {"prompt": "x", "logit_bias": {"1" * 5000: 1}}, "logit_bias", "is not a token id"),
    (C, {"prompt": "x", "logit_bias": {"²": 1}}, "logit_bias", "is not a token id"),
]


@pytest.mark.parametrize("path,body,param,message", FLOODS, ids=[f"{i}-{c[2]}" for i, c in enumerate(FLOODS)])
def test_floods_are_400_naming_the_field(server, path, body, param, message):
    r = post(server[0] + path, body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_limits_are_flags_checked_before_anything_loads(capsys):
    assert main(["serve", "--model", "default", "--max-stop-strings", "0"]) == 2
    assert "max_stop_strings: must be >= 1, got 0" in capsys.readouterr().err


# ---- non-finite numbers ------------------------------------------------------------------------------------


def float_fields(model: type) -> list[str]:
    """Every field of a request type whose value is, or holds, a float."""
    return sorted(name for name, f in model.model_fields.items() if "float" in str(f.annotation))


NON_FINITE = (math.nan, math.inf, -math.inf)


@pytest.mark.parametrize("path,model,base", [(C, CompletionRequest, {"prompt": "x"}),
                                             (CHAT, ChatCompletionRequest, {"messages": MSG})])
def test_nan_and_inf_in_every_float_field_are_400(server, path, model, base):
    fields = float_fields(model)
    assert set(fields) >= {"temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias"}, fields
    for name in fields:
        for x in NON_FINITE:
            value = {"5": x} if name == "logit_bias" else x
            r = post(server[0] + path, {**base, name: value})  # json.dumps writes NaN / Infinity, pydantic reads them
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, x, r.text)
            assert "finite" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path,body,param", [
    (C, {"prompt": "x", "guided_json": {"type": "number", "minimum": math.nan}}, "guided_json"),
    (C, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "number", "maximum": math.inf}}}}, "response_format"),
    (C, {"prompt": "x", "structured_outputs": {"json": {"type": "integer", "minimum": -math.inf}}},
     "structured_outputs"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "number", "maximum": math.nan}}}}}]}, "tools"),
])
def test_non_finite_numbers_inside_schemas_and_tools_are_400(server, path, body, param):
    r = post(server[0] + path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "numbers must be finite" in r.json()["error"]["message"]


# ---- backpressure ------------------------------------------------------------------------------------------


def test_a_burst_past_the_queue_is_only_200_and_503_with_retry_after(llm):
    with live_server(llm, max_num_seqs=1, max_waiting=2) as (url, engine):
        body = {"prompt": "tell me a story", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(20) as pool:
            responses = list(pool.map(lambda _: post(url + C, body), range(20)))
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 503} and 200 in statuses and 503 in statuses, statuses
        for r in responses:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "ServiceUnavailableError" and "retry later" in r.text
            else:
                assert r.json()["usage"]["completion_tokens"] == 8
        assert rejected(url)["queue_full"] == statuses.count(503)
        assert post(url + C, body).status_code == 200 and httpx.get(url + "/health").status_code == 200
        assert engine.num_unfinished == 0


# ---- docs, 500s, metrics -----------------------------------------------------------------------------------


def test_api_docs_are_off_unless_enabled(server, llm):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server[0] + path).status_code == 404
    with live_server(llm, max_num_seqs=1, enable_docs=True) as (url, _):
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(url + path).status_code == 200


class FakeEngine:
    """add_request raises `error`, or (error None) the request fails on the engine with a secret in its message."""

    num_running = num_waiting = 0
    kv_usage = 0.0
    spec = None
    embeds = False  # a generation model's engine
    runner = SimpleNamespace(vocab_size=10, stats=RunnerStats())
    prefix_cache_stats = SimpleNamespace(queries=0, hits=0, hit_rate=0.0)
    stats = SimpleNamespace(preemptions=0, step_tokens={}, step_s=0.0)

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def add_request(self, rid, ids, params, on_output, **kw):
        from neuron_opt.runtime.engine import RequestOutput

        if self.error is not None:
            raise self.error
        on_output(RequestOutput(rid, (), "", len(ids), 0, True, "error", error="decode failed: SECRET /srv/x.so"))

    def check_admission(self, n=1): ...
    def abort(self, rid): ...
    def start(self): ...
    def stop(self): ...


class Tok:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1, 2]}

    def __len__(self):
        return 10


def fake_app(engine: FakeEngine, **kw):
    from fastapi.testclient import TestClient

    from neuron_opt.server.app import create_app

    return TestClient(create_app(engine, Tok(), lambda m, tools: [1], "tiny", 64, **kw), raise_server_exceptions=False)


@pytest.mark.parametrize("error", [RuntimeError("SECRET /srv/x.so"), None])
def test_a_500_says_only_a_request_id_and_logs_the_details(error, caplog):
    with caplog.at_level(logging.ERROR), fake_app(FakeEngine(error)) as http:
        r = http.post(C, json={"prompt": "x"})
        chunks = http.post(C, json={"prompt": "x", "stream": True}).text if error is None else ""
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "SECRET" not in r.text and message.startswith("Internal server error (request id ")
    error_id = message.split("request id ")[1].split(")")[0]
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and "SECRET" in logged[0].getMessage(), caplog.text
    if error is None:  # a stream that fails after it started: its error event is as generic
        assert "SECRET" not in chunks and "Internal server error (request id " in chunks, chunks


def test_refusals_are_counted_by_reason():
    with fake_app(FakeEngine(), api_key="k", limits=ServerLimits(max_body_bytes=100)) as http:
        auth = {"Authorization": "Bearer k"}
        assert http.post(C, json={"prompt": "x"}).status_code == 401
        assert http.post(C, json={"prompt": "x", "n": 0}, headers=auth).status_code == 400
        assert http.post(C, json={"prompt": "x" * 200}, headers=auth).status_code == 413
        assert http.post(C, json={"prompt": "x", "model": "gpt"}, headers=auth).status_code == 404
        text = http.get("/metrics").text
    for reason, n in (("unauthorized", 1), ("bad_request", 1), ("body_too_large", 1), ("not_found", 1),
                      ("queue_full", 0)):
        assert f'neuron_opt:request_rejected_total{{model_name="tiny",reason="{reason}"}} {n}.0' in text, text


# ---- soak (make test-slow) ---------------------------------------------------------------------------------

SOAK_S = 40.0


def attack(url: str, rng: random.Random) -> int:
    """One malicious request; returns its status."""
    kind = rng.randrange(8)
    if kind == 0:
        return post(url + C, json.dumps({"prompt": "x" * (9 * MB)}).encode()).status_code
    if kind == 1:
        return httpx.post(url + C, content=(b"x" * MB for _ in range(10)), headers=JSON, timeout=60).status_code
    if kind == 2:
        return post(url + C, {"prompt": "hello " * 500_000}).status_code
    if kind == 3:
        return post(url + C, {"prompt": "x", "stop": ["y" * 1000] * 1000}).status_code
    if kind == 4:
        return post(url + C, {"prompt": "x", "temperature": math.nan}).status_code
    if kind == 5:
        return post(url + C, b'{"prompt": ').status_code
    if kind == 6:
        return post(url + CHAT, {"messages": MSG * 2000}).status_code
    with httpx.stream("POST", url + C, json={"prompt": "go", "max_tokens": 200, "stream": True, "ignore_eos": True},
                      timeout=60) as r:  # a client that leaves mid-stream
        for _ in r.iter_lines():
            break
        return r.status_code


@pytest.mark.slow
def test_soak_mixed_valid_and_malicious_traffic(tiny_dir):
    """For SOAK_S seconds, 4 clients send valid greedy requests (retrying after a 503's Retry-After) and 4 send
    attacks. Every valid request ends with its reference output computed alone (nothing lost or crossed); every
    attack gets its 4xx/503 (or its stream); the server is healthy, idle and serving at the end."""
    path = tiny_dir("smollm-tok")
    llm, ref = LLM(path, batch_size=2, max_model_len=256), LLM(path, batch_size=1, max_model_len=256)
    prompts = [f"Request {i}: the weather in city number {i} is" for i in range(12)]
    want = {p: ref.generate(p, SamplingParams(max_tokens=12, temperature=0.0)).text for p in prompts}
    with live_server(llm, max_num_seqs=2, max_waiting=4) as (url, engine):
        deadline = time.monotonic() + SOAK_S
        served: list[tuple[str, str]] = []
        attack_statuses: list[int] = []

        def valid(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(timeout=120) as http:
                while time.monotonic() < deadline:
                    p = rng.choice(prompts)
                    r = http.post(url + C, json={"prompt": p, "max_tokens": 12, "temperature": 0})
                    while r.status_code == 503:
                        time.sleep(float(r.headers["retry-after"]))
                        r = http.post(url + C, json={"prompt": p, "max_tokens": 12, "temperature": 0})
                    assert r.status_code == 200, r.text
                    served.append((p, r.json()["choices"][0]["text"]))

        def malicious(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                attack_statuses.append(attack(url, rng))

        with ThreadPoolExecutor(8) as pool:
            for f in [pool.submit(valid, i) for i in range(4)] + [pool.submit(malicious, 100 + i) for i in range(4)]:
                f.result()
        print(f"valid requests served: {len(served)}; attacks by status: {Counter(attack_statuses)}")
        assert len(served) > 20 and all(text == want[p] for p, text in served)
        assert set(attack_statuses) <= {200, 400, 413, 503}, sorted(set(attack_statuses))
        assert httpx.get(url + "/health").status_code == 200
        for _ in range(100):  # the streams left mid-way are aborted at the engine's next step
            if engine.num_unfinished == 0:
                break
            time.sleep(0.1)
        assert engine.num_unfinished == 0 and engine.kv_usage == 0
        r = post(url + C, {"prompt": prompts[0], "max_tokens": 12, "temperature": 0})
        assert r.json()["choices"][0]["text"] == want[prompts[0]]
