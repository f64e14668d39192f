"""The on-disk caches of checkpoint reading, under `neuron_opt.envs.CACHE_DIR`, content-addressed by the file's
sha256 (`fingerprint`), so an edited file is never served stale.

- A GGUF's config and tensor names (JSON): parsing its metadata (100k tokenizer strings) takes ~2 s, hashing ~0.1 s.
- A GGUF's dequantized weights as fp32 safetensors: dequantizing the default Q4_1 model in numpy takes seconds.
- A GGUF's tokenizer, saved with `save_pretrained`: building it from GGUF metadata re-derives the BPE merges.
Every write is atomic (temp file + os.replace), and a damaged entry is rebuilt, never trusted. A failed write (a
read-only or full disk) is ignored: a cache only buys speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from neuron_opt.checkpoint.gguf import check_types, gguf_names, gguf_reader, gguf_state_dict, gguf_tokenizer
from neuron_opt.checkpoint.gguf_config import gguf_config
from neuron_opt.config import ModelConfig
from neuron_opt.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_VERSION = "v2"  # bump when the GGUF -> canonical conversion changes


def gguf_meta_cached(path: Path, cache_dir: Path) -> tuple[ModelConfig, set[str]]:
    """Config and HF tensor names of a GGUF file. Parsing its metadata (100k tokenizer strings) takes ~2 s,
    hashing it ~0.1 s, so the result is cached as JSON keyed by the file's sha256."""
    cached = cache_dir / "gguf" / f"{fingerprint((path,))[:40]}-{CACHE_VERSION}.json"
    try:
        meta = json.loads(cached.read_text())
        return ModelConfig.from_dict(meta["config"]), set(meta["names"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or damaged: rebuild
    reader = gguf_reader(path)
    check_types(reader, path)
    cfg = gguf_config(reader, path)
    try:
        names = gguf_names(reader, cfg)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint: {path}: {e}") from None
    fresh = {"config": cfg.to_dict(), "names": sorted(names)}
    _atomic_write(cached, lambda tmp: tmp.write_text(json.dumps(fresh)))
    return cfg, names


def _atomic_write(dest: Path, write: Callable[[Path], object]) -> None:
    """Write `dest` through a temp file in the same directory + os.replace, so readers never see a partial
    file. Failures (read-only or full disk) are ignored: a cache only buys speed."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, suffix=".tmp")
        os.close(fd)
    except OSError:
        return
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; cache entries are plain readable files
        os.replace(tmp, dest)
    except OSError:
        Path(tmp).unlink(missing_ok=True)



def gguf_state_dict_cached(path: Path, cfg: ModelConfig, cache_dir: Path) -> dict[str, torch.Tensor]:
    """`gguf_state_dict`, memoised on disk as fp32 safetensors keyed by the file's sha256."""
    cached, sd = _gguf_cache(path, cfg, cache_dir)
    return sd if sd is not None else load_file(str(cached))


def gguf_cache_file(path: Path, cfg: ModelConfig, cache_dir: Path) -> Path:
    """The fp32 safetensors file holding `gguf_state_dict(path)`, built if absent or damaged."""
    return _gguf_cache(path, cfg, cache_dir)[0]


def _gguf_cache(path: Path, cfg: ModelConfig, cache_dir: Path) -> tuple[Path, dict[str, torch.Tensor] | None]:
    """(cache file, the state dict if it had to be built now: None when the file was already there and valid)."""
    cached = cache_dir / "gguf" / f"{fingerprint((path,))[:40]}-{CACHE_VERSION}.safetensors"
    if cached.is_file():
        try:
            with safe_open(str(cached), framework="pt") as sf:
                sf.keys()
            return cached, None
        except Exception:  # a damaged cache entry is rebuilt, never trusted
            cached.unlink(missing_ok=True)
    sd = gguf_state_dict(path, cfg)
    _atomic_write(cached, lambda tmp: save_file(sd, str(tmp)))
    return cached, sd



def gguf_tokenizer_cached(path: Path, cache_dir: Path) -> PreTrainedTokenizerBase:
    """`gguf.gguf_tokenizer`, saved once with `save_pretrained` (loading tokenizer.json is faster than converting the
    GGUF's vocabulary again)."""
    from transformers import AutoTokenizer  # as in hf.hf_tokenizer

    cached = cache_dir / "tokenizers" / f"{fingerprint((path,))[:40]}-{CACHE_VERSION}"
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError, KeyError, TypeError):
            shutil.rmtree(cached, ignore_errors=True)
    tok = gguf_tokenizer(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent))
    except OSError:
        return tok  # a read-only cache directory only costs speed
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached)  # atomic directory rename; fails harmlessly if another process won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


_FINGERPRINTS: dict[tuple[tuple[str, int, int], ...], str] = {}


def fingerprint(files: tuple[Path, ...]) -> str:
    """sha256 over the files' bytes, memoised per process on (path, mtime, size) of every file."""
    stats = tuple((str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(files))
    if stats not in _FINGERPRINTS:
        h = hashlib.sha256()
        for name, _, _ in stats:
            with open(name, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
        _FINGERPRINTS[stats] = h.hexdigest()
    return _FINGERPRINTS[stats]
