"""The flags that pick a model on the Hugging Face Hub (compile, plan, generate, serve): `--revision` (vLLM's name)
and `--gguf-file`; the id itself is `--model org/name[:QUANT]` (neuron_opt.hub, docs/models.md)."""

from __future__ import annotations

import argparse

MODEL_HELP = ("an HF checkpoint directory, a GGUF file, 'default' (the bundled SmolLM2), or a Hugging Face Hub id "
              "org/name (org/name:Q4_K_M for one .gguf of a GGUF repo), fetched into the Hub cache (HF_HOME, "
              "HF_TOKEN, HF_HUB_OFFLINE)")


def add_hub_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default=None, metavar="REV",
                   help="with a Hub id: the branch, tag or commit hash to use (default: main)")
    p.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="with a Hub id of a GGUF repo: the .gguf file to use (its path or file name; or give "
                        "--model org/name:QUANT)")
