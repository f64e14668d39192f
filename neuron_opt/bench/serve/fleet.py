"""Data-parallel serving: replicas behind one endpoint, and prefix-aware against load-only routing in one run."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from neuron_opt.bench.serve.client import (
    free_port,
    make_prompts,
    run_load,
    start_server,
    stop_server,
    summarize,
    wait_healthy,
)


def wait_replicas(url: str, proc: subprocess.Popen, n: int, timeout: float = 600.0) -> None:
    """Until the `serve --data-parallel` router counts `n` live replicas (its /health is up as soon as one is)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode}")
        try:
            for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
                if line.startswith("neuron_opt:cluster_replicas ") and float(line.split()[1]) >= n:
                    return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{n} replicas did not come up")


def scenario_data_parallel(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """The same load (every --concurrency level) on the single-process server and on `serve --data-parallel N` for
    each N of --data-parallel, alternating --rounds times (the machine's speed drifts); the best round of each, and
    each data-parallel figure as a ratio to the single-process server's in the same run."""
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    levels = [int(c) for c in args.concurrency.split(",")]
    budget = (args.budget_flag, str(args.max_num_batched_tokens))
    modes = [("single", 0)] + [(f"dp{n}", n) for n in (int(x) for x in args.data_parallel.split(","))]
    runs: dict[str, list[list[dict[str, object]]]] = {m: [] for m, _ in modes}
    for _ in range(args.rounds):
        for mode, n in modes:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start_server(args, port, (*budget, *(("--data-parallel", str(n)) if n else ())))
            try:
                wait_healthy(url, proc)
                if n:
                    wait_replicas(url, proc, n)
                asyncio.run(run_load(url, prompts[: 2 * max(n, 1)], 4, 2 * max(n, 1), float("inf"), 0))  # warm-up
                res = []
                for c in levels:
                    results, dur = asyncio.run(run_load(url, prompts, args.output_len, c, args.request_rate,
                                                        args.seed))
                    res.append(summarize(results, dur, args.input_len) | {"concurrency": c, "errors": [
                        r.error for r in results if r.error][:5]})
                    print(f"{mode} c={c}: {res[-1]['output_throughput']:.1f} out tok/s, TTFT p50 "
                          f"{res[-1]['ttft_ms']['p50']:.0f} ms, TPOT p50 {res[-1]['tpot_ms']['p50']:.1f} ms, "
                          f"{res[-1]['completed']}/{len(results)} ok", file=sys.stderr)
            finally:
                stop_server(proc, timeout=120)
            runs[mode].append(res)
    best = {m: [max((r[i] for r in rs), key=lambda s: s["output_throughput"]) for i in range(len(levels))]
            for m, rs in runs.items()}
    ratios = {m: [{"concurrency": c, "throughput": b["output_throughput"] / s["output_throughput"],
                   "ttft_p50": b["ttft_ms"]["p50"] / s["ttft_ms"]["p50"],
                   "tpot_p50": b["tpot_ms"]["p50"] / s["tpot_ms"]["p50"]}
                  for c, b, s in zip(levels, best[m], best["single"], strict=True)] for m in best if m != "single"}
    return {"scenario": "data-parallel", "cores": len(os.sched_getaffinity(0)), "runs": runs, "best": best,
            "ratio_to_single": ratios}


def plot_data_parallel(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mode, rows in report["best"].items():
        cs = [r["concurrency"] for r in rows]
        label = "single process" if mode == "single" else f"--data-parallel {mode[2:]}"
        for ax, key in zip(axes, ("output_throughput", "ttft_ms", "tpot_ms"), strict=True):
            ax.plot(cs, [r[key] if key == "output_throughput" else r[key]["p50"] for r in rows], "o-", label=label)
    for ax, title in zip(axes, ("output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"serve vs serve --data-parallel, {report['cores']} cores, same run (best of "
                 f"{len(next(iter(report['runs'].values())))} rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def routing_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """--prefix-groups groups of --group-requests requests: each group's own --prefix-len-token system prompt,
    then a distinct --input-len-token tail per request; in waves (the i-th request of every group, group order
    shuffled per wave), so each group's first request finds its prefix nowhere and the later ones find it where
    the router sent the first."""
    rng = np.random.default_rng(args.seed)
    systems = make_prompts(args.prefix_groups, args.prefix_len, vocab, args.seed + 1)
    tails = make_prompts(args.prefix_groups * args.group_requests, args.input_len, vocab, args.seed + 2)
    prompts = []
    for i in range(args.group_requests):
        for g in rng.permutation(args.prefix_groups):
            prompts.append(systems[g] + tails[i * args.prefix_groups + g])
    return prompts


def _routing_run(url: str, args: argparse.Namespace, prompts: list[list[int]], concurrency: int,
                 vocab: int) -> dict[str, object]:
    """One load of the routing workload on a started server: latency figures, and the prefix-cache hit rate over
    this load alone (the replicas' hits / queries counters before and after, in prompt tokens)."""
    from neuron_opt.bench.cluster import routed, router_metrics, summed, wait_counted

    warm = make_prompts(4, 16, vocab, args.seed + 3)  # first calls of each replica; no prefix of the workload
    asyncio.run(run_load(url, warm, 2, len(warm), float("inf"), 0))
    before = wait_counted(url, len(warm))
    reasons_before = router_metrics(url, "reason")
    results, dur = asyncio.run(run_load(url, prompts, args.output_len, concurrency, args.request_rate, args.seed))
    after = wait_counted(url, len(warm) + len(results))
    reasons_after = router_metrics(url, "reason")
    hits = summed(after, "prefix_cache_hits_total") - summed(before, "prefix_cache_hits_total")
    queries = summed(after, "prefix_cache_queries_total") - summed(before, "prefix_cache_queries_total")
    name = "neuron_opt:cluster_routed_total"
    return summarize(results, dur, len(prompts[0])) | {
        "prefix_cache_hits": hits, "prefix_cache_queries": queries,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "routed": {r: n - routed(before).get(r, 0.0) for r, n in routed(after).items()},
        "routed_by_reason": {reason: n - reasons_before.get((name, reason), 0.0)
                             for (n_, reason), n in reasons_after.items() if n_ == name},
        "errors": [r.error for r in results if r.error][:5]}


def scenario_routing(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """`serve --data-parallel N --routing P` for each policy P of --routing, and one single-process server (the
    hit rate one replica keeps), on the prefix-group workload (routing_prompts), alternating --rounds times: the
    cluster's prefix-cache hit rate and TTFT per policy in the same run; medians of the rounds."""
    n = int(args.data_parallel)
    policies = args.routing.split(",")
    prompts = routing_prompts(args, vocab)
    concurrency = int(args.concurrency.split(",")[0])
    sized = argparse.Namespace(**{**vars(args), "input_len": len(prompts[0])})  # start_server's max model len
    budget = (args.budget_flag, str(args.max_num_batched_tokens), "--enable-prefix-caching")
    threshold = (() if args.routing_balance_threshold is None else
                 ("--routing-balance-threshold", str(args.routing_balance_threshold)))
    modes = [("single", ())] + [(f"dp{n}-{p}", ("--data-parallel", str(n), "--routing", p, *threshold))
                                for p in policies]
    runs: dict[str, list[dict[str, object]]] = {m: [] for m, _ in modes}
    for _ in range(args.rounds):
        for mode, flags in modes:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start_server(sized, port, (*budget, *flags))
            try:
                wait_healthy(url, proc)
                if flags:
                    wait_replicas(url, proc, n)
                r = _routing_run(url, args, prompts, concurrency, vocab)
            finally:
                stop_server(proc, timeout=120)
            runs[mode].append(r)
            print(f"{mode}: prefix hit rate {r['prefix_hit_rate']:.3f}, TTFT p50 {r['ttft_ms']['p50']:.0f} ms, "
                  f"{r['completed']}/{len(prompts)} ok, routed {r['routed']}", file=sys.stderr)
    summary = {m: {"prefix_hit_rate": float(np.median([r["prefix_hit_rate"] for r in rs])),
                   "prefix_hit_rate_min": min(r["prefix_hit_rate"] for r in rs),
                   "prefix_hit_rate_max": max(r["prefix_hit_rate"] for r in rs),
                   "ttft_p50_ms": float(np.median([r["ttft_ms"]["p50"] for r in rs])),
                   "ttft_p50_ms_min": min(r["ttft_ms"]["p50"] for r in rs),
                   "ttft_p50_ms_max": max(r["ttft_ms"]["p50"] for r in rs),
                   "ttft_p99_ms": float(np.median([r["ttft_ms"]["p99"] for r in rs])),
                   "output_throughput": float(np.median([r["output_throughput"] for r in rs])),
                   "completed": sum(r["completed"] for r in rs), "failed": sum(r["failed"] for r in rs)}
               for m, rs in runs.items()}
    single = summary["single"]["prefix_hit_rate"]
    for s in summary.values():
        s["hit_rate_vs_single"] = s["prefix_hit_rate"] / single if single else None
    return {"scenario": "routing", "data_parallel": n, "cores": len(os.sched_getaffinity(0)),
            "workload": {"prefix_groups": args.prefix_groups, "group_requests": args.group_requests,
                         "prefix_len": args.prefix_len, "tail_len": args.input_len, "output_len": args.output_len,
                         "concurrency": concurrency, "request_rate": str(args.request_rate),
                         # every later request of a group finding its whole prefix cached, and nothing else
                         "ideal_hit_rate": (args.group_requests - 1) * args.prefix_len
                         / (args.group_requests * len(prompts[0])),
                         "order": "waves: the i-th request of every group, groups shuffled per wave"},
            "balance_threshold": args.routing_balance_threshold, "rounds": args.rounds, "runs": runs,
            "summary": summary}


def plot_routing(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["summary"])
    labels = ["single process" if m == "single" else f"dp{report['data_parallel']} --routing {m.split('-', 1)[1]}"
              for m in modes]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in ((axes[0], "prefix_hit_rate", "prefix-cache hit rate (prompt tokens)"),
                           (axes[1], "ttft_p50_ms", "TTFT p50 (ms)")):
        vals = [report["summary"][m][key] for m in modes]
        lo = [v - report["summary"][m][f"{key}_min"] for m, v in zip(modes, vals, strict=True)]
        hi = [report["summary"][m][f"{key}_max"] - v for m, v in zip(modes, vals, strict=True)]
        ax.bar(labels, vals, yerr=[lo, hi], capsize=4, color=["#888", "#2a7", "#c52", "#27c"][: len(modes)])
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    w = report["workload"]
    fig.suptitle(f"{w['prefix_groups']} prefix groups x {w['group_requests']} requests, {w['prefix_len']}-token "
                 f"prefix + {w['tail_len']}-token tail, {report['cores']} cores (median of {report['rounds']} "
                 "rounds, min-max bars)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

