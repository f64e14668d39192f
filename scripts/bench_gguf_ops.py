#!/usr/bin/env python
"""A/B of the linears a decode step makes on GGUF blocks as stored (`gguf_linear`, csrc/gguf_linear.cpp) against
the int8 weight-only operator (`int8_linear`, csrc/int8_linear.cpp), in ONE process, at the shapes of SmolLM2-135M,
Llama-3.2-1B and Llama-3.2-3B.

A pass is every layer's four products (fused q/k/v, o, fused gate/up, down) on its own weights, as a decode step
reads them, so weights stream from memory rather than cache once all variants' weights exceed the last-level
cache (the JSON records the bytes; a shape whose variants fit the LLC reads partly from cache). Rows of a K-quant
type that are not whole 256-value blocks (SmolLM2-135M's hidden 576) take the type llama-quantize falls back to
(Q4_K, Q5_K: Q5_0; Q6_K: Q8_0), as its files of that model do. Variants: `int8` (int8 rows, one bf16 scale per
row), each GGUF type on the default operator (activations rounded to llama.cpp's 8-bit blocks), `Q4_K_M`
(llama-quantize's mix: q/k/o/gate/up Q4_K, v Q6_K, down Q6_K on every other layer, rows of two types fused into
one call), `Q4_K:fp32` (the exact reference path), and with `--all-paths` every code path of each type. K-quant
blocks are random bytes with finite fp16 scales (gguf's Python package has no K-quant quantizer); speed does not
depend on the values. Variants run in alternating blocks, each block in a rotated order; reported per variant: the
median and best pass, the weights' read rate, and the ratio of medians against int8.

llama.cpp's own kernels are not timed here (this environment has no ggml binding; `llamacpp` in the JSON says so):
llama.cpp end to end is scripts/bench_decode.py's. Memory: all variants of a shape at once, about 16 GB at the 3B
shape with every type (`--types` or `--layers` to take less).

    python scripts/bench_gguf_ops.py --shapes 135m,1b,3b --blocks 7 --json > docs/bench/gguf_ops.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import numpy as np
import torch

# name -> (hidden, intermediate, k/v width, layers): SmolLM2-135M, Llama-3.2-1B, Llama-3.2-3B
SHAPES = {"135m": (576, 1536, 192, 30), "1b": (2048, 8192, 512, 16), "3b": (3072, 8192, 1024, 28)}
# GGML type -> (id, values per block, bytes per block, offsets of its fp16 scales, their magnitude)
TYPES = {"Q4_K": (12, 256, 144, (0, 2), 1e-4), "Q5_K": (13, 256, 176, (0, 2), 1e-4),
         "Q6_K": (14, 256, 210, (208,), 1e-4), "Q5_0": (6, 32, 22, (0,), 1e-2), "Q8_0": (8, 32, 34, (0,), 1e-3)}
# what llama-quantize writes instead of a K-quant for rows that are not whole 256-value blocks (SmolLM2-135M's
# hidden 576), among the types with kernels here (its Q5_K fallback, Q5_1, has none: Q5_0 stands in)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_0", "Q6_K": "Q8_0"}


def blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random `kind` rows (uint8 [n, row bytes]) with finite fp16 scales, and their kinds (int8 [n])."""
    tid, size, nbytes, offsets, mag = TYPES[kind]
    b = rng.integers(0, 256, size=(n, k // size, nbytes), dtype=np.uint8)
    for off in offsets:
        d = rng.uniform(0.5, 1.0, size=(n, k // size)).astype(np.float16) * np.float16(mag)
        b[..., off:off + 2] = d.view(np.uint8).reshape(n, k // size, 2)
    return torch.from_numpy(b.reshape(n, -1)), torch.full((n,), tid, dtype=torch.int8)


def fused(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of several weights in one tensor, padded to the widest (as the cpu backend fuses q/k/v, gate/up)."""
    width = max(q.shape[1] for q, _ in parts)
    return (torch.cat([torch.nn.functional.pad(q, (0, width - q.shape[1])) for q, _ in parts]),
            torch.cat([k for _, k in parts]))


def layer_shapes(shape: str) -> list[tuple[list[int], int]]:
    """One layer's four products: (the output widths fused into one call, input features)."""
    h, inter, kv, _ = SHAPES[shape]
    return [([h, kv, kv], h), ([h], h), ([inter, inter], h), ([h], inter)]


def gguf_weights(shape: str, mix: str, rng: np.random.Generator) -> list[list[tuple[torch.Tensor, torch.Tensor, int]]]:
    """Every layer's four products as (qweight, kinds, K), each part of type `mix` (or Q4_K_M's choice)."""
    out = []
    for layer in range(SHAPES[shape][3]):
        products = []
        for i, (widths, k) in enumerate(layer_shapes(shape)):
            kinds = [mix] * len(widths)
            if mix == "Q4_K_M":
                kinds = ["Q4_K"] * len(widths)
                if i == 0:
                    kinds[2] = "Q6_K"  # v
                if i == 3 and layer % 2 == 0:
                    kinds = ["Q6_K"]  # down
            kinds = [FALLBACK.get(t, t) if k % 256 else t for t in kinds]
            q, kd = fused([blocks(t, n, k, rng) for t, n in zip(kinds, widths, strict=True)])
            products.append((q, kd, k))
        out.append(products)
    return out


def int8_weights(shape: str, g: torch.Generator) -> list[list[tuple[torch.Tensor, torch.Tensor, int]]]:
    out = []
    for _ in range(SHAPES[shape][3]):
        out.append([(torch.randint(-127, 128, (sum(widths), k), generator=g, dtype=torch.int8),
                     (torch.rand(sum(widths), generator=g) * 1e-2).to(torch.bfloat16), k)
                    for widths, k in layer_shapes(shape)])
    return out


def nbytes(ws: list[list[tuple[torch.Tensor, torch.Tensor, int]]], gguf: bool) -> int:
    """Bytes a pass reads: each row's own blocks (not its padding) for GGUF, the int8 rows and scales for int8."""
    total = 0
    for layer in ws:
        for q, kinds, k in layer:
            if gguf:
                per = {tid: k // size * nb for tid, size, nb, _, _ in TYPES.values()}
                total += sum(per[int(t)] * int(c) for t, c in zip(*torch.unique(kinds, return_counts=True),
                                                                     strict=True))
            else:
                total += q.numel() + kinds.numel() * 2
    return total


def llamacpp_note() -> str:
    """Why llama.cpp's kernels are not in this benchmark's rows."""
    have = importlib.util.find_spec("llama_cpp") is not None
    return ("not timed: no ggml matmul binding here (llama-cpp-python " + ("installed" if have else "not installed")
            + "); llama.cpp end to end is scripts/bench_decode.py's")


def bench_shape(shape: str, args: argparse.Namespace) -> dict:
    from neuron_opt.backends.cpu import ops as cpu_ops

    rng, g = np.random.default_rng(0), torch.Generator().manual_seed(0)
    h, inter = SHAPES[shape][0], SHAPES[shape][1]
    xs = {k: torch.randn(args.rows, k, generator=g) for k in (h, inter)}
    int8 = int8_weights(shape, g)
    sizes = {"int8": nbytes(int8, False)}

    def run_int8() -> None:
        for layer in int8:
            for w, s, k in layer:
                torch.ops.neuron_opt.int8_linear(xs[k], w, s)

    def run_gguf(ws, path: str | None, activations: str):  # noqa: ANN001, ANN202
        def run() -> None:
            for layer in ws:
                for q, kinds, k in layer:
                    if path is None:
                        op = cpu_ops.gguf_linear if activations == "q8" else cpu_ops.gguf_linear_exact
                        op(xs[k], q, kinds)
                    else:
                        cpu_ops.gguf_linear_path(xs[k], q, kinds, path, activations)
        return run

    variants = {"int8": run_int8}
    for mix in args.types:
        ws = gguf_weights(shape, mix, rng)
        sizes[mix] = nbytes(ws, True)
        variants[mix] = run_gguf(ws, None, "q8")
        if mix == "Q4_K":
            variants["Q4_K:fp32"] = run_gguf(ws, None, "fp32")
        if args.all_paths:
            for activations in ("q8", "fp32"):
                for path in cpu_ops.gguf_linear_paths(activations)[1:]:
                    variants[f"{mix}:{activations}:{path}"] = run_gguf(ws, path, activations)

    def block(fn) -> float:  # noqa: ANN001
        t = time.perf_counter()
        for _ in range(args.passes):
            fn()
        return (time.perf_counter() - t) / args.passes

    for fn in variants.values():
        block(fn)  # warm-up
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for b in range(args.blocks):
        for n in names[b % len(names):] + names[:b % len(names)]:
            times[n].append(block(variants[n]))
    base = statistics.median(times["int8"])
    rows = [{"variant": n, "median_ms": 1e3 * statistics.median(t), "best_ms": 1e3 * min(t),
             "weight_bytes": sizes[n.split(":")[0]],
             "median_gb_s": sizes[n.split(":")[0]] / statistics.median(t) / 1e9,
             "vs_int8": base / statistics.median(t), "blocks_ms": [1e3 * x for x in t]} for n, t in times.items()]
    return {"shape": shape, "hidden": h, "intermediate": inter, "kv_width": SHAPES[shape][2],
            "layers": SHAPES[shape][3], "all_variants_bytes": sum(sizes[n.split(":")[0]] for n in names
                                                                if n.count(":") == 0), "results": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="135m,1b,3b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q5_0,Q8_0,Q4_K_M",
                    help="comma-separated GGML types (and Q4_K_M, the mix)")
    ap.add_argument("--layers", type=int, default=None, help="layers per pass (default: the model's)")
    ap.add_argument("--rows", type=int, default=1, help="rows of x (the decode batch, up to 16)")
    ap.add_argument("--blocks", type=int, default=7, help="timing blocks per variant")
    ap.add_argument("--passes", type=int, default=3, help="passes per block")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--all-paths", action="store_true", help="also every code path of each type (q8 and fp32)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.types = args.types.split(",")
    for t in args.types:
        if t not in TYPES and t != "Q4_K_M":
            raise SystemExit(f"--types: {t!r} is not one of {[*TYPES, 'Q4_K_M']}")
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: {s!r} is not one of {sorted(SHAPES)}")
    if args.layers:
        for s in shapes:
            SHAPES[s] = (*SHAPES[s][:3], args.layers)
    if args.threads:
        torch.set_num_threads(args.threads)

    from neuron_opt.backends.cpu import ops as cpu_ops

    err = cpu_ops.load()
    if err is not None:
        raise SystemExit(f"the cpu backend's C++ operators did not build: {err}")
    results = [bench_shape(s, args) for s in shapes]
    if args.json:
        from neuron_opt.bench import machine

        print(json.dumps({"machine": machine(), "rows": args.rows, "threads": torch.get_num_threads(),
                          "blocks": args.blocks, "passes": args.passes, "llamacpp": llamacpp_note(),
                          "q8_paths": cpu_ops.gguf_linear_paths("q8"),
                          "fp32_paths": cpu_ops.gguf_linear_paths("fp32"), "shapes": results}, indent=2))
    else:
        print(f"{args.rows} row(s), {torch.get_num_threads()} threads, {args.blocks} blocks of {args.passes}; "
              f"llama.cpp: {llamacpp_note()}")
        for res in results:
            print(f"{res['shape']}: hidden {res['hidden']}, {res['layers']} layers, "
                  f"{res['all_variants_bytes'] / 1e6:.0f} MB of weights over all variants")
            for r in res["results"]:
                print(f"  {r['variant']:24s} median {r['median_ms']:8.2f} ms  best {r['best_ms']:8.2f} ms  "
                      f"{r['median_gb_s']:5.1f} GB/s  {r['vs_int8']:.2f}x int8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
