"""Qwen3-VL vision: the ViT over dynamic-resolution patches (full attention within each frame, 2-D rotary plus a
learned position grid resampled to the image's), the patch merger into the decoder's hidden size, and the deepstack
features (merged from early ViT blocks, added to the decoder's hidden states at the image's positions after its
first layers). The decoder is models/llama.py's with Qwen3's options (q/k norm) and interleaved M-RoPE; the
prompt's images and 3-D rotary positions are Qwen2.5-VL's (models/qwen2_5_vl.py: `image_items`,
`rope_positions`), as is the patch embedding, attention and 2-D rotary.

One top-down file: config -> MLP -> block -> merger -> position grid -> encoder -> the MoE decoder's stacked
experts (Qwen3-VL-MoE).

Design decisions
- Module names equal the HF checkpoint's under `model.visual.`, so the stored vision tensors load with
  `load_state_dict` once that prefix is dropped; the decoder's tensors are stored under `model.language_model.`.
- An image is encoded alone (attention never crosses images), its frames attending within themselves.
- The encoder's output per placeholder token is one row of width H * (1 + len(deepstack_visual_indexes)): the
  merger's H features (the decoder's input at that position), then each deepstack merger's H features in ViT block
  order, which the decoder adds after its layers 0, 1, ... (models.llama.LlamaForCausalLM.hidden_states). One row
  per token keeps the encoder cache and chunked prefill exactly as for the other families: a chunk takes the rows
  of the image tokens it holds.
- The learned position grid (num_position_embeddings = side^2) is resampled bilinearly with aligned corners to
  each image's patch grid (`F.interpolate`, transformers' formula) and put in the processor's merge-block order.
- Qwen3-VL-MoE is the same vision side and images beside a Qwen3-MoE decoder (models.moe: its router softmax,
  top k, renormalised); its stacked expert tensors are split per expert at load (`split_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen2_5_vl import (
    PatchBuckets,
    PatchEmbed,
    VisionAttention,
    merge_block_order,
    padded_segments,
    rotary,
    rotary_inv_freq,
)
from neuron_opt.config import ModelConfig
from neuron_opt.errors import CheckpointError, ConfigError

VISION_PREFIXES = ("model.visual.",)
TEXT_PREFIX = "model.language_model."


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    in_channels: int
    hidden_act: str
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float

    def __post_init__(self) -> None:
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu", "silu"):
            raise ConfigError(f"vision_config.hidden_act: {self.hidden_act!r} is not supported")
        if (self.hidden_size // self.num_heads) % 4:
            raise ConfigError("vision_config: the head size must be a multiple of 4 (2-D rotary over h and w)")
        side = round(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ConfigError(f"vision_config.num_position_embeddings: {self.num_position_embeddings} is not a "
                              "square (the learned position grid is side x side)")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad or len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ConfigError(f"vision_config.deepstack_visual_indexes: {list(self.deepstack_visual_indexes)} must be "
                              f"distinct block indices in 0..{self.depth - 1}")

    @classmethod
    def from_hf(cls, hf: Any) -> VisionConfig:
        v = hf.vision_config
        rope = dict(getattr(v, "rope_parameters", None) or {})
        return cls(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                   num_heads=v.num_heads, patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
                   temporal_patch_size=v.temporal_patch_size, out_hidden_size=v.out_hidden_size,
                   in_channels=v.in_channels, hidden_act=v.hidden_act,
                   num_position_embeddings=v.num_position_embeddings,
                   deepstack_visual_indexes=tuple(int(i) for i in v.deepstack_visual_indexes),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        h = F.silu(h) if self.act == "silu" else F.gelu(h, approximate="tanh" if "tanh" in self.act else "none")
        return self.linear_fc2(h)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge block of m x m patches (consecutive in the processor's order) -> one decoder row. `post_shuffle`
    (the deepstack mergers): the norm over the block's concatenated features rather than over each patch's."""

    def __init__(self, cfg: VisionConfig, post_shuffle: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.post_shuffle = post_shuffle
        self.norm = nn.LayerNorm(self.width if post_shuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.post_shuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # [N / m^2, H_text]


def position_grid(table: torch.Tensor, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """The learned position grid `table` [side^2, D] resampled to the image's h x w patches (bilinear, aligned
    corners), in the processor's merge-block order, frame after frame: [t * h * w, D]."""
    t, h, w = grid
    side = round(table.shape[0] ** 0.5)
    square = table.float().reshape(side, side, -1).permute(2, 0, 1)[None]  # [1, D, side, side]
    resampled = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D, h, w]
    flat = resampled.reshape(table.shape[1], h * w).T  # [h * w, D], raster order
    return flat[merge_block_order(h, w, merge)].repeat(t, 1).to(table.dtype)


class Qwen3Vision(PatchBuckets, nn.Module):
    """The image encoder of a Qwen3-VL checkpoint: one image's patches -> its placeholder rows, each the merger's
    features and the deepstack features side by side (module docstring)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, post_shuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, post_shuffle=True)
                                                   for _ in cfg.deepstack_visual_indexes)
        self.register_buffer("inv_freq", rotary_inv_freq(cfg.hidden_size // cfg.num_heads, cfg.rope_theta),
                             persistent=False)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [t * h * w, C * T * p * p], image_grid_thw [1, 3] -> [t * h * w / m^2, H_text * (1 + d)]."""
        inputs = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
        return self.graph_rows(self.graph_forward(*self.graph_inputs(self.graph_size(inputs), inputs)), inputs)

    def graph_inputs(self, size: int, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The image's patches in the processor's order, padded to `size` rows: patches [size, C * T * p * p] and
        the resampled position grid [size, D] in the weights' dtype, rotary cos/sin [size, d] (fp32), the frames'
        mask [size, size] bool. Padding as Qwen2.5-VL's (`padded_segments`): padding rows are zero and see only
        themselves, and merge blocks never mix real and padding rows (sizes are whole merge blocks), so the real
        rows are exact."""
        grid = tuple(int(v) for v in inputs["image_grid_thw"].reshape(-1).tolist())
        m = self.cfg.spatial_merge_size
        dtype = self.patch_embed.proj.weight.dtype
        x = inputs["pixel_values"]
        N, pad = x.shape[0], size - x.shape[0]
        x = F.pad(x.to(dtype), (0, 0, 0, pad))
        pos = F.pad(position_grid(self.pos_embed.weight, grid, m).to(dtype), (0, 0, 0, pad))  # type: ignore[arg-type]
        cos, sin = (F.pad(a, (0, 0, 0, pad)) for a in rotary(grid, m, self.inv_freq))  # type: ignore[arg-type]
        frames = padded_segments([i * grid[1] * grid[2] for i in range(grid[0] + 1)], N, size)
        return x, pos, cos, sin, frames

    def graph_forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      frames: torch.Tensor) -> torch.Tensor:
        """`graph_inputs`' tensors -> the rows [size / m^2, H_text * (1 + d)] (module docstring)."""
        x = self.patch_embed(x) + pos  # [size, D]
        deep = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frames)
            if i in self.cfg.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)

    def graph_rows(self, out: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The real merge blocks' rows of `graph_forward`'s output (already in the processor's order)."""
        return out[: self.graph_size(inputs) // self.size_step]


# Qwen3-VL-MoE's decoder stores each layer's experts stacked (published checkpoints inputs first, transformers 5's
# save_pretrained outputs first); the MoE decoder (models.moe) loads one tensor per expert and projection
STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def split_experts(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A decoder tensor of a Qwen3-VL-MoE checkpoint (canonical name) as canonical (name, tensor) pairs: a stacked
    expert tensor as one tensor per expert (`experts.{j}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj`
    [H, I]; gate_up_proj's outputs are the gate's then the up's), any other tensor as it is. The stacked layout is
    read as transformers reads it: outputs first ([E, 2I, H], [E, H, I]) when the shape says so, else inputs first
    ([E, H, 2I], [E, I, H]); CheckpointError naming the tensor for any other shape."""
    m = STACKED_EXPERTS.fullmatch(name)
    if m is None:
        yield name, tensor
        return
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    rows, cols = (2 * I, H) if m.group(2) == "gate_up_proj" else (H, I)
    if tuple(tensor.shape) == (E, cols, rows) and (E, cols, rows) != (E, rows, cols):
        tensor = tensor.transpose(1, 2)
    elif tuple(tensor.shape) != (E, rows, cols):
        raise CheckpointError(f"checkpoint: {name}: shape {tuple(tensor.shape)}, the config needs {(E, rows, cols)} "
                              f"or {(E, cols, rows)} (num_experts={E}, hidden_size={H}, moe_intermediate_size={I})")
    for j in range(E):
        w = tensor[j]
        parts = [("gate_proj", w[:I]), ("up_proj", w[I:])] if m.group(2) == "gate_up_proj" else [("down_proj", w)]
        for part, t in parts:
            yield f"{m.group(1)}.{j}.{part}.weight", t.contiguous()
