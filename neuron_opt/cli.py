"""`neuron-opt` entry point. Each subcommand lives in neuron_opt/commands/<name>.py and exposes
`add_parser(subparsers)`, which registers its flags and sets `func(args) -> int`.

Errors from our own boundary checks (NeuronOptError) print as one clear line and exit 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

from neuron_opt import envs
from neuron_opt.errors import NeuronOptError

COMMANDS = ("compile", "generate", "serve", "run_batch", "plan", "bench", "inspect", "keygen", "push", "pull")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuron-opt", description="Compile and serve Llama-family LLMs on AWS Neuron (and fast on CPU).")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{" + ",".join(c.replace("_", "-") for c in COMMANDS) + "}")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"neuron_opt.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"neuron_opt.commands.{name}":
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if envs.NUM_THREADS:
        torch.set_num_threads(envs.NUM_THREADS)
    try:
        return int(args.func(args) or 0)
    except NeuronOptError as e:
        print(f"neuron-opt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
