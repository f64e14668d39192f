"""Tiny random-weight HF checkpoints for the oracle tests (made with `save_pretrained`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _phi3(original: int) -> tuple[str, dict[str, Any]]:
    """Phi-3 with every option on: fused qkv_proj / gate_up_proj, a sliding window (6) on every layer, partial
    rotary (0.75 of head_dim 16: 12 features, 6 pairs) and longrope (short and long factors; its attention factor
    from max_position_embeddings / `original`)."""
    return ("Phi3Config", dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=6, pad_token_id=0,
        original_max_position_embeddings=original,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                             long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0])))


# variant name -> (HF config class name, overrides). Small enough to run in milliseconds.
BASE: dict[str, Any] = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa2": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa4": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16)),
    "llama-mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1)),
    "smollm-like-9-3": ("LlamaConfig", dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                                             tie_word_embeddings=True)),
    "odd-heads-gqa3": ("LlamaConfig", dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=48)),
    "llama3-rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=256))),
    "llama-linear-rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                              rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                   factor=2.0))),
    "llama-bias": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                       mlp_bias=True)),
    # an MLP width no tp > 1 divides (101 is prime): the intermediate dimension is zero-padded per rank
    "llama-odd-mlp": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=101)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "mistral-window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8)),
    # mixtures of experts: 8 experts, top 2 (Mixtral renormalises the two weights; Qwen2-MoE does not and adds a
    # shared expert; Qwen3-MoE renormalises and norms q/k). Widths no tp > 1 divides: experts are padded too
    "mixtral": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                      num_experts_per_tok=2, intermediate_size=40)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=37, norm_topk_prob=False)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=21, norm_topk_prob=True)),
    # families on the same decoder with options (docs/models.md); every option on, windows (6) shorter than the
    # parity tests' texts
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                  use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "gemma2": ("Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=4.0, final_logit_softcapping=2.5, sliding_window=6,
                                    tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
    "olmo2": ("Olmo2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "granite": ("GraniteConfig", dict(num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=12.0,
                                      residual_multiplier=0.22, attention_multiplier=0.2, logits_scaling=8.0)),
    "smollm3": ("SmolLM3Config", dict(num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[1, 0],
                                      use_sliding_window=True, sliding_window=6, tie_word_embeddings=True,
                                      pad_token_id=0)),
    # the short factors only: the parity tests' texts stay below the original length (256)
    "phi3": _phi3(256),
    # GPT-OSS: attention sinks (randomised in make_tiny), a window of 4 on the sliding layer, YaRN past its original
    # length (8), biases everywhere, 8 experts top 2 with the clamped SwiGLU at a limit (0.1) the tiny weights cross,
    # an expert width (32: MXFP4 groups) that tp 3 pads
    "gpt-oss": ("GptOssConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        intermediate_size=32, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=0.1, pad_token_id=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=8, truncate=False))),
}
FAMILIES = ["qwen3", "gemma2", "gemma3", "olmo2", "granite", "smollm3"]
# Texts cross original_max_position_embeddings (12): transformers switches to the long factors for a whole forward
# call once its highest position passes it, so the oracle is HF stepped as generate steps it (test_phi3.py). Dynamic
# NTK scaling likewise recomputes a call's frequencies from its highest position past max_position_embeddings (12
# here: tests/models/test_rope_scaling.py)
LONGROPE: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3-long": _phi3(12),
    "llama-dynamic-rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=12,
                                               rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0,
                                                                    factor=8.0))),
}
# Variants with the default model's vocabulary: make_tiny saves its real tokenizer (and chat template) beside them,
# so CLI / API / server tests run end to end on a model that is fast.
WITH_TOKENIZER: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm-tok": ("LlamaConfig", dict(vocab_size=49152, num_attention_heads=9, num_key_value_heads=3,
                                       hidden_size=72, tie_word_embeddings=True)),
    "smollm-tok-1layer": ("LlamaConfig", dict(vocab_size=49152, num_attention_heads=9, num_key_value_heads=3,
                                              hidden_size=72, tie_word_embeddings=True, num_hidden_layers=1)),
    "gemma2-tok": ("Gemma2Config", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                                        final_logit_softcapping=2.5, sliding_window=6, tie_word_embeddings=True)),
    "mixtral-tok": ("MixtralConfig", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2,
                                          num_local_experts=8, num_experts_per_tok=2, intermediate_size=40)),
    # GGUF conversion tests (tests/neuron_opt/test_gguf_families.py): every family llama.cpp's converter maps, at
    # llama.cpp's fixed conventions, which the files do not carry (SmolLM3: no rotary on every 4th layer; Gemma:
    # query_pre_attn_scalar = head_dim; GPT-OSS: SwiGLU clamp 7). Families whose converter reads a sentencepiece
    # model get a small one there instead of this vocabulary (make_with_sentencepiece takes the other overrides)
    "gguf-llama": ("LlamaConfig", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2)),
    "gguf-qwen2": ("Qwen2Config", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2)),
    "gguf-qwen3": ("Qwen3Config", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       tie_word_embeddings=True)),
    "gguf-phi3": ("Phi3Config", {**_phi3(256)[1], "vocab_size": 49152}),
    "gguf-mistral": ("MistralConfig", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2,
                                           sliding_window=None)),
    "gguf-gemma3": ("Gemma3TextConfig", dict(
        vocab_size=49152, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=6, num_hidden_layers=7, final_logit_softcapping=3.0,
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
    "gguf-olmo2": ("Olmo2Config", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2)),
    "gguf-granite": ("GraniteConfig", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2,
                                           embedding_multiplier=12.0, residual_multiplier=0.22,
                                           attention_multiplier=0.2, logits_scaling=8.0)),
    "gguf-smollm3": ("SmolLM3Config", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2,
                                           num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
                                           tie_word_embeddings=True, pad_token_id=0)),
    "gguf-mixtral": ("MixtralConfig", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2,
                                           num_local_experts=4, num_experts_per_tok=2, intermediate_size=40)),
    "gguf-qwen2-moe": ("Qwen2MoeConfig", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2,
                                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                              shared_expert_intermediate_size=37, norm_topk_prob=False)),
    # GPT-OSS at llama.cpp's fixed SwiGLU clamp (7.0); float experts (the converter writes them as stored)
    "gguf-gpt-oss": ("GptOssConfig", dict(
        vocab_size=49152, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0, pad_token_id=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=8, truncate=False))),
    "gguf-qwen3-moe": ("Qwen3MoeConfig", dict(vocab_size=49152, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=16, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=21, norm_topk_prob=True)),
}


def make_tiny(variant: str, out: Path, seed: int = 0, tokenizer: bool = False, **widths: Any) -> Path:
    """`tokenizer=True` also saves the default model's tokenizer beside any variant, so `compile` accepts it
    (token ids beyond the variant's vocabulary are simply never used); `widths` override the variant's config."""
    import transformers

    cls_name, overrides = {**VARIANTS, **LONGROPE, **WITH_TOKENIZER}[variant]
    cfg = getattr(transformers, cls_name)(**{**BASE, **overrides, **widths}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # HF initialises norms to ones and biases to zeros: randomise them so the oracle test sees them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            elif name.endswith("sinks"):  # GPT-OSS: sink logits that take a real share of each softmax
                p.normal_(0.0, 1.0)
    model.save_pretrained(out)
    if variant in WITH_TOKENIZER:
        from neuron_opt.checkpoint import open_checkpoint

        tok = open_checkpoint("default").tokenizer()
        cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
        model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        model.save_pretrained(out)
        tok.save_pretrained(out)
    elif tokenizer:
        from neuron_opt.checkpoint import open_checkpoint

        open_checkpoint("default").tokenizer().save_pretrained(out)
    return out


def load_hf(d: Path) -> Any:
    """The HF oracle for a tiny checkpoint, fp32, eval. MoE variants use HF's eager (per-expert loop) experts: its
    default grouped-GEMM path refuses the unaligned widths the tiny variants use ("strides should be multiple of
    16 bytes" on the CPU)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                             experts_implementation="eager").eval()
