"""PEFT LoRA adapters made in the tests, and greedy decoding of HF (or PEFT) models: the LoRA tests' oracle."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
from tiny import load_hf


def make_adapter(base: Path, out: Path, r: int, alpha: float, targets: list[str] | str, seed: int,
                 rslora: bool = False, **extra) -> Path:
    """A PEFT LoRA adapter of `base` with random A and B (B non-zero), saved as PEFT saves it."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_dropout=0.0,
                          use_rslora=rslora, **extra)
    model = peft.get_peft_model(load_hf(base), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of an HF (or PEFT) model, full forward each step: the oracle."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
