"""End to end through the API: generation on TP rank processes equals tp=1, with and without rank-side sampling."""

from __future__ import annotations

import pytest

from neuron_opt.api import LLM
from neuron_opt.config import ParallelConfig
from neuron_opt.runtime.sampling import SamplingParams

PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True),
          SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_k=5, seed=7)]


@pytest.mark.parametrize("vocab_parallel", [True, False])
def test_tp2_generation_equals_tp1(tiny_dir, vocab_parallel):
    d = tiny_dir("smollm-tok")
    ref = LLM(d, max_length=128)
    tp = LLM(d, max_length=128, parallel=ParallelConfig(tp=2, vocab_parallel_sampling=vocab_parallel))
    assert tp.runner.executor.gathers_candidates is vocab_parallel
    try:
        for params in PARAMS:
            assert tp.generate("The quick brown fox", params).token_ids == \
                ref.generate("The quick brown fox", params).token_ids
    finally:
        tp.runner.executor.close()
