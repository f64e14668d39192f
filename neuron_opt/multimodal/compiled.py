"""A vision encoder compiled per image-size bucket, as the decoder is per shape bucket: the graphs are built at
compile time into the artifact (beside the decoder's), and an image runs in the smallest bucket that holds it.

Design decisions
- A family plugs in by what its encoder module declares (models/idefics3.py, qwen2_5_vl.py, qwen3_vl.py,
  gemma3.py): `size_step` (the bucket unit: a tile, a merge block of patches, an image), `graph_size(inputs)`
  (an image's size in that unit), `graph_example(size)` (inputs of an image of a bucket's size: the example
  shapes), `graph_inputs(size, inputs)` (the image padded to a bucket: fixed-shape tensors, whatever needs
  data-dependent indexing done here on the host), `graph_forward(*tensors)` (what a backend compiles) and
  `graph_rows(out, inputs)` (the image's placeholder rows of the output). The module's own forward runs the same
  three at the image's size: the eager reference is the compiled path without the padding.
- Padding is exact by construction in each family: padded tiles or patches never attend to or from real ones.
- Buckets (`buckets.encoder_sizes`): the unit times powers of two up to the largest image the processor makes
  (planner.vision reads it from preprocessor_config.json), plus that size; `compile --encoder-buckets` overrides.
- The encoder is replicated (tp > 1 runs the decoder on ranks; the encoder, small next to it, runs whole in the
  process that serves the requests), so it compiles once per artifact, not per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from neuron_opt.backends.base import Backend
from neuron_opt.buckets import pick_encoder
from neuron_opt.compile_cache import CacheKey, CompileCache
from neuron_opt.errors import ArtifactError, ConfigError
from neuron_opt.multimodal.vision import open_vision_dir, save_vision

ENCODER_DIR = "vision"  # in an artifact: the encoder's weights, its HF config and processor, its graphs


class EncoderGraph(nn.Module):
    """The compiled part of an encoder (`graph_forward`) as a module: what a backend exports and compiles."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.encoder.graph_forward(*tensors)


def encoder_key(size: int) -> str:
    return f"encoder_n{size}"


def example_inputs(encoder: Any, size: int) -> tuple[torch.Tensor, ...]:
    """A bucket's example inputs: the family's example image of `size` units, as the graph takes it."""
    return tuple(encoder.graph_inputs(size, encoder.graph_example(size)))


class BucketedEncoder:
    """Called as the encoder module is (`encoder(**inputs)` -> the image's placeholder rows), through the compiled
    bucket that holds the image. `graphs`: bucket size -> the backend's loaded graph (a function of the inputs)."""

    def __init__(self, encoder: Any, graphs: dict[int, Callable[[tuple[torch.Tensor, ...]], torch.Tensor]]) -> None:
        self.encoder, self.graphs = encoder, graphs
        self.sizes = tuple(sorted(graphs))
        self.calls: dict[int, int] = dict.fromkeys(self.sizes, 0)  # images run per bucket

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        size = pick_encoder(self.encoder.graph_size(inputs), self.sizes)
        self.calls[size] += 1
        out = self.graphs[size](tuple(self.encoder.graph_inputs(size, inputs)))
        return self.encoder.graph_rows(out, inputs)


GRAPH_METHODS = ("graph_size", "graph_example", "graph_inputs", "graph_forward", "graph_rows")


def check_compilable(vision: Any) -> None:
    """ConfigError unless the family's encoder declares its compiled buckets (module docstring), before any long
    work."""
    missing = [m for m in ("size_step", *GRAPH_METHODS) if not hasattr(vision.encoder, m)]
    if missing:
        raise ConfigError(f"model: {vision.architecture}'s vision encoder does not declare its compiled buckets yet "
                          f"(missing {', '.join(missing)}: neuron_opt/multimodal/compiled.py); run it from its "
                          "checkpoint directory on the eager backend", param="model")


def compile_encoders(vision: Any, source: Path, sizes: tuple[int, ...], backend: Backend, dtype: torch.dtype,
                     out: Path, cache: CompileCache | None, key_fields: dict[str, Any], hits: list[str],
                     misses: dict[str, str], progress: bool = True) -> dict[str, Any]:
    """The image side of a vision-language checkpoint (`vision`: multimodal.vision.VisionModel, opened from
    `source`) into the artifact directory `out` (its ENCODER_DIR): processor, config, encoder weights, and one
    encoder graph per bucket size (the compile cache consulted first, `key_fields` the decoder's key fields that
    apply). Returns the manifest's `vision` entry."""
    d = out / ENCODER_DIR
    save_vision(vision, source, d, dtype)
    encoder = vision.encoder
    graph = EncoderGraph(encoder)
    graphs: dict[str, list[str]] = {}
    for size in tqdm(sizes, desc="compile vision encoder", unit="graph", disable=not progress):
        key = CacheKey({**key_fields, "encoder": vision.architecture, "encoder_config": asdict(encoder.cfg),
                        "size": size})
        label = f"{ENCODER_DIR}/{encoder_key(size)}"
        cached = cache.fetch(key, d) if cache is not None else None
        if cached is not None:
            hits.append(label)
            files = [Path(f) for f in cached]
        else:
            misses[label] = cache.explain_miss(key) if cache is not None else "cache disabled"
            files = [Path(f) for f in backend.compile_encoder(graph, example_inputs(encoder, size), encoder_key(size),
                                                              d)]
            if cache is not None and files:
                cache.store(key, d, files)
        graphs[str(size)] = [f"{ENCODER_DIR}/{f}" for f in files]
    return {"architecture": vision.architecture, "dir": ENCODER_DIR, "unit_step": int(encoder.size_step),
            "graphs": graphs}


def load_vision(root: Path, entry: dict[str, Any], backend: Backend, dtype: torch.dtype) -> Any:
    """An artifact's image side (`entry`: its manifest's `vision`): the processor and the encoder, run through its
    compiled buckets (eager buckets on the eager backend: the module at the bucket's padded size)."""
    vision = open_vision_dir(root / entry["dir"], dtype)
    if vision.architecture != entry["architecture"]:
        raise ArtifactError(f"manifest: vision architecture {entry['architecture']!r}, but {entry['dir']}/config.json "
                            f"holds {vision.architecture!r}; recompile")
    graph = EncoderGraph(vision.encoder)
    graphs = {int(size): backend.load_encoder(graph, [root / f for f in files])
              for size, files in entry["graphs"].items()}
    if not graphs:
        raise ArtifactError("manifest: a vision entry without encoder buckets; recompile")
    vision.encoder = BucketedEncoder(vision.encoder, graphs)
    return vision
