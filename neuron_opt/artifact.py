"""On-disk artifact: everything `generate`/`serve` need, produced by `compile`.

    DIR/
      manifest.json             format version; neuron_opt/torch/transformers versions; model, parallel, bucket and
                                cache config; KV geometry; dtype; backend; sha256 of every other file
      graphs/rank{r}/...        each rank's compiled graphs (backend-specific files; none for eager); the manifest
                                maps each bucket to its files (buckets may share files, e.g. a dynamic-KV graph)
      weights/rank{r}.safetensors  each rank's weight shard, stored once (never once per bucket)
      tokenizer/                tokenizer files (+ chat template)
      vision/                   a vision-language model's image side: config.json, processor files, the encoder's
                                weights, and its graphs per image-size bucket (neuron_opt.multimodal.compiled)

      manifest.sig              optional: the manifest's signature (neuron_opt.signing; `compile --sign-key`)

Written atomically: everything goes to a temporary sibling directory that is renamed into place at the end, so a
crash leaves either the old artifact or the new one, never half of one. `--out` is replaced only when it is an
artifact (or empty): any other directory is refused unless `force`, so a mistyped path deletes nothing.

Loading checks, in this order, before any file of the artifact is opened for use: the signature over the manifest's
bytes when keys are trusted; versions, digest and KV geometry; that every path the manifest names stays inside the
artifact (no `..`, no absolute path, no symlink out) and that every graph is one of its files; no file missing
or extra; every file's sha256. `ArtifactError` names what differs. Weights are read with safetensors only.
Within one process a file is hashed once per manifest: a later check skips a file whose stamp (device, inode,
size, mtime, ctime) has not changed since it was hashed, unless it changed within RACY_NS of the stamp (docs/
scale_out.md, "Each file is hashed once per process").
Loading itself (tokenizer, executor, runner) is neuron_opt.executors' `load_model`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

import neuron_opt
from neuron_opt.buckets import Bucket, BucketConfig
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig, QuantConfig
from neuron_opt.errors import ArtifactError, ConfigError
from neuron_opt.headers import read_capped
from neuron_opt.lora.config import LoraConfig
from neuron_opt.parallel import head_layout
from neuron_opt.signing import SIGNATURE, check_signature, load_trusted_keys, sign_manifest, trusted_key_paths

# format 2: the names of docs/structure.md, "Names" (max_model_len, max_prompt_len, prefill_lens,
# decode_kv_lens); 3: block KV cache
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists files and configs: kilobytes


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def versions() -> dict[str, str]:
    import transformers  # here: importing transformers may import a device runtime (executors.loader)

    return {"neuron_opt": neuron_opt.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def kv_geometry(model_cfg: ModelConfig, par: ParallelConfig, cache: CacheConfig) -> dict[str, Any]:
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
    lora: LoraConfig | None = None  # the LoRA capacity its graphs take adapters for (compile --enable-lora)
    # a vision-language model's image side (neuron_opt.multimodal.compiled.compile_encoders): architecture, dir,
    # unit_step, graphs (bucket size -> files relative to the root); None for a text model
    vision: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION, "versions": self.versions, "backend": self.backend, "dtype": self.dtype,
            "backend_options": self.backend_options, "model": self.model.to_dict(),
            "parallel": self.parallel.__dict__, "cache": self.cache.__dict__, "buckets": self.buckets.to_dict(),
            "kv_geometry": kv_geometry(self.model, self.parallel, self.cache), "graphs": self.graphs,
            "source": self.source, "files": self.files, "quant": dataclasses.asdict(self.quant),
            **({"draft": self.draft} if self.draft is not None else {}),
            **({"task": "embed", "pooling": self.model.pooling} if self.model.is_embedding else {}),
            **({"lora": self.lora.to_dict()} if self.lora is not None else {}),
            **({"vision": self.vision} if self.vision is not None else {}),
        }

    @property
    def task(self) -> str:
        """"embed" (an embedding model: pooled vectors) or "generate"."""
        return "embed" if self.model.is_embedding else "generate"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        model = ModelConfig.from_dict(d["model"])
        task, pooling = d.get("task", "generate"), d.get("pooling")
        if (task, pooling) != (("embed", model.pooling) if model.is_embedding else ("generate", None)):
            raise ArtifactError(f"manifest: task {task!r} with pooling {pooling!r} disagrees with its model's "
                                f"pooling {model.pooling!r}; the manifest was edited: recompile")
        return cls(model=model, parallel=ParallelConfig(**d["parallel"]),
                   cache=CacheConfig(**d["cache"]), buckets=BucketConfig.from_dict(d["buckets"]),
                   backend=d["backend"], dtype=d["dtype"], backend_options=d.get("backend_options", {}),
                   graphs=d["graphs"], files=d["files"], versions=d["versions"], source=d.get("source", {}),
                   quant=QuantConfig(**{**d.get("quant", {}),
                                        "modules_to_not_convert": tuple(d.get("quant", {}).get(
                                            "modules_to_not_convert", ()))}), draft=d.get("draft"),
                   lora=LoraConfig.from_dict(d["lora"]) if d.get("lora") is not None else None,
                   vision=d.get("vision"))

    def bucket_files(self, root: Path) -> dict[Bucket, list[Path]]:
        return {Bucket.from_key(k): [root / f for f in fs] for k, fs in self.graphs.items()}


def is_artifact_dir(path: Path) -> bool:
    """Whether `path` holds one of our artifacts: a manifest.json with our format's fields (a web app's manifest.json
    is not one)."""
    try:
        raw = json.loads(read_capped(Path(path) / MANIFEST, MAX_MANIFEST_BYTES, ArtifactError, "artifact"))
    except (OSError, ValueError, ArtifactError):
        return False
    return isinstance(raw, dict) and {"format_version", "files", "digest"} <= set(raw)


def check_out_dir(out: Path, force: bool) -> None:
    """`compile --out` may replace an artifact or an empty directory; another directory only with `force` (its
    contents are then deleted), a file never. ConfigError naming the flag otherwise."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out}: is a file, not a directory; refusing to replace it", param="out")
    if force or is_artifact_dir(out) or not any(out.iterdir()):
        return
    raise ConfigError(f"--out {out}: a non-empty directory that is not an artifact (no {MANIFEST} of ours); "
                      "replacing it would delete its files. Choose another --out, or pass --force to replace it",
                      param="out")


class ArtifactWriter:
    """Collects files in a temporary directory next to `out`; `commit` hashes them, writes the manifest (and its
    signature, given a key) and renames into place."""

    def __init__(self, out: Path, force: bool = False, signing_key: Any = None) -> None:
        self.out = Path(out).resolve()
        self.force, self.signing_key = force, signing_key  # signing_key: an Ed25519PrivateKey, or None
        check_out_dir(self.out, force)
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
        data = json.dumps(raw, indent=2, sort_keys=True).encode()
        with open(self.tmp / MANIFEST, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if self.signing_key is not None:  # over the exact bytes written, which hash every other file
            sign_manifest(self.tmp, data, self.signing_key)
        check_out_dir(self.out, self.force)  # again: the directory may have been filled while we compiled
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


@dataclass(frozen=True)
class VerifiedManifest:
    manifest: Manifest
    raw: dict[str, Any]  # the manifest as written (the bytes that were checked)
    signature: str  # what neuron_opt.signing.check_signature found: "unsigned", or the signer and the check
    files_verified: bool = True  # every file's sha256 was checked (read_verified's verify_hashes)


def read_manifest(root: Path, verify_hashes: bool = True,
                  trusted_keys: Sequence[str | Path] | None = None) -> Manifest:
    """The artifact's manifest, after every check of the module docstring (`verify_hashes=False`: all but the files'
    sha256). `trusted_keys`: public-key files the artifact must be signed by; None: NEURON_OPT_TRUSTED_KEYS."""
    return read_verified(root, verify_hashes, trusted_keys).manifest


def read_verified(root: Path, verify_hashes: bool = True,
                  trusted_keys: Sequence[str | Path] | None = None) -> VerifiedManifest:
    root = Path(root)
    mpath = root / MANIFEST
    if not mpath.exists():
        raise ArtifactError(f"{root}: not an artifact (no {MANIFEST}); create one with `neuron-opt compile`")
    data = read_capped(mpath, MAX_MANIFEST_BYTES, ArtifactError, "artifact")
    # the signature first, over the bytes parsed below: nothing the manifest says is used before it is checked
    signature = check_signature(root, data, load_trusted_keys(trusted_key_paths(trusted_keys)))
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{mpath}: corrupt manifest ({e})") from None
    if not isinstance(raw, dict) or raw.get("format_version") != FORMAT_VERSION:
        version = raw.get("format_version") if isinstance(raw, dict) else None
        raise ArtifactError(f"{mpath}: format version {version} differs from this install's "
                            f"{FORMAT_VERSION}; recompile the artifact")
    try:
        m = Manifest.from_json(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
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
    check_paths(root, m)  # before any file is listed or hashed: a symlink out could point at /dev/zero
    skip = {root / MANIFEST, root / SIGNATURE}
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p not in skip}
    if missing := sorted(set(m.files) - on_disk):
        raise ArtifactError(f"{root}: missing file(s) listed in the manifest: {', '.join(missing[:5])}")
    if extra := sorted(on_disk - set(m.files)):
        raise ArtifactError(f"{root}: file(s) not listed in the manifest: {', '.join(extra[:5])}")
    if verify_hashes:
        key = _hashed_key(root, data)
        known = _HASHED.get(key, {})
        stamps: dict[str, tuple[int, ...]] = {}
        for rel, digest in m.files.items():
            before = _stamp(root / rel)
            if before is not None and known.get(rel) == before:  # hashed by this process, unchanged since
                stamps[rel] = before
                continue
            if sha256_file(root / rel) != digest:
                raise ArtifactError(f"{root / rel}: sha256 does not match the manifest (file modified or corrupt)")
            if before is not None and _stamp(root / rel) == before:  # not written to while it was hashed
                stamps[rel] = before
        _HASHED[key] = stamps
    return VerifiedManifest(m, raw, signature, verify_hashes)


# Files whose sha256 this process has checked against a manifest, per (resolved artifact root, sha256 of the
# manifest's bytes): each file's stamp (_stamp) when it was checked. read_verified hashes a file again unless its
# stamp is still the same, so a pulled artifact (hashed while it downloads, or by pull's check of a cached copy)
# is not hashed a second time by the loader in the same process. Per process only: nothing is written to disk.
_HASHED: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}
# A stamp is only kept for a file whose last change is this much older than the stamp: a write within the
# filesystem's timestamp granularity of the last one may leave mtime and ctime unchanged (git's "racily clean").
RACY_NS = 2_000_000_000


def _now_ns() -> int:
    return time.time_ns()


def _hashed_key(root: Path, manifest_bytes: bytes) -> tuple[str, str]:
    return str(Path(root).resolve()), hashlib.sha256(manifest_bytes).hexdigest()


def _stamp(path: Path) -> tuple[int, ...] | None:
    """(device, inode, size, mtime, ctime) in ns, or None when the file changed too recently to be told apart from
    a later write (RACY_NS). ctime changes on every write, truncation, rename onto the path's inode and utime call
    and cannot be set back by the user, so an unchanged stamp means unchanged bytes short of a filesystem that
    does not keep these times."""
    st = path.stat()
    if max(st.st_mtime_ns, st.st_ctime_ns) > _now_ns() - RACY_NS:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def record_hashed(root: Path, manifest_bytes: bytes, files: Sequence[str]) -> None:
    """`files` of the artifact at `root` (manifest bytes `manifest_bytes`) were just checked against the manifest's
    sha256 by the caller (object_store.pull hashes each file as it downloads): a later read_verified in this
    process skips them while their stamps stay the same."""
    stamps = {rel: st for rel in files if (st := _stamp(Path(root) / rel)) is not None}
    _HASHED.setdefault(_hashed_key(root, manifest_bytes), {}).update(stamps)


def check_paths(root: Path, m: Manifest) -> None:
    """Every path the manifest names resolves inside `root`: relative, without `..`, through no symlink that leads
    out; every graph file is one of the listed files, the draft a directory with a listed manifest."""
    real = root.resolve()
    if not isinstance(m.files, dict) or not isinstance(m.graphs, dict):
        raise ArtifactError(f"{root / MANIFEST}: files and graphs must be objects")

    def inside(rel: Any, field: str) -> None:
        p = PurePosixPath(rel) if isinstance(rel, str) and rel else None
        if p is None or p.is_absolute() or ".." in p.parts:
            raise ArtifactError(f"{root / MANIFEST}: {field} names {rel!r}, which is not a relative path inside "
                                "the artifact (absolute, empty or with '..')")
        if not (root / p).resolve().is_relative_to(real):
            raise ArtifactError(f"{root / rel}: resolves to {(root / p).resolve()}, outside the artifact (a symlink "
                                "out of it)")

    for rel in m.files:
        inside(rel, "files")
    for key, files in m.graphs.items():
        for rel in files:
            inside(rel, f"graphs[{key!r}]")
            if rel not in m.files:
                raise ArtifactError(f"{root / MANIFEST}: graphs[{key!r}] names {rel!r}, which is not one of the "
                                    "artifact's files")
    for size, files in (m.vision or {}).get("graphs", {}).items():
        for rel in files:
            inside(rel, f"vision.graphs[{size!r}]")
            if rel not in m.files:
                raise ArtifactError(f"{root / MANIFEST}: vision.graphs[{size!r}] names {rel!r}, which is not one of "
                                    "the artifact's files")
    if m.vision is not None:
        inside(m.vision.get("dir"), "vision.dir")
    if m.draft is not None:
        inside(m.draft, "draft")
        if f"{PurePosixPath(m.draft)}/{MANIFEST}" not in m.files:
            raise ArtifactError(f"{root / MANIFEST}: draft {m.draft!r} is not an artifact inside this one")
