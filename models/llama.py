"""Llama family: Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v bias), SmolLM2 (tied embeddings), and the
families that are this decoder with options (ModelConfig; docs/models.md): Qwen3 (per-head q/k norms), Gemma 2/3
((1 + w) norms before and after each branch, GeGLU, scaled embeddings, soft-capping, sliding and global layers, a
local rope base), OLMo 2 (post-norms, q/k norms over all heads), Granite 3 (multipliers), SmolLM3 (NoPE layers).

One top-down file: rope -> norm -> attention -> MLP -> block -> model -> HF weight-name map.

Design decisions
- Module names equal Hugging Face parameter names, so a canonical (HF-named) state dict, sharded per rank
  by `neuron_opt.parallel.sharding`, loads with `load_state_dict` and no renaming.
- Every step (prefill or decode) is one call with fixed shapes per bucket:
    input_ids [B, S], positions [B, S], slot_mapping [B, S], block_tables [B, nb], last_index [B], and a
  static `kv_len` <= nb * block_size.
- The KV cache is a pool of fixed-size blocks shared by every sequence ([num_blocks, n_kv_local, block_size, D]
  per layer; block 0 is the null block, never given to a sequence). A sequence owns the blocks listed in its
  row of `block_tables` (logical block i holds its positions [i * block_size, (i + 1) * block_size)); rows
  are padded with the null block. New K/V are written at `slot_mapping` (block * block_size + offset; padding
  tokens write the null block's slot 0); attention gathers the row's blocks, keeps logical positions
  [0, kv_len), and masks causally by position, so null-block entries (beyond the sequence) are never visible.
  Decode graphs attend over their bucket's `kv_len` only, so bytes read scale with the bucket, not with the
  longest sequence. A prefill may start at any position (a cached prefix, an earlier chunk): its queries see
  the blocks already written.
- KV caches are explicit inputs, mutated in place; an AOT compiler sees them as graph inputs rather than
  module buffers (see docs/design.md on pytorch#165444).
- Only the hidden state at `last_index` goes through the LM head: prefill never computes [S, V] logits.
- Per-layer differences are inputs or options, never other classes: a layer without rotary embeddings (SmolLM3)
  gets the identity table (cos 1, sin 0: x * 1 + rotated * 0 is x exactly), a sliding layer of Gemma 3 the local
  table, so every layer runs the same code and a compiled layer graph serves them all (the cpu backend also passes
  the window of a model whose layers mix windows as an input: `window`).
- Window-sized KV (`window_kv`): the sliding layers hold their own, smaller pools and are given their own slot
  mapping and block tables (same logical blocks; out-of-window ones are the null block, which the window's mask
  already hides), so their attention code is unchanged; which pools a layer holds is the caller's
  (neuron_opt.backends.base.allocate_kv).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from neuron_opt.config import ModelConfig, norm_roles
from neuron_opt.errors import CheckpointError, ConfigError
from neuron_opt.lora.ops import LayerLora, LoraInputs
from neuron_opt.parallel import (
    SINGLE,
    ColumnParallelLinear,
    FusedLinears,
    HeadLayout,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from neuron_opt.parallel.layers import seq_gather
from neuron_opt.parallel.sharding import head_sources


def rope_tables(cfg: ModelConfig, max_model_len: int, rope: dict | None = None,
                factors: str = "short_factor") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_model_len, R] in fp32 (R = cfg.rotary_dim: the features rope rotates), computed exactly
    as transformers does (same inv_freq, cos/sin times the attention factor), for `rope` (default: cfg.rope;
    Gemma 3's sliding layers: cfg.rope_local_parameters). `factors`: longrope's factor set ("short_factor" or
    "long_factor")."""
    rope = cfg.rope if rope is None else rope
    rope_type = rope.get("rope_type", "default")
    R = cfg.rotary_dim
    scaling = 1.0
    if rope_type == "default":
        theta = float(rope.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.int64).float() / R))
    elif rope_type == "longrope":
        inv_freq, scaling = longrope_inv_freq(cfg, rope, factors)
    else:  # transformers here, not at the top: importing it may import a device runtime, which the neuron
        # backend sets up first (executors.loader); models are built after that
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                         rope_parameters=rope)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
        inv_freq = inv_freq.float()
        if inv_freq.numel() != R // 2:
            raise ValueError(f"rope {rope_type}: {inv_freq.numel()} frequencies for {R} rotary features")
    pos = torch.arange(max_model_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # [max_model_len, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_model_len, R]
    return emb.cos() * scaling, emb.sin() * scaling


def longrope_inv_freq(cfg: ModelConfig, rope: dict, factors: str) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): the default frequencies over R rotary features, each divided by its factor of the set
    `factors`; one attention factor for both sets: `attention_factor`, else sqrt(1 + ln(s) / ln(original length))
    with s = `factor`, else max_position_embeddings / original length (1 when s <= 1)."""
    R = cfg.rotary_dim
    orig = int(rope["original_max_position_embeddings"])
    s = rope.get("factor") or cfg.max_position_embeddings / orig
    attn = rope.get("attention_factor")
    if attn is None:
        attn = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(orig))
    theta = float(rope.get("rope_theta", 10000.0))
    ext = torch.tensor(rope[factors], dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, R, 2, dtype=torch.int64).float() / R)), float(attn)


def model_rope_tables(cfg: ModelConfig, max_model_len: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The fp32 tables the layers of `cfg` use, by kind (ModelConfig.layer_rope): "global", "local" for a
    Gemma 3-style rope of its own on sliding layers, and "long" for longrope's long factors (then "global" holds
    the short ones; `layer_rope_inputs` picks per row). NoPE layers ("none") use `layer_rope_inputs`' identity."""
    tables = {"global": rope_tables(cfg, max_model_len)}
    if cfg.rope_local_parameters:
        tables["local"] = rope_tables(cfg, max_model_len, dict(cfg.rope_local_parameters))
    if cfg.rope.get("rope_type") == "longrope":
        tables["long"] = rope_tables(cfg, max_model_len, factors="long_factor")
    return tables


def long_rope_rows(cfg: ModelConfig, positions: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows of a step that rotate with longrope's long factors. As transformers decides per forward
    call from its highest position (long when it is past original_max_position_embeddings, for every token of the
    call), we decide per row from the row's highest real position in this step: the position at `last_index`
    ([B], or [B, T] for a verify step: the highest of them). Padding positions are never read."""
    B = positions.shape[0]
    last = positions.gather(1, last_index.reshape(B, -1).to(torch.int64)).amax(1)  # [B]
    return last >= int(cfg.rope["original_max_position_embeddings"])  # seq_len = last + 1 > original


def dynamic_rope_rows(cfg: ModelConfig, table: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                      last_index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic NTK scaling's (cos, sin) [B, S, 1, R] at `positions` [B, S]. transformers recomputes the frequencies
    per forward call from its highest position (seq_len = it + 1, never below max_position_embeddings): the base
    grows to theta x (factor x seq_len / max_position_embeddings - (factor - 1)) ^ (R / (R - 2)), in fp32 as its
    `_compute_dynamic_ntk_parameters` does, and a call within max_position_embeddings uses the original table
    (`table`). We decide per row from the row's highest real position in this step (as `long_rope_rows`): exact
    against HF's generate (a prompt in one call, then a token per call). Without a data-dependent branch (a
    traced graph takes it too): every row's scaled rows are computed and `torch.where` picks."""
    B = positions.shape[0]
    mpe, R = cfg.max_position_embeddings, cfg.rotary_dim
    factor, theta = float(cfg.rope["factor"]), float(cfg.rope.get("rope_theta", 10000.0))
    last = positions.gather(1, last_index.reshape(B, -1).to(torch.int64)).amax(1)  # [B]
    seq_len = torch.clamp(last + 1, min=mpe)  # [B]
    exponents = torch.arange(0, R, 2, dtype=torch.int64, device=positions.device).float() / R  # [R/2]
    scaled = []
    for b in range(B):  # one row's frequencies as transformers computes them: a 0-dim base ** [R/2] exponents
        base = theta * ((factor * seq_len[b] / mpe) - (factor - 1)) ** (R / (R - 2))
        freqs = positions[b].float()[:, None] * (1.0 / (base ** exponents))[None, :]  # [S, R/2]
        scaled.append(torch.cat([freqs, freqs], dim=-1))  # [S, R]
    emb = torch.stack(scaled)  # [B, S, R]
    use = (last + 1 > mpe)[:, None, None, None]  # [B, 1, 1, 1]
    cos, sin = table
    return (torch.where(use, emb.cos()[:, :, None, :], cos[positions][:, :, None, :]).to(dtype),
            torch.where(use, emb.sin()[:, :, None, :], sin[positions][:, :, None, :]).to(dtype))


def layer_rope_inputs(cfg: ModelConfig, tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
                      positions: torch.Tensor, dtype: torch.dtype,
                      last_index: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (cos, sin) [B, S, 1, R] at `positions` [B, S] in `dtype`: its kind's table rows, or for a
    layer without rotary embeddings ones and zeros (the identity rotation, exact). Layers of one kind share the
    tensors. With longrope tables ("long"), each row takes the short or the long rows (`long_rope_rows`, which
    needs the step's `last_index`); dynamic NTK scaling computes each row's (`dynamic_rope_rows`, the same)."""
    rows = {}
    for kind, (cos, sin) in tables.items():
        if kind != "long":
            rows[kind] = (cos[positions].to(dtype)[:, :, None, :], sin[positions].to(dtype)[:, :, None, :])
    if "long" in tables:
        if last_index is None:
            raise ValueError("longrope tables: the step's last_index decides which factors each row uses")
        use = long_rope_rows(cfg, positions, last_index)[:, None, None, None]  # [B, 1, 1, 1]
        lc, ls = tables["long"]
        c, s = rows["global"]
        rows["global"] = (torch.where(use, lc[positions].to(dtype)[:, :, None, :], c),
                          torch.where(use, ls[positions].to(dtype)[:, :, None, :], s))
    if cfg.rope.get("rope_type") == "dynamic":
        if last_index is None:
            raise ValueError("dynamic rope: the step's last_index decides each row's frequencies")
        rows["global"] = dynamic_rope_rows(cfg, tables["global"], positions, last_index, dtype)
    kinds = [cfg.layer_rope(i) for i in range(cfg.num_hidden_layers)]
    if "none" in kinds:
        c, _ = rows["global"]
        rows["none"] = (torch.ones_like(c), torch.zeros_like(c))
    return [rows[k] for k in kinds]


def merge_embeddings(x: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The decoder's input with image embeddings at their placeholder positions: x [B, S, H] (the tokens' scaled
    embeddings), mask [B, S] bool, rows [B, S, H * (1 + d)] (read where mask is set; the first H features: the
    rest are deepstack rows, `deepstack_rows`). Image rows are not scaled by the embedding multiplier: transformers
    merges the encoder's output into the scaled token embeddings (Gemma 3)."""
    H = x.shape[-1]
    if rows.shape[-1] % H:
        raise ValueError(f"image embeddings: rows of {rows.shape[-1]} features are not H * (1 + d) for H = {H}")
    return torch.where(mask[..., None], rows[..., :H].to(x.dtype), x)


def deepstack_rows(mask: torch.Tensor, rows: torch.Tensor, hidden: int) -> list[torch.Tensor]:
    """Qwen3-VL's deepstack: what is added to the output of decoder layer i, for i < d, of rows [B, S, H * (1 + d)]
    (`merge_embeddings`): the (i + 1)-th H features at the image positions, zeros elsewhere (x + 0 leaves a text
    token exact). [] for rows of width H."""
    return [torch.where(mask[..., None], rows[..., i:i + hidden], 0.0) for i in range(hidden, rows.shape[-1], hidden)]


def mrope_axes(section: tuple[int, ...], interleaved: bool) -> list[int]:
    """Which position axis (0 temporal, 1 height, 2 width) each of the R / 2 rotary pairs takes: `section`'s counts
    in turn (Qwen2.5-VL), or interleaved (Qwen3-VL: pair j takes height where j % 3 == 1 and j < 3 * section[1],
    width where j % 3 == 2 and j < 3 * section[2], temporal elsewhere, as transformers recomposes them)."""
    if not interleaved:
        return [axis for axis, n in enumerate(section) for _ in range(n)]
    return [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
            for j in range(sum(section))]


def mrope_rows(section: tuple[int, ...], table: tuple[torch.Tensor, torch.Tensor], rope_positions: torch.Tensor,
               dtype: torch.dtype, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE's (cos, sin) [B, S, 1, R]: each rotary pair takes the table's rows at its axis (`mrope_axes`) of
    `rope_positions` [3, B, S]; both halves of the rotate-half layout alike, as transformers recomposes them.
    Positions equal on every axis give the 1-D rows exactly."""
    axes = torch.tensor(mrope_axes(section, interleaved) * 2, device=rope_positions.device)  # [R]

    def pick(t: torch.Tensor) -> torch.Tensor:
        rows = t[rope_positions]  # [3, B, S, R]
        out = rows.gather(0, axes.expand(1, *rows.shape[1:]))[0]  # [B, S, R]
        return out[:, :, None, :].to(dtype)  # [B, S, 1, R]

    return pick(table[0]), pick(table[1])


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), as transformers writes it (Gemma 2's attention scores and logits)."""
    return torch.tanh(x / cap) * cap


def finish_logits(logits: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The LM head's fp32 logits divided by cfg.logits_scaling (Granite), then soft-capped (Gemma 2); the identity
    else. Elementwise, so a rank's vocabulary shard is finished alone."""
    if cfg.logits_scaling != 1.0:
        logits = logits / cfg.logits_scaling
    if cfg.final_logit_softcapping is not None:
        logits = soft_cap(logits, cfg.final_logit_softcapping)
    return logits


def window_input(cfg: ModelConfig, layer: int, max_model_len: int) -> torch.Tensor:
    """Layer `layer`'s window as a compiled graph's input (1-element int64): its sliding window, or max_model_len
    for a layer that attends to all positions (no position is that far back)."""
    w = cfg.layer_window(layer)
    return torch.tensor([max_model_len if w is None else min(w, max_model_len)], dtype=torch.int64)


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention probabilities with sinks (GPT-OSS), fp32: the softmax over each row's masked scores [B, n, S, kv]
    and its head's sink logit (`sinks` [n]), the sink's column dropped, so a row's probabilities sum to less than
    one by the sink's share."""
    s = scores.float()
    sink = sinks.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, n, D]; cos/sin [B, S, 1, R], R <= D. Rotate-half convention (HF Llama) over the first R features;
    the other D - R pass through (partial rotary: Phi-4-mini)."""
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :R], cos, sin), x[..., R:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def write_blocks(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """cache [num_blocks, n_kv, per_block, D] <- x [B, S, n_kv, D] at flat slots `slot_mapping` [B, S], in place
    (advanced indices around a slice: the value is [B, S, n_kv, D])."""
    per = cache.shape[2]
    if cache.dtype == torch.float8_e4m3fn:  # an fp8 cache (its scales are folded into the weights,
        x = x.clamp(-448.0, 448.0)  # neuron_opt.quant.kv): saturate, as a cast past e4m3's range gives NaN
    cache[slot_mapping // per, :, slot_mapping % per] = x.to(cache.dtype)


def read_blocks(cache: torch.Tensor, block_tables: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The rows' first `kv_len` logical positions: cache [num_blocks, n_kv, per_block, D], block_tables [B, nb]
    -> [B, n_kv, kv_len, D]. Each head's positions are contiguous within a block."""
    B, nb = block_tables.shape
    n_kv, per, D = cache.shape[1:]
    if cache.dtype == torch.float8_e4m3fn and cache.device.type == "cpu":  # torch 2.9's CPU index has no fp8
        rows = cache.view(torch.uint8)[block_tables].view(cache.dtype).transpose(1, 2)  # [B, n_kv, nb, per, D]
    else:
        rows = cache[block_tables].transpose(1, 2)  # [B, n_kv, nb, per_block, D]
    return rows.reshape(B, n_kv, nb * per, D)[:, :, :kv_len]


class TorchOps:
    """Reference attention and RMSNorm in plain torch: the default ops, traceable by every backend.

    The attention/norm implementation is chosen once, when the model is built (`ops=`), never by a flag inside
    `forward`. Kernel-backed variants implement these two methods with the same contract and are tested
    against this one (e.g. `neuron_opt.backends.nki_ops.NkiSimOps`: the NKI kernels on the simulator).
    """

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(dtype)

    def rms_norm_offset(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        """RMSNorm scaled by (offset + weight) (Gemma: 1 + w), in fp32 as transformers computes it. Written as
        xn * w + offset * xn: no op on the weight alone, which a freezing compiler would fold into a constant that
        is no longer the parameter (neuron_opt.backends.cpu.constants matches constants to parameters)."""
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * weight + offset * xf).to(dtype)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                  mask: torch.Tensor, scale: float, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, n_heads, S, D], keys/values [B, n_kv, kv_len, D], positions [B, S] of the queries,
        mask [B, S, kv_len] (True = visible: causality and any sliding window) -> [B, n_heads, S, D].
        `softcap`: scores -> softcap * tanh(scores / softcap) before the mask; `sinks` [n_heads]: each head's sink
        logit joins its softmax (sink_softmax). SDPA has neither step: the scores are then written out."""
        gqa = bool(q.shape[1] != keys.shape[1])  # static per graph; bool(): jit.trace sizes are tensors
        if softcap is None and sinks is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], scale=scale,
                                                  enable_gqa=gqa)  # [B, n_heads, S, D]
        g = q.shape[1] // keys.shape[1]
        if gqa:
            keys, values = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)
        scores = q @ keys.transpose(-1, -2) * scale  # [B, n_heads, S, kv_len]
        if softcap is not None:
            scores = soft_cap(scores, softcap)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        if sinks is None:
            p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            p = sink_softmax(scores, sinks).to(q.dtype)
        return p @ values  # [B, n_heads, S, D]

    def attention_blocks(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                         scale: float, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`attention` over each row's blocks: k_cache/v_cache [num_blocks, n_kv, block_size, D], block_tables
        [B, nb], mask [B, S, kv_len] with kv_len <= nb * block_size. This default gathers the rows' first kv_len
        positions and calls `attention`; ops that read the blocks in place override it."""
        kv_len = mask.shape[-1]
        keys = read_blocks(k_cache, block_tables, kv_len).to(q.dtype)  # [B, n_kv, kv_len, D]
        values = read_blocks(v_cache, block_tables, kv_len).to(q.dtype)  # [B, n_kv, kv_len, D]
        if sinks is None:
            return self.attention(q, keys, values, positions, mask, scale, softcap=softcap)
        return self.attention(q, keys, values, positions, mask, scale, softcap=softcap, sinks=sinks)


TORCH_OPS = TorchOps()


class RMSNorm(nn.Module):
    """RMSNorm scaled by the weight, or by (offset + weight) where the checkpoint stores the difference (Gemma)."""

    def __init__(self, hidden: int, eps: float, ops: TorchOps = TORCH_OPS, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps, self.ops, self.offset = eps, ops, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return self.ops.rms_norm_offset(x, self.weight, self.eps, self.offset)
        return self.ops.rms_norm(x, self.weight, self.eps)


class FullWidthRMSNorm(nn.Module):
    """OLMo 2's q/k norm: one RMS over all heads' features of q (or k), [B, S, n * D], not per head.

    Under tp a rank holds some heads, so it sums its squares and one all-reduce of [B, S, 1] adds the ranks'.
    Layouts that hold a source head several times (replicated or expanded KV heads, flash decoding's groups) hold
    every head the same number of times (`copies`), and zero padding heads add nothing, so the sum / copies is
    the sum over the model's heads; the mean divides by their count (`width`). The weight is this rank's heads'
    part of the [n * D] vector (parallel.sharding picks it head by head, as q/k rows)."""

    def __init__(self, local: int, width: int, copies: int, eps: float, pctx: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local), requires_grad=False)
        self.width, self.copies, self.eps, self.pctx = width, copies, eps, pctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        ss = xf.pow(2).sum(-1, keepdim=True)  # [B, S, 1]
        if self.pctx.tp > 1:
            ss = self.pctx.comm.all_reduce(ss)
            if self.copies > 1:
                ss = ss / self.copies
        xf = xf * torch.rsqrt(ss / self.width + self.eps)
        return (self.weight * xf).to(dtype)  # transformers' Olmo2RMSNorm: the product in fp32, then the cast


def head_copies(cfg: ModelConfig, lay: HeadLayout, which: int) -> int:
    """How many times the layout holds source head 0 of q (which=0) or k/v (which=1) over all ranks (every
    source head is held as often: FullWidthRMSNorm)."""
    return sum(head_sources(cfg, lay, r)[which].count(0) for r in range(lay.tp))


class Attention(nn.Module):
    """Self-attention over this rank's heads.

    Two variants, chosen at build time from the head layout:
    - heads split over ranks (shard / replicate-kv / mha): SDPA over the rank's full KV cache rows.
    - kv-seq-shard (flash decoding): the rank keeps every query head of its KV group but only the group's
      positions p with p % g == j (its rank j within the group of g): each block holds block_size / g of them,
      so the ranks share the host's block ids and each holds 1/g of every block. It computes an unnormalised partial
      softmax (max m, sum s, output o) over its positions; the group exchanges (m, s) with one small
      all-gather, each rank rescales its o by exp(m - M) / sum_c(s_c exp(m_c - M)), and the o_proj
      all-reduce that row-parallel attention needs anyway adds the group's partial outputs together.
      Under context-parallel prefill (HeadLayout.cp, `--cp-degree g`) a prefill step's q/k/v projections, q/k
      norms and rope are split over the group too: rank j computes them for the step's tokens i with i % g == j
      (S / g each, any start position) and one all-gather within the group puts the step's q/k/v back in order;
      the pool writes and the partial softmax above then run as without it, so the KV blocks hold the same
      values. Decode and verify steps do not split (one or a few tokens per row).
    - shard + context-parallel prefill (HeadLayout.cp_heads: as many KV heads as tp or more, `--cp-degree tp`):
      k/v are projected, normed, roped and written for the rank's own KV heads and every token of the step, as
      without it (the pools hold the same values); the rank then reads its heads' K/V of the rows' first kv_len
      positions from its pool and one all-gather over the ranks gives every head's. It takes its tokens i with
      i % tp == rank (a static stride: equal shares, balanced under the causal mask) and runs them through q,
      attention and o_proj over every head: the q and o weights (and biases, sinks) are all-gathered in the graph
      (no copy at rest), so its o_proj product is the tokens' whole attention output, and one all-gather over
      the ranks puts the step's [B, S, H] back in token order, in place of the all-reduce.
    """

    def __init__(self, cfg: ModelConfig, lay: HeadLayout, pctx: ParallelContext,
                 ops: TorchOps = TORCH_OPS, layer: int = 0) -> None:
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.D = lay.n_heads_local, lay.n_kv_local, D
        self.ops = ops
        self.window = cfg.layer_window(layer)
        self.scale = cfg.softmax_scale
        self.softcap = cfg.attn_logit_softcapping
        self.pctx = pctx
        self.kv_groups = lay.kv_seq_shards  # g: 1 unless kv-seq-shard
        self.cp = lay.cp  # context-parallel prefill: over the g ranks of the KV group, or all tp (cp_heads)
        self.cp_heads = lay.cp_heads
        self.cp_size = lay.cp_degree
        self.q_proj = ColumnParallelLinear(H, self.n_heads * D, cfg.attention_bias, pctx)
        self.k_proj = ColumnParallelLinear(H, self.n_kv * D, cfg.attention_bias, pctx)
        self.v_proj = ColumnParallelLinear(H, self.n_kv * D, cfg.attention_bias, pctx)
        self.o_proj = RowParallelLinear(self.n_heads * D, H, cfg.o_bias, pctx)
        if cfg.qk_norm_full:  # OLMo 2: RMSNorm over all heads' features of q and of k, before rope
            self.q_norm = FullWidthRMSNorm(self.n_heads * D, cfg.num_attention_heads * D, head_copies(cfg, lay, 0),
                                           cfg.rms_norm_eps, pctx)
            self.k_norm = FullWidthRMSNorm(self.n_kv * D, cfg.num_key_value_heads * D, head_copies(cfg, lay, 1),
                                           cfg.rms_norm_eps, pctx)
        elif cfg.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's D features of q and k, before rope
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, ops, cfg.norm_offset)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, ops, cfg.norm_offset)
        self.qk_norm, self.qk_norm_full = cfg.qk_norm, cfg.qk_norm_full
        if cfg.attention_sinks:  # GPT-OSS: one logit per local query head (zero for a padding head)
            self.sinks = nn.Parameter(torch.zeros(self.n_heads), requires_grad=False)
        else:
            self.sinks = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, kv_len: int, seq_sharded: bool = False,
                window: torch.Tensor | None = None, lora: LayerLora | None = None,
                decode: bool = False, last_keys: torch.Tensor | None = None) -> torch.Tensor:
        """`window`: this layer's sliding window as a 1-element int64 tensor, in place of the built-in one (a
        compiled graph that serves layers of several windows; a window >= the longest sequence is none).
        `last_keys`: [B, S] the last key position each query sees (`_mask`); None: its own.
        `lora`: the rows' adapter terms on q/k/v/o (neuron_opt.lora.ops), added to the base projections.
        `decode`: a token-generation step (static per graph); context parallelism applies to prefill steps only."""
        B, S = positions.shape
        if seq_sharded:
            x = seq_gather(x, self.pctx, S)  # [B, S, H] from [B, S_pad/tp, H]
        cp = self.cp and not decode and S > 1 and S % self.cp_size == 0  # static per graph
        if cp and self.cp_heads:
            return self._cp_heads_forward(x, cos, sin, positions, slot_mapping, block_tables, k_cache, v_cache,
                                          kv_len, window, lora)
        if cp:  # this rank's tokens i % g == j of the step: q/k/v/rope of S/g tokens, gathered after rope
            x, cos, sin = self._own_tokens(x), self._own_tokens(cos), self._own_tokens(sin)
        S_own = x.shape[1]
        qkv = self._modules.get("qkv_proj")  # set once, at build time (fuse_quantized_projections)
        q, k, v = qkv(x) if qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        if lora is not None:
            q, k, v = lora.add("q_proj", x, q), lora.add("k_proj", x, k), lora.add("v_proj", x, v)
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S_own, self.n_heads, self.D)  # [B, S, n_heads, D]
        k = k.view(B, S_own, self.n_kv, self.D)  # [B, S, n_kv, D]
        v = v.view(B, S_own, self.n_kv, self.D)  # [B, S, n_kv, D]
        if self.qk_norm and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cp:  # the group's tokens back in step order: [B, S, heads, D]
            q, k, v = self._gather_tokens(q), self._gather_tokens(k), self._gather_tokens(v)
        if self.kv_groups > 1:
            out = self._seq_shard_attention(q, k, v, positions, slot_mapping, block_tables, k_cache, v_cache,
                                             kv_len, window, last_keys)
        else:
            out = self._attention(q, k, v, positions, slot_mapping, block_tables, k_cache, v_cache, kv_len, window,
                                  last_keys)
        # rope tables wider than x (fp32 tables under bf16 weights) make rope and attention run wide; o_proj
        # takes x's dtype again
        out = out.to(x.dtype).transpose(1, 2).reshape(B, S, self.n_heads * self.D)  # [B, S, n_heads*D]
        if lora is not None:  # a row-parallel term: this rank's partial joins the base layer's all-reduce
            return self.o_proj(out, scatter_seq=seq_sharded, delta=lora.delta("o_proj", out))
        return self.o_proj(out, scatter_seq=seq_sharded)

    def fuse_quantized_projections(self) -> None:
        """q/k/v as one weight-only GEMM (`qkv_proj`, neuron_opt.parallel.FusedLinears) when all three are
        quantized alike; the three linears are dropped. Called by the cpu backend before it compiles or loads."""
        projs = [self.q_proj, self.k_proj, self.v_proj]
        if FusedLinears.can_fuse(projs):
            self.qkv_proj = FusedLinears(projs)
            del self.q_proj, self.k_proj, self.v_proj

    def _group_rank(self) -> int | torch.Tensor:
        """This rank's index j within its KV group (a device tensor in an SPMD program: ParallelContext.rank_value)."""
        return self.pctx.rank_value() % self.kv_groups

    def _own_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> this rank's tokens i = m * g + j of the step (g = cp_size ranks, j this rank's index
        among them): [B, S / g, ...] (a static stride, so the ranks hold equal shares whatever the row's start
        position)."""
        if t.dim() < 2 or t.shape[1] == 1:  # a table broadcast over the tokens (a layer without rope)
            return t
        B, S, g = t.shape[0], t.shape[1], self.cp_size
        j = self.pctx.rank_value() % g
        idx = j.reshape(1).long() if isinstance(j, torch.Tensor) else torch.tensor([j], device=t.device)
        return t.reshape(B, S // g, g, *t.shape[2:]).index_select(2, idx).squeeze(2)

    def _gather_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """The cp ranks' [B, S / g, ...] shares (one all-gather: within the KV group, or over all ranks under
        cp_heads) -> [B, S, ...] in step order."""
        comm = self.pctx.comm
        every = (comm.all_gather if self.cp_heads else comm.group_all_gather)(t[None], dim=0)  # [g, B, S / g, ...]
        B, part = t.shape[0], t.shape[1]
        return every.movedim(0, 2).reshape(B, part * self.cp_size, *t.shape[2:])

    def _cp_heads_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, kv_len: int, window: torch.Tensor | None,
                          lora: LayerLora | None) -> torch.Tensor:
        """A prefill step under context parallelism with whole KV heads per rank (the class docstring):
        x [B, S, H] -> the attention output [B, S, H], every rank the same."""
        if lora is not None or any(p._modules.get("quant") is not None for p in (self.q_proj, self.o_proj)):
            raise ConfigError("cp_degree: context-parallel prefill with whole KV heads per rank gathers the float "
                              "q and o weights of every rank; it takes neither LoRA adapters nor quantized "
                              "attention weights (use --cp-degree 1)")
        B, S = positions.shape
        comm, D = self.pctx.comm, self.D
        k, v = self.k_proj(x), self.v_proj(x)  # this rank's KV heads, every token: [B, S, n_kv*D]
        k = k.view(B, S, self.n_kv, D)
        v = v.view(B, S, self.n_kv, D)
        if self.qk_norm:
            k = self.k_norm(k)
        k = apply_rope(k, cos, sin)
        write_blocks(k_cache, slot_mapping, k)
        write_blocks(v_cache, slot_mapping, v)
        # every head's K/V of the rows' first kv_len positions: [B, n_kv * tp, kv_len, D]
        keys = comm.all_gather(read_blocks(k_cache, block_tables, kv_len), dim=1)
        values = comm.all_gather(read_blocks(v_cache, block_tables, kv_len), dim=1)
        xs, pos = self._own_tokens(x), self._own_tokens(positions)  # [B, S/g, H], [B, S/g]
        wq = comm.all_gather(self.q_proj.weight, dim=0)  # [n_heads * tp * D, H], heads in global order
        bq = comm.all_gather(self.q_proj.bias, dim=0) if self.q_proj.bias is not None else None
        heads = wq.shape[0] // D
        q = F.linear(xs, wq, bq).view(B, xs.shape[1], heads, D)
        if self.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q, self._own_tokens(cos), self._own_tokens(sin))
        mask = self._mask(torch.arange(kv_len, device=x.device), pos, window)  # [B, S/g, kv_len]
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if self.sinks is not None:
            out = self.ops.attention(q.transpose(1, 2), keys, values, pos, mask, self.scale, softcap=self.softcap,
                                     sinks=comm.all_gather(self.sinks, dim=0))
        elif self.softcap is None:
            out = self.ops.attention(q.transpose(1, 2), keys, values, pos, mask, self.scale)
        else:
            out = self.ops.attention(q.transpose(1, 2), keys, values, pos, mask, self.scale, softcap=self.softcap)
        out = out.to(x.dtype).transpose(1, 2).reshape(B, xs.shape[1], heads * D)  # [B, S/g, every head * D]
        y = F.linear(out, comm.all_gather(self.o_proj.weight, dim=1), self.o_proj.bias)  # [B, S/g, H]: whole
        return self._gather_tokens(y)  # [B, S, H]

    def _mask(self, key_pos: torch.Tensor, positions: torch.Tensor, window: torch.Tensor | None = None,
              last_keys: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S, kv] True where a query sees a key: keys up to its position (or up to its `last_keys` entry: a
        bidirectional image block's last, Gemma 3) and, in a sliding layer, within the window before its position
        (transformers' AND(window, OR(causal, image block)))."""
        last = positions if last_keys is None else last_keys
        mask = key_pos[None, None, :] <= last[:, :, None]  # [B, S, kv]
        if window is not None:
            mask = mask & (key_pos[None, None, :] > positions[:, :, None] - window)
        elif self.window is not None:
            mask = mask & (key_pos[None, None, :] > positions[:, :, None] - self.window)
        return mask

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, kv_len: int, window: torch.Tensor | None = None,
                   last_keys: torch.Tensor | None = None) -> torch.Tensor:
        write_blocks(k_cache, slot_mapping, k)
        write_blocks(v_cache, slot_mapping, v)
        mask = self._mask(torch.arange(kv_len, device=q.device), positions, window, last_keys)  # [B, S, kv_len]
        if self.sinks is not None:
            return self.ops.attention_blocks(q.transpose(1, 2), k_cache, v_cache, block_tables, positions, mask,
                                             self.scale, softcap=self.softcap, sinks=self.sinks)
        if self.softcap is None:  # the call every existing op implements as it did
            return self.ops.attention_blocks(q.transpose(1, 2), k_cache, v_cache, block_tables, positions, mask,
                                             self.scale)  # [B, n_heads, S, D]
        return self.ops.attention_blocks(q.transpose(1, 2), k_cache, v_cache, block_tables, positions, mask,
                                         self.scale, softcap=self.softcap)  # [B, n_heads, S, D]

    def _seq_shard_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                             slot_mapping: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, kv_len: int, window: torch.Tensor | None = None,
                             last_keys: torch.Tensor | None = None) -> torch.Tensor:
        g, j = self.kv_groups, self._group_rank()
        per = k_cache.shape[2]  # this rank's positions per block: block_size / g
        bs = per * g
        off = slot_mapping % bs  # offset in the block; the block starts at a multiple of bs, so p % g == off % g
        # tokens owned by the other group ranks (and padding, in the null block already) write the null slot 0
        local = torch.where(off % g == j, (slot_mapping // bs) * per + off // g, torch.zeros_like(slot_mapping))
        write_blocks(k_cache, local, k)
        write_blocks(v_cache, local, v)
        nb = -(-kv_len // bs)
        keys = read_blocks(k_cache, block_tables[:, :nb], nb * per).to(q.dtype)  # [B, 1, nb*per, D]
        values = read_blocks(v_cache, block_tables[:, :nb], nb * per).to(q.dtype)  # [B, 1, nb*per, D]
        blk = torch.arange(nb, device=q.device)[:, None] * bs
        key_pos = (blk + torch.arange(per, device=q.device)[None, :] * g + j).flatten()  # each local entry's position
        mask = self._mask(key_pos, positions, window, last_keys) & (key_pos < kv_len)[None, None]  # [B, S, nb*per]
        if self.softcap is None and self.scale == 1.0 / math.sqrt(self.D):
            scores = q.transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(self.D)  # [B, n_heads, S, kv_local]
        else:
            scores = q.transpose(1, 2) @ keys.transpose(-1, -2) * self.scale
            if self.softcap is not None:
                scores = soft_cap(scores, self.softcap)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        m = scores.amax(-1)  # [B, n_heads, S]; -inf where none of this rank's positions is visible
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m_safe[..., None])  # [B, n_heads, S, kv_local]
        o = p @ values  # [B, n_heads, S, D], unnormalised
        ms = torch.stack([m, p.sum(-1)], dim=-1)  # [B, n_heads, S, 2]
        every = self.pctx.comm.group_all_gather(ms[None], dim=0)  # [g, B, n_heads, S, 2]
        big_m = every[..., 0].amax(0)  # [B, n_heads, S]; finite: each query sees its own position
        if self.sinks is not None:  # the sink joins the group's softmax once: every rank adds it to the same sum
            sink = self.sinks.to(big_m.dtype).view(1, -1, 1)
            big_m = torch.maximum(big_m, sink)
        total = (every[..., 1] * torch.exp(every[..., 0] - big_m)).sum(0)  # [B, n_heads, S]
        if self.sinks is not None:
            total = total + torch.exp(sink - big_m)
        return o * (torch.exp(m - big_m) / total)[..., None]  # [B, n_heads, S, D]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, lay: HeadLayout, pctx: ParallelContext) -> None:
        super().__init__()
        H, I = cfg.hidden_size, lay.intermediate_local
        self.pctx = pctx
        self.gate_proj = ColumnParallelLinear(H, I, cfg.mlp_bias, pctx)
        self.up_proj = ColumnParallelLinear(H, I, cfg.mlp_bias, pctx)
        self.down_proj = RowParallelLinear(I, H, cfg.mlp_bias, pctx)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma); else SwiGLU. Both give 0 at 0: padding

    def forward(self, x: torch.Tensor, seq_sharded: bool = False, lora: LayerLora | None = None) -> torch.Tensor:
        if seq_sharded:
            # padded rows ride along: they are reduce-scattered back into the padding and never read
            x = self.pctx.comm.all_gather(x, dim=1)  # [B, S_pad, H] from [B, S_pad/tp, H]
        gate_up = self._modules.get("gate_up_proj")  # set once, at build time (fuse_quantized_projections)
        gate, up = gate_up(x) if gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        if lora is not None:
            gate, up = lora.add("gate_proj", x, gate), lora.add("up_proj", x, up)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        if lora is not None:
            h = act * up
            return self.down_proj(h, scatter_seq=seq_sharded, delta=lora.delta("down_proj", h))
        return self.down_proj(act * up, scatter_seq=seq_sharded)

    def fuse_quantized_projections(self) -> None:
        """gate/up as one weight-only GEMM (`gate_up_proj`), as Attention does for q/k/v."""
        projs = [self.gate_proj, self.up_proj]
        if FusedLinears.can_fuse(projs):
            self.gate_up_proj = FusedLinears(projs)
            del self.gate_proj, self.up_proj


# (module name, module) of a layer's feed-forward block; models.moe passes its sparse block's
MlpFactory = Callable[[ModelConfig, HeadLayout, ParallelContext], tuple[str, nn.Module]]


# the checkpoint's name of a decoder layer's RMSNorm by role (config.norm_roles) and norm layout: Llama's
# `post_attention_layernorm` is the MLP's input norm, Gemma's and OLMo 2's the attention output's
NORM_NAMES = {
    "pre": {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"},
    "sandwich": {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                 "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"},
    "post": {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, lay: HeadLayout, pctx: ParallelContext,
                 ops: TorchOps = TORCH_OPS, mlp_factory: MlpFactory | None = None, layer: int = 0) -> None:
        super().__init__()
        self.norms = {role: NORM_NAMES[cfg.norm_layout][role] for role in norm_roles(cfg.norm_layout)}

        def add_norm(role: str) -> None:  # registered in the order the layer applies them
            if role in self.norms:
                self.add_module(self.norms[role], RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, cfg.norm_offset))

        add_norm("attn_in")
        self.self_attn = Attention(cfg, lay, pctx, ops, layer)
        add_norm("attn_out")
        add_norm("mlp_in")
        # the feed-forward block under the checkpoint's name for it (a dense MLP: `mlp`)
        self.mlp_name, mlp = mlp_factory(cfg, lay, pctx) if mlp_factory else ("mlp", MLP(cfg, lay, pctx))
        self.add_module(self.mlp_name, mlp)
        add_norm("mlp_out")
        self.residual_multiplier = cfg.residual_multiplier

    def _norm(self, role: str, x: torch.Tensor) -> torch.Tensor:
        name = self.norms.get(role)
        return x if name is None else getattr(self, name)(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, kv_len: int, seq_sharded: bool = False, decode: bool = False,
                window: torch.Tensor | None = None, lora: LayerLora | None = None,
                last_keys: torch.Tensor | None = None) -> torch.Tensor:
        # `decode`: a token-generation step (decode or verify graph), for a feed-forward block that lays its
        # weights out per phase (models.moe under a hybrid expert layout); a dense MLP has one layout.
        # under sequence parallelism x is this rank's [B, S_pad/tp, H] chunk: norms and residuals run on it.
        # x may be a wider residual stream than the layer's weights (fp32 under bf16 weights: the compiled cpu
        # graphs do this for accuracy, see neuron_opt/backends/cpu/graphs.py): norms run on it, each branch's
        # input takes the weights' dtype and its output comes back to x's. Same dtype: the casts are no-ops.
        # Norm layouts (ModelConfig.norm_layout): a role without a norm passes its tensor through.
        # `lora`: the rows' adapter terms (neuron_opt.lora.ops) on the attention and dense MLP projections
        dt = getattr(self, next(iter(self.norms.values()))).weight.dtype
        a = self.self_attn(self._norm("attn_in", x).to(dt), cos, sin, positions, slot_mapping, block_tables,
                           k_cache, v_cache, kv_len, seq_sharded, window, lora, decode, last_keys)
        x = x + self._residual(self._norm("attn_out", a)).to(x.dtype)
        mlp = getattr(self, self.mlp_name)
        h = self._norm("mlp_in", x).to(dt)
        if lora is not None and not isinstance(mlp, MLP):
            raise ValueError("LoRA adapters apply to dense MLPs only, not to a mixture-of-experts block")
        if lora is not None:
            out = mlp(h, seq_sharded, lora)
        else:
            out = mlp(h, seq_sharded, decode) if getattr(mlp, "per_phase", False) else mlp(h, seq_sharded)
        return x + self._residual(self._norm("mlp_out", out)).to(x.dtype)

    def _residual(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_multiplier == 1.0 else branch * self.residual_multiplier


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, lay: HeadLayout, pctx: ParallelContext,
                 ops: TorchOps = TORCH_OPS, mlp_factory: MlpFactory | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(lay.vocab_local, cfg.hidden_size, pctx)
        self.layers = nn.ModuleList(DecoderLayer(cfg, lay, pctx, ops, mlp_factory, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, cfg.norm_offset)


class LlamaForCausalLM(nn.Module):
    # the LoRA capacity its graphs take adapters for (neuron_opt.lora.LoraConfig), set by models.build; None: none
    lora_config = None

    def __init__(self, cfg: ModelConfig, lay: HeadLayout, max_model_len: int,
                 pctx: ParallelContext = SINGLE, ops: TorchOps = TORCH_OPS,
                 mlp_factory: MlpFactory | None = None) -> None:
        super().__init__()
        self.cfg, self.layout, self.pctx, self.max_model_len = cfg, lay, pctx, max_model_len
        self.model = Backbone(cfg, lay, pctx, ops, mlp_factory)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, lay.vocab_local, False, pctx)
        self.tie_weights()
        with torch.device("cpu"):  # real tables even when the module is built on the meta device (models/build.py)
            tables = model_rope_tables(cfg, max_model_len)
        self.register_buffer("rope_cos", tables["global"][0], persistent=False)  # [max_model_len, R]
        self.register_buffer("rope_sin", tables["global"][1], persistent=False)  # [max_model_len, R]
        if "local" in tables:  # Gemma 3's sliding layers
            self.register_buffer("rope_cos_local", tables["local"][0], persistent=False)
            self.register_buffer("rope_sin_local", tables["local"][1], persistent=False)
        if "long" in tables:  # longrope's long factors (Phi-3)
            self.register_buffer("rope_cos_long", tables["long"][0], persistent=False)
            self.register_buffer("rope_sin_long", tables["long"][1], persistent=False)

    def tie_weights(self) -> None:
        """Tied embeddings: the LM head is the embedding tensor. Call again after moving the model to a device
        whose tensors cannot share storage with the host's (`.to(xla)` makes a new Parameter per module). A
        quantized LM head (`--quantize-lm-head`) holds its own copy of the table, quantized."""
        if self.cfg.tie_word_embeddings and "quant" not in self.lm_head._modules:
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """One layer's K (or V) block pool on this rank: [num_blocks, n_kv_local, positions per block, D]."""
        return (num_blocks, self.layout.n_kv_local, self.layout.block_positions(block_size), self.cfg.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, last_index: torch.Tensor, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor], kv_len: int, decode: bool = False,
                lora: LoraInputs | None = None,
                window_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope_positions: torch.Tensor | None = None, last_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns this rank's fp32 logits [B, V/tp] at `last_index` [B] of each row, or
        [B, T, V/tp] at every index of a [B, T] `last_index` (a verify step scores all its positions).
        `decode`: a token-generation step (a decode or verify bucket), static per graph like the shapes.
        `lora`: the adapter stacks and each row's slot (neuron_opt.lora.ops; None: the base model only).
        `window_kv`: the sliding layers' (slot mapping, block tables) under window-sized KV (None: every layer
        uses `slot_mapping` and `block_tables`). `mm_embeds`: (mask [B, S] bool, rows [B, S, H]): the positions whose
        input is an image embedding rather than the token's (`merge_embeddings`; wider rows also carry the deepstack
        features added after the first layers, `deepstack_rows`); None: tokens only.
        `rope_positions`: [3, B, S] M-RoPE positions (cfg.mrope_section; `mrope_rows`); None: `positions` on every
        axis. `last_keys`: [B, S] the last key position each query sees (a bidirectional image block's tokens see
        the whole block: Gemma 3); None: its own position."""
        x, sp = self.hidden_states(input_ids, positions, slot_mapping, block_tables, k_caches, v_caches, kv_len,
                                   decode, last_index, lora, window_kv, mm_embeds=mm_embeds,
                                   rope_positions=rope_positions, last_keys=last_keys)
        x = self._last_rows(x, last_index, sp)  # [B, H] or [B, T, H]
        return self.finish_logits(self.lm_head(self.model.norm(x)).float())  # [B, V/tp] or [B, T, V/tp]

    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                         block_tables: torch.Tensor, last_index: torch.Tensor, k_caches: list[torch.Tensor],
                         v_caches: list[torch.Tensor], kv_len: int, aux_layers: tuple[int, ...], decode: bool = False,
                         lora: LoraInputs | None = None,
                         window_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                         mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                         rope_positions: torch.Tensor | None = None, last_keys: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits and the residual stream entering each layer of `aux_layers` at every position,
        concatenated: [B, S, len(aux_layers) * H] (id num_hidden_layers: the last layer's output, before the final
        norm). What an EAGLE-3 head reads (models/eagle3.py); not sequence-parallel."""
        if self.pctx.seq_sharded(input_ids.shape[1]):
            raise ValueError("auxiliary hidden states: a sequence-parallel step holds a chunk of each row")
        aux: list[torch.Tensor] = []
        x, sp = self.hidden_states(input_ids, positions, slot_mapping, block_tables, k_caches, v_caches, kv_len,
                                   decode, last_index, lora, window_kv, aux_layers, aux, mm_embeds, rope_positions,
                                   last_keys)
        logits = self.finish_logits(self.lm_head(self.model.norm(self._last_rows(x, last_index, sp))).float())
        return logits, torch.cat(aux, dim=-1)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      block_tables: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                      kv_len: int, decode: bool = False, last_index: torch.Tensor | None = None,
                      lora: LoraInputs | None = None,
                      window_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                      aux_layers: tuple[int, ...] = (), aux_out: list[torch.Tensor] | None = None,
                      mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                      rope_positions: torch.Tensor | None = None, last_keys: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, bool]:
        """The decoder's output before the final norm, [B, S, H] (sequence-parallel: this rank's [B, S_pad/tp, H]
        chunk), and whether it is sequence-parallel; the LM head (`forward`) or a pooling step
        (models.pooling) takes it from there. `last_index`: the step's last real positions, which pick longrope's
        factors per row (layer_rope_inputs). `aux_out` receives the stream entering each layer of `aux_layers`, in
        that order (`forward_with_aux`). `mm_embeds`: image embeddings merged at their positions (`forward`);
        `last_keys`: as `forward`'s."""
        B, S = input_ids.shape
        sp = self.pctx.seq_sharded(S)  # static per bucket: a prefill graph is sequence-parallel or not
        x = self.scale_embeddings(self.model.embed_tokens(input_ids, scatter_seq=sp))  # [B, S, H] ([B, S_pad/tp, H])
        if mm_embeds is not None:
            if sp:
                raise ValueError("image embeddings: a sequence-parallel step holds a chunk of each row")
            x = merge_embeddings(x, *mm_embeds)
        deepstack = deepstack_rows(*mm_embeds, x.shape[-1]) if mm_embeds is not None else []
        tables = {"global": (self.rope_cos, self.rope_sin)}
        if self.cfg.rope_local_parameters:
            tables["local"] = (self.rope_cos_local, self.rope_sin_local)
        if hasattr(self, "rope_cos_long"):
            tables["long"] = (self.rope_cos_long, self.rope_sin_long)
        ropes = layer_rope_inputs(self.cfg, tables, positions, x.dtype, last_index)  # each [B, S, 1, R]
        if self.cfg.mrope_section and rope_positions is not None:
            ropes = [mrope_rows(self.cfg.mrope_section, tables["global"], rope_positions, x.dtype,
                                self.cfg.mrope_interleaved)] * len(ropes)
        seen: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                seen[i] = x
            cos, sin = ropes[i]
            slots, tables = slot_mapping, block_tables
            if window_kv is not None and self.cfg.layer_window(i) is not None:
                slots, tables = window_kv
            kw = {} if last_keys is None else {"last_keys": last_keys}
            if lora is not None:
                x = layer(x, cos, sin, positions, slots, tables, k_caches[i], v_caches[i], kv_len, sp, decode,
                          lora=lora.layer(i), **kw)
            else:
                x = layer(x, cos, sin, positions, slots, tables, k_caches[i], v_caches[i], kv_len, sp, decode, **kw)
            if i < len(deepstack):
                x = x + deepstack[i].to(x.dtype)
        if aux_out is not None:
            seen[len(self.model.layers)] = x
            aux_out.extend(seen[i] for i in aux_layers)
        return x, sp

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """Embedding rows times cfg.embedding_multiplier (Gemma: sqrt(hidden), Granite); the identity else."""
        m = self.cfg.embedding_multiplier
        return x if m == 1.0 else x * m

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return finish_logits(logits, self.cfg)


    def _last_rows(self, x: torch.Tensor, last_index: torch.Tensor, sp: bool) -> torch.Tensor:
        """Hidden states at `last_index` ([B] or [B, T]) of each row: [B, H] or [B, T, H]. Sequence-parallel: the
        rank whose chunk holds a position contributes its row, the others zeros, and one all-reduce (exact:
        x + 0) gives it to all."""
        rows = torch.arange(x.shape[0], device=x.device, dtype=last_index.dtype)  # one index dtype (XLA)
        if last_index.dim() == 2:
            rows = rows[:, None]
        if not sp:
            return x[rows, last_index]
        chunk = x.shape[1]
        local = last_index - self.pctx.rank_value() * chunk
        inside = (local >= 0) & (local < chunk)
        picked = x[rows, local.clamp(0, chunk - 1)] * inside[..., None].to(x.dtype)  # [B, (T,) H]
        return self.pctx.comm.all_reduce(picked)


# HF weight-name map: our parameter names are the HF names. Checkpoints with tied embeddings may omit
# `lm_head.weight`; GGUF names are mapped to these in neuron_opt/checkpoint/gguf.py.
def expected_weight_names(cfg: ModelConfig, mlp_names: Callable[[ModelConfig, str], list[str]] | None = None
                          ) -> list[str]:
    """Checkpoint names of the model; `mlp_names(cfg, layer_prefix)` names a layer's feed-forward block (default:
    the dense MLP; models.moe passes its sparse block's)."""
    mlp_names = mlp_names or dense_mlp_names
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings and not cfg.is_embedding:  # an embedding model pools instead (models.pooling)
        names.append("lm_head.weight")
    norms = [NORM_NAMES[cfg.norm_layout][role] for role in norm_roles(cfg.norm_layout)]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + f"{norm}.weight" for norm in norms]
        for proj in ("q", "k", "v"):
            names.append(p + f"self_attn.{proj}_proj.weight")
            if cfg.attention_bias:
                names.append(p + f"self_attn.{proj}_proj.bias")
        names.append(p + "self_attn.o_proj.weight")
        if cfg.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.attention_sinks:
            names.append(p + "self_attn.sinks")
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += mlp_names(cfg, p)
    return names


def dense_mlp_names(cfg: ModelConfig, prefix: str) -> list[str]:
    names = []
    for proj in ("gate", "up", "down"):
        names.append(prefix + f"mlp.{proj}_proj.weight")
        if cfg.mlp_bias:
            names.append(prefix + f"mlp.{proj}_proj.bias")
    return names


def fused_weight_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """Checkpoint name -> the canonical names its rows split into, in row order, for a checkpoint that stores
    projections fused (cfg.fused_projections, Phi-3: `qkv_proj` = q rows, then k, then v; `gate_up_proj` = gate
    rows, then up); {} otherwise."""
    if not cfg.fused_projections:
        return {}
    kinds = ["weight", "bias"] if cfg.attention_bias else ["weight"]
    mlp_kinds = ["weight", "bias"] if cfg.mlp_bias else ["weight"]
    out: dict[str, list[str]] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for k in kinds:
            out[p + f"self_attn.qkv_proj.{k}"] = [p + f"self_attn.{x}_proj.{k}" for x in "qkv"]
        for k in mlp_kinds:
            out[p + f"mlp.gate_up_proj.{k}"] = [p + f"mlp.gate_proj.{k}", p + f"mlp.up_proj.{k}"]
    return out


def checkpoint_weight_names(cfg: ModelConfig, names: list[str]) -> list[str]:
    """`names` (canonical) as the checkpoint stores them: each fused group once, under its fused name."""
    part_of = {c: f for f, parts in fused_weight_names(cfg).items() for c in parts}
    return list(dict.fromkeys(part_of.get(n, n) for n in names))


def split_fused(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as canonical (name, tensor) pairs: a fused projection's rows split into its parts
    (fused_weight_names), any other tensor as it is."""
    parts = fused_weight_names(cfg).get(name)
    if parts is None:
        return [(name, tensor)]
    D = cfg.head_dim
    if len(parts) == 3:
        sizes = [cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.num_key_value_heads * D]
    else:
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
    if tensor.shape[0] != sum(sizes):
        raise CheckpointError(f"checkpoint: {name} has {tensor.shape[0]} rows; its parts {parts} need "
                              f"{' + '.join(map(str, sizes))}")
    return [(n, t.contiguous()) for n, t in zip(parts, torch.split(tensor, sizes, dim=0), strict=True)]
