"""`neuron-opt bench NAME [args...]`: run a benchmark (decode here; serve, kernels, tp from the repo's scripts/)."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from neuron_opt.errors import ConfigError

NAMES = ("decode", "serve", "kernels", "tp")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark: " + ", ".join(NAMES) + " (args after NAME go to it)")
    p.add_argument("name", choices=NAMES)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark (see NAME --help)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.name == "decode":
        from neuron_opt.bench.decode import main  # here: the CLI parses without loading the benchmark's systems

        return main(args.rest)
    script = Path(__file__).resolve().parents[2] / "scripts" / f"bench_{args.name}.py"
    if not script.exists():
        raise ConfigError(f"bench {args.name}: {script} not found; run it from a source checkout of neuron_opt")
    sys.argv = [str(script), *args.rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0)
    return 0
