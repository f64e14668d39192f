"""Scoring through /v1/completions (server/scoring.py): `echo` with prompt logprobs, vLLM's `prompt_logprobs`, token-id
prompts, `GET /tokenizer_info`, and lm-evaluation-harness's `local-completions` model on a small multiple-choice
task written here.

Oracles: HF transformers' log-softmax over the same token ids (every prompt position, fp32), and for lm-eval the
same task scored with HF: per-item log-likelihoods to 1e-3 and the same accuracy. The model is the tiny random one
with the real tokenizer, served on the eager backend; the cpu backend's every-position head is checked against its
own last-position head.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from helpers import live_server

from neuron_opt.api import LLM

MODEL = "tiny"
ITEMS = [  # a small multiple-choice task: question, choices, the index of the right one
    ("The capital of France is", ["Paris", "Berlin", "Madrid"], 0),
    ("Two plus two equals", ["three", "four", "five"], 1),
    ("The sky on a clear day is", ["green", "red", "blue"], 2),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin"], 0),
    ("A cat says", ["woof", "meow", "moo", "quack"], 1),
]


@pytest.fixture(scope="module")
def ckpt(tiny_dir):
    return tiny_dir("smollm-tok")


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(ckpt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(ckpt, batch_size=2, max_model_len=256)
    with live_server(llm, max_num_seqs=2, enable_tokenizer_info=True) as (url, engine):
        yield url, llm
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: position j's log-softmax, which scores ids[j + 1]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def test_echo_logprobs_match_hf(server, client, hf):
    """echo + logprobs over a token-id prompt: the prompt comes back as text and tokens, null first, each prompt
    token's logprob and top-2 as HF computes them; max_tokens 0 returns the prompt alone."""
    tok = server[1].tokenizer
    ids = tok("Scoring a prompt, token by token, on every backend.", add_special_tokens=False)["input_ids"]
    ref = hf_logprobs(hf, ids)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=2, echo=True, temperature=0)
    c = r.choices[0]
    assert c.text.startswith(tok.decode(ids)) and len(c.text) > len(tok.decode(ids))
    lp = c.logprobs
    assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids] and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], want, strict=True)) < 1e-4
    for j in range(1, len(ids)):
        top2 = torch.topk(ref[j - 1], 2)
        expect = {tok.decode([t]) for t in top2.indices.tolist()} | {lp.tokens[j]}
        assert set(lp.top_logprobs[j]) == expect
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1

    only = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, logprobs=0, echo=True)
    oc = only.choices[0]
    assert oc.text == tok.decode(ids) and oc.finish_reason == "length" and only.usage.completion_tokens == 0
    assert oc.logprobs.token_logprobs == lp.token_logprobs[:len(ids)]


def test_vllm_prompt_logprobs(server, hf):
    """vLLM's prompt_logprobs: [null, {id: {logprob, rank, decoded_token}}, ...] with the prompt's own token; a
    text prompt too (tokenized as for generation)."""
    tok = server[1].tokenizer
    text = "Ranks and logprobs of each prompt token"
    ids = tok(text)["input_ids"]
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": text, "max_tokens": 2, "prompt_logprobs": 1},
                   timeout=60).json()
    pl = r["choices"][0]["prompt_logprobs"]
    ref = hf_logprobs(hf, ids)
    assert pl[0] is None and len(pl) == len(ids)
    for j in range(1, len(ids)):
        own = pl[j][str(ids[j])]
        assert abs(own["logprob"] - ref[j - 1, ids[j]].item()) < 1e-4
        assert own["rank"] == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1
        assert own["decoded_token"] == tok.decode([ids[j]])
        best = int(ref[j - 1].argmax())
        assert pl[j][str(best)]["rank"] == 1 and len(pl[j]) in (1, 2)
    assert r["choices"][0]["logprobs"] is None and r["usage"]["completion_tokens"] == 2


def test_echo_streams_the_prompt_and_its_logprobs_first(server, client):
    """echo + logprobs with stream (the official client, stream=True): the first chunk carries the prompt's text and
    its tokens' logprobs (null first), the rest the completion; joined, the chunks are the unstreamed response (text,
    tokens, logprobs, offsets). max_tokens 0 streams the prompt alone."""
    tok = server[1].tokenizer
    ids = tok("Echo this prompt back, then go on", add_special_tokens=False)["input_ids"]
    kw = dict(model=MODEL, prompt=ids, logprobs=1, echo=True, temperature=0)
    whole = client.completions.create(max_tokens=5, **kw).choices[0]
    chunks = [c for c in client.completions.create(max_tokens=5, stream=True, **kw) if c.choices]
    first = chunks[0].choices[0]
    assert first.text.startswith(tok.decode(ids)) and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    for field_name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined = [x for c in chunks for x in getattr(c.choices[0].logprobs, field_name)]
        assert joined == getattr(whole.logprobs, field_name), field_name
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "length"

    only = [c for c in client.completions.create(max_tokens=0, stream=True, **kw) if c.choices]
    assert len(only) == 1 and only[0].choices[0].text == tok.decode(ids)
    assert only[0].choices[0].finish_reason == "length" and len(only[0].choices[0].logprobs.tokens) == len(ids)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": [5, 10**9], "echo": True}, "prompt"),
])
def test_bad_scoring_requests(server, body, param):
    r = httpx.post(server[0] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(server[0] + "/health").status_code == 200


def test_tokenizer_info(server):
    info = httpx.get(server[0] + "/tokenizer_info").json()
    tok = server[1].tokenizer
    assert info["tokenizer_class"] == type(tok).__name__ and info["chat_template"] == tok.chat_template
    assert info["eos_token"] == tok.eos_token
    assert info["added_tokens_decoder"][str(tok.eos_token_id)]["content"] == tok.eos_token


def test_lm_eval_local_completions_matches_hf(server, ckpt, hf, tmp_path, monkeypatch):
    """lm-evaluation-harness (`local-completions`, token-id prompts, echo + logprobs) against the live server on a
    task written here: per-item log-likelihoods as HF computes them for the same (context, continuation) pairs, and
    the same accuracy."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(data) + "\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL},base_url={server[0]}/v1/completions,tokenizer={ckpt},tokenized_requests=True,"
                   "num_concurrent=1,max_retries=1",
        tasks=["tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True, batch_size=1)
    tok = server[1].tokenizer
    correct = 0
    for sample in out["samples"]["tiny_mc"]:
        lls = []
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
            ref = hf_logprobs(hf, whole)
            ll = sum(ref[j - 1, whole[j]].item() for j in range(len(ctx), len(whole)))
            assert abs(resp[0][0] - ll) < 1e-3, (context, continuation, resp, ll)
            lls.append(ll)
        correct += int(max(range(len(lls)), key=lls.__getitem__) == sample["target"])
    assert len(out["samples"]["tiny_mc"]) == len(ITEMS)
    assert out["results"]["tiny_mc"]["acc,none"] == pytest.approx(correct / len(ITEMS))


@pytest.mark.parametrize("sequence_parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_prompt_logprobs_on_tp2_ranks_match_hf(ckpt, hf, sequence_parallel):
    """Prompt logprobs at tp 2 (gloo rank processes, the vocab-parallel head's shards all-gathered at every prompt
    position; sequence-parallel too, whose ranks each hold a chunk of the positions): HF's log-softmax over the
    prompt, for two prompts prefilled in one graph call."""
    from neuron_opt.config import ParallelConfig
    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.sampling import SamplingParams

    llm = LLM(ckpt, max_model_len=128, batch_size=2,
              parallel=ParallelConfig(tp=2, sequence_parallel=sequence_parallel))
    try:
        tok = llm.tokenizer
        prompts = [tok(t, add_special_tokens=False)["input_ids"]
                   for t in ("Prompt logprobs on two ranks, every position", "A shorter one")]
        engine = Engine(llm.runner, tok, llm.eos_token_ids)
        outs: dict[str, list] = {str(i): [] for i in range(2)}
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, SamplingParams(max_tokens=1, prompt_logprobs=1), outs[str(i)].append)
        for _ in range(20):
            if not engine.step() and engine.num_unfinished == 0:
                break
        for i, ids in enumerate(prompts):
            got = outs[str(i)][0].prompt_logprobs
            ref = hf_logprobs(hf, ids)
            assert got[0] is None and len(got) == len(ids)
            for j in range(1, len(ids)):
                assert got[j].token_id == ids[j]
                assert abs(got[j].logprob - ref[j - 1, ids[j]].item()) < 1e-3
                assert got[j].top[0][0] == int(ref[j - 1].argmax())
    finally:
        llm.runner.executor.close()
