"""A GGUF checkpoint's quantized linears, read as stored: Q4_0 / Q4_1 blocks become our int4 format exactly.

GGUF's Q4_0 and Q4_1 blocks hold 32 consecutive input features of one row: an fp16 scale d (and, for Q4_1, an fp16
minimum m) and 16 bytes of nibbles (byte i: element i in the low nibble, element i + 16 in the high). That is
our int4 format with group_size 32 (neuron_opt.quant.weights): scale = d, offset = m (Q4_1) or -8 d (Q4_0), values
unchanged; only the nibbles are reordered. No value goes through fp32 and back, so the model runs with exactly
the weights the file ships.

Q8_0 (32 int8 values and an fp16 scale per block) has no lossless counterpart: our int8 format has one scale per
output channel (what torch's CPU kernel and NxDI take). `--quantize auto` maps a Q8_0 file to int8, requantized
per channel from the exact Q8_0 values. An LM head shipped in a quantized type (SmolLM2's tied Q8_0 table) is kept
int8 per channel; the embedding lookup, norms and anything else stay dequantized in the compute dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from neuron_opt.config import QuantConfig
from neuron_opt.quant.weights import QuantTensor, pack_int4

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LINEARS = ("qkv_proj", "gate_up_proj")  # phi3's fused linears: their blocks span two or three of ours
# GGUF type -> (QuantConfig fields) for files whose decoder linears all share it
_NATIVE = {"Q4_0": ("int4", "group_symmetric", 32), "Q4_1": ("int4", "group_asymmetric", 32),
           "Q8_0": ("int8", "per_channel_symmetric", 0)}


def native_config(linear_types: set[str], head_type: str | None) -> QuantConfig:
    """The quantization a GGUF file ships with (`--quantize auto`), from the GGUF types of its decoder linears and
    of its LM head (`output`, or the tied `token_embd`): int4 for Q4_0/Q4_1, int8 for Q8_0, none for float files
    or files whose linears mix types. A head shipped quantized is kept quantized (int8 per channel)."""
    if len(linear_types) != 1 or next(iter(linear_types)) not in _NATIVE:
        return QuantConfig()
    method, qtype, group = _NATIVE[next(iter(linear_types))]
    return QuantConfig(method, qtype, group, source="gguf" if method == "int4" else "", lm_head=head_type in _NATIVE)


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
