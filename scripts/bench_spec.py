#!/usr/bin/env python
"""Speculative decoding (prompt lookup, a draft model) against plain decoding, side by side in one run, on one
artifact.

Workloads (the default model, chat template, greedy):
- grounded: "repeat / edit this text" over a ~300-token paragraph or code block: the answer copies the prompt,
  which prompt lookup predicts;
- open-ended: story / explanation prompts: little to copy.
For each workload and batch size: output tokens/s with speculation off, on with the adaptive controller, and on
with the controller disabled (always verify), the same two with a draft model's proposals when
`--speculative-model` names one (`draft-adaptive`, `draft-always`), the greedy outputs of every mode compared
token for token with plain decoding's, and the speculation counters. Answers end at EOS (or --max-tokens):
forcing a fixed length would time the text a model
makes up after its answer, which nothing grounds. Greedy outputs are identical in float32 (same tokens, same
work); in bfloat16 the verify graph's GEMMs (k + 1 rows) round differently from the decode graph's (1 row), so a
near-tie can flip and the texts diverge from there (`first_divergence`; the token counts then differ too).
Batch 1 runs `LLM.generate_ids` (plain) and the engine (speculative); batch > 1 runs the engine for all three,
every request admitted at once. The peer in the same run: HF transformers eager with and without its own prompt
lookup (`generate(prompt_lookup_num_tokens=k)`) on the grounded prompts at batch 1 (when --batches has 1), in the
artifact's dtype and in fp32 (`--hf-dtype`). HF's modes are taken like ours: warmed up, interleaved with our modes
in every one of the `--repeats` rounds, the best round reported.

The machine is checked for idleness before the run and watched over it (neuron_opt.bench); the JSON records the
machine (CPU model, ISA flags, cores, a bandwidth probe, torch) and the verdict; `--require-idle` refuses a busy
machine.

    python scripts/bench_spec.py --artifact artifacts/spec --out docs/bench/spec.json --plot docs/bench/spec.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuron_opt.bench import MachineBusyError, RunRecord  # noqa: E402 (after the sys.path line)
from neuron_opt.bench.spec_workloads import GROUNDED, OPEN  # noqa: E402


def run_plain_b1(llm, prompts, params):
    outs, t0 = [], time.perf_counter()
    for p in prompts:
        outs.append(llm.generate_ids(p, params).token_ids)
    return outs, time.perf_counter() - t0, None


def run_engine(llm, prompts, params, spec, draft=None):
    from neuron_opt.runtime.engine import Engine

    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, max_num_seqs=len(prompts), speculative=spec,
                    draft=draft if spec is not None and spec.method == "draft_model" else None)
    outs: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, outs[str(i)].append)
    while engine.num_unfinished:
        engine.step()
    dt = time.perf_counter() - t0
    toks = [[t for o in outs[str(i)] for t in o.new_token_ids] for i in range(len(prompts))]
    return toks, dt, engine.spec_stats


def bench_ours(args, llm, name, prompts, batch, peers=()):
    """Our modes on `prompts` at `batch`, and `peers` ((mode, fn(prompt ids) -> (tokens, seconds)), HF's) in
    the same rounds: best of --repeats rounds per mode, modes interleaved within each round."""
    from neuron_opt.runtime.sampling import SamplingParams
    from neuron_opt.runtime.speculative import SpeculativeConfig

    k = llm.runner.buckets.num_speculative_tokens
    params = SamplingParams(max_tokens=args.max_tokens)  # answers end at EOS, as they would in service
    ids = [llm.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    groups = [ids[i: i + batch] for i in range(0, len(ids), batch)]
    rows = []
    modes = [("plain", None), ("spec-adaptive", SpeculativeConfig(k)),
             ("spec-always", SpeculativeConfig(k, adaptive=False))]
    draft = None
    if args.speculative_model:  # a draft model: its own modes, on its own runner (KV slots for the batch)
        draft = llm.draft(args.speculative_model, batch).runner
        modes += [("draft-adaptive", SpeculativeConfig(k, "draft_model", model=args.speculative_model)),
                  ("draft-always", SpeculativeConfig(k, "draft_model", adaptive=False, model=args.speculative_model))]
    unknown = set(args.modes) - {m for m, _ in modes} if args.modes else set()
    if unknown:
        raise SystemExit(f"--modes: {sorted(unknown)} not among {[m for m, _ in modes]}")
    modes = [(m, spec) for m, spec in modes if not args.modes or m in args.modes or m == "plain"]
    results = {}
    best: dict[str, tuple[float, list, object]] = {}
    for _ in range(args.repeats):  # modes interleaved within each repeat: the VM's speed drifts (docs/benchmarks.md)
        for mode, spec in modes:
            all_toks, total, agg = [], 0.0, None
            for g in groups:
                if spec is None and batch == 1:
                    t, dt, st = run_plain_b1(llm, g, params)
                else:
                    t, dt, st = run_engine(llm, g, params, spec, draft)
                all_toks += t
                total += dt
                agg = st if agg is None or st is None else _add(agg, st)
            if mode not in best or total < best[mode][0]:
                best[mode] = (total, all_toks, agg)
        for mode, fn in peers:
            toks, total = fn(ids)
            if mode not in best or total < best[mode][0]:
                best[mode] = (total, toks, None)
    dtype = llm.runner.cache.dtype
    for mode, _ in modes:
        seconds, toks, stats = best[mode]
        n = sum(len(t) for t in toks)
        results[mode] = toks
        row = {"workload": name, "batch": batch, "mode": mode, "dtype": dtype, "k": k, "output_tokens": n,
               "seconds": round(seconds, 3), "tok_s": round(n / seconds, 2), "rounds": args.repeats}
        if stats is not None:
            row.update(verify_steps=stats.verify_steps, drafts=stats.drafts, draft_tokens=stats.draft_tokens,
                       accepted_tokens=stats.accepted_tokens, skipped_steps=stats.skipped_steps,
                       mean_accepted_length=round(stats.mean_accepted_length, 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    for r in rows:
        r["identical_to_plain"] = results[r["mode"]] == results["plain"]
        # where each request's tokens first differ from plain decoding's (None: identical)
        r["first_divergence"] = [_divergence(x, y) for x, y in zip(results[r["mode"]], results["plain"], strict=True)]
        r["speedup_vs_plain"] = round(r["tok_s"] / rows[0]["tok_s"], 3)
    for mode, _fn in peers:
        seconds, toks, _stats = best[mode]
        n = sum(len(t) for t in toks)
        hf_k = k if "prompt-lookup" in mode else 0
        rows.append({"workload": name, "batch": batch, "mode": mode, "dtype": mode.rsplit("-", 1)[1], "k": hf_k,
                     "output_tokens": n, "seconds": round(seconds, 3), "tok_s": round(n / seconds, 2),
                     "rounds": args.repeats, "speedup_vs_plain": round(n / seconds / rows[0]["tok_s"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _divergence(x: list[int], y: list[int]) -> int | None:
    """The first index where two token lists differ (None when equal)."""
    if x == y:
        return None
    return next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))


def _add(a, b):
    from dataclasses import fields

    out = type(a)()
    for f in fields(a):
        setattr(out, f.name, getattr(a, f.name) + getattr(b, f.name))
    return out


def hf_peers(args, dtypes: list[str], k: int):
    """HF transformers eager, greedy, batch 1, with and without prompt lookup (its own implementation), once per
    dtype: [(mode, fn(prompt ids) -> (generated ids per prompt, seconds))], each model loaded and warmed up."""
    import torch
    import transformers

    from neuron_opt.checkpoint import default_model_path

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    peers = []
    for dtype in dtypes:
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=getattr(torch, dtype)).eval()

        def gen(p: list[int], n: int, extra: dict, model=model) -> list[int]:
            with torch.inference_mode():
                out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                     pad_token_id=tok.eos_token_id, **extra)
            return out[0, len(p):].tolist()

        for mode, extra in (("hf-plain", {}), ("hf-prompt-lookup", {"prompt_lookup_num_tokens": k})):
            gen(tok.encode("Hello"), 4, extra)  # warm-up: first-call allocations and lazy initialisation

            def timed(ids: list[list[int]], gen=gen, extra=extra) -> tuple[list[list[int]], float]:
                t0 = time.perf_counter()
                toks = [gen(p, args.max_tokens, extra) for p in ids]
                return toks, time.perf_counter() - t0

            peers.append((f"{mode}-{dtype}", timed))
    return peers


def plot(doc, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    panels = sorted({(r["workload"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (w, b) in zip(axes[0], panels, strict=True):
        sel = [r for r in rows if r["workload"] == w and r["batch"] == b]
        ax.bar(range(len(sel)), [r["tok_s"] for r in sel],
               color=["#888" if r["mode"].startswith("hf") else "#2a7" for r in sel])
        ax.set_xticks(range(len(sel)), [r["mode"] for r in sel], rotation=30, ha="right")
        plain = next(r for r in sel if r["mode"] == "plain")["tok_s"]
        for i, r in enumerate(sel):
            ax.text(i, r["tok_s"], f"{r['tok_s'] / plain:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{w}, batch {b}")
        ax.set_ylabel("output tokens/s")
    fig.suptitle(f"speculative decoding, {doc['artifact']} ({doc['machine']['cpu']}, {doc['threads']} threads)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="an artifact compiled with --num-speculative-tokens K")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3,
                    help="best of N per mode, modes (HF's too) interleaved (default 3)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    ap.add_argument("--hf-dtype", choices=("artifact", "float32", "both"), default="both",
                    help="the HF peer's dtype: the artifact's, float32, or both (default; one when they are equal)")
    ap.add_argument("--require-idle", action="store_true",
                    help="refuse to run, or to write results, when the machine is not idle (else: a warning in "
                         "the JSON)")
    ap.add_argument("--speculative-model", default=None, metavar="PATH|ARTIFACT",
                    help="also time a draft model's proposals (modes draft-adaptive, draft-always)")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=None,
                    help="comma list of modes besides plain (default: all: spec-adaptive, spec-always, and the "
                         "draft modes with --speculative-model)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    try:
        return run(args)
    except MachineBusyError as e:
        print(f"bench_spec: {e}", file=sys.stderr)
        return 3


def run(args) -> int:
    import torch

    record = RunRecord(args.require_idle)
    if args.threads:
        torch.set_num_threads(args.threads)
    from neuron_opt.api import LLM

    llm = LLM(args.artifact)
    if not llm.runner.verify_len:
        raise SystemExit(f"{args.artifact} has no verify graphs: compile it with --num-speculative-tokens K")
    dtype = llm.runner.cache.dtype
    hf_dtypes = {"artifact": [dtype], "float32": ["float32"], "both": list(dict.fromkeys([dtype, "float32"]))}
    batches = [int(x) for x in args.batches.split(",")]
    k = llm.runner.buckets.num_speculative_tokens
    peers = [] if args.no_hf or 1 not in batches else hf_peers(args, hf_dtypes[args.hf_dtype], k)
    results = []
    for b in batches:
        for name, prompts in (("grounded", GROUNDED), ("open-ended", OPEN)):
            results += bench_ours(args, llm, name, prompts, b, peers if (name, b) == ("grounded", 1) else ())
    doc = {"artifact": str(args.artifact), **record.finish(), "threads": torch.get_num_threads(),
           "dtype": dtype, "max_tokens": args.max_tokens, "repeats": args.repeats, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
