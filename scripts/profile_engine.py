#!/usr/bin/env python
"""Where a serving step's time goes, engine side: the engine on its own thread as `serve` runs it (no HTTP), N
streams of distinct prompts, and per step the wall time in the graph calls, sampling, output processing
(detokenizing, stop checks, callbacks) and the rest (scheduling, glue), from the engine's counters
(runtime/engine.py, EngineStats); the prefill tokens the graphs ran against the prompt tokens (padding); and
the process's CPU seconds per output token (every thread: OpenMP workers waiting by spinning count).

    python scripts/profile_engine.py ARTIFACT --streams 1,8 --input-len 155 --output-len 64 --json
    NEURON_OPT_THREAD_POLICY=reserve python scripts/profile_engine.py ARTIFACT --streams 1,8
    python scripts/profile_engine.py ARTIFACT --streams 1 --keep-loading-workers   # as `serve` ran before the hand-over

Without --threads the torch threads follow `serve`'s policy (NEURON_OPT_NUM_THREADS, NEURON_OPT_THREAD_POLICY).

CPU seconds and padding counts are meaningful on a busy machine; wall times are not (docs/serving.md, "Where a
step's time goes"). The HTTP side is not in it: `scripts/bench_serve.py` measures the server end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


def run_level(engine, prompts: list[list[int]], streams: int, output_len: int) -> dict:  # noqa: ANN001
    """Keep `streams` requests in flight until every prompt is served; timings from the engine's callbacks."""
    import torch

    from neuron_opt.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0.0)
    done = threading.Semaphore(0)
    sent: dict[int, float] = {}
    times: dict[int, list[float]] = {i: [] for i in range(len(prompts))}

    def on_output(o, i: int) -> None:  # noqa: ANN001
        times[i].extend([time.perf_counter()] * len(o.new_token_ids))
        if o.finished:
            done.release()

    st = engine.stats
    before = (st.steps, len(st.step_times), st.graph_s, st.sample_s, st.output_s, st.prefill_tokens,
              st.prefill_graph_tokens)
    cpu0, t0 = time.process_time(), time.perf_counter()
    nxt = 0
    for _ in range(min(streams, len(prompts))):
        sent[nxt] = time.perf_counter()
        engine.add_request(str(nxt), prompts[nxt], params, lambda o, i=nxt: on_output(o, i))
        nxt += 1
    for _ in range(len(prompts)):
        done.acquire()
        if nxt < len(prompts):
            sent[nxt] = time.perf_counter()
            engine.add_request(str(nxt), prompts[nxt], params, lambda o, i=nxt: on_output(o, i))
            nxt += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steps = st.steps - before[0]
    step_s = sum(st.step_times[before[1]:])
    graph, sample, output = st.graph_s - before[2], st.sample_s - before[3], st.output_s - before[4]
    tokens = sum(len(t) for t in times.values())
    ttft = [times[i][0] - sent[i] for i in times]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    ms = 1e3 / max(steps, 1)
    return {"streams": streams, "requests": len(prompts), "output_tok_s": tokens / wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttft), "tpot_p50_ms": 1e3 * statistics.median(tpot),
            "steps": steps, "step_ms": step_s * ms, "graph_ms": graph * ms, "sample_ms": sample * ms,
            "output_ms": output * ms, "other_ms": (step_s - graph - sample - output) * ms,
            "prefill_tokens": st.prefill_tokens - before[5],
            "prefill_graph_tokens": st.prefill_graph_tokens - before[6],
            "cpu_s_per_token": cpu / tokens, "cpu_utilization": cpu / wall, "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--streams", default="1,8", help="concurrent streams, comma-separated")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: 4 x streams, at least 4)")
    p.add_argument("--input-len", type=int, default=155)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None,
                   help="a fixed torch thread count (default: serve's thread policy, from the environment)")
    p.add_argument("--prefill-granularity", type=int, default=None,
                   help="pad prefills to a multiple of this many tokens (0: to the compiled prefill buckets, as on "
                        "backends without dynamic prefill graphs; default: the executor's own)")
    p.add_argument("--keep-loading-workers", action="store_true",
                   help="skip the hand-over of threads to the engine (runtime/threads.hand_threads_to_engine): the "
                        "loading thread keeps its OpenMP workers and the engine thread its inherited count, to measure "
                        "what the hand-over is for (docs/serving.md, \"Threads\")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads: must be >= 1, got {args.threads}")
    if args.prefill_granularity is not None and args.prefill_granularity < 0:
        p.error(f"--prefill-granularity: must be >= 0, got {args.prefill_granularity}")

    import torch

    from neuron_opt import envs
    from neuron_opt.api import LLM
    from neuron_opt.commands.serve import thread_policy
    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.threads import hand_threads_to_engine

    policy = None if args.threads is not None or envs.NUM_THREADS is not None else thread_policy()
    threads = args.threads or envs.NUM_THREADS or policy.threads
    torch.set_num_threads(threads)
    llm = LLM(args.artifact)
    if args.prefill_granularity is not None:
        if args.prefill_granularity and not llm.runner.prefill_granularity:
            p.error("--prefill-granularity: this artifact's executor runs only its compiled prefill lengths")
        llm.runner.prefill_granularity = args.prefill_granularity
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, max_num_batched_tokens=2048)
    if not args.keep_loading_workers:
        hand_threads_to_engine(engine.runners, threads)  # as `serve` does
    engine.start()
    levels = []
    try:
        run_level(engine, _prompts(2, args.input_len, llm.runner.vocab_size, args.seed + 99), 2, 4)  # warm-up
        for i, s in enumerate(int(x) for x in args.streams.split(",")):
            n = args.requests or max(4, 4 * s)
            levels.append(run_level(engine, _prompts(n, args.input_len, llm.runner.vocab_size, args.seed + i), s,
                                    args.output_len))
    finally:
        engine.stop()
    doc = {"artifact": str(args.artifact), "input_len": args.input_len, "output_len": args.output_len,
           "threads": threads, "policy": None if policy is None else policy.name,
           "keep_loading_workers": args.keep_loading_workers,
           "prefill_granularity": llm.runner.prefill_granularity,
           "env": {k: os.environ.get(k) for k in ("NEURON_OPT_NUM_THREADS", "NEURON_OPT_THREAD_POLICY",
                                                  "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
           "cores": len(os.sched_getaffinity(0)), "loadavg_1m": os.getloadavg()[0], "levels": levels}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{args.artifact}: {args.input_len}-token prompts, {args.output_len} tokens each; "
          f"policy {doc['policy']}, threads {threads}, prefill granularity {doc['prefill_granularity']}, "
          f"load average {doc['loadavg_1m']:.2f}")
    for r in levels:
        print(f"{r['streams']:>3} streams: {r['output_tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
              f"TPOT p50 {r['tpot_p50_ms']:6.2f} ms | per step {r['step_ms']:6.2f} ms = graph {r['graph_ms']:6.2f} "
              f"+ sample {r['sample_ms']:.2f} + output {r['output_ms']:.2f} + other {r['other_ms']:.2f} | prefill "
              f"{r['prefill_graph_tokens']}/{r['prefill_tokens']} graph/prompt tokens | "
              f"{1e3 * r['cpu_s_per_token']:.2f} CPU ms/token, {r['cpu_utilization']:.2f} cores busy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
