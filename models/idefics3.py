"""Idefics3 / SmolVLM vision: the SigLIP-style encoder over image tiles and the pixel-shuffle connector into the
text decoder's hidden size. The decoder is models/llama.py's (a Llama text model; standard rope).

One top-down file: config -> patch embeddings -> attention -> MLP -> encoder layer -> encoder -> connector -> the
prompt's images -> HF weight-name map.

Design decisions
- Module names equal the HF checkpoint's under `model.` (`vision_model.*`, `connector.*`), so the stored vision
  tensors load with `load_state_dict` once that prefix is dropped (`VISION_PREFIXES`).
- An image is every tile the processor cut it into (rows x cols tiles and the global one, or one tile), encoded in
  one call: [tiles, 3, h, w] pixels and their [tiles, h, w] pixel mask (padding where the processor padded a
  tile to the largest of the prompt). Tiles that are all zeros are the processor's padding images: HF drops them
  (`real_images_inds`), so does `image_items` (they belong to no image).
- Variable-resolution tiles (NaViT): a tile's patches take position ids bucketed from their fractional
  coordinates within the tile's real patches, exactly as transformers computes them; padded patches take id 0
  and are masked as keys (bidirectional attention over each tile's real patches).
- Compiled per bucket of tile counts (neuron_opt.multimodal.compiled): an image's tiles padded with whole zero
  tiles, whose rows are dropped (`graph_rows`); attention never crosses tiles, so the real rows are exact.
- The connector's output rows are the image's placeholder tokens in prompt order: tile after tile, each tile's
  (side / scale_factor)^2 rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.images import placeholder_runs
from neuron_opt.errors import ConfigError

# checkpoint prefixes: the vision tensors (loaded into `Idefics3Vision` without `model.`) and the decoder's
# (`model.text_model.X` is our `model.X`; `lm_head.weight` as it is)
VISION_PREFIXES = ("model.vision_model.", "model.connector.")
TEXT_PREFIX = "model.text_model."


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    scale_factor: int
    text_hidden_size: int

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"vision_config.hidden_size: {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"vision_config.hidden_act: {self.hidden_act!r} is not supported "
                              "(gelu_pytorch_tanh, gelu)")
        side = self.image_size // self.patch_size
        if side % self.scale_factor:
            raise ConfigError(f"scale_factor: {self.scale_factor} does not divide the {side} patches per side")

    @property
    def tokens_per_tile(self) -> int:
        """Placeholder tokens one tile becomes (HF's image_seq_len)."""
        return (self.image_size // self.patch_size // self.scale_factor) ** 2

    @classmethod
    def from_hf(cls, hf: Any) -> VisionConfig:
        v = hf.vision_config
        return cls(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                   num_hidden_layers=v.num_hidden_layers, num_attention_heads=v.num_attention_heads,
                   image_size=v.image_size, patch_size=v.patch_size, num_channels=v.num_channels,
                   layer_norm_eps=float(v.layer_norm_eps), hidden_act=v.hidden_act,
                   scale_factor=int(hf.scale_factor), text_hidden_size=hf.text_config.hidden_size)


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_size, self.side = cfg.patch_size, cfg.image_size // cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(self.side ** 2, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """pixels [n, C, h, w], patch_mask [n, h/p, w/p] bool -> [n, (h/p) * (w/p), D]."""
        n = pixels.shape[0]
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [n, P, D]
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=pixels.device)
        step_h = 1.0 / patch_mask[:, :, 0].sum(dim=1)  # [n]: each tile's real patch rows
        step_w = 1.0 / patch_mask[:, 0, :].sum(dim=1)  # [n]
        hs = torch.arange(patch_mask.shape[1], dtype=torch.float32, device=pixels.device)
        ws = torch.arange(patch_mask.shape[2], dtype=torch.float32, device=pixels.device)
        frac_h = torch.clamp(hs[None, :] * step_h[:, None], max=1.0 - 1e-6)  # [n, h/p]
        frac_w = torch.clamp(ws[None, :] * step_w[:, None], max=1.0 - 1e-6)  # [n, w/p]
        bh = torch.bucketize(frac_h, boundaries, right=True)
        bw = torch.bucketize(frac_w, boundaries, right=True)
        ids = (bh[:, :, None] * self.side + bw[:, None, :]).reshape(n, -1)  # [n, P]
        ids = torch.where(patch_mask.reshape(n, -1), ids, torch.zeros_like(ids))
        return x + self.position_embedding(ids)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [n, P, D]; key_mask [n, P] bool (real patches): every query sees every real patch of its tile."""
        n, P, D = x.shape
        q, k, v = (p(x).view(n, P, self.n_heads, -1).transpose(1, 2)  # [n, heads, P, d]
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])  # [n, heads, P, d]
        return self.out_proj(o.transpose(1, 2).reshape(n, P, D))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class VisionTransformer(nn.Module):
    """HF's `vision_model`: patch embeddings, encoder layers, final LayerNorm."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels, patch_mask)  # [n, P, D]
        key_mask = patch_mask.reshape(pixels.shape[0], -1)  # [n, P]
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size * cfg.scale_factor ** 2, cfg.text_hidden_size, bias=False)


class Connector(nn.Module):
    """Pixel shuffle (each scale x scale square of patches into one row of scale^2 x D features), then a linear map
    into the decoder's hidden size."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.scale_factor = cfg.scale_factor
        self.modality_projection = ModalityProjection(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, P, D = x.shape
        s, side = self.scale_factor, int(P ** 0.5)
        x = x.view(n, side, side // s, D * s)  # [n, h, w/s, D*s]
        x = x.permute(0, 2, 1, 3).reshape(n, side // s, side // s, D * s * s)  # [n, w/s, h/s, D*s*s]
        x = x.permute(0, 2, 1, 3).reshape(n, P // (s * s), D * s * s)  # [n, P/s^2, D*s*s]
        return self.modality_projection.proj(x)


class Idefics3Vision(nn.Module):
    """The image encoder of an Idefics3 / SmolVLM checkpoint: an image's tiles -> its placeholder embeddings.

    Compiled per bucket of tile counts (models/images.py, "Compiled encoders"): `graph_inputs` pads an image to a
    bucket's tiles, `graph_forward` is what a backend compiles, `graph_rows` keeps the real tiles' rows; `forward`
    runs the same three at the image's own size."""

    size_step = 1  # bucket sizes count tiles

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_model = VisionTransformer(cfg)
        self.connector = Connector(cfg)

    def forward(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor) -> torch.Tensor:
        """pixel_values [tiles, C, h, w], pixel_attention_mask [tiles, h, w] -> [tiles * tokens_per_tile, H_text]."""
        inputs = {"pixel_values": pixel_values, "pixel_attention_mask": pixel_attention_mask}
        return self.graph_rows(self.graph_forward(*self.graph_inputs(self.graph_size(inputs), inputs)), inputs)

    def graph_size(self, inputs: dict[str, torch.Tensor]) -> int:
        """An image's size in bucket units: its tiles."""
        return int(inputs["pixel_values"].shape[0])

    def graph_example(self, size: int) -> dict[str, torch.Tensor]:
        """Encoder inputs of an image of `size` tiles (a bucket's example shapes)."""
        c = self.cfg
        return {"pixel_values": torch.randn(size, c.num_channels, c.image_size, c.image_size),
                "pixel_attention_mask": torch.ones(size, c.image_size, c.image_size, dtype=torch.bool)}

    def graph_inputs(self, size: int, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The image's tiles padded to `size`: pixels [size, C, h, w] in the weights' dtype and the patch mask
        [size, h/p, w/p] (a patch with any real pixel is real). Padding tiles are zero pixels with every patch
        real, so they compute defined values; tiles never attend across each other, so they change no real row."""
        pixels, mask = inputs["pixel_values"], inputs["pixel_attention_mask"]
        p, pad = self.cfg.patch_size, size - pixels.shape[0]
        grid = mask.unfold(1, p, p).unfold(2, p, p)  # [tiles, h/p, w/p, p, p]
        patch_mask = grid.sum(dim=(-1, -2)) > 0  # [tiles, h/p, w/p]
        w = self.connector.modality_projection.proj.weight
        pixels = F.pad(pixels.to(w.dtype), (0, 0, 0, 0, 0, 0, 0, pad))  # [size, C, h, w]
        patch_mask = torch.cat([patch_mask, patch_mask.new_ones(pad, *patch_mask.shape[1:])])  # [size, h/p, w/p]
        return pixels, patch_mask

    def graph_forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """[tiles, C, h, w], [tiles, h/p, w/p] -> [tiles * tokens_per_tile, H_text]."""
        feats = self.connector(self.vision_model(pixels, patch_mask))  # [tiles, T, H_text]
        return feats.reshape(-1, feats.shape[-1])

    def graph_rows(self, out: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The real tiles' rows of `graph_forward`'s output: the image's placeholder embeddings."""
        return out[: self.graph_size(inputs) * self.cfg.tokens_per_tile]


def image_items(processed: dict[str, torch.Tensor], token_ids: list[int], image_token_id: int,
                global_token_id: int) -> list[tuple[tuple[int, ...], dict[str, torch.Tensor]]]:
    """The processor's output for one prompt, split per image: each image's placeholder positions (prompt indices,
    ascending) and its encoder inputs (`pixel_values` [tiles, C, h, w], `pixel_attention_mask` [tiles, h, w]).

    The processor expands each image into runs of image tokens, one run per tile, tiles in pixel_values' order;
    an image's last run is its global tile's, the one after the `<global-img>` token. Padding tiles (all zeros)
    follow the real ones."""
    pixels = processed["pixel_values"][0]  # [tiles, C, h, w] (one prompt)
    mask = processed.get("pixel_attention_mask")
    mask = (torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.bool) if mask is None
            else mask[0].bool())  # [tiles, h, w]
    runs = placeholder_runs(token_ids, image_token_id)
    items, tile, positions = [], 0, []
    for run in runs:
        positions += run
        tile += 1
        if run[0] > 0 and token_ids[run[0] - 1] == global_token_id:  # the image's last tile
            start = sum(it[1]["pixel_values"].shape[0] for it in items)
            items.append((tuple(positions), {"pixel_values": pixels[start:tile].contiguous(),
                                             "pixel_attention_mask": mask[start:tile].contiguous()}))
            positions = []
    if positions:
        raise ConfigError("messages: an image's tiles in the prompt do not end with its global tile "
                          "(<global-img>); the chat template or processor is not SmolVLM's / Idefics3's",
                          param="messages")
    if tile > pixels.shape[0] or bool(pixels[tile:].ne(0).any()):
        raise ConfigError(f"messages: the prompt has {tile} image tiles, the processor made {pixels.shape[0]} "
                          "of which some are not padding", param="messages")
    return items

