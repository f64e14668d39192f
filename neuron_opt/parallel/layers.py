"""TP-aware layers (Megatron layout). Each holds only its rank's shard of the weight.

- ColumnParallelLinear: weight [out/tp, in]; output stays sharded along features (no collective).
- RowParallelLinear: weight [out, in/tp]; partial sums are all-reduced (bias added once, after).
- VocabParallelEmbedding: rows [V/tp, H]; out-of-shard ids contribute zeros, then all-reduce.
- The LM head is a ColumnParallelLinear over the (padded) vocabulary; logits are gathered by the runner.

Shard shapes come from `neuron_opt.parallel.sharding`; these classes do not compute them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neuron_opt.parallel.context import ParallelContext


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_local: int, bias: bool, pctx: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features), requires_grad=False)  # [out/tp, in]
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_local: int, out_features: int, bias: bool, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        self.weight = nn.Parameter(torch.empty(out_features, in_local), requires_grad=False)  # [out, in/tp]
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pctx.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_local: int, hidden: int, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        self.vocab_local = vocab_local
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden), requires_grad=False)  # [V/tp, H]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pctx.tp == 1:
            return F.embedding(ids, self.weight)
        start = self.pctx.rank * self.vocab_local
        local = ids - start
        inside = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight)  # [B, S, H]
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.pctx.comm.all_reduce(out)
