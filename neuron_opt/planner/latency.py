"""Latency per step from first principles: TensorE FLOPs, HBM bytes, collectives, fixed overheads.

A step (one graph execution, prefill or decode) costs

    max(FLOPs / (peak * eff.tensor), bytes / (HBM bandwidth * eff.hbm))
    + [prefill, scores materialised] score elements * eff.attention_score_s
    + n_collectives * (eff.collective_latency_s + ring bytes / link bandwidth)
    + [prefill] 2 * layers * ring_steps(chips) * eff.prefill_hop_latency_s
    + eff.step_overhead_s + [prefill] (batch - 1) * eff.prefill_row_s

per rank (every rank does the same work under Megatron TP). Compute and HBM traffic overlap (engines and
DMA run concurrently); collectives are on the critical path between layers (the next layer needs the
reduced sum).

- FLOPs: 2 per weight element per token for the linears (padded heads included: padding is real work), plus
  attention 4 * q_len * kv_len * D per local head (QK^T and PV), computed over the whole masked square because
  our graphs mask rather than skip (a flash-attention kernel skips the causal upper triangle: half); the LM head
  runs on the last position of each row only.
- Score elements: batch * layers * local heads * S^2 of the materialised score matrix, whose elementwise passes
  run on the vector/scalar engines (no such term under a flash-attention kernel).
- Bytes: every weight is read once per step; decode also reads the K and V of its bucket's kv_len positions
  for every row of the batch (not the cache's max length: that is what decode length buckets buy).
- Collectives: Megatron TP does two all-reduces per layer (after o_proj and down_proj) of [tokens, H]
  activations in bfloat16, plus one gather of sampling candidates after the vocab-parallel LM head (latency
  only). The all-reduce is modelled hierarchically: cores of a chip reduce through the chip's DMA engines,
  then a ring over the c chips sends 2 (c - 1) / c of the message through each chip's NeuronLink.
- LoRA adapters (`lora`, compile --enable-lora): the per-row adapter products' FLOPs and the adapter slices each
  row reads (neuron_opt.planner.lora.bgmv_step) join the compute and memory terms.
- Weight-only quantization (int8/fp8) halves weight bytes but not FLOPs: weights are dequantized to bfloat16
  before TensorE, so the bfloat16 peak applies.

The seven constants (`Efficiency`) are named and justified in docs/planner.md. `hbm` is taken from AWS's
NKI performance guide; the other six are calibrated once, jointly, on the Llama-3 inf2.48xlarge rows of AWS's
published tables and then held fixed for every other model, instance and stack (neuron_opt.planner.validation:
the fit, the held-out rows and their errors).
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_opt.config import ModelConfig
from neuron_opt.lora.config import LoraConfig
from neuron_opt.parallel.sharding import HeadLayout
from neuron_opt.planner.collectives import layer_collectives
from neuron_opt.planner.hardware import Instance
from neuron_opt.planner.lora import bgmv_step
from neuron_opt.planner.memory import dtype_bytes, weight_bytes, weight_count
from neuron_opt.planner.moe import expert_step


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
        attention_score_s: elementwise work per materialised score element per rank (calibrated).
        prefill_row_s: fixed cost of each prompt row of a prefill call beyond the first, whatever its length
            (calibrated on the batched fit rows; docs/planner.md, "Batched rows").
    """

    hbm: float = 0.6
    tensor: float = 0.30
    collective_latency_s: float = 5e-6
    step_overhead_s: float = 3.75e-3
    prefill_hop_latency_s: float = 12e-6
    attention_score_s: float = 9e-11
    prefill_row_s: float = 2e-3


DEFAULT_EFFICIENCY = Efficiency()
ACT_BYTES = 2  # activations and collectives in bfloat16
# What a decode step that returns its logits and samples on the host adds to one that samples in the graph (the
# neuron backend's default; docs/planner.md, "Sampling on the host"), measured on the XLA tier (torch-xla's CPU
# client, docs/neuron_backend.md): the rate a [8, 128256] fp32 output reached the host, and the host sampler's time
# per logit for temperature rows (runtime/sampling.py, one thread; a top-p row's sort costs 14x that)
LOGITS_D2H_BYTES_PER_S = 2.5e8
HOST_SAMPLE_S_PER_LOGIT = 2.7e-8


def host_sampling_time(cfg: ModelConfig, batch: int) -> float:
    """Seconds a decode step of `batch` rows would add by moving its fp32 logits [batch, vocab] to the host and
    sampling there, rather than sampling in the graph and moving out the token ids."""
    logits = batch * cfg.vocab_size
    return logits * 4 / LOGITS_D2H_BYTES_PER_S + logits * HOST_SAMPLE_S_PER_LOGIT


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


def collectives_time(
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
    # per layer: two all-reduces, and under flash decoding the merge of partial softmax results in the KV group
    n = cfg.num_hidden_layers * len(layer_collectives(lay, sequence_parallel=False))
    hops = inst.ring_steps(chips) * hop_latency
    return n * (eff.collective_latency_s + wire + hops) + eff.collective_latency_s


def _lora(cfg: ModelConfig, lay: HeadLayout, lora: LoraConfig | None, rows: int, tokens: int,
          dtype: str) -> tuple[float, int]:
    """The adapter products' (FLOPs, bytes) of a step (none without a LoRA capacity)."""
    if lora is None:
        return 0.0, 0
    return bgmv_step(cfg, lay, lora, rows=rows, tokens=tokens, act_bytes=4 if dtype == "float32" else 2)


def _attention_flops(cfg: ModelConfig, lay: HeadLayout, batch: int, q_len: int, kv_len: int) -> float:
    return 4.0 * batch * cfg.num_hidden_layers * lay.n_heads_local * q_len * kv_len * lay.head_dim


def _score_time(cfg: ModelConfig, lay: HeadLayout, batch: int, q_len: int, kv_len: int, eff: Efficiency) -> float:
    """Elementwise work on the materialised attention scores (scale, mask, max, exp, sum, normalise, casts) on
    the vector/scalar engines, with the score matrix's HBM round trips: per score element per rank."""
    return eff.attention_score_s * batch * cfg.num_hidden_layers * lay.n_heads_local * q_len * kv_len


def prefill_time(
    cfg: ModelConfig,
    lay: HeadLayout,
    inst: Instance,
    *,
    batch: int,
    seq: int,
    dtype: str,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    flash: bool = False,
    lora: LoraConfig | None = None,
) -> StepTime:
    """One prefill graph of `batch` rows padded to `seq` tokens (the bucket, not the prompt length).

    `flash`: attention runs as a flash-attention kernel (NxDI's, or transformers-neuronx's beyond 8k tokens):
    causal tiles above the diagonal are skipped (half the attention FLOPs) and no score matrix is materialised
    (no score term). Our own graphs run with flash=False (the `torch` ops) unless built with `ops=nki`."""
    n = weight_count(cfg, lay)
    tokens = batch * seq
    attention = _attention_flops(cfg, lay, batch, seq, seq) * (0.5 if flash else 1.0)
    flops = 2.0 * tokens * n.linear + attention + 2.0 * batch * cfg.hidden_size * lay.vocab_local
    if cfg.is_moe:  # prefill graphs run every local expert on every token (planner.moe)
        flops += expert_step(cfg, lay, tokens, dense=True)[1]
    scores = 0.0 if flash else _score_time(cfg, lay, batch, seq, seq, eff)
    lora_flops, lora_bytes = _lora(cfg, lay, lora, batch, tokens, dtype)
    return StepTime(
        compute=(flops + lora_flops) / (inst.bf16_flops_per_core * eff.tensor) + scores,
        memory=(weight_bytes(cfg, lay, dtype) + lora_bytes) / (inst.hbm_bw_per_core * eff.hbm),
        collective=collectives_time(cfg, lay, inst, tokens, eff, eff.prefill_hop_latency_s),
        overhead=eff.step_overhead_s + (batch - 1) * eff.prefill_row_s,
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
    lora: LoraConfig | None = None,
    tokens_per_row: int = 1,
) -> StepTime:
    """One decode graph: `batch` rows (the batch bucket) each attending over `kv_len` positions (the length
    bucket). `tokens_per_row` > 1: a verify graph (speculative decoding), k + 1 tokens a row scored at every
    position, which multiplies the compute and the messages but reads the weights and the KV once."""
    n = weight_count(cfg, lay)
    tokens = batch * tokens_per_row
    local = lay.local_positions(kv_len)  # positions this rank attends over (split under kv-seq-shard)
    flops = 2.0 * tokens * (n.linear + cfg.hidden_size * lay.vocab_local) + _attention_flops(
        cfg, lay, batch, tokens_per_row, local
    )
    kv = 2 * cfg.num_hidden_layers * batch * lay.n_kv_local * local * lay.head_dim * dtype_bytes(kv_dtype)
    weights = weight_bytes(cfg, lay, dtype)
    if cfg.is_moe:  # only the experts a step reads (gathered below planner.moe.gather_until, else all)
        read, expert_flops = expert_step(cfg, lay, tokens)
        weights += (read - n.experts) * dtype_bytes(dtype)
        flops += expert_flops
    lora_flops, lora_bytes = _lora(cfg, lay, lora, batch, tokens, dtype)
    return StepTime(
        compute=(flops + lora_flops) / (inst.bf16_flops_per_core * eff.tensor),
        memory=(weights + kv + lora_bytes) / (inst.hbm_bw_per_core * eff.hbm),
        collective=collectives_time(cfg, lay, inst, tokens, eff),
        overhead=eff.step_overhead_s,
    )
