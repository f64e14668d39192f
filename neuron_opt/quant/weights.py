"""Weight-only quantization: the stored formats, the quantizers, and the module a quantized linear holds.

Formats, per linear weight W [N, K] (y = x @ W.T), stored in the artifact as computed on:
- int8: `qweight` int8 [N, K], `scale` fp32 [N, 1]; W = q * scale. per_channel_symmetric: scale = amax(row) / 127;
  per_tensor_symmetric: one amax for the whole tensor (stored on every row).
- fp8: `qweight` float8_e4m3fn [N, K], `scale` fp32 [N, 1]; W = q * scale with scale = amax / 448 (e4m3's max).
- int4: `qweight` uint8 [N, K/2], two values per byte (element 2j in the low nibble, 2j+1 in the high), each
  u in [0, 15]; `scale` and `offset` fp32 [N, K/G]: W = u * scale + offset within each group of G input features.
  group_asymmetric: scale = (max - min) / 15, offset = min (GGUF's Q4_1); group_symmetric: scale = amax / 8 and
  offset = -8 * scale, i.e. values -8..7 (Q4_0). GGUF Q4_0/Q4_1 blocks (32 values, fp16 d and m) map onto this
  exactly: only the nibble order is rearranged (neuron_opt.checkpoint).

Kernels, chosen once when a graph is built (never a flag read inside forward):
- "dequant", the reference (eager backend and the device path): W is rebuilt in the compute dtype inside the
  graph and multiplied. On a NeuronCore the weight crosses HBM in 1 byte (int8, fp8) or half a byte (int4) and is
  widened on chip, which is what NxDI does; the gain there is bandwidth and capacity.
- "cpu" (the cpu backend's compiled graphs): torch's CPU weight-only kernels, fed bf16 activations:
  int8 -> aten._weight_int8pack_mm on the stored [N, K] values; int4 -> aten._weight_int4pack_mm_for_cpu on the
  tinygemm layout (`_convert_weight_to_int4pack_for_cpu`, built at load). Their fp32-activation variants are
  several times slower than their bf16 ones on AVX2 (docs/quantization.md), hence bf16 activations; the residual
  stream and the layer outputs stay in the model's dtype. A one-row int8 product (batch-1 decode) is instead a
  dot product per output row over the same int8 values, summed in fp32, which Inductor compiles into the layer's
  own loops (faster than the GEMM kernel at one row); so is every int8 product whose K is not a multiple of 16,
  on which torch 2.13's int8 GEMM crashes. With `use_cpu_kernels(int8_kernel=True)` (the cpu backend's
  `int8_linear` "kernel") int8 products of up to INT8_KERNEL_MAX_ROWS rows, a number fixed when the graph is
  traced, call torch.ops.neuron_opt.int8_linear instead (the cpu backend's C++ operator, which the backend loads
  before tracing): the same fp32 sums, at the memory's speed, and a row's result independent of the row count.
  With `use_cpu_kernels(int8_widened=True)` (the cpu backend's `int8_gemm` "widened") the products of more rows
  (prefills) call torch.ops.neuron_opt.int8_linear_widened: W widened to bf16 once per call, then one bf16 GEMM
  over every row (aten's, oneDNN's where the CPU has native bf16), where aten's int8 GEMM widens W for each row.
  fp8 weights have no CPU kernel: compile refuses them on cpu.
- gguf: a GGUF file's blocks as stored (neuron_opt.quant.gguf_blocks: `qweight` uint8 [N, width], `kinds` int8 [N]).
  "dequant" multiplies gguf's reference dequantization of them; "cpu" calls torch.ops.neuron_opt.gguf_linear
  (up to INT8_KERNEL_MAX_ROWS rows, a number fixed when the graph is traced) or gguf_linear_widened (more rows, or a
  dynamic count): the few-row operator rounds x to llama.cpp's 8-bit activation blocks and sums integer products
  (llama.cpp's arithmetic; with `use_cpu_kernels(gguf_exact=True)`, the cpu backend's `gguf_linear` "exact",
  gguf_linear_exact keeps x fp32 instead), the widened one multiplies x as it comes (fp32 or bf16) by each weight
  decoded to the reference's fp32 value (csrc/gguf_linear.cpp; docs/quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from neuron_opt.config import QuantConfig
from neuron_opt.errors import ConfigError
from neuron_opt.quant import gguf_blocks

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
DEQUANT, CPU = "dequant", "cpu"
# up to this many rows (decode batches, verify steps) the int8 operator reuses each widened weight across the
# rows, where aten._weight_int8pack_mm's time grows with the rows (docs/quantization.md); above, and wherever the
# row count is dynamic, the graphs keep aten's GEMM
INT8_KERNEL_MAX_ROWS = 16


@dataclass
class QuantTensor:
    """One quantized linear weight in the stored format (see the module docstring)."""

    method: str  # int8 | int4 | fp8 | gguf
    qweight: torch.Tensor
    scale: torch.Tensor | None  # fp32 [N, groups]; None under gguf
    offset: torch.Tensor | None = None  # int4 only, fp32 [N, groups]
    kinds: torch.Tensor | None = None  # gguf only: each row's GGML type id, int8 [N]
    cols: int = 0  # gguf only: the input features (rows may be padded past their blocks)

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.qweight.shape
        if self.method == "gguf":
            return (n, self.cols)
        return (n, k * 2) if self.method == "int4" else (n, k)

    @property
    def group_size(self) -> int:
        if self.scale is None:  # gguf: blocks of their own sizes; the row is one unit here
            return self.cols
        return self.shape[1] // self.scale.shape[1]

    def parts(self) -> dict[str, torch.Tensor]:
        if self.kinds is not None:
            return {"qweight": self.qweight, "kinds": self.kinds}
        assert self.scale is not None
        out = {"qweight": self.qweight, "scale": self.scale}
        if self.offset is not None:
            out["offset"] = self.offset
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts().values())


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 (any integer dtype) -> uint8 [N, K/2]: element 2j in the low nibble, 2j+1 in the high."""
    u = u.to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)  # [N, K/2]


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] values 0..15 (inverse of pack_int4)."""
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], p.shape[1] * 2)  # [N, K]


def quantize(w: torch.Tensor, qc: QuantConfig) -> QuantTensor:
    """Quantize a linear weight [N, K] (any float dtype; computed in fp32) into `qc`'s format."""
    w = w.detach().float()
    n, k = w.shape
    if qc.method in ("int8", "fp8"):
        qmax = 127.0 if qc.method == "int8" else FP8_MAX
        amax = w.abs().amax(dim=1, keepdim=True)  # [N, 1]
        if qc.quantization_type == "per_tensor_symmetric":
            amax = amax.amax().expand(n, 1)
        scale = (amax / qmax).clamp(min=1e-12)  # [N, 1]
        if qc.method == "int8":
            q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        else:
            q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantTensor(qc.method, q.contiguous(), scale.contiguous())
    g = qc.group_size
    if k % g:
        raise ConfigError(f"group_size: {g} does not divide the linear's {k} input features; choose one that does")
    wg = w.view(n, k // g, g)  # [N, groups, G]
    if qc.quantization_type == "group_asymmetric":
        lo, hi = wg.amin(-1), wg.amax(-1)  # [N, groups]
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        offset = lo
    else:
        scale = (wg.abs().amax(-1) / 8).clamp(min=1e-12)
        offset = -8 * scale
    u = torch.round((wg - offset[..., None]) / scale[..., None]).clamp(0, 15)  # [N, groups, G]
    return QuantTensor("int4", pack_int4(u.view(n, k)).contiguous(), scale.contiguous(), offset.contiguous())


def dequantize(t: QuantTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] a QuantTensor stands for, in `dtype` (computed in fp32)."""
    n, k = t.shape
    if t.method == "gguf":
        assert t.kinds is not None
        return gguf_blocks.dequantize(t.qweight, t.kinds, k).to(dtype)
    g = t.group_size
    assert t.scale is not None
    if t.method == "int4":
        u = unpack_int4(t.qweight).float().view(n, k // g, g)  # [N, groups, G]
        assert t.offset is not None
        w = u * t.scale.float()[..., None] + t.offset.float()[..., None]
    else:
        w = t.qweight.float().view(n, k // g, g) * t.scale.float()[..., None]
    return w.reshape(n, k).to(dtype)


def concat_rows(tensors: list[QuantTensor]) -> QuantTensor:
    """Weights [N_i, K] of one format and group size as one [sum N_i, K] weight, rows in order. Exact: every stored
    part (values, scales, offsets) is laid out per output row."""
    first = tensors[0]
    if any(t.method != first.method or t.shape[1] != first.shape[1] or t.group_size != first.group_size
           for t in tensors):
        raise ValueError("concat_rows: the weights differ in format, input features or group size")
    if first.method == "gguf":  # rows padded to the widest (values unchanged)
        width = max(t.qweight.shape[1] for t in tensors)
        return QuantTensor("gguf", torch.cat([gguf_blocks.pad_rows(t.qweight, width) for t in tensors]), None,
                           kinds=torch.cat([t.kinds for t in tensors]), cols=first.cols)  # type: ignore[misc]
    offset = None if first.offset is None else torch.cat([t.offset for t in tensors])  # type: ignore[misc]
    return QuantTensor(first.method, torch.cat([t.qweight for t in tensors]), torch.cat([t.scale for t in tensors]),
                       offset)


def scale_quant(t: QuantTensor, factor: float) -> QuantTensor:
    """The QuantTensor of `factor * W`, exactly (scales and offsets are multiplied; values unchanged). GGUF blocks
    hold their scales in fp16 inside each block: no exact multiple, refused."""
    if t.scale is None:
        raise ConfigError("kv_cache_dtype fp8: its scales are folded into q/k/v/o, which GGUF blocks kept as stored "
                          "(--quantize auto on a K-quant file) cannot take exactly; use --quantize int8, or a bf16 "
                          "KV cache")
    off = None if t.offset is None else t.offset * factor
    return QuantTensor(t.method, t.qweight, t.scale * factor, off)


class QuantizedWeight(nn.Module):
    """A linear's weight in a quantized format; `forward(x)` = x @ W.T in x's dtype (no bias).

    Holds the stored format (parameters `qweight`, `scale`, and `offset` for int4; `qweight` and `kinds` for gguf,
    whose rows are `width` bytes) until `use_cpu_kernels()` replaces them with the CPU kernels' layouts (gguf's
    blocks stay as they are). `.to(dtype)` never converts these tensors (their dtypes are the format);
    `.to(device)` moves them.
    """

    def __init__(self, qc: QuantConfig, out_features: int, in_features: int, width: int = 0) -> None:
        super().__init__()
        method = str(qc.method)
        self.qc, self.method, self.out_features, self.in_features = qc, method, out_features, in_features
        group_size = qc.group_size
        self.group_size = group_size if method == "int4" else in_features
        self.kernel = DEQUANT
        self.int8_kernel = False  # torch.ops.neuron_opt.int8_linear for few rows (use_cpu_kernels)
        self.int8_widened = False  # torch.ops.neuron_opt.int8_linear_widened for more (use_cpu_kernels)
        self.gguf_exact = False  # gguf: few rows on gguf_linear_exact, not gguf_linear (use_cpu_kernels)
        self.width = width
        if method == "gguf":
            if width <= 0:
                raise ValueError("QuantizedWeight: gguf needs the rows' width in bytes")
            self.qweight = nn.Parameter(torch.zeros(out_features, width, dtype=torch.uint8), requires_grad=False)
            self.kinds = nn.Parameter(torch.zeros(out_features, dtype=torch.int8), requires_grad=False)
            return
        groups = in_features // self.group_size
        qdtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}[method]
        qk = in_features // 2 if method == "int4" else in_features
        self.qweight = nn.Parameter(torch.empty(out_features, qk, dtype=qdtype), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        if method == "int4":
            if in_features % group_size:
                raise ConfigError(f"group_size: {group_size} does not divide a linear's {in_features} input "
                                  "features (per rank); choose one that does")
            self.offset = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)

    def extra_repr(self) -> str:
        return f"{self.method}, out={self.out_features}, in={self.in_features}, group={self.group_size}, " \
               f"kernel={self.kernel}"

    def _apply(self, fn: Any, recurse: bool = True) -> QuantizedWeight:  # noqa: ANN401
        # nn.Module.to(dtype) would cast fp8 values and fp32 scales; keep every dtype, follow only the device
        for name, p in list(self._parameters.items()):
            if p is not None:
                moved = fn(p.data)
                if moved.dtype != p.dtype:  # a dtype cast: redo it as a pure move
                    moved = p.data.to(moved.device)
                self._parameters[name] = nn.Parameter(moved, requires_grad=False)
        return self

    def load(self, value: torch.Tensor | QuantTensor) -> None:
        """Fill from a QuantTensor of this format, or quantize a float weight [out, in] into it."""
        if self.method == "gguf":
            self._load_gguf(value)
            return
        t = value if isinstance(value, QuantTensor) else quantize(value, self.qc)
        if t.method != self.method or t.shape != (self.out_features, self.in_features) or \
                t.group_size != self.group_size:
            raise ValueError(f"quantized weight {t.method} {t.shape} group {t.group_size} does not fit this layer "
                             f"({self.method} {(self.out_features, self.in_features)} group {self.group_size})")
        with torch.no_grad():
            for name, part in t.parts().items():
                getattr(self, name).copy_(part)

    def _load_gguf(self, value: torch.Tensor | QuantTensor) -> None:
        """GGUF blocks as stored (rows padded to this weight's width), or a float weight quantized into Q8_0."""
        if isinstance(value, QuantTensor):
            if value.method != "gguf" or value.shape != (self.out_features, self.in_features):
                raise ValueError(f"quantized weight {value.method} {value.shape} does not fit this layer (gguf "
                                 f"{(self.out_features, self.in_features)})")
            qweight, kinds = gguf_blocks.pad_rows(value.qweight, self.width), value.kinds
        else:
            if tuple(value.shape) != (self.out_features, self.in_features):
                raise ValueError(f"weight {tuple(value.shape)} does not fit this layer "
                                 f"{(self.out_features, self.in_features)}")
            qweight, kinds = gguf_blocks.from_float(value, self.width)
        with torch.no_grad():
            self.qweight.copy_(qweight)
            self.kinds.copy_(kinds)  # type: ignore[arg-type]

    def stored(self) -> QuantTensor:
        if self.method == "gguf":
            return QuantTensor("gguf", self.qweight, None, kinds=self.kinds, cols=self.in_features)
        return QuantTensor(self.method, self.qweight, self.scale, getattr(self, "offset", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == CPU:
            return self._cpu(x)
        if self.method == "gguf":
            return torch.nn.functional.linear(x, dequantize(self.stored(), x.dtype))
        if self.method != "int4" and self.group_size == self.in_features:  # one scale per output channel: after
            return torch.nn.functional.linear(x, self.qweight.to(x.dtype)) * self.scale.view(-1).to(x.dtype)
        return torch.nn.functional.linear(x, dequantize(self.stored(), x.dtype))

    def use_cpu_kernels(self, int8_kernel: bool = False, int8_widened: bool = False, gguf_exact: bool = False) -> None:
        """Replace the stored format with the CPU kernels' layouts (bf16 scales; int4 in the tinygemm layout).
        int8_kernel: int8 products of few rows call torch.ops.neuron_opt.int8_linear; int8_widened: those of more
        rows call torch.ops.neuron_opt.int8_linear_widened; gguf_exact: gguf products of few rows call
        gguf_linear_exact (x fp32, the reference) instead of gguf_linear (llama.cpp's 8-bit x) (see the module's
        doc)."""
        self.int8_kernel = int8_kernel and self.method == "int8"
        self.int8_widened = int8_widened and self.method == "int8"
        self.gguf_exact = gguf_exact and self.method == "gguf"
        if self.kernel == CPU:
            return
        if self.method == "gguf":  # the blocks as stored are the operators' layout
            self.kernel = CPU
            return
        if self.method == "fp8":
            raise ConfigError("quantize: fp8 weights have no CPU kernel; use --quantize int8 or int4 on the cpu "
                              "backend (fp8 is a device format: --backend neuron, or eager for a reference)")
        with torch.no_grad():
            if self.method == "int8":
                self.cpu_scale = nn.Parameter(self.scale.view(-1).to(torch.bfloat16), requires_grad=False)  # [N]
                del self.scale
            else:
                u = unpack_int4(self.qweight).to(torch.int32)  # [N, K]
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2)
                # tinygemm: W = (u - 8) * scale + zero, so zero = offset + 8 * scale; [groups, N, 2]
                sz = torch.stack([self.scale, self.offset + 8 * self.scale], dim=-1).transpose(0, 1)
                self.cpu_qweight = nn.Parameter(packed, requires_grad=False)
                self.cpu_scale_zeros = nn.Parameter(sz.to(torch.bfloat16).contiguous(), requires_grad=False)
                del self.qweight, self.scale, self.offset
        self.kernel = CPU

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.method == "gguf":  # x as it comes (fp32 or bf16): the operators widen it exactly
            rows = x2.shape[0]
            if isinstance(rows, int) and rows <= INT8_KERNEL_MAX_ROWS:  # static and few
                op = torch.ops.neuron_opt.gguf_linear_exact if self.gguf_exact else torch.ops.neuron_opt.gguf_linear
                y = op(x2, self.qweight, self.kinds)  # [M, N] fp32
            else:
                y = torch.ops.neuron_opt.gguf_linear_widened(x2, self.qweight, self.kinds)
            return y.to(x.dtype).view(*lead, self.out_features)
        if x2.dtype != torch.bfloat16:  # no `.to` when it is one: export records even a no-op cast as a node
            x2 = x2.to(torch.bfloat16)  # (aten._assert_tensor_metadata), and torch 2.13's int4 concat-linear pass
            # fails on an activation whose first user is not the int4 GEMM ('NoneType' has no attribute 'meta')
        # one row (static per graph): a dot product per output row. Also every row count when K is not a multiple
        # of 16: torch 2.13's int8 GEMM kernel then reads past the weight's rows (it crashed at K = 72)
        rows = x2.shape[0]
        if self.int8_kernel and isinstance(rows, int) and rows <= INT8_KERNEL_MAX_ROWS:  # static and few
            y = torch.ops.neuron_opt.int8_linear(x2, self.qweight, self.cpu_scale)  # [M, N] fp32
        elif self.int8_widened and not (isinstance(rows, int) and rows <= INT8_KERNEL_MAX_ROWS):  # dynamic or many
            y = torch.ops.neuron_opt.int8_linear_widened(x2, self.qweight, self.cpu_scale)  # [M, N] fp32
        elif self.method == "int8" and (rows == 1 or self.in_features % 16):
            y = (x2.float()[:, None, :] * self.qweight.float()[None]).sum(-1) * self.cpu_scale.float()  # [M, N]
        elif self.method == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.cpu_scale)  # [M, N]
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.cpu_qweight, self.group_size,
                                                           self.cpu_scale_zeros)  # [M, N]
        return y.to(x.dtype).view(*lead, self.out_features)


def quantized_modules(model: nn.Module) -> dict[str, QuantizedWeight]:
    """Every QuantizedWeight in `model`, by the name of the linear that holds it."""
    return {name.removesuffix(".quant"): m for name, m in model.named_modules() if isinstance(m, QuantizedWeight)}


def use_cpu_kernels(model: nn.Module, int8_kernel: bool = False, int8_widened: bool = False,
                    gguf_exact: bool = False) -> None:
    for m in quantized_modules(model).values():
        m.use_cpu_kernels(int8_kernel, int8_widened, gguf_exact)


def check_uniform_layers(model: nn.Module) -> None:
    """The cpu backend compiles one layer graph for every layer: each layer must quantize the same projections."""
    per_layer: dict[str, set[str]] = {}
    for name in quantized_modules(model):
        if name.startswith("model.layers."):
            idx, rest = name.removeprefix("model.layers.").split(".", 1)
            per_layer.setdefault(idx, set()).add(rest)
    layers = {str(i) for i in range(len(model.model.layers))}
    sets = {frozenset(per_layer.get(i, set())) for i in layers}
    if len(sets) > 1:
        raise ConfigError("modules_to_not_convert: the cpu backend compiles one graph shared by every layer, so "
                          "each layer must quantize the same projections; name a projection for all layers (e.g. "
                          "mlp.down_proj) or use --backend eager/neuron")
