"""GGUF blocks kept as stored (the `gguf` weight format): each output feature's row of blocks, as the file holds it.

A linear of the `gguf` format is `qweight` uint8 [N, width] and `kinds` int8 [N]: row n holds output feature n's
K input features in blocks of GGML type kinds[n] (its id: Q5_0 6, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14), from byte 0,
and zeros after them up to `width`. Rows of different types share one tensor that way: q/k/v fused into one
weight, and a projection whose type differs between layers (llama-quantize's Q4_K_M gives some layers' v_proj and
down_proj Q6_K, the others Q4_K) padded to one width, so every layer's weight has one shape (the cpu backend
compiles one graph for every layer). A file's linear in a type without a kernel here (`KERNEL_TYPES`), or a float
weight, is quantized into Q8_0 by gguf's own quantizer (`to_rows`).

The reference (`dequantize`) is gguf's own dequantizer (`gguf.quants.dequantize`); the cpu backend's operators
(torch.ops.neuron_opt.gguf_linear, csrc/gguf_linear.cpp) decode every value to the same fp32 bits.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

# GGML type -> (id, values per block, bytes per block): the types the cpu backend's operators multiply as stored
KERNEL_TYPES = {"Q5_0": (6, 32, 22), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
                "Q6_K": (14, 256, 210)}
FALLBACK = "Q8_0"  # what a linear of another type (or a float weight) is quantized into
_BY_ID = {v[0]: k for k, v in KERNEL_TYPES.items()}


def row_bytes(kind: str, cols: int) -> int:
    """Bytes of one row of `cols` values in `kind` (a KERNEL_TYPES key; another type counts as FALLBACK's)."""
    _, size, nbytes = KERNEL_TYPES.get(kind, KERNEL_TYPES[FALLBACK])
    if cols % size:
        raise ValueError(f"gguf blocks: {cols} values are not whole {kind} blocks of {size}")
    return cols // size * nbytes


def to_rows(data: np.ndarray, kind: str, rows: int, cols: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF tensor's raw blocks (uint8 [rows, row bytes]) as (qweight uint8 [rows, width], kinds int8 [rows]),
    the bytes unchanged; a type outside KERNEL_TYPES is dequantized by gguf and quantized into FALLBACK by gguf."""
    if kind not in KERNEL_TYPES:
        values = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, kind))
        return from_float(torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(rows, cols)), width)
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1)
    if raw.shape[1] != row_bytes(kind, cols) or width < raw.shape[1]:
        raise ValueError(f"gguf blocks: {kind} rows of {cols} values take {row_bytes(kind, cols)} bytes; got "
                         f"{raw.shape[1]}, width {width}")
    out = np.zeros((rows, width), dtype=np.uint8)
    out[:, : raw.shape[1]] = raw
    return torch.from_numpy(out), torch.full((rows,), KERNEL_TYPES[kind][0], dtype=torch.int8)


def from_float(w: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] quantized into FALLBACK (Q8_0) by gguf's quantizer, as rows of `width` bytes."""
    n, k = w.shape
    blocks = gguf.quants.quantize(w.detach().float().numpy(), gguf.GGMLQuantizationType.Q8_0)  # [N, row bytes]
    return to_rows(blocks, FALLBACK, n, k, width)


def pad_rows(qweight: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of blocks widened to `width` bytes with zeros (their values unchanged)."""
    if qweight.shape[1] > width:
        raise ValueError(f"gguf blocks: rows of {qweight.shape[1]} bytes do not fit {width}")
    return torch.nn.functional.pad(qweight, (0, width - qweight.shape[1]))


def dequantize(qweight: torch.Tensor, kinds: torch.Tensor, cols: int) -> torch.Tensor:
    """fp32 [N, cols]: every row's blocks dequantized by gguf's reference dequantizer (rows grouped by type)."""
    out = torch.empty(qweight.shape[0], cols)
    q = qweight.cpu().numpy()
    kinds_np = kinds.cpu().numpy()
    for kid in np.unique(kinds_np):
        if int(kid) not in _BY_ID:
            raise ValueError(f"gguf blocks: GGML type id {int(kid)} is not one of {sorted(_BY_ID)}")
        kind = _BY_ID[int(kid)]
        rows = np.nonzero(kinds_np == kid)[0]
        raw = np.ascontiguousarray(q[rows, : row_bytes(kind, cols)])
        values = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
        out[torch.from_numpy(rows)] = torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(len(rows), cols))
    return out.to(qweight.device)
