"""Rope scaling kinds as HF configs state them (default, linear, llama3, yarn, longrope, dynamic) against HF
transformers, past 32K positions.

Cheap checks (default suite): each kind's cos/sin at positions past 32K equal HF's rotary embedding for a call
whose highest position is the last of them (longrope: the long factors; dynamic NTK: the base grown for that
length), and dynamic NTK scaling stepped across max_position_embeddings as HF's generate steps it (tests/tiny.py's
llama-dynamic-rope, the threshold at 12). The end-to-end check (slow suite): a tiny checkpoint of each kind answers a
prompt of more than 32K tokens (prefilled in chunks through the engine) with HF's greedy tokens, on the eager
runner (every kind) and on the cpu backend's graphs (dynamic, longrope and yarn). Longrope and dynamic decide
their frequencies per call, so there the prompt stays below the threshold and the decode crosses it (HF's generate:
one call for the prompt, one per token).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import NoTok, check_stepwise_against_hf, eager_runner
from tiny import load_hf

from neuron_opt.config import ModelConfig
from neuron_opt.errors import ConfigError

PAST_32K = 32_768 + 400  # positions looked at / prompt length of the end-to-end check
HEAD_DIM = 16


def long_context_configs(threshold: int) -> dict[str, dict]:
    """rope_parameters (and max_position_embeddings) of each kind at published models' proportions; longrope's
    original length and dynamic's max_position_embeddings are `threshold`."""
    pairs = HEAD_DIM // 2
    return {
        "default": dict(max_position_embeddings=65_536, rope_parameters=dict(rope_type="default", rope_theta=5e5)),
        "linear": dict(max_position_embeddings=65_536,
                       rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=4.0)),
        "llama3": dict(max_position_embeddings=131_072, rope_parameters=dict(  # Llama 3.1
            rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192)),
        "yarn": dict(max_position_embeddings=131_072, rope_parameters=dict(  # Qwen2.5 / Qwen3 with YaRN
            rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32_768)),
        "longrope": dict(max_position_embeddings=131_072,  # Phi-3 128K's proportions
                         rope_parameters=dict(rope_type="longrope", rope_theta=1e4,
                                              original_max_position_embeddings=threshold,
                                              short_factor=[1.0 + 0.05 * i for i in range(pairs)],
                                              long_factor=[1.0 + 1.5 * i for i in range(pairs)])),
        "dynamic": dict(max_position_embeddings=threshold,
                        rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=4.0)),
    }


def hf_config(kind: str, threshold: int, **more):
    from transformers import LlamaConfig

    kw = long_context_configs(threshold)[kind]
    return LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                       architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2, **kw, **more)


@pytest.mark.parametrize("kind", sorted(long_context_configs(1)))
def test_rope_rows_past_32k_equal_hf(kind, tmp_path):
    """Our (cos, sin) at positions 32,768 + [0, 400) of a call reaching the last of them: HF's rotary embedding of
    that call (longrope and dynamic past their threshold, 16K)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from models.llama import layer_rope_inputs, model_rope_tables

    hf = hf_config(kind, 16_384)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    positions = torch.arange(32_768, PAST_32K)[None]  # [1, S]
    want_cos, want_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1), positions)  # [1, S, R]
    (cos, sin), *_ = layer_rope_inputs(cfg, model_rope_tables(cfg, PAST_32K), positions, torch.float32,
                                       torch.tensor([positions.shape[1] - 1]))  # [1, S, 1, R] each
    torch.testing.assert_close(cos[:, :, 0], want_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[:, :, 0], want_sin, atol=1e-5, rtol=0)


def test_dynamic_rope_matches_hf_stepped_across_max_position_embeddings(tiny_dir):
    d = tiny_dir("llama-dynamic-rope")
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope["rope_type"] == "dynamic" and cfg.max_model_len_limit == 12 * 8  # vLLM's limit: the length x factor
    check_stepwise_against_hf(eager_runner(d, max_model_len=64, max_batch=2), load_hf(d))


def test_dynamic_rope_options_are_checked(tiny_dir):
    cfg = ModelConfig.from_hf(tiny_dir("llama-dynamic-rope"))
    with pytest.raises(ConfigError, match="^rope_parameters.factor:"):
        dataclasses.replace(cfg, rope_parameters=(("rope_theta", 1e4), ("rope_type", "dynamic")))


def random_checkpoint(kind: str, threshold: int, out: Path) -> Path:
    """A tiny random Llama with `kind`'s rope (norms randomised as tests/tiny.py does)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(kind, threshold)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    model.save_pretrained(out)
    return out


def engine_greedy(runner, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens through the engine: the prompt prefilled in chunks of the largest prefill bucket."""
    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.sampling import SamplingParams

    engine = Engine(runner, NoTok(), (), max_num_seqs=1, max_num_batched_tokens=runner.max_prompt_len)
    got: list[int] = []
    engine.add_request("0", prompt, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0),
                       lambda o: got.extend(o.new_token_ids))
    while engine.step():
        pass
    return got


def hf_greedy(ck: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(long_context_configs(1)))
def test_greedy_past_32k_tokens_equals_hf_on_eager(kind, tmp_path):
    """A prompt of 33,168 tokens and 6 greedy tokens: HF's generate. Longrope's and dynamic's threshold lies 2
    tokens past the prompt, so their decode switches as HF's does."""
    n = 6
    ck = random_checkpoint(kind, PAST_32K + 2, tmp_path / "ck")
    prompt = torch.randint(3, 257, (PAST_32K,), generator=torch.Generator().manual_seed(3)).tolist()
    want = hf_greedy(ck, prompt, n)
    runner = eager_runner(ck, max_model_len=PAST_32K + n, max_batch=1, block_size=256, prefill_lens=(1024,),
                          decode_kv_lens=(PAST_32K + n,))
    assert engine_greedy(runner, prompt, n) == want


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dynamic", "longrope", "yarn"])  # every kind on eager; on cpu graphs, one cold
def test_greedy_past_32k_tokens_equals_hf_on_cpu_graphs(kind, tmp_path):  # compile each: those decided per call, yarn
    """The same through a compiled cpu artifact (the rope rows are host inputs of its layer graphs; its prefill
    graph splits attention over a context this long)."""
    from neuron_opt.api import LLM
    from neuron_opt.checkpoint import open_checkpoint
    from neuron_opt.compiler import CompileRequest, compile_artifact

    n = 6
    ck = random_checkpoint(kind, PAST_32K + 2, tmp_path / "ck")
    open_checkpoint("default").tokenizer().save_pretrained(ck)  # compile ships a tokenizer; ids past 257 never occur
    prompt = torch.randint(3, 257, (PAST_32K,), generator=torch.Generator().manual_seed(3)).tolist()
    want = hf_greedy(ck, prompt, n)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny graphs: thread barriers cost more than they save
    try:
        req = CompileRequest(model=str(ck), out=tmp_path / "art", backend="cpu", dtype="float32",
                             max_model_len=PAST_32K + n, block_size=256, prefill_buckets=(1024,),
                             decode_buckets=(PAST_32K + n,), decode_batches=(1,), cache_dir=tmp_path / "cache")
        compile_artifact(req, log=lambda s: None, progress=False)
        assert engine_greedy(LLM(tmp_path / "art").runner, prompt, n) == want
    finally:
        torch.set_num_threads(threads)
