"""EAGLE-3 draft head (Li et al. 2025): one decoder layer that reads the target model's own hidden states.

One top-down file: config -> decoder layer -> head -> weight names of the two published layouts.

- Input of position i: the target's auxiliary hidden states at i (the residual stream entering each layer of
  `aux_layer_ids`, concatenated: [3 * H]; id == num_hidden_layers is the last layer's output), projected by `fc`
  to [H], and the embedding of token i + 1 (the token the target put after it). The layer's q/k/v read
  cat([input_layernorm(embed), hidden_norm(hidden)]) ([2H]); the residual is the hidden part (normed with
  `norm_before_residual`). `norm` and `lm_head` give logits over the draft vocabulary; draft token d is target
  token d + d2t[d].
- A chain: the next position's hidden input is the layer's own output (normed with `norm_output`), its token
  the proposal just made. The head keeps its own one-layer KV in the target's block layout (`PagedKV`: head
  position p at the sequence's logical position p + 1, through the target's block tables); attention at position
  p sees positions <= p, so entries past a sequence (rejected proposals of an earlier chain) are never read before
  they are rewritten. `SlotKV` (a contiguous KV per slot) is the layout `forward_layer` recomputes a chain in.
- `ChainGraph`: one step's chain for a batch of rows as one function of tensors, which the cpu and neuron backends
  compile per decode bucket and the host runs as is (`run_chain`).
- Same arithmetic as `speculators`' Eagle3DraftModel (transformers' Llama/Qwen3 decoder layer with the EAGLE-3
  first-layer patch): RMSNorm in fp32, rotate-half rope over the layer config's rope, SwiGLU MLP. Positions are the
  hidden state's (vLLM's convention; speculators' training counts from 1, the same attention under rope).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.llama import TORCH_OPS, apply_rope, rope_tables
from neuron_opt.config import ModelConfig


@dataclass(frozen=True)
class Eagle3Config:
    """`layer`: the decoder layer's config as a (one-layer) ModelConfig of the target's vocabulary;
    `aux_layer_ids`: the target layers whose input states it reads (None: the checkpoint names none, the default
    (2, L // 2, L - 3) of the target's L layers applies); `target_hidden_size`: the target's hidden size when it is
    not the head's (fc then reads n_aux * that)."""

    layer: ModelConfig
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    target_hidden_size: int | None = None
    has_embed: bool = False
    has_vocab_map: bool = False

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def target_vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids else 3

    @property
    def aux_hidden_size(self) -> int:
        return self.target_hidden_size or self.hidden_size


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's and speculators' choice when a head names none: an early, a middle and a late layer."""
    return (2, num_layers // 2, num_layers - 3)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TORCH_OPS.rms_norm(x, self.weight, self.eps)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, n, nkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n, self.nkv, self.D = n, nkv, D
        self.q_proj = nn.Linear(2 * H, n * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(2 * H, nkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(2 * H, nkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(n * D, H, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3's per-head q/k norms
            self.q_norm, self.k_norm = RMSNorm(D, cfg.rms_norm_eps), RMSNorm(D, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVSource) -> torch.Tensor:
        """x [B, S, 2H]; `kv` takes this step's K/V and gives what the queries attend over (`SlotKV`: the head's
        KV slots at inference; training-time test: every step's keys under its mask)."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n, self.D)
        k = self.k_proj(x).view(B, S, self.nkv, self.D)
        v = self.v_proj(x).view(B, S, self.nkv, self.D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values, mask = kv(k, v)  # [B, kv, n_kv, D] each, mask [B, S, kv] (True: visible)
        keys, values = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)
        if self.n != self.nkv:
            keys = keys.repeat_interleave(self.n // self.nkv, dim=1)
            values = values.repeat_interleave(self.n // self.nkv, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                             scale=self.D ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.n * self.D))


KVSource = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class SlotKV:
    """Inference K/V: the step's tokens at `positions` [B, S] of the sequences in KV slots `slots` [B] write
    k_cache/v_cache [num_slots, max_len, n_kv, D] there, and attend over their slot's positions <= their own,
    among the first `kv_len` (None: up to the furthest position, read from `positions`; a device graph gives its
    bucket's static length, which must exceed every position whose output is used)."""

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, kv_len: int | None = None) -> None:
        self.positions, self.slots, self.k_cache, self.v_cache = positions, slots, k_cache, v_cache
        self.kv_len = kv_len

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos, slots = self.positions, self.slots
        self.k_cache[slots[:, None], pos] = k.to(self.k_cache.dtype)
        self.v_cache[slots[:, None], pos] = v.to(self.v_cache.dtype)
        kv_len = int(pos.max()) + 1 if self.kv_len is None else self.kv_len
        mask = torch.arange(kv_len, device=pos.device)[None, None, :] <= pos[:, :, None]  # [B, S, kv_len]
        return self.k_cache[slots, :kv_len], self.v_cache[slots, :kv_len], mask


class PagedKV:
    """Inference K/V in the target's block layout: pools [num_blocks, n_kv, block_size, D] (`Eagle3Head.kv_pools`,
    as many blocks as the target's pool) read through the target's block tables [B, nb]. Head position p pairs the
    target's states at p with token p + 1, so its entry is a function of the sequence's tokens 0..p + 1, the same as
    the target's K/V at position p + 1: it is kept at the sequence's logical position p + 1 (`slot_mapping`: block *
    block_size + offset of that position, 0 for a padding entry: the null block). A full block of the target then
    holds head entries that depend on its own tokens and those before it only, which is what its prefix-cache hash
    covers. A query at head position p attends to logical positions 1..p + 1 of its table (logical position 0 holds
    no head entry)."""

    def __init__(self, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        self.positions, self.slot_mapping, self.block_tables = positions, slot_mapping, block_tables
        self.k_pool, self.v_pool = k_pool, v_pool

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs = self.k_pool.shape[2]
        block, offset = self.slot_mapping // bs, self.slot_mapping % bs  # [B, S]
        self.k_pool[block, :, offset] = k.to(self.k_pool.dtype)  # [B, S, n_kv, D] at each (block, offset)
        self.v_pool[block, :, offset] = v.to(self.v_pool.dtype)
        B, nb = self.block_tables.shape
        keys = self.k_pool[self.block_tables].permute(0, 1, 3, 2, 4).reshape(B, nb * bs, *self.k_pool.shape[1::2])
        values = self.v_pool[self.block_tables].permute(0, 1, 3, 2, 4).reshape(B, nb * bs, *self.v_pool.shape[1::2])
        j = torch.arange(nb * bs, device=self.positions.device)[None, None, :]
        mask = (j >= 1) & (j <= self.positions[:, :, None] + 1)  # [B, S, nb * bs]
        return keys, values, mask


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, inter, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(H, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, H, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The decoder layer over [embed, hidden] (EAGLE's `midlayer`, speculators' `layers.0`)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        lc = cfg.layer
        H, eps = lc.hidden_size, lc.rms_norm_eps
        self.hidden_norm = RMSNorm(H, eps)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Eagle3Attention(lc)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = Eagle3MLP(lc)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: KVSource) -> torch.Tensor:
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        x = residual + self.self_attn(x, cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """The draft head; `embed_tokens` is its own when the checkpoint has one, else the target's table
    (`share_embedding`). `max_model_len`: the rope tables' reach (the positions it may run at)."""

    def __init__(self, cfg: Eagle3Config, max_model_len: int) -> None:
        super().__init__()
        lc = cfg.layer
        H, eps, A = lc.hidden_size, lc.rms_norm_eps, cfg.num_aux * cfg.aux_hidden_size
        if lc.hidden_act != "silu":
            raise ValueError(f"eagle3: the layer's activation is {lc.hidden_act!r}; only silu (SwiGLU) is built")
        self.cfg, self.max_model_len = cfg, max_model_len
        self.embed_tokens = nn.Embedding(lc.vocab_size, H) if cfg.has_embed else None
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(A, eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.aux_hidden_size, eps) for _ in range(cfg.num_aux))
        self.fc = nn.Linear(A, H, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        if cfg.has_vocab_map:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        with torch.device("cpu"):
            cos, sin = rope_tables(lc, max_model_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._shared_embed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.aux_layer_ids: tuple[int, ...] = cfg.aux_layer_ids or ()  # the target's, once checked against it

    def share_embedding(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Use the target's token embeddings (`embed(ids)` -> unscaled rows [..., H]) for a head saved without its
        own."""
        if self.embed_tokens is not None:
            raise ValueError("eagle3: this head has its own embed_tokens")
        self._shared_embed = embed

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        if self._shared_embed is None:
            raise ValueError("eagle3: the head has no embed_tokens; share_embedding(the target's) first")
        return self._shared_embed(ids).to(self.fc.weight.dtype)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated auxiliary states [..., n_aux * H_target] -> the layer's hidden input [..., H]."""
        aux = aux.to(self.fc.weight.dtype)
        if self.cfg.norm_before_fc:
            aux = self.input_norm(aux)
        if self.cfg.fc_norm:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(self.cfg.num_aux, -1), strict=True)], -1)
        return self.fc(aux)

    def kv_pools(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Its K and V block pools in the target's block layout (`PagedKV`): [num_blocks, n_kv, block_size, D]."""
        lc = self.cfg.layer
        shape = (num_blocks, lc.num_key_value_heads, block_size, lc.head_dim)
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    def kv_cache(self, num_slots: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A contiguous KV per slot ([slots, max_model_len, n_kv, D], `SlotKV`: `forward_layer`'s, the layout the
        tests recompute a chain from scratch in)."""
        lc = self.cfg.layer
        shape = (num_slots, self.max_model_len, lc.num_key_value_heads, lc.head_dim)
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    def forward_layer(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One layer pass: tokens [B, S] (each the token after its position's hidden state), hidden inputs
        [B, S, H] (`project`ed target states, or the chain's fed-back state), positions [B, S], KV slots [B].
        Returns the layer's output [B, S, H] (`logits` takes it from there)."""
        return self.run_layer(token_ids, hidden, positions, SlotKV(positions, slots, k_cache, v_cache))

    def run_layer(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  kv: KVSource) -> torch.Tensor:
        """The layer over tokens [B, S] and hidden inputs [B, S, H] at `positions` [B, S], attending as `kv` says
        (`forward_layer`: the head's KV slots; the trainer: the training-time test's steps)."""
        return self.run_layer_embeds(self.embed(token_ids), hidden, positions, kv)

    def run_layer_embeds(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                         kv: KVSource) -> torch.Tensor:
        """`run_layer` on the tokens' embeddings [B, S, H] (a compiled chain graph looks them up itself)."""
        cos = self.rope_cos[positions].to(hidden.dtype)[:, :, None, :]
        sin = self.rope_sin[positions].to(hidden.dtype)[:, :, None, :]
        return self.midlayer(embeds.to(hidden.dtype), hidden, cos, sin, kv)

    def logits(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logits over the draft vocabulary, the hidden input of the chain's next position) of layer
        outputs `h` [..., H]."""
        if self.cfg.norm_output:
            h = self.norm(h)
            return self.lm_head(h).float(), h
        return self.lm_head(self.norm(h)).float(), h

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's (d + d2t[d]; the identity for a head over the full vocabulary)."""
        return draft_ids + self.d2t[draft_ids] if self.cfg.has_vocab_map else draft_ids


@dataclass(frozen=True)
class ChainRow:
    """One sequence's head work of a step: `tokens` [n] (token p + 1 of each head position p = start, start + 1,
    ...) with the target's states `aux` [n, A] at those positions, then a chain of `k` proposals (k >= 1) from the
    last one; the head's K/V go to the sequence's target blocks `blocks` (`PagedKV`)."""

    blocks: tuple[int, ...]
    start: int
    tokens: list[int]
    aux: torch.Tensor
    k: int


def head_slot(blocks: Sequence[int], position: int, block_size: int) -> int:
    """Where head position `position` of a sequence with these blocks keeps its K/V (`PagedKV`: its logical position
    + 1), or 0 (the null block) where the blocks do not reach (a clamped step whose output is never used)."""
    i, o = divmod(position + 1, block_size)
    return blocks[i] * block_size + o if i < len(blocks) else 0


@dataclass(frozen=True)
class ChainInputs:
    """`ChainGraph`'s tensor inputs for a batch of `ChainRow`s (`chain_inputs`)."""

    tokens: torch.Tensor  # [B, Q]
    aux: torch.Tensor  # [B, Q, A]
    positions: torch.Tensor  # [B, Q]
    slot_mapping: torch.Tensor  # [B, Q]
    last: torch.Tensor  # [B] each row's last real index
    chain_positions: torch.Tensor  # [B, K - 1]
    chain_slots: torch.Tensor  # [B, K - 1]
    block_tables: torch.Tensor  # [B, nb]

    def arrays(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.aux, self.positions, self.slot_mapping, self.last, self.chain_positions,
                self.chain_slots, self.block_tables)


def chain_inputs(rows: Sequence[ChainRow], batch: int, q: int, k: int, block_size: int, num_table_blocks: int,
                 max_len: int, aux_width: int, dtype: torch.dtype) -> ChainInputs:
    """Rows of at most `q` positions padded to `q` (positions continuing, clamped below `max_len`; K/V to the null
    block) and to `batch` rows (one position 0 over null blocks); `k` proposals each (a row asking fewer writes its
    extra chain steps to the null block); block tables cut or padded (null blocks) to `num_table_blocks`."""
    tokens = torch.zeros(batch, q, dtype=torch.long)
    aux = torch.zeros(batch, q, aux_width, dtype=dtype)
    positions = torch.arange(q).repeat(batch, 1).clamp(max=max_len - 1)
    slots = torch.zeros(batch, q, dtype=torch.long)
    last = torch.zeros(batch, dtype=torch.long)
    chain_pos = torch.zeros(batch, max(k - 1, 0), dtype=torch.long)
    chain_slots = torch.zeros(batch, max(k - 1, 0), dtype=torch.long)
    tables = torch.zeros(batch, num_table_blocks, dtype=torch.long)
    for r, row in enumerate(rows):
        n = len(row.tokens)
        if n > q or row.k > k:
            raise ValueError(f"eagle3 chain: a row of {n} positions and {row.k} proposals; the graph takes {q} and {k}")
        tokens[r, :n] = torch.tensor(row.tokens, dtype=torch.long)
        aux[r, :n] = row.aux
        positions[r] = torch.arange(row.start, row.start + q).clamp(max=max_len - 1)
        slots[r, :n] = torch.tensor([head_slot(row.blocks, p, block_size) for p in range(row.start, row.start + n)])
        last[r] = n - 1
        for j in range(k - 1):
            p = row.start + n + j
            chain_pos[r, j] = min(p, max_len - 1)
            chain_slots[r, j] = head_slot(row.blocks, p, block_size) if j + 1 < row.k and p < max_len else 0
        use = list(row.blocks[:num_table_blocks])
        tables[r, :len(use)] = torch.tensor(use, dtype=torch.long)
    return ChainInputs(tokens, aux, positions, slots, last, chain_pos, chain_slots, tables)


class ChainGraph(nn.Module):
    """One step's draft chain as a function of tensors (what the cpu and neuron backends compile per decode bucket,
    and what the host runs as is): the layer over each row's new positions, the first proposal from each row's
    position `last`, then `k` - 1 chain steps, each feeding the layer's output back with the token just proposed.
    Returns the proposals [B, k] (target ids); the K/V go to the pools in place (`PagedKV`). `table_input`: the
    head reads the target's embedding table as the graph's last input (a head without embed_tokens, compiled)."""

    def __init__(self, head: Eagle3Head, k: int, table_input: bool = False) -> None:
        super().__init__()
        self.head, self.k, self.table_input = head, k, table_input

    def _embed(self, ids: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
        if self.table_input:
            assert table is not None, "this chain graph reads the model's embedding table as its last input"
            return F.embedding(ids, table)
        return self.head.embed(ids)

    def forward(self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                last: torch.Tensor, chain_positions: torch.Tensor, chain_slots: torch.Tensor,
                block_tables: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                table: torch.Tensor | None = None) -> torch.Tensor:
        head = self.head
        kv = PagedKV(positions, slot_mapping, block_tables, k_pool, v_pool)
        h = head.run_layer_embeds(self._embed(tokens, table), head.project(aux), positions, kv)
        rows = torch.arange(tokens.shape[0], device=tokens.device, dtype=last.dtype)  # (XLA: one index dtype)
        logits, hidden = head.logits(h[rows, last])  # [B, V_draft], [B, H]
        token = head.to_target(logits.argmax(-1))
        out = [token]
        for j in range(self.k - 1):
            p, s = chain_positions[:, j:j + 1], chain_slots[:, j:j + 1]
            h = head.run_layer_embeds(self._embed(token[:, None], table), hidden[:, None], p,
                                      PagedKV(p, s, block_tables, k_pool, v_pool))
            logits, hidden = head.logits(h[:, 0])
            token = head.to_target(logits.argmax(-1))
            out.append(token)
        return torch.stack(out, dim=1)


def table_blocks(rows: Sequence[ChainRow], k: int, block_size: int) -> int:
    """Block-table width that reaches every head entry the rows write or read (at least 2, at most the longest
    table: past a row's own blocks its entries go to the null block)."""
    reach = max(r.start + len(r.tokens) + k for r in rows)  # past the furthest head position written, + 1
    return max(2, min(-(-(reach + 1) // block_size), max(len(r.blocks) for r in rows)))


def run_chain(head: Eagle3Head, rows: Sequence[ChainRow], k_pool: torch.Tensor, v_pool: torch.Tensor,
              block_size: int) -> list[list[int]]:
    """`ChainGraph` in torch over the rows as they are: padded to the longest row and the most proposals."""
    q, k = max(len(r.tokens) for r in rows), max(r.k for r in rows)
    x = chain_inputs(rows, len(rows), q, k, block_size, table_blocks(rows, k, block_size), head.max_model_len,
                     head.cfg.num_aux * head.cfg.aux_hidden_size, head.fc.weight.dtype)
    out = ChainGraph(head, k)(*x.arrays(), k_pool, v_pool)
    return [out[r, :row.k].tolist() for r, row in enumerate(rows)]


def fill(head: Eagle3Head, rows: Sequence[ChainRow], k_pool: torch.Tensor, v_pool: torch.Tensor,
         block_size: int) -> None:
    """The layer over the rows' positions in torch, for their K/V only (no logits): a row further behind than a
    compiled chain graph takes."""
    q = max(len(r.tokens) for r in rows)
    x = chain_inputs(rows, len(rows), q, 1, block_size, table_blocks(rows, 1, block_size), head.max_model_len,
                     head.cfg.num_aux * head.cfg.aux_hidden_size, head.fc.weight.dtype)
    head.run_layer(x.tokens, head.project(x.aux), x.positions,
                   PagedKV(x.positions, x.slot_mapping, x.block_tables, k_pool, v_pool))


# ---- the weight names of the two published layouts ---------------------------------------------------------

def layer_weight_names(cfg: Eagle3Config) -> list[str]:
    """The decoder layer's names under `midlayer.` (EAGLE/SpecForge; speculators stores them under `layers.0.`)."""
    lc = cfg.layer
    names = ["hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
    for p in "qkv":
        names.append(f"self_attn.{p}_proj.weight")
        if lc.attention_bias:
            names.append(f"self_attn.{p}_proj.bias")
    names.append("self_attn.o_proj.weight")
    if lc.o_bias:
        names.append("self_attn.o_proj.bias")
    if lc.qk_norm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for p in ("gate", "up", "down"):
        names.append(f"mlp.{p}_proj.weight")
        if lc.mlp_bias:
            names.append(f"mlp.{p}_proj.bias")
    return ["midlayer." + n for n in names]


def head_weight_names(cfg: Eagle3Config) -> list[str]:
    """Every tensor the head loads, under our (EAGLE-layout) names."""
    names = ["fc.weight", "norm.weight", "lm_head.weight", *layer_weight_names(cfg)]
    if cfg.has_embed:
        names.append("embed_tokens.weight")
    if cfg.has_vocab_map:
        names.append("d2t")
    if cfg.norm_before_fc:
        names.append("input_norm.weight")
    if cfg.fc_norm:
        names += [f"fc_norm.{i}.weight" for i in range(cfg.num_aux)]
    return names
