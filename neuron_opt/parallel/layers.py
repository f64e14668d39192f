"""TP-aware layers (Megatron layout). Each holds only its rank's shard of the weight.

- ColumnParallelLinear: weight [out/tp, in]; output stays sharded along features (no collective).
- RowParallelLinear: weight [out, in/tp]; partial sums are all-reduced (bias added once, after), or, under
  sequence parallelism, reduce-scattered along the sequence.
- VocabParallelEmbedding: rows [V/tp, H]; out-of-shard ids contribute zeros, then all-reduce (or
  reduce-scatter along the sequence).
- The LM head is a ColumnParallelLinear over the (padded) vocabulary; the executor gathers logits or top-k
  candidates (neuron_opt.parallel.worker).

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
from neuron_opt.quant import QuantizedWeight


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
    (neuron_opt.quant.QuantizedWeight) in its place. Chosen when the model is built."""

    weight: nn.Parameter

    def quantize_as(self, qc: QuantConfig) -> None:
        out_f, in_f = self.weight.shape
        self.add_module("quant", QuantizedWeight(qc, out_f, in_f).to(self.weight.device))
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


class RowParallelLinear(_Linear):
    def __init__(self, in_local: int, out_features: int, bias: bool, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        self.weight = nn.Parameter(torch.empty(out_features, in_local), requires_grad=False)  # [out, in/tp]
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's un-reduced product (no bias): what the all-reduce sums."""
        return self._matmul(x, None)

    def forward(self, x: torch.Tensor, scatter_seq: bool = False) -> torch.Tensor:
        partial = self.partial(x)
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
