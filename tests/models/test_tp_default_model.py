"""The real default model (SmolLM2-135M: 9 q / 3 kv heads) on real TP ranks against tp=1 and HF transformers.

tp=2 pads the 9 query heads to 10 and converts to MHA; tp=3 splits heads evenly and runs prefill
sequence-parallel. Slow (two sets of rank processes loading 135M parameters each, 30 layers).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from neuron_opt.api import LLM
from neuron_opt.checkpoint import default_model_path
from neuron_opt.config import ParallelConfig
from neuron_opt.runtime.runner import DecodeRow
from neuron_opt.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow
N_TOKENS = 24


@pytest.fixture(scope="module")
def single():
    return LLM("default", max_model_len=256)


@pytest.fixture(scope="module")
def hf_tokens(single):
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompt = single.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=N_TOKENS,
            do_sample=False,
            min_new_tokens=N_TOKENS,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    return prompt, ref


@pytest.mark.parametrize(
    "par", [ParallelConfig(tp=2), ParallelConfig(tp=3, sequence_parallel=True)], ids=["tp2-mha", "tp3-sp"]
)
def test_tp_matches_tp1_and_hf(par, single, hf_tokens):
    prompt, ref = hf_tokens
    llm = LLM("default", max_model_len=256, parallel=par)
    try:
        params = SamplingParams(max_tokens=N_TOKENS, min_tokens=N_TOKENS)
        assert llm.generate_ids(prompt, params).token_ids == ref
        # teacher-forced logits against tp=1 on the same prompt + the reference continuation
        text = prompt + ref
        a = [llm.runner.prefill(0, prompt)]
        b = [single.runner.prefill(0, prompt)]
        for t in range(len(prompt), len(text)):
            a.append(llm.runner.decode([DecodeRow(0, text[t], t)])[0])
            b.append(single.runner.decode([DecodeRow(0, text[t], t)])[0])
        torch.testing.assert_close(torch.stack(a), torch.stack(b), atol=1e-4, rtol=0)
    finally:
        llm.runner.executor.close()
