"""The cpu backend's vision encoder graphs (neuron_opt.multimodal.compiled): one AOTInductor graph per image-size
bucket, weight-free like the decoder's (cpu_constants: each graph constant a recipe over the encoder's tensors,
bound at load from one shared set of tensors, so every bucket shares one copy of the weights).

Design decisions
- GEMMs on aten (no freezing): the constants stay the encoder's tensors as stored (conv and linear weights alike,
  recipe "identity"), so no packing is matched or held twice; the encoder runs once per image, off the decode
  loop, and is small next to the decoder.
- Static shapes: a bucket is one image size (tiles, or patches padded to the bucket), so each graph is specialised
  to its shape; the family's `graph_inputs` pads to it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from neuron_opt.backends.cpu.constants import ConstantRecipe
from neuron_opt.backends.cpu.graphs import compile_graph
from neuron_opt.errors import ArtifactError

FORMAT = 1
SUBDIR = "cpu"


def compile_encoder(graph: torch.nn.Module, args: tuple[torch.Tensor, ...], key: str, out_dir: Path,
                    dtype: torch.dtype) -> list[Path]:
    """Compile `graph` at `args`' shapes into `out_dir`/cpu/<key>.so with its constant recipes beside it
    (<key>.meta.json); the two paths relative to `out_dir`."""
    rel_so, rel_meta = Path(SUBDIR) / f"{key}.so", Path(SUBDIR) / f"{key}.meta.json"
    recipes = compile_graph(graph, args, None, "aten", Path(out_dir) / rel_so, f"cpu encoder graph {key}")
    meta = {"format": FORMAT, "kind": "encoder", "key": key, "so": rel_so.name, "torch": torch.__version__,
            "dtype": str(dtype).removeprefix("torch."), "shapes": [list(a.shape) for a in args],
            "constants": {k: r.to_dict() for k, r in recipes.items()}}
    (Path(out_dir) / rel_meta).write_text(json.dumps(meta, indent=1, sort_keys=True))
    return [rel_so, rel_meta]


def load_encoder(graph: torch.nn.Module, files: list[Path], dtype: torch.dtype,
                 runner: Callable[[Path, dict[str, torch.Tensor]], Any]) -> Callable[[tuple[torch.Tensor, ...]],
                                                                                    torch.Tensor]:
    """A compiled encoder bucket as a function of its inputs; its constants are `graph`'s tensors (held, not
    copied: the caller keeps `graph` alive). `runner`: the backend's container loader (cpu._runner)."""
    metas = [Path(f) for f in files if str(f).endswith(".meta.json")]
    if len(metas) != 1:
        raise ArtifactError(f"cpu encoder graph: expected one .meta.json among {[str(f) for f in files]}")
    meta = json.loads(metas[0].read_text())
    want = {"format": FORMAT, "kind": "encoder", "torch": torch.__version__,
            "dtype": str(dtype).removeprefix("torch.")}
    bad = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
    if bad:
        raise ArtifactError(f"{metas[0]}: compiled for a different setup (artifact, here): {bad}; recompile")
    tensors = {**dict(graph.state_dict()), **dict(graph.named_buffers())}
    constants = {}
    for name, d in meta["constants"].items():
        r = ConstantRecipe.from_dict(d)
        if r.op != "identity" or len(r.sources) != 1 or r.sources[0] not in tensors:
            raise ArtifactError(f"{metas[0]}: constant {name} is {r.op} of {list(r.sources)}; an encoder graph "
                                "binds the encoder's own tensors only: recompile")
        constants[name] = tensors[r.sources[0]]
    container = runner(metas[0].with_name(meta["so"]), constants)
    shapes = [tuple(s) for s in meta["shapes"]]

    def run(args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        got = [tuple(a.shape) for a in args]
        if got != shapes:
            raise ValueError(f"cpu encoder graph {meta['key']}: inputs of shapes {got}, compiled for {shapes}")
        return container.run([a.contiguous() for a in args])[0]

    return run
