"""Parity with HF transformers (the oracle), fp32, on tiny random-weight checkpoints of every variant."""

from __future__ import annotations

import pytest
import torch
from helpers import eager_runner
from tiny import VARIANTS, load_hf

from neuron_opt.runtime.runner import DecodeRow

PROMPT_LEN, DECODE_STEPS = 11, 16


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_and_decode_logits_match_hf(variant, tiny_dir):
    d = tiny_dir(variant)
    hf = load_hf(d)
    runner = eager_runner(d)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, hf.config.vocab_size, (1, PROMPT_LEN + DECODE_STEPS), generator=g)
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [S, V]
    got = [runner.prefill(0, ids[0, :PROMPT_LEN].tolist())]
    for t in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        got.append(runner.decode([DecodeRow(0, int(ids[0, t]), t)])[0])
    got_t = torch.stack(got)  # [1 + steps, V]
    torch.testing.assert_close(got_t, ref[PROMPT_LEN - 1:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_32_tokens_identical_to_hf(variant, tiny_dir):
    from neuron_opt.runtime.generate import generate_ids
    from neuron_opt.runtime.sampling import SamplingParams

    d = tiny_dir(variant)
    hf = load_hf(d)
    runner = eager_runner(d)
    prompt = [1, 17, 42, 99, 5, 123, 7]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                          pad_token_id=0)[0, len(prompt):].tolist()

    class NoTok:  # the oracle compares ids; no text needed
        def decode(self, ids, skip_special_tokens=True):
            return ""

    out = generate_ids(runner, NoTok(), prompt, SamplingParams(max_tokens=32, min_tokens=32), (2,))
    assert out.token_ids == ref
