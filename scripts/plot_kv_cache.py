#!/usr/bin/env python
"""Plot the block KV cache benchmarks (`scripts/bench_serve.py --scenario ...` and the version A/B) in one figure.

    python scripts/plot_kv_cache.py --dir docs/bench --out docs/bench/kv_cache.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("docs/bench"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def load(name: str) -> dict:
        return json.loads((args.dir / name).read_text())

    sp, lp, cap, ab = (load(f"kv_{n}.json") for n in ("shared_prefix", "long_prompts", "capacity", "ab_16streams"))
    panels = [
        ("shared 1,024-token prefix: TTFT p50 (ms)", ["no prefix cache", "prefix cache"],
         [sp["best"]["no_prefix_caching"]["ttft_ms"]["p50"], sp["best"]["prefix_caching"]["ttft_ms"]["p50"]]),
        ("2,048-token prompts into 16 streams: ITL p99 (ms)", ["whole prompts", "chunked"],
         [lp["best"]["not_chunked"]["streams"]["itl_ms"]["p99"], lp["best"]["chunked"]["streams"]["itl_ms"]["p99"]]),
        ("same, TPOT p99 (ms)", ["whole prompts", "chunked"],
         [lp["best"]["not_chunked"]["streams"]["tpot_ms"]["p99"], lp["best"]["chunked"]["streams"]["tpot_ms"]["p99"]]),
        ("concurrent sequences, same KV memory", ["contiguous slots", "blocks (max)", "blocks (mean)"],
         [cap["contiguous_slots_same_memory"], cap["run"]["running_max"], cap["run"]["running_mean"]]),
        ("16 streams: output tok/s", ["contiguous-slot engine", "block engine"],
         [ab["best"]["baseline"]["output_throughput"], ab["best"]["ours"]["output_throughput"]]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4))
    for ax, (title, names, vals) in zip(axes, panels, strict=True):
        bars = ax.bar(range(len(vals)), vals, color=["#888"] + ["#2a7"] * (len(vals) - 1))
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(vals)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.suptitle("SmolLM2-135M bf16, cpu backend, 2 cores: block KV cache (docs/benchmarks.md)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
