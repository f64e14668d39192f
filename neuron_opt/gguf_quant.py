"""A GGUF checkpoint's quantized linears, read as stored: Q4_0 / Q4_1 blocks become our int4 format exactly.

GGUF's Q4_0 and Q4_1 blocks hold 32 consecutive input features of one row: an fp16 scale d (and, for Q4_1, an fp16
minimum m) and 16 bytes of nibbles (byte i: element i in the low nibble, element i + 16 in the high). That is
our int4 format with group_size 32 (neuron_opt.quant): scale = d, offset = m (Q4_1) or -8 d (Q4_0), values
unchanged; only the nibbles are reordered. No value goes through fp32 and back, so the model runs with exactly
the weights the file ships.

Q8_0 (32 int8 values and an fp16 scale per block) has no lossless counterpart: our int8 format has one scale per
output channel (what torch's CPU kernel and NxDI take). `--quantize auto` maps a Q8_0 file to int8, requantized
per channel from the exact Q8_0 values. An LM head shipped in a quantized type (SmolLM2's tied Q8_0 table) is kept
int8 per channel; the embedding lookup, norms and anything else stay dequantized in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from neuron_opt.checkpoint import (
    _GGUF_ARCHS,
    Checkpoint,
    _field,
    _gguf_reader,
    gguf_to_hf_name,
    gguf_weight_tensors,
    unpermute_qk,
)
from neuron_opt.config import QuantConfig
from neuron_opt.quant import QuantTensor, pack_int4

_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = ("qkv_proj", "gate_up_proj")  # phi3's fused linears: their blocks span two or three of ours
# GGUF type -> (QuantConfig fields) for files whose decoder linears all share it
_NATIVE = {"Q4_0": ("int4", "group_symmetric", 32), "Q4_1": ("int4", "group_asymmetric", 32),
           "Q8_0": ("int8", "per_channel_symmetric", 0)}


def _linear_types(reader: object) -> dict[str, str]:
    """HF name -> GGUF type name of every decoder linear weight (fused ones under their fused names)."""
    out = {}
    arch = _field(reader, "general.architecture")
    for t in gguf_weight_tensors(reader):
        name = gguf_to_hf_name(t.name, arch)
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in (*_LINEAR, *_FUSED):
            out[name] = t.tensor_type.name
    return out


def native_quant(ckpt: Checkpoint) -> QuantConfig:
    """The quantization a checkpoint ships with (`--quantize auto`): int4 for Q4_0/Q4_1 files, int8 for Q8_0,
    none for float files, HF checkpoints, or GGUF files whose linears mix types. A file with fused projections
    (phi3) gets the method of its type, but its blocks are not kept as stored (`source` ""): its linears are
    dequantized, split and quantized again at compile time."""
    if ckpt.format != "gguf":
        return QuantConfig()
    reader = _gguf_reader(ckpt.source)
    types = set(_linear_types(reader).values())
    if len(types) != 1 or next(iter(types)) not in _NATIVE:
        return QuantConfig()
    method, qtype, group = _NATIVE[next(iter(types))]
    # the LM head (`output`, or the tied `token_embd`) shipped quantized too: keep it quantized (int8 per channel)
    head = {t.name: t.tensor_type.name for t in reader.tensors if t.name in ("output.weight", "token_embd.weight")}
    head_quantized = head.get("output.weight", head.get("token_embd.weight")) in _NATIVE
    kept = method == "int4" and not ckpt.config.fused_projections
    return QuantConfig(method, qtype, group, source="gguf" if kept else "", lm_head=head_quantized)


def q4_block_tensor(data: np.ndarray, kind: str, rows: int, cols: int) -> QuantTensor:
    """Q4_0 / Q4_1 raw blocks (uint8 [rows, blocks * block_bytes]) -> QuantTensor int4, group 32, exactly."""
    block = 20 if kind == "Q4_1" else 18
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // 32, block)  # [N, groups, bytes]
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, groups]
    if kind == "Q4_1":
        offset = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = b[..., 4:]
    else:
        offset = -8 * d
        qs = b[..., 2:]
    u = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [N, groups, 32]: elements 0..15, then 16..31
    packed = pack_int4(torch.from_numpy(u.reshape(rows, cols)))
    return QuantTensor("int4", packed, torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(offset)))


def _unpermute(t: QuantTensor, n_heads: int) -> QuantTensor:
    """llama.cpp's q/k row permutation undone on every part (rows are output channels in each)."""
    assert t.offset is not None
    return QuantTensor(t.method, unpermute_qk(t.qweight, n_heads).contiguous(),
                       unpermute_qk(t.scale, n_heads).contiguous(), unpermute_qk(t.offset, n_heads).contiguous())


def stored_tensors(ckpt: Checkpoint, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """`ckpt.tensors(dtype)`, except that Q4_0/Q4_1 decoder linears come as QuantTensor, read as stored."""
    reader = _gguf_reader(ckpt.source)
    arch = _field(reader, "general.architecture")
    permuted = _GGUF_ARCHS[arch][2]
    cfg = ckpt.config
    native = {}
    for t in gguf_weight_tensors(reader):
        name = gguf_to_hf_name(t.name, arch)
        if t.tensor_type.name in ("Q4_0", "Q4_1") and name.rsplit(".", 2)[-2] in _LINEAR:
            native[name] = t
    for name, t in native.items():
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims fastest-first
        q = q4_block_tensor(t.data, t.tensor_type.name, rows, cols)
        if permuted and ".self_attn.q_proj." in name:
            q = _unpermute(q, cfg.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            q = _unpermute(q, cfg.num_key_value_heads)
        yield name, q
    yield from ckpt.tensors(dtype, skip=frozenset(native))
