#!/usr/bin/env python
"""A/B of cpu backend options on batch decode (or a batch-1 prefill), in ONE process.

Each variant (a dtype plus backend options) gets its own compiled decode graphs and executor; all executors are
loaded side by side and timed in alternating blocks, so every variant sees the same machine state (this VM's
memory bandwidth moves by +-20% between runs, which swamps differences of 5-15% measured run against run).
Reports the median and best block per variant; JSON with --json.

    python scripts/bench_cpu_options.py --kv 512 bfloat16 bfloat16:decode_attention=sdpa float32
    python scripts/bench_cpu_options.py --prefill 1504 --blocks 5 bfloat16 bfloat16:prefill_attention=whole
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse_variant(text: str) -> tuple[torch.dtype, dict[str, str]]:
    """'bfloat16:gemm=onednn:logits=dtype' -> (torch.bfloat16, {"gemm": "onednn", "logits": "dtype"})."""
    dtype, *kvs = text.split(":")
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise SystemExit(f"variant {text!r}: {dtype!r} is not a torch dtype")
    bad = [kv for kv in kvs if "=" not in kv]
    if bad:
        raise SystemExit(f"variant {text!r}: options are key=value, got {bad}")
    return getattr(torch, dtype), dict(kv.split("=", 1) for kv in kvs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="dtype[:option=value...], e.g. bfloat16:decode_attention=sdpa")
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv", type=int, default=128, help="decode KV bucket (the context attended over)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=8, help="timing blocks per variant")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per block")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="time a batch-1 prefill of N tokens from position 0 per block instead of decode steps "
                         "(--kv, --batch and --steps do not apply)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.prefill and (args.prefill < 2 or args.batch != 1):
        ap.error("--prefill: N >= 2 tokens, at --batch 1")
    variants = [(v, *parse_variant(v)) for v in args.variants]

    from neuron_opt.api import build_model
    from neuron_opt.backends.base import StepInputs
    from neuron_opt.backends.cpu.backend import CpuBackend
    from neuron_opt.buckets import DECODE, PREFILL, Bucket
    from neuron_opt.checkpoint import open_checkpoint
    from neuron_opt.config import CacheConfig

    ckpt = open_checkpoint(args.model)
    state = ckpt.state_dict()
    max_model_len = max(args.kv, args.prefill, 128)

    def factory() -> torch.nn.Module:
        return build_model(ckpt.config, state, max_model_len, torch.float32)

    bucket = Bucket(PREFILL, 1, args.prefill) if args.prefill else Bucket(DECODE, args.batch, args.kv)
    model = factory()
    executors = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, dtype, options) in enumerate(variants):
            backend = CpuBackend(dtype, options)
            cache = CacheConfig(max_batch=args.batch, max_model_len=max_model_len,
                                dtype=str(dtype).removeprefix("torch."))
            out = Path(tmp) / f"v{i}"
            out.mkdir()
            files = [out / f for f in backend.compile_bucket(model, bucket, cache, out)]
            backend.save_weights(model, out / "w.safetensors")
            executors[name] = backend.load({bucket: files}, out / "w.safetensors", factory, cache)
            print(f"loaded {name}", file=sys.stderr, flush=True)  # stdout: the report (JSON with --json)
    del model

    # row b owns blocks 1 + b * nb ... (block 0 is the null block); every row decodes at position 8 + step
    bs = cache.block_size
    nb = -(-max(args.kv, args.prefill) // bs)
    tables = 1 + torch.arange(args.batch * nb).view(args.batch, nb)

    def step(pos: int) -> StepInputs:
        slots = tables[:, pos // bs] * bs + pos % bs
        return StepInputs(torch.full((args.batch, 1), 42), torch.full((args.batch, 1), pos), slots[:, None],
                          tables, torch.zeros(args.batch, dtype=torch.long))

    def prefill(n: int) -> StepInputs:
        pos = torch.arange(n)
        ids = torch.randint(100, 10000, (1, n), generator=torch.Generator().manual_seed(0))
        return StepInputs(ids, pos[None], (tables[0, pos // bs] * bs + pos % bs)[None], tables,
                          torch.tensor([n - 1]))

    inputs = [prefill(args.prefill)] if args.prefill else [step(8 + i) for i in range(min(args.steps, args.kv - 8))]
    tokens = args.prefill or args.batch

    def block(ex) -> float:  # noqa: ANN001
        t = time.perf_counter()
        for inp in inputs:
            ex.run(bucket, inp)
        return tokens * len(inputs) / (time.perf_counter() - t)

    for ex in executors.values():
        block(ex)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in executors}
    for _ in range(args.blocks):
        for name, ex in executors.items():
            times[name].append(block(ex))
    rows = [{"variant": n, "median_tok_s": statistics.median(t), "best_tok_s": max(t)} for n, t in times.items()]
    if args.prefill:  # and the prefill's time
        for r in rows:
            r["median_ms"] = 1e3 * args.prefill / r["median_tok_s"]
    if args.json:
        from neuron_opt.bench import machine

        what = {"prefill": args.prefill} if args.prefill else {"kv": args.kv, "batch": args.batch}
        print(json.dumps({"machine": machine(), **what, "threads": torch.get_num_threads(), "blocks": args.blocks,
                          "results": rows}, indent=2))
    elif args.prefill:
        print(f"batch-1 prefill of {args.prefill} tokens, {torch.get_num_threads()} threads")
        for r in rows:
            print(f"{r['variant']:45s} median {r['median_ms']:8.1f} ms ({r['median_tok_s']:7.1f} tok/s), "
                  f"best {r['best_tok_s']:7.1f} tok/s")
    else:
        print(f"decode batch {args.batch}, KV bucket {args.kv}, {torch.get_num_threads()} threads")
        for r in rows:
            print(f"{r['variant']:45s} median {r['median_tok_s']:7.1f}  best {r['best_tok_s']:7.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
