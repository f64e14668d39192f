"""Decode throughput, side by side in one run: HF transformers (the peer) vs neuron_opt eager and compiled.

Every system decodes the same prompts greedily for the same number of steps; only decode steps are timed
(prefill excluded). Reported: tokens/s, ratio to HF eager fp32, and model-bandwidth utilisation (MBU): bytes a
decode step must read (weights + the KV positions it attends over) x steps/s, over the memory-read bandwidth
measured in the same run.

JSON: {"mem_bw_gbs": x, "results": [{"system", "dtype", "batch", "tok_s", "ratio_vs_hf", "mbu"}, ...], ...}
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PROMPT_LEN = 32


@dataclass
class Result:
    system: str
    dtype: str
    batch: int
    tok_s: float
    steps: int
    bytes_per_step: float
    ratio_vs_hf: float | None = None
    mbu: float | None = None


def measure_read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a streaming read (sum over a buffer far larger than the caches), best of `repeats`."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def _prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab - 1, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]


def bench_runner(runner, batch: int, steps: int, vocab: int) -> float:
    """tok/s of `steps` batched greedy decode steps through a neuron_opt ModelRunner."""
    from neuron_opt.runtime.runner import DecodeRow

    toks = [int(runner.prefill(slot, p).argmax()) for slot, p in enumerate(_prompts(batch, vocab))]
    pos = PROMPT_LEN
    for _ in range(2):  # warm-up
        runner.decode([DecodeRow(s, t, pos) for s, t in enumerate(toks)])
    t0 = time.perf_counter()
    for i in range(steps):
        logits = runner.decode([DecodeRow(s, t, pos + 2 + i) for s, t in enumerate(toks)])
        toks = logits.argmax(-1).tolist()
    return batch * steps / (time.perf_counter() - t0)


def bench_hf(model, batch: int, steps: int, vocab: int, static_compile: bool = False) -> float:
    """tok/s of HF transformers decoding with its KV cache (DynamicCache, or StaticCache + torch.compile)."""
    from transformers import DynamicCache, StaticCache

    ids = torch.tensor(_prompts(batch, vocab))
    with torch.inference_mode():
        if static_compile:
            cache = StaticCache(config=model.config, max_batch_size=batch, max_cache_len=PROMPT_LEN + steps + 8)
            fwd = torch.compile(model.forward, fullgraph=True)
        else:
            cache, fwd = DynamicCache(config=model.config), model.forward
        out = model(ids, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(PROMPT_LEN))
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = PROMPT_LEN
        t0 = None
        for i in range(steps + 2):  # 2 warm-up steps
            if i == 2:
                t0 = time.perf_counter()
            out = fwd(tok, past_key_values=cache, use_cache=True, cache_position=torch.tensor([pos]))
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            pos += 1
    return batch * steps / (time.perf_counter() - t0)


def step_bytes(cfg, dtype: torch.dtype, batch: int, kv_len: int) -> float:
    esz = torch.finfo(dtype).bits // 8
    kv = 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * kv_len * cfg.head_dim * esz
    return cfg.num_parameters() * esz + kv


def compiled_runner(model: str, backend: str, dtype: str, batch: int, out: Path, max_length: int):
    from neuron_opt.api import LLM
    from neuron_opt.compiler import CompileRequest, compile_artifact

    compile_artifact(CompileRequest(model=model, out=out, backend=backend, dtype=dtype, batch_size=batch,
                                    max_length=max_length, prefill_buckets=(PROMPT_LEN,),
                                    decode_buckets=(max_length,), decode_batches=(batch,)), progress=True)
    return LLM(out).runner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--systems", default="hf,hf-compile,eager,cpu-fp32,cpu-bf16",
                    help="comma list of: hf, hf-compile, eager, cpu-fp32, cpu-bf16")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from neuron_opt.api import LLM
    from neuron_opt.checkpoint import open_checkpoint

    ckpt = open_checkpoint(args.model)
    cfg = ckpt.config
    systems = args.systems.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    bw = measure_read_bandwidth()
    results: list[Result] = []
    kv_len = PROMPT_LEN + args.steps
    log = (lambda s: print(s, flush=True)) if not args.json else (lambda s: None)
    for batch in batches:
        if "hf" in systems or "hf-compile" in systems:
            src = ckpt.source
            kw = {"gguf_file": src.name} if ckpt.format == "gguf" else {}
            hf = transformers.AutoModelForCausalLM.from_pretrained(src.parent if kw else src, dtype=torch.float32,
                                                                   **kw).eval()
            for name in ("hf", "hf-compile"):
                if name in systems:
                    tps = bench_hf(hf, batch, args.steps, cfg.vocab_size, static_compile=name == "hf-compile")
                    results.append(Result(f"transformers-{'static-compile' if name == 'hf-compile' else 'eager'}",
                                          "float32", batch, tps, args.steps,
                                          step_bytes(cfg, torch.float32, batch, kv_len)))
                    log(f"{results[-1].system:32s} b={batch} {tps:7.1f} tok/s")
            del hf
        if "eager" in systems:
            llm = LLM(args.model, max_length=args.max_length, batch_size=batch)
            tps = bench_runner(llm.runner, batch, args.steps, cfg.vocab_size)
            results.append(Result("neuron_opt-eager", "float32", batch, tps, args.steps,
                                  step_bytes(cfg, torch.float32, batch, kv_len)))
            log(f"{results[-1].system:32s} b={batch} {tps:7.1f} tok/s")
            del llm
        for name, dtype in (("cpu-fp32", "float32"), ("cpu-bf16", "bfloat16")):
            if name in systems:
                with tempfile.TemporaryDirectory() as d:
                    runner = compiled_runner(args.model, "cpu", dtype, batch, Path(d) / "a", args.max_length)
                    tps = bench_runner(runner, batch, args.steps, cfg.vocab_size)
                    del runner
                results.append(Result("neuron_opt-cpu-compiled", dtype, batch, tps, args.steps,
                                      step_bytes(cfg, getattr(torch, dtype), batch, kv_len)))
                log(f"{results[-1].system + ' ' + dtype:32s} b={batch} {tps:7.1f} tok/s")
    for r in results:
        base = next((x.tok_s for x in results if x.system == "transformers-eager" and x.batch == r.batch), None)
        r.ratio_vs_hf = r.tok_s / base if base else None
        r.mbu = r.bytes_per_step * (r.tok_s / r.batch) / (bw * 1e9)
    doc = {"mem_bw_gbs": bw, "model": str(args.model), "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "prompt_len": PROMPT_LEN,
           "steps": args.steps, "results": [asdict(r) for r in results]}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"\nmemory read bandwidth: {bw:.1f} GB/s")
        print(f"{'system':30s} {'dtype':9s} {'batch':>5s} {'tok/s':>8s} {'vs HF':>6s} {'MBU':>6s}")
        for r in results:
            ratio = f"{r.ratio_vs_hf:.2f}x" if r.ratio_vs_hf else "-"
            print(f"{r.system:30s} {r.dtype:9s} {r.batch:5d} {r.tok_s:8.1f} {ratio:>6s} {r.mbu:6.1%}")
    return 0
