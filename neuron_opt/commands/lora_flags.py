"""The LoRA flags: `compile --enable-lora --max-loras N --max-lora-rank R [--lora-target-modules ...]` (the
capacity, recorded in the manifest) and `serve --lora-modules name=path ...` (vLLM's spellings; docs/lora.md)."""

from __future__ import annotations

import argparse

from neuron_opt.errors import ConfigError
from neuron_opt.lora.config import TARGET_MODULES, LoraConfig


def add_compile_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-lora", action="store_true",
                   help="compile graphs that take LoRA adapters at run time (docs/lora.md); cpu, eager and neuron "
                        "backends")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="adapters resident at once (slots; default 1); more may be registered, swapped in on demand")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="largest adapter rank (default 16); smaller ranks are zero-padded")
    p.add_argument("--lora-target-modules", nargs="+", default=None, metavar="NAME",
                   help=f"linears that take adapters (default all: {' '.join(TARGET_MODULES)})")


def lora_config_from_args(args: argparse.Namespace) -> LoraConfig | None:
    """The capacity asked for, None without --enable-lora (its other flags alone are an error, never ignored)."""
    if not args.enable_lora:
        given = [f for f, v in (("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank),
                                ("--lora-target-modules", args.lora_target_modules)) if v is not None]
        if given:
            raise ConfigError(f"{given[0]}: needs --enable-lora", param="enable_lora")
        return None
    return LoraConfig(1 if args.max_loras is None else args.max_loras,
                      16 if args.max_lora_rank is None else args.max_lora_rank,
                      tuple(args.lora_target_modules or TARGET_MODULES))


def parse_lora_modules(items: list[str] | None) -> dict[str, str]:
    """`name=path` pairs (vLLM's --lora-modules) -> {name: path}; ConfigError naming the bad item."""
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules: expected name=path, got {item!r}", param="lora_modules")
        if name in out:
            raise ConfigError(f"--lora-modules: {name!r} is given twice", param="lora_modules")
        out[name] = path
    return out
