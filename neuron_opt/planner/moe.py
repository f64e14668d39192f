"""What a mixture-of-experts layer costs one rank: expert bytes and FLOPs per step, and the expert layout.

Our sparse blocks (models/moe.py) apply experts one of two ways in device graphs, by the step's token count T:
gather T * k expert rows (each (token, slot) reads its expert, so T * k experts' weights per rank, duplicates
re-read) while T * k < E_local, else every local expert once over every token (E_local experts read, E_local / k
times the routed FLOPs; prefill graphs always). So per rank and step:

    experts read = min(T * k, E_local)                      x 3 * H * I_local elements
    expert FLOPs = 2 * T * (k if T * k < E_local else E_local) * 3 * H * I_local

and the batch from which reading all local experts is cheaper is ceil(E_local / k). Under expert parallelism a
rank still evaluates every (token, slot) at small batch (a slot whose expert lives elsewhere reads a local one
and is weighted zero: static shapes), so ep > 1 reads more per rank at small batch; what it buys is wider
expert matrices (moe_intermediate / (tp / ep) features per rank): TensorE works on 128-row tiles, and an expert
split into narrower slices wastes the rest of each tile. The expert FLOPs here count I_local rounded up to a
multiple of 128 for that reason. `planner.recommend.evaluate`, without a fixed ep, evaluates every ep that divides
tp and num_experts for prefill with every one for decode and keeps the fastest end to end (ties: the smaller ep); a
hybrid (two degrees, the experts held twice: `memory.weight_count` counts both) only when it is HYBRID_MIN_GAIN
faster than the best single layout. AWS's guidance for NxDI (TP for <= 32 experts, EP for >= 64) is the same
trade-off.
"""

from __future__ import annotations

import math

from neuron_opt.config import ModelConfig
from neuron_opt.parallel.sharding import HeadLayout

TENSOR_TILE = 128  # TensorE partition rows: expert slices narrower than this waste the rest of the tile


def expert_elements(cfg: ModelConfig, lay: HeadLayout) -> int:
    """Expert weight elements one rank holds (every layer), biases included (GPT-OSS: gate/up biases split as their
    rows, the down bias [H] held by every rank, zeros on all but an expert's first)."""
    per_expert = 3 * cfg.hidden_size * lay.moe_intermediate_local
    if cfg.expert_bias:
        per_expert += 2 * lay.moe_intermediate_local + cfg.hidden_size
    return cfg.num_hidden_layers * lay.experts_local * per_expert


def experts_read(cfg: ModelConfig, lay: HeadLayout, tokens: int, dense: bool = False) -> int:
    """Experts whose weights one rank reads per layer in a step of `tokens` tokens."""
    routed = tokens * cfg.num_experts_per_tok
    return lay.experts_local if dense or routed >= lay.experts_local else routed


def gather_until(cfg: ModelConfig, lay: HeadLayout) -> int:
    """The smallest batch from which a decode step reads every local expert once instead of gathering."""
    return math.ceil(lay.experts_local / cfg.num_experts_per_tok)


def expert_step(cfg: ModelConfig, lay: HeadLayout, tokens: int, dense: bool = False) -> tuple[float, float]:
    """(elements read, FLOPs) of every layer's experts on one rank for a step of `tokens` tokens."""
    per_expert = 3 * cfg.hidden_size * lay.moe_intermediate_local
    n = experts_read(cfg, lay, tokens, dense)
    applied = lay.experts_local if n == lay.experts_local else cfg.num_experts_per_tok
    tile = math.ceil(lay.moe_intermediate_local / TENSOR_TILE) * TENSOR_TILE / lay.moe_intermediate_local
    flops = 2.0 * tokens * applied * per_expert * tile
    return float(cfg.num_hidden_layers * n * per_expert), cfg.num_hidden_layers * flops


def ep_choices(cfg: ModelConfig, tp: int) -> list[int]:
    """Expert-parallel degrees `tp` ranks can use for `cfg` (1 for a dense model)."""
    if not cfg.is_moe:
        return [1]
    return [e for e in range(1, tp + 1) if tp % e == 0 and cfg.num_experts % e == 0]


def moe_line(cfg: ModelConfig, lay: HeadLayout, cpu: bool = False) -> str:
    """The plan table's line on the expert layout (`cpu`: the cpu backend's graphs, whose decode always gathers)."""
    shared = f", shared expert {cfg.shared_expert_intermediate_size}" if cfg.shared_expert_intermediate_size else ""
    dec = lay.decode_layout()
    decode = ("decode gathers the selected experts at every batch (cpu graphs)" if cpu else
              f"decode gathers the selected experts below batch {gather_until(cfg, dec)}, reads all "
              f"{dec.experts_local} from it")

    def split(la: HeadLayout) -> str:
        return (f"ep {la.ep} x moe tp {la.moe_tp}: {la.experts_local} experts x {la.moe_intermediate_local} "
                "features per rank")

    layout = split(lay) if not lay.hybrid else \
        f"prefill {split(lay)}; decode and verify {split(dec)} (a second copy of the experts)"
    return (f"experts: {cfg.num_experts} x {cfg.moe_intermediate_size}, top {cfg.num_experts_per_tok}{shared}; "
            f"{layout}; {decode} (prefill: all); active parameters "
            f"{cfg.active_parameters() / 1e9:.2f} B of {cfg.num_parameters() / 1e9:.2f} B")
