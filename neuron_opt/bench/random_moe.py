"""The MoE decode benchmark's model: a random-weight Mixtral small enough for a laptop, large enough that its
experts dominate the bytes (8 experts, top 2, 8 layers, hidden 512, expert width 1024: 156.3 M parameters, 80.8 M
active per token of which 55.6 M are read, the embedding table being looked up one row), with the default model's
tokenizer (49,152 ids) so every command accepts it.

`neuron-opt bench decode` and `scripts/bench_decode.py` take `--model random-moe`: the checkpoint is written once
with transformers' `save_pretrained` (fixed seed) under the cache directory and reused.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from neuron_opt.checkpoint import open_checkpoint

NAME = "random-moe"
CONFIG = dict(vocab_size=49152, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
              max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
VERSION = 1  # bump when CONFIG or the seed changes: a new directory


def random_moe_dir(cache_dir: Path) -> Path:
    """The checkpoint directory, written on first use (config.json last: a half-written one is redone)."""
    out = Path(cache_dir) / f"{NAME}-v{VERSION}"
    if (out / "config.json").is_file():
        return out
    tok = open_checkpoint("default").tokenizer()
    cfg = transformers.MixtralConfig(**CONFIG, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out
