"""Mixture of experts: Mixtral, Qwen2-MoE and Qwen3-MoE on the Llama family's attention, cache and buckets.

A decoder layer's MLP becomes a sparse block: a router (`gate`, [E, H], replicated) scores every expert per token,
softmax in fp32 over all E, the top k kept (renormalised over the k when `norm_topk_prob`; Mixtral always), and
the token's output is the weighted sum of its k experts' SwiGLU MLPs. Qwen2-MoE adds a shared expert, a dense
MLP scaled by sigmoid(shared_expert_gate(x)). No token is dropped: there is no capacity factor.

Design decisions
- Experts are stacked per rank: `experts.gate_up_proj` [E_local, 2 * I_local, H] (gate rows, then up rows) and
  `experts.down_proj` [E_local, H, I_local], so an expert is an index, not a module. Checkpoints store one
  tensor per expert and projection (`experts.{j}.w1.weight`, ...); the loader writes each into its slot
  (`stacked_slot`), after `parallel.sharding.shard_tensor` has kept only this rank's experts and features.
- Parallelism (parallel/sharding.py): ep groups of tp / ep ranks; group e holds experts [e E/ep, (e+1) E/ep)
  and splits each over its ranks as a dense MLP is split. Every rank routes every token (hidden states are
  replicated after attention) and applies its own experts to the tokens routed to them; tokens routed elsewhere
  contribute zero here. All partial sums, the shared expert's included, meet in one all-reduce (a
  reduce-scatter under sequence parallelism): the dense layer's collective, no all-to-all.
- A hybrid layout (ParallelConfig.ep_decode): a second stack, `experts_decode`, in the decode degree's layout;
  token-generation graphs (the model's `decode` flag, static per graph) apply it, prefill graphs `experts`. The
  loader fills both from one pass over the checkpoint (`parallel.sharding.rank_shards` names the second shard
  `...experts_decode.{j}...`).
- Three ways to apply the experts, chosen per call from the token count T (static in every graph but the cpu
  backend's prefill graph) and where the block runs:
    gather  T * k < E_local, or any static T in a cpu graph: each (token, slot) reads only its expert's weights,
            indexed by expert id inside the product (a broadcast product and sum that Inductor fuses into one loop
            nest over the selected rows; no copy of the weights). Bytes: T * k experts; FLOPs: routed only.
    grouped eager on the host, T * k >= E_local: assignments sorted by expert and one grouped GEMM per
            projection (torch._grouped_mm, as HF's grouped experts do). FLOPs: routed only.
    dense   device graphs (XLA) with T * k >= E_local, and the cpu prefill graph (its token count is dynamic):
            every local expert on every token, weighted by a [T, E_local] matrix that is zero off the top k. Reads
            each expert once and computes E_local / k times the routed FLOPs; exact (the zero weights drop the rest).
            On a NeuronCore, decode is bound by bytes, so from T * k >= E_local reading every expert once is the
            cheaper side; a CPU core is not (measured: dense decode at batch 8 ran slower than gather),
            so cpu decode graphs keep gathering.
  The plan (neuron_opt.planner.moe) models the device rule.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from models.llama import TORCH_OPS, LlamaForCausalLM, TorchOps, expected_weight_names
from neuron_opt.config import ModelConfig
from neuron_opt.parallel import SINGLE, ColumnParallelLinear, HeadLayout, ParallelContext, RowParallelLinear
from neuron_opt.parallel.layers import seq_scatter
from neuron_opt.parallel.sharding import DECODE_EXPERT_NAME, EXPERT_NAME, EXPERT_PARTS

GATHER, GROUPED, DENSE = "gather", "grouped", "dense"
EAGER, CPU_GRAPH, DEVICE = "eager", "cpu-graph", "device"


def moe_strategy(tokens: int, top_k: int, experts_local: int, where: str) -> str:
    """How a sparse block applies its experts to a static `tokens` tokens (see the module docstring); `where`:
    EAGER (host tensors, not tracing), CPU_GRAPH (traced for the cpu backend) or DEVICE (XLA)."""
    if tokens * top_k < experts_local or where == CPU_GRAPH:
        return GATHER
    return GROUPED if where == EAGER else DENSE


def _tracing() -> bool:
    return bool(torch.compiler.is_compiling() or torch.compiler.is_exporting())


class Router(nn.Module):
    """HF's `gate` (GPT-OSS: `router`): logits = x W^T (+ b: router_bias) in x's dtype, softmax in fp32, top k,
    optional renormalisation; or (router_topk_softmax, GPT-OSS) the top k logits, then a softmax over those k."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        if cfg.router_bias:
            self.bias = nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False)
        else:
            self.bias = None
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.topk_softmax = cfg.router_topk_softmax

    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """t [T, H] -> (weights [T, k] fp32, expert ids [T, k])."""
        logits = F.linear(t, self.weight, self.bias)  # [T, E]
        if self.topk_softmax:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top.float(), dim=-1), ids
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class Experts(nn.Module):
    """This rank's experts, stacked: gate_up_proj [E_local, 2 * I_local, H], down_proj [E_local, H, I_local];
    with expert_bias (GPT-OSS) gate_up_proj_bias [E_local, 2 * I_local] and down_proj_bias [E_local, H] (a rank
    holds an expert's down bias only if it is the first of the expert's moe_tp ranks, zeros else: the group's
    partial sums then add it once). The activation is SwiGLU, or GPT-OSS's clamped form (`act`)."""

    def __init__(self, cfg: ModelConfig, lay: HeadLayout) -> None:
        super().__init__()
        E, H, I = lay.experts_local, cfg.hidden_size, lay.moe_intermediate_local
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)
        if cfg.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(E, H), requires_grad=False)
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        # traced gather as torch.ops.neuron_opt.moe_gather (the cpu backend's C++ operator, which that backend loads
        # before tracing and sets this for; its `moe_gather` option)
        self.kernel = False

    @property
    def kernel_limit(self) -> str | None:
        """Why cpu_ops' moe_gather cannot apply these experts (None: it can): it computes silu(gate) * up products
        without biases."""
        if self.gate_up_proj_bias is not None or self.limit is not None:
            return "expert biases and the clamped SwiGLU (GPT-OSS): moe_gather has neither"
        return None

    def act(self, h: torch.Tensor, I: int) -> torch.Tensor:
        """h [..., 2I] (gate features, then up) -> [..., I]: silu(gate) * up, or with swiglu_limit GPT-OSS's
        (up + 1) * g * sigmoid(alpha * g), g = gate clamped above at the limit, up clamped to [-limit, limit]
        (zero gate and up give zero: padded features stay zero)."""
        if self.limit is None:
            return F.silu(h[..., :I]) * h[..., I:]
        gate = h[..., :I].clamp(max=self.limit)
        up = h[..., I:].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def gather(self, t: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, local: torch.Tensor,
               traced: bool) -> torch.Tensor:
        """Only the selected experts' rows: t [T, H], ids/weights [T, k] (local ids, weights 0 where not local).

        Traced: one broadcast product and sum over the indexed weights, which a compiler fuses into a loop over the
        selected rows. Eager: a loop over the (token, slot) pairs on views of the stacked weights (the broadcast
        form would materialise each selected expert's products; at most E_local - 1 pairs take this path), skipping
        the pairs whose expert another rank holds."""
        I = self.down_proj.shape[2]
        bu, bd = self.gate_up_proj_bias, self.down_proj_bias
        if traced and self.kernel:  # the same sums, each selected expert's weights streamed once
            if self.kernel_limit is not None:
                raise ValueError(f"moe_gather kernel: {self.kernel_limit}")
            return torch.ops.neuron_opt.moe_gather(t, self.gate_up_proj, self.down_proj, ids, weights)
        if not traced:
            out = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
            for i, j in local.nonzero().tolist():
                e = int(ids[i, j])
                h = F.linear(t[i], self.gate_up_proj[e], None if bu is None else bu[e])  # [2I]
                y = F.linear(self.act(h, I), self.down_proj[e], None if bd is None else bd[e])
                out[i] += weights[i, j] * y.float()
            return out
        # products and sums in fp32 (as a GEMM accumulates; a compiler may round a low-precision product before the
        # sum otherwise); a fused loop converts each weight as it reads it, so the bytes read stay the stored ones
        h = (self.gate_up_proj[ids].float() * t.float()[:, None, None, :]).sum(-1)  # [T, k, 2I]
        if bu is not None:
            h = h + bu[ids].float()
        a = self.act(h, I).to(t.dtype).float()  # [T, k, I], rounded as the eager path rounds
        y = (self.down_proj[ids].float() * a[:, :, None, :]).sum(-1)  # [T, k, H]
        if bd is not None:
            y = y + bd[ids].float()
        return (y * weights[..., None]).sum(1)  # [T, H] fp32

    def grouped(self, t: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Assignments sorted by expert, one grouped GEMM per projection; `local` [T, k]: the expert is here."""
        E, I, k = self.down_proj.shape[0], self.down_proj.shape[2], ids.shape[1]
        key = torch.where(local, ids, E).flatten()  # [T*k]; E: another rank's expert, sorted last
        order = torch.argsort(key, stable=True)
        offs = torch.cumsum(torch.bincount(key, minlength=E + 1)[:E], 0).to(torch.int32)  # [E] group ends
        xs = t[order // k]  # [T*k, H]
        h = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs)  # [T*k, 2I]
        expert = key[order].clamp(max=E - 1)  # each sorted row's expert (rows of other ranks' experts: dropped)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[expert]
        a = self.act(h, I)
        y = torch._grouped_mm(a, self.down_proj.transpose(1, 2), offs)  # [T*k, H]; rows past offs[-1] unset
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[expert]
        w = weights.flatten()[order]
        y = torch.where(local.flatten()[order][:, None], y.float() * w[:, None], 0.0)
        return torch.zeros(t.shape[0], t.shape[1], dtype=torch.float32).index_add_(0, order // k, y)

    def dense(self, t: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every local expert on every token, combined with a [T, E_local] weight matrix zero off the top k."""
        E, I = self.down_proj.shape[0], self.down_proj.shape[2]
        h = torch.einsum("th,eih->tei", t, self.gate_up_proj)  # [T, E, 2I]
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias
        a = self.act(h, I)  # [T, E, I]
        y = torch.einsum("tei,ehi->teh", a, self.down_proj)  # [T, E, H]
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias
        dense_w = torch.zeros(t.shape[0], E, dtype=torch.float32, device=t.device).scatter_add(1, ids, weights)
        return torch.einsum("teh,te->th", y.float(), dense_w)  # [T, H] fp32


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP split over all tp ranks; `partial` is this rank's un-reduced sum."""

    def __init__(self, cfg: ModelConfig, lay: HeadLayout, pctx: ParallelContext) -> None:
        super().__init__()
        H, I = cfg.hidden_size, lay.shared_intermediate_local
        self.gate_proj = ColumnParallelLinear(H, I, False, pctx)
        self.up_proj = ColumnParallelLinear(H, I, False, pctx)
        self.down_proj = RowParallelLinear(I, H, False, pctx)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.partial(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """The sparse MLP of one decoder layer on this rank (HF names: `gate` (GPT-OSS: `router`), `experts`,
    `shared_expert`, `shared_expert_gate`).

    Under a hybrid layout (HeadLayout.hybrid) `experts_decode` holds the experts a second time, laid out for
    `ep_decode` groups, and token-generation steps (decode, verify) apply that copy; prefill steps apply
    `experts`. Either copy gives the same sums (the all-reduce adds every expert's contribution exactly once)."""

    per_phase = True  # models.llama.DecoderLayer passes `decode`

    def __init__(self, cfg: ModelConfig, lay: HeadLayout, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx, self.lay = pctx, lay
        self.router_name = router_name(cfg)
        self.add_module(self.router_name, Router(cfg))
        self.experts = Experts(cfg, lay)
        self.lay_decode = lay.decode_layout()  # `lay` itself unless hybrid
        if lay.hybrid:
            self.experts_decode = Experts(cfg, self.lay_decode)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg, lay, pctx)
            self.shared_expert_gate = ColumnParallelLinear(cfg.hidden_size, 1, False, pctx)  # replicated [1, H]
        else:
            self.shared_expert = None

    def _first_expert(self, lay: HeadLayout) -> int | torch.Tensor:
        """Global id of this rank's first expert under `lay` (a tensor under SPMD, where the rank is one)."""
        if lay.ep == 1:
            return 0
        return (self.pctx.rank_value() // lay.moe_tp) * lay.experts_local

    def forward(self, x: torch.Tensor, seq_sharded: bool = False, decode: bool = False) -> torch.Tensor:
        if seq_sharded:
            x = self.pctx.comm.all_gather(x, dim=1)  # [B, S_pad, H] from [B, S_pad/tp, H]
        B, S, H = x.shape
        t = x.reshape(B * S, H)
        weights, ids = getattr(self, self.router_name)(t)  # [T, k]
        lay, experts = (self.lay_decode, self.experts_decode) if decode and self.lay.hybrid else \
            (self.lay, self.experts)
        E = lay.experts_local
        lid = ids - self._first_expert(lay)
        local = (lid >= 0) & (lid < E)
        lid = lid.clamp(0, E - 1)
        weights = weights * local
        where = DEVICE if t.device.type != "cpu" else CPU_GRAPH if _tracing() else EAGER
        if isinstance(B * S, torch.SymInt):  # a dynamic token count (the cpu prefill graph): no branch on it
            how = DENSE
        else:
            how = moe_strategy(B * S, ids.shape[1], E, where)
        # torch's CPU grouped GEMM wants 16-byte-aligned row strides; other widths take the dense path
        if how == GROUPED and any(n * t.element_size() % 16 for n in (H, experts.down_proj.shape[2])):
            how = DENSE
        if how == GATHER:
            out = experts.gather(t, lid, weights, local, traced=where != EAGER)
        elif how == GROUPED:
            out = experts.grouped(t, lid, weights, local)
        else:
            out = experts.dense(t, lid, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(t).float()) * self.shared_expert.partial(t).float()
        partial = out.to(x.dtype).view(B, S, H)
        return seq_scatter(partial, self.pctx) if seq_sharded else self.pctx.comm.all_reduce(partial)


class MoeForCausalLM(LlamaForCausalLM):
    """Llama-family attention, cache and head; every layer's MLP a `SparseMoeBlock` under the checkpoint's name
    for it (Mixtral: `block_sparse_moe`, Qwen-MoE: `mlp`)."""

    def __init__(self, cfg: ModelConfig, lay: HeadLayout, max_model_len: int, pctx: ParallelContext = SINGLE,
                 ops: TorchOps = TORCH_OPS) -> None:
        super().__init__(cfg, lay, max_model_len, pctx, ops,
                         mlp_factory=lambda c, la, px: (moe_module_name(c), SparseMoeBlock(c, la, px)))

    def stacked_slot(self, name: str) -> tuple[str, tuple[int | slice, ...]] | None:
        """Where a checkpoint's per-expert tensor (already this rank's shard) goes: (parameter, index), or None if
        `name` is not one."""
        m = re.fullmatch(EXPERT_NAME, name)
        lay = self.layout
        if m is None:
            m = re.fullmatch(DECODE_EXPERT_NAME, name) if lay.hybrid else None  # the decode layout's copy
            if m is None:
                return None
            lay = lay.decode_layout()
        prefix, j, part = m.group(1), int(m.group(2)), EXPERT_PARTS[m.group(3)]
        suffix = "_bias" if m.group(4) == "bias" else ""  # GPT-OSS's expert biases: [E_local, 2I] and [E_local, H]
        held = lay.expert_range(self.pctx.rank)
        if j not in held:
            raise ValueError(f"{name}: expert {j} is not one of this rank's experts {held.start}..{held.stop - 1} "
                             "(an unsharded checkpoint given to a rank?)")
        slot = j - held.start
        I = lay.moe_intermediate_local
        if part == "down":
            return f"{prefix}.down_proj{suffix}", (slot,)
        return f"{prefix}.gate_up_proj{suffix}", (slot, slice(0, I) if part == "gate" else slice(I, 2 * I))


def moe_module_name(cfg: ModelConfig) -> str:
    return "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"


def router_name(cfg: ModelConfig) -> str:
    return "router" if cfg.model_type == "gpt_oss" else "gate"


def expected_moe_names(cfg: ModelConfig, prefix: str) -> list[str]:
    """A sparse layer's canonical names under `prefix` (e.g. `model.layers.3.`): one tensor per expert and
    projection (GPT-OSS stores them stacked, per layer: models.gpt_oss splits them into these at load)."""
    mod = prefix + moe_module_name(cfg) + "."
    parts = ("w1", "w2", "w3") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    kinds = ("weight", "bias") if cfg.expert_bias else ("weight",)
    names = [mod + router_name(cfg) + ".weight"] + ([mod + router_name(cfg) + ".bias"] if cfg.router_bias else [])
    names += [f"{mod}experts.{j}.{p}.{kind}" for j in range(cfg.num_experts) for p in parts for kind in kinds]
    if cfg.shared_expert_intermediate_size:
        names += [f"{mod}shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        names.append(mod + "shared_expert_gate.weight")
    return names


def moe_weight_names(cfg: ModelConfig) -> list[str]:
    return expected_weight_names(cfg, expected_moe_names)
