"""Latency per step from first principles: TensorE FLOPs, HBM bytes, collectives, fixed overheads.

A step (one graph execution, prefill or decode) costs

    max(FLOPs / (peak * eff.tensor), bytes / (HBM bandwidth * eff.hbm))
    + n_collectives * (eff.collective_latency_s + ring bytes / link bandwidth)
    + [prefill] 2 * layers * ring_steps(chips) * eff.prefill_hop_latency_s
    + eff.step_overhead_s

per rank (every rank does the same work under Megatron TP). Compute and HBM traffic overlap (engines and
DMA run concurrently); collectives are on the critical path between layers (the next layer needs the
reduced sum).

- FLOPs: 2 per weight element per token for the linears (padded heads included: padding is real work), plus
  attention 4 * q_len * kv_len * D per local head (QK^T and PV), computed over the whole masked square because
  our graphs mask rather than skip; the LM head runs on the last position of each row only.
- Bytes: every weight is read once per step; decode also reads the K and V of its bucket's kv_len positions
  for every row of the batch (not the cache's max length: that is what decode length buckets buy).
- Collectives: Megatron TP does two all-reduces per layer (after o_proj and down_proj) of [tokens, H]
  activations in bfloat16, plus one gather of sampling candidates after the vocab-parallel LM head (latency
  only). The all-reduce is modelled hierarchically: cores of a chip reduce through the chip's DMA engines,
  then a ring over the c chips sends 2 (c - 1) / c of the message through each chip's NeuronLink.
- Weight-only quantization (int8/fp8) halves weight bytes but not FLOPs: weights are dequantized to bfloat16
  before TensorE, so the bfloat16 peak applies.

The five constants (`Efficiency`) are named and justified in docs/planner.md. `hbm` is taken from AWS's
NKI performance guide; the other four are calibrated once, jointly, on the inf2.48xlarge rows of AWS's
published table and then held fixed for every other instance (scripts/validate_planner.py --fit reproduces
the fit; the trn1 and trn2 rows are out-of-sample checks).
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_opt.config import ModelConfig
from neuron_opt.parallel.sharding import HeadLayout
from neuron_opt.planner.hardware import Instance
from neuron_opt.planner.memory import dtype_bytes, weight_bytes, weight_count


@dataclass(frozen=True)
class Efficiency:
    """The latency model's constants (docs/planner.md justifies each).

    Attributes:
        hbm: fraction of peak HBM bandwidth a streaming read achieves. AWS's NKI performance guide calls a
            memory-bound kernel "good" at >= 60% utilisation; taken as is, not fitted.
        tensor: fraction of TensorE peak that whole-model, compiler-generated matmuls reach (calibrated).
        collective_latency_s: fixed cost of one all-reduce on the critical path between layers (calibrated).
        step_overhead_s: fixed cost per graph execution: launch, input copy, sampling, host round trip
            (calibrated).
        prefill_hop_latency_s: extra cost per chip-to-chip ring step of a prefill all-reduce, whose
            megabyte messages travel every hop of the ring in turn (calibrated; decode's kilobyte messages
            are covered by collective_latency_s).
    """

    hbm: float = 0.6
    tensor: float = 0.20
    collective_latency_s: float = 5e-6
    step_overhead_s: float = 3.75e-3
    prefill_hop_latency_s: float = 12e-6


DEFAULT_EFFICIENCY = Efficiency()
ACT_BYTES = 2  # activations and collectives in bfloat16


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on one rank, by cause."""

    compute: float
    memory: float
    collective: float
    overhead: float

    @property
    def total(self) -> float:
        return max(self.compute, self.memory) + self.collective + self.overhead

    @property
    def bound(self) -> str:
        parts = {
            "compute": self.compute,
            "memory": self.memory,
            "collective": self.collective,
            "overhead": self.overhead,
        }
        return max(parts, key=lambda k: parts[k])


def _collectives(
    cfg: ModelConfig, lay: HeadLayout, inst: Instance, tokens: int, eff: Efficiency, hop_latency: float = 0.0
) -> float:
    """All-reduces of one step: 2 per layer + 1 small gather for sampling; zero at tp=1. `hop_latency` is
    paid per ring step over the chips by every per-layer all-reduce (prefill only)."""
    if lay.tp == 1:
        return 0.0
    message = tokens * cfg.hidden_size * ACT_BYTES
    chips = -(-lay.tp // inst.cores_per_chip)
    if chips == 1:  # cores of one chip reduce through shared HBM with the chip's DMA engines
        wire = 2 * (lay.tp - 1) / lay.tp * message / inst.dma_bw_per_chip
    else:  # hierarchical: reduce inside each chip, ring over chips (each chip sends 2 (c-1)/c of the message)
        wire = 2 * (chips - 1) / chips * message / inst.link_bw_per_chip
    n = 2 * cfg.num_hidden_layers
    if lay.kv_seq_shards > 1:  # flash decoding merges partial softmax results in the KV group once per layer
        n += cfg.num_hidden_layers
    hops = inst.ring_steps(chips) * hop_latency
    return n * (eff.collective_latency_s + wire + hops) + eff.collective_latency_s


def _attention_flops(cfg: ModelConfig, lay: HeadLayout, batch: int, q_len: int, kv_len: int) -> float:
    return 4.0 * batch * cfg.num_hidden_layers * lay.n_heads_local * q_len * kv_len * lay.head_dim


def prefill_time(
    cfg: ModelConfig,
    lay: HeadLayout,
    inst: Instance,
    *,
    batch: int,
    seq: int,
    dtype: str,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> StepTime:
    """One prefill graph of `batch` rows padded to `seq` tokens (the bucket, not the prompt length)."""
    n = weight_count(cfg, lay)
    tokens = batch * seq
    flops = (
        2.0 * tokens * n.linear
        + _attention_flops(cfg, lay, batch, seq, seq)
        + 2.0 * batch * cfg.hidden_size * lay.vocab_local
    )
    return StepTime(
        compute=flops / (inst.bf16_flops_per_core * eff.tensor),
        memory=weight_bytes(cfg, lay, dtype) / (inst.hbm_bw_per_core * eff.hbm),
        collective=_collectives(cfg, lay, inst, tokens, eff, eff.prefill_hop_latency_s),
        overhead=eff.step_overhead_s,
    )


def decode_time(
    cfg: ModelConfig,
    lay: HeadLayout,
    inst: Instance,
    *,
    batch: int,
    kv_len: int,
    dtype: str,
    kv_dtype: str,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> StepTime:
    """One decode graph: `batch` rows (the batch bucket) each attending over `kv_len` positions (the length
    bucket)."""
    n = weight_count(cfg, lay)
    local = lay.cache_length(kv_len)  # positions this rank attends over (split under kv-seq-shard)
    flops = 2.0 * batch * (n.linear + cfg.hidden_size * lay.vocab_local) + _attention_flops(
        cfg, lay, batch, 1, local
    )
    kv = 2 * cfg.num_hidden_layers * batch * lay.n_kv_local * local * lay.head_dim * dtype_bytes(kv_dtype)
    return StepTime(
        compute=flops / (inst.bf16_flops_per_core * eff.tensor),
        memory=(weight_bytes(cfg, lay, dtype) + kv) / (inst.hbm_bw_per_core * eff.hbm),
        collective=_collectives(cfg, lay, inst, batch, eff),
        overhead=eff.step_overhead_s,
    )
