"""A vision-language model's image side in the plan: the vision encoder's weights, its activations for the largest
image the processor makes, and the placeholder tokens that image adds to a prompt; from the checkpoint's
config.json and preprocessor_config.json (docs/multimodal.md). The encoder is replicated on every rank (it runs at
tp 1), so its weights count on each.

Per family, the parameter count is the encoder's and connector's tensors as transformers builds them
(tests/neuron_opt/test_planner_vision.py checks it against transformers' own modules), and the largest image is
the processor's bound: Idefics3 / SmolVLM, `size.longest_edge` cut into tiles of `max_image_size.longest_edge`
(plus the global tile when it splits images); Qwen2.5-VL and Qwen3-VL, `max_pixels` (or `size.longest_edge`) in
patches; Gemma 3, one square image per encoder call, and with `do_pan_and_scan` the image and up to
`pan_and_scan_max_num_crops` crops of it in the prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_opt.buckets import encoder_sizes
from neuron_opt.errors import ConfigError
from neuron_opt.headers import read_json_capped
from neuron_opt.planner.memory import dtype_bytes


@dataclass(frozen=True)
class VisionPlan:
    architecture: str
    parameters: int
    weight_bytes: int
    max_image_tokens: int  # placeholder tokens of the largest image
    activation_bytes: int  # the encoder's largest live activations for that image (fp32 attention scores + rows)
    shape: str  # what one encoder call of the largest image holds (tiles x patches, or patches)
    max_units: int = 0  # the largest image in the encoder's bucket unit (tiles, or patches)
    unit_step: int = 1  # bucket sizes are multiples of it (Qwen2.5-VL: a merge block of patches)
    unit: str = ""  # "tiles" | "patches"

    @property
    def encoder_buckets(self) -> tuple[int, ...]:
        """The encoder's default bucket sizes (buckets.encoder_sizes; `compile --encoder-buckets` overrides)."""
        return encoder_sizes(self.max_units, self.unit_step)


def _linear(i: int, o: int, bias: bool = True) -> int:
    return i * o + (o if bias else 0)


# a family's (parameters, largest image's tokens, its activation bytes, its shape, (its size in the bucket unit,
# the unit's step, the unit's name))
Sized = tuple[int, int, int, str, tuple[int, int, str]]


def _idefics3(cfg: dict[str, Any], pre: dict[str, Any], act: int) -> Sized:
    v, text = cfg["vision_config"], cfg["text_config"]
    D, inner, heads = v["hidden_size"], v["intermediate_size"], v["num_attention_heads"]
    p, side_px, s = v["patch_size"], v["image_size"], cfg.get("scale_factor", 2)
    P = (side_px // p) ** 2
    layer = 4 * _linear(D, D) + _linear(D, inner) + _linear(inner, D) + 4 * D  # attention, MLP, two LayerNorms
    params = (3 * p * p * D + D + P * D + v["num_hidden_layers"] * layer + 2 * D
              + _linear(D * s * s, text["hidden_size"], bias=False))
    tile = (pre.get("max_image_size") or {}).get("longest_edge", side_px)
    edge = (pre.get("size") or {}).get("longest_edge", tile)
    per_side = math.ceil(edge / tile)
    tiles = per_side * per_side + 1 if pre.get("do_image_splitting", True) and per_side > 1 else 1
    tokens = tiles * P // (s * s)
    acts = tiles * (heads * P * P * 4 + P * (2 * D + inner) * act)
    return params, tokens, acts, f"{tiles} tiles x {P} patches", (tiles, 1, "tiles")


def _qwen2_5_vl(cfg: dict[str, Any], pre: dict[str, Any], act: int) -> Sized:
    v = cfg["vision_config"]
    D, inner, heads, p = v["hidden_size"], v["intermediate_size"], v["num_heads"], v["patch_size"]
    m, T, out = v["spatial_merge_size"], v["temporal_patch_size"], v["out_hidden_size"]
    block = _linear(D, 3 * D) + _linear(D, D) + 2 * _linear(D, inner) + _linear(inner, D) + 2 * D
    wide = D * m * m
    params = (v.get("in_channels", 3) * T * p * p * D + v["depth"] * block + D + _linear(wide, wide)
              + _linear(wide, out))
    pixels = pre.get("max_pixels") or (pre.get("size") or {}).get("longest_edge")
    if not pixels:
        raise ConfigError(f"preprocessor_config.json: {cfg['architectures'][0]}'s largest image needs max_pixels or "
                          "size.longest_edge")
    N = int(pixels) // (p * p) // (m * m) * (m * m)
    acts = heads * N * N * 4 + N * N + N * (2 * D + inner) * act  # full-attention scores and the mask
    return params, N // (m * m), acts, f"{N} patches", (N, m * m, "patches")


def _qwen3_vl(cfg: dict[str, Any], pre: dict[str, Any], act: int) -> Sized:
    """Qwen2.5-VL's bound and activations; LayerNorms, MLPs without a gate, a learned position grid, a biased patch
    projection and a merger per deepstack index beside the final one (each normalising the merged width)."""
    v = cfg["vision_config"]
    D, inner, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    m, T, out = v["spatial_merge_size"], v["temporal_patch_size"], v["out_hidden_size"]
    block = _linear(D, 3 * D) + _linear(D, D) + _linear(D, inner) + _linear(inner, D) + 4 * D
    wide = D * m * m
    mergers = 2 * D + _linear(wide, wide) + _linear(wide, out) + len(v.get("deepstack_visual_indexes", (8, 16, 24))) \
        * (2 * wide + _linear(wide, wide) + _linear(wide, out))
    params = (_linear(v.get("in_channels", 3) * T * p * p, D) + v.get("num_position_embeddings", 2304) * D
              + v["depth"] * block + mergers)
    _, tokens, acts, shape, units = _qwen2_5_vl(cfg, pre, act)
    return params, tokens, acts, shape, units


def _gemma3(cfg: dict[str, Any], pre: dict[str, Any], act: int) -> Sized:
    v, text = cfg["vision_config"], cfg["text_config"]
    D, inner, heads = v["hidden_size"], v["intermediate_size"], v["num_attention_heads"]
    P = (v["image_size"] // v["patch_size"]) ** 2
    layer = 4 * _linear(D, D) + _linear(D, inner) + _linear(inner, D) + 4 * D  # attention, MLP, two LayerNorms
    params = (v.get("num_channels", 3) * v["patch_size"] ** 2 * D + D + P * D + v["num_hidden_layers"] * layer
              + 2 * D + D + D * text["hidden_size"])  # SigLIP, then the projector's norm and matrix
    runs = 1 + pre.get("pan_and_scan_max_num_crops", 4) if pre.get("do_pan_and_scan") else 1
    tokens = runs * cfg.get("mm_tokens_per_image", 256)
    acts = heads * P * P * 4 + P * (2 * D + inner) * act
    shape = f"1 image x {P} patches" + (f" ({runs} with its crops)" if runs > 1 else "")
    return params, tokens, acts, shape, (runs, 1, "images")


_FAMILIES = {"Idefics3ForConditionalGeneration": _idefics3, "SmolVLMForConditionalGeneration": _idefics3,
             "Qwen2_5_VLForConditionalGeneration": _qwen2_5_vl, "Qwen3VLForConditionalGeneration": _qwen3_vl,
             "Qwen3VLMoeForConditionalGeneration": _qwen3_vl,  # the same vision side beside a MoE decoder
             "Gemma3ForConditionalGeneration": _gemma3}


def vision_plan(config: dict[str, Any], preprocessor: dict[str, Any] | None, dtype: str) -> VisionPlan:
    """The image side of a vision-language config.json (`preprocessor`: its preprocessor_config.json, None: the
    model's own image size bounds the image) in `dtype`."""
    arch = (config.get("architectures") or [""])[0]
    if arch not in _FAMILIES:
        raise ConfigError(f"config: {arch!r} has a vision_config, but its image side is not planned (supported: "
                          f"{', '.join(sorted(_FAMILIES))})", param="model")
    act = 4 if dtype == "float32" else 2
    params, tokens, acts, shape, (units, step, unit) = _FAMILIES[arch](config, preprocessor or {}, act)
    return VisionPlan(arch, params, params * dtype_bytes(dtype), tokens, acts, shape, units, step, unit)


def vision_lines(vp: VisionPlan, buckets: tuple[int, ...] = ()) -> list[str]:
    """The plan's lines for the image side (`buckets`: the encoder's bucket sizes; () its defaults)."""
    return [f"  vision encoder ({vp.architecture}, {vp.parameters / 1e6:.1f} M params, on every rank):",
            f"    weights {vp.weight_bytes / 2**30:.3f} GiB; largest image: {vp.shape} in one encoder call, "
            f"{vp.max_image_tokens} prompt tokens, activations {vp.activation_bytes / 2**30:.3f} GiB",
            f"    encoder buckets ({vp.unit}; one graph each on compiling backends): "
            f"{', '.join(map(str, buckets or vp.encoder_buckets))}"]


def image_processor_settings(root: Path) -> dict[str, Any] | None:
    """A checkpoint's image processor settings: preprocessor_config.json, or the "image_processor" entry of
    processor_config.json (where newer transformers saves them); None when it has neither."""
    pre = root / "preprocessor_config.json"
    if pre.is_file():
        return dict(read_json_capped(pre, ConfigError, "preprocessor_config"))
    proc = root / "processor_config.json"
    if proc.is_file():
        settings = read_json_capped(proc, ConfigError, "processor_config").get("image_processor")
        return dict(settings) if isinstance(settings, dict) else None
    return None


def checkpoint_vision_plan(root: Path, dtype: str) -> VisionPlan:
    """`vision_plan` of a checkpoint directory: its config.json and its image processor's settings."""
    return vision_plan(read_json_capped(root / "config.json", ConfigError, "config"), image_processor_settings(root),
                       dtype)
