"""GGUF files (llama.cpp) -> model config, canonical fp32 tensors (HF names) and tokenizer.

Design decisions
- Weights are read only with `gguf` (never unpickled), and dequantized with gguf's own reference code
  (`gguf.quants.dequantize`).
- llama.cpp's converter permutes the rows of Llama q/k projections so that rotary pairs are interleaved (GPT-J
  style). We undo that here, so everything downstream sees one (HF, rotate-half) layout. Qwen2 GGUFs are written
  without the permutation, so none is undone for them.
- Headers are walked with bounds checks first (neuron_opt.headers): a crafted file fails in time and memory
  bounded by its size, never by the counts it declares.
- Reading is uncached here; neuron_opt.checkpoint.cache memoises the slow parts on disk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch

from models.build import split_fused
from neuron_opt.architectures import supported_architectures
from neuron_opt.config import ModelConfig, QuantConfig
from neuron_opt.errors import CheckpointError, UnsupportedModelError
from neuron_opt.headers import check_gguf
from neuron_opt.quant.gguf import FUSED_LINEARS, LINEARS, native_config, q4_block_tensor
from neuron_opt.quant.weights import QuantTensor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# GGUF `general.architecture` -> (HF architecture, HF model_type, q/k rows permuted by llama.cpp's converter)
_GGUF_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),  # + per-head q/k norms (attn_q_norm, attn_k_norm)
    # Phi-3 / 3.5 / 4-mini: fused attn_qkv and ffn_up (gate rows, then up), partial rotary, longrope's factor sets
    # as the tensors rope_factors_long / rope_factors_short (read into the config, not weights)
    "phi3": ("Phi3ForCausalLM", "phi3", False),
}

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# the names an architecture's layers use differently (HF's fused names: models.llama.split_fused splits them)
_GGUF_ARCH_LAYER_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# tensors that hold config values, not weights (the architectures whose config reads them: _gguf_config)
_GGUF_CONFIG_TENSORS = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}


def gguf_weight_tensors(reader: Any) -> list[Any]:
    """A GGUF file's weight tensors: all of them but the config values some architectures store as tensors."""
    skip = _GGUF_CONFIG_TENSORS.get(field(reader, "general.architecture"), ())
    return [t for t in reader.tensors if t.name not in skip]


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """GGUF tensor name -> HF name, e.g. `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; under
    `arch` "phi3", the fused `blk.3.attn_qkv.weight` -> `model.layers.3.self_attn.qkv_proj.weight`."""
    layer_names = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(arch, {})}
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise CheckpointError(f"GGUF tensor {name!r} has no Llama-family equivalent")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp writes `w.reshape(n_heads, 2, D // 2, *rest).swapaxes(1, 2).reshape(w.shape)`: within each head
    the two rotary halves are interleaved. The inverse splits rows as (n_heads, D // 2, 2) and swaps back.
    `n_heads` is the number of query heads for q and of KV heads for k; works for weights and biases.
    """
    half = w.shape[0] // n_heads // 2
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)  # [n_heads * D, *rest]


def field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(v: float) -> float:
    """GGUF stores float32; return the shortest decimal that rounds to it (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(v)))


def gguf_reader(path: Path) -> Any:
    """gguf's reader, after our bounded walk of the header (neuron_opt.headers.check_gguf): the reader allocates
    by the counts the file declares."""
    check_gguf(path)
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on malformed input
        raise CheckpointError(f"checkpoint: {path} is not a readable GGUF file ({e})") from None


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported GGUF architectures: "
            f"{', '.join(sorted(_GGUF_ARCHS))} (HF: {', '.join(supported_architectures())})")
    hf_arch, model_type, _ = _GGUF_ARCHS[arch]

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
    rope = dict(_gguf_rope(key))
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
    eos = [field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    family: dict[str, Any] = {}
    window = None
    if arch == "phi3":
        rope.update(_gguf_longrope(key, tensors, path, int(key("context_length", 2048))))
        window = int(key("attention.sliding_window", 0)) or None  # llama.cpp writes 0 for none (Phi-4-mini)
        family.update(fused_projections=True)
    return ModelConfig(
        architecture=hf_arch,
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_hidden_layers=int(key("block_count", required=True)),
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 2048)),
        rope_parameters=tuple(sorted(rope.items())),
        sliding_window=window,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        **family,
    )


def _gguf_longrope(key: Any, tensors: dict[str, Any], path: Path, max_positions: int) -> dict[str, Any]:
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
        out[hf_name] = tuple(_f32(x) for x in np.asarray(tensors[name].data, dtype=np.float32).reshape(-1))
    attn = key("rope.scaling.attn_factor")
    s = max_positions / int(orig)
    derived = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(int(orig)))
    if attn is not None and not math.isclose(float(attn), derived, rel_tol=1e-6):
        out["attention_factor"] = _f32(attn)
    return out


def _gguf_rope(key: Any) -> tuple[tuple[str, Any], ...]:
    rope: dict[str, Any] = {"rope_theta": _f32(key("rope.freq_base", 10000.0))}
    kind = key("rope.scaling.type", "none")
    if kind == "none":
        rope["rope_type"] = "default"
    elif kind in ("linear", "yarn"):
        rope["rope_type"] = kind
        rope["factor"] = _f32(key("rope.scaling.factor", 1.0))
        orig = key("rope.scaling.original_context_length")
        if kind == "yarn" and orig is not None:
            rope["original_max_position_embeddings"] = int(orig)
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if kind == "yarn" and key(f"rope.scaling.{gguf_name}") is not None:
                rope[hf_name] = _f32(key(f"rope.scaling.{gguf_name}"))
    else:
        raise CheckpointError(f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear, "
                              "yarn)")
    return tuple(sorted(rope.items()))


def gguf_state_dict(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Read and dequantize every weight of a GGUF file into canonical fp32 HF-named tensors (fused projections
    split; no cache)."""
    reader = gguf_reader(path)
    arch = field(reader, "general.architecture")
    permuted = _GGUF_ARCHS[arch][2]
    sd: dict[str, torch.Tensor] = {}
    for t in gguf_weight_tensors(reader):
        name = gguf_to_hf_name(t.name, arch)
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"checkpoint: {path}: tensor {t.name} has type {t.tensor_type.name}, which "
                                  "gguf cannot dequantize") from None
        # GGUF lists dims fastest-first (ne0 = input features); row-major order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape))
        x = torch.from_numpy(np.array(w, dtype=np.float32).reshape(shape))  # [out, in] or [n]
        if permuted and ".self_attn.q_proj." in name:
            x = unpermute_qk(x, cfg.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            x = unpermute_qk(x, cfg.num_key_value_heads)
        sd.update(split_fused(cfg, name, x))  # a fused projection (phi3) as its canonical parts
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _linear_types(reader: Any) -> dict[str, str]:
    """HF name -> GGUF type name of every decoder linear weight (fused ones under their fused names)."""
    out = {}
    arch = field(reader, "general.architecture")
    for t in gguf_weight_tensors(reader):
        name = gguf_to_hf_name(t.name, arch)
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in (*LINEARS, *FUSED_LINEARS):
            out[name] = t.tensor_type.name
    return out



def gguf_native_quant(path: Path, cfg: ModelConfig) -> QuantConfig:
    """The quantization a GGUF file ships with (`--quantize auto`; neuron_opt.quant.gguf.native_config). A file with
    fused projections (phi3) gets the method of its type, but its blocks are not kept as stored (`source` ""): its
    linears are dequantized, split and quantized again at compile time."""
    reader = gguf_reader(path)
    head = {t.name: t.tensor_type.name for t in reader.tensors if t.name in ("output.weight", "token_embd.weight")}
    qc = native_config(set(_linear_types(reader).values()), head.get("output.weight", head.get("token_embd.weight")))
    if cfg.fused_projections and qc.source:
        qc = replace(qc, source="")
    return qc


def _unpermute_quant(t: QuantTensor, n_heads: int) -> QuantTensor:
    """llama.cpp's q/k row permutation undone on every part (rows are output channels in each)."""
    assert t.offset is not None
    return QuantTensor(t.method, unpermute_qk(t.qweight, n_heads).contiguous(),
                       unpermute_qk(t.scale, n_heads).contiguous(), unpermute_qk(t.offset, n_heads).contiguous())




def q4_linears(path: Path, cfg: ModelConfig) -> Iterator[tuple[str, QuantTensor]]:
    """A GGUF file's Q4_0/Q4_1 decoder linears as QuantTensor (HF names), read as stored."""
    reader = gguf_reader(path)
    arch = field(reader, "general.architecture")
    permuted = _GGUF_ARCHS[arch][2]
    for t in gguf_weight_tensors(reader):
        name = gguf_to_hf_name(t.name, arch)
        if t.tensor_type.name not in ("Q4_0", "Q4_1") or name.rsplit(".", 2)[-2] not in LINEARS:
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims fastest-first
        q = q4_block_tensor(t.data, t.tensor_type.name, rows, cols)
        if permuted and ".self_attn.q_proj." in name:
            q = _unpermute_quant(q, cfg.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            q = _unpermute_quant(q, cfg.num_key_value_heads)
        yield name, q


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # as in hf.hf_tokenizer

    reader = gguf_reader(path)  # first: transformers reads the file with gguf's reader too
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint: cannot build a tokenizer from {path} ({e})") from None
    template = field(reader, "tokenizer.chat_template")
    if template is not None and not tok.chat_template:
        tok.chat_template = template
    return tok

