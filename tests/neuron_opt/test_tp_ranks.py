"""Real TP ranks (spawned processes, gloo) against HF transformers on tiny checkpoints.

One set of rank processes per case (module-scoped, parametrized: pytest keeps one case alive at a time).
Cases cover divisible and non-divisible head counts and every layout:
  9 q / 3 kv heads at tp=2 (MHA, padded), tp=3 (shard) and tp=4 (MHA, padded) with sequence parallelism,
  8/2 at tp=4 (replicate-kv), flash decoding (KV cache split along the sequence) for MQA at tp=2 (with and
  without context-parallel prefill) and for Mistral's sliding window at tp=4 (two KV groups), and 8/2 at tp=2
  with context-parallel prefill over ranks that hold whole KV heads.
Oracle: HF logits (fp32, within 1e-4) and HF greedy tokens; collective counts against the formula.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file
from tiny import load_hf

from neuron_opt.buckets import BucketConfig, pick_decode, pick_prefill
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.errors import RankFailedError
from neuron_opt.executors.tp import tp_executor_from_state_dict
from neuron_opt.planner.collectives import expected_calls
from neuron_opt.runtime.generate import generate_ids
from neuron_opt.runtime.runner import DecodeRow, ModelRunner
from neuron_opt.runtime.sampling import SamplingParams

MAX_LEN = 128
CASES = {
    "9-3-tp2-mha": ("smollm-like-9-3", ParallelConfig(tp=2)),
    "9-3-tp3-sp": ("smollm-like-9-3", ParallelConfig(tp=3, sequence_parallel=True)),
    "9-3-tp4-mha-sp": ("smollm-like-9-3", ParallelConfig(tp=4, sequence_parallel=True)),
    "gqa4-tp4-replicate": ("llama-gqa4", ParallelConfig(tp=4)),
    "mqa-tp2-flash": ("llama-mqa", ParallelConfig(tp=2, flash_decoding=True, sequence_parallel=True)),
    # context-parallel prefill: the KV group's two ranks split each prefill's tokens (prompts of 5, 7, 11 tokens
    # in 16-token buckets)
    "mqa-tp2-cp": ("llama-mqa", ParallelConfig(tp=2, cp_degree=2)),
    # context-parallel prefill with whole KV heads per rank (8 q / 2 kv heads at tp 2: the shard layout): each rank
    # runs a prefill's attention for half its tokens over every head
    "gqa4-tp2-cp-heads": ("llama-gqa4", ParallelConfig(tp=2, cp_degree=2)),
    # two KV groups of two ranks (subgroup collectives) and a sliding window inside the sequence-split cache
    "mistral-window-tp4-flash": ("mistral-window", ParallelConfig(tp=4, flash_decoding=True)),
}


class NoTok:  # the oracle compares ids; no text needed
    def decode(self, ids, skip_special_tokens=True):
        return ""


class WithCandidates:
    """The runner's executor, asking the ranks for top-K candidates instead of full logits."""

    def __init__(self, ex, k):
        self.ex, self.k = ex, k

    def run(self, bucket, inputs):
        return self.ex.run(bucket, inputs, candidates=self.k)


def _state_dict(d, cfg):
    sd = load_file(str(d / "model.safetensors"))
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


# the XLA tier runs context parallelism at tp 2 too (tests/xla/test_device_cp.py)
SLOW = {"mqa-tp2-cp", "gqa4-tp2-cp-heads"}


@pytest.fixture(scope="module", params=[pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                        for c in sorted(CASES)])
def case(request, tiny_dir, tmp_path_factory):
    variant, par = CASES[request.param]
    d = tiny_dir(variant)
    cfg = ModelConfig.from_hf(d)
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    ex = tp_executor_from_state_dict(cfg, _state_dict(d, cfg), par, cache, tmp_path_factory.mktemp("w"))
    buckets = BucketConfig.build(
        max_prompt_len=MAX_LEN, max_model_len=MAX_LEN, max_batch=2, min_prefill=16, min_decode=16
    )
    hf = load_hf(d)
    yield cfg, par, ex, buckets, cache, hf
    ex.close()


def test_batched_logits_match_hf(case):
    """Two sequences in two slots (prompts 11 and 5 tokens), then batched decode, teacher forced."""
    cfg, par, ex, buckets, cache, hf = case
    runner = ModelRunner(ex, buckets, cache, cfg.vocab_size)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (11 + 6, 5 + 6)]
    prompts = (11, 5)
    with torch.no_grad():
        refs = [hf(torch.tensor([s])).logits[0] for s in seqs]  # [S, V]
    for slot, (s, n) in enumerate(zip(seqs, prompts, strict=True)):
        torch.testing.assert_close(runner.prefill(slot, s[:n]), refs[slot][n - 1], atol=1e-4, rtol=0)
    for step in range(6):
        pairs = enumerate(zip(seqs, prompts, strict=True))
        rows = [DecodeRow(slot, s[n + step], n + step) for slot, (s, n) in pairs]
        got = runner.decode(rows)  # [2, V]
        for slot, n in enumerate(prompts):
            torch.testing.assert_close(got[slot], refs[slot][n + step], atol=1e-4, rtol=0)


def test_greedy_tokens_match_hf_with_full_logits_and_with_candidates(case):
    cfg, par, ex, buckets, cache, hf = case
    prompt = [1, 17, 42, 99, 5, 123, 7]
    n = 24
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
        )[0, len(prompt) :].tolist()
    params = SamplingParams(max_tokens=n, min_tokens=n)
    for executor in (ex, WithCandidates(ex, 1 + 1)):  # greedy + EOS banned before min_tokens
        runner = ModelRunner(executor, buckets, cache, cfg.vocab_size)
        assert generate_ids(runner, NoTok(), prompt, params, (2,)).token_ids == ref


def test_top_k_sampling_with_candidates_equals_full_logits(case):
    cfg, par, ex, buckets, cache, hf = case
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=4, seed=11, ignore_eos=True)
    outs = []
    for executor in (ex, WithCandidates(ex, 4)):
        runner = ModelRunner(executor, buckets, cache, cfg.vocab_size)
        outs.append(generate_ids(runner, NoTok(), [1, 9, 8, 7], params, ()).token_ids)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("candidates", [None, 3])
def test_counted_collective_bytes_equal_the_formula(case, candidates):
    cfg, par, ex, buckets, cache, hf = case
    runner = ModelRunner(WithCandidates(ex, candidates), buckets, cache, cfg.vocab_size)
    ex.reset_collective_calls()
    runner.prefill(0, list(range(3, 3 + 21)))  # 21 tokens -> a 32 bucket; tp=3 pads it to 33 activations
    prefill_calls = ex.collective_calls()
    ex.reset_collective_calls()
    runner.decode([DecodeRow(0, 5, 21), DecodeRow(1, 6, 0)])
    decode_calls = ex.collective_calls()
    pb, db = pick_prefill(21, buckets), pick_decode(2, 21, buckets)
    assert prefill_calls == expected_calls(cfg, par, pb, 4, candidates)
    assert decode_calls == expected_calls(cfg, par, db, 4, candidates)


def test_a_dead_rank_fails_fast_with_a_clear_error(tiny_dir, tmp_path):
    d = tiny_dir("llama-gqa2")
    cfg = ModelConfig.from_hf(d)
    cache = CacheConfig(max_batch=1, max_model_len=64)
    ex = tp_executor_from_state_dict(cfg, _state_dict(d, cfg), ParallelConfig(tp=2), cache, tmp_path)
    buckets = BucketConfig.build(max_prompt_len=64, max_model_len=64, max_batch=1, min_prefill=16, min_decode=16)
    runner = ModelRunner(ex, buckets, cache, cfg.vocab_size)
    runner.prefill(0, [1, 2, 3])
    victim = ex.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1"):
        runner.decode([DecodeRow(0, 4, 3)])
    assert time.monotonic() - t0 < 30  # no hang: the watchdog saw the dead rank
    assert not ex.procs  # every other rank was stopped
    with pytest.raises(RankFailedError, match="closed"):
        runner.decode([DecodeRow(0, 4, 3)])
