"""The official `openai` client against a live server (uvicorn in a thread, loopback, free port) on a tiny
random model with the real tokenizer. The oracle is the single-sequence reference path (`LLM.generate` /
`LLM.chat`) on a separate batch-1 model: greedy (and seeded) outputs through the server must be identical.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch
from helpers import live_server

from neuron_opt.api import LLM
from neuron_opt.runtime.sampling import SamplingParams

MODEL = "tiny"


@pytest.fixture(scope="module")
def llms(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: thread barriers cost more than they save
    path = tiny_dir("smollm-tok")
    yield LLM(path, batch_size=16, max_model_len=256), LLM(path, batch_size=1, max_model_len=256)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(llms):
    with live_server(llms[0], max_num_seqs=16) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


# What vLLM's Grafana dashboard and KEDA examples query (family names; histograms add _bucket/_sum/_count)
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:iteration_tokens_total": "histogram",
}


def test_models_health_metrics(server, client):
    """vLLM's metric names and types, labelled model_name; the per-request histograms agree with the counters, and
    a request's queue + inference time fits inside its end-to-end latency."""
    from prometheus_client.parser import text_string_to_metric_families

    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").status_code == 200
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="Metrics, please", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server[0] + "/metrics").text)}
    assert {n: fams[n].type for n in VLLM_METRICS if n in fams} == VLLM_METRICS
    for name in VLLM_METRICS:
        assert {s.labels["model_name"] for s in fams[name].samples} == {MODEL}, name
    assert "neuron_opt:request_rejected" in fams and "neuron_opt:prefix_cache_hit_rate" in fams

    def value(family: str, sample: str) -> float:
        return sum(s.value for s in fams[family].samples if s.name == sample)

    done = value("vllm:request_success", "vllm:request_success_total")
    assert done >= 2
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(f"vllm:request_{phase}_time_seconds", f"vllm:request_{phase}_time_seconds_count") == done
    assert value("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == value(
        "vllm:prompt_tokens", "vllm:prompt_tokens_total")
    assert value("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == value(
        "vllm:generation_tokens", "vllm:generation_tokens_total")
    queue, inference = (value(f"vllm:request_{p}_time_seconds", f"vllm:request_{p}_time_seconds_sum")
                        for p in ("queue", "inference"))
    assert 0 < queue + inference <= value("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    assert value("vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_sum") <= inference
    # the graph calls inside the engine's steps; this executor's outputs are host tensors, sampled on the host
    busy = value("neuron_opt:graph_busy_seconds", "neuron_opt:graph_busy_seconds_total")
    assert 0 < busy <= value("neuron_opt:engine_step_seconds", "neuron_opt:engine_step_seconds_total")
    assert 0 < value("neuron_opt:graph_busy_fraction", "neuron_opt:graph_busy_fraction") <= 1
    assert value("neuron_opt:device_to_host_bytes", "neuron_opt:device_to_host_bytes_total") == 0
    assert value("neuron_opt:device_sampled_tokens", "neuron_opt:device_sampled_tokens_total") == 0

    # a request's n and max_tokens, its longest sample, and the tokens of the engine steps that ran it
    before = fams
    client.completions.create(model=MODEL, prompt="Two samples", max_tokens=6, n=2, temperature=1.0, seed=1,
                              extra_body={"ignore_eos": True})
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server[0] + "/metrics").text)}

    def delta(family: str, sample: str) -> float:
        return value(family, sample) - sum(s.value for s in before[family].samples if s.name == sample)

    assert (delta("vllm:request_params_n", "vllm:request_params_n_count"),
            delta("vllm:request_params_n", "vllm:request_params_n_sum")) == (1, 2)
    assert delta("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 6
    assert (delta("vllm:request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens_count"),
            delta("vllm:request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens_sum")) == (1, 6)
    steps = delta("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count")
    assert steps >= 5 and delta("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") >= 2 * 5 + 1


def test_completion_greedy_matches_reference(llms, client):
    ref = llms[1].generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0.0))
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids),
        len(ref.token_ids),
    )
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    # token ids as the prompt give the same result
    r2 = client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == ref.text


def test_chat_greedy_matches_reference(llms, client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ref = llms[1].chat(msgs, SamplingParams(max_tokens=10, temperature=0.0))
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids),
        len(ref.token_ids),
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)


def test_stop_max_tokens_and_seed(llms, client):
    prompt = "Once upon a time"
    full = llms[1].generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    ref = llms[1].generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, stop=(stop,)))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == ref.text and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    # seeded sampling: reproducible, and the same draw as the reference path with that seed
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    ref = llms[1].generate(prompt, seeded)
    outs = [
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0.9, top_p=0.95, seed=1234
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert outs == [ref.text, ref.text]


def test_logprobs(llms, client):
    ref = llms[1].generate("Hello", SamplingParams(max_tokens=5, temperature=0.0, logprobs=2))
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert len(lp.top_logprobs) == len(ref.token_ids) and all(len(t) <= 2 for t in lp.top_logprobs)
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)


def test_streamed_logprobs_equal_the_non_streamed_ones(client):
    """Streaming splits the same logprobs over chunks: completions keep text offsets into the whole text, chat
    keeps one content entry per token."""
    kw = dict(model=MODEL, prompt="Hello there", max_tokens=8, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True) if c.choices]
    assert [t for c in chunks if c for t in c.tokens] == whole.tokens
    assert [o for c in chunks if c for o in c.text_offset] == whole.text_offset
    assert [v for c in chunks if c for v in c.token_logprobs] == pytest.approx(whole.token_logprobs, abs=1e-5)
    ckw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, logprobs=True,
               top_logprobs=2)
    whole_chat = client.chat.completions.create(**ckw).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(**ckw, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole_chat]


def test_32_concurrent_streams_each_get_their_own_continuation(llms, server):
    prompts = [f"Client {i}: " + "word " * (i % 7) + f"number {i * 37}" for i in range(32)]
    lengths = [4 + (i * 5) % 13 for i in range(32)]
    greedy = [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths]
    refs = [llms[1].generate(p, g) for p, g in zip(prompts, greedy, strict=True)]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompts[i],
            max_tokens=lengths[i],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for c in stream:
            text += "".join(ch.text for ch in c.choices)
            usage = c.usage or usage
        return text, usage.completion_tokens

    async def main() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert [t for t, _ in results] == [r.text for r in refs]
    assert [n for _, n in results] == [len(r.token_ids) for r in refs]
    assert server[1].num_unfinished == 0 and server[1].kv_usage == 0


def _sse(url: str, body: dict) -> list[dict]:
    """POST a streaming request; returns its `data:` events as JSON, checking the stream ends with [DONE]."""
    import json

    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# What guidellm 0.8 sends (guidellm/backends/openai/request_handlers.py, after it drops None values) for
# synthetic data with a fixed output length; vLLM benchmarking clients send the same vLLM extensions.
GUIDELLM_COMMON = {
    "model": MODEL,
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "ignore_eos": True,
}
GUIDELLM_CHAT = {
    **GUIDELLM_COMMON,
    "max_completion_tokens": 8,
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Once upon"}, {"type": "text", "text": " a time"}]},
    ],
}
GUIDELLM_COMPLETION = {**GUIDELLM_COMMON, "max_tokens": 8, "prompt": "Once upon a time"}


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", GUIDELLM_CHAT),
                                       ("/v1/completions", GUIDELLM_COMPLETION)], ids=["chat", "completions"])
def test_continuous_usage_stats_put_usage_in_every_chunk(server, path, body):
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries the usage so far; with include_usage
    the last chunk (no choices) has the total as well."""
    events = _sse(server[0] + path, body)
    assert all("usage" in e for e in events), events
    prompt = events[0]["usage"]["prompt_tokens"]
    done = [e["usage"]["completion_tokens"] for e in events]
    assert done == sorted(done) and done[-1] == 8  # ignore_eos: exactly max_(completion_)tokens
    assert all(e["usage"]["total_tokens"] == prompt + e["usage"]["completion_tokens"] for e in events)
    assert events[-1]["choices"] == [] and events[-2]["choices"][0]["finish_reason"] == "length"
    # without include_usage: usage in the chunks, but no usage-only last chunk
    opts = {"continuous_usage_stats": True}
    events = _sse(server[0] + path, {**body, "stream_options": opts})
    assert all(e["choices"] and "usage" in e for e in events)
    # without continuous_usage_stats: only the last chunk has usage (as before)
    events = _sse(server[0] + path, {**body, "stream_options": {"include_usage": True}})
    assert [("usage" in e) for e in events] == [False] * (len(events) - 1) + [True]


def test_vllm_extensions_are_honoured(llms, server):
    """`stop: null`, `min_tokens`, `ignore_eos`, `max_completion_tokens` and text-part message content, as
    vLLM-compatible clients send them, give the reference output."""
    url = server[0]
    ref = llms[1].chat([{"role": "user", "content": "Hi there"}],
                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, min_tokens=3))
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                     {"type": "text", "text": " there"}]}],
            "max_completion_tokens": 6, "temperature": 0, "stop": None, "ignore_eos": True, "min_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.text
    assert r.json()["usage"]["completion_tokens"] == 6
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5, "stop": None,
                                                  "ignore_eos": True, "min_tokens": 5}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text


class SlowRunner:
    """A real runner whose decode steps take at least 20 ms, so a long request is still running when its
    client leaves."""

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def decode(self, rows, candidates=None):
        time.sleep(0.02)
        return self._runner.decode(rows, candidates)


def test_client_disconnect_frees_slot(llms):
    llm = llms[0]
    with live_server(llm, max_num_seqs=1, runner=SlowRunner(llm.runner)) as (url, engine):
        body = {
            "model": MODEL,
            "prompt": "Tell me a long story",
            "max_tokens": 240,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }  # ~5 s of decoding if nobody cancels it
        with httpx.Client(timeout=10) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as resp:
                data_lines = 0
                for line in resp.iter_lines():  # SSE: events separated by blank lines; read 3 events
                    data_lines += line.startswith("data: {")
                    assert line != "data: [DONE]", "the stream ended before the client hung up"
                    if data_lines == 3:
                        break
            t0 = time.monotonic()  # the connection is closed here, mid-stream
            r = http.post(
                url + "/v1/completions",
                json={"model": MODEL, "prompt": "next", "max_tokens": 3, "temperature": 0},
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert time.monotonic() - t0 < 3.0  # it got the only slot long before the first one would finish
            assert http.get(url + "/health").status_code == 200
        # non-streaming: the client gives up (timeout closes the connection); the server notices within ~1 s
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
        t0 = time.monotonic()
        r = httpx.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": "next", "max_tokens": 3}, timeout=10
        )
        assert r.status_code == 200 and time.monotonic() - t0 < 3.0
        assert engine.num_unfinished == 0 and engine.kv_usage == 0


@pytest.mark.slow
def test_default_model_through_server_matches_generate_cli():
    """The real default model: greedy chat through the server (alone and with 3 other streams at once) equals
    `neuron-opt generate` and LLM.chat on a batch-1 model."""
    import json
    import subprocess
    import sys

    prompts = [
        "What is the capital of France?",
        "Name three colours.",
        "Count to five.",
        "Say hello in Spanish.",
    ]
    ref = LLM("default", batch_size=1, max_model_len=512)
    want = [
        ref.chat([{"role": "user", "content": p}], SamplingParams(max_tokens=24, temperature=0.0))
        for p in prompts
    ]
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_opt.cli",
            "generate",
            "--model",
            "default",
            "--chat",
            "--json",
            "--prompt",
            prompts[0],
            "--max-new-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(cli.stdout.strip().splitlines()[-1])["text"] == want[0].text
    with live_server(LLM("default", batch_size=4, max_model_len=512), max_num_seqs=4) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": prompts[0]}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == want[0].text

        async def together() -> list[str]:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as ac:
                rs = await asyncio.gather(
                    *(
                        ac.chat.completions.create(
                            model=MODEL,
                            messages=[{"role": "user", "content": p}],
                            max_tokens=24,
                            temperature=0,
                        )
                        for p in prompts
                    )
                )
            return [x.choices[0].message.content for x in rs]

        assert asyncio.run(together()) == [w.text for w in want]
