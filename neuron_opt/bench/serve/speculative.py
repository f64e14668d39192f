"""The speculative-decoding scenario: the same workload with each speculation mode against plain decoding, with
acceptance from /metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from neuron_opt.bench.serve.client import run_load, scrape, summarize, with_server

SPEC_MODES = {
    "plain": (),
    "ngram-adaptive": ("--speculative-method", "ngram"),
    "ngram-always": ("--speculative-method", "ngram", "--no-speculative-adaptive"),
}


def scenario_speculative(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """`--num-prompts` chat requests of the speculative benchmark's workload (`--spec-workload`: grounded, distinct
    "repeat this text" prompts, or open-ended), `--concurrency` streams at once, greedy, answers ending at EOS (at
    most --output-len tokens), on an artifact compiled with --num-speculative-tokens K: served plainly, with
    prompt lookup under the adaptive rule, and with prompt lookup verifying every step, alternating --rounds
    times; the best round of each. Texts are compared request for request with the plain server's; the
    spec_decode counters come from /metrics."""
    from neuron_opt.bench.spec_workloads import OPEN, grounded_prompts

    base = grounded_prompts(min(args.num_prompts, 18)) if args.spec_workload == "grounded" else OPEN
    prompts = [base[i % len(base)] for i in range(args.num_prompts)]
    runs: dict[str, list[dict[str, object]]] = {m: [] for m in SPEC_MODES}
    for _ in range(args.rounds):
        for mode, extra in SPEC_MODES.items():
            def body(url: str) -> dict[str, object]:
                results, dur = asyncio.run(run_load(url, prompts, args.output_len, int(args.concurrency),
                                                    float("inf"), 0))
                s = summarize(results, dur, 0)
                del s["total_token_throughput"]  # prompt lengths differ: output throughput is the measure
                return s | {"metrics": scrape(url), "texts": [r.text for r in results],
                            "errors": [r.error for r in results if r.error][:5]}
            runs[mode].append(with_server(args, extra, body))
            r = runs[mode][-1]
            print(f"{mode}: {r['output_throughput']:.1f} out tok/s, {r['completed']}/{len(prompts)} ok",
                  file=sys.stderr)
    best = {m: max(rs, key=lambda r: r["output_throughput"]) for m, rs in runs.items()}
    plain = best["plain"]
    summary = {}
    for mode, r in best.items():
        m = r["metrics"]
        drafted, accepted = m.get("spec_decode_num_draft_tokens_total", 0.0), m.get(
            "spec_decode_num_accepted_tokens_total", 0.0)
        summary[mode] = {
            "output_throughput": r["output_throughput"],
            "ratio_to_plain": r["output_throughput"] / plain["output_throughput"],
            "tpot_p50_ms": r["tpot_ms"]["p50"],
            "identical_to_plain": sum(a == b for a, b in zip(r["texts"], plain["texts"], strict=True)),
            "verify_steps": m.get("spec_decode_num_verify_steps_total"),
            "skipped_steps": m.get("spec_decode_num_skipped_steps_total"),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": m.get("spec_decode_mean_accepted_length"),
        }
        print(f"best {mode}: {json.dumps(summary[mode])}", file=sys.stderr)
    # the noise floor of "identical": plain rounds against each other (batch composition moves bf16 rounding)
    plain_agree = [sum(a == b for a, b in zip(r["texts"], runs["plain"][0]["texts"], strict=True))
                   for r in runs["plain"][1:]]
    from neuron_opt.artifact import read_manifest

    dtype = read_manifest(Path(args.model), verify_hashes=False).dtype if Path(args.model).is_dir() else None
    return {"scenario": "speculative", "workload": args.spec_workload, "dtype": dtype, "requests": len(prompts),
            "concurrency": int(args.concurrency), "max_tokens": args.output_len, "runs": runs, "summary": summary,
            "plain_rounds_identical_to_first": plain_agree}


def plot_speculative(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["summary"])
    fig, ax = plt.subplots(figsize=(5.5, 4))
    vals = [report["summary"][m]["output_throughput"] for m in modes]
    ax.bar(range(len(modes)), vals, color=["#888", "#2a7", "#7a2"][: len(modes)])
    ax.set_xticks(range(len(modes)), modes)
    for i, m in enumerate(modes):
        ax.text(i, vals[i], f"{report['summary'][m]['ratio_to_plain']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("output tokens/s (whole run)")
    ax.set_title(f"{report['concurrency']} streams, {report['workload']} chat, {report['requests']} requests, "
                 f"best of {len(report['runs']['plain'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

