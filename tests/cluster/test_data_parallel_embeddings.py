"""`neuron-opt serve --data-parallel 2` on an embedding model: the router forwards `/v1/embeddings` to the replicas
(by load: an embedding request has no prefix to route by), and the official `openai` client gets
sentence-transformers' vectors (the oracle) from both replicas; a text route is a 400 naming `model`, as in one
process. A real local Ray started by the command. Runs with `make test-cluster` (needs the `cluster` extra)."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytest.importorskip("ray", reason="Ray Serve is the `cluster` extra: pip install 'neuron-opt[cluster]'")
pytest.importorskip("sentence_transformers")
from cluster_helpers import MODEL, REPLICA, serve_replicas, wait
from st_models import TEXTS, assert_same, make_st_model, reference

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    return make_st_model(tmp_path_factory.mktemp("st"), "qwen3", "lasttoken", True)


@pytest.fixture(scope="module")
def cluster(st_model, tmp_path_factory):
    args = ["--model", str(st_model[0]), "--max-num-seqs", "4", "--max-model-len", "256", "--served-model-name", MODEL]
    with serve_replicas(args, tmp_path_factory.mktemp("cluster") / "serve.log") as (url, _):
        yield url


async def _embed(url: str, texts: list[str]) -> tuple[list[list[float]], str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    raw = await client.embeddings.with_raw_response.create(model=MODEL, input=texts)
    return [e.embedding for e in raw.parse().data], raw.headers[REPLICA]


def test_embeddings_through_the_router_equal_sentence_transformers(cluster, st_model):
    url = cluster
    want = reference(st_model[1], TEXTS)
    # 4 requests of 2 inputs at once: 8 engine requests, within what one replica's engine admits (4 running, 8
    # waiting) should all of them meet the same replica
    picks = [[i % len(TEXTS), (i + 2) % len(TEXTS)] for i in range(4)]
    seen: set[str] = set()

    def round_() -> bool:
        async def all_at_once():
            return await asyncio.gather(*(_embed(url, [TEXTS[j] for j in p]) for p in picks))

        for p, (vectors, replica) in zip(picks, asyncio.run(all_at_once()), strict=True):
            assert_same(vectors, want[p])
            seen.add(replica)
        return len(seen) == 2

    if not round_():  # the router's replica set follows the controller by long poll: both once it holds both
        wait(round_, 60, "answers from both replicas", every=1.0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert_same([one.data[0].embedding], want[:1])
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model" and "embedding model" in e.value.body["message"]
