"""Serving benchmark, like `vllm bench serve`, plus the no-engine baseline in the same run: see
neuron_opt/bench/serve/ (the package's doc states what each scenario measures) and docs/benchmarks.md.

    python scripts/bench_serve.py --model default --num-prompts 32 --concurrency 16 --json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuron_opt.bench.serve.cli import main  # noqa: E402 (after the sys.path line)

if __name__ == "__main__":
    sys.exit(main())
