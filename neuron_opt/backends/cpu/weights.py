"""The cpu backend's weight layouts: each quantized linear (neuron_opt.quant.weights.QuantizedWeight, the stored
format) replaced, when the backend builds its graphs, by a CpuQuantizedWeight holding what the CPU kernels read.

- int8 and int4: torch's CPU weight-only kernels, fed bf16 activations: int8 -> aten._weight_int8pack_mm on the
  stored [N, K] values; int4 -> aten._weight_int4pack_mm_for_cpu on the tinygemm layout
  (`_convert_weight_to_int4pack_for_cpu`, built at load). Their fp32-activation variants are several times slower
  than their bf16 ones on AVX2 (docs/quantization.md), hence bf16 activations; the residual stream and the layer
  outputs stay in the model's dtype. A one-row int8 product (batch-1 decode) is instead a dot product per output
  row over the same int8 values, summed in fp32, which Inductor compiles into the layer's own loops (faster than
  the GEMM kernel at one row); so is every int8 product whose K is not a multiple of 16, on which torch 2.13's int8
  GEMM crashes. With `int8_kernel` (the cpu backend's `int8_linear` "kernel") int8 products of up to
  INT8_KERNEL_MAX_ROWS rows, a number fixed when the graph is traced, call torch.ops.neuron_opt.int8_linear
  instead (our C++ operator, which the backend loads before tracing): the same fp32 sums, at the memory's speed,
  and a row's result independent of the row count. With `int8_widened` (the cpu backend's `int8_gemm` "widened")
  the products of more rows (prefills) call torch.ops.neuron_opt.int8_linear_widened: W widened to bf16 once per
  call, then one bf16 GEMM over every row (aten's, oneDNN's where the CPU has native bf16), where aten's int8 GEMM
  widens W for each row.
- gguf: the blocks as stored are the operators' layout. torch.ops.neuron_opt.gguf_linear (up to
  INT8_KERNEL_MAX_ROWS rows, a number fixed when the graph is traced) or gguf_linear_widened (more rows, or a
  dynamic count): the few-row operator rounds x to llama.cpp's 8-bit activation blocks and sums integer products
  (llama.cpp's arithmetic; with `gguf_exact`, the cpu backend's `gguf_linear` "exact", gguf_linear_exact keeps x
  fp32 instead), the widened one multiplies x as it comes (fp32 or bf16) by each weight decoded to gguf's
  reference fp32 value (csrc/gguf_linear.cpp; docs/quantization.md).
- fp8 has no CPU kernel: compile refuses it on cpu.
"""

from __future__ import annotations

import torch
from torch import nn

from neuron_opt.errors import ConfigError
from neuron_opt.quant.weights import QuantizedWeight, quantized_modules, unpack_int4

# up to this many rows (decode batches, verify steps) the int8 operator reuses each widened weight across the
# rows, where aten._weight_int8pack_mm's time grows with the rows (docs/quantization.md); above, and wherever the
# row count is dynamic, the graphs keep aten's GEMM
INT8_KERNEL_MAX_ROWS = 16


class CpuQuantizedWeight(QuantizedWeight):
    """A QuantizedWeight in the CPU kernels' layouts (bf16 scales; int4 in the tinygemm layout; gguf blocks as
    stored); `forward(x)` = x @ W.T in x's dtype. Built from the stored module, whose tensors it takes over."""

    def __init__(self, q: QuantizedWeight, int8_kernel: bool = False, int8_widened: bool = False,
                 gguf_exact: bool = False) -> None:
        nn.Module.__init__(self)  # the stored module's tensors are taken over, not allocated again
        self.qc, self.method, self.width = q.qc, q.method, q.width
        self.out_features, self.in_features, self.group_size = q.out_features, q.in_features, q.group_size
        self.kernel = "cpu"
        self.int8_kernel = int8_kernel and self.method == "int8"  # int8_linear for few rows
        self.int8_widened = int8_widened and self.method == "int8"  # int8_linear_widened for more
        self.gguf_exact = gguf_exact and self.method == "gguf"  # few rows on gguf_linear_exact, not gguf_linear
        if self.method == "fp8":
            raise ConfigError("quantize: fp8 weights have no CPU kernel; use --quantize int8 or int4 on the cpu "
                              "backend (fp8 is a device format: --backend neuron, or eager for a reference)")
        with torch.no_grad():
            if self.method == "gguf":
                self.qweight, self.kinds = q.qweight, q.kinds
            elif self.method == "int8":
                self.qweight = q.qweight
                self.cpu_scale = nn.Parameter(q.scale.view(-1).to(torch.bfloat16), requires_grad=False)  # [N]
            else:
                u = unpack_int4(q.qweight).to(torch.int32)  # [N, K]
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2)
                # tinygemm: W = (u - 8) * scale + zero, so zero = offset + 8 * scale; [groups, N, 2]
                sz = torch.stack([q.scale, q.offset + 8 * q.scale], dim=-1).transpose(0, 1)
                self.cpu_qweight = nn.Parameter(packed, requires_grad=False)
                self.cpu_scale_zeros = nn.Parameter(sz.to(torch.bfloat16).contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        rows = x2.shape[0]
        few = isinstance(rows, int) and rows <= INT8_KERNEL_MAX_ROWS  # static and few
        if self.method == "gguf":  # x as it comes (fp32 or bf16)
            if few:
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
        if self.int8_kernel and few:
            y = torch.ops.neuron_opt.int8_linear(x2, self.qweight, self.cpu_scale)  # [M, N] fp32
        elif self.int8_widened and not few:  # dynamic or many
            y = torch.ops.neuron_opt.int8_linear_widened(x2, self.qweight, self.cpu_scale)  # [M, N] fp32
        elif self.method == "int8" and (rows == 1 or self.in_features % 16):
            y = (x2.float()[:, None, :] * self.qweight.float()[None]).sum(-1) * self.cpu_scale.float()  # [M, N]
        elif self.method == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.cpu_scale)  # [M, N]
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.cpu_qweight, self.group_size,
                                                           self.cpu_scale_zeros)  # [M, N]
        return y.to(x.dtype).view(*lead, self.out_features)


def use_cpu_kernels(model: nn.Module, int8_kernel: bool = False, int8_widened: bool = False,
                    gguf_exact: bool = False) -> None:
    """Replace every stored QuantizedWeight under `model` (not `model` itself) with its CPU layout, in place.
    int8_kernel: int8 products of few rows call torch.ops.neuron_opt.int8_linear; int8_widened: those of more rows
    call torch.ops.neuron_opt.int8_linear_widened; gguf_exact: gguf products of few rows call gguf_linear_exact (x
    fp32, the reference) instead of gguf_linear (llama.cpp's 8-bit x) (see the module's doc). Modules already
    converted stay."""
    if isinstance(model, QuantizedWeight):
        raise ValueError("use_cpu_kernels: pass the module that holds the quantized weight, not the weight itself")
    for name, m in list(model.named_modules()):
        if not isinstance(m, QuantizedWeight) or isinstance(m, CpuQuantizedWeight):
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, CpuQuantizedWeight(m, int8_kernel, int8_widened, gguf_exact))


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
