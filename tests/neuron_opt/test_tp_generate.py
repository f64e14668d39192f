"""End to end through the API: generation on TP rank processes equals tp=1, with and without rank-side sampling."""

from __future__ import annotations

import pytest
from helpers import reference_generate

from neuron_opt.api import LLM
from neuron_opt.config import ParallelConfig
from neuron_opt.runtime.sampling import SamplingParams

PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True),
          SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_k=5, seed=7)]


@pytest.mark.parametrize("vocab_parallel", [True, False])
def test_tp2_generation_equals_tp1(tiny_dir, vocab_parallel):
    d = tiny_dir("smollm-tok")
    ref = LLM(d, max_model_len=128)
    tp = LLM(d, max_model_len=128, parallel=ParallelConfig(tp=2, vocab_parallel_sampling=vocab_parallel))
    assert tp.runner.executor.gathers_candidates is vocab_parallel
    try:
        for params in PARAMS:
            assert tp.generate("The quick brown fox", params).token_ids == \
                ref.generate("The quick brown fox", params).token_ids
    finally:
        tp.runner.executor.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_on_tp_ranks_equals_single_sequence_tp1(tiny_dir, async_scheduling):
    """Continuous batching over TP rank processes: greedy rows gather only top candidates, the top-p row the full
    logits; every request still gets exactly the tp=1 single-sequence result, with async scheduling too."""
    from neuron_opt.runtime.engine import Engine

    d = tiny_dir("smollm-tok")
    ref = LLM(d, max_model_len=128)
    tp = LLM(d, max_model_len=128, batch_size=4, parallel=ParallelConfig(tp=2))
    params = [SamplingParams(max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=14, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, top_p=0.8, seed=3)]
    prompts = [list(tp.tokenizer(f"Prompt {i} is about" + " cats" * i)["input_ids"]) for i in range(3)]
    try:
        engine = Engine(tp.runner, tp.tokenizer, tp.eos_token_ids, async_scheduling=async_scheduling)
        outs: dict[str, list] = {str(i): [] for i in range(3)}
        for i in range(3):
            engine.add_request(str(i), prompts[i], params[i], outs[str(i)].append)
        for _ in range(100):
            if not engine.step() and engine.num_unfinished == 0:
                break
        for i in range(3):
            got = [t for o in outs[str(i)] for t in o.new_token_ids]
            assert got == reference_generate(ref, prompts[i], params[i]).token_ids
    finally:
        tp.runner.executor.close()
