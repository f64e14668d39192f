"""Structured outputs in the serving engine: constrained and unconstrained rows in one batch, with prefix caching,
chunked prefill, preemption and speculative decoding; `n` siblings; logit_bias.

Oracles: the single-sequence reference loop (runtime/generate.py via `helpers.reference_generate`, which masks with
the same grammar one token at a time) for every request of a mixed batch, so unconstrained rows are untouched by
their neighbours' masks and constrained rows are the same under every engine feature; `jsonschema` / `re` for the
constrained texts. The model is the tiny random one with the real tokenizer: its text is noise, so the schemas bound
every string (and the grammar must end every request).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from helpers import eager_runner, reference_generate

from neuron_opt.api import LLM, build_model
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig
from neuron_opt.runtime.engine import Engine
from neuron_opt.runtime.runner import ModelRunner
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.speculative import SpeculativeConfig
from neuron_opt.runtime.structured import StructuredOutputs

MAX_LEN, BS, K = 128, 8, 3
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{2}"


@pytest.fixture(scope="module")
def setup(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = LLM(tiny_dir("smollm-tok"), batch_size=1, max_model_len=MAX_LEN)
    system = "You are a careful assistant. Reply in JSON with the fields asked for, nothing else. " * 2
    prompts = [list(ref.tokenizer(system + f"Person {i}: who are they?")["input_ids"]) for i in range(6)]
    params = [
        SamplingParams(max_tokens=60, structured=StructuredOutputs(json=SCHEMA)),
        SamplingParams(max_tokens=12, min_tokens=12),
        SamplingParams(max_tokens=60, structured=StructuredOutputs(json=SCHEMA), temperature=0.9, seed=3),
        SamplingParams(max_tokens=30, structured=StructuredOutputs(regex=REGEX)),
        SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=8, structured=StructuredOutputs(choice=("alpha", "beta", "gamma delta"))),
    ]
    want = [reference_generate(ref, p, sp) for p, sp in zip(prompts, params, strict=True)]
    yield ref, prompts, params, want
    torch.set_num_threads(threads)


def check_texts(params, texts) -> None:
    for sp, text in zip(params, texts, strict=True):
        s = sp.structured
        if s is not None and s.json is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif s is not None and s.regex is not None:
            assert re.fullmatch(REGEX, text), text
        elif s is not None:
            assert text in s.choice


def engine_for(ref, num_blocks: int = 0, **kw) -> Engine:
    cache = CacheConfig(max_batch=4, max_model_len=MAX_LEN, block_size=BS, num_blocks=num_blocks)
    buckets = BucketConfig.build(max_prompt_len=64, max_model_len=MAX_LEN, max_batch=4, min_prefill=16,
                                 min_decode=16, num_speculative_tokens=K)
    model = build_model(ref.config, dict(ref.runner.executor.model.state_dict()), MAX_LEN, torch.float32)
    runner = ModelRunner(EagerExecutor(model, cache), buckets, cache, ref.config.vocab_size)
    return Engine(runner, ref.tokenizer, ref.eos_token_ids, **kw)


def run(engine: Engine, prompts, params) -> list[tuple[list[int], str, str]]:
    outs: dict[int, list] = {i: [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp, outs[i].append)
    for _ in range(3000):
        if not engine.step() and engine.num_unfinished == 0:
            break
    assert engine.num_unfinished == 0 and engine.kv_usage == 0
    return [([t for o in outs[i] for t in o.new_token_ids], "".join(o.text_delta for o in outs[i]),
             outs[i][-1].finish_reason) for i in range(len(prompts))]


@pytest.mark.parametrize("features", [
    dict(max_num_batched_tokens=2048),
    dict(max_num_batched_tokens=24),  # chunked prefill, the shared system prompt from the prefix cache
    dict(num_blocks=-1, max_num_batched_tokens=64, enable_prefix_caching=False),  # preemption (blocks: below)
    dict(speculative=SpeculativeConfig(K, adaptive=False)),  # prompt lookup, verified under the masks
], ids=["plain", "chunked+prefix", "preemption", "speculative"])
def test_constrained_and_free_rows_in_one_batch_equal_the_reference(setup, features):
    ref, prompts, params, want = setup
    check_texts(params, [w.text for w in want])
    assert all(w.finish_reason == "stop" for w, sp in zip(want, params, strict=True) if sp.structured)
    if features.get("num_blocks") == -1:  # room for three prompts and a block: the newest are preempted
        features = {**features, "num_blocks": 2 + 3 * -(-max(len(p) for p in prompts) // BS)}
    engine = engine_for(ref, **features)
    got = run(engine, prompts, params)
    assert [g[0] for g in got] == [w.token_ids for w in want]
    assert [(g[1], g[2]) for g in got] == [(w.text, w.finish_reason) for w in want]
    if features.get("num_blocks"):
        assert engine.stats.preemptions > 0
    if "speculative" in features:
        assert engine.spec_stats.verify_steps > 0


def test_a_grammar_ends_the_request_even_when_eos_is_ignored(setup):
    ref, prompts, _, _ = setup
    sp = SamplingParams(max_tokens=20, ignore_eos=True, structured=StructuredOutputs(choice=("yes", "no")))
    out = reference_generate(ref, prompts[0], sp)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_logit_bias_bans_and_forces_tokens(setup):
    ref, prompts, _, _ = setup
    free = reference_generate(ref, prompts[1], SamplingParams(max_tokens=8, ignore_eos=True))
    banned = reference_generate(ref, prompts[1], SamplingParams(max_tokens=8, ignore_eos=True,
                                                         logit_bias=tuple((t, -100.0) for t in set(free.token_ids))))
    assert not set(banned.token_ids) & set(free.token_ids)
    forced = reference_generate(ref, prompts[1], SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, seed=0,
                                                         logit_bias=((42, 100.0),)))
    assert forced.token_ids == [42] * 4


def test_n_siblings_wait_for_the_first_prompt_and_reuse_its_blocks(setup):
    ref, prompts, _, _ = setup
    engine = engine_for(ref)
    outs: dict[str, list] = {}
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"s{i}", prompts[0], sp, outs.setdefault(f"s{i}", []).append,
                           share_prefix_with="s0" if i else None)
    while engine.num_unfinished:
        engine.step()
    tokens = {rid: [t for o in out for t in o.new_token_ids] for rid, out in outs.items()}
    assert tokens["s0"] == tokens["s1"] == tokens["s2"] == reference_generate(ref, prompts[0], sp).token_ids
    full_blocks = len(prompts[0]) // BS
    assert engine.prefix_cache_stats.hits >= 2 * full_blocks * BS  # both siblings took the prompt's full blocks
    assert engine.stats.prefills == 3


def test_an_invalid_grammar_is_refused_before_anything_is_queued(tiny_dir):
    llm_runner = eager_runner(tiny_dir("smollm-tok"))
    ref = LLM(tiny_dir("smollm-tok"), batch_size=1, max_model_len=64)
    engine = Engine(llm_runner, ref.tokenizer, ref.eos_token_ids)
    with pytest.raises(ValueError, match="regex does not compile"):
        engine.add_request("x", [1, 2, 3], SamplingParams(structured=StructuredOutputs(regex="(")), print)
    assert engine.num_unfinished == 0
