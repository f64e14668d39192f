"""A GGUF file's metadata -> ModelConfig: what `ModelConfig.from_hf` builds from the HF config the file was converted
from, as far as the file carries it.

Design decisions
- One table row per GGUF architecture (`general.architecture`, as llama.cpp's convert_hf_to_gguf.py writes it):
  the HF architecture and model type it stands for, and whether the converter permuted the q/k rows (Llama's
  converter class and its subclasses: llama, granite, smollm3; neuron_opt.checkpoint.gguf undoes it).
- Where the converter does not write a value, we take the one llama.cpp's own loader assumes, so a file runs here
  as it runs in llama.cpp: Gemma 2 slides every other layer (the first slides), Gemma 3 five of every six;
  Gemma's softmax scale is head_dim ** -0.5, except in the 27B models (46 / 62 layers), whose
  query_pre_attn_scalar is hidden / heads; SmolLM3 skips rotary on every fourth layer; Qwen2-MoE does not
  renormalise its top-k routing weights, Qwen3-MoE and Mixtral do; GPT-OSS slides every other layer (the first
  slides), clamps its SwiGLU at 7.0 with alpha 1.702 and runs YaRN untruncated, as its HF config states.
- Mistral files are `llama` files (the converter writes no window; llama.cpp applies none) and Mixtral's are
  `llama` files with experts: they load as Llama and as Mixtral.
- What we do not map is refused here, from the header, naming the key: per-layer KV head counts, partial rotary
  outside Phi-3, Llama-3 rope scaling (a `rope_freqs` tensor), OLMo 3's windows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from neuron_opt.architectures import supported_architectures
from neuron_opt.config import ModelConfig
from neuron_opt.errors import CheckpointError, UnsupportedModelError

# GGUF `general.architecture` -> (HF architecture, HF model_type, q/k rows permuted by llama.cpp's converter)
GGUF_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),  # also Mistral; with experts, Mixtral (_config)
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),  # + per-head q/k norms (attn_q_norm, attn_k_norm)
    # Phi-3 / 3.5 / 4-mini: fused attn_qkv and ffn_up (gate rows, then up), partial rotary, longrope's factor sets
    # as the tensors rope_factors_long / rope_factors_short (read into the config, not weights)
    "phi3": ("Phi3ForCausalLM", "phi3", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "olmo2": ("Olmo2ForCausalLM", "olmo2", False),
    "granite": ("GraniteForCausalLM", "granite", True),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", True),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss", False),
}
# tensors that hold config values, not weights (the architectures whose config reads them: gguf_config)
CONFIG_TENSORS = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}
# llama.cpp's sliding-window pattern when a file states none: n means layer i slides when i % n < n - 1
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}
# llama.cpp's model sizes whose Gemma softmax scale is (hidden / heads) ** -0.5: their layer counts
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value of a `gguf.GGUFReader`, `default` when the file lacks the key."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def f32(v: float) -> float:
    """GGUF stores float32; return the shortest decimal that rounds to it (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(v)))


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata and tensor headers (no tensor data is read but Phi-3's
    rope factors)."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported GGUF architectures: "
            f"{', '.join(sorted(GGUF_ARCHS))} (HF: {', '.join(supported_architectures())})")
    hf_arch, model_type, _ = GGUF_ARCHS[arch]

    def key(k: str, default: Any = None, required: bool = False) -> Any:
        v = field(reader, f"{arch}.{k}", default)
        if required and v is None:
            raise CheckpointError(f"checkpoint: {path} has no metadata key {arch}.{k}")
        return v

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(key("embedding_length", required=True))
    n_heads = int(key("attention.head_count", required=True))
    n_kv = key("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer list in some files; we need one value
        if len(set(n_kv)) != 1:
            raise CheckpointError(f"checkpoint: {path} has per-layer KV head counts {n_kv}; not supported")
        n_kv = n_kv[0]
    head_dim = int(key("attention.key_length", hidden // n_heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    rope = dict(_rope(key))
    if rope_dim != head_dim and arch != "phi3":
        raise CheckpointError(f"checkpoint: {path} uses partial rotary ({rope_dim} of {head_dim} dims)")
    if arch == "phi3":  # as HF's Phi3Config always states it (Phi-4-mini: 0.75, the first features rotate)
        rope["partial_rotary_factor"] = rope_dim / head_dim
    if "rope_freqs.weight" in tensors:
        raise CheckpointError(f"checkpoint: {path} carries a rope_freqs tensor (Llama-3 style rope scaling), "
                              "which we do not map back to rope_parameters; use the HF safetensors directory")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise CheckpointError(f"checkpoint: {path} has no token_embd.weight")
    # vocab: the explicit key, else the token list, else (no tokenizer in the file) the embedding rows
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", len(tokens) if tokens is not None else int(embd.shape[-1])))
    if vocab != int(embd.shape[-1]):
        raise CheckpointError(f"checkpoint: {path} says vocab {vocab} but token_embd.weight has "
                              f"{int(embd.shape[-1])} rows")
    n_layers = int(key("block_count", required=True))
    eos = [field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    family: dict[str, Any] = {}
    if arch == "phi3":
        rope.update(_longrope(key, tensors, path, int(key("context_length", 2048))))
        family.update(fused_projections=True,
                      sliding_window=int(key("attention.sliding_window", 0)) or None)  # 0: none (Phi-4-mini)
    elif arch in ("gemma2", "gemma3"):
        family.update(_gemma(arch, key, n_layers, hidden, n_heads, head_dim, rope))
    elif arch == "olmo2":
        if key("attention.sliding_window") is not None:
            raise CheckpointError(f"checkpoint: {path} slides a window on some layers (OLMo 3); only OLMo 2 "
                                  "(full attention everywhere) is supported from GGUF")
        family.update(norm_layout="post", qk_norm_full=True)
    elif arch == "granite":
        family.update(embedding_multiplier=f32(key("embedding_scale", 1.0)),
                      residual_multiplier=f32(key("residual_scale", 1.0)),
                      attention_scale=f32(key("attention.scale", head_dim ** -0.5)),
                      logits_scaling=f32(key("logit_scale", 1.0)))
    elif arch == "smollm3":
        family.update(nope_layers=tuple(i for i in range(n_layers) if (i + 1) % 4 == 0))
    elif arch == "gpt-oss":
        if rope.get("rope_type") == "yarn":
            rope["truncate"] = False
        family.update(_windows(arch, key, n_layers, rope), attention_sinks=True, router_bias=True,
                      router_topk_softmax=True, expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)
    experts = int(key("expert_count", 0) or 0)
    if experts:
        if arch == "llama":
            hf_arch, model_type = "MixtralForCausalLM", "mixtral"
        family.update(num_experts=experts, num_experts_per_tok=int(key("expert_used_count", required=True)),
                      moe_intermediate_size=int(key("expert_feed_forward_length") or key("feed_forward_length")),
                      shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0) or 0),
                      norm_topk_prob=arch != "qwen2moe")
    return ModelConfig(
        architecture=hf_arch,
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        head_dim=head_dim,
        rms_norm_eps=f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 2048)),
        rope_parameters=tuple(sorted(rope.items())),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        **family,
    )


def _gemma(arch: str, key: Any, n_layers: int, hidden: int, n_heads: int, head_dim: int,
           rope: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3's options (HF's _family_fields for gemma2 / gemma3_text), as llama.cpp reads them."""
    scalar = hidden // n_heads if n_layers == _GEMMA_27B_LAYERS[arch] else head_dim
    attn_cap = key("attn_logit_softcapping") if arch == "gemma2" else None
    final_cap = key("final_logit_softcapping")
    out: dict[str, Any] = dict(
        hidden_act="gelu_pytorch_tanh", norm_offset=1.0, norm_layout="sandwich",
        embedding_multiplier=float(hidden) ** 0.5, attention_scale=float(scalar) ** -0.5,
        attn_logit_softcapping=None if attn_cap is None else f32(attn_cap),
        final_logit_softcapping=None if not final_cap else f32(final_cap))
    return out | _windows(arch, key, n_layers, rope)


def _windows(arch: str, key: Any, n_layers: int, rope: dict[str, Any]) -> dict[str, Any]:
    """The sliding window and which layers slide (`layer_types`; none when every layer slides), from
    `attention.sliding_window` and `attention.sliding_window_pattern` or llama.cpp's pattern for `arch`; the
    sliding layers' own rotary table where the file gives them a base (`rope.freq_base_swa`, unscaled)."""
    window = int(key("attention.sliding_window", 4096 if arch == "gemma2" else 0) or 0)
    if not window:
        return {}
    pattern = key("attention.sliding_window_pattern", _SWA_PATTERN[arch])
    if isinstance(pattern, list):  # one flag per layer
        slides = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        slides = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    out: dict[str, Any] = dict(sliding_window=window)
    if all(slides):
        return out  # every layer slides: the model-wide window
    out.update(layer_types=tuple("sliding_attention" if s else "full_attention" for s in slides))
    base = key("rope.freq_base_swa")  # written from HF's rope_parameters["sliding_attention"] (Gemma 3)
    local = {"rope_type": "default", "rope_theta": f32(base)} if base is not None else {}
    if local and local != rope:
        out.update(rope_local_parameters=tuple(sorted(local.items())))
    return out


def _longrope(key: Any, tensors: dict[str, Any], path: Path, max_positions: int) -> dict[str, Any]:
    """A phi3 file's longrope parameters (HF's `rope_parameters` keys), {} for a file without rope factors.

    llama.cpp's converter writes the factor sets as the tensors rope_factors_short / rope_factors_long (float32,
    one factor per rotary pair), the original length as rope.scaling.original_context_length, and the attention
    factor it computed (rope.scaling.attn_factor); an attention factor other than the one HF derives from the two
    lengths (sqrt(1 + ln(s) / ln(original)), s = context / original) is kept as `attention_factor`."""
    names = ("rope_factors_short.weight", "rope_factors_long.weight")
    if not any(n in tensors for n in names):
        return {}
    missing = [n for n in names if n not in tensors]
    orig = key("rope.scaling.original_context_length")
    if missing or orig is None:
        raise CheckpointError(f"checkpoint: {path} has longrope factors but no "
                              f"{missing[0] if missing else 'phi3.rope.scaling.original_context_length'}")
    out: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": int(orig)}
    for name, hf_name in zip(names, ("short_factor", "long_factor"), strict=True):
        out[hf_name] = tuple(f32(x) for x in np.asarray(tensors[name].data, dtype=np.float32).reshape(-1))
    attn = key("rope.scaling.attn_factor")
    s = max_positions / int(orig)
    derived = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(int(orig)))
    if attn is not None and not math.isclose(float(attn), derived, rel_tol=1e-6):
        out["attention_factor"] = f32(attn)
    return out


def _rope(key: Any) -> tuple[tuple[str, Any], ...]:
    rope: dict[str, Any] = {"rope_theta": f32(key("rope.freq_base", 10000.0))}
    kind = key("rope.scaling.type", "none")
    if kind == "none":
        rope["rope_type"] = "default"
    elif kind in ("linear", "yarn"):
        rope["rope_type"] = kind
        rope["factor"] = f32(key("rope.scaling.factor", 1.0))
        orig = key("rope.scaling.original_context_length")
        if kind == "yarn" and orig is not None:
            rope["original_max_position_embeddings"] = int(orig)
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if kind == "yarn" and key(f"rope.scaling.{gguf_name}") is not None:
                rope[hf_name] = f32(key(f"rope.scaling.{gguf_name}"))
    else:
        raise CheckpointError(f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear, "
                              "yarn)")
    return tuple(sorted(rope.items()))
