"""Sharding rules as data, and the per-rank head layout.

A rule per weight name (Megatron layout):
  column   : split dim 0 (q/k/v, gate/up, LM head)  -- output features; no collective
  row      : split dim 1 (o, down)                   -- input features; one all-reduce after
  vocab    : split dim 0 of the embedding table      -- out-of-shard ids give zeros; one all-reduce after
  replicate: norms, row-parallel biases (OLMo 2's q/k norms span all heads: picked head by head, as q/k rows)

Attention weights are not chunked blindly: `head_sources` says, per rank, which source head each local head
is (or None for a zero padding head), and q/k/v rows and o columns are gathered head by head. That one
mechanism expresses every GQA strategy:

  shard        n_heads % tp == 0 and n_kv_heads % tp == 0: contiguous heads per rank, nothing duplicated.
  replicate-kv tp % n_kv_heads == 0 and n_heads % tp == 0: each rank keeps the one KV head its query heads
               use; a KV head is stored tp / n_kv_heads times (weights and cache).
  mha          otherwise (e.g. SmolLM2's 9 q / 3 kv heads at tp=2 or 4): query heads padded with zero heads
               to a multiple of tp, and every query head gets its own copy of its KV head. Always possible,
               costs the most KV memory.
  kv-seq-shard flash decoding (`--flash-decoding`, needs n_kv_heads < tp and tp % n_kv_heads == 0): the
               g = tp / n_kv_heads ranks of a KV group each keep every query head of the group and 1/g of the
               group's KV cache along the sequence (round-robin: position p lives on group rank p % g).
               KV memory per rank drops by g against replicate-kv; q/o weights are duplicated g times.
               `--cp-degree g` (context-parallel prefill) implies it: the g ranks of a group also split a
               prefill's tokens (models/llama.py, Attention).
  shard + cp   context-parallel prefill with as many KV heads as tp or more (`--cp-degree tp`, the shard layout:
               n_heads and n_kv_heads multiples of tp): weights and KV pools as `shard`; in a prefill step every
               rank runs attention for 1/tp of the step's tokens over every head (models/llama.py, Attention).

Widths tp does not divide are padded with zeros, never refused, so any tp shards any Llama-family model (as
transformers-neuronx ran Llama-3-8B, Mistral-7B and Llama-3-70B at tp 24 on inf2.48xlarge): the MLP's
`intermediate_size` to ceil(I / tp) features per rank (zero gate/up rows and down columns: silu(0) * 0 = 0, so
the result is unchanged), the vocabulary to ceil(V / tp) rows per rank (padded logits are masked to -inf before
sampling), and query heads as under `mha` above. The plan prints what was padded and what it costs
(neuron_opt.planner.memory.layout_overhead).

Attention sinks (GPT-OSS, one logit per query head) are picked head by head as the q rows are. Expert biases
(GPT-OSS): gate/up biases are split as their rows are; an expert's down bias is held by the first rank of its group
(zeros on the others), so the group's partial sums add it once.

Mixture of experts (`ParallelConfig.ep`, NxDI's moe_ep_degree): the tp ranks form `ep` groups of `moe_tp = tp / ep`
consecutive ranks. Group e holds experts [e * E / ep, (e + 1) * E / ep) whole, stacked as `experts.gate_up_proj`
[E / ep, 2 * I_local, H] and `experts.down_proj` [E / ep, H, I_local]; within the group each expert's MLP is split
as a dense MLP is (moe_intermediate_size zero-padded to a multiple of moe_tp). Hidden states are replicated on every
rank after attention, so every rank routes every token (the router is replicated), applies its local experts to
the tokens routed to them, and the partial sums of all ranks meet in the one all-reduce a row-parallel MLP needs
anyway: no all-to-all, the same collective bytes per token as the dense layer. `ep_decode` (a hybrid layout) adds a
second stack of the same experts laid out for another degree, which decode and verify graphs apply
(`rank_shards` yields both shards of each expert tensor). The shared expert (Qwen2-MoE) is a
dense MLP split over all tp ranks; its gate is replicated.

`head_layout` picks the strategy (overridable with ParallelConfig.gqa_strategy); `layout_cost` describes it
with its memory cost for the compile plan. tp=1 is the identity layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.errors import ConfigError

COLUMN, ROW, VOCAB, REPLICATE, EXPERT = "column", "row", "vocab", "replicate", "expert"
# one expert's projection as checkpoints store it (Mixtral: w1 gate, w3 up, w2 down; Qwen-MoE: *_proj; GPT-OSS's
# stacked tensors are split into these names at load, biases included: models.gpt_oss)
EXPERT_NAME = r"(.*\.(?:block_sparse_moe|mlp)\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|bias)"
# the second copy of an expert under a hybrid layout (HeadLayout.hybrid): `...experts_decode.{j}.{part}.weight`
DECODE_EXPERT_NAME = EXPERT_NAME.replace(r"\.experts)", r"\.experts_decode)")
EXPERT_PARTS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
SHARD, REPLICATE_KV, MHA, KV_SEQ_SHARD = "shard", "replicate-kv", "mha", "kv-seq-shard"

RULES: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", VOCAB),
    (r"lm_head\.weight", COLUMN),
    (r".*\.self_attn\.[qkv]_proj\.(weight|bias)", COLUMN),
    (r".*\.self_attn\.o_proj\.weight", ROW),
    (r".*\.mlp\.(gate|up)_proj\.(weight|bias)", COLUMN),
    (r".*\.mlp\.down_proj\.weight", ROW),
    (r".*\.shared_expert\.(gate|up)_proj\.weight", COLUMN),
    (r".*\.shared_expert\.down_proj\.weight", ROW),
    (EXPERT_NAME, EXPERT),
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
    n_heads: int  # query heads after padding (global)
    n_kv_heads: int  # KV heads after replication (replicate-kv) or expansion (mha) (global)
    head_dim: int
    strategy: str  # shard | replicate-kv | mha | kv-seq-shard
    intermediate_local: int  # MLP features per rank: ceil(intermediate_size / tp) (zero-padded)
    vocab_padded: int
    kv_seq_shards: int = 1  # g: ranks sharing one KV head along the sequence (kv-seq-shard only)
    # context-parallel prefill: over each KV group's g ranks (kv-seq-shard: g), or over all tp ranks of a shard
    # layout whose ranks hold whole KV heads (tp); 1: none
    cp_degree: int = 1
    ep: int = 1  # MoE: expert-parallel groups (each holds experts_local whole experts)
    experts_local: int = 0  # MoE: experts per rank, num_experts / ep (0: dense)
    moe_intermediate_local: int = 0  # MoE: each expert's features per rank, ceil(moe_intermediate_size / moe_tp)
    shared_intermediate_local: int = 0  # MoE: shared-expert features per rank, ceil(shared / tp)
    # MoE, token-generation graphs in a layout of their own (ParallelConfig.ep_decode; 0: the same layout)
    ep_decode: int = 0
    experts_local_decode: int = 0
    moe_intermediate_local_decode: int = 0

    @property
    def cp(self) -> bool:
        """Context-parallel prefill (ParallelConfig.cp_degree > 1)."""
        return self.cp_degree > 1

    @property
    def cp_heads(self) -> bool:
        """Context-parallel prefill over ranks that each hold whole KV heads (the shard layout, cp_degree = tp): a
        prefill's attention splits by tokens over every head, not by heads."""
        return self.cp and self.strategy == SHARD

    @property
    def hybrid(self) -> bool:
        """Decode and verify graphs apply a second copy of the experts, laid out for ep_decode groups."""
        return self.ep_decode not in (0, self.ep)

    def decode_layout(self) -> HeadLayout:
        """The layout token-generation graphs run on (this one unless `hybrid`)."""
        if not self.hybrid:
            return self
        return replace(self, ep=self.ep_decode, experts_local=self.experts_local_decode,
                       moe_intermediate_local=self.moe_intermediate_local_decode, ep_decode=0,
                       experts_local_decode=0, moe_intermediate_local_decode=0)

    @property
    def moe_tp(self) -> int:
        """Ranks each expert is split over (tp / ep)."""
        return self.tp // self.ep

    def expert_range(self, rank: int) -> range:
        """Global ids of the experts `rank` holds."""
        first = (rank // self.moe_tp) * self.experts_local
        return range(first, first + self.experts_local)

    @property
    def n_heads_local(self) -> int:
        return self.n_heads * self.kv_seq_shards // self.tp

    @property
    def n_kv_local(self) -> int:
        return self.n_kv_heads * self.kv_seq_shards // self.tp

    @property
    def vocab_local(self) -> int:
        return self.vocab_padded // self.tp

    @property
    def intermediate_padded(self) -> int:
        return self.intermediate_local * self.tp

    def local_positions(self, length: int) -> int:
        """Of `length` positions of a sequence, how many this rank stores: all, or ceil(length / g) under
        kv-seq-shard."""
        return math.ceil(length / self.kv_seq_shards)

    def block_positions(self, block_size: int) -> int:
        """Positions of a KV block this rank stores: block_size, or block_size / g under kv-seq-shard (each group
        rank holds every g-th position of every block)."""
        if block_size % self.kv_seq_shards:
            raise ConfigError(f"block_size: {block_size} must be a multiple of {self.kv_seq_shards} under flash "
                              f"decoding (each of the {self.kv_seq_shards} ranks of a KV group holds every "
                              f"{self.kv_seq_shards}th position of a block)")
        return block_size // self.kv_seq_shards


def head_layout(cfg: ModelConfig, par: ParallelConfig) -> HeadLayout:
    """Choose the head layout for `par.tp` ranks (see the module docstring for the strategies)."""
    tp = par.tp
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    common = dict(
        tp=tp,
        head_dim=cfg.head_dim,
        intermediate_local=math.ceil(cfg.intermediate_size / tp),
        vocab_padded=math.ceil(cfg.vocab_size / tp) * tp,
        **_moe_layout(cfg, par),
    )
    if tp == 1:
        return HeadLayout(n_heads=nq, n_kv_heads=nkv, strategy=SHARD, **common)
    if par.cp_degree > 1:
        check_cp_degree(cfg, par)
        if nkv >= tp:
            return HeadLayout(n_heads=nq, n_kv_heads=nkv, strategy=SHARD, cp_degree=par.cp_degree, **common)
    if (par.flash_decoding or par.cp_degree > 1) and nkv < tp:
        if tp % nkv:
            raise ConfigError(
                f"flash_decoding: tp={tp} is not a multiple of num_key_value_heads={nkv}, so KV "
                f"groups of equal size cannot be formed; use tp in "
                f"{[nkv * k for k in range(2, 5)]} or drop --flash-decoding"
            )
        return HeadLayout(
            n_heads=nq, n_kv_heads=nkv, strategy=KV_SEQ_SHARD, kv_seq_shards=tp // nkv, cp_degree=par.cp_degree,
            **common
        )
    can_shard = nq % tp == 0 and nkv % tp == 0
    can_replicate = nq % tp == 0 and tp % nkv == 0
    want = par.gqa_strategy
    if want == REPLICATE_KV and not (can_shard or can_replicate):
        raise ConfigError(
            f"gqa_strategy: replicate-kv needs num_attention_heads ({nq}) divisible by tp ({tp}) "
            f"and tp divisible by num_key_value_heads ({nkv}); use --gqa-strategy mha or auto"
        )
    if want != MHA and can_shard:
        return HeadLayout(n_heads=nq, n_kv_heads=nkv, strategy=SHARD, **common)
    if want != MHA and can_replicate:
        return HeadLayout(n_heads=nq, n_kv_heads=tp, strategy=REPLICATE_KV, **common)
    nq_pad = math.ceil(nq / tp) * tp
    return HeadLayout(n_heads=nq_pad, n_kv_heads=nq_pad, strategy=MHA, **common)


def check_cp_degree(cfg: ModelConfig, par: ParallelConfig) -> None:
    """Context-parallel prefill splits a prefill over the ranks that share a KV head (the flash-decoding groups of
    tp / num_key_value_heads ranks): `cp_degree` must be that group size. With as many KV heads as tp or more it
    splits over all tp ranks of the shard layout (each rank whole KV heads): `cp_degree` must be tp."""
    nkv, nq, tp, cp = cfg.num_key_value_heads, cfg.num_attention_heads, par.tp, par.cp_degree
    if nkv >= tp:
        if cp != tp or nkv % tp or nq % tp:
            raise ConfigError(
                f"cp_degree: with {nkv} KV heads at tp {tp} every rank holds whole KV heads, and context-parallel "
                f"prefill splits a prefill's attention over all tp ranks by tokens, so cp_degree must be tp ({tp}) "
                f"and tp must divide the heads (num_attention_heads {nq}, num_key_value_heads {nkv}: the shard "
                f"layout); got cp_degree {cp}")
        if par.sequence_parallel:
            raise ConfigError("cp_degree: context-parallel prefill with whole KV heads per rank gathers the step's "
                              "attention output over the ranks in token order, which sequence parallelism would "
                              "scatter again; drop --sequence-parallel or use --cp-degree 1")
    elif tp % nkv or tp // nkv != cp:
        shared = (f"the KV groups have {tp // nkv} ranks each (tp {tp} / {nkv} KV heads): use --cp-degree "
                  f"{tp // nkv}" if tp % nkv == 0 else f"tp {tp} is not a multiple of the {nkv} KV heads")
        raise ConfigError(f"cp_degree: context-parallel prefill splits a prompt over the ranks that share a KV head "
                          f"(flash decoding's groups of tp / num_key_value_heads ranks), so cp_degree must be that "
                          f"group size; {shared}")
    if cfg.qk_norm_full:
        raise ConfigError("cp_degree: OLMo 2's q/k norms span every head's features of a token, summed over all "
                          "ranks, which context parallelism gives different tokens; use --cp-degree 1")


def _moe_layout(cfg: ModelConfig, par: ParallelConfig) -> dict[str, int]:
    if not cfg.is_moe:
        if par.ep != 1 or par.decode_ep != 1:
            raise ConfigError(f"ep: expert parallelism needs a mixture-of-experts model; {cfg.architecture} is "
                              f"dense (use --ep 1, no --ep-decode)")
        return {}
    E = cfg.num_experts

    def experts(ep: int, flag: str) -> dict[str, int]:
        if E % ep:
            raise ConfigError(f"{flag}: {ep} does not divide num_experts={E}; use one of "
                              f"{[d for d in range(1, par.tp + 1) if E % d == 0 and par.tp % d == 0]}")
        return dict(ep=ep, experts_local=E // ep,
                    moe_intermediate_local=math.ceil(cfg.moe_intermediate_size / (par.tp // ep)))

    out = {**experts(par.ep, "ep"),
           "shared_intermediate_local": math.ceil(cfg.shared_expert_intermediate_size / par.tp)}
    if par.decode_ep != par.ep:
        dec = experts(par.decode_ep, "ep_decode")
        out.update(ep_decode=dec["ep"], experts_local_decode=dec["experts_local"],
                   moe_intermediate_local_decode=dec["moe_intermediate_local"])
    return out


def head_sources(cfg: ModelConfig, lay: HeadLayout, rank: int) -> tuple[list[int | None], list[int | None]]:
    """(query, kv) source head of each of `rank`'s local heads; None is a zero padding head."""
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    group = nq // nkv
    nql, nkvl = lay.n_heads_local, lay.n_kv_local
    if lay.strategy == KV_SEQ_SHARD:
        k = rank // lay.kv_seq_shards  # this rank's KV group
        return list(range(k * group, (k + 1) * group)), [k]
    q: list[int | None] = [h if h < nq else None for h in range(rank * nql, (rank + 1) * nql)]
    if lay.strategy == SHARD:
        kv: list[int | None] = list(range(rank * nkvl, (rank + 1) * nkvl))
    elif lay.strategy == REPLICATE_KV:
        kv = [q[0] // group]  # type: ignore[operator]  # all of this rank's query heads share one KV head
    else:  # mha: one KV head per (padded) query head
        kv = [(h // group) if h is not None else None for h in q]
    return q, kv


def _pick_heads(w: torch.Tensor, src: list[int | None], D: int) -> torch.Tensor:
    """Rows of a head-major weight [n*D, ...] for the heads `src` (None -> zeros): [len(src)*D, ...]."""
    heads = w.reshape(-1, D, *w.shape[1:])  # [n_src, D, ...]
    out = torch.zeros((len(src), D, *w.shape[1:]), dtype=w.dtype)
    for i, s in enumerate(src):
        if s is not None:
            out[i] = heads[s]
    return out.reshape(len(src) * D, *w.shape[1:])  # [len(src)*D, ...]


def _pad_dim(w: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`w` with zeros appended along `dim` up to `size` (padded vocabulary rows, MLP features)."""
    missing = size - w.shape[dim]
    if missing == 0:
        return w
    shape = list(w.shape)
    shape[dim] = missing
    return torch.cat([w, w.new_zeros(shape)], dim=dim)


def shard_state_dict(
    sd: dict[str, torch.Tensor], cfg: ModelConfig, lay: HeadLayout, rank: int
) -> dict[str, torch.Tensor]:
    """Canonical (HF-named) full state dict -> this rank's shard, with head padding/replication applied."""
    return {n: t for name, w in sd.items() for n, t in rank_shards(name, w, cfg, lay, rank) if t is not None}


def rank_shards(name: str, w: torch.Tensor, cfg: ModelConfig, lay: HeadLayout,
                rank: int) -> Iterator[tuple[str, torch.Tensor | None]]:
    """One canonical tensor -> (name, this rank's shard) pairs: the tensor's shard (`shard_tensor`), and under a
    hybrid expert layout an expert's second shard, in the decode layout, under its `experts_decode` name."""
    yield name, shard_tensor(name, w, cfg, lay, rank)
    if lay.hybrid and rule_for(name) == EXPERT:
        second = shard_tensor(name, w, cfg, lay.decode_layout(), rank)
        # its own storage: both shards may be views of `w` (safetensors refuses to save shared storage)
        yield decode_expert_name(name), None if second is None else second.clone()


def decode_expert_name(name: str) -> str:
    """`...experts.{j}.w1.weight` -> `...experts_decode.{j}.w1.weight`."""
    m = re.fullmatch(EXPERT_NAME, name)
    if m is None:
        raise ValueError(f"{name} is not an expert's tensor")
    return m.group(1) + "_decode" + name[m.end(1):]


def shard_tensor(name: str, w: torch.Tensor, cfg: ModelConfig, lay: HeadLayout, rank: int) -> torch.Tensor | None:
    """One canonical tensor -> this rank's shard of it (what `shard_state_dict` does per entry; compile streams
    a checkpoint through it one tensor at a time). None: an expert another expert-parallel group holds."""
    D, tp = cfg.head_dim, lay.tp
    rule = rule_for(name)
    if rule == EXPERT:
        m = re.fullmatch(EXPERT_NAME, name)
        j = int(m.group(2))  # type: ignore[union-attr]
        if not 0 <= j < cfg.num_experts:
            raise ValueError(f"{name}: expert {j} does not exist (num_experts={cfg.num_experts})")
        if j not in lay.expert_range(rank):
            return None
        part = EXPERT_PARTS[m.group(3)]  # type: ignore[union-attr]
        if part == "down" and m.group(4) == "bias":  # [H], added once per expert: by the group's first rank
            return (w if rank % lay.moe_tp == 0 else torch.zeros_like(w)).contiguous()
        dim = 1 if part == "down" else 0  # down [H, I]: its input features; gate/up biases [I]: dim 0
        w = _pad_dim(w, dim, lay.moe_intermediate_local * lay.moe_tp)
        return w.chunk(lay.moe_tp, dim=dim)[rank % lay.moe_tp].contiguous() if lay.moe_tp > 1 else w.contiguous()
    if re.fullmatch(r".*\.q_proj\.(weight|bias)", name):
        w = _pick_heads(w, head_sources(cfg, lay, rank)[0], D)
    elif re.fullmatch(r".*\.[kv]_proj\.(weight|bias)", name):
        w = _pick_heads(w, head_sources(cfg, lay, rank)[1], D)
    elif name.endswith("self_attn.sinks"):  # GPT-OSS: one logit per query head, picked as q's heads (zero: padding)
        w = _pick_heads(w, head_sources(cfg, lay, rank)[0], 1)
    elif name.endswith("o_proj.weight"):  # columns of this rank's heads: [H, nql*D]
        w = _pick_heads(w.t().contiguous(), head_sources(cfg, lay, rank)[0], D).t()
    elif cfg.qk_norm_full and re.fullmatch(r".*\.self_attn\.[qk]_norm\.weight", name):
        # OLMo 2's norms over all heads' features [n * D]: this rank's heads' parts, as the q/k rows
        w = _pick_heads(w, head_sources(cfg, lay, rank)[0 if name.endswith("q_norm.weight") else 1], D)
    elif rule in (COLUMN, VOCAB):
        if name in ("lm_head.weight", "model.embed_tokens.weight"):
            w = _pad_dim(w, 0, lay.vocab_padded)
        elif re.fullmatch(r".*\.mlp\.(gate|up)_proj\.(weight|bias)", name):
            w = _pad_dim(w, 0, lay.intermediate_padded)
        elif ".shared_expert." in name:
            w = _pad_dim(w, 0, lay.shared_intermediate_local * tp)
        w = w.chunk(tp, dim=0)[rank] if tp > 1 else w
    elif rule == ROW:
        if name.endswith("mlp.down_proj.weight"):
            w = _pad_dim(w, 1, lay.intermediate_padded)
        elif ".shared_expert." in name:
            w = _pad_dim(w, 1, lay.shared_intermediate_local * tp)
        w = w.chunk(tp, dim=1)[rank] if tp > 1 else w
    return w.contiguous()


@dataclass(frozen=True)
class LayoutCost:
    """What a head layout costs, for the compile plan."""

    description: str
    weight_bytes_per_rank: int
    kv_bytes_per_rank: int
    kv_bytes_unsharded_per_rank: int  # KV bytes per rank if the cache split perfectly tp ways (the ideal)

    def line(self) -> str:
        extra = self.kv_bytes_per_rank / max(1, self.kv_bytes_unsharded_per_rank)
        return (
            f"heads: {self.description}; per rank: weights {self.weight_bytes_per_rank / 2**20:.1f} MiB, "
            f"KV {self.kv_bytes_per_rank / 2**20:.1f} MiB ({extra:.2f}x the ideal 1/tp split)"
        )


def layout_cost(
    cfg: ModelConfig, lay: HeadLayout, num_blocks: int, block_size: int, dtype_bytes: int
) -> LayoutCost:
    """A one-line description of the layout and its weight/KV bytes per rank (from the shard shapes)."""
    nq, nkv, D, H, L = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.hidden_size,
        cfg.num_hidden_layers,
    )
    what = {
        SHARD: f"{nq} q / {nkv} kv heads split evenly" + (
            f"; context-parallel prefill (cp_degree {lay.cp_degree}): each rank runs a prefill's attention for "
            f"1/{lay.cp_degree} of its tokens over every head" if lay.cp else ""),
        REPLICATE_KV: f"kv heads replicated to {lay.n_kv_heads} (each of {nkv} stored {lay.tp // nkv}x)",
        MHA: f"converted to MHA: {nq} q heads padded to {lay.n_heads}, one kv head per q head",
        KV_SEQ_SHARD: (
            f"flash decoding: {nkv} kv group(s) of {lay.kv_seq_shards} ranks, KV cache split along "
            f"the sequence, q/o weights of a group duplicated {lay.kv_seq_shards}x"
            + (f"; context-parallel prefill (cp_degree {lay.kv_seq_shards}): a group's ranks split a prefill's "
               "tokens" if lay.cp else "")
        ),
    }[lay.strategy]
    what = f"{lay.strategy}: {what} ({lay.n_heads_local} q / {lay.n_kv_local} kv per rank)"
    attn = (2 * lay.n_heads_local + 2 * lay.n_kv_local) * D * H
    mlp = 3 * lay.intermediate_local * H
    vocab = lay.vocab_local * H * (1 if cfg.tie_word_embeddings else 2)
    weights = (L * (attn + mlp + 2 * H) + vocab + H) * dtype_bytes
    kv = 2 * L * num_blocks * lay.block_positions(block_size) * lay.n_kv_local * D * dtype_bytes
    ideal = 2 * L * num_blocks * block_size * nkv * D * dtype_bytes // lay.tp
    return LayoutCost(what, weights, kv, ideal)
