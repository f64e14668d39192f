"""`neuron-opt serve --data-parallel 2 --api-key KEY`: a real local Ray (started by the command) with 2 replicas of a
tiny model on this machine's cores, driven by the official `openai` client. Oracle: the single-sequence reference path
(`LLM.generate`) on the same checkpoint in this process. Runs with `make test-cluster` (needs the `cluster` extra).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

pytest.importorskip("ray", reason="Ray Serve is the `cluster` extra: pip install 'neuron-opt[cluster]'")
from cluster_helpers import (
    MODEL,
    PROMPTS,
    REPLICA,
    metrics,
    reference,
    replica_pids,
    replicas,
    serve_replicas,
    wait,
)

from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.server.cluster.board import STALE_AFTER_S

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
KEY = "sk-cluster"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory):
    args = ["--model", str(ckpt), "--max-num-seqs", "4", "--max-model-len", "1024", "--served-model-name", MODEL,
            "--api-key", KEY]
    with serve_replicas(args, tmp_path_factory.mktemp("cluster") / "serve.log") as (url, proc):
        yield url, proc


async def _complete(url: str, prompt: list[int], n: int) -> tuple[str, str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    return raw.parse().choices[0].text, raw.headers[REPLICA]


def test_greedy_answers_from_both_replicas(cluster, ref):
    url, _ = cluster

    async def all_at_once() -> list[tuple[str, str]]:
        return await asyncio.gather(*(_complete(url, p, 16) for p in PROMPTS))

    got = asyncio.run(all_at_once())
    assert [text for text, _ in got] == [reference(ref, p, 16) for p in PROMPTS]
    seen = {replica for _, replica in got}

    def both_answered() -> bool:
        # 8 at once spread over both replicas once the router's replica set holds both: that set follows the
        # controller by long poll, so just after start-up it may still list one replica
        seen.update(replica for _, replica in asyncio.run(all_at_once()))
        return len(seen) == 2

    if len(seen) < 2:
        wait(both_answered, 60, "answers from both replicas", every=1.0)
    # replicas push their metrics each PUSH_PERIOD_S (1 s): the merged counts catch up, they are not there at once
    wait(lambda: (v := replicas(url, "vllm:request_success_total")) and len(v) == 2
         and all(x > 0 for x in v.values()) and sum(v.values()) >= len(PROMPTS), 15,
         f"both replicas' request counts in /metrics, {len(PROMPTS)} in all")

    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    cards = client.models.list().data
    assert [m.id for m in cards] == [MODEL] and cards[0].model_extra["input_modalities"] == ["text"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == ref.chat(msgs, SamplingParams(max_tokens=8, temperature=0.0)).text


def test_streaming_through_the_router(cluster, ref):
    url, _ = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference(ref, PROMPTS[0], 12)
    assert chunks[-1].usage.completion_tokens == 12


def test_errors_are_openai_shaped(cluster):
    url, _ = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    r = httpx.get(url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(url + "/health").status_code == 200


def test_the_router_checks_the_api_key_and_forwards_the_agent_api(cluster):
    url, _ = cluster
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
                 "/detokenize"):
        r = httpx.post(url + path, json={}) if path != "/v1/models" else httpx.get(url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", path
    assert httpx.get(url + "/health").status_code == 200
    # a generation model's replicas answer /v1/embeddings as one process does: a 400 naming `model`
    r = httpx.post(url + "/v1/embeddings", json={"model": MODEL, "input": "Hello"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    tok = httpx.post(url + "/tokenize", json={"prompt": "Hello"}, headers=AUTH).json()
    assert httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH).json()["prompt"] == "Hello"
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       max_tokens=40, n=2, extra_body={"guided_choice": ["yes", "no"]})
    assert [c.message.content in ("yes", "no") for c in r.choices] == [True, True]


def test_client_disconnect_frees_the_slot_on_its_replica(cluster):
    """A long stream (1000 tokens: seconds on the tiny model, against the replicas' 1 s metrics push; 200 tokens
    once finished between two pushes in CI) is seen running, the client leaves, and the request leaves its replica
    without finishing: no finish reason is counted for it (an aborted request is not a finished one)."""
    url, _ = cluster
    finished = "vllm:request_success_total"

    def settled() -> float:  # the finished count once a push brings nothing new (earlier tests' last requests)
        now = sum(replicas(url, finished).values())
        while True:
            time.sleep(1.5)
            now, last = sum(replicas(url, finished).values()), now
            if now == last:
                return now

    before = settled()
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60, headers=AUTH) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        assert wait(lambda: sum(replicas(url).values()) == 1, 10, "the stream running on a replica")
    # the client is gone: the replica's engine must drop the request well before its 1000 tokens are done
    wait(lambda: sum(replicas(url).values()) == 0 or None, 15, "the aborted request to leave its replica")
    assert settled() == before


def test_a_killed_replica_is_restarted_and_nothing_hangs(cluster, ref):
    url, proc = cluster
    n = 220  # long enough that the streams are still running when one replica is killed
    expected = {i: reference(ref, p, n) for i, p in enumerate(PROMPTS)}
    started: dict[int, str] = {}

    async def stream(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": n, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text, done = "", False
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            started[i] = r.headers[REPLICA]
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # the replica died mid-stream: an OpenAI-shaped error event, then [DONE]
                    assert event["error"]["code"] == 503 and "replica" in event["error"]["message"], event
                    text = None
                else:
                    text += event["choices"][0]["text"]
        assert done, "stream ended without [DONE]"
        if text is None:
            return "failed"
        assert text == expected[i]
        return "ok"

    async def whole(client: httpx.AsyncClient, i: int) -> str:
        """Non-streaming: the client sees nothing until the end, so a request whose replica dies is re-sent."""
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": n, "temperature": 0, "ignore_eos": True}
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[i]
        return "ok"

    async def scenario() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:  # streaming and non-streaming, in pairs
            before = [asyncio.create_task((stream if i % 4 < 2 else whole)(client, i)) for i in range(len(PROMPTS))]
            while len(set(started.values())) < 2 and not all(t.done() for t in before):
                await asyncio.sleep(0.005)
            pids = replica_pids()
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)
            started.clear()
            after = [await stream(client, i) for i in range(4)]  # sent after the kill, one by one: none may fail
            return await asyncio.wait_for(asyncio.gather(*before), 300), after

    before, after = asyncio.run(scenario())
    print("outcomes:", before, "retries:", metrics(url)[("neuron_opt:cluster_retries_total", "")])
    assert after == ["ok"] * 4
    assert set(before) <= {"ok", "failed"} and "ok" in before, before  # the survivor's streams completed
    assert [before[i] for i in range(len(PROMPTS)) if i % 4 >= 2] == ["ok"] * 4  # non-streaming: retried
    # Ray restarts the replica; both serve again. The new replica pushes its metrics from its constructor, before
    # Serve marks it running and the router's handle learns of it (and the killed one's entry lasts STALE_AFTER_S),
    # so the wait is on what a client sees: 8 concurrent requests, all answered right, by both replicas
    wait(lambda: len(replica_pids()) == 2, 180, "the replica to be restarted")
    want = [reference(ref, p, 8) for p in PROMPTS]

    async def again() -> list[tuple[str, str]]:
        return await asyncio.gather(*(_complete(url, p, 8) for p in PROMPTS))

    def both_answer() -> bool:
        got = asyncio.run(again())
        assert [t for t, _ in got] == want
        return len({r for _, r in got}) == 2

    wait(both_answer, 120, "both replicas to answer again", every=2.0)
    # the killed replica's last push ages out of the merged /metrics STALE_AFTER_S after it died; a fast restart can
    # have both replicas answering before then, so this waits for it rather than reading once
    wait(lambda: len(replicas(url)) == 2, STALE_AFTER_S + 10, "the killed replica's metrics to age out")
    assert proc.poll() is None
    assert metrics(url)[("neuron_opt:cluster_failed_streams_total", "")] == before.count("failed")
