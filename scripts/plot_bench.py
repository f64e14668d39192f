#!/usr/bin/env python
"""Plot scripts/bench_decode.py's JSON: tokens/s per system and batch (the median of the rounds, a bar from the
slowest to the fastest round), ratio to HF eager above each bar."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("json", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default=None, help="the model's name in the title (default: from the JSON's model: "
                    "SmolLM2-135M for the default one, else the checkpoint's directory name)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(args.json.read_text())
    rows = doc["results"]
    batches = sorted({r["batch"] for r in rows})
    systems = list(dict.fromkeys(f"{r['system']} {r['dtype']}" for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        sel = {f"{r['system']} {r['dtype']}": r for r in rows if r["batch"] == b}
        names = [s for s in systems if s in sel]
        vals = [sel[s]["tok_s"] for s in names]
        lo = [v - (sel[s].get("tok_s_min") or v) for s, v in zip(names, vals, strict=True)]  # older JSON: no span
        hi = [(sel[s].get("tok_s_max") or v) - v for s, v in zip(names, vals, strict=True)]
        bars = ax.bar(range(len(names)), vals, yerr=[lo, hi], capsize=3,
                      color=["#888" if "transformers" in s else "#c73" if "llama" in s else "#2a7" for s in names])
        for bar, s, up in zip(bars, names, hi, strict=True):
            ratio = sel[s].get("ratio_vs_hf")
            if ratio:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + up, f"{ratio:.2f}x", ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), [n.replace("neuron_opt-", "").replace("transformers-", "HF ")
                                          for n in names], rotation=30, ha="right", fontsize=8)
        ax.set_title(f"decode, batch {b}")
        ax.set_ylabel(f"tokens/s, median of {doc.get('repeats', 1)} rounds (min-max)")
    model = str(doc.get("model", "default"))
    name = args.title or ("SmolLM2-135M" if model == "default" else Path(model).name)
    cpu = doc.get("machine", {}).get("cpu_model") or doc.get("cpu", "")
    fig.suptitle(f"{name} decode on {doc.get('threads')} threads of {cpu} (read bandwidth "
                 f"{doc['mem_bw_gbs']:.0f} GB/s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
