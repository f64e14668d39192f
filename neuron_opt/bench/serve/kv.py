"""Block KV cache scenarios: shared prefixes (prefix-cache hits), long prompts under a chunked-prefill budget, and
the pool's capacity against the contiguous-slot engine's for the same memory."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

from neuron_opt.bench.serve.client import (
    RequestResult,
    make_prompts,
    one_request,
    poll_running,
    run_load,
    scrape,
    summarize,
    with_server,
)


def scenario_shared_prefix(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """64 requests sharing a 1,024-token system prompt, 32 distinct tokens each, 32 out: TTFT with and without
    prefix caching, alternating `--rounds` times."""
    system = make_prompts(1, 1024, vocab, args.seed)[0]
    prompts = [system + tail for tail in make_prompts(64, 32, vocab, args.seed + 1)]
    budget = ("--max-num-batched-tokens", str(args.max_num_batched_tokens))
    runs: dict[str, list[dict[str, object]]] = {"prefix_caching": [], "no_prefix_caching": []}
    for _ in range(args.rounds):
        for mode, flag in (("no_prefix_caching", "--no-enable-prefix-caching"),
                           ("prefix_caching", "--enable-prefix-caching")):
            def body(url: str) -> dict[str, object]:
                results, dur = asyncio.run(run_load(url, prompts, 32, int(args.concurrency), float("inf"), 0))
                return summarize(results, dur, len(prompts[0])) | {"metrics": scrape(url)}
            runs[mode].append(with_server(args, (*budget, flag), body))
            r = runs[mode][-1]
            print(f"{mode}: TTFT p50 {r['ttft_ms']['p50']:.0f} ms, {r['completed']} ok", file=sys.stderr)
    best = {m: min(rs, key=lambda r: r["ttft_ms"]["p50"]) for m, rs in runs.items()}
    return {"scenario": "shared-prefix", "runs": runs, "best": best,
            "ttft_p50_ratio": best["no_prefix_caching"]["ttft_ms"]["p50"] / best["prefix_caching"]["ttft_ms"]["p50"]}


def scenario_long_prompts(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """16 streams decoding (in 128 / out 256) while 2,048-token prompts (16 out) arrive every 3 s: the streams'
    TPOT and inter-token latency with chunked prefill (token budget --max-num-batched-tokens) and without (each
    prompt prefilled whole in one step)."""
    streams = make_prompts(16, 128, vocab, args.seed)
    longs = make_prompts(4, 2048, vocab, args.seed + 2)

    async def load(url: str) -> tuple[list[RequestResult], list[RequestResult]]:
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
            s_tasks = [asyncio.create_task(one_request(client, url, i, p, 256)) for i, p in enumerate(streams)]
            l_tasks = [asyncio.create_task(one_request(client, url, 100 + i, p, 16, delay=3.0 * (i + 1)))
                       for i, p in enumerate(longs)]
            return list(await asyncio.gather(*s_tasks)), list(await asyncio.gather(*l_tasks))

    runs: dict[str, list[dict[str, object]]] = {"chunked": [], "not_chunked": []}
    for _ in range(args.rounds):
        for mode, extra in (("not_chunked", ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048")),
                            ("chunked", ("--enable-chunked-prefill", "--max-num-batched-tokens",
                                         str(args.max_num_batched_tokens)))):
            def body(url: str, budget: str = extra[-1]) -> dict[str, object]:
                t0 = time.perf_counter()
                s_res, l_res = asyncio.run(load(url))
                dur = time.perf_counter() - t0
                return {"streams": summarize(s_res, dur, 128), "long_prompts": summarize(l_res, dur, 2048),
                        "budget": budget}
            runs[mode].append(with_server(args, extra, body))
            r = runs[mode][-1]["streams"]
            print(f"{mode}: streams TPOT p99 {r['tpot_ms']['p99']:.1f} ms, ITL p99 {r['itl_ms']['p99']:.0f} ms, "
                  f"{r['completed']} ok", file=sys.stderr)
    best = {m: min(rs, key=lambda r: r["streams"]["itl_ms"]["p99"]) for m, rs in runs.items()}
    c, n = best["chunked"]["streams"], best["not_chunked"]["streams"]
    return {"scenario": "long-prompts", "runs": runs, "best": best,
            "tpot_p99_ratio": c["tpot_ms"]["p99"] / n["tpot_ms"]["p99"],
            "itl_p99_ratio": c["itl_ms"]["p99"] / n["itl_ms"]["p99"]}


def scenario_capacity(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """64 requests whose total lengths are uniform in 32..1,024 (prompt + 32 out), all at once, on an artifact whose
    KV pool is a fixed memory: how many run concurrently, against the contiguous-slot engine's count for the same
    memory (pool positions // max_model_len: each of its slots held a whole max_model_len)."""
    from neuron_opt.artifact import read_manifest

    cache = read_manifest(Path(args.model), verify_hashes=False).cache
    rng = np.random.default_rng(args.seed)
    totals = rng.integers(32, 1025, size=64)
    prompts = [rng.integers(100, vocab, size=int(t) - 32).tolist() if t > 32 else [100] for t in totals]

    def body(url: str) -> dict[str, object]:
        async def go() -> tuple[list[RequestResult], float, list[float]]:
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_running(url, stop))
            results, dur = await run_load(url, prompts, 32, 64, float("inf"), 0)
            stop.set()
            return results, dur, await poller
        results, dur, running = asyncio.run(go())
        busy = [x for x in running if x > 0]
        return summarize(results, dur, int(totals.mean()) - 32) | {
            "running_max": max(running), "running_mean": float(np.mean(busy)) if busy else 0.0,
            "metrics": scrape(url)}

    res = with_server(args, ("--max-num-batched-tokens", str(args.max_num_batched_tokens)), body)
    contiguous = (cache.num_blocks - 1) * cache.block_size // cache.max_model_len
    print(f"capacity: {res['running_max']:.0f} running at most (mean {res['running_mean']:.1f}) vs {contiguous} "
          f"contiguous slots of {cache.max_model_len}", file=sys.stderr)
    return {"scenario": "capacity", "pool_blocks": cache.num_blocks, "block_size": cache.block_size,
            "max_model_len": cache.max_model_len, "contiguous_slots_same_memory": contiguous, "run": res,
            "capacity_ratio_max": res["running_max"] / contiguous,
            "capacity_ratio_mean": res["running_mean"] / contiguous}

