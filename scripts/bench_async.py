#!/usr/bin/env python
"""Async scheduling against the synchronous engine loop, in one run: serving TPOT and the host time per decode
step at each stream count, the two loops interleaved round by round.

    python scripts/bench_async.py ARTIFACT --streams 1,8 --rounds 3 --out docs/bench/async_scheduling.json
    python scripts/bench_async.py ARTIFACT --streams 1 --rounds 1 --output-len 16     # a quick check

Each (loop, stream count, round) runs in a fresh process, as `serve` runs its engine (its own thread, the thread
policy's torch threads, the loading thread's OpenMP workers handed over): loading both loops into one process would
leave two OpenMP teams (the synchronous engine thread's and the graph thread's), which slows both
(runtime/threads.py). Per level: TPOT and TTFT p50 from the engine's callbacks, output tokens/s, and per engine step
the wall time, the graph calls' time, and the host time the graph waited for (`host_ms`: step wall time less the
graph calls; async scheduling overlaps the rest). `ARTIFACT` may be a checkpoint (run eagerly). The JSON names the
machine (`neuron_opt.bench.RunRecord`) and whether it was idle; timings from a busy machine are marked so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(args: argparse.Namespace) -> int:
    """One level in this process: the engine over the model, `--mode`'s loop, printed as one JSON line."""
    import torch

    from neuron_opt.api import LLM

    torch.set_num_threads(threads_for(args))  # before the load, as `serve` does
    print(json.dumps(level(LLM(args.model), args.mode, args)))
    return 0


def threads_for(args: argparse.Namespace) -> int:
    """`--threads`, else serve's: NEURON_OPT_NUM_THREADS, else the thread policy's."""
    from neuron_opt import envs
    from neuron_opt.commands.serve import thread_policy

    return args.threads or envs.NUM_THREADS or thread_policy().threads


def level(llm, mode: str, args: argparse.Namespace) -> dict:  # noqa: ANN001
    """One level of `args.streams` streams on an engine over `llm`'s runner with `mode`'s loop ("sync", "async")."""
    import torch

    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.threads import hand_threads_to_engine
    sys.path.insert(0, str(ROOT / "scripts"))
    from profile_engine import _prompts, run_level

    threads = threads_for(args)
    torch.set_num_threads(threads)
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, max_num_batched_tokens=2048,
                    async_scheduling=mode == "async")
    hand_threads_to_engine(engine.runners, threads)
    engine.start()
    try:
        run_level(engine, _prompts(2, args.input_len, llm.runner.vocab_size, args.seed + 99), 2, 4)  # warm-up
        st = engine.stats
        wait0 = st.wait_s
        n = args.requests or max(2, 2 * args.streams)
        out = run_level(engine, _prompts(n, args.input_len, llm.runner.vocab_size, args.seed), args.streams,
                        args.output_len)
        out["wait_ms"] = 1e3 * (st.wait_s - wait0) / max(out["steps"], 1)
    finally:
        engine.stop()
    out["host_ms"] = out["step_ms"] - out["graph_ms"]
    out.update(mode=mode, threads=threads)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="an artifact directory, or a checkpoint (run eagerly)")
    p.add_argument("--streams", default="1,8", help="concurrent streams, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 x streams, at least 2)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: serve's thread policy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout)")
    p.add_argument("--require-idle", action="store_true", help="refuse to run, or to finish, on a busy machine")
    p.add_argument("--mode", choices=["sync", "async"], help=argparse.SUPPRESS)  # a child's level
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds: must be >= 1, got {args.rounds}")
    if args.mode is not None:
        args.streams = int(args.streams)
        return child(args)

    from neuron_opt.bench import RunRecord, rounds_summary

    record = RunRecord(args.require_idle)
    streams = [int(s) for s in args.streams.split(",")]
    runs: dict[str, list[dict]] = {}
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for r in range(args.rounds):
        for s in streams:
            for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):  # alternate who goes first
                cmd = [sys.executable, __file__, str(args.model), "--mode", mode, "--streams", str(s),
                       "--requests", str(args.requests), "--input-len", str(args.input_len),
                       "--output-len", str(args.output_len), "--seed", str(args.seed)]
                if args.threads:
                    cmd += ["--threads", str(args.threads)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
                level = json.loads(out.strip().splitlines()[-1])
                runs.setdefault(f"{mode}/{s}", []).append(level)
                print(f"round {r + 1} {mode:>5} {s} streams: TPOT p50 {level['tpot_p50_ms']:.2f} ms, "
                      f"host {level['host_ms']:.2f} ms/step, graph {level['graph_ms']:.2f} ms/step",
                      file=sys.stderr, flush=True)
    summary = {}
    for s in streams:
        row = {}
        for mode in ("sync", "async"):
            levels = runs[f"{mode}/{s}"]
            row[mode] = {k: rounds_summary([lv[k] for lv in levels])
                         for k in ("tpot_p50_ms", "ttft_p50_ms", "output_tok_s", "step_ms", "graph_ms", "host_ms",
                                   "sample_ms", "output_ms")}
        row["tpot_change"] = row["async"]["tpot_p50_ms"]["median"] / row["sync"]["tpot_p50_ms"]["median"] - 1
        summary[str(s)] = row
    doc = {"bench": "async_scheduling", "model": str(args.model), "streams": streams, "rounds": args.rounds,
           "input_len": args.input_len, "output_len": args.output_len, **record.finish(), "summary": summary,
           "runs": runs}
    text = json.dumps(doc, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
