"""A GGUF checkpoint's quantized linears, read as stored: Q4_0 / Q4_1 blocks become our int4 format exactly, and
K-quant files keep their blocks as they are (the `gguf` format, neuron_opt.quant.gguf_blocks).

GGUF's Q4_0 and Q4_1 blocks hold 32 consecutive input features of one row: an fp16 scale d (and, for Q4_1, an fp16
minimum m) and 16 bytes of nibbles (byte i: element i in the low nibble, element i + 16 in the high). That is
our int4 format with group_size 32 (neuron_opt.quant.weights): scale = d, offset = m (Q4_1) or -8 d (Q4_0), values
unchanged; only the nibbles are reordered. No value goes through fp32 and back, so the model runs with exactly
the weights the file ships.

A file whose decoder linears are mostly (in elements) Q4_K, Q5_K or Q6_K (llama-quantize's Q4_K_M, Q5_K_M,
Q4_K_S, Q6_K...) runs as stored in the `gguf` format: each linear's blocks unchanged (Q4_K, Q5_K, Q6_K, Q5_0 and Q8_0
have kernels; a linear of another type in such a file is requantized into Q8_0 by gguf's quantizer), on the cpu
backend's gguf_linear operators, or gguf's reference dequantization on eager. Backends without those operators
(neuron), and tp > 1, take the int8 conversion below instead (neuron_opt.compiler.resolve_quant).
Every other type a GGUF file commonly holds is dequantized once at compile time (gguf's own reference
dequantizer, neuron_opt.checkpoint.gguf) and quantized again, per output channel, into int8: Q8_0, Q5_0, Q5_1,
IQ4_NL, IQ4_XS, MXFP4, Q3_K, Q2_K (`AUTO_FORMATS`; F32 / F16 / BF16 run in the compute dtype), and so do the
K-quants where the backend does not run them as stored.
Measured on the default model's weights (scripts/gguf_quant_error.py, docs/quantization.md's table), int8 adds
under 1.2% relative error to every one of them, where our int4 format (groups of 32, a minimum) would add 4-9%:
their 16-level grids (IQ4's and MXFP4's non-uniform, Q4_K's with 6-bit sub-block scales, Q3_K's and Q2_K's on
16-value sub-blocks) do not fall on its grid. Our int4 also spends 0.75 bytes a weight (fp32 scale and minimum
per 32), so int8 costs a third more memory for an error four to ten times smaller.
A model runs one format (our QuantizedWeight layers share one QuantConfig), so a file that mixes types takes the
format of the type class holding most of its decoder linears' weights, counted in elements (a Q4_K_M file: Q4_K,
Q6_K, Q5_0 and Q8_0 linears, all kept as stored; a Q4_0 file with a few Q8_0 linears: int4, the Q8_0 ones
requantized to it). An LM head shipped in a quantized type (SmolLM2's tied Q8_0 table) is kept int8 per channel,
or as stored under `gguf` (a Q4_K_M file's Q6_K output); the embedding lookup, norms and anything else stay
dequantized in the compute dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from neuron_opt.config import QuantConfig
from neuron_opt.quant.gguf_blocks import to_rows
from neuron_opt.quant.weights import QuantTensor, pack_int4

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LINEARS = ("qkv_proj", "gate_up_proj")  # phi3's fused linears: their blocks span two or three of ours
# GGUF type -> what `--quantize auto` makes of a decoder linear stored in it ("" = the compute dtype). The keys
# are the types we read; any other is refused from the file's header (neuron_opt.checkpoint.gguf).
AUTO_FORMATS = {
    "F32": "", "F16": "", "BF16": "", "Q4_0": "int4", "Q4_1": "int4",
    "Q8_0": "int8", "Q6_K": "gguf", "Q5_K": "gguf", "Q5_0": "int8", "Q5_1": "int8", "Q4_K": "gguf",
    "IQ4_NL": "int8", "IQ4_XS": "int8", "MXFP4": "int8", "Q3_K": "int8", "Q2_K": "int8",
}
STORED_INT4 = ("Q4_0", "Q4_1")  # the types read as stored (q4_block_tensor)


def native_config(linear_sizes: dict[str, int], head_type: str | None,
                  widths: tuple[tuple[str, int], ...] = ()) -> QuantConfig:
    """The quantization `--quantize auto` gives a GGUF file, from the GGUF type of each decoder linear (type ->
    its linears' total elements) and of its LM head (`output`, or the tied `token_embd`); `widths`: each linear's
    (and the head's, `lm_head`) widest row in bytes (gguf_blocks.row_bytes), which `gguf` takes (none: int8).

    The format of the type class (AUTO_FORMATS) holding most elements; int4 is group 32, symmetric when every int4
    linear is Q4_0 (its blocks' own layout), else with a minimum (Q4_1's), and its Q4_0/Q4_1 linears are read as
    stored (`source` "gguf"). A head shipped in a quantized type is kept int8 per channel, or as stored under
    gguf."""
    by_format: dict[str, int] = {}
    for kind, n in linear_sizes.items():
        by_format[AUTO_FORMATS[kind]] = by_format.get(AUTO_FORMATS[kind], 0) + n
    if not by_format or max(by_format, key=lambda f: (by_format[f], f)) == "":
        return QuantConfig()
    method = max(by_format, key=lambda f: (by_format[f], f))
    head = bool(AUTO_FORMATS.get(head_type or "F32"))
    if method == "int8" or (method == "gguf" and not widths):  # no widths: rows the format cannot hold
        return QuantConfig("int8", "per_channel_symmetric", 0, lm_head=head)
    if method == "gguf":
        return QuantConfig("gguf", source="gguf", lm_head=head, gguf_widths=widths)
    int4 = {kind for kind in linear_sizes if AUTO_FORMATS[kind] == "int4"}
    qtype = "group_symmetric" if int4 == {"Q4_0"} else "group_asymmetric"
    return QuantConfig("int4", qtype, 32, source="gguf", lm_head=head)


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


def gguf_block_tensor(data: np.ndarray, kind: str, rows: int, cols: int, width: int) -> QuantTensor:
    """A GGUF tensor's raw blocks -> QuantTensor gguf, rows of `width` bytes (gguf_blocks.to_rows: the bytes as
    stored, or Q8_0 for a type without a kernel)."""
    qweight, kinds = to_rows(data, kind, rows, cols, width)
    return QuantTensor("gguf", qweight, None, kinds=kinds, cols=cols)
