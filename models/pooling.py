"""Embedding models: the Llama-family decoder with a pooling step where the LM head was (docs/embeddings.md).

Design decisions
- One step's inputs are a generation step's (backends.base.StepInputs): an embedding request is one prefill from
  position 0 (no prefix cache, no chunks: the runner refuses anything else), so a row's tokens are indices
  0..last_index[b] and everything the pooling needs is `last_index`. Pads beyond it are masked out.
- Pooling runs on the final norm's output (what transformers' bare `Qwen3Model` returns as last_hidden_state and
  sentence-transformers pools): "last" takes row last_index, "mean" averages rows 0..last_index, "cls" takes
  row 0; then an L2 normalisation when the model has one. In fp32, whatever the compute dtype.
- All three are one masked sum over the rows (then divided by the count for "mean"): a selection by mask is exact
  (x * 1 plus zeros), and under sequence parallelism each rank sums the rows of its chunk and one all-reduce adds
  the ranks' partial sums. Without it every rank holds the whole [B, S, H] after the decoder's last all-reduce,
  so rank 0's vector is the model's (the tp executor returns rank 0's).
- The pooled vector is the graph's output, [B, H] fp32, in place of [B, V] logits: the backends compile it as
  they compile the LM head (the cpu backend's pool graph, cpu_graphs.PoolGraph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.llama import TORCH_OPS, LlamaForCausalLM, MlpFactory, TorchOps
from neuron_opt.config import ModelConfig
from neuron_opt.parallel import SINGLE, HeadLayout, ParallelContext


def pool_mask(last_index: torch.Tensor, rows: int, mode: str, offset: int | torch.Tensor = 0) -> torch.Tensor:
    """Weights [B, rows] fp32 of each row in the pooled sum: 1 where the pooling `mode` takes the row, else 0.
    `offset`: the position of the first row (a sequence-parallel rank's chunk)."""
    pos = torch.arange(rows, device=last_index.device, dtype=last_index.dtype) + offset  # [rows]
    if mode == "last":
        sel = pos[None, :] == last_index[:, None]
    elif mode == "mean":
        sel = pos[None, :] <= last_index[:, None]
    elif mode == "cls":  # the input's first row (written against last_index like the others: a device graph's
        # inputs are all parameters of it, neuron_opt.backends.neuron.DeviceProgram.prepare)
        sel = (pos[None, :] == 0) & (pos[None, :] <= last_index[:, None])
    else:
        raise ValueError(f"pooling: unknown mode {mode!r}")
    return sel.to(torch.float32)  # [B, rows]


def pooled_sum(h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over rows of h [B, S, H] weighted by [B, S], in fp32 -> [B, H]."""
    return (h.float() * weights[:, :, None]).sum(dim=1)


def finish_pooling(summed: torch.Tensor, last_index: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The masked sum [B, H] -> the embedding: divided by the token count for mean pooling, then L2-normalised
    when the model normalises (F.normalize, as sentence-transformers' Normalize)."""
    out = summed / (last_index + 1).to(torch.float32)[:, None] if cfg.pooling == "mean" else summed
    return F.normalize(out, p=2.0, dim=-1) if cfg.normalize_embeddings else out


def pool(h: torch.Tensor, last_index: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Reference pooling of normed hidden states h [B, S, H] at `last_index` [B] -> fp32 [B, H]."""
    assert cfg.pooling is not None
    return finish_pooling(pooled_sum(h, pool_mask(last_index, h.shape[1], cfg.pooling)), last_index, cfg)


class LlamaEmbeddingModel(LlamaForCausalLM):
    """The decoder, its final norm and the pooling step; no LM head (its parameter is dropped: the checkpoint's,
    if any, is not loaded)."""

    def __init__(self, cfg: ModelConfig, lay: HeadLayout, max_model_len: int,
                 pctx: ParallelContext = SINGLE, ops: TorchOps = TORCH_OPS,
                 mlp_factory: MlpFactory | None = None) -> None:
        if cfg.pooling is None:
            raise ValueError("LlamaEmbeddingModel needs a ModelConfig with pooling")
        super().__init__(cfg, lay, max_model_len, pctx, ops, mlp_factory)
        del self.lm_head

    def tie_weights(self) -> None:
        """No LM head to tie."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, last_index: torch.Tensor, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor], kv_len: int, decode: bool = False) -> torch.Tensor:
        """One prefill from position 0; returns the rows' embeddings, fp32 [B, H] (the same on every rank)."""
        x, sp = self.hidden_states(input_ids, positions, slot_mapping, block_tables, k_caches, v_caches, kv_len,
                                   decode, last_index)
        h = self.model.norm(x)  # [B, S, H] ([B, S_pad/tp, H] under sequence parallelism)
        offset = self.pctx.rank_value() * h.shape[1] if sp else 0
        summed = pooled_sum(h, pool_mask(last_index, h.shape[1], self.cfg.pooling or "", offset))  # [B, H]
        if sp:
            summed = self.pctx.comm.all_reduce(summed)
        return finish_pooling(summed, last_index, self.cfg)

