"""The structured-outputs scenario: free text against JSON-schema and regex constrained requests on the same
prompts, every constrained output validated."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

from neuron_opt.bench.serve.client import run_load, summarize, with_server

# a schema as pydantic writes one (strings without lengths), whose answers run long (eight records), so TPOT is
# measured over many constrained steps
PEOPLE_SCHEMA = {"type": "object", "properties": {"people": {
    "type": "array", "minItems": 8, "maxItems": 8, "items": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "city": {"type": "string"}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}


STRUCTURED_MODES = {
    "free": {"ignore_eos": True},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "people",
                                                                               "schema": PEOPLE_SCHEMA}}},
}


def scenario_structured(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """Chat requests answered freely (ignore_eos, --output-len tokens) and under a JSON schema (eight records,
    ending with the grammar or at --output-len), on one server, at each --concurrency level, the two modes
    alternating in order over --rounds rounds. TPOT p50 of each round; the medians' ratio is the cost of the
    grammar per token. Every constrained answer that ended with the grammar (finish_reason "stop") is validated
    (jsonschema); the count of answers cut at --output-len is reported beside it."""
    import jsonschema

    prompts = [f"List eight people (name, age, city) as JSON. Batch {i}." for i in range(args.num_prompts)]
    levels = [int(c) for c in args.concurrency.split(",")]
    runs: dict[str, dict[int, list[dict[str, object]]]] = {m: {c: [] for c in levels} for m in STRUCTURED_MODES}

    def body(url: str) -> None:
        for r in range(args.rounds):
            for c in levels:
                modes = list(STRUCTURED_MODES) if r % 2 == 0 else list(reversed(STRUCTURED_MODES))
                for mode in modes:
                    results, dur = asyncio.run(run_load(url, prompts, args.output_len, c, float("inf"), 0,
                                                        STRUCTURED_MODES[mode]))
                    s = summarize(results, dur, 0)
                    if mode == "json_schema":
                        ended = [r for r in results if r.ok and r.finish_reason == "stop"]
                        s["ended_by_grammar"] = len(ended)
                        s["valid"] = sum(_validates(r.text, PEOPLE_SCHEMA, jsonschema) for r in ended)
                    s["errors"] = [x.error for x in results if x.error][:5]
                    runs[mode][c].append(s)
                    print(f"round {r} c={c} {mode}: TPOT p50 {s['tpot_ms']['p50']:.2f} ms, "
                          f"{s['output_throughput']:.1f} out tok/s, {s['completed']}/{len(prompts)} ok",
                          file=sys.stderr)

    with_server(args, (args.budget_flag, str(args.max_num_batched_tokens)), body)
    summary = {}
    for c in levels:
        med = {m: float(np.median([s["tpot_ms"]["p50"] for s in runs[m][c]])) for m in STRUCTURED_MODES}
        summary[str(c)] = {
            "tpot_p50_ms": {m: {"median": med[m], "min": min(s["tpot_ms"]["p50"] for s in runs[m][c]),
                                "max": max(s["tpot_ms"]["p50"] for s in runs[m][c])} for m in STRUCTURED_MODES},
            "ratio_json_schema_to_free": med["json_schema"] / med["free"],
            "json_schema_ended_by_grammar": f"{sum(s['ended_by_grammar'] for s in runs['json_schema'][c])} of "
                                            f"{sum(s['completed'] for s in runs['json_schema'][c])}",
            "json_schema_valid": f"{sum(s['valid'] for s in runs['json_schema'][c])} of "
                                 f"{sum(s['ended_by_grammar'] for s in runs['json_schema'][c])} that ended",
        }
        print(f"c={c}: {json.dumps(summary[str(c)])}", file=sys.stderr)
    return {"scenario": "structured", "model": str(args.model), "requests_per_run": len(prompts),
            "max_tokens": args.output_len, "rounds": args.rounds, "schema": PEOPLE_SCHEMA, "runs": runs,
            "summary": summary}


def _validates(text: str, schema: dict, jsonschema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def plot_structured(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(report["summary"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, mode in enumerate(STRUCTURED_MODES):
        t = [report["summary"][c]["tpot_p50_ms"][mode] for c in levels]
        ax.bar([i + 0.4 * k for i in range(len(levels))], [x["median"] for x in t], width=0.4, label=mode,
               yerr=[[x["median"] - x["min"] for x in t], [x["max"] - x["median"] for x in t]], capsize=3)
    ax.set_xticks([i + 0.2 for i in range(len(levels))], [f"{c} stream(s)" for c in levels])
    ax.set_ylabel("TPOT p50 (ms), median of rounds")
    ax.set_title(f"JSON schema vs free decoding ({report['machine']['cpu']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)

