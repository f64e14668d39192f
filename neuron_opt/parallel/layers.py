"""TP-aware layers (Megatron layout). Each holds only its rank's shard of the weight.

- ColumnParallelLinear: weight [out/tp, in]; output stays sharded along features (no collective).
- RowParallelLinear: weight [out, in/tp]; partial sums are all-reduced (bias added once, after), or, under
  sequence parallelism, reduce-scattered along the sequence.
- VocabParallelEmbedding: rows [V/tp, H]; out-of-shard ids contribute zeros, then all-reduce (or
  reduce-scatter along the sequence).
- The LM head is a ColumnParallelLinear over the (padded) vocabulary; the executor gathers logits or top-k
  candidates (neuron_opt.executors.worker).

Sequence-parallel activations are [B, S_pad/tp, H] where S_pad rounds S up to a multiple of tp: the padding
is on activations only (zero rows), never on tokens, so no extra positions are written to the KV cache.
Shard shapes come from `neuron_opt.parallel.sharding`; these classes do not compute them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neuron_opt.config import QuantConfig
from neuron_opt.parallel.context import ParallelContext
from neuron_opt.quant.weights import DEQUANT, QuantizedWeight, concat_rows


def seq_scatter(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """Partial sums [B, S, H] -> this rank's summed sequence chunk [B, S_pad/tp, H] (one reduce-scatter)."""
    pad = -x.shape[1] % pctx.tp
    if pad:
        x = F.pad(x, (0, 0, 0, pad))  # [B, S_pad, H]
    return pctx.comm.reduce_scatter(x, dim=1)


def seq_gather(x: torch.Tensor, pctx: ParallelContext, seq: int) -> torch.Tensor:
    """Sequence chunks [B, S_pad/tp, H] -> full activations [B, seq, H] (one all-gather)."""
    return pctx.comm.all_gather(x, dim=1)[:, :seq]


class _Linear(nn.Module):
    """The weight of a parallel linear: a float `weight`, or, once `quantize_as` has run, a `quant` submodule
    (neuron_opt.quant.weights.QuantizedWeight) in its place. Chosen when the model is built."""

    weight: nn.Parameter

    def quantize_as(self, qc: QuantConfig, name: str = "") -> None:
        """`name`: the linear's module name (model.layers.3.mlp.down_proj, lm_head): gguf rows take its width."""
        out_f, in_f = self.weight.shape
        width = qc.gguf_width(name) if qc.method == "gguf" else 0
        self.add_module("quant", QuantizedWeight(qc, out_f, in_f, width).to(self.weight.device))
        del self.weight

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        quant = self._modules.get("quant")  # set once, at build time (no class attribute: it would shadow it)
        if quant is None:
            return F.linear(x, self.weight, bias)
        y = quant(x)
        return y if bias is None else y + bias


class ColumnParallelLinear(_Linear):
    def __init__(self, in_features: int, out_local: int, bias: bool, pctx: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features), requires_grad=False)  # [out/tp, in]
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class FusedLinears(nn.Module):
    """Quantized column-parallel linears that read the same input (q/k/v, gate/up), as ONE weight-only GEMM whose
    output is split back into theirs, in order: `forward(x)` -> (y_1, ..., y_n).

    Built from loaded linears in their stored format (neuron_opt.quant.weights.concat_rows: exact). Float projections
    need none of this: Inductor's concat-linear pass fuses their GEMMs; it does not fuse torch's weight-only
    kernels (int8: never fires; int4: fails on bf16 graphs in torch 2.13), so the cpu backend fuses quantized
    ones here (models.llama: `fuse_quantized_projections`).
    """

    def __init__(self, linears: list[_Linear]) -> None:
        super().__init__()
        if not self.can_fuse(linears):
            raise ValueError("FusedLinears: the linears must all be quantized alike (format, group size, input "
                             "features, stored layout) and either all or none have a bias")
        quants: list[QuantizedWeight] = [lin._modules["quant"] for lin in linears]  # type: ignore[misc]
        self.sizes = [q.out_features for q in quants]
        self.quant = QuantizedWeight(quants[0].qc, sum(self.sizes), quants[0].in_features,
                                     max(q.width for q in quants)).to(quants[0].qweight.device)
        self.quant.load(concat_rows([q.stored() for q in quants]))
        biases = [lin.bias for lin in linears]
        self.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases),  # type: ignore[arg-type]
                                                                requires_grad=False)

    @staticmethod
    def can_fuse(linears: list[_Linear]) -> bool:
        quants = [lin._modules.get("quant") for lin in linears]
        if len(linears) < 2 or any(not isinstance(q, QuantizedWeight) or q.kernel != DEQUANT for q in quants):
            return False
        first = quants[0]
        assert isinstance(first, QuantizedWeight)
        return all(q.method == first.method and q.group_size == first.group_size  # type: ignore[union-attr]
                   and q.in_features == first.in_features for q in quants) and \
            len({lin.bias is None for lin in linears}) == 1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.quant(x)
        if self.bias is not None:
            y = y + self.bias
        return y.split(self.sizes, dim=-1)


class RowParallelLinear(_Linear):
    def __init__(self, in_local: int, out_features: int, bias: bool, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        self.weight = nn.Parameter(torch.empty(out_features, in_local), requires_grad=False)  # [out, in/tp]
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's un-reduced product (no bias): what the all-reduce sums."""
        return self._matmul(x, None)

    def forward(self, x: torch.Tensor, scatter_seq: bool = False, delta: torch.Tensor | None = None) -> torch.Tensor:
        """`delta`: a term of this rank's to add to its partial sum before the reduction (a LoRA adapter's
        row-parallel product: neuron_opt.lora.ops)."""
        partial = self.partial(x)
        if delta is not None:
            partial = partial + delta.to(partial.dtype)
        y = seq_scatter(partial, self.pctx) if scatter_seq else self.pctx.comm.all_reduce(partial)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_local: int, hidden: int, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        self.vocab_local = vocab_local
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden), requires_grad=False)  # [V/tp, H]

    def forward(self, ids: torch.Tensor, scatter_seq: bool = False) -> torch.Tensor:
        if self.pctx.tp == 1:
            return F.embedding(ids, self.weight)
        start = self.pctx.rank_value() * self.vocab_local
        local = ids - start
        inside = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight)  # [B, S, H]
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return seq_scatter(out, self.pctx) if scatter_seq else self.pctx.comm.all_reduce(out)
