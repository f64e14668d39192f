"""GPT-OSS checkpoints: the stacked expert tensors as stored, MXFP4 included, into the canonical per-expert names.

The model itself is the mixture-of-experts decoder (models.moe on models.llama) with GPT-OSS's options
(ModelConfig: attention_sinks, router_bias, router_topk_softmax, expert_bias, swiglu_limit / swiglu_alpha); this
module only reads what its checkpoints store differently from our other MoE families.

Stored layout (per layer, under `model.layers.{i}.mlp.experts.`):
- float checkpoints: `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] (inputs first), with gate and up
  interleaved along the last axis of gate_up_proj (gate features at even positions, up at odd ones);
- MXFP4 checkpoints (as published): `gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 with `gate_up_proj_scales`
  [E, 2I, H/32] uint8, and `down_proj_blocks` [E, H, I/32, 16] with `down_proj_scales` [E, H, I/32] (outputs
  first): each byte holds two FP4 (e2m1) values, the low nibble first; each group of 32 values along the input
  axis shares one E8M0 scale, 2^(scale - 127);
- both: `gate_up_proj_bias` [E, 2I] (interleaved as the weight) and `down_proj_bias` [E, H].

Design decisions
- MXFP4 is dequantized at load (`mxfp4_dequantize`, our own reader, checked against transformers' on random
  blocks): an FP4 value times a power of two is exact in fp32 and in bf16, so the float weights are the stored
  values exactly. Keeping the blocks packed on the device is a later step.
- Each layer's stacked tensors become one tensor per expert and projection under the names Mixtral-style
  checkpoints use (`experts.{j}.gate_proj.weight` [I, H], `up_proj`, `down_proj` [H, I], and their `.bias`), so
  sharding (parallel.sharding: experts per ep group, features per moe tp rank) and the stacked slots
  (models.moe.MoeForCausalLM.stacked_slot) are the MoE families' own. Experts are dequantized one at a time:
  compile holds one expert's floats in flight, not the layer's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from neuron_opt.config import ModelConfig
from neuron_opt.errors import CheckpointError
from neuron_opt.parallel.sharding import EXPERT_NAME, EXPERT_PARTS

# the 16 FP4 (e2m1: sign, 2 exponent bits, 1 mantissa bit) values by code; codes 8..15 are the negatives
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per scale
E8M0_BIAS = 127
# a stacked expert tensor as GPT-OSS checkpoints store it
STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] uint8 and scales [..., G] uint8 -> fp32 [..., G * 32]: byte b of a group holds
    values 2b (low nibble) and 2b + 1 (high nibble), each an FP4 code, times 2^(scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"mxfp4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                              f"(blocks [..., G, {MXFP4_GROUP // 2}], scales [..., G])")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).to(torch.int64)  # [..., G, 16, 2]
    values = table[codes].reshape(*scales.shape, MXFP4_GROUP)  # [..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - E8M0_BIAS)[..., None])
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4_GROUP)


def stored_names(cfg: ModelConfig, names: list[str]) -> list[str]:
    """Canonical `names` as a GPT-OSS checkpoint stores them: each layer's per-expert tensors as its stacked ones
    (MXFP4: blocks and scales for the weights)."""
    out = []
    for n in names:
        m = re.fullmatch(EXPERT_NAME, n)
        if m is None:
            out.append(n)
            continue
        stacked = m.group(1) + "." + ("down_proj" if EXPERT_PARTS[m.group(3)] == "down" else "gate_up_proj")
        if m.group(4) == "bias":
            out.append(stacked + "_bias")
        elif cfg.experts_mxfp4:
            out += [stacked + "_blocks", stacked + "_scales"]
        else:
            out.append(stacked)
    return list(dict.fromkeys(out))


def split_stored(cfg: ModelConfig, name: str, tensor: torch.Tensor,
                 read: Callable[[str], torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A stored tensor as canonical (name, tensor) pairs: a stacked expert tensor as one tensor per expert (gate and
    up de-interleaved; MXFP4 blocks dequantized with their scales, which `read(name)` returns), any other tensor
    as it is. A layer's `_scales` yield nothing: they are read with its blocks."""
    m = STACKED.fullmatch(name)
    if m is None:
        yield name, tensor
        return
    base, proj, kind = m.group(1), m.group(2), m.group(3) or ""
    if kind == "_scales":
        return
    if (kind == "_blocks" and not cfg.experts_mxfp4) or (kind == "" and cfg.experts_mxfp4):
        raise CheckpointError(f"checkpoint: {name}: the config says the experts are "
                              f"{'MXFP4' if cfg.experts_mxfp4 else 'float'} (quantization_config), the file "
                              f"stores them {'as floats' if cfg.experts_mxfp4 else 'as MXFP4 blocks'}")
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gate_up = proj == "gate_up_proj"
    rows, cols = (2 * I, H) if gate_up else (H, I)
    if kind == "_blocks":
        if read is None:
            raise CheckpointError(f"checkpoint: {name}: MXFP4 blocks need their scales ({base}.{proj}_scales)")
        scales = read(f"{base}.{proj}_scales")
        want = {"blocks": (E, rows, cols // MXFP4_GROUP, MXFP4_GROUP // 2), "scales": (E, rows, cols // MXFP4_GROUP)}
        have = {"blocks": tuple(tensor.shape), "scales": tuple(scales.shape)}
    else:
        want = {name: (E, rows) if kind == "_bias" else (E, cols, rows)}
        have = {name: tuple(tensor.shape)}
    if want != have:
        raise CheckpointError(f"checkpoint: {name}: shapes {have}, the config needs {want} "
                              f"(num_local_experts={E}, hidden_size={H}, intermediate_size={I})")
    for j in range(E):
        if kind == "_bias":
            b = tensor[j]
            parts = [("gate_proj", b[0::2]), ("up_proj", b[1::2])] if gate_up else [("down_proj", b)]
            kind_name = "bias"
        else:
            w = mxfp4_dequantize(tensor[j], scales[j]) if kind == "_blocks" else tensor[j].t()  # [rows, cols]
            parts = [("gate_proj", w[0::2]), ("up_proj", w[1::2])] if gate_up else [("down_proj", w)]
            kind_name = "weight"
        for part, t in parts:
            yield f"{base}.{j}.{part}.{kind_name}", t.contiguous()
