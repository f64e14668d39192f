"""Faults of `neuron-opt serve --data-parallel 2`: a replica process killed, and a replica's engine thread dead
with its process alive, under a load of streaming and non-streaming requests (completions and chat), more than the
replicas take at once, and SIGTERM on the `serve` command. Also the newer single-process routes served through the
router (Anthropic's `/v1/messages*`, OpenAI's `/v1/responses`, `/tokenizer_info`), read with the official
`anthropic` and `openai` clients. Oracle: the single-sequence reference path (`LLM.generate_ids`) on the same
checkpoint in this process. Runs with `make test-cluster` (needs the `cluster` extra); the SIGTERM test ends the
module's cluster, so it runs last.
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
anthropic = pytest.importorskip("anthropic")
from cluster_helpers import (  # noqa: E402
    MODEL,
    PROMPTS,
    REPLICA,
    metrics,
    reference,
    replica_pids,
    serve_replicas,
    wait,
)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
N = 160  # tokens per request: long enough that streams are running when a replica is killed
BOUND_S = 240  # no request may take longer, kill and retries included
GREEDY = {"temperature": 0}  # the anthropic client takes the sampling fields as extra_body
LOAD = 12  # requests at once: the 2 replicas take 8 (2 x --max-num-seqs x 2), the rest wait at the router


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory):
    args = ["--model", str(ckpt), "--max-num-seqs", "2", "--max-model-len", "512", "--served-model-name", MODEL,
            "--enable-tokenizer-info-endpoint", "--shutdown-timeout", "120"]
    with serve_replicas(args, tmp_path_factory.mktemp("faults") / "serve.log") as (url, proc):
        yield url, proc


def _prompt(i: int) -> list[int]:
    return PROMPTS[i % len(PROMPTS)][:4] + [60 + i]


async def _request(client: httpx.AsyncClient, url: str, i: int, stream: bool, started: dict[int, str]) -> str:
    """One completion of `_prompt(i)`: "ok" (200, the reference's text), "failed" (a stream that began, then ended
    with an OpenAI-shaped 503 error event and [DONE], no finish reported before it); anything else fails the test.
    """
    body = {"model": MODEL, "prompt": _prompt(i), "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text  # the client saw nothing before the end: a dead replica is a retry
        return r.json()["choices"][0]["text"]
    events: list[str] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        started[i] = r.headers[REPLICA]
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    if "error" in chunks[-1]:
        err = chunks[-1]["error"]
        # the router's event for a replica process that died; the replica's own for its engine that died
        assert (err["code"] == 503 and "replica" in err["message"]) or (
            err["code"] == 500 and err["type"] == "InternalServerError"), err
        assert len(chunks) > 1, "a stream failed before its first output: it should have run elsewhere"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1]), "a finish before the error"
        return "failed"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(c["choices"][0]["text"] for c in chunks)


def test_the_router_serves_the_newer_routes(cluster, ckpt):
    from transformers import AutoTokenizer

    url, _ = cluster
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    chat = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say hello"}]
    oa = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    msg = client.messages.create(model=MODEL, messages=messages, max_tokens=8, extra_body=GREEDY)
    assert msg.content[0].text == oa.choices[0].message.content  # the same prompt, greedy: the same text
    with client.messages.stream(model=MODEL, messages=messages, max_tokens=8, extra_body=GREEDY) as s:
        assert "".join(s.text_stream) == oa.choices[0].message.content
    count = client.messages.count_tokens(model=MODEL, messages=messages)
    assert count.input_tokens == oa.usage.prompt_tokens
    resp = chat.responses.create(model=MODEL, input="Say hello", max_output_tokens=8, temperature=0)
    assert resp.output_text == oa.choices[0].message.content
    with pytest.raises(openai.NotFoundError):  # no store with --data-parallel: as one process without it
        chat.responses.retrieve(resp.id)
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["chat_template"] == AutoTokenizer.from_pretrained(ckpt).chat_template is not None
    # the router's own refusals in each API's shape: a bad Anthropic body is the replica's 400, reshaped
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, messages=[], max_tokens=8)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/messages", content=b"x" * (9 * 2**20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    # runtime LoRA loading is off, as in one process without --enable-lora-runtime-loading
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 404 and "--enable-lora-runtime-loading" in r.json()["error"]["message"], r.text


def test_a_killed_replica_loses_no_request_and_the_fleet_recovers(cluster, ref):
    url, proc = cluster
    expected = {i: reference(ref, _prompt(i), N) for i in range(LOAD)}
    retried = metrics(url)[("neuron_opt:cluster_retries_total", "")]
    started: dict[int, str] = {}

    async def scenario() -> tuple[list[str], list[str], float]:
        async with httpx.AsyncClient(timeout=BOUND_S) as client:
            t0 = time.monotonic()
            load = [asyncio.create_task(_request(client, url, i, i % 2 == 0, started)) for i in range(LOAD)]
            while len(set(started.values())) < 2 and not all(t.done() for t in load):
                await asyncio.sleep(0.005)
            pids = replica_pids()
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)  # as the OOM killer does
            # sent after the kill, while the replica is down: each one answered by the survivor or a retry
            after = await asyncio.wait_for(asyncio.gather(*(_request(client, url, i, i % 2 == 1, {})
                                                            for i in range(4))), BOUND_S)
            done, pending = await asyncio.wait(load, timeout=BOUND_S)
            assert not pending, f"{len(pending)} request(s) still unanswered {BOUND_S} s after the kill"
            return [t.result() for t in load], after, time.monotonic() - t0

    outcomes, after, took = asyncio.run(scenario())
    kinds = ["failed" if o == "failed" else "text" for o in outcomes]
    print("outcomes:", kinds, "took:", round(took, 1), "s; retries:",
          metrics(url)[("neuron_opt:cluster_retries_total", "")] - retried)
    assert after == [expected[i] for i in range(4)]
    for i, got in enumerate(outcomes):  # every request answered: the reference's text, or a clean stream error
        assert got == expected[i] or (got == "failed" and i % 2 == 0), (i, got)
    assert "failed" not in outcomes[1::2]  # non-streaming: never failed, retried
    assert any(o != "failed" for o in outcomes[0::2])  # the survivor's streams completed
    # Ray replaces the replica; within a bound both serve again
    wait(lambda: len(replica_pids()) == 2, 180, "the replica to be replaced")

    async def both() -> set[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            rs = await asyncio.gather(*(client.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": _prompt(i), "max_tokens": 4, "temperature": 0}) for i in range(8)))
        assert [r.status_code for r in rs] == [200] * 8
        return {r.headers[REPLICA] for r in rs}

    wait(lambda: len(asyncio.run(both())) == 2, 120, "both replicas to answer again", every=2.0)
    assert proc.poll() is None


# Run by a separate Python attached to the serve command's Ray instance: once it has connected it says "ready", and
# on a line from stdin it has one replica wait (in its own process: the tiny model's load is over within a second
# or two) until its engine has two requests in flight, then raise an exception the engine loop does not expect in
# the engine thread (as a bug or a device error in the loop would), the process living on; it prints the replica's
# pid and the engine's error (or that the replica exited before it could answer: it does so once its engine died).
KILL_ENGINE = """
import ctypes, os, sys, time
import ray

class InjectedFault(BaseException):
    pass

def kill_engine(actor):
    engine = actor._replica_impl._user_callable_wrapper.user_callable.engine
    end = time.monotonic() + 120
    while engine.num_unfinished < 2:
        if time.monotonic() > end:
            return None
        time.sleep(0.001)
    set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    assert set_exc(ctypes.c_ulong(engine._thread.ident), ctypes.py_object(InjectedFault)) == 1
    end = time.monotonic() + 30
    while engine.error is None and time.monotonic() < end:
        time.sleep(0.001)
    return repr(engine.error)

ray.init(address=sys.argv[1], log_to_driver=False)
name = min(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"])
replica = ray.get_actor(name, namespace="serve")
pid = ray.get(replica.__ray_call__.remote(lambda actor: os.getpid()))
print("ready", flush=True)
sys.stdin.readline()
try:
    error = ray.get(replica.__ray_call__.remote(kill_engine))
except ray.exceptions.ActorDiedError:  # the replica ended its process as soon as its engine died
    error = "the replica exited"
if error is not None:
    print("killed", pid, error, flush=True)
"""


def _line(proc, word: str) -> str:
    """The first line of `proc`'s output that begins with `word` ("" at its end)."""
    for line in proc.stdout:
        if line.startswith(word):
            return line.strip()
    return ""


def _ray_instance(serve_pid: int) -> tuple[str, dict[str, str]]:
    """The address of the Ray instance the `serve` command started (what its raylet, a child, was given) and the
    authentication settings of its processes (a new local Ray turns token authentication on for them)."""
    import psutil

    for child in psutil.Process(serve_pid).children(recursive=True):
        for arg in child.cmdline():
            if arg.startswith("--gcs-address="):
                return arg.split("=", 1)[1], {k: v for k, v in child.environ().items() if k.startswith("RAY_AUTH")}
    raise AssertionError("no Ray process under the serve command names its GCS address")


def test_a_replica_whose_engine_died_exits_and_loses_no_request(cluster, ref):
    """The engine thread of one replica dies under a load, its process alive: the replica ends its process so that
    Serve replaces it; requests that had made no output there (queued in its engine, or sent to it meanwhile) run
    on the other replica; a stream that had made output ends with an error event; nothing hangs."""
    import subprocess
    import sys

    url, _ = cluster
    expected = {i: reference(ref, _prompt(i), N) for i in range(LOAD)}
    started: dict[int, str] = {}
    before = set(replica_pids())

    address, auth = _ray_instance(cluster[1].pid)
    killer = subprocess.Popen([sys.executable, "-c", KILL_ENGINE, address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **auth})
    try:
        assert _line(killer, "ready")

        async def scenario() -> tuple[list[str], str]:
            killer.stdin.write("go\n")
            killer.stdin.flush()
            await asyncio.sleep(2)  # the replica is waiting for requests
            async with httpx.AsyncClient(timeout=BOUND_S) as client:
                load = [asyncio.create_task(_request(client, url, i, i % 2 == 0, started)) for i in range(LOAD)]
                killed = await asyncio.to_thread(_line, killer, "killed")
                done, pending = await asyncio.wait(load, timeout=BOUND_S)
                assert not pending, f"{len(pending)} request(s) still unanswered {BOUND_S} s after the engine died"
                return [t.result() for t in load], killed

        outcomes, killed = asyncio.run(scenario())
    finally:
        killer.kill()
        killer.wait()
    assert killed, "the replica never had two requests in flight"
    pid, error = killed.split(" ", 2)[1:]
    victim = int(pid)
    assert "InjectedFault" in error or error == "the replica exited", killed
    assert victim in before
    print("outcomes:", ["failed" if o == "failed" else "text" for o in outcomes])
    for i, got in enumerate(outcomes):  # every request answered: the reference's text, or a clean stream error
        assert got == expected[i] or (got == "failed" and i % 2 == 0), (i, got)
    assert "failed" not in outcomes[1::2]  # non-streaming: never failed, retried
    # the replica ended its own process (Serve replaces it), well before a health check would have failed it
    wait(lambda: victim not in replica_pids(), 30, "the replica with the dead engine to exit")
    wait(lambda: len(replica_pids()) == 2, 180, "the replica to be replaced")
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": _prompt(0), "max_tokens": N,
                                                  "temperature": 0, "ignore_eos": True}, timeout=BOUND_S)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[0], r.text


def test_sigterm_drains_then_exits_0(cluster, ref):
    """Last: it ends the module's cluster."""
    url, proc = cluster
    expected = {i: reference(ref, _prompt(i), N) for i in range(4)}
    started: dict[int, str] = {}

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(timeout=BOUND_S) as client:
            streams = [asyncio.create_task(_request(client, url, i, True, started)) for i in range(4)]
            while len(started) < 4:
                await asyncio.sleep(0.005)
            proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + 30
            while True:  # the command starts the drain as soon as its main thread sees the signal
                r = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": _prompt(0),
                                                                     "max_tokens": 2})
                if r.status_code == 503:
                    break
                assert r.status_code == 200 and time.monotonic() < end, r.text
            assert r.headers["Retry-After"] and "shutting down" in r.json()["error"]["message"]
            assert (await client.get(url + "/health")).status_code == 503
            assert (await client.get(url + "/metrics")).status_code == 200
            return await asyncio.wait_for(asyncio.gather(*streams), BOUND_S)

    got = asyncio.run(scenario())
    assert got == [expected[i] for i in range(4)]  # the streams in flight ran to their end
    assert proc.wait(120) == 0
