"""Frozen, typed configuration split by owner.

- ModelConfig: what the checkpoint says (HF field names). Built with `ModelConfig.from_hf`.
- ParallelConfig: how the model is split across ranks (tp degree, layouts).
- CacheConfig: KV cache geometry (slots, max length, dtype).
- BucketConfig: which graphs are compiled (prefill seq lengths, decode (batch, kv_len) pairs).

Every dataclass validates itself in `__post_init__` and raises `ConfigError` naming the field.
Change a config with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from neuron_opt.architectures import family_for, supported_architectures
from neuron_opt.errors import ConfigError
from neuron_opt.headers import read_json_capped

DTYPES = ("float32", "bfloat16", "float16")
FP8_STORAGE = "float8_e4m3fn"  # the stored dtype of KVCacheDtype.FP8
KV_CACHE_DTYPES = DTYPES + (FP8_STORAGE,)  # what CacheConfig.dtype holds: the KV pools' stored dtype


class KVCacheDtype(str, Enum):
    """The KV cache dtype asked for, one name from the CLI (`compile --kv-cache-dtype`) to the kernels.

    AUTO stores K and V in the compute dtype; FP8 in float8 e4m3 with per-layer scales calibrated at compile time
    and folded into the weights (neuron_opt.quant.kv). `storage` names the stored dtype, which is what
    `CacheConfig.dtype` holds (so manifests keep their `cache.dtype`); `CacheConfig.kv_cache_dtype` reads it back.
    """

    AUTO = "auto"
    FP8 = "fp8"

    def storage(self, compute: str) -> str:
        """The KV pools' dtype name for a model computing in `compute`."""
        return FP8_STORAGE if self is KVCacheDtype.FP8 else compute

    @classmethod
    def parse(cls, value: Any) -> KVCacheDtype:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"kv_cache_dtype: must be {' or '.join(d.value for d in cls)}, got {value!r}") from None
QUANT_METHODS = ("int8", "int4", "fp8")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation: SwiGLU (Llama) or GeGLU (Gemma)
LAYER_TYPES = ("full_attention", "sliding_attention")
NORM_LAYOUTS = ("pre", "sandwich", "post")
POOLING_MODES = ("last", "mean", "cls")  # ModelConfig.pooling: an embedding model's pooling step
QUANT_TYPES = ("per_channel_symmetric", "per_tensor_symmetric", "group_asymmetric", "group_symmetric")


def torch_dtype(name: str) -> Any:
    """The torch dtype named `name` (one of KV_CACHE_DTYPES); torch is imported here, not when config is."""
    import torch

    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"dtype: must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return getattr(torch, name)


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a Llama-family checkpoint (HF names)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_parameters: tuple[tuple[str, Any], ...] = (("rope_type", "default"), ("rope_theta", 10000.0))
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2: True)
    o_bias: bool = False  # bias on o_proj (Llama's attention_bias covers o_proj too)
    mlp_bias: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rope (Qwen3-MoE: q_norm, k_norm)
    # Mixture of experts (num_experts 0: a dense model). Every decoder layer is sparse: a router picks
    # num_experts_per_tok of num_experts expert MLPs (SwiGLU, moe_intermediate_size wide) per token, softmax over
    # all experts then top-k, renormalised over the k when norm_topk_prob (Mixtral always); Qwen2-MoE adds a
    # shared expert (shared_expert_intermediate_size wide) scaled by sigmoid(shared_expert_gate(x)). No token is
    # dropped (no capacity factor).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Per-family options (docs/models.md); every default is Llama's behaviour.
    # layer_types: per layer "full_attention" or "sliding_attention" (Gemma 2/3, Qwen3, SmolLM3: sliding layers
    # attend to the last `sliding_window` positions, full ones to all); () = every layer attends with
    # `sliding_window` (None: all positions), as Mistral does.
    layer_types: tuple[str, ...] = ()
    # rotary embedding of the sliding layers when it differs from the full layers' (Gemma 3's local base); ()
    # = rope_parameters
    rope_local_parameters: tuple[tuple[str, Any], ...] = ()
    nope_layers: tuple[int, ...] = ()  # layers without rotary embeddings (SmolLM3's no_rope_layers flags = 0)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma stores w for (1 + w)
    # where the decoder's RMSNorms sit: "pre" (Llama: before attention and MLP), "sandwich" (Gemma 2/3: before and
    # after each), "post" (OLMo 2: after each, on the branch output, before the residual add)
    norm_layout: str = "pre"
    qk_norm_full: bool = False  # the q/k norms span all heads' features (OLMo 2), not each head's head_dim
    embedding_multiplier: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size); Granite)
    residual_multiplier: float = 1.0  # each branch's output times this before the residual add (Granite)
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar
    # ** -0.5; Granite: attention_multiplier)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3); they are split into
    # the canonical q/k/v_proj and gate/up_proj at load (neuron_opt.checkpoint), so sharding and every backend see
    # the canonical names
    fused_projections: bool = False
    # GPT-OSS (docs/models.md): a learned logit per query head joins each row's softmax and takes its share of the
    # probability without a value (attention_sinks); the router has a bias and takes the top k of its logits, then
    # a softmax over those k (router_bias, router_topk_softmax); each expert's projections have biases
    # (expert_bias) and apply the clamped SwiGLU (up + 1) * g * sigmoid(swiglu_alpha * g), g = gate clamped above
    # at swiglu_limit, up clamped to [-limit, limit] (swiglu_limit None: silu(gate) * up); experts_mxfp4: the
    # checkpoint stores the expert projections as MXFP4 blocks and scales, dequantized at load (models.gpt_oss)
    attention_sinks: bool = False
    router_bias: bool = False
    router_topk_softmax: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    experts_mxfp4: bool = False
    # Embedding models (docs/embeddings.md). pooling None: a generation model (its LM head gives logits); "last",
    # "mean" or "cls": the final norm's hidden states pooled into one vector per sequence (no LM head), then
    # L2-normalised when normalize_embeddings. matryoshka_dims: the sizes a request may truncate the vector to
    # (`dimensions`); () = none. Set from a sentence-transformers checkpoint or `compile --task embed`.
    pooling: str | None = None
    normalize_embeddings: bool = False
    matryoshka_dims: tuple[int, ...] = ()
    # how an embedding model's texts become tokens (neuron_opt.embeddings.text_ids): None, as they are; "flat" or
    # "structured", one user message through the chat template with embedding_template_kwargs (a JSON object)
    embedding_messages: str | None = None
    embedding_template_kwargs: str = ""
    # M-RoPE (Qwen2.5-VL, docs/multimodal.md): the rotary pairs of the temporal, height and width position axes, in
    # that order (sum: rotary_dim / 2); () = one position axis
    mrope_section: tuple[int, ...] = ()
    # Qwen3-VL: the sections' pairs interleaved (height and width every third pair from the second and third,
    # models.llama.mrope_axes) rather than consecutive
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _check(int(getattr(self, name)) > 0, name, f"must be a positive integer, got {getattr(self, name)!r}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
               f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}")
        _check(self.head_dim % 2 == 0, "head_dim", f"must be even for rotary embeddings, got {self.head_dim}")
        _check(self.hidden_act in HIDDEN_ACTS, "hidden_act",
               f"must be one of {', '.join(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        _check(not (self.num_experts and self.hidden_act != "silu"), "hidden_act",
               f"mixture-of-experts blocks are SwiGLU (silu); {self.hidden_act!r} is not supported with num_experts")
        _check(self.sliding_window is None or self.sliding_window > 0, "sliding_window",
               f"must be positive or None, got {self.sliding_window}")
        rope_type = self.rope.get("rope_type", "default")
        _check(rope_type in ROPE_TYPES, "rope_parameters.rope_type",
               f"{rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        _check(rope_type != "dynamic" or not self.rope_local_parameters, "rope_parameters.rope_type",
               "'dynamic' with a rotary embedding of its own on sliding layers is not supported")
        self._check_rope()
        _check(not self.mrope_section or (len(self.mrope_section) == 3
                                          and sum(self.mrope_section) * 2 == self.rotary_dim),
               "rope_parameters.mrope_section", f"3 sections summing to rotary_dim / 2 = {self.rotary_dim // 2}, "
               f"got {self.mrope_section}")
        _check(self.mrope_section or not self.mrope_interleaved, "rope_parameters.mrope_interleaved",
               "needs mrope_section")
        self._check_family_options()
        self._check_embedding()
        if self.num_experts:
            _check(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                   f"must be in 1..num_experts={self.num_experts}, got {self.num_experts_per_tok}")
            _check(self.moe_intermediate_size > 0, "moe_intermediate_size",
                   f"must be a positive integer, got {self.moe_intermediate_size}")
        else:
            _check(not (self.num_experts_per_tok or self.shared_expert_intermediate_size), "num_experts",
                   "num_experts_per_tok / shared_expert_intermediate_size need num_experts > 0")

    def _check_rope(self) -> None:
        rope = self.rope
        f = rope.get("partial_rotary_factor", 1.0)
        _check(isinstance(f, (int, float)) and 0 < f <= 1, "rope_parameters.partial_rotary_factor",
               f"must be in (0, 1], got {f!r}")
        _check(self.rotary_dim >= 2 and self.rotary_dim % 2 == 0, "rope_parameters.partial_rotary_factor",
               f"head_dim={self.head_dim} x {f} gives {self.rotary_dim} rotary features; it must be even and >= 2")
        if rope.get("rope_type") == "dynamic":
            factor = rope.get("factor")
            _check(isinstance(factor, (int, float)) and factor >= 1, "rope_parameters.factor",
                   f"dynamic NTK scaling needs a factor >= 1, got {factor!r}")
        if rope.get("rope_type") != "longrope":
            return
        orig = rope.get("original_max_position_embeddings")
        _check(isinstance(orig, int) and orig > 0, "rope_parameters.original_max_position_embeddings",
               f"longrope needs a positive integer, got {orig!r}")
        for name in ("short_factor", "long_factor"):
            v = rope.get(name)
            _check(isinstance(v, (tuple, list)) and len(v) == self.rotary_dim // 2
                   and all(isinstance(x, (int, float)) and x > 0 for x in v), f"rope_parameters.{name}",
                   f"longrope needs {self.rotary_dim // 2} positive numbers (one per rotary pair), got {v!r}")

    @property
    def max_model_len_limit(self) -> int:
        """The longest sequence the model's rotary embedding serves: max_position_embeddings, or for dynamic NTK
        scaling (whose frequencies stretch past it) max_position_embeddings x factor, as vLLM derives it."""
        if self.rope.get("rope_type") == "dynamic":
            return int(self.max_position_embeddings * float(self.rope["factor"]))
        return self.max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        """Features of each head that rope rotates (the first ones; Phi-4-mini: 0.75 of head_dim); the rest pass
        through."""
        return int(self.head_dim * self.rope.get("partial_rotary_factor", 1.0))

    def _check_family_options(self) -> None:
        L = self.num_hidden_layers
        if self.layer_types:
            _check(len(self.layer_types) == L, "layer_types",
                   f"has {len(self.layer_types)} entries for num_hidden_layers={L}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            _check(not bad, "layer_types", f"unknown layer types {bad}; supported: {', '.join(LAYER_TYPES)}")
            _check(self.sliding_window is not None or "sliding_attention" not in self.layer_types, "sliding_window",
                   "layer_types has sliding_attention layers but no sliding_window is given")
        if self.rope_local_parameters:
            local = dict(self.rope_local_parameters).get("rope_type", "default")
            kinds = [k for k in ROPE_TYPES if k != "dynamic"]  # a per-call base: the global rope's alone
            _check(local in kinds, "rope_local_parameters.rope_type",
                   f"{local!r} is not supported on sliding layers (supported: {', '.join(kinds)})")
            _check("sliding_attention" in self.layer_types, "rope_local_parameters",
                   "a rotary embedding for sliding layers needs layer_types with sliding_attention layers")
        bad_layers = [i for i in self.nope_layers if not 0 <= i < L]
        _check(not bad_layers, "nope_layers", f"layers {bad_layers} do not exist (num_hidden_layers={L})")
        _check(self.norm_layout in NORM_LAYOUTS, "norm_layout",
               f"must be one of {', '.join(NORM_LAYOUTS)}, got {self.norm_layout!r}")
        _check(self.qk_norm or not self.qk_norm_full, "qk_norm_full", "needs qk_norm")
        _check(not (self.fused_projections and self.num_experts), "fused_projections",
               "fused gate_up_proj checkpoints are dense; a mixture of experts has no such projection")
        for name in ("router_bias", "router_topk_softmax", "expert_bias", "experts_mxfp4"):
            _check(not getattr(self, name) or self.num_experts, name, "applies to mixture-of-experts models only "
                   "(num_experts > 0)")
        _check((self.swiglu_limit is None) == (self.swiglu_alpha is None), "swiglu_limit",
               f"the clamped SwiGLU needs both swiglu_limit and swiglu_alpha, got {self.swiglu_limit!r} and "
               f"{self.swiglu_alpha!r}")
        if self.swiglu_limit is not None:
            _check(self.num_experts > 0, "swiglu_limit", "the clamped SwiGLU applies to experts (num_experts > 0)")
            _check(float(self.swiglu_limit) > 0 and float(self.swiglu_alpha) > 0, "swiglu_limit",
                   f"swiglu_limit and swiglu_alpha must be positive, got {self.swiglu_limit!r} and "
                   f"{self.swiglu_alpha!r}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            _check(float(getattr(self, name)) > 0, name, f"must be positive, got {getattr(self, name)!r}")
        for name in ("attention_scale", "attn_logit_softcapping", "final_logit_softcapping"):
            v = getattr(self, name)
            _check(v is None or float(v) > 0, name, f"must be positive or None, got {v!r}")

    def _check_embedding(self) -> None:
        _check(self.pooling is None or self.pooling in POOLING_MODES, "pooling",
               f"must be one of {', '.join(POOLING_MODES)}, got {self.pooling!r}")
        _check(self.pooling is None or not self.num_experts, "pooling",
               "embedding models of mixture-of-experts architectures are not supported")
        _check(self.pooling is not None or not (self.normalize_embeddings or self.matryoshka_dims),
               "normalize_embeddings", "normalization and matryoshka_dims belong to embedding models (pooling)")
        _check(self.embedding_messages in (None, "flat", "structured"), "embedding_messages",
               f"must be flat or structured, got {self.embedding_messages!r}")
        _check(self.pooling is not None or not (self.embedding_messages or self.embedding_template_kwargs),
               "embedding_messages", "a chat-template rendering of texts belongs to embedding models (pooling)")
        bad = [d for d in self.matryoshka_dims if not 1 <= int(d) <= self.hidden_size]
        _check(not bad, "matryoshka_dims", f"{bad} are not in 1..hidden_size={self.hidden_size}")

    @property
    def is_embedding(self) -> bool:
        """An embedding model: pooled vectors, no LM head (`pooling`)."""
        return self.pooling is not None

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer `i` (None: it attends to every earlier position)."""
        if self.layer_types and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def mixed_windows(self) -> bool:
        """Whether some layers slide and others do not (a compiled layer graph then takes the window as input)."""
        return len({self.layer_window(i) for i in range(self.num_hidden_layers)}) > 1

    def layer_rope(self, i: int) -> str:
        """Which rotary table layer `i` uses: "global" (rope_parameters), "local" (rope_local_parameters: Gemma 3's
        sliding layers) or "none" (SmolLM3's NoPE layers)."""
        if i in self.nope_layers:
            return "none"
        if self.rope_local_parameters and self.layer_window(i) is not None:
            return "local"
        return "global"

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.attention_scale is None else float(self.attention_scale)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_parameters)

    @property
    def rope_theta(self) -> float:
        return float(self.rope.get("rope_theta", 10000.0))

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self) -> int:
        """Exact parameter count (embeddings counted once when tied)."""
        H, D, L, V = self.hidden_size, self.head_dim, self.num_hidden_layers, self.vocab_size
        nq, nkv = self.num_attention_heads, self.num_key_value_heads
        attn = H * nq * D + 2 * H * nkv * D + nq * D * H
        if self.attention_bias:
            attn += nq * D + 2 * nkv * D
        if self.o_bias:
            attn += H
        if self.qk_norm:
            attn += (nq + nkv) * D if self.qk_norm_full else 2 * D
        if self.attention_sinks:
            attn += nq
        mlp = self._mlp_parameters()
        per_layer = attn + mlp + H * len(norm_roles(self.norm_layout))
        head = 0 if self.tie_word_embeddings or self.is_embedding else V * H  # an embedding model has no head
        return L * per_layer + V * H + H + head

    def active_parameters(self) -> int:
        """Parameters one token reads: all but the experts it is not routed to (= num_parameters if dense)."""
        if not self.is_moe:
            return self.num_parameters()
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_parameters() - self.num_hidden_layers * idle * self.expert_parameters()

    def expert_parameters(self) -> int:
        """One expert's parameters: gate, up and down projections, and their biases (GPT-OSS)."""
        H, I = self.hidden_size, self.moe_intermediate_size
        return 3 * H * I + (2 * I + H if self.expert_bias else 0)

    def _mlp_parameters(self) -> int:
        H = self.hidden_size
        if not self.is_moe:
            I = self.intermediate_size
            return 3 * H * I + (2 * I + H if self.mlp_bias else 0)
        shared = self.shared_expert_intermediate_size
        router = self.num_experts * H + (self.num_experts if self.router_bias else 0)
        return self.num_experts * self.expert_parameters() + router + (3 * H * shared + H if shared else 0)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a `transformers` config object, a config dict, or a path to config.json / its directory."""
        if isinstance(hf, (str, Path)):
            p = Path(hf)
            p = p / "config.json" if p.is_dir() else p
            if not p.exists():
                raise ConfigError(f"config: {p} does not exist")
            hf = read_json_capped(p, ConfigError, "config")  # a size cap first: it is someone else's file
        if isinstance(hf, dict):
            # transformers here, not at the top: the CLI's parser imports this module, and importing transformers
            # may import a device runtime (executors.loader)
            from transformers import AutoConfig

            d = dict(hf)
            model_type = d.pop("model_type", None)
            if model_type is None:
                raise ConfigError("config: no 'model_type' field; is this a Hugging Face config.json?")
            try:
                hf = AutoConfig.for_model(model_type, **d)
            except ValueError as e:
                raise ConfigError(f"config: unknown model_type {model_type!r} ({e}); supported architectures: "
                                  f"{', '.join(supported_architectures())}") from None
        archs = getattr(hf, "architectures", None) or []
        arch = archs[0] if archs else _DEFAULT_ARCHS.get(hf.model_type, hf.model_type)
        family_for(arch)  # raises UnsupportedModelError with the supported list
        n_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        local: dict[str, Any] = {}
        if "full_attention" in rope or "sliding_attention" in rope:  # per layer type (Gemma 3)
            local = dict(rope.get("sliding_attention") or {})
            rope = dict(rope.get("full_attention") or {})
        mrope = tuple(int(x) for x in rope.pop("mrope_section", None) or ())
        mrope_interleaved = bool(rope.pop("mrope_interleaved", False))
        rope.setdefault("rope_theta", float(getattr(hf, "rope_theta", 10000.0)))
        rope.setdefault("rope_type", "default")
        if rope["rope_type"] == "su":  # longrope's earlier name (Phi-3 configs)
            rope["rope_type"] = "longrope"
        if rope["rope_type"] == "longrope":
            rope.pop("type", None)  # the old key beside rope_type (transformers keeps both)
        if local:
            local.setdefault("rope_type", "default")
            if local == rope:
                local = {}
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        is_qwen2 = hf.model_type in ("qwen2", "qwen2_moe")  # q/k/v bias (Qwen2-MoE: `qkv_bias`), no o bias
        attention_bias = bool(getattr(hf, "qkv_bias", True)) if is_qwen2 else bool(getattr(hf, "attention_bias", False))
        sliding = getattr(hf, "sliding_window", None)
        mt = hf.model_type
        if (mt.startswith("qwen") or mt == "smollm3") and not getattr(hf, "use_sliding_window", False):
            sliding = None
        layer_types: tuple[str, ...] = ()
        if mt in _PER_LAYER_WINDOWS and sliding is not None and getattr(hf, "layer_types", None):
            layer_types = tuple(hf.layer_types)
            if "sliding_attention" not in layer_types:
                sliding, layer_types = None, ()
            elif "full_attention" not in layer_types:
                layer_types = ()  # every layer slides: the model-wide window
        if not layer_types:
            local = {}  # no sliding layers of their own: one rotary table
        moe = _moe_fields(hf)
        fam = _family_fields(hf)
        return cls(
            architecture=arch,
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=hf.max_position_embeddings,
            rope_parameters=tuple(sorted((k, _freeze(v)) for k, v in rope.items())),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_bias=bool(getattr(hf, "attention_bias", False)) and not is_qwen2,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=sliding,
            hidden_act=getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu"),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            qk_norm=mt in ("qwen3_moe", "qwen3", "gemma3_text", "olmo2"),
            layer_types=layer_types,
            rope_local_parameters=tuple(sorted((k, _freeze(v)) for k, v in local.items())),
            mrope_section=mrope,
            mrope_interleaved=mrope_interleaved,
            **moe,
            **fam,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_parameters"] = self.rope
        d["rope_local_parameters"] = dict(self.rope_local_parameters)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
        d["nope_layers"] = list(self.nope_layers)
        d["matryoshka_dims"] = list(self.matryoshka_dims)
        if self.mrope_section:
            d["mrope_section"] = list(self.mrope_section)
        else:  # absent unless set: manifests and compile-cache keys of every other model stay as they were
            del d["mrope_section"]
        if not self.mrope_interleaved:
            del d["mrope_interleaved"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        for key in ("rope_parameters", "rope_local_parameters"):
            if key in d:
                d[key] = tuple(sorted((k, _freeze(v)) for k, v in d[key].items()))
        for key in ("eos_token_ids", "layer_types", "nope_layers", "matryoshka_dims", "mrope_section"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


_DEFAULT_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
                  "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# model types whose sliding window applies to the layers `layer_types` marks sliding_attention only (transformers'
# Mistral and Qwen2 apply theirs to every layer)
_PER_LAYER_WINDOWS = ("qwen3", "gemma2", "gemma3_text", "smollm3", "gpt_oss")


def norm_roles(layout: str) -> tuple[str, ...]:
    """The decoder layer's RMSNorms under `layout` (ModelConfig.norm_layout), in order, by role: attn_in / mlp_in
    normalise a branch's input, attn_out / mlp_out its output."""
    return {"pre": ("attn_in", "mlp_in"), "sandwich": ("attn_in", "attn_out", "mlp_in", "mlp_out"),
            "post": ("attn_out", "mlp_out")}[layout]


def _family_fields(hf: Any) -> dict[str, Any]:
    """The per-family options of a transformers config (ModelConfig's fields after norm_topk_prob)."""
    mt = hf.model_type
    out: dict[str, Any] = {}
    if mt in ("gemma2", "gemma3_text"):
        out.update(norm_offset=1.0, norm_layout="sandwich", embedding_multiplier=float(hf.hidden_size) ** 0.5,
                   attention_scale=float(hf.query_pre_attn_scalar) ** -0.5,
                   attn_logit_softcapping=getattr(hf, "attn_logit_softcapping", None),
                   final_logit_softcapping=getattr(hf, "final_logit_softcapping", None))
    elif mt == "olmo2":
        out.update(norm_layout="post", qk_norm_full=True)
    elif mt == "granite":
        out.update(embedding_multiplier=float(hf.embedding_multiplier),
                   residual_multiplier=float(hf.residual_multiplier),
                   attention_scale=float(hf.attention_multiplier), logits_scaling=float(hf.logits_scaling))
    elif mt == "smollm3":
        flags = list(getattr(hf, "no_rope_layers", None) or [])
        out.update(nope_layers=tuple(i for i, use_rope in enumerate(flags) if not use_rope))
    elif mt == "phi3":
        out.update(fused_projections=True)
    elif mt == "gpt_oss":
        quant = getattr(hf, "quantization_config", None) or {}
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if method not in (None, "mxfp4"):
            raise ConfigError(f"quantization_config.quant_method: {method!r} is not supported for gpt_oss "
                              "checkpoints; supported: mxfp4 (as published) or none (float experts)")
        out.update(attention_sinks=True, router_bias=True, router_topk_softmax=True, expert_bias=True,
                   swiglu_limit=float(hf.swiglu_limit), swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
                   experts_mxfp4=method == "mxfp4")
    return out


def _moe_fields(hf: Any) -> dict[str, Any]:
    """The MoE fields of a transformers config (Mixtral's num_local_experts, Qwen-MoE's num_experts); {} if dense."""
    experts = int(getattr(hf, "num_local_experts", 0) or getattr(hf, "num_experts", 0) or 0)
    if not experts:
        return {}
    n_layers = hf.num_hidden_layers
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    dense = [i for i in range(n_layers) if i in (getattr(hf, "mlp_only_layers", None) or []) or (i + 1) % step]
    if dense:
        raise ConfigError(f"config: layers {dense[:8]} of this {hf.model_type} checkpoint are dense MLPs "
                          f"(decoder_sparse_step={step}, mlp_only_layers={getattr(hf, 'mlp_only_layers', [])}); "
                          "models that mix dense and MoE layers are not supported, only all-MoE ones")
    mixtral = hf.model_type == "mixtral"
    width = hf.model_type in ("mixtral", "gpt_oss")  # intermediate_size is each expert's width
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(hf.intermediate_size if width else hf.moe_intermediate_size),
        shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
        # GPT-OSS's softmax over the top k logits is the renormalised top k of the softmax over all
        norm_topk_prob=True if mixtral or hf.model_type == "gpt_oss" else bool(getattr(hf, "norm_topk_prob", False)),
    )


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor-parallel degree and the collective-communication-aware layouts to use."""

    tp: int = 1
    sequence_parallel: bool = False
    # KV heads fewer than tp: each KV group's ranks split the cache along the sequence (kv-seq-shard). None: auto,
    # decided by compile from the plan's memory (planner.memory.resolve_flash_decoding); elsewhere None is off
    flash_decoding: bool | None = None
    vocab_parallel_sampling: bool = True
    gqa_strategy: str = "auto"  # auto | replicate-kv | mha
    instance: str | None = None
    # MoE experts over the tp ranks (NxDI's moe_ep_degree; moe_tp_degree = tp / ep): each of `ep` groups of
    # tp / ep ranks holds num_experts / ep whole experts, each expert's MLP split over its group's ranks.
    # Attention stays sharded over all tp ranks. ep 1: every expert split over every rank.
    ep: int = 1
    # token-generation graphs (decode, verify) with their own expert layout (NxDI's hybrid_sharding_config:
    # moe_tkg_ep_degree beside moe_cte_ep_degree): None or `ep`, one layout for every graph; another degree, the
    # experts are held a second time in that layout and prefill graphs keep `ep`'s
    ep_decode: int | None = None
    # context-parallel prefill (NxDI's cp_degree): the ranks that share a KV head under flash decoding split a
    # prefill's tokens between them (q/k/v projections of 1/cp of the tokens each, then exchanged); 1: off. It
    # implies the flash-decoding layout and must equal its group size, tp / num_key_value_heads (head_layout)
    cp_degree: int = 1

    def __post_init__(self) -> None:
        _check(isinstance(self.tp, int) and self.tp >= 1, "tp", f"must be an integer >= 1, got {self.tp!r}")
        _check(isinstance(self.cp_degree, int) and self.cp_degree >= 1 and self.tp % self.cp_degree == 0,
               "cp_degree", f"must be an integer >= 1 that divides tp={self.tp}, got {self.cp_degree!r}")
        _check(isinstance(self.ep, int) and self.ep >= 1 and self.tp % self.ep == 0, "ep",
               f"must be an integer >= 1 that divides tp={self.tp} (tp = moe tp x ep), got {self.ep!r}")
        _check(self.ep_decode is None or (isinstance(self.ep_decode, int) and self.ep_decode >= 1
                                          and self.tp % self.ep_decode == 0), "ep_decode",
               f"must be an integer >= 1 that divides tp={self.tp}, got {self.ep_decode!r}")
        _check(self.gqa_strategy in ("auto", "replicate-kv", "mha"), "gqa_strategy",
               f"must be one of auto, replicate-kv, mha; got {self.gqa_strategy!r}")

    @property
    def decode_ep(self) -> int:
        """The expert-parallel degree of token-generation graphs."""
        return self.ep if self.ep_decode is None else self.ep_decode


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization of the decoder's seven linear projections (neuron_opt.quant.weights has the formats).

    `method` None: no quantization. int8 and fp8 (e4m3) take `per_channel_symmetric` (default) or
    `per_tensor_symmetric`; int4 takes `group_asymmetric` (default: a scale and an offset per group of
    `group_size` input features, as GGUF's Q4_1) or `group_symmetric` (Q4_0). `gguf` (only from `--quantize auto`
    on a GGUF file of K-quants, `source` "gguf", quantization_type `blocks`): each linear keeps the file's blocks
    as stored (neuron_opt.quant.gguf); `gguf_widths` gives each linear (by its name within a layer, e.g.
    `mlp.down_proj`, or `lm_head`) the byte width of its rows: the widest its type takes in any layer, so every
    layer's weight has one shape. `modules_to_not_convert`: module
    names (substring match on the full name, as NxDI and HF do) left in the compute dtype. Embeddings and the LM
    head stay in the compute dtype unless `lm_head` (int8 per output channel, fp8 under fp8; a tied head holds its own
    quantized copy of the table, the embedding lookup keeps the float one). `source`: "gguf" when the int4 values
    and scales were taken from the checkpoint's own blocks as stored, "" when compile quantized them.
    """

    method: str | None = None
    quantization_type: str = ""
    group_size: int = 0
    modules_to_not_convert: tuple[str, ...] = ()
    source: str = ""
    lm_head: bool = False  # also quantize the LM head, per channel (int8; fp8 under fp8); embeddings stay
    gguf_widths: tuple[tuple[str, int], ...] = ()  # gguf only: (linear name within a layer, row bytes)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gguf_widths", tuple((str(n), int(w)) for n, w in self.gguf_widths))
        if self.method is None:
            _check(not self.modules_to_not_convert, "modules_to_not_convert", "needs a quantization method")
            _check(not self.lm_head, "quantize_lm_head", "needs a quantization method")
            return
        if self.method == "gguf":
            _check(self.source == "gguf" and self.quantization_type in ("", "blocks") and not self.group_size,
                   "quantize", "gguf keeps a GGUF file's K-quant blocks as stored: --quantize auto chooses it for "
                   "such a file; name int8, int4 or fp8 otherwise")
            _check(bool(self.gguf_widths), "quantize", "gguf needs the row width of each linear (gguf_widths)")
            object.__setattr__(self, "quantization_type", "blocks")
            object.__setattr__(self, "modules_to_not_convert", tuple(self.modules_to_not_convert))
            return
        _check(not self.gguf_widths, "quantize", f"gguf_widths applies to gguf only, not {self.method}")
        _check(self.method in QUANT_METHODS, "quantize", f"must be one of {', '.join(QUANT_METHODS)}; "
               f"got {self.method!r}")
        qtype = self.quantization_type or ("group_asymmetric" if self.method == "int4" else "per_channel_symmetric")
        object.__setattr__(self, "quantization_type", qtype)
        _check(qtype in QUANT_TYPES, "quantization_type", f"must be one of {', '.join(QUANT_TYPES)}; got {qtype!r}")
        grouped = qtype.startswith("group_")
        _check(grouped == (self.method == "int4"), "quantization_type",
               f"{qtype} does not apply to {self.method}: int4 is group-wise (group_asymmetric, group_symmetric), "
               "int8 and fp8 are per_channel_symmetric or per_tensor_symmetric")
        if grouped:
            size = self.group_size or 32
            object.__setattr__(self, "group_size", size)
            _check(size in (32, 64, 128, 256), "group_size", f"must be 32, 64, 128 or 256, got {size}")
        else:
            _check(self.group_size == 0, "group_size", f"applies to int4 only, got {self.group_size} for "
                   f"{self.method}")
        object.__setattr__(self, "modules_to_not_convert", tuple(self.modules_to_not_convert))

    def head_config(self) -> QuantConfig:
        """The LM head's format: int8 per channel under int4 linears, else the linears' own."""
        if self.method == "gguf":  # the head's blocks as stored too
            return dataclasses.replace(self, modules_to_not_convert=(), lm_head=False)
        method = "int8" if self.method == "int4" else self.method
        return QuantConfig(method, "per_channel_symmetric")

    def gguf_width(self, module_name: str) -> int:
        """The row bytes of the linear named `module_name` (model.layers.3.mlp.down_proj, lm_head) under gguf."""
        for name, width in self.gguf_widths:
            if module_name == name or module_name.endswith("." + name):
                return width
        raise ConfigError(f"quantize gguf: no row width for {module_name} (gguf_widths names "
                          f"{', '.join(n for n, _ in self.gguf_widths)})")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def converts(self, module_name: str) -> bool:
        """Whether the linear named `module_name` (e.g. model.layers.3.mlp.up_proj) is quantized."""
        return self.enabled and not any(key in module_name for key in self.modules_to_not_convert)


@dataclass(frozen=True)
class CacheConfig:
    """KV cache geometry: a pool of `num_blocks` blocks of `block_size` positions, shared by every sequence.

    Block 0 is the null block: padded tokens write it and padded block-table entries point at it; it is never
    given to a sequence. `num_blocks` 0 (the default) sizes the pool for `max_batch` sequences of `max_model_len`
    each, plus the null block; a smaller pool serves mixed lengths in less memory (the scheduler preempts when
    it runs out), a larger one keeps more prefixes cached.

    Window-sized KV (`sliding_window` > 0): the sliding-window layers hold their own, smaller pool of
    `window_num_blocks` blocks, `window_blocks_per_sequence` per sequence (the blocks one step of a sequence can
    see or write: `window_blocks`), and every other layer the pool above. 0: every layer holds the pool above.
    """

    max_batch: int = 1
    max_model_len: int = 2048
    dtype: str = "float32"
    block_size: int = 32
    num_blocks: int = 0
    sliding_window: int = 0  # the window the window pool serves (the largest of the sliding layers'); 0: no pool
    window_blocks_per_sequence: int = 0

    def __post_init__(self) -> None:
        _check(self.max_batch >= 1, "max_batch", f"must be >= 1, got {self.max_batch}")
        _check(self.max_model_len >= 1, "max_model_len", f"must be >= 1, got {self.max_model_len}")
        _check(self.dtype in KV_CACHE_DTYPES, "dtype",
               f"must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.dtype!r}")
        _check(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        if self.num_blocks == 0:
            object.__setattr__(self, "num_blocks", self.max_batch * self.blocks_per_sequence + 1)
        _check(self.num_blocks >= self.blocks_per_sequence + 1, "num_blocks",
               f"must hold at least one sequence of max_model_len={self.max_model_len} ("
               f"{self.blocks_per_sequence} blocks of {self.block_size}) plus the null block, got {self.num_blocks}")

        _check(self.sliding_window >= 0 and (self.window_blocks_per_sequence >= 1) == (self.sliding_window > 0),
               "window_blocks_per_sequence", f"must be >= 1 exactly when sliding_window > 0, got "
               f"{self.window_blocks_per_sequence} for sliding_window={self.sliding_window}")

    @property
    def window_num_blocks(self) -> int:
        """Blocks of the sliding layers' pool: `window_blocks_per_sequence` for each of max_batch sequences, plus
        the null block; 0 without one."""
        return self.max_batch * self.window_blocks_per_sequence + 1 if self.sliding_window else 0

    def pool_blocks(self, window: int | None) -> int:
        """Blocks of the pool a layer with this sliding window (None: none) holds."""
        return self.window_num_blocks if self.sliding_window and window is not None else self.num_blocks

    @property
    def kv_cache_dtype(self) -> KVCacheDtype:
        """FP8 when the pools are stored in fp8, else AUTO (the compute dtype)."""
        return KVCacheDtype.FP8 if self.dtype == FP8_STORAGE else KVCacheDtype.AUTO

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks one sequence of max_model_len tokens needs."""
        return -(-self.max_model_len // self.block_size)


def window_blocks(window: int, block_size: int, step_tokens: int, max_model_len: int) -> int:
    """Blocks a sequence holds in a sliding-window pool: the keys the first query of a step of up to `step_tokens`
    tokens still sees (positions > its position - window) through the step's last token, ceil((window - 1 +
    step_tokens) / block_size) + 1 (the span straddles block boundaries), at most a whole max_model_len
    sequence's blocks."""
    return min(-(-max_model_len // block_size), -(-(window - 1 + step_tokens) // block_size) + 1)
