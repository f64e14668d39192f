"""Multi-LoRA serving (`--scenario lora`): random PEFT adapters made on HF's model of the same weights, loaded
through /v1/load_lora_adapter; the base model alone against a mix over the adapters."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

from neuron_opt.bench.serve.client import (
    free_port,
    load_hf_model,
    make_prompts,
    over_rounds,
    run_load,
    start_server,
    stop_server,
    summarize,
    wait_healthy,
)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapters(hf_model: str, out: Path, n: int, rank: int, seed: int) -> list[Path]:
    """`n` PEFT LoRA adapters of rank `rank` on every projection of HF transformers' model of `hf_model`, each saved
    with `save_pretrained` under out/lora<k>: peft's `init_lora_weights=False` initialisation (nn.Linear's, random A
    and B), redrawn with seed + k for each adapter, so each one changes the model's output."""
    import math

    import peft
    import torch

    model = peft.get_peft_model(load_hf_model(hf_model), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0, init_lora_weights=False))
    paths = []
    for k in range(n):
        torch.manual_seed(seed + k)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_A." in name or ".lora_B." in name:
                    torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5))  # nn.Linear's weight initialisation
        model.save_pretrained(out / f"lora{k}")
        paths.append(out / f"lora{k}")
    return paths


def check_lora_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--scenario lora's flags, checked before anything runs (a usage error naming the flag): --model an artifact
    compiled with --enable-lora from the weights of --hf-model (default: the default GGUF), and the adapters'
    count and rank within its capacity. Parsed values go into args.lora_*."""
    from neuron_opt.artifact import read_manifest
    from neuron_opt.checkpoint import open_checkpoint
    from neuron_opt.errors import NeuronOptError

    if not (Path(args.model) / "manifest.json").is_file():
        p.error(f"--scenario lora: --model must be an artifact compiled with --enable-lora, got {args.model!r}")
    try:
        m = read_manifest(Path(args.model), verify_hashes=False)
    except (OSError, NeuronOptError) as e:
        p.error(f"--model {args.model}: not a readable artifact ({e})")
    if m.lora is None:
        p.error(f"--model {args.model}: compiled without --enable-lora (compile it with --enable-lora --max-loras 4 "
                "--max-lora-rank 16)")
    args.lora_capacity = m.lora
    args.lora_rank = m.lora.max_lora_rank if args.lora_rank is None else args.lora_rank
    args.lora_adapters = m.lora.max_loras if args.lora_adapters is None else args.lora_adapters
    if not 1 <= args.lora_rank <= m.lora.max_lora_rank:
        p.error(f"--lora-rank: must be in 1..{m.lora.max_lora_rank} (the artifact's --max-lora-rank), got "
                f"{args.lora_rank}")
    if args.lora_adapters < 1:
        p.error(f"--lora-adapters: must be >= 1, got {args.lora_adapters}")
    if set(m.lora.target_modules) != set(LORA_TARGETS):
        p.error(f"--model {args.model}: compiled for --lora-target-modules {' '.join(m.lora.target_modules)}; the "
                "scenario's adapters target every projection (compile without --lora-target-modules)")
    args.lora_hf_model = args.hf_model or "default"
    if m.source.get("weights_sha256") != open_checkpoint(args.lora_hf_model).weights_fingerprint():
        p.error(f"--model {args.model}: compiled from {m.source.get('model')}, not from --hf-model "
                f"{args.lora_hf_model}, whose HF model the adapters are made on")


def scenario_lora(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """One server on an --enable-lora artifact: --lora-adapters random PEFT adapters (make_lora_adapters) loaded
    through `POST /v1/load_lora_adapter` (its wall time; the first request under each then writes its cold slot,
    whose TTFT is recorded beside a base request's), then, at every --concurrency level, the same prompts served
    on the base model alone and as a mix (request i under adapter i mod (n + 1), the last share the base model),
    the two alternating in order over --rounds rounds; medians with min-max, and the mixed / base ratios per level
    (throughput, TPOT) over the medians and per round."""
    import httpx

    from neuron_opt.artifact import read_manifest

    manifest = read_manifest(Path(args.model), verify_hashes=False)
    work = Path(tempfile.mkdtemp(prefix="bench-serve-lora-"))
    try:
        t0 = time.perf_counter()
        paths = make_lora_adapters(args.lora_hf_model, work, args.lora_adapters, args.lora_rank, args.seed)
        made_s = time.perf_counter() - t0
        names = [p.name for p in paths]
        mix = [*names, "bench"]  # "bench": the served (base) model's name
        prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
        levels = [int(c) for c in args.concurrency.split(",")]
        runs: dict[str, dict[int, list[dict[str, object]]]] = {m: {c: [] for c in levels} for m in ("base", "mixed")}
        loads: list[dict[str, object]] = []
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        # no prefix caching: the rounds repeat the prompts, which base-model requests would find cached and requests
        # under an adapter never do (their blocks are keyed by adapter)
        proc = start_server(args, port, (args.budget_flag, str(args.max_num_batched_tokens),
                                         "--no-enable-prefix-caching"))
        try:
            wait_healthy(url, proc)
            asyncio.run(run_load(url, prompts[:1], 4, 1, float("inf"), args.seed))  # warm-up, base model

            def first(model: str) -> float:
                r = asyncio.run(run_load(url, [prompts[0]], 4, 1, float("inf"), args.seed, models=[model]))[0][0]
                if not r.ok:
                    raise SystemExit(f"a request under {model} failed: {r.error}")
                return r.ttft * 1000.0

            for name, path in zip(names, paths, strict=True):
                t = time.perf_counter()
                resp = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                                  timeout=600)
                load_s = time.perf_counter() - t
                if resp.status_code != 200:
                    raise SystemExit(f"load_lora_adapter {name}: HTTP {resp.status_code}: {resp.text}")
                loads.append({"lora_name": name, "load_s": load_s, "first_request_ttft_ms": first(name)})
                print(f"{name}: loaded in {1000 * load_s:.0f} ms, first request TTFT "
                      f"{loads[-1]['first_request_ttft_ms']:.0f} ms (its slot written)", file=sys.stderr)
            base_ttft = first("bench")
            for rnd in range(1, args.rounds + 1):
                for c in levels:
                    for mode in ("base", "mixed") if rnd % 2 else ("mixed", "base"):
                        models = ["bench" if mode == "base" else mix[i % len(mix)] for i in range(len(prompts))]
                        results, dur = asyncio.run(run_load(url, prompts, args.output_len, c, args.request_rate,
                                                            args.seed, models=models))
                        s = summarize(results, dur, args.input_len) | {
                            "round": rnd, "concurrency": c, "errors": [r.error for r in results if r.error][:5]}
                        runs[mode][c].append(s)
                        print(f"round {rnd} c={c} {mode}: {s['output_throughput']:.1f} out tok/s, TPOT p50 "
                              f"{s['tpot_ms']['p50']:.1f} ms, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
                              f"{s['completed']}/{len(results)} ok", file=sys.stderr)
            # requests per adapter, adapters loaded and resident
            metrics = [ln for ln in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                       if ln.startswith("neuron_opt:lora_") and "_created{" not in ln]
        finally:
            stop_server(proc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for c in levels:
        base, mixed = over_rounds(runs["base"][c]), over_rounds(runs["mixed"][c])
        summary[str(c)] = {
            "base": {k: v for k, v in base.items() if k != "rounds"},
            "mixed": {k: v for k, v in mixed.items() if k != "rounds"},
            "throughput_ratio_mixed_to_base": mixed["output_throughput"] / base["output_throughput"],
            "throughput_ratio_rounds": [m["output_throughput"] / b["output_throughput"]
                                        for m, b in zip(runs["mixed"][c], runs["base"][c], strict=True)],
            "tpot_p50_ratio_mixed_to_base": mixed["tpot_ms"]["p50"] / base["tpot_ms"]["p50"],
        }
        print(f"c={c}: mixed / base output throughput {summary[str(c)]['throughput_ratio_mixed_to_base']:.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in summary[str(c)]['throughput_ratio_rounds'])}), TPOT p50 "
              f"{summary[str(c)]['tpot_p50_ratio_mixed_to_base']:.3f}x", file=sys.stderr)
    return {"scenario": "lora", "model": str(args.model), "dtype": manifest.dtype,
            "quantize": manifest.quant.method,
            "lora_capacity": args.lora_capacity.to_dict(), "adapters": len(names), "adapter_rank": args.lora_rank,
            "adapter_targets": list(LORA_TARGETS), "adapters_made_s": made_s,
            "mix": "request i under adapter i mod (adapters + 1); the last share runs the base model",
            "prompts": len(prompts), "input_len": args.input_len, "output_len": args.output_len,
            "rounds": args.rounds, "adapter_loads": loads, "base_first_request_ttft_ms": base_ttft,
            "runs": {m: {str(c): rs for c, rs in by.items()} for m, by in runs.items()}, "summary": summary,
            "lora_metrics": metrics,
            "config": {k: str(v) for k, v in vars(args).items()}}


def plot_lora(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(report["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for k, mode in enumerate(("base", "mixed")):
        rows = [report["summary"][c][mode] for c in levels]
        xs = [i + 0.4 * k for i in range(len(levels))]
        thr = [r["output_throughput"] for r in rows]
        err = [[v - r["output_throughput_min"] for v, r in zip(thr, rows, strict=True)],
               [r["output_throughput_max"] - v for v, r in zip(thr, rows, strict=True)]]
        label = "base model only" if mode == "base" else f"mixed: {report['adapters']} adapters + base"
        bars = axes[0].bar(xs, thr, width=0.4, yerr=err, capsize=3, label=label)
        axes[0].bar_label(bars, fmt="%.1f", fontsize=8)
        bars = axes[1].bar(xs, [r["tpot_ms"]["p50"] for r in rows], width=0.4, label=label)
        axes[1].bar_label(bars, fmt="%.1f", fontsize=8)
    ticks = [f"{c} stream(s)\n{report['summary'][c]['throughput_ratio_mixed_to_base']:.2f}x" for c in levels]
    for ax, title in zip(axes, (f"output tok/s, median of {report['rounds']} rounds (min-max)", "TPOT p50 (ms)"),
                         strict=True):
        ax.set_xticks([i + 0.2 for i in range(len(levels))], ticks)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"multi-LoRA: rank {report['adapter_rank']} adapters on every projection, {report['dtype']} "
                 f"artifact, in {report['input_len']} / out {report['output_len']} ({report['machine']['cpu']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

