"""Tensor-parallel benchmark on this machine: tokens/s and collective bytes per token per tp and layout.

For each configuration it starts the rank processes once, then measures
  prefill: one prompt of --prompt-len tokens (best of --repeats), tokens/s = prompt tokens / seconds;
  decode: --decode-steps greedy steps at batch 1, with full-logit gathering and with top-1 candidates
          (vocab-parallel sampling), tokens/s = steps / seconds;
and reads the ranks' counted collectives for one prefill and one decode step (payload bytes and ring-model
wire bytes per rank, per token), checked against the formula in neuron_opt.planner.collectives.
tp=1 runs the eager executor in this process (no collectives).

Configurations: the default model (SmolLM2-135M, 9 q / 3 kv heads) at tp 1/2/3, plain and sequence-parallel;
and, because flash decoding needs n_kv_heads < tp, the same dimensions with one KV head (MQA, random
weights) at tp 1 and at tp 2 with replicate-kv vs flash decoding.

    python scripts/bench_tp.py [--json] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import torch

from neuron_opt.api import build_model
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig, pick_decode, pick_prefill
from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.executors.launcher import default_threads
from neuron_opt.executors.tp import tp_executor_from_state_dict
from neuron_opt.parallel.sharding import head_layout, layout_cost
from neuron_opt.planner.collectives import expected_calls, summarize
from neuron_opt.runtime.runner import DecodeRow, ModelRunner


class WithCandidates:
    def __init__(self, ex: Any, k: int | None) -> None:
        self.ex, self.k = ex, k

    def run(self, bucket: Any, inputs: Any) -> torch.Tensor:
        return self.ex.run(bucket, inputs, candidates=self.k)


def mqa_variant(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Same dimensions, one KV head: k/v projections keep their first head (a random-ish but real model)."""
    D = cfg.head_dim
    out = {k: (v[:D] if (".k_proj." in k or ".v_proj." in k) else v) for k, v in sd.items()}
    return dataclasses.replace(cfg, num_key_value_heads=1), out


def timed(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_one(
    name: str,
    cfg: ModelConfig,
    sd: dict[str, torch.Tensor],
    par: ParallelConfig,
    args: argparse.Namespace,
    threads_tp1: int = 1,
) -> dict[str, Any]:
    L = args.max_model_len
    cache = CacheConfig(max_batch=1, max_model_len=L)
    buckets = BucketConfig.build(max_prompt_len=L, max_model_len=L, max_batch=1, min_prefill=16, min_decode=L)
    t0 = time.perf_counter()
    threads = threads_tp1 if par.tp == 1 else default_threads(par.tp)
    if par.tp == 1:
        torch.set_num_threads(threads_tp1)
        ex: Any = EagerExecutor(build_model(cfg, sd, L, torch.float32), cache)
    else:
        ex = tp_executor_from_state_dict(cfg, sd, par, cache)
    start_s = time.perf_counter() - t0
    prompt = [(i * 7919) % (cfg.vocab_size - 3) + 3 for i in range(args.prompt_len)]
    row: dict[str, Any] = {
        "config": name,
        "tp": par.tp,
        "sequence_parallel": par.sequence_parallel,
        "flash_decoding": par.flash_decoding,
        "start_s": round(start_s, 1),
        "threads_per_rank": threads,
    }
    lay = head_layout(cfg, par)
    row["layout"] = layout_cost(cfg, lay, cache.num_blocks, cache.block_size, 4).line()
    try:
        full = ModelRunner(ex, buckets, cache, cfg.vocab_size)
        pre_s = timed(lambda: full.prefill(0, prompt), args.repeats)
        row["prefill_tok_s"] = round(args.prompt_len / pre_s, 1)
        modes = [("full", None), ("top1", 1)] if par.tp > 1 else [("full", None)]
        for mode, k in modes:
            runner = ModelRunner(WithCandidates(ex, k) if par.tp > 1 else ex, buckets, cache, cfg.vocab_size)
            runner.prefill(0, prompt)

            def decode_steps(runner: ModelRunner = runner) -> None:
                for t in range(args.decode_steps):
                    runner.decode([DecodeRow(0, 5 + t, args.prompt_len + t)])

            row[f"decode_tok_s_{mode}"] = round(args.decode_steps / timed(decode_steps, 1), 2)
        if par.tp > 1:
            row.update(count_bytes(cfg, par, ex, buckets, cache, prompt))
    finally:
        if par.tp > 1:
            ex.close()
    return row


def count_bytes(
    cfg: ModelConfig,
    par: ParallelConfig,
    ex: Any,
    buckets: BucketConfig,
    cache: CacheConfig,
    prompt: list[int],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n = len(prompt)
    for phase, k in (("prefill", None), ("decode_full", None), ("decode_top1", 1)):
        runner = ModelRunner(WithCandidates(ex, k), buckets, cache, cfg.vocab_size)
        ex.reset_collective_calls()
        if phase == "prefill":
            runner.prefill(0, prompt)
            bucket = pick_prefill(n, buckets)
        else:
            runner.decode([DecodeRow(0, 5, n)])
            bucket = pick_decode(1, n, buckets)
        calls = ex.collective_calls()
        if calls != expected_calls(cfg, par, bucket, 4, k):
            raise AssertionError(f"{phase}: counted collectives differ from the formula")
        s = summarize(calls, bucket)
        out[f"{phase}_calls"] = s.calls
        out[f"{phase}_payload_B_per_tok"] = round(s.payload_per_token)
        out[f"{phase}_wire_B_per_tok"] = round(s.wire_per_token)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="fewer configurations and steps (smoke run)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=256)
    args = p.parse_args()
    if args.quick:
        args.decode_steps, args.repeats = 8, 1
    ckpt = open_checkpoint("default")
    cfg, sd = ckpt.config, ckpt.state_dict(torch.float32)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    configs: list[tuple[str, ModelConfig, dict[str, torch.Tensor], ParallelConfig]] = [
        ("default", cfg, sd, ParallelConfig(tp=1)),
        ("default", cfg, sd, ParallelConfig(tp=2)),
        ("default", cfg, sd, ParallelConfig(tp=2, sequence_parallel=True)),
        ("default", cfg, sd, ParallelConfig(tp=3)),
        ("default", cfg, sd, ParallelConfig(tp=3, sequence_parallel=True)),
    ]
    mcfg, msd = mqa_variant(cfg, sd)
    configs += [
        ("mqa", mcfg, msd, ParallelConfig(tp=1)),
        ("mqa", mcfg, msd, ParallelConfig(tp=2)),
        ("mqa", mcfg, msd, ParallelConfig(tp=2, flash_decoding=True)),
    ]
    if args.quick:
        configs = configs[:2] + configs[-1:]
    rows = []
    for name, c, s, par in configs:
        # tp=1 twice: one thread (like each rank) and two (the whole machine, where oversubscription bites)
        for threads in (1, 2) if par.tp == 1 else (1,):
            row = bench_one(name, c, s, par, args, threads)
            rows.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    if args.json:
        from neuron_opt.bench import machine

        json.dump(
            {"machine": machine(), "prompt_len": args.prompt_len, "decode_steps": args.decode_steps, "rows": rows},
            sys.stdout,
            indent=1,
        )
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
