"""Qwen2.5-VL vision: the ViT over dynamic-resolution patches (windowed and full attention, 2-D rotary), the patch
merger into the decoder's hidden size, and the decoder's 3-D rotary positions (M-RoPE) of a prompt with images.
The decoder is models/llama.py's with Qwen2's options and `mrope_section` (ModelConfig).

One top-down file: config -> norm -> patch embedding -> rotary -> attention -> MLP -> block -> merger -> encoder
-> the prompt's images and rotary positions -> HF weight-name map.

Design decisions
- Module names equal the HF checkpoint's under `visual.`, so the stored vision tensors load with
  `load_state_dict` once that prefix is dropped (`VISION_PREFIXES`); the decoder's tensors are stored as a Qwen2
  decoder's (`model.`, `lm_head.`).
- An image is its patches as the processor flattened them ([t * h * w, C * temporal * p * p], merge-block order)
  and its grid (t, h, w), encoded alone: attention never crosses images, so one image at a time is exact.
- Windowed attention as transformers computes it: the patches are reordered window by window (the window index
  over merged 2 x 2 blocks), the blocks in `fullatt_block_indexes` attend over each frame, the others within
  each window (a block-diagonal mask), and the merger's output is put back in the original order.
- Compiled per bucket of patch counts (neuron_opt.multimodal.compiled): the window order, rotary tables and masks
  are computed on the host (`graph_inputs`, data-dependent indexing), the blocks and merger are the graph
  (`graph_forward`); padding patches attend only to themselves, so a padded image's rows are exact.
- M-RoPE (`rope_positions`): text tokens advance every axis by one; an image's tokens take (t, h, w) indices of
  its merged grid offset by the position it starts at, and the next token continues at that position plus the
  larger side of the grid. Decode positions continue from the prompt's: position + delta (delta = the largest
  prompt position + 1 - the prompt's length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.images import placeholder_runs
from neuron_opt.errors import ConfigError

VISION_PREFIXES = ("visual.",)
TEXT_PREFIX = "model."


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    out_hidden_size: int
    in_channels: int
    hidden_act: str
    rope_theta: float

    def __post_init__(self) -> None:
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"vision_config.hidden_act: {self.hidden_act!r} is not supported")
        if (self.hidden_size // self.num_heads) % 4:
            raise ConfigError("vision_config: the head size must be a multiple of 4 (2-D rotary over h and w)")

    @classmethod
    def from_hf(cls, hf: Any) -> VisionConfig:
        v = hf.vision_config
        rope = dict(getattr(v, "rope_parameters", None) or {})
        return cls(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                   num_heads=v.num_heads, patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
                   temporal_patch_size=v.temporal_patch_size, window_size=v.window_size,
                   fullatt_block_indexes=tuple(v.fullatt_block_indexes), out_hidden_size=v.out_hidden_size,
                   in_channels=v.in_channels, hidden_act=v.hidden_act,
                   rope_theta=float(rope.get("rope_theta", 10000.0)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class PatchEmbed(nn.Module):
    """`cfg`: any vision config with the patch fields (Qwen3-VL's too, whose projection has a bias)."""

    def __init__(self, cfg: Any, bias: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        x = x.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)  # [N, C, T, p, p]
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, c.hidden_size)  # [N, D]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention with 2-D rotary; `cfg`: any vision config with hidden_size and num_heads."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.n_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [N, D]; cos/sin [N, d] (fp32); mask [N, N] bool: which patches each patch sees."""
        N = x.shape[0]
        q, k, v = self.qkv(x).reshape(N, 3, self.n_heads, -1).permute(1, 0, 2, 3).unbind(0)  # each [N, heads, d]
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask)  # [heads, N, d]
        return self.proj(o.transpose(0, 1).reshape(N, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        D, inner = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(D, inner), nn.Linear(D, inner)
        self.down_proj = nn.Linear(inner, D)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate_proj(x)
        g = F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh" if "tanh" in self.act else "none")
        return self.down_proj(g * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.hidden_size), RMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge block of m x m patches (consecutive in the processor's order) -> one decoder row."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # [N / m^2, H_text]


def rotary_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The 2-D rotary's inverse frequencies: h and w rotate half the head's features each."""
    quarter = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, quarter, 2).float() / quarter))


def merge_block_order(h: int, w: int, m: int) -> torch.Tensor:
    """[h * w] raster indices of an h x w patch grid in the processor's merge-block order (each m x m block's
    patches consecutive, blocks row by row)."""
    return torch.arange(h * w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()


def rotary(grid: tuple[int, int, int], merge: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, d] of each patch's (h, w) in the processor's merge-block order, frame after frame."""
    t, h, w = grid
    order = merge_block_order(h, w, merge)
    pos = torch.stack([order // w, order % w], dim=-1).repeat(t, 1)  # [N, 2]
    freqs = pos[..., None].float() * inv_freq  # [N, 2, d/4]
    freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [N, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [N, d]
    return emb.cos(), emb.sin()


def window_index(grid: tuple[int, int, int], cfg: VisionConfig) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks' order window by window, and the windows' cumulative patch counts (transformers'
    get_vision_window_index for one image)."""
    m = cfg.spatial_merge_size
    win = cfg.window_size // m // cfg.patch_size  # windows' side in merge blocks
    t, gh, gw = grid[0], grid[1] // m, grid[2] // m
    index = torch.arange(t * gh * gw).reshape(t, gh, gw)
    ph, pw = win - gh % win, win - gw % win
    nh, nw = (gh + ph) // win, (gw + pw) // win
    padded = F.pad(index, (0, pw, 0, ph), "constant", -100)
    padded = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, win, win)
    counts = (padded != -100).sum([2, 3]).reshape(-1)  # merge blocks per window
    flat = padded.reshape(-1)
    bounds = [0] + (counts.cumsum(0) * m * m).tolist()
    return flat[flat != -100], bounds


def segments_mask(bounds: list[int], n: int) -> torch.Tensor:
    """[n, n] bool: patches see the patches of their own segment [bounds[i], bounds[i + 1])."""
    seg = torch.zeros(n, dtype=torch.long)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        seg[a:b] = i
    return seg[:, None] == seg[None, :]


class PatchBuckets:
    """The compiled buckets' sizing shared by the dynamic-resolution encoders (Qwen2.5-VL, Qwen3-VL): a bucket is a
    patch count in whole merge blocks (neuron_opt.multimodal.compiled). Needs `cfg` (a VisionConfig)."""

    cfg: Any

    @property
    def size_step(self) -> int:
        """Bucket sizes count patches, in whole merge blocks."""
        return self.cfg.spatial_merge_size ** 2

    def graph_size(self, inputs: dict[str, torch.Tensor]) -> int:
        """An image's size in bucket units: its patches."""
        return int(inputs["pixel_values"].shape[0])

    def graph_example(self, size: int) -> dict[str, torch.Tensor]:
        """Encoder inputs of an image of `size` patches (a bucket's example shapes): one frame, one merge block
        high."""
        c, m = self.cfg, self.cfg.spatial_merge_size
        width = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
        return {"pixel_values": torch.randn(size, width), "image_grid_thw": torch.tensor([[1, m, size // m]])}


def padded_segments(bounds: list[int], n: int, size: int) -> torch.Tensor:
    """`segments_mask` of n real patches padded to `size`: each padding patch a segment of its own (it sees only
    itself, and no real patch sees it)."""
    return segments_mask(bounds + list(range(n + 1, size + 1)), size)


class Qwen25Vision(PatchBuckets, nn.Module):
    """The image encoder of a Qwen2.5-VL checkpoint: one image's patches -> its placeholder embeddings."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self.register_buffer("inv_freq", rotary_inv_freq(cfg.hidden_size // cfg.num_heads, cfg.rope_theta),
                             persistent=False)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [t * h * w, C * T * p * p], image_grid_thw [1, 3] -> [t * h * w / m^2, H_text]."""
        inputs = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
        return self.graph_rows(self.graph_forward(*self.graph_inputs(self.graph_size(inputs), inputs)), inputs)

    def graph_inputs(self, size: int, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The image's patches in window order, padded to `size` rows: patches [size, C * T * p * p] in the
        weights' dtype, rotary cos/sin [size, d] (fp32), and the full-attention and windowed masks [size, size]
        bool. A padding row sees only itself and no real row sees it, so the real rows are exact; the patch
        embedding is per row, so reordering its input equals reordering its output."""
        grid = tuple(int(v) for v in inputs["image_grid_thw"].reshape(-1).tolist())
        unit = self.size_step
        x = inputs["pixel_values"]
        N, pad = x.shape[0], size - x.shape[0]
        order, bounds = window_index(grid, self.cfg)  # type: ignore[arg-type]

        def by_window(a: torch.Tensor) -> torch.Tensor:
            return F.pad(a.reshape(N // unit, unit, -1)[order].reshape(N, -1), (0, 0, 0, pad))  # [size, ...]

        x = by_window(x.to(self.patch_embed.proj.weight.dtype))
        rope = rotary(grid, self.cfg.spatial_merge_size, self.inv_freq)  # type: ignore[arg-type]
        cos, sin = (by_window(a) for a in rope)
        ends = [i * grid[1] * grid[2] for i in range(grid[0] + 1)]
        frames = padded_segments(ends, N, size)
        windows = padded_segments(bounds, N, size)
        return x, cos, sin, frames, windows

    def graph_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: torch.Tensor,
                      windows: torch.Tensor) -> torch.Tensor:
        """`graph_inputs`' tensors -> the merger's rows in window order [size / m^2, H_text]."""
        x = self.patch_embed(x)  # [size, D]
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frames if i in self.cfg.fullatt_block_indexes else windows)
        return self.merger(x)

    def graph_rows(self, out: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The real merge blocks' rows of `graph_forward`'s output, back in the processor's order."""
        grid = tuple(int(v) for v in inputs["image_grid_thw"].reshape(-1).tolist())
        order, _ = window_index(grid, self.cfg)  # type: ignore[arg-type]
        return out[: self.graph_size(inputs) // self.size_step][torch.argsort(order)]


def image_items(processed: dict[str, torch.Tensor], token_ids: list[int], image_token_id: int,
                merge: int) -> list[tuple[tuple[int, ...], dict[str, torch.Tensor]]]:
    """The processor's output split per image: each image's placeholder positions (one run of image tokens, t * h * w
    / merge^2 long) and its encoder inputs (`pixel_values` rows, `image_grid_thw` [1, 3])."""
    grids = processed["image_grid_thw"]  # [n, 3]
    pixels = processed["pixel_values"]  # [sum(t * h * w), C * T * p * p]
    runs = placeholder_runs(token_ids, image_token_id)
    if len(runs) != grids.shape[0]:
        raise ConfigError(f"messages: the prompt holds {len(runs)} image token runs for {grids.shape[0]} images",
                          param="messages")
    items, row = [], 0
    for run, grid in zip(runs, grids, strict=True):
        n = int(grid.prod())
        if len(run) != n // merge ** 2:
            raise ConfigError(f"messages: an image of grid {grid.tolist()} has {len(run)} placeholder tokens, not "
                              f"{n // merge ** 2}", param="messages")
        items.append((tuple(run), {"pixel_values": pixels[row:row + n].contiguous(),
                                   "image_grid_thw": grid[None].clone()}))
        row += n
    return items


def rope_positions(num_tokens: int, images: list[tuple[tuple[int, ...], tuple[int, int, int]]],
                   merge: int) -> tuple[torch.Tensor, int]:
    """The prompt's M-RoPE positions [3, num_tokens] and the decode delta (module docstring); `images`: each image's
    placeholder positions and grid (t, h, w), in prompt order."""
    parts: list[torch.Tensor] = []
    pos, idx = 0, 0
    for positions, (t, h, w) in images:
        text = positions[0] - idx
        parts.append(torch.arange(text).expand(3, -1) + pos)
        pos += text
        gh, gw = h // merge, w // merge
        T, H, W = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        parts.append(torch.stack([T, H, W]).reshape(3, -1) + pos)
        pos += max(h, w) // merge
        idx = positions[-1] + 1
    parts.append(torch.arange(num_tokens - idx).expand(3, -1) + pos)
    table = torch.cat(parts, dim=1)  # [3, num_tokens]
    return table, int(table.max()) + 1 - num_tokens
