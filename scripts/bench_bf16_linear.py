#!/usr/bin/env python
"""A/B of the bf16 one-row linears a decode step makes, in ONE process: oneDNN with weights packed as the compiled
graphs pack them (`mkldnn._linear_pointwise`, the `one_row_gemm=same` default) against each path of the cpu
backend's `bf16_linear` operator (`one_row_gemm=kernel`; csrc/bf16_linear.cpp).

A pass is every layer's four products (fused q/k/v, o, fused gate/up, down) on its own weights, as a decode step
reads them (so the weights stream from memory, not cache), optionally with the LM head. Variants run in
alternating blocks, each block in a rotated order, so every variant sees the same machine state; reported per
variant: the median and best pass, the weights' read rate, and the ratio of medians against oneDNN.

    python scripts/bench_bf16_linear.py --rows 1 --blocks 15 --head
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=576, help="hidden size (default: SmolLM2-135M's)")
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--kv-width", type=int, default=192, help="k and v projection width (kv heads x head dim)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--head", action="store_true", help="add the LM head ([vocab, hidden]) to each pass")
    ap.add_argument("--rows", type=int, default=1, help="rows of x (the decode batch)")
    ap.add_argument("--blocks", type=int, default=15, help="timing blocks per variant")
    ap.add_argument("--passes", type=int, default=10, help="passes per block")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from neuron_opt.backends.cpu import ops as cpu_ops

    err = cpu_ops.load()
    if err is not None:
        raise SystemExit(f"the cpu backend's C++ operators did not build: {err}")
    H, inter, kvw = args.hidden, args.intermediate, args.kv_width
    g = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)

    # per layer: q/k/v and gate/up as their parts (the operator takes them side by side) and fused (oneDNN's GEMM)
    layers = []
    for _ in range(args.layers):
        q, k, v, o = weight(H, H), weight(kvw, H), weight(kvw, H), weight(H, H)
        gate, up, down = weight(inter, H), weight(inter, H), weight(H, inter)
        layers.append([([q, k, v], H), ([o], H), ([gate, up], H), ([down], inter)])
    if args.head:
        layers.append([([weight(args.vocab, H)], H)])
    nbytes = sum(sum(w.numel() for w in ws) * 2 for layer in layers for ws, _ in layer)

    def packed(ws: list[torch.Tensor]) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(torch.cat(ws), args.rows)

    onednn = [[(packed(ws), k) for ws, k in layer] for layer in layers]
    xs = {k: torch.randn(args.rows, k, generator=g).to(torch.bfloat16) for k in (H, inter)}

    def run_onednn() -> None:
        for layer in onednn:
            for w, k in layer:
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

    def run_path(path: str):  # noqa: ANN202
        def run() -> None:
            for layer in layers:
                for ws, k in layer:
                    torch.ops.neuron_opt.bf16_linear_path(xs[k], ws, path)
        return run

    variants = {"onednn": run_onednn}
    for path in cpu_ops.bf16_linear_paths(xs[H]):
        variants[f"kernel:{path}"] = run_path(path)

    # the products agree (oneDNN rounds its output to bf16; the operator keeps fp32)
    for (ws, k), (w, _) in zip(layers[0], onednn[0], strict=True):
        ref = xs[k].float() @ torch.cat(ws).float().T
        for path in cpu_ops.bf16_linear_paths(xs[k]):
            torch.testing.assert_close(torch.ops.neuron_opt.bf16_linear_path(xs[k], ws, path), ref, rtol=1e-3,
                                       atol=1e-3)
        got = torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "").float()
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)

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
    base = statistics.median(times["onednn"])
    rows = [{"variant": n, "median_ms": 1e3 * statistics.median(t), "best_ms": 1e3 * min(t),
             "median_gb_s": nbytes / statistics.median(t) / 1e9, "vs_onednn": base / statistics.median(t),
             "blocks_ms": [1e3 * x for x in t]} for n, t in times.items()]
    if args.json:
        from neuron_opt.bench import machine

        print(json.dumps({"machine": machine(), "rows": args.rows, "layers": args.layers, "head": args.head,
                          "weight_bytes": nbytes, "threads": torch.get_num_threads(), "results": rows}, indent=2))
    else:
        print(f"{args.rows} row(s), {args.layers} layers{' + head' if args.head else ''}, {nbytes / 1e6:.0f} MB of "
              f"bf16 weights per pass, {torch.get_num_threads()} threads, {args.blocks} blocks of {args.passes}")
        for r in rows:
            print(f"{r['variant']:20s} median {r['median_ms']:7.2f} ms  best {r['best_ms']:7.2f} ms  "
                  f"{r['median_gb_s']:5.1f} GB/s  {r['vs_onednn']:.2f}x oneDNN")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
