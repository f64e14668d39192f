"""The data-parallel router's own limits: a burst past its bound (the replica's share + --max-waiting) is answered
only 200 and 503 with Retry-After, bodies past --max-body-bytes are 413 (chunked too), its refusals are counted,
and it serves no API docs. One replica of a tiny model on a local Ray started by the command. Runs with
`make test-cluster` (needs the `cluster` extra)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray", reason="Ray Serve is the `cluster` extra: pip install 'neuron-opt[cluster]'")
from cluster_helpers import MODEL, PROMPTS, free_port, metrics, replicas, stop_serve, wait

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def router(ckpt, tmp_path_factory):
    """One replica taking 2 x 1 requests, 2 more waiting at the router: at most 4 in flight."""
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "serve.log"
    cmd = [sys.executable, "-m", "neuron_opt.cli", "serve", "--model", str(ckpt), "--data-parallel", "1",
           "--port", str(port), "--max-num-seqs", "1", "--max-waiting", "2", "--max-model-len", "1024",
           "--served-model-name", MODEL, "--max-body-bytes", "100000"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: proc.poll() is not None or len(replicas(url)) == 1, 240, "the replica up")
        assert proc.poll() is None, log.read_text()[-3000:]
        yield url
    finally:
        stop_serve(proc)


def rejected(url: str) -> dict[str, float]:
    """neuron_opt:cluster_rejected_total by reason."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
            for s in fam.samples if s.name == "neuron_opt:cluster_rejected_total"}


def test_a_burst_past_the_router_bound_is_only_200_and_503(router):
    url = router
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=120), range(16)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 4 and 503 in statuses, statuses
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert rejected(url)["queue_full"] == statuses.count(503)
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)  # the slots came back
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64
    stream = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=120)
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    wait(lambda: sum(replicas(url).values()) == 0 or None, 15, "the replica idle")


def test_bodies_past_the_limit_are_413_and_docs_are_off(router):
    url = router
    big = json.dumps({"model": MODEL, "prompt": "x" * 200_000}).encode()
    before = rejected(url)["body_too_large"]
    r = httpx.post(url + "/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
    r = httpx.post(url + "/v1/completions", content=(big[i:i + 10_000] for i in range(0, len(big), 10_000)),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert rejected(url)["body_too_large"] == before + 2
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(url + path).status_code == 404
    assert metrics(url)  # and it still serves


def test_a_full_router_refuses_before_reading_the_body(router):
    """The slot is checked before the body is read (nor parsed, nor tokenized): with the 4 slots held by streams
    (the engine runs one at a time, so they hold them for seconds), a body past --max-body-bytes is the 503 of a
    full router, not the 413 that reading it would give."""
    url = router
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    big = b"{" + b" " * 200_000 + b"}"
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=120) for _ in range(4)]
        wait(lambda: sum(replicas(url, "vllm:num_requests_running").values()) >= 1 or None, 30, "a stream running")
        time.sleep(1.0)  # the other three, sent with it, have reached the router
        full = httpx.post(url + "/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert [f.result().status_code for f in streams] == [200] * 4
    assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
    again = httpx.post(url + "/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert again.status_code == 413, again.text  # the same body once a slot is free
