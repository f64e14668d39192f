"""Sharding rules as data, and the per-rank head layout.

A rule per weight name (Megatron layout):
  column  : split dim 0 (q/k/v, gate/up, LM head)  -- output features
  row     : split dim 1 (o, down)                   -- input features; all-reduce after
  vocab   : split dim 0 of the embedding table
  replicate: norms, row-parallel biases

`head_layout` decides how attention heads are spread over `tp` ranks. tp=1 is the identity layout.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.errors import ConfigError

COLUMN, ROW, VOCAB, REPLICATE = "column", "row", "vocab", "replicate"

RULES: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", VOCAB),
    (r"lm_head\.weight", COLUMN),
    (r".*\.self_attn\.[qkv]_proj\.(weight|bias)", COLUMN),
    (r".*\.self_attn\.o_proj\.weight", ROW),
    (r".*\.mlp\.(gate|up)_proj\.(weight|bias)", COLUMN),
    (r".*\.mlp\.down_proj\.weight", ROW),
    (r".*", REPLICATE),
)


def rule_for(name: str) -> str:
    for pattern, rule in RULES:
        if re.fullmatch(pattern, name):
            return rule
    raise AssertionError(name)  # the last rule matches everything


@dataclass(frozen=True)
class HeadLayout:
    """How heads, features and vocabulary are laid out per rank (identical on every rank)."""

    tp: int
    n_heads: int  # query heads after padding to a multiple of tp
    n_kv_heads: int  # KV heads after replication (replicate-kv) or expansion (mha)
    head_dim: int
    strategy: str  # shard | replicate-kv | mha
    intermediate_local: int
    vocab_padded: int

    @property
    def n_heads_local(self) -> int:
        return self.n_heads // self.tp

    @property
    def n_kv_local(self) -> int:
        return self.n_kv_heads // self.tp

    @property
    def vocab_local(self) -> int:
        return self.vocab_padded // self.tp


def head_layout(cfg: ModelConfig, par: ParallelConfig) -> HeadLayout:
    tp = par.tp
    if cfg.intermediate_size % tp:
        raise ConfigError(f"tp: {tp} does not divide intermediate_size={cfg.intermediate_size}")
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    vocab_padded = math.ceil(cfg.vocab_size / tp) * tp
    common = dict(tp=tp, head_dim=cfg.head_dim, intermediate_local=cfg.intermediate_size // tp,
                  vocab_padded=vocab_padded)
    if tp == 1:
        return HeadLayout(n_heads=nq, n_kv_heads=nkv, strategy="shard", **common)
    if nq % tp == 0 and nkv % tp == 0 and par.gqa_strategy != "mha":
        return HeadLayout(n_heads=nq, n_kv_heads=nkv, strategy="shard", **common)
    if nq % tp == 0 and tp % nkv == 0 and par.gqa_strategy != "mha":
        return HeadLayout(n_heads=nq, n_kv_heads=tp, strategy="replicate-kv", **common)
    nq_pad = math.ceil(nq / tp) * tp
    return HeadLayout(n_heads=nq_pad, n_kv_heads=nq_pad, strategy="mha", **common)


def _expand_heads(w: torch.Tensor, src_of: list[int | None], D: int) -> torch.Tensor:
    """Rebuild a head-major weight [n*D, ...] so head i is source head src_of[i] (None = zero padding)."""
    heads = w.reshape(-1, D, *w.shape[1:])  # [n_src, D, ...]
    out = torch.zeros((len(src_of), D, *w.shape[1:]), dtype=w.dtype)
    for i, s in enumerate(src_of):
        if s is not None:
            out[i] = heads[s]
    return out.reshape(len(src_of) * D, *w.shape[1:])


def shard_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, lay: HeadLayout,
                     rank: int) -> dict[str, torch.Tensor]:
    """Canonical (HF-named) full state dict -> this rank's shard, with head padding/replication applied."""
    D, nq, nkv, tp = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, lay.tp
    group = nq // nkv
    q_src: list[int | None] = [h if h < nq else None for h in range(lay.n_heads)]
    if lay.strategy == "shard":
        kv_src: list[int | None] = list(range(nkv))
    elif lay.strategy == "replicate-kv":
        # rank r holds q heads [r*nq/tp, (r+1)*nq/tp); they all share KV head (r*nq/tp) // group
        kv_src = [(r * (nq // tp)) // group for r in range(tp)]
    else:  # mha: one KV head per (padded) query head
        kv_src = [(h // group) if h < nq else None for h in range(lay.n_heads)]
    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if name == "lm_head.weight" or name == "model.embed_tokens.weight":
            if lay.vocab_padded != w.shape[0]:
                w = torch.cat([w, w.new_zeros(lay.vocab_padded - w.shape[0], *w.shape[1:])])
        elif re.fullmatch(r".*\.q_proj\.(weight|bias)", name):
            w = _expand_heads(w, q_src, D)
        elif re.fullmatch(r".*\.[kv]_proj\.(weight|bias)", name):
            w = _expand_heads(w, kv_src, D)
        elif name.endswith("o_proj.weight"):
            wt = _expand_heads(w.t().contiguous(), q_src, D)  # [n_heads*D, H]
            w = wt.t()
        rule = rule_for(name)
        if tp > 1 and rule in (COLUMN, VOCAB):
            w = w.chunk(tp, dim=0)[rank]
        elif tp > 1 and rule == ROW:
            w = w.chunk(tp, dim=1)[rank]
        out[name] = w.contiguous()
    return out
