"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers loading the same file."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from neuron_opt.api import LLM
from neuron_opt.backends.cpu.backend import onednn_bf16_supported
from neuron_opt.checkpoint import default_model_path
from neuron_opt.cli import main
from neuron_opt.runtime.runner import DecodeRow
from neuron_opt.runtime.sampling import SamplingParams

N_TOKENS = 64


@pytest.fixture(scope="module")
def hf_model():
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    return LLM("default", max_model_len=512)


def test_greedy_64_tokens_match_hf(hf_model, llm):
    """Exact greedy tokens; if a near-tie ever flips, teacher forcing below still bounds the disagreement."""
    prompt = llm.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=N_TOKENS, do_sample=False,
                                min_new_tokens=N_TOKENS, pad_token_id=0)[0, len(prompt):].tolist()
    out = llm.generate_ids(prompt, SamplingParams(max_tokens=N_TOKENS, min_tokens=N_TOKENS))
    assert out.token_ids == ref


def test_teacher_forced_logits_match_hf(hf_model, llm):
    prompt = llm.encode_chat([{"role": "user", "content": "Explain what a compiler does."}])
    text = prompt + llm.tokenizer(" A compiler translates source code into machine code.")["input_ids"]
    with torch.no_grad():
        ref = hf_model(torch.tensor([text])).logits[0]
    runner = llm.runner
    got = [runner.prefill(0, text[: len(prompt)])]
    for t in range(len(prompt), len(text)):
        got.append(runner.decode([DecodeRow(0, text[t], t)])[0])
    got_t = torch.stack(got)
    ref_t = ref[len(prompt) - 1:]
    assert (got_t.argmax(-1) == ref_t.argmax(-1)).float().mean().item() == 1.0
    torch.testing.assert_close(got_t, ref_t, atol=2e-3, rtol=0)  # fp32, 30 layers: summation-order noise only


def test_cli_chat_answers_paris(capsys):
    rc = main(["generate", "--model", "default", "--chat", "--prompt", "What is the capital of France?",
               "--max-new-tokens", "24", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert "Paris" in out["text"]
    assert out["finish_reason"] in ("stop", "length")
    assert out["prompt_token_ids"] and out["token_ids"]


def test_speculative_greedy_equals_plain_greedy_on_the_default_model():
    """Prompt-lookup speculation on the real model (fp32, eager) over an input-grounded prompt: the same tokens as
    plain greedy decoding, with proposals accepted."""
    from neuron_opt.runtime.speculative import SpeculativeConfig

    spec_llm = LLM("default", max_model_len=512, num_speculative_tokens=4)
    text = ("The committee met on Tuesday to review the budget. The committee approved the budget after a short "
            "discussion, and the chair thanked the members for their work on the budget.")
    prompt = spec_llm.encode_chat([{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}])
    params = SamplingParams(max_tokens=N_TOKENS, min_tokens=N_TOKENS)
    out, stats = spec_llm.generate_ids_speculative(prompt, params, SpeculativeConfig(4, adaptive=False))
    assert out.token_ids == spec_llm.generate_ids(prompt, params).token_ids
    assert stats.accepted_tokens >= N_TOKENS // 4, stats  # most of the answer came from accepted proposals


@pytest.mark.slow
def test_draft_model_greedy_equals_plain_greedy_on_the_default_model(llm):
    """The default model drafting for itself (fp32, eager; the only model here with its tokenizer): the same tokens as
    plain greedy decoding, and the draft's greedy continuation is the target's, so nearly every proposal is taken
    (a near-tie between the verify call's and the decode call's rounding may reject one)."""
    from neuron_opt.runtime.speculative import SpeculativeConfig

    spec_llm = LLM("default", max_model_len=512, num_speculative_tokens=4)
    prompt = spec_llm.encode_chat([{"role": "user", "content": "Tell me about the moon."}])
    params = SamplingParams(max_tokens=N_TOKENS, min_tokens=N_TOKENS)
    out, stats = spec_llm.generate_ids_speculative(prompt, params, SpeculativeConfig(
        4, "draft_model", adaptive=False, model="default"))
    assert out.token_ids == llm.generate_ids(prompt, params).token_ids
    assert stats.accepted_tokens >= 0.9 * stats.draft_tokens > 0, stats


@pytest.mark.slow
@pytest.mark.skipif(not onednn_bf16_supported(), reason="bf16 cpu graphs need oneDNN bf16 (AVX-512 BW/VL/DQ or "
                    "AVX-NE-CONVERT); the cpu backend refuses bf16 on this CPU")
def test_bf16_compiled_speculative_greedy_equals_plain_greedy(tmp_path):
    """The default model compiled in bf16 with verify graphs (exact_verify, the default): prompt lookup over a
    grounded prompt gives plain greedy's tokens through the same artifact, 128 of them, with or without the
    adaptive rule. (With exact_verify=off such texts diverged after a few dozen tokens: docs/speculative.md.)"""
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.runtime.speculative import SpeculativeConfig

    compile_artifact(CompileRequest(model="default", out=tmp_path / "art", dtype="bfloat16", batch_size=1,
                                    max_model_len=512, num_speculative_tokens=8, cache_dir=tmp_path / "cache"),
                     log=lambda s: None, progress=False)
    spec_llm = LLM(tmp_path / "art")
    text = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
            "    return 2 * (width + height)\n\n\nprint(area(3, 4), perimeter(3, 4))\n")
    prompt = spec_llm.encode_chat([{"role": "user", "content": f"Repeat this code exactly, twice:\n\n{text}"}])
    params = SamplingParams(max_tokens=2 * N_TOKENS, min_tokens=2 * N_TOKENS)
    for adaptive in (False, True):
        out, stats = spec_llm.generate_ids_speculative(prompt, params, SpeculativeConfig(8, adaptive=adaptive))
        assert out.token_ids == spec_llm.generate_ids(prompt, params).token_ids
        # always verifying takes at least half the answer from proposals; the adaptive rule decodes plainly where
        # it expects less than a verify's cost, so fewer
        assert stats.accepted_tokens >= (N_TOKENS // 4 if adaptive else N_TOKENS // 2), stats
