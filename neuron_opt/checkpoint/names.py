"""The names a checkpoint of a config must hold, checked at open time (cheap: from file headers), so a bad
checkpoint fails before any compile.

"Canonical" means: HF names, the layout `models/llama.py` loads with no renaming, and no `lm_head.weight` when
embeddings are tied (the model ties the two parameters itself).
"""

from __future__ import annotations

import re
from pathlib import Path

from models.build import stored_weight_names, weight_names
from models.llama import checkpoint_weight_names
from neuron_opt.config import ModelConfig
from neuron_opt.errors import CheckpointError

# Old HF checkpoints store the rotary table as a buffer; it is recomputed by the model, so it is dropped.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")


def check_names(have: set[str], cfg: ModelConfig, source: Path, expected: list[str] | None = None) -> None:
    """`have` (a checkpoint's names) must be `expected` (default: what an HF checkpoint of `cfg` stores)."""
    expected = stored_names(cfg) if expected is None else expected
    have = {n for n in have if not _IGNORED.fullmatch(n)}
    if cfg.tie_word_embeddings or cfg.is_embedding:
        # tied: the model reuses embed_tokens, the copy is redundant; an embedding model has no LM head to load
        have.discard("lm_head.weight")
    missing = [n for n in expected if n not in have]
    extra = sorted(have - set(expected))
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



def gguf_stored_names(cfg: ModelConfig) -> list[str]:
    """The names a GGUF file of `cfg` gives (neuron_opt.checkpoint.gguf.gguf_names): the canonical ones, fused
    projections (Phi-3) under their fused names; stacked experts are one name per expert already."""
    return checkpoint_weight_names(cfg, weight_names(cfg))
