#!/usr/bin/env python
"""Plot scripts/bench_decode.py's JSON: tokens/s per system, batch and size (`--sizes`: one panel per size and
batch, the size's parameters in its title), the median of the rounds with a bar from the slowest to the fastest
round; above each bar the ratio to HF eager (or, without HF, to llama.cpp's paired format) and the MBU (marked *
where the step's bytes fit in the last-level cache, so MBU above 1 is possible)."""

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
    sizes = list(dict.fromkeys(r.get("size") for r in rows))
    params = {z["name"]: z["parameters"] for z in doc.get("sizes") or []}
    systems = list(dict.fromkeys(f"{r['system']} {r['dtype']}" for r in rows))
    fig, axes = plt.subplots(len(sizes), len(batches), figsize=(5.5 * len(batches), 4.2 * len(sizes)),
                             squeeze=False)
    for ax, (z, b) in zip(axes.flat, [(z, b) for z in sizes for b in batches], strict=True):
        sel = {f"{r['system']} {r['dtype']}": r for r in rows if r["batch"] == b and r.get("size") == z}
        names = [s for s in systems if s in sel]
        vals = [sel[s]["tok_s"] for s in names]
        lo = [v - (sel[s].get("tok_s_min") or v) for s, v in zip(names, vals, strict=True)]  # older JSON: no span
        hi = [(sel[s].get("tok_s_max") or v) - v for s, v in zip(names, vals, strict=True)]
        bars = ax.bar(range(len(names)), vals, yerr=[lo, hi], capsize=3,
                      color=["#888" if "transformers" in s else "#c73" if "llama" in s else "#2a7" for s in names])
        for bar, s, up in zip(bars, names, hi, strict=True):
            r = sel[s]
            ratio = r.get("ratio_vs_hf") or r.get("ratio_vs_llamacpp")
            label = (f"{ratio:.2f}x\n" if ratio else "") + (f"{r['mbu']:.0%}" + ("*" if r.get("fits_llc") else "")
                                                            if r.get("mbu") is not None else "")
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + up, label, ha="center", va="bottom",
                    fontsize=7)
        ax.set_xticks(range(len(names)), [n.replace("neuron_opt-", "").replace("transformers-", "HF ")
                                          for n in names], rotation=30, ha="right", fontsize=8)
        what = f"{z}, {params[z] / 1e9:.2f} B parameters, " if z in params else (f"{z}, " if z else "")
        ax.set_title(f"decode, {what}batch {b}", fontsize=9)
        ax.set_ylabel(f"tokens/s, median of {doc.get('repeats', 1)} rounds (min-max)")
    model = str(doc.get("model", "default"))
    name = args.title or ("SmolLM2-135M" if model == "default" else "three sizes" if model == "sizes"
                          else Path(model).name)
    cpu = doc.get("machine", {}).get("cpu_model") or doc.get("cpu", "")
    llc = doc.get("llc_bytes") or doc.get("machine", {}).get("llc_bytes")
    fig.suptitle(f"{name} decode on {doc.get('threads')} threads of {cpu} (read bandwidth "
                 f"{doc['mem_bw_gbs']:.0f} GB/s" + (f", last-level cache {llc / 2**20:.0f} MiB" if llc else "")
                 + "); above each bar: ratio, MBU (* fits the cache)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
