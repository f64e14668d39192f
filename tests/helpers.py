"""The one small helper the tests share: build our runner for a checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from neuron_opt.api import build_model
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig, ModelConfig
from neuron_opt.runtime.runner import ModelRunner


def eager_runner(ckpt_dir: Path, max_length: int = 256, max_batch: int = 1, **bucket_kw) -> ModelRunner:
    cfg = ModelConfig.from_hf(ckpt_dir)
    sd = load_file(str(ckpt_dir / "model.safetensors"))
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    model = build_model(cfg, sd, max_length, torch.float32)
    cache = CacheConfig(max_batch=max_batch, max_length=max_length)
    buckets = BucketConfig.build(max_context=max_length, max_length=max_length, max_batch=max_batch,
                                 min_prefill=16, min_decode=16, **bucket_kw)
    return ModelRunner(EagerExecutor(model, cache.num_slots), buckets, cache, cfg.vocab_size)
