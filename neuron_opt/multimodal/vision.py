"""Vision-language checkpoints: which architectures take images, and a checkpoint's image side (`VisionModel`:
processor, vision encoder, how the processor's output splits per image) beside its text decoder, which is the
decoder of its family (models/llama.py) loaded from the checkpoint's text tensors.

Design decisions
- Explicit registry (`FAMILIES`): HF `architectures[0]` -> the family's vision module and checkpoint layout; an
  unknown architecture with a `vision_config` is refused listing the supported ones.
- The decoder's config is `ModelConfig.from_hf(text_config)`: the text model is one of our dense families, so
  every decoder option (norms, rope, ...) comes from the one place that reads them.
- The processor is the checkpoint's own (AutoProcessor): resizing, tiling, normalisation and placeholder
  expansion are transformers', never re-implemented. transformers builds Qwen2.5-VL's and SmolVLM's processors
  only together with their video processors, which need torchvision; where AutoProcessor fails for that reason
  alone, the loader builds the same processor class from the checkpoint's image processor and tokenizer without
  the video processor (images preprocess exactly as with it; video is not served) and says so at INFO.
- Backends: eager from a checkpoint (tp 1, or the decoder on tp rank processes), and artifacts compiled for the
  eager or cpu backend, the encoder in per-bucket graphs (multimodal.compiled); the encoder is replicated: it runs
  whole in the process that serves requests (docs/multimodal.md).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from models import gemma3, idefics3, qwen2_5_vl, qwen3_vl
from neuron_opt.checkpoint import Checkpoint
from neuron_opt.checkpoint.hf import weight_files
from neuron_opt.config import ModelConfig
from neuron_opt.errors import CheckpointError, ConfigError, UnsupportedModelError
from neuron_opt.headers import read_json_capped
from neuron_opt.multimodal.inputs import ImageItem

log = logging.getLogger(__name__)

Split = Callable[[dict[str, torch.Tensor], list[int]], list[tuple[tuple[int, ...], dict[str, torch.Tensor]]]]
# (prompt length, each image's ImageItem) -> the prompt's M-RoPE positions [3, n] and the decode delta
Rope = Callable[[int, tuple[ImageItem, ...]], tuple[torch.Tensor, int]]


@dataclass(frozen=True)
class Family:
    """How a vision-language architecture is built: its vision module from the HF config, the per-image split of
    its processor's output, and the checkpoint prefixes of its vision and text tensors."""

    build: Callable[[Any], torch.nn.Module]
    split: Callable[[Any, Any], Split]  # (hf config, processor) -> split
    vision_prefixes: tuple[str, ...]
    text_prefix: str  # stored `text_prefix + X` is the decoder's canonical `model.X`
    text_config: Callable[[Any], Any] = lambda hf: hf.text_config  # what ModelConfig.from_hf reads
    rope: Callable[[Any], Rope] | None = None  # an M-RoPE decoder's prompt positions, from the hf config
    vision_strip: str = "model."  # what the stored vision names have before the encoder module's own
    # a decoder tensor (canonical name) as the canonical tensors the decoder loads (stacked experts split)
    text_split: Callable[[ModelConfig, str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]] | None = None
    # a stored name -> the encoder module's (None: drop `vision_strip`) / the decoder's canonical (None: drop
    # `text_prefix`); for layouts that a prefix alone does not map
    vision_key: Callable[[str], str] | None = None
    text_key: Callable[[str], str] | None = None
    # the decoder attends bidirectionally among each run of image tokens (Gemma 3): a prefill chunk never ends
    # inside one (docs/multimodal.md, "Bidirectional image blocks")
    bidirectional: bool = False


def _idefics3_split(hf: Any, processor: Any) -> Split:
    # Idefics3's processor names the global tile's token global_image_tag, SmolVLM's global_image_token
    tag = processor.global_image_tag if hasattr(processor, "global_image_tag") else processor.global_image_token
    global_id = processor.tokenizer.convert_tokens_to_ids(tag)
    return lambda out, ids: idefics3.image_items(out, ids, int(hf.image_token_id), int(global_id))


_IDEFICS3 = Family(lambda hf: idefics3.Idefics3Vision(idefics3.VisionConfig.from_hf(hf)), _idefics3_split,
                   idefics3.VISION_PREFIXES, idefics3.TEXT_PREFIX)

def _qwen2_5_vl_split(hf: Any, processor: Any) -> Split:
    merge = int(hf.vision_config.spatial_merge_size)
    return lambda out, ids: qwen2_5_vl.image_items(out, ids, int(hf.image_token_id), merge)


def _qwen2_5_vl_rope(hf: Any) -> Rope:
    merge = int(hf.vision_config.spatial_merge_size)

    def rope(n: int, images: tuple[ImageItem, ...]) -> tuple[torch.Tensor, int]:
        grids = [tuple(int(v) for v in im.encoder_inputs["image_grid_thw"].reshape(-1).tolist()) for im in images]
        return qwen2_5_vl.rope_positions(n, [(im.positions, g) for im, g in zip(images, grids, strict=True)],
                                         merge)  # type: ignore[misc]

    return rope


def _qwen2_text(hf: Any) -> dict[str, Any]:
    """The text decoder's config as a Qwen2 decoder's (q/k/v biases), its rope's mrope_section kept."""
    return {**hf.text_config.to_dict(), "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


_QWEN2_5_VL = Family(lambda hf: qwen2_5_vl.Qwen25Vision(qwen2_5_vl.VisionConfig.from_hf(hf)), _qwen2_5_vl_split,
                     qwen2_5_vl.VISION_PREFIXES, qwen2_5_vl.TEXT_PREFIX, _qwen2_text, _qwen2_5_vl_rope, "visual.")


def _qwen3_text(hf: Any) -> dict[str, Any]:
    """The text decoder's config as a Qwen3 decoder's (q/k norm), its rope's mrope_section kept and interleaved
    (transformers interleaves Qwen3-VL's whatever the config says), its embeddings tied as the top-level config
    says (transformers ties by that one)."""
    d = hf.text_config.to_dict()
    rope = {**(d.get("rope_parameters") or {}), "mrope_interleaved": True}
    return {**d, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "rope_parameters": rope,
            "tie_word_embeddings": bool(hf.tie_word_embeddings)}


# Qwen3-VL's images and positions are Qwen2.5-VL's; its encoder rows carry the deepstack features (models.qwen3_vl)
_QWEN3_VL = Family(lambda hf: qwen3_vl.Qwen3Vision(qwen3_vl.VisionConfig.from_hf(hf)), _qwen2_5_vl_split,
                   qwen3_vl.VISION_PREFIXES, qwen3_vl.TEXT_PREFIX, _qwen3_text, _qwen2_5_vl_rope, "model.visual.")



def _qwen3_moe_text(hf: Any) -> dict[str, Any]:
    """`_qwen3_text` as a Qwen3-MoE decoder's: the router's top k always renormalised (transformers' Qwen3-VL-MoE
    router does so; its config has no norm_topk_prob)."""
    return {**_qwen3_text(hf), "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "norm_topk_prob": True}


_QWEN3_VL_MOE = dataclasses.replace(_QWEN3_VL, text_config=_qwen3_moe_text, text_split=qwen3_vl.split_experts)


def _gemma3_split(hf: Any, processor: Any) -> Split:
    per_image = int(hf.mm_tokens_per_image)
    return lambda out, ids: gemma3.image_items(out, ids, int(hf.image_token_id), per_image)


_GEMMA3 = Family(lambda hf: gemma3.Gemma3Vision(gemma3.VisionConfig.from_hf(hf)), _gemma3_split,
                 gemma3.VISION_PREFIXES, gemma3.TEXT_PREFIX, vision_strip="", vision_key=gemma3.vision_key,
                 text_key=gemma3.text_key, bidirectional=True)

FAMILIES: dict[str, Family] = {
    "Idefics3ForConditionalGeneration": _IDEFICS3,
    "SmolVLMForConditionalGeneration": _IDEFICS3,
    "Qwen2_5_VLForConditionalGeneration": _QWEN2_5_VL,
    "Qwen3VLForConditionalGeneration": _QWEN3_VL,
    "Qwen3VLMoeForConditionalGeneration": _QWEN3_VL_MOE,
    "Gemma3ForConditionalGeneration": _GEMMA3,
}


@dataclass
class VisionModel:
    """A loaded vision-language model's image side."""

    architecture: str
    processor: Any
    # the encoder module (eager), or its compiled buckets called alike (multimodal.compiled.BucketedEncoder)
    encoder: Any
    split: Split
    rope: Rope | None = None
    bidirectional: bool = False  # Family.bidirectional

    def encode(self, item: ImageItem) -> torch.Tensor:
        """One image's embeddings [len(item.positions), H_text], in the encoder's dtype."""
        with torch.inference_mode():
            return self.encoder(**item.encoder_inputs)

    def rope_positions(self, ids: list[int], images: tuple[ImageItem, ...]) -> tuple[torch.Tensor, int] | None:
        """The prompt's M-RoPE positions [3, len(ids)] and decode delta for an M-RoPE decoder (a prompt without
        images included); None for a decoder with 1-D positions."""
        return None if self.rope is None else self.rope(len(ids), images)


def hf_config(root: Path) -> Any:
    """A vision-language config.json (or its directory) as transformers' config object."""
    from transformers import AutoConfig

    d = dict(read_json_capped(root / "config.json" if root.is_dir() else root, CheckpointError, "config"))
    model_type = d.pop("model_type", None)
    return AutoConfig.for_model(model_type, **d)


def decoder_config(path: Path) -> ModelConfig:
    """The text decoder's ModelConfig of a vision-language config.json (or its directory)."""
    hf = hf_config(path)
    return ModelConfig.from_hf(FAMILIES[hf.architectures[0]].text_config(hf))


def check_vision_parallel(par: Any) -> None:
    """ConfigError for a layout a vision-language decoder cannot run: sequence-parallel prefill holds a chunk of
    each row on a rank, where image rows merge into whole rows."""
    if par.sequence_parallel:
        raise ConfigError("sequence_parallel: image embeddings merge into whole prefill rows; run a vision-language "
                          "model without sequence parallelism", param="sequence_parallel")


def is_multimodal(path: str | Path) -> bool:
    """A HF checkpoint directory (or its config.json) whose config has a vision tower (`vision_config`); an
    unsupported one raises."""
    root = Path(path)
    file = root / "config.json" if root.is_dir() else root
    if file.suffix != ".json" or not file.is_file():
        return False
    d = read_json_capped(file, CheckpointError, "config")
    if "vision_config" not in d:
        return False
    arch = (d.get("architectures") or [d.get("model_type")])[0]
    if arch not in FAMILIES:
        raise UnsupportedModelError(f"architecture {arch!r}: vision-language models supported: "
                                    f"{', '.join(sorted(FAMILIES))}")
    return True


@dataclass(frozen=True)
class VisionLanguageCheckpoint(Checkpoint):
    """A vision-language checkpoint as `compile` reads a checkpoint: the text decoder's config, weights and
    tokenizer (the Checkpoint interface, over the decoder's canonical tensors), with its image side in `mm`."""

    mm: Any = None  # MultimodalCheckpoint

    def state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return {k: v.to(dtype) for k, v in self.mm.state_dict.items()}

    def tensors(self, dtype: torch.dtype = torch.float32,
                skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        return ((k, v.to(dtype)) for k, v in self.mm.state_dict.items() if k not in skip)

    def tokenizer(self) -> Any:
        return self.mm.tokenizer


def open_vision_language(root: Path) -> VisionLanguageCheckpoint:
    """A vision-language checkpoint directory for `compile` (fp32: compile casts to its dtype)."""
    mm = open_multimodal(root, torch.float32)
    return VisionLanguageCheckpoint(config=mm.config, source=root, format="hf", mm=mm)


@dataclass
class MultimodalCheckpoint:
    config: ModelConfig  # the text decoder's
    state_dict: dict[str, torch.Tensor]  # the decoder's canonical weights
    tokenizer: Any
    vision: VisionModel


def open_multimodal(root: Path, dtype: torch.dtype) -> MultimodalCheckpoint:
    """A vision-language checkpoint: the decoder's config and weights, the processor and the vision encoder (its
    weights loaded, in `dtype`). CheckpointError naming the tensor for a missing or unexpected vision weight."""
    hf = hf_config(root)
    fam = FAMILIES[hf.architectures[0]]
    cfg = decoder_config(root)
    stored: dict[str, torch.Tensor] = {}
    for f in weight_files(root):
        stored.update(load_file(str(f)))
    text_key = fam.text_key or (lambda k: "model." + k[len(fam.text_prefix):] if k.startswith(fam.text_prefix)
                                else k)
    text = {text_key(k): v for k, v in stored.items() if not k.startswith(fam.vision_prefixes)}
    if fam.text_split is not None:
        text = dict(pair for k, v in text.items() for pair in fam.text_split(cfg, k, v))
    vision_key = fam.vision_key or (lambda k: k[len(fam.vision_strip):])
    vision_sd = {vision_key(k): v for k, v in stored.items() if k.startswith(fam.vision_prefixes)}
    vision = _vision_model(root, hf, vision_sd, dtype)
    return MultimodalCheckpoint(cfg, {k: v.to(dtype) for k, v in text.items()}, vision.processor.tokenizer, vision)


def _vision_model(root: Path, hf: Any, encoder_sd: dict[str, torch.Tensor], dtype: torch.dtype) -> VisionModel:
    """The image side of `hf` with its encoder's weights (names as the encoder module's) and the processor in
    `root`."""
    arch = hf.architectures[0]
    fam = FAMILIES[arch]
    encoder = fam.build(hf)
    missing, unexpected = encoder.load_state_dict(encoder_sd, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {root}: vision tensors missing {sorted(missing)[:5]}, unexpected "
                              f"{sorted(unexpected)[:5]}")
    processor = load_processor(root, hf)
    return VisionModel(arch, processor, encoder.to(dtype).eval(), fam.split(hf, processor),
                       fam.rope(hf) if fam.rope is not None else None, fam.bidirectional)


ENCODER_WEIGHTS = "encoder.safetensors"


def save_vision(vision: VisionModel, source: Path, out: Path, dtype: torch.dtype) -> None:
    """A vision-language model's image side into an artifact's directory `out`: the checkpoint's own files but its
    weights (config.json, the processor's and tokenizer's files, as the checkpoint ships them, so the processor
    loads as it did from the checkpoint) and the encoder's weights in `dtype` (`open_vision_dir` reads them)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and f.suffix in _PROCESSOR_SUFFIXES and not f.name.endswith(".safetensors.index.json"):
            shutil.copyfile(f, out / f.name)
    save_file({k: v.to(dtype).contiguous() for k, v in vision.encoder.state_dict().items()},
              str(out / ENCODER_WEIGHTS))


# what a checkpoint's config, processor and tokenizer are stored in (its weights are not)
_PROCESSOR_SUFFIXES = frozenset({".json", ".jinja", ".txt", ".model", ".tiktoken"})


def open_vision_dir(d: Path, dtype: torch.dtype) -> VisionModel:
    """The image side `save_vision` wrote into `d`, its encoder in `dtype`."""
    return _vision_model(d, hf_config(d), load_file(str(d / ENCODER_WEIGHTS)), dtype)


def load_processor(root: Path, hf: Any) -> Any:
    """The checkpoint's processor (AutoProcessor); where that fails only because torchvision is missing or does
    not import (the video processor needs it), the processor class transformers maps `hf` to, built from the
    checkpoint's image processor, tokenizer and processor settings without its video processor. Any other
    failure propagates."""
    from transformers import AutoProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    try:
        return AutoProcessor.from_pretrained(root)
    except (ImportError, RuntimeError) as e:
        cls: Any = PROCESSOR_MAPPING[type(hf)]  # the class AutoProcessor took for this config
        if "torchvision" not in str(e).lower() or "video_processor" not in cls.get_attributes():
            raise
        reason = " ".join(str(e).split())[:200]
    processor = images_only(cls).from_pretrained(root)
    log.info("checkpoint %s: %s built without its video processor (%s); images are served, video is not",
             root, cls.__name__, reason)
    return processor


# Processor classes whose apply_chat_template only adds the video processor's frame settings (and a default video
# chat template) before ProcessorMixin's: without a video processor, ProcessorMixin's is theirs.
_CHAT_TEMPLATE_VIDEO_SETTINGS = frozenset({"SmolVLMProcessor"})


def images_only(cls: type) -> Any:
    """transformers' processor class `cls` (one whose sub-processors include a video processor) without the video
    processor: the same image processor, tokenizer, placeholder expansion and chat template; a conversation with a
    video part is refused (ValueError). transformers reads a processor's sub-processors from `get_attributes()`
    (loading and the constructor's checks alike) and skips the video step of `__call__` for a processor that has
    no `video_processor`."""
    from transformers.processing_utils import ProcessorMixin

    parent: Any = cls
    attributes = [a for a in parent.get_attributes() if a != "video_processor"]
    render = ProcessorMixin.apply_chat_template if parent.__name__ in _CHAT_TEMPLATE_VIDEO_SETTINGS else \
        parent.apply_chat_template

    def get_attributes(_: type) -> list[str]:
        return attributes

    def from_dict(sub: Any, processor_dict: dict[str, Any], **kwargs: Any) -> Any:
        # the constructors take video_processor (SmolVLM's without a default); the base class then drops it
        return super(sub, sub).from_dict({**processor_dict, "video_processor": None}, **kwargs)

    def apply_chat_template(self: Any, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        convs = conversation if conversation and isinstance(conversation[0], list) else [conversation]
        if any(isinstance(part, dict) and part.get("type") == "video" for conv in convs for m in conv
               if isinstance(m.get("content"), list) for part in m["content"]):
            raise ValueError(f"{parent.__name__} was built without its video processor (it needs torchvision): "
                             "video parts are not served")
        return render(self, conversation, *args, **kwargs)

    return type(parent.__name__, (parent,), {"get_attributes": classmethod(get_attributes),
                                             "from_dict": classmethod(from_dict),
                                             "apply_chat_template": apply_chat_template,
                                             "__module__": parent.__module__, "__doc__": images_only.__doc__})
