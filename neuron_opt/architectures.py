"""Explicit registry: HF `architectures[0]` -> model family. Unknown names fail with the supported list.

Data only, importing neither `neuron_opt.config` (which checks a checkpoint's architecture against it) nor `models`
(whose `build.py` maps a family to its classes): both depend on it, so the packages stay one-way."""

from __future__ import annotations

from neuron_opt.errors import UnsupportedModelError

# SmolLM2 checkpoints declare LlamaForCausalLM.
_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    # the same decoder with per-family options (ModelConfig: norms, multipliers, soft-capping, layer types)
    "Qwen3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "llama",
    "Gemma3ForCausalLM": "llama",
    "Olmo2ForCausalLM": "llama",
    "GraniteForCausalLM": "llama",
    "SmolLM3ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",  # Phi-3, Phi-3.5-mini, Phi-4-mini: fused projections split at load, longrope
    "MixtralForCausalLM": "moe",
    "Qwen2MoeForCausalLM": "moe",
    "Qwen3MoeForCausalLM": "moe",
    # attention sinks, a biased router, clamped SwiGLU experts with biases, MXFP4 experts dequantized at load
    "GptOssForCausalLM": "moe",
}
# The bare decoders (no LM head; their checkpoints usually name weights without `model.`): embedding models only
# (`compile --task embed`, docs/embeddings.md)
_BARE: dict[str, str] = {
    "LlamaModel": "llama",
    "MistralModel": "llama",
    "Qwen2Model": "llama",
    "Qwen3Model": "llama",
}


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES) + [f"{a} (embeddings only)" for a in sorted(_BARE)]


def is_bare_model(architecture: str) -> bool:
    """A bare decoder (`Qwen3Model`, ...): no LM head, weights named without `model.`; embedding models only."""
    return architecture in _BARE


def family_for(architecture: str) -> str:
    try:
        return _FAMILIES[architecture] if architecture in _FAMILIES else _BARE[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None

