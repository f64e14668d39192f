"""Gemma 3 vision: the SigLIP encoder over one square image, the multi-modal projector (average pooling of the
patch grid to the image's soft tokens, a (1 + w) RMSNorm and a linear map into the decoder's hidden size). The
decoder is models/llama.py's Gemma 3 text decoder (sliding and global layers); what the image adds to it is the
bidirectional attention among each image's soft tokens (neuron_opt.multimodal.inputs.image_blocks).

One top-down file: config -> embeddings -> tower -> projector -> encoder -> the prompt's images -> HF weight names.

Design decisions
- SigLIP's encoder layers are models/idefics3.py's (the same LayerNorm / attention / GELU MLP under the same
  names); only the embeddings differ: every image is the tower's full square, so each patch takes its own position
  id (no padding, no variable-resolution buckets).
- Module names equal transformers' under `vision_tower.` and `multi_modal_projector.`. Checkpoints store them in
  one of three layouts: the released one (`vision_tower.vision_model.X`, `multi_modal_projector.X`,
  `language_model.model.X`, `language_model.lm_head.weight`), transformers 4.5x's (the same under `model.`, with
  `model.language_model.X` and `lm_head.weight`) and transformers 5's (the released one without SigLIP's
  `vision_model` level, `lm_head.weight`). `vision_key` and `text_key` map each to the module's names and the
  decoder's canonical `model.X` / `lm_head.weight`.
- An image is each run of soft tokens the processor wrote, with its one `pixel_values` row: with pan-and-scan
  on, the processor adds the image's crops as further runs (each its own bidirectional block, as transformers
  masks them), so an image part becomes one item per run (`image_items`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models import idefics3
from models.images import placeholder_runs
from neuron_opt.errors import ConfigError

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
TEXT_PREFIX = "language_model.model."


@dataclass(frozen=True)
class VisionConfig:
    encoder: idefics3.VisionConfig  # SigLIP's fields (scale_factor 1: no pixel shuffle)
    tokens_per_image: int  # soft tokens an image becomes (mm_tokens_per_image, a square number)

    def __post_init__(self) -> None:
        side = self.encoder.image_size // self.encoder.patch_size
        per_side = round(self.tokens_per_image ** 0.5)
        if per_side ** 2 != self.tokens_per_image or side % per_side:
            raise ConfigError(f"mm_tokens_per_image: {self.tokens_per_image} is not a square whose side divides the "
                              f"{side} patches per side")

    @property
    def kernel(self) -> int:
        """The average pool's kernel (and stride) in patches."""
        return self.encoder.image_size // self.encoder.patch_size // round(self.tokens_per_image ** 0.5)

    @classmethod
    def from_hf(cls, hf: Any) -> VisionConfig:
        v = hf.vision_config
        if getattr(v, "vision_use_head", False):
            raise ConfigError("vision_config.vision_use_head: Gemma 3 reads the encoder's patch states; a SigLIP "
                              "pooling head is not part of it")
        enc = idefics3.VisionConfig(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                                    num_hidden_layers=v.num_hidden_layers, num_attention_heads=v.num_attention_heads,
                                    image_size=v.image_size, patch_size=v.patch_size, num_channels=v.num_channels,
                                    layer_norm_eps=float(v.layer_norm_eps), hidden_act=v.hidden_act, scale_factor=1,
                                    text_hidden_size=hf.text_config.hidden_size)
        return cls(enc, int(hf.mm_tokens_per_image))


class Embeddings(nn.Module):
    def __init__(self, cfg: idefics3.VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [n, C, s, s] -> [n, P, D]: each patch plus its position's row."""
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [n, P, D]
        return x + self.position_embedding.weight


class VisionTower(nn.Module):
    """transformers' SiglipVisionModel without a head: embeddings, encoder layers, final LayerNorm."""

    def __init__(self, cfg: idefics3.VisionConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = idefics3.Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)  # [n, P, D]
        every = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)  # every patch is real
        for layer in self.encoder.layers:
            x = layer(x, every)
        return self.post_layernorm(x)


class SoftEmbNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Projector(nn.Module):
    """The patch grid average-pooled to tokens_per_side^2 rows (row-major), normed, mapped to the decoder."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        e = cfg.encoder
        self.side, self.kernel = e.image_size // e.patch_size, cfg.kernel
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(e.hidden_size, e.text_hidden_size))
        self.mm_soft_emb_norm = SoftEmbNorm(e.hidden_size, e.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, D = x.shape
        grid = x.transpose(1, 2).reshape(n, D, self.side, self.side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [n, T, D]
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).to(x.dtype)  # [n, T, H_text]


class Gemma3Vision(nn.Module):
    """The image encoder of a Gemma 3 checkpoint: one image (or crop) -> its soft-token embeddings. Compiled buckets
    (neuron_opt.multimodal.compiled) count images: every image is the tower's full square, so a bucket is an image
    count, padded with zero images (images never attend across each other)."""

    size_step = 1  # bucket sizes count images

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg.encoder)
        self.multi_modal_projector = Projector(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, C, s, s] -> [n * tokens_per_image, H_text]."""
        inputs = {"pixel_values": pixel_values}
        return self.graph_rows(self.graph_forward(*self.graph_inputs(self.graph_size(inputs), inputs)), inputs)

    def graph_size(self, inputs: dict[str, torch.Tensor]) -> int:
        """An item's size in bucket units: its images (one per item: `image_items`)."""
        return int(inputs["pixel_values"].shape[0])

    def graph_example(self, size: int) -> dict[str, torch.Tensor]:
        """Encoder inputs of `size` images (a bucket's example shapes)."""
        e = self.cfg.encoder
        return {"pixel_values": torch.randn(size, e.num_channels, e.image_size, e.image_size)}

    def graph_inputs(self, size: int, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """The images padded to `size` with zero images: pixels [size, C, s, s] in the weights' dtype."""
        pixels = inputs["pixel_values"]
        w = self.multi_modal_projector.mm_input_projection_weight
        return (nn.functional.pad(pixels.to(w.dtype), (0, 0, 0, 0, 0, 0, 0, size - pixels.shape[0])),)

    def graph_forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[size, C, s, s] -> [size * tokens_per_image, H_text]."""
        feats = self.multi_modal_projector(self.vision_tower(pixels))
        return feats.reshape(-1, feats.shape[-1])

    def graph_rows(self, out: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The real images' rows of `graph_forward`'s output."""
        return out[: self.graph_size(inputs) * self.cfg.tokens_per_image]


def image_items(processed: dict[str, torch.Tensor], token_ids: list[int], image_token_id: int,
                tokens_per_image: int) -> list[tuple[tuple[int, ...], dict[str, torch.Tensor]]]:
    """The processor's output split per run of soft tokens (an image, or one of its pan-and-scan crops): its
    placeholder positions and its `pixel_values` row [1, C, s, s], in prompt order."""
    pixels = processed["pixel_values"]  # [runs, C, s, s]
    runs = placeholder_runs(token_ids, image_token_id)
    if len(runs) != pixels.shape[0]:
        raise ConfigError(f"messages: the prompt holds {len(runs)} image token runs for {pixels.shape[0]} images",
                          param="messages")
    for run in runs:
        if len(run) != tokens_per_image:
            raise ConfigError(f"messages: an image has {len(run)} soft tokens, not mm_tokens_per_image "
                              f"{tokens_per_image}", param="messages")
    return [(tuple(run), {"pixel_values": pixels[i:i + 1].contiguous()}) for i, run in enumerate(runs)]


def vision_key(stored: str) -> str:
    """A stored vision tensor's name as Gemma3Vision's (module docstring)."""
    name = stored.removeprefix("model.")
    if name.startswith("vision_tower.vision_model."):
        return "vision_tower." + name[len("vision_tower.vision_model."):]
    return name


def text_key(stored: str) -> str:
    """A stored decoder tensor's canonical name (`model.X`, `lm_head.weight`; module docstring)."""
    for prefix in (TEXT_PREFIX, "model.language_model."):
        if stored.startswith(prefix):
            return "model." + stored[len(prefix):]
    return stored.removeprefix("language_model.")
