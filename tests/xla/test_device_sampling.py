"""Sampling on the device: the neuron backend's decode and last-token prefill graphs take the rows' sampling
parameters and return token ids.

Oracles: the host sampler (runtime/sampling.py) on the same step's logits, fed the same uniform numbers (a copy of
each request's seeded generator); `jsonschema` / `re` for constrained texts; torch-xla's own transfer metrics for
the bytes a step moves device -> host.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch_xla.debug.metrics as met
from device_sampling import streams
from tiny import make_tiny

from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.executors import load_model
from neuron_opt.runtime.runner import DecodeRow
from neuron_opt.runtime.sampling import SamplerState, SamplingParams, device_inputs

pytestmark = pytest.mark.xla
HERE = Path(__file__).parent


def compile_tiny(ckpt: Path, out: Path, **kw) -> Path:
    req = dict(max_model_len=32, prefill_buckets=(16,), decode_buckets=(32,), batch_size=4, prefill_batch=4,
               block_size=32)
    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", dtype="float32", use_cache=False,
                                    **{**req, **kw}), log=lambda s: None, progress=False)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("llama-gqa2", tmp_path_factory.mktemp("llama-gqa2"), tokenizer=True)


def check_streams(res: dict) -> None:
    assert res["device"] == res["host"]  # greedy; temperature; top-k + penalties; top-p + min-p + logit_bias
    assert len({tuple(s) for s in res["host"]}) == 4 and len(res["host"][0]) == 13
    assert res["lp_diff"] < 1e-5, res["lp_diff"]  # chosen and top-3 logprobs (ids equal: asserted in streams)
    B, V = res["batch"], 257
    # out: ids, the chosen logprobs, 20 top logprobs and their ids per row, not the logits
    assert res["d2h"]["sampled_logprobs"] <= res["tp"] * B * 4 * (2 + 2 * 20) < res["d2h"]["logits"]
    assert res["d2h"]["logits"] >= B * V * 4
    v = res["verify"]  # sampled verify steps accepted in the graph: the host verifier's tokens, numbers and logprobs
    assert v["device"] == v["host"] and v["generators"], v
    assert 0 < v["accepted"][0] == v["accepted"][1] < 3 * 6, v["accepted"]  # some accepted, some rejected
    assert v["lp_diff"] < 1e-5, v["lp_diff"]


def test_device_sampling_equals_the_host_sampler_token_for_token_tp1(tiny, tmp_path):
    res = streams(load_model(compile_tiny(tiny, tmp_path / "art", num_speculative_tokens=2)).runner, 12, 1)
    check_streams({**res, "tp": 1})


def test_device_sampling_equals_the_host_sampler_token_for_token_tp2_vocab_parallel(tiny, tmp_path):
    """tp=2: each rank's top candidates, max and sum of exponentials cross ranks; the sampled rows keep a top_k
    within the candidates (the others are sampled on the host: test_rows_the_device_cannot_sample...)."""
    out = subprocess.run([sys.executable, str(HERE / "device_sampling.py"), str(tiny), str(tmp_path / "art"), "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    check_streams({**json.loads(out.stdout.strip().splitlines()[-1]), "tp": 2})


@pytest.mark.parametrize("replay", [True, False])
def test_a_sampled_decode_step_moves_ids_not_logits(replay, tiny, tmp_path):
    runner = load_model(compile_tiny(tiny, tmp_path / "art", backend_options={"replay": replay})).runner
    V = runner.vocab_size
    runner.prefill(0, list(range(3, 15)))
    states = [SamplerState.create(SamplingParams(temperature=0.7, top_p=0.9, seed=4)),
              SamplerState.create(SamplingParams())]
    rows = [DecodeRow(0, 5, 12), DecodeRow(1, 6, 0)]
    moved, total = {}, runner.stats.d2h_bytes  # the prefill's logits so far
    for kind in ("logits", "ids"):
        before = met.metric_data("InboundData")
        if kind == "ids":
            runner.decode_sampled(rows, device_inputs(states, [(), ()], V))
        else:
            runner.decode(rows)
        after = met.metric_data("InboundData")
        moved[kind] = (after[1] - (before[1] if before else 0), runner.stats.last_d2h_bytes)
    B = runner.last_bucket.batch
    assert moved["ids"] == (4 * B, 4 * B)  # [B] int32 token ids: torch-xla's count and the runner's agree
    assert moved["logits"][1] == 4 * B * V and moved["logits"][0] >= 4 * B * V
    assert runner.stats.device_sampled == 2 and runner.stats.d2h_bytes - total == 4 * B * V + 4 * B


def test_the_first_requests_compile_nothing_after_load(tiny, tmp_path):
    """Load compiles every bucket's sampling graphs for greedy and sampled rows (`ModelRunner.warm_sampling`):
    greedy and sampled requests, batched, then speculative verify steps of both kinds, compile nothing more
    (torch-xla's own compile count)."""
    from neuron_opt.api import LLM
    from neuron_opt.runtime.speculative import SpeculativeConfig

    llm = LLM(compile_tiny(tiny, tmp_path / "art", num_speculative_tokens=2))
    compiles, uncached = met.metric_data("CompileTime")[0], met.counter_value("UncachedCompile") or 0
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=1)]
    llm.generate_batch([prompt, prompt[:7], prompt[:9]], [params[0], params[1], params[1]])
    for p in params:
        llm.generate_ids_speculative(prompt, p, SpeculativeConfig(2, adaptive=False))
    assert llm.runner.stats.device_sampled > 0 and llm.runner.stats.host_fallback == 0
    assert (met.counter_value("UncachedCompile") or 0) == uncached
    assert met.metric_data("CompileTime")[0] == compiles


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{2}"


def test_structured_outputs_through_the_device_bitmask_validate_and_equal_host_sampling(tmp_path):
    """The engine (LLM API) over a neuron artifact: JSON-schema and regex requests, greedy and sampled, with
    min_tokens (EOS banned), penalties and a logit bias, sampled in the graphs through the token bitmask input;
    the same requests with the host sampler give the same tokens. A row with more logit_bias entries than the
    graph takes is sampled on the host, and counted."""
    from neuron_opt.api import LLM
    from neuron_opt.runtime.sampling import ADJUST_SLOTS
    from neuron_opt.runtime.structured import StructuredOutputs

    ckpt = make_tiny("smollm-tok-1layer", tmp_path / "ckpt", tokenizer=True)
    art = compile_tiny(ckpt, tmp_path / "art", max_model_len=64, prefill_buckets=(16,), decode_buckets=(64,),
                       batch_size=4, prefill_batch=1, block_size=16)
    llm = LLM(art)
    prompts = [list(llm.tokenizer(f"Person {i}: who?")["input_ids"]) for i in range(4)]
    params = [SamplingParams(max_tokens=40, structured=StructuredOutputs(json=SCHEMA)),
              SamplingParams(max_tokens=40, structured=StructuredOutputs(json=SCHEMA), temperature=0.9, seed=3,
                             min_p=0.02),
              SamplingParams(max_tokens=20, structured=StructuredOutputs(regex=REGEX), temperature=0.7, top_k=30,
                             seed=5, frequency_penalty=0.5),
              SamplingParams(max_tokens=12, min_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                             presence_penalty=0.4, logit_bias=((11, 3.0), (42, -2.0)))]
    stats = llm.runner.stats
    device = llm.generate_batch(prompts, params)
    assert stats.device_sampled > 0 and stats.host_fallback == 0
    llm.runner.executor.samples_on_device = False
    sampled_before = stats.device_sampled
    host = llm.generate_batch(prompts, params)
    assert stats.device_sampled == sampled_before
    assert [o.token_ids for o in device] == [o.token_ids for o in host]
    for o in device[:2]:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert re.fullmatch(REGEX, device[2].text), device[2].text
    assert len(device[3].token_ids) == 12
    llm.runner.executor.samples_on_device = True
    many = SamplingParams(max_tokens=3, temperature=0.5, seed=1, logit_bias=tuple((i, 0.5) for i in
                                                                                  range(ADJUST_SLOTS + 1)))
    assert len(llm.generate_ids(prompts[0], many).token_ids) == 3
    assert stats.host_fallback == 3  # its prefill and two decode steps


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_speculative_verification_accepts_in_the_graph_as_the_host_verifier(method, tiny, tmp_path):
    """Verify steps of greedy and sampled rows (penalties, top-k, top-p, logprobs) in one batch, their proposals
    from prompt lookup, a draft model (the target's checkpoint, eager) or a random EAGLE-3 head: accepted in the
    graph, they give the host verifier's tokens, logprobs and acceptance counts (the same requests with the graphs
    returning logits)."""
    from eagle3_heads import write_random_head

    from neuron_opt.api import LLM
    from neuron_opt.runtime.speculative import SpeculativeConfig

    llm = LLM(compile_tiny(tiny, tmp_path / "art", num_speculative_tokens=2))
    model = {"ngram": None, "draft_model": str(tiny),
             "eagle3": str(write_random_head(tmp_path / "head", tiny, [0, 1, 2], draft_vocab=64))}[method]
    spec = SpeculativeConfig(2, method, adaptive=False, model=model)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    params = [SamplingParams(max_tokens=14, ignore_eos=True),
              SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8, top_k=20, seed=3, logprobs=2),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.1, top_p=0.9, presence_penalty=0.4,
                             seed=4),
              SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.6, seed=5)]
    st = llm.runner.stats
    runs = {}
    for on_device in (True, False):
        llm.runner.executor.samples_on_device = on_device
        sampled = st.device_sampled
        batch = llm.generate_batch([prompt] * len(params), params, speculative=spec)
        one, stats = llm.generate_ids_speculative(prompt, params[1], spec)
        runs[on_device] = (batch, one, stats, st.device_sampled - sampled)
    (dev, dev_one, dev_stats, n_dev), (host, host_one, host_stats, n_host) = runs[True], runs[False]
    assert st.host_fallback == 0 and n_dev > 0 and n_host == 0
    assert [o.token_ids for o in dev] == [o.token_ids for o in host]
    assert dev_one.token_ids == host_one.token_ids and dev_one.token_ids != dev[0].token_ids
    assert dev_stats.accepted_tokens == host_stats.accepted_tokens
    if method == "draft_model":  # the target as its own draft: its argmax proposals, accepted and rejected
        assert 0 < dev_stats.accepted_tokens < dev_stats.draft_tokens
    assert dev_stats.verify_steps == host_stats.verify_steps > 0
    assert len(dev[1].logprobs) == 14 and dev[1].logprobs == pytest.approx(host[1].logprobs, abs=1e-5)
