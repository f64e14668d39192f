"""Embedding models against sentence-transformers (the oracle): tiny random bare decoders saved with
sentence-transformers modules (Transformer + Pooling [+ Normalize]) in the test, run through `LLM.embed`, compiled
artifacts (eager, cpu graphs, tp ranks) and `/v1/embeddings` with the official `openai` client; the task and pooling
recorded in the manifest; the refusals."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
import torch

from neuron_opt.api import LLM
from neuron_opt.artifact import Manifest, read_verified
from neuron_opt.buckets import BucketConfig
from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.config import CacheConfig, ParallelConfig
from neuron_opt.embeddings import read_sentence_transformers, resolve_task, text_ids
from neuron_opt.errors import ArtifactError, ConfigError
from neuron_opt.runtime.runner import ModelRunner, PrefillRow

st = pytest.importorskip("sentence_transformers")
from st_models import TEXTS, assert_same, make_st_model, reference  # noqa: E402


@pytest.fixture(scope="module")
def qwen3_last(tmp_path_factory):
    return make_st_model(tmp_path_factory.mktemp("st-qwen3"), "qwen3", "lasttoken", True)


@pytest.fixture(scope="module")
def llama_mean(tmp_path_factory):
    return make_st_model(tmp_path_factory.mktemp("st-llama"), "llama", "mean", False, seed=1)


def test_sentence_transformers_checkpoint_is_an_embedding_model(qwen3_last, llama_mean):
    q, lm = open_checkpoint(qwen3_last[0]).config, open_checkpoint(llama_mean[0]).config
    assert (q.architecture, q.pooling, q.normalize_embeddings) == ("Qwen3Model", "last", True)
    assert (lm.architecture, lm.pooling, lm.normalize_embeddings) == ("LlamaModel", "mean", False)
    # the bare decoder's weights (no `model.` prefix, no LM head) load under the canonical names
    names = set(open_checkpoint(llama_mean[0]).state_dict())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize("which", ["qwen3_last", "llama_mean"])
def test_llm_embed_equals_sentence_transformers(which, request):
    d, model = request.getfixturevalue(which)
    llm = LLM(str(d), batch_size=4)
    assert_same(llm.embed(TEXTS), reference(model, TEXTS))
    ids = [llm.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    assert_same(llm.embed(ids), reference(model, TEXTS[:2]))  # token id lists give the texts' vectors
    assert_same(llm.embed(ids[0]), reference(model, TEXTS[:1]))


@pytest.fixture(scope="module")
def qwen3_message(tmp_path_factory):
    """sentence-transformers >= 6 with a tokenizer that has a chat template: texts are rendered as a user message
    through it (the `message` modality), here with a template kwarg saved beside it."""
    return make_st_model(tmp_path_factory.mktemp("st-msg"), "qwen3", "lasttoken", True, seed=2, chat_template=True,
                         template_kwargs={"add_generation_prompt": True})


def test_message_modality_renders_the_chat_template(qwen3_message, tmp_path):
    """Texts go through the chat template as sentence-transformers renders them, in LLM.embed, in a compiled
    artifact (the rendering kept in its ModelConfig) and behind /v1/embeddings with the `openai` client."""
    openai = pytest.importorskip("openai")
    from helpers import live_server

    d, model = qwen3_message
    spec = read_sentence_transformers(d)
    assert (spec.messages, json.loads(spec.template_kwargs)) == ("flat", {"add_generation_prompt": True})
    ref = reference(model, TEXTS)
    llm = LLM(str(d), batch_size=4)
    ids = text_ids(llm.config, llm.tokenizer, TEXTS[0])
    assert ids == model.preprocess([TEXTS[0]])["input_ids"][0].tolist()  # the template's tokens, and its kwarg's
    assert_same(llm.embed(TEXTS), ref)
    out = tmp_path / "art"
    compile_artifact(CompileRequest(model=str(d), out=out, backend="eager", batch_size=4, max_prompt_len=128,
                                    use_cache=False), log=lambda s: None, progress=False)
    art = LLM(str(out))
    assert art.config.embedding_messages == "flat"
    assert_same(art.embed(TEXTS), ref)
    with live_server(art, 4) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert_same([e.embedding for e in client.embeddings.create(model="tiny", input=TEXTS).data], ref)


def test_compiled_artifact_batches_mixed_lengths(qwen3_last, tmp_path, monkeypatch):
    """An eager artifact with a prefill batch of 3: the inputs run 3 to a graph call, padded to the longest, and
    each vector is what sentence-transformers gives; the manifest records the task and pooling."""
    d, model = qwen3_last
    out = tmp_path / "art"
    compile_artifact(CompileRequest(model=str(d), out=out, backend="eager", batch_size=4, prefill_batch=3,
                                    max_prompt_len=64, prefill_buckets=(16, 64), use_cache=False),
                     log=lambda s: None, progress=False)
    m = read_verified(out).manifest
    raw = json.loads((out / "manifest.json").read_text())
    assert (raw["task"], raw["pooling"], m.task) == ("embed", "last", "embed")
    assert m.buckets.prefill_only and all(b.phase == "prefill" for b in m.buckets.buckets())
    llm = LLM(str(out))
    calls: list[list[int]] = []
    embed_rows = llm.runner.embed_rows

    def record(rows):
        calls.append([len(r.tokens) for r in rows])
        return embed_rows(rows)

    monkeypatch.setattr(llm.runner, "embed_rows", record)
    assert_same(llm.embed(TEXTS), reference(model, TEXTS))
    assert max(len(c) for c in calls) == 3 and any(len(set(c)) > 1 for c in calls), calls


def test_manifest_task_must_match_its_model(qwen3_last, tmp_path):
    out = tmp_path / "art"
    compile_artifact(CompileRequest(model=str(qwen3_last[0]), out=out, backend="eager", max_prompt_len=32,
                                    use_cache=False), log=lambda s: None, progress=False)
    raw = json.loads((out / "manifest.json").read_text())
    Manifest.from_json(raw)
    for task, pooling in (("generate", None), ("embed", "mean")):
        with pytest.raises(ArtifactError, match="disagrees"):
            Manifest.from_json({**raw, "task": task, "pooling": pooling})


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_ranks_equal_sentence_transformers(llama_mean, tmp_path, sequence_parallel):
    """tp=2 ranks (threads, the worker's code): the pooled vector from rank 0, with the mean's partial sums
    all-reduced under sequence parallelism."""
    from helpers import ThreadRanks

    from neuron_opt.executors.launcher import RankSpec, write_rank_weights

    d, model = llama_mean
    ckpt = open_checkpoint(d)
    cfg, par = ckpt.config, ParallelConfig(tp=2, sequence_parallel=sequence_parallel)
    cache = CacheConfig(max_batch=4, max_model_len=64)
    write_rank_weights(ckpt.state_dict(), cfg, par, tmp_path)
    ranks = ThreadRanks(RankSpec(cfg, par, cache, str(tmp_path)))
    try:
        buckets = BucketConfig.build(max_prompt_len=64, max_model_len=64, max_batch=4, min_prefill=16,
                                     prefill_batch=4, offset_prefill=False, prefill_only=True)
        runner = ModelRunner(ranks, buckets, cache, cfg.vocab_size)
        tok = ckpt.tokenizer()
        rows = [PrefillRow(i, tuple(tok(t)["input_ids"])) for i, t in enumerate(TEXTS[:4])]
        assert_same(runner.embed_rows(rows), reference(model, TEXTS[:4]))
    finally:
        ranks.close()


@pytest.mark.slow  # a cpu artifact's compile (the default suite's budget)
def test_cpu_graphs_equal_sentence_transformers(llama_mean, tmp_path):
    """The cpu backend: compiled layer graphs, then the pool graph (final norm, masked mean) on every row."""
    d, model = llama_mean
    out = tmp_path / "cpu"
    compile_artifact(CompileRequest(model=str(d), out=out, backend="cpu", dtype="float32", batch_size=2,
                                    prefill_batch=2, max_prompt_len=32, prefill_buckets=(32,), use_cache=False),
                     log=lambda s: None, progress=False)
    files = read_verified(out).manifest.graphs
    assert any("pool_b2_dyn" in f for fs in files.values() for f in fs), files
    assert_same(LLM(str(out)).embed(TEXTS), reference(model, TEXTS), exact=False)


def test_openai_client_embeddings(qwen3_last, tiny_dir):
    """`client.embeddings.create`: one string, a list (base64 by default in the client, and float), token ids,
    usage; `dimensions` on a model that declares no Matryoshka sizes, a text route on an embedding model and
    embeddings from a generation model are 400s naming the field."""
    openai = pytest.importorskip("openai")
    from helpers import live_server

    d, model = qwen3_last
    llm = LLM(str(d), batch_size=4)
    ref = reference(model, TEXTS)
    with live_server(llm, 4) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        resp = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
        assert [e.index for e in resp.data] == list(range(len(TEXTS)))
        assert_same([e.embedding for e in resp.data], ref)
        n = sum(len(llm.tokenizer(t)["input_ids"]) for t in TEXTS)
        assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (n, n)
        one = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
        assert_same([one.data[0].embedding], ref[:1])
        ids = client.embeddings.create(model="tiny", input=[llm.tokenizer(TEXTS[1])["input_ids"]])
        assert_same([ids.data[0].embedding], ref[1:2])
        raw = client.embeddings.with_raw_response.create(model="tiny", input=[TEXTS[2]], encoding_format="base64")
        b64 = raw.http_response.json()["data"][0]["embedding"]
        assert_same([np.frombuffer(base64.b64decode(b64), dtype="<f4")], ref[2:3])
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16)
        assert e.value.body["param"] == "dimensions"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["param"] == "model" and "embedding model" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="tiny", input=[])
        assert e.value.body["param"] == "input"
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="tiny", input=[[10**9]])
        assert e.value.body["param"] == "input"
    gen = LLM(str(tiny_dir("smollm-tok-1layer")))
    with live_server(gen, 1) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="tiny", input="hi")
        assert e.value.body["param"] == "model" and "--task embed" in e.value.body["message"]


def test_matryoshka_dimensions_truncate_and_renormalise(qwen3_last, tmp_path):
    openai = pytest.importorskip("openai")
    from helpers import live_server

    d, model = qwen3_last
    out = tmp_path / "mrl"
    compile_artifact(CompileRequest(model=str(d), out=out, backend="eager", max_prompt_len=64,
                                    matryoshka_dims=(16, 32), use_cache=False), log=lambda s: None, progress=False)
    llm = LLM(str(out))
    full = reference(model, TEXTS[:2])
    with live_server(llm, 1) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        resp = client.embeddings.create(model="tiny", input=TEXTS[:2], dimensions=16)
        want = torch.nn.functional.normalize(full[:, :16], dim=-1)
        assert_same([e.embedding for e in resp.data], want)
        assert all(math.isclose(float(np.linalg.norm(e.embedding)), 1.0, rel_tol=1e-5) for e in resp.data)
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=24)
        assert e.value.body["param"] == "dimensions" and "16, 32" in e.value.body["message"]


def test_refusals(qwen3_last, tmp_path, tiny_dir):
    d, _ = qwen3_last
    cfg = open_checkpoint(d).config
    with pytest.raises(ConfigError, match="bare decoder") as e:
        resolve_task(cfg, "generate")
    assert e.value.param == "task"
    gen = open_checkpoint(tiny_dir("llama-gqa2")).config
    with pytest.raises(ConfigError, match="--pooling") as e:
        resolve_task(gen, "embed")
    assert e.value.param == "pooling"
    assert resolve_task(gen, "embed", "cls").pooling == "cls" and resolve_task(gen, "embed", "cls").normalize_embeddings
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        compile_artifact(CompileRequest(model=str(d), out=tmp_path / "x", backend="eager", max_prompt_len=32,
                                        num_speculative_tokens=2, use_cache=False), log=lambda s: None,
                         progress=False)
    with pytest.raises(ConfigError, match="matryoshka_dims"):
        resolve_task(cfg, "embed", matryoshka_dims=(16, 4096))
    # a sentence-transformers pipeline we would not compute exactly is refused, naming the field
    pool_cfg, modules_file = d / "1_Pooling" / "config.json", d / "modules.json"
    saved_pool, saved_modules = pool_cfg.read_text(), modules_file.read_text()
    saved_bert = (d / "sentence_bert_config.json").read_text()
    try:
        for mode in ("max", ["mean", "lasttoken"]):
            pool_cfg.write_text(json.dumps({**json.loads(saved_pool), "pooling_mode": mode}))
            with pytest.raises(ConfigError) as e:
                read_sentence_transformers(d)
            assert e.value.param == "pooling_mode"
        # the older files' flags name the same modes
        pool_cfg.write_text(json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
        assert read_sentence_transformers(d).pooling == "mean"
        pool_cfg.write_text(json.dumps({"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}))
        with pytest.raises(ConfigError):
            read_sentence_transformers(d)
        pool_cfg.write_text(saved_pool)
        dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
        modules_file.write_text(json.dumps(json.loads(saved_modules) + [dense]))
        with pytest.raises(ConfigError, match="Dense"):
            read_sentence_transformers(d)
        modules_file.write_text(saved_modules)
        (d / "sentence_bert_config.json").write_text(json.dumps({"modality_config": {"text": {}, "message": {}}}))
        with pytest.raises(ConfigError, match="format") as e:  # the message format is one sentence-transformers saves
            read_sentence_transformers(d)
        assert e.value.param == "modality_config"
        message = {"modality_config": {"message": {"format": "flat"}},
                   "processing_kwargs": {"chat_template": {"tokenize": False}}}
        (d / "sentence_bert_config.json").write_text(json.dumps(message))
        with pytest.raises(ConfigError, match="tokenize") as e:
            read_sentence_transformers(d)
        assert e.value.param == "processing_kwargs"
    finally:
        (d / "sentence_bert_config.json").write_text(saved_bert)
        pool_cfg.write_text(saved_pool)
        modules_file.write_text(saved_modules)
    with pytest.raises(ConfigError, match="embedding model"):
        LLM(str(d)).generate("hi")
    with pytest.raises(ConfigError, match="--task embed"):
        LLM(str(tiny_dir("smollm-tok-1layer"))).embed("hi")
