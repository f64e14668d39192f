"""On-disk artifact: everything `generate`/`serve` need, produced by `compile`.

    DIR/
      manifest.json             format version; neuron_opt/torch/transformers versions; model, parallel, bucket and
                                cache config; KV geometry; dtype; backend; sha256 of every other file
      graphs/rank{r}/...        each rank's compiled graphs (backend-specific files; none for eager); the manifest
                                maps each bucket to its files (buckets may share files, e.g. a dynamic-KV graph)
      weights/rank{r}.safetensors  each rank's weight shard, stored once (never once per bucket)
      tokenizer/                tokenizer files (+ chat template)

Written atomically: everything goes to a temporary sibling directory that is renamed into place at the end, so a
crash leaves either the old artifact or the new one, never half of one. Loading validates versions, hashes and
geometry and raises `ArtifactError` naming what differs. Weights are read with safetensors only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuron_opt.buckets import Bucket, BucketConfig
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig, QuantConfig, torch_dtype
from neuron_opt.errors import ArtifactError

# 2: names of issue #17 item 13 (max_model_len, max_prompt_len, prefill_lens, decode_kv_lens); 3: block KV cache
FORMAT_VERSION = 3
MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def versions() -> dict[str, str]:
    import transformers

    import neuron_opt

    return {"neuron_opt": neuron_opt.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def kv_geometry(model_cfg: ModelConfig, par: ParallelConfig, cache: CacheConfig) -> dict[str, Any]:
    from neuron_opt.parallel import head_layout

    lay = head_layout(model_cfg, par)
    return {"layers": model_cfg.num_hidden_layers, "num_blocks": cache.num_blocks, "block_size": cache.block_size,
            "positions_per_block_per_rank": lay.block_positions(cache.block_size),
            "n_kv_heads_per_rank": lay.n_kv_local, "max_model_len": cache.max_model_len,
            "head_dim": model_cfg.head_dim, "dtype": cache.dtype,
            "layout": "[num_blocks, n_kv_heads_per_rank, positions_per_block_per_rank, head_dim]"}


@dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    parallel: ParallelConfig
    cache: CacheConfig
    buckets: BucketConfig
    backend: str
    dtype: str
    backend_options: dict[str, Any]
    graphs: dict[str, list[str]]  # bucket key -> files relative to the artifact root
    files: dict[str, str]  # relative path -> sha256
    versions: dict[str, str]
    source: dict[str, Any]
    quant: QuantConfig = QuantConfig()  # weight-only quantization of the decoder linears (none by default)
    draft: str | None = None  # a draft model's artifact compiled alongside (a directory in this one), if any

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION, "versions": self.versions, "backend": self.backend, "dtype": self.dtype,
            "backend_options": self.backend_options, "model": self.model.to_dict(),
            "parallel": self.parallel.__dict__, "cache": self.cache.__dict__, "buckets": self.buckets.to_dict(),
            "kv_geometry": kv_geometry(self.model, self.parallel, self.cache), "graphs": self.graphs,
            "source": self.source, "files": self.files, "quant": dataclasses.asdict(self.quant),
            **({"draft": self.draft} if self.draft is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        return cls(model=ModelConfig.from_dict(d["model"]), parallel=ParallelConfig(**d["parallel"]),
                   cache=CacheConfig(**d["cache"]), buckets=BucketConfig.from_dict(d["buckets"]),
                   backend=d["backend"], dtype=d["dtype"], backend_options=d.get("backend_options", {}),
                   graphs=d["graphs"], files=d["files"], versions=d["versions"], source=d.get("source", {}),
                   quant=QuantConfig(**{**d.get("quant", {}),
                                        "modules_to_not_convert": tuple(d.get("quant", {}).get(
                                            "modules_to_not_convert", ()))}), draft=d.get("draft"))

    def bucket_files(self, root: Path) -> dict[Bucket, list[Path]]:
        return {Bucket.from_key(k): [root / f for f in fs] for k, fs in self.graphs.items()}


class ArtifactWriter:
    """Collects files in a temporary directory next to `out`; `commit` hashes them and renames into place."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out).resolve()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, manifest_fields: dict[str, Any]) -> Manifest:
        files = {str(p.relative_to(self.tmp)): sha256_file(p) for p in sorted(self.tmp.rglob("*")) if p.is_file()}
        manifest = Manifest(files=files, versions=versions(), **manifest_fields)
        raw = manifest.to_json()
        raw["digest"] = manifest_digest(raw)
        with open(self.tmp / MANIFEST, "w") as f:
            json.dump(raw, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        old = None
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return manifest


def manifest_digest(raw: dict[str, Any]) -> str:
    """sha256 over the manifest's own content (all fields but the digest): an edited manifest is refused."""
    body = {k: v for k, v in raw.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(root: Path, verify_hashes: bool = True) -> Manifest:
    root = Path(root)
    mpath = root / MANIFEST
    if not mpath.exists():
        raise ArtifactError(f"{root}: not an artifact (no {MANIFEST}); create one with `neuron-opt compile`")
    try:
        raw = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{mpath}: corrupt manifest ({e})") from None
    if raw.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{mpath}: format version {raw.get('format_version')} differs from this install's "
                            f"{FORMAT_VERSION}; recompile the artifact")
    try:
        m = Manifest.from_json(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{mpath}: invalid manifest ({e})") from None
    ours = versions()
    for name in ("neuron_opt", "torch"):
        if m.versions.get(name) != ours[name]:
            raise ArtifactError(f"{root}: compiled with {name} {m.versions.get(name)}, this install has "
                                f"{ours[name]}; recompile the artifact")
    geo = kv_geometry(m.model, m.parallel, m.cache)
    if raw.get("kv_geometry") != geo:
        diff = {k: (raw.get("kv_geometry", {}).get(k), v) for k, v in geo.items()
                if raw.get("kv_geometry", {}).get(k) != v}
        raise ArtifactError(f"{mpath}: KV geometry does not match the model/parallel/cache config "
                            f"(field: (manifest, expected)): {diff}")
    if raw.get("digest") != manifest_digest(raw):
        raise ArtifactError(f"{mpath}: manifest was edited after compile (its digest does not match its content); "
                            "recompile instead of editing configs by hand")
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p != root / MANIFEST}
    if missing := sorted(set(m.files) - on_disk):
        raise ArtifactError(f"{root}: missing file(s) listed in the manifest: {', '.join(missing[:5])}")
    if extra := sorted(on_disk - set(m.files)):
        raise ArtifactError(f"{root}: file(s) not listed in the manifest: {', '.join(extra[:5])}")
    if verify_hashes:
        for rel, digest in m.files.items():
            if sha256_file(root / rel) != digest:
                raise ArtifactError(f"{root / rel}: sha256 does not match the manifest (file modified or corrupt)")
    return m


@dataclass
class LoadedArtifact:
    manifest: Manifest
    model_config: ModelConfig
    tokenizer: Any
    runner: Any  # neuron_opt.runtime.runner.ModelRunner


def load_artifact(root: Path, verify_hashes: bool = True) -> LoadedArtifact:
    """Validate an artifact and build a runner for it (rank processes are started for tp > 1)."""
    from transformers import AutoTokenizer

    from models.build import rank_model_factory
    from neuron_opt.backends import get_backend
    from neuron_opt.runtime.runner import ModelRunner

    root = Path(root)
    m = read_manifest(root, verify_hashes=verify_hashes)
    if m.backend == "neuron":  # SPMD devices before anything (transformers included) imports torch_xla
        from neuron_opt.backends.neuron import import_xla

        import_xla(devices=m.parallel.tp)
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    dtype = torch_dtype(m.dtype)
    if m.parallel.tp == 1:
        backend = get_backend(m.backend, dtype, m.backend_options)
        files = {b: [f for f in fs if f.relative_to(root).parts[:2] == ("graphs", "rank0")]
                 for b, fs in m.bucket_files(root).items()}
        executor = backend.load(files, root / "weights" / "rank0.safetensors",
                                rank_model_factory(m.model, m.parallel, m.cache, 0, dtype, quant=m.quant), m.cache)
    elif m.backend == "neuron":  # every rank in one SPMD program, collectives inside the graph
        from neuron_opt.parallel import ParallelContext

        backend = get_backend(m.backend, dtype, m.backend_options, tp=m.parallel.tp)
        files = {b: [f for f in fs if f.relative_to(root).parts[:2] == ("graphs", "spmd")]
                 for b, fs in m.bucket_files(root).items()}
        comm = backend.rank_collectives(m.parallel.tp, 1)
        factories = [rank_model_factory(m.model, m.parallel, m.cache, r, dtype,
                                        ParallelContext(m.parallel.tp, r, comm, m.parallel.sequence_parallel),
                                        quant=m.quant)
                     for r in range(m.parallel.tp)]
        executor = backend.load(files, [root / "weights" / f"rank{r}.safetensors" for r in range(m.parallel.tp)],
                                factories, m.cache)
    else:
        from neuron_opt.parallel.executor import launch_tp_executor

        executor = launch_tp_executor(root, m)
    return LoadedArtifact(m, m.model, tokenizer, ModelRunner(executor, m.buckets, m.cache, m.model.vocab_size))
