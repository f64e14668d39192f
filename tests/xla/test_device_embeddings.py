"""Embedding models (`compile --task embed`) on the neuron backend's device path (torch-xla's CPU device; tests/xla):
prefill-only bucket graphs ending in the pooling step, against sentence-transformers (the oracle) on mixed-length
inputs run 3 to a graph call: last-token, masked mean and CLS pooling, with and without L2 normalisation, at tp 1
and as one SPMD program at tp 2; Matryoshka `dimensions` through `/v1/embeddings` with the `openai` client."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from device_embed import compile_embed, embed
from st_models import TEXTS, assert_same, make_st_model, reference
from test_device_path import HERE

from neuron_opt.artifact import read_manifest
from neuron_opt.backends.neuron.backend import hlo_summary

pytestmark = pytest.mark.xla
pytest.importorskip("sentence_transformers")

# (family, sentence-transformers pooling mode, Normalize module)
MODELS = {"qwen3-last": ("qwen3", "lasttoken", True), "llama-mean": ("llama", "mean", False),
          "llama-cls": ("llama", "cls", True)}


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            made[name] = make_st_model(tmp_path_factory.mktemp(name), *MODELS[name], seed=len(made))
        return made[name]

    return get


def _check_buckets(buckets: list[str]) -> None:
    """The 5 inputs ran in fewer graph calls than inputs, every call a prefill graph of 3 rows (mixed lengths,
    padded to the call's bucket)."""
    assert 0 < len(buckets) < len(TEXTS) and all(b.startswith("prefill_b3_s") for b in buckets), buckets


@pytest.mark.parametrize("name", list(MODELS))
def test_tp1_equals_sentence_transformers(name, st_model, tmp_path):
    d, model = st_model(name)
    art = compile_embed(d, tmp_path / "art")
    m = read_manifest(art)
    assert m.task == "embed" and m.model.pooling == {"qwen3-last": "last", "llama-mean": "mean",
                                                     "llama-cls": "cls"}[name]
    assert m.buckets.prefill_only and sorted(m.graphs) == sorted(b.key for b in m.buckets.buckets())
    H = m.model.hidden_size
    for key, files in m.graphs.items():
        assert key.startswith("prefill_"), key
        text = (art / next(f for f in files if f.endswith(".hlo.txt"))).read_text()
        header = text.splitlines()[0]
        out = re.search(r"\)->\((.*)\)\}", header).group(1)
        batch = int(re.match(r"prefill_b(\d+)_", key).group(1))
        assert out.startswith(f"f32[{batch},{H}]"), (key, out[:80])  # pooled vectors where the logits were
        assert hlo_summary(text)["donated"] == 2 * m.model.num_hidden_layers
    vectors, buckets = embed(art, TEXTS)
    _check_buckets(buckets)
    assert_same(vectors, reference(model, TEXTS))


@pytest.mark.parametrize("name", ["qwen3-last", "llama-mean"])
def test_tp2_one_spmd_program_equals_sentence_transformers(name, st_model, tmp_path):
    d, model = st_model(name)
    out = subprocess.run([sys.executable, str(HERE / "device_embed.py"), str(d), str(tmp_path / "art"), "2",
                          json.dumps(TEXTS)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    _check_buckets(res["buckets"])
    assert_same(res["vectors"], reference(model, TEXTS))
    m = read_manifest(tmp_path / "art")
    assert m.parallel.tp == 2 and all(f.startswith("graphs/spmd/") for fs in m.graphs.values() for f in fs)


def test_matryoshka_dimensions_through_the_openai_client(st_model, tmp_path):
    """`dimensions` truncates the device's vectors to a declared size and normalises them again; an undeclared
    size is a 400 naming `dimensions`."""
    import openai
    from helpers import live_server

    from neuron_opt.api import LLM

    d, model = st_model("qwen3-last")
    art = compile_embed(d, tmp_path / "art", matryoshka_dims=(16, 32))
    want = torch.nn.functional.normalize(reference(model, TEXTS)[:, :16], dim=-1)
    with live_server(LLM(str(art)), 4) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        resp = client.embeddings.create(model="tiny", input=TEXTS, dimensions=16)
        assert_same([e.embedding for e in resp.data], want)
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=24)
        assert e.value.body["param"] == "dimensions"
