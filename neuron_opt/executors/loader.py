"""The one loader: a model path (artifact or checkpoint) -> manifest, tokenizer and runner.

An artifact's manifest is read and verified once (neuron_opt.artifact.read_verified: signature, versions, digest,
KV geometry, paths, every file's sha256); a caller that has already verified it (`serve` and `generate` check
their flags against it first) passes it in, and it is not read again. The settings asked for are checked against
it before anything loads; then the tokenizer, then the executor (executors.factory.create_executor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from neuron_opt.artifact import Manifest, VerifiedManifest, read_verified
from neuron_opt.backends import get_backend
from neuron_opt.buckets import BucketConfig
from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig, torch_dtype
from neuron_opt.embeddings import resolve_task
from neuron_opt.errors import ConfigError
from neuron_opt.executors.factory import ArtifactSpec, CheckpointSpec, create_executor, prepare
from neuron_opt.hub import resolve_model
from neuron_opt.lora.config import LoraConfig
from neuron_opt.multimodal.compiled import load_vision
from neuron_opt.multimodal.vision import check_vision_parallel, is_multimodal, open_multimodal
from neuron_opt.planner.memory import kv_window, window_prompt_len
from neuron_opt.runtime.runner import ModelRunner


@dataclass
class LoadedModel:
    manifest: Manifest | None  # None: a checkpoint, run eagerly
    model_config: ModelConfig
    tokenizer: Any
    runner: ModelRunner
    dtype: str  # the compute dtype
    modalities: tuple[str, ...] = ("text",)


def is_artifact(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "manifest.json").exists()


def check_artifact_settings(manifest: Manifest, *, dtype: str | None, max_model_len: int | None,
                            batch_size: int | None, parallel: ParallelConfig | None,
                            num_speculative_tokens: int | None = None, lora: LoraConfig | None = None) -> None:
    """An artifact fixes its dtype, KV length, batch size and parallel layout when it is compiled: a value asked
    for here must be the artifact's, else a ConfigError says which and how to get it (never ignored)."""
    m = manifest
    if parallel is not None and parallel.flash_decoding is None:  # auto: whatever compile decided for the artifact
        parallel = replace(parallel, flash_decoding=m.parallel.flash_decoding)
    fixed = {"dtype": (dtype, m.dtype, "--dtype"),
             "max_model_len": (max_model_len, m.cache.max_model_len, "--max-model-len"),
             "batch_size": (batch_size, m.cache.max_batch, "--batch-size"),
             "parallel": (parallel, m.parallel, "--tp and the layout flags"),
             "num_speculative_tokens": (num_speculative_tokens, m.buckets.num_speculative_tokens,
                                        "--num-speculative-tokens"),
             "lora": (lora, m.lora, "--enable-lora --max-loras --max-lora-rank --lora-target-modules")}
    for name, (asked, has, flag) in fixed.items():
        if asked is not None and asked != has:
            raise ConfigError(f"{name}: this artifact was compiled with {name}={has!r}, not {asked!r}; an artifact's "
                              f"{name} is fixed at compile time: recompile with `neuron-opt compile ... {flag}`, "
                              f"or leave {name} unset to use the artifact's", param=name)


def load_model(model: str | Path, *, dtype: str | None = None, max_model_len: int | None = None,
               batch_size: int | None = None, parallel: ParallelConfig | None = None,
               num_speculative_tokens: int | None = None, trusted_keys: Sequence[str | Path] | None = None,
               verified: VerifiedManifest | None = None, lora: LoraConfig | None = None,
               revision: str | None = None, gguf_file: str | None = None) -> LoadedModel:
    """An artifact directory (`verified`: its manifest, already read with every check) or a checkpoint (HF
    directory, GGUF file, "default", or a Hub id with its `revision` and `gguf_file`: neuron_opt.hub), ready to
    run; `verified` is read again only if its files' sha256 were not checked.

    For a checkpoint the settings say how to run it (defaults float32, the model's limit up to 2048, batch 1,
    tp=1, no verify buckets; buckets and KV geometry as `compile` makes them by default for the eager backend,
    window-sized KV included); for an artifact each is left unset or equal to the artifact's own. `trusted_keys`:
    the public keys an artifact must be signed by (None: NEURON_OPT_TRUSTED_KEYS). `lora`: a checkpoint's LoRA
    capacity (neuron_opt.lora; default none); an artifact's, unset or equal to the one it was compiled with."""
    settings = dict(dtype=dtype, max_model_len=max_model_len, batch_size=batch_size, parallel=parallel,
                    num_speculative_tokens=num_speculative_tokens, lora=lora)
    model = resolve_model(model, revision=revision, gguf_file=gguf_file)  # a local path as given
    if is_artifact(model):
        return _load_artifact(Path(model), verified, trusted_keys, settings)
    return _load_checkpoint(model, **settings)


def _load_artifact(root: Path, verified: VerifiedManifest | None, trusted_keys: Sequence[str | Path] | None,
                   settings: dict[str, Any]) -> LoadedModel:
    if verified is None or not verified.files_verified:
        verified = read_verified(root, trusted_keys=trusted_keys)
    m = verified.manifest
    check_artifact_settings(m, **settings)
    spec = ArtifactSpec(root, m)
    prepare(spec)  # before transformers (the tokenizer) may import a device runtime
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    vision = None
    if m.vision is not None:  # the image side: processor and the encoder's compiled buckets, in this process
        backend = get_backend(m.backend, torch_dtype(m.dtype), m.backend_options)
        vision = load_vision(root, m.vision, backend, torch_dtype(m.dtype))
    runner = ModelRunner(create_executor(spec), m.buckets, m.cache, m.model.vocab_size, m.model, vision)
    runner.warm_sampling()  # every graph ready before the first request
    return LoadedModel(m, m.model, tokenizer, runner, m.dtype, ("text", "image") if vision is not None else ("text",))


def _load_checkpoint(model: str | Path, *, dtype: str | None, max_model_len: int | None, batch_size: int | None,
                     parallel: ParallelConfig | None, num_speculative_tokens: int | None,
                     lora: LoraConfig | None = None) -> LoadedModel:
    dtype, batch_size = dtype or "float32", batch_size or 1
    vision = None
    if is_multimodal(model):  # a vision-language model: its text decoder here (tp > 1: on the ranks), its image
        # side (`vision`) beside it in this process, replicated (docs/multimodal.md)
        check_vision_parallel(parallel or ParallelConfig())
        mm = open_multimodal(Path(model), torch_dtype(dtype))
        cfg, tokenizer, state_dict, vision = mm.config, mm.tokenizer, mm.state_dict, mm.vision
    else:
        ckpt = open_checkpoint(model)
        cfg = resolve_task(ckpt.config)  # a sentence-transformers checkpoint is an embedding model (prefill only)
        tokenizer = ckpt.tokenizer()
        state_dict = ckpt.state_dict()
    max_model_len = max_model_len or min(cfg.max_position_embeddings, 2048)
    k = num_speculative_tokens or 0
    block_size = CacheConfig.block_size
    # as compile's defaults (compiler.plan_buckets) for the eager backend: sliding-window layers prefill in chunks of
    # their window and hold window-sized KV where that saves blocks
    prompt_len = window_prompt_len(cfg, max_model_len, block_size, k + 1 if k else 0) or max_model_len
    buckets = BucketConfig.build(max_prompt_len=prompt_len, max_model_len=max_model_len, max_batch=batch_size,
                                 num_speculative_tokens=k, offset_prefill=not cfg.is_embedding,
                                 prefill_only=cfg.is_embedding)
    window, per_seq = kv_window(cfg, buckets, block_size, max_model_len)
    cache = CacheConfig(max_batch=batch_size, max_model_len=max_model_len, dtype=dtype, block_size=block_size,
                        sliding_window=window, window_blocks_per_sequence=per_seq)
    spec = CheckpointSpec(cfg, state_dict, parallel or ParallelConfig(), cache, dtype, lora)
    runner = ModelRunner(create_executor(spec), buckets, cache, cfg.vocab_size, cfg, vision)
    return LoadedModel(None, cfg, tokenizer, runner, dtype, ("text", "image") if vision is not None else ("text",))
