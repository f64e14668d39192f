"""GGUF files (llama.cpp) -> canonical fp32 tensors (HF names), the quantization they ship, and tokenizer (the
config: neuron_opt.checkpoint.gguf_config).

Design decisions
- Weights are read only with `gguf` (never unpickled), and dequantized with gguf's own reference code
  (`gguf.quants.dequantize`). Every tensor type is checked against the types we read (neuron_opt.quant.gguf's
  AUTO_FORMATS) from the header, before any tensor is read.
- We undo what llama.cpp's converter does to the HF tensors, so everything downstream sees one (HF) layout: it
  permutes the rows of Llama-style q/k projections so that rotary pairs are interleaved (GPT-J style; llama,
  granite, smollm3 files); it stores Gemma's norms as 1 + w; it stacks the experts of a layer into one
  [n_experts, out, in] tensor per projection.
- Headers are walked with bounds checks first (neuron_opt.headers): a crafted file fails in time and memory
  bounded by its size, never by the counts it declares.
- Reading is uncached here; neuron_opt.checkpoint.cache memoises the slow parts on disk.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch

from models.build import split_fused
from neuron_opt.checkpoint.gguf_config import CONFIG_TENSORS, GGUF_ARCHS, field
from neuron_opt.config import ModelConfig, QuantConfig
from neuron_opt.errors import CheckpointError
from neuron_opt.headers import check_gguf
from neuron_opt.quant.gguf import (
    AUTO_FORMATS,
    FUSED_LINEARS,
    LINEARS,
    STORED_INT4,
    gguf_block_tensor,
    native_config,
    q4_block_tensor,
)
from neuron_opt.quant.gguf_blocks import row_bytes
from neuron_opt.quant.weights import QuantTensor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# GGUF layer tensor -> HF name, as llama.cpp's converter maps them (gguf-py's tensor_mapping.py)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# the names an architecture's layers use differently: HF's fused names (models.llama.split_fused splits them),
# the sandwich / post norms, the routers and shared experts
_SANDWICH = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _SANDWICH, "gemma3": _SANDWICH,
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "qwen2moe": {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                 "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                 "ffn_gate_inp_shexp": "mlp.shared_expert_gate"},
    "qwen3moe": {"ffn_gate_inp": "mlp.gate"},
    "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate"},
    "gpt-oss": {"attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
                "post_attention_norm": "post_attention_layernorm"},
}
_UNSUFFIXED = ("self_attn.sinks",)  # HF parameters named without .weight
# stacked experts: GGUF tensor -> the HF name of expert {e}'s part (one [n_experts, out, in] tensor per part)
_QWEN_EXPERTS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                 "ffn_down_exps": "mlp.experts.{e}.down_proj"}
_EXPERT_NAMES = {
    "mixtral": {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1", "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
    "qwen2moe": _QWEN_EXPERTS, "qwen3moe": _QWEN_EXPERTS, "gpt-oss": _QWEN_EXPERTS,
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_weight_tensors(reader: Any) -> list[Any]:
    """A GGUF file's weight tensors: all of them but the config values some architectures store as tensors."""
    skip = CONFIG_TENSORS.get(field(reader, "general.architecture"), ())
    return [t for t in reader.tensors if t.name not in skip]


def name_scheme(reader: Any) -> str:
    """The key of a file's naming in the tables above: its GGUF architecture, or "mixtral" for a `llama` file
    with experts."""
    arch = field(reader, "general.architecture")
    return "mixtral" if arch == "llama" and field(reader, "llama.expert_count") else arch


def gguf_to_hf_names(name: str, scheme: str = "llama", n_experts: int = 0) -> list[str]:
    """GGUF tensor name -> its HF names, e.g. `blk.3.attn_q.weight` -> [`model.layers.3.self_attn.q_proj.weight`];
    under `scheme` "phi3", the fused `blk.3.attn_qkv.weight` -> [`model.layers.3.self_attn.qkv_proj.weight`]; a
    stacked expert tensor -> one name per expert."""
    layer_names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(scheme, {})}
    experts = _EXPERT_NAMES.get(scheme, {})
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in experts:
        return [f"model.layers.{m.group(1)}.{experts[m.group(2)].format(e=e)}.{m.group(3)}" for e in range(n_experts)]
    if m and m.group(2) in layer_names:
        hf = f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
        return [hf if layer_names[m.group(2)] in _UNSUFFIXED else f"{hf}.{m.group(3)}"]
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _TOP_NAMES:
        return [f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"]
    raise CheckpointError(f"GGUF tensor {name!r} has no equivalent in a {scheme} model")


def gguf_names(reader: Any, cfg: ModelConfig) -> set[str]:
    """The canonical names a GGUF file's tensors give (fused projections under their fused names)."""
    scheme = name_scheme(reader)
    return {n for t in gguf_weight_tensors(reader) for n in gguf_to_hf_names(t.name, scheme, cfg.num_experts)}


def check_types(reader: Any, path: Path) -> None:
    """Refuse, from the header, a file holding a tensor type we do not read (the keys of AUTO_FORMATS)."""
    for t in reader.tensors:
        if t.tensor_type.name not in AUTO_FORMATS:
            raise CheckpointError(
                f"checkpoint: {path}: tensor {t.name} has GGUF type {t.tensor_type.name}, which we do not read; "
                f"supported types: {', '.join(AUTO_FORMATS)} (requantize the file with llama.cpp's llama-quantize)")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp writes `w.reshape(n_heads, 2, D // 2, *rest).swapaxes(1, 2).reshape(w.shape)`: within each head
    the two rotary halves are interleaved. The inverse splits rows as (n_heads, D // 2, 2) and swaps back.
    `n_heads` is the number of query heads for q and of KV heads for k; works for weights and biases.
    """
    half = w.shape[0] // n_heads // 2
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)  # [n_heads * D, *rest]


def gguf_reader(path: Path) -> Any:
    """gguf's reader, after our bounded walk of the header (neuron_opt.headers.check_gguf): the reader allocates
    by the counts the file declares."""
    check_gguf(path)
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on malformed input
        raise CheckpointError(f"checkpoint: {path} is not a readable GGUF file ({e})") from None


def _canonical(name: str, x: torch.Tensor, cfg: ModelConfig, permuted: bool) -> torch.Tensor:
    """A tensor as the HF checkpoint holds it: llama.cpp's q/k row permutation undone, Gemma's norms (which the
    converter stores as 1 + w, the factor they scale by) back to w, and Qwen2-MoE's shared-expert gate [1, H] a
    matrix again (llama-quantize writes it as a vector: ggml drops a trailing dimension of 1)."""
    if permuted and ".self_attn.q_proj." in name:
        return unpermute_qk(x, cfg.num_attention_heads)
    if permuted and ".self_attn.k_proj." in name:
        return unpermute_qk(x, cfg.num_key_value_heads)
    if cfg.norm_offset and name.endswith("norm.weight"):
        return x - cfg.norm_offset
    if name.endswith(".shared_expert_gate.weight") and x.dim() == 1:  # [1, H]: llama-quantize drops the 1
        return x[None]
    return x


def gguf_state_dict(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Read and dequantize (gguf's reference `gguf.quants.dequantize`) every weight of a GGUF file into canonical
    fp32 HF-named tensors (fused projections split, stacked experts one per expert; no cache)."""
    reader = gguf_reader(path)
    scheme = name_scheme(reader)
    permuted = GGUF_ARCHS[field(reader, "general.architecture")][2]
    sd: dict[str, torch.Tensor] = {}
    for t in gguf_weight_tensors(reader):
        names = gguf_to_hf_names(t.name, scheme, cfg.num_experts)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first (ne0 = input features); row-major order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape))
        x = torch.from_numpy(np.array(w, dtype=np.float32).reshape(shape))  # [out, in], [n] or [E, out, in]
        parts = x.unbind(0) if len(names) > 1 else (x,)  # stacked experts: [out, in] each
        for name, part in zip(names, parts, strict=True):
            sd.update(split_fused(cfg, name, _canonical(name, part, cfg, permuted)))  # phi3: the canonical parts
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _linear_sizes(reader: Any) -> dict[str, int]:
    """GGUF type name -> the elements of the decoder linears (dense, fused or stacked experts) stored in it."""
    out: dict[str, int] = {}
    scheme = name_scheme(reader)
    for t in gguf_weight_tensors(reader):
        name = gguf_to_hf_names(t.name, scheme, 1)[0]
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in (*LINEARS, *FUSED_LINEARS):
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + int(t.n_elements)
    return out


def _widths(reader: Any) -> tuple[tuple[str, int], ...] | None:
    """Each decoder linear's widest row in bytes over the layers (by its name within a layer, e.g.
    `mlp.down_proj`), and the LM head's (`lm_head`: `output`, or the tied `token_embd`), as the gguf format pads
    them (neuron_opt.quant.gguf_blocks; a float or other type counts as the Q8_0 it would be quantized into).
    None when a linear's rows are not whole Q8_0 blocks (32 values): the gguf format cannot hold it."""
    out: dict[str, int] = {}
    scheme = name_scheme(reader)
    names = {t.name for t in reader.tensors}
    for t in gguf_weight_tensors(reader):
        if len(t.shape) != 2:
            continue
        name = gguf_to_hf_names(t.name, scheme, 1)[0].removesuffix(".weight")
        if t.name == "output.weight" or (t.name == "token_embd.weight" and "output.weight" not in names):
            key = "lm_head"
        elif name.startswith("model.layers.") and name.rsplit(".", 1)[-1] in LINEARS:
            key = name.split(".", 3)[3]
        else:
            continue
        try:
            out[key] = max(out.get(key, 0), row_bytes(t.tensor_type.name, int(t.shape[0])))
        except ValueError:
            return None
    return tuple(sorted(out.items()))


def gguf_native_quant(path: Path, cfg: ModelConfig) -> QuantConfig:
    """What `--quantize auto` makes of a GGUF file (neuron_opt.quant.gguf.native_config). A file with fused
    projections (phi3) gets the method of its types, but its blocks are not kept as stored (`source` ""): its
    linears are dequantized, split and quantized again at compile time. A mixture of experts runs in the compute
    dtype: its stacked experts have no quantized layout yet. A K-quant file runs as stored (`gguf`), except with
    fused projections or a linear whose rows are not whole 32-value blocks: then int8 per channel."""
    if cfg.is_moe:
        return QuantConfig()
    reader = gguf_reader(path)
    head = {t.name: t.tensor_type.name for t in reader.tensors if t.name in ("output.weight", "token_embd.weight")}
    widths = _widths(reader)
    qc = native_config(_linear_sizes(reader), head.get("output.weight", head.get("token_embd.weight")),
                       widths or ())
    # fused blocks (phi3) are split at compile time: int8
    if qc.method == "gguf" and cfg.fused_projections:
        return QuantConfig("int8", "per_channel_symmetric", 0, lm_head=qc.lm_head)
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
    scheme = name_scheme(reader)
    permuted = GGUF_ARCHS[field(reader, "general.architecture")][2]
    for t in gguf_weight_tensors(reader):
        if t.tensor_type.name not in STORED_INT4 or len(t.shape) != 2:
            continue
        (name,) = gguf_to_hf_names(t.name, scheme)
        if name.rsplit(".", 2)[-2] not in LINEARS:
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims fastest-first
        q = q4_block_tensor(t.data, t.tensor_type.name, rows, cols)
        if permuted and ".self_attn.q_proj." in name:
            q = _unpermute_quant(q, cfg.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            q = _unpermute_quant(q, cfg.num_key_value_heads)
        yield name, q


def gguf_block_linears(path: Path, cfg: ModelConfig, qc: QuantConfig) -> Iterator[tuple[str, QuantTensor]]:
    """A GGUF file's quantized decoder linears that `qc` (method gguf) converts, and its LM head under
    `qc.lm_head` (`output`, or the tied `token_embd` as `lm_head.weight`), as QuantTensor gguf (HF names): the
    blocks as stored, rows padded to qc's widths (a type without a kernel requantized into Q8_0)."""
    reader = gguf_reader(path)
    scheme = name_scheme(reader)
    permuted = GGUF_ARCHS[field(reader, "general.architecture")][2]
    names = {t.name for t in reader.tensors}
    for t in gguf_weight_tensors(reader):
        if len(t.shape) != 2 or not AUTO_FORMATS[t.tensor_type.name]:  # floats come with the other tensors
            continue
        (name,) = gguf_to_hf_names(t.name, scheme)
        module = name.removesuffix(".weight")
        if t.name == "output.weight" or (t.name == "token_embd.weight" and "output.weight" not in names):
            if not qc.lm_head:
                continue
            name, module = "lm_head.weight", "lm_head"
        elif not (module.startswith("model.layers.") and module.rsplit(".", 1)[-1] in LINEARS
                  and qc.converts(module)):
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims fastest-first
        q = gguf_block_tensor(t.data, t.tensor_type.name, rows, cols, qc.gguf_width(module))
        heads = cfg.num_attention_heads if ".self_attn.q_proj." in name else \
            cfg.num_key_value_heads if ".self_attn.k_proj." in name else 0
        if permuted and heads:  # rows are output channels in both parts
            assert q.kinds is not None
            q = QuantTensor("gguf", unpermute_qk(q.qweight, heads).contiguous(), None,
                            kinds=unpermute_qk(q.kinds, heads).contiguous(), cols=cols)
        yield name, q


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF file describes (its vocabulary, merges, special tokens and chat template), built by
    transformers. AutoTokenizer also reads the file's config to pick a tokenizer class, and refuses architectures
    its GGUF loader does not map (OLMo 2, Granite, SmolLM3) or fails on their config (GPT-OSS): for those, the
    generic fast tokenizer, which is built from the same metadata."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # as in hf.hf_tokenizer

    reader = gguf_reader(path)  # first: transformers reads the file with gguf's reader too
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except (ValueError, TypeError):  # "GGUF model with architecture ... is not supported yet"; GPT-OSS's
            # config breaks its parse (TypeError: an array value read as a float)
            tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint: cannot build a tokenizer from {path} ({e})") from None
    template = field(reader, "tokenizer.chat_template")
    if template is not None and not tok.chat_template:
        tok.chat_template = template
    return tok
