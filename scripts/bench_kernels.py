"""Cost-model benchmark of the NKI kernels on the simulator (count-only: rules checked, no values computed).

Usage: python scripts/bench_kernels.py [--json] [--target trn1|inf2|trn2]

Shapes: flash attention prefill S=4096 D=128 bf16 (one head; causal and not), decode attention batch 8,
S_max 4096, 32 query / 8 KV heads (GQA 4), D=128 bf16, split 1024 (and through a block table, blocks of 16 and
of 32, the KV cache's default, at the default split),
RMSNorm N=4096 H=4096 bf16 (plain and with the fused residual add), and the matmul calibration
[4096, 8192] @ [8192, 8192] bf16 if kernels_nki/matmul.py exists.
Every number is the simulator's estimate (documented per-instruction costs, a dependency-aware schedule, one
DMA constant fitted on a published timing: docs/nki_simulator.md), not a measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

from kernels_nki import decode_attention, flash_attention, rmsnorm
from neuron_opt.nki_sim import get_target


def _entry(name: str, shape: dict[str, Any], rep: Any, useful_flops: int | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"kernel": name, "shape": shape, **rep.to_dict()}
    # The bandwidth bound: the bytes moved at the core's sustained DMA rate, no fixed costs.
    tgt = get_target(rep.target)
    d["bandwidth_bound_us"] = rep.dma_bytes / tgt.dma_gbps / 1e3
    d["of_bandwidth_bound"] = d["bandwidth_bound_us"] / rep.latency_us
    if useful_flops is not None:
        # The report counts every matmul (incl. the causal-mask matmuls); this counts only attention's own.
        d["useful_flops"] = useful_flops
        peak = {"trn1": 92.0, "inf2": 92.0, "trn2": 79.0}[rep.target] * 1e6  # FLOP per us
        d["useful_tensor_utilization"] = useful_flops / (rep.latency_us * peak)
    return d


def run_all(target: str) -> list[dict[str, Any]]:
    out = []
    s, d = 4096, 128
    for causal in (True, False):
        rep = flash_attention.estimate(1, 1, 1, s, d, causal=causal, target=target)
        out.append(_entry("flash_attention", {"B": 1, "n_heads": 1, "S": s, "D": d, "causal": causal,
                                              "dtype": "bfloat16"}, rep,
                          flash_attention.useful_flops(1, 1, s, d, causal=causal)))
    rep = decode_attention.estimate(8, 32, 8, 4096, 128, split_size=1024, target=target)
    out.append(_entry("decode_attention", {"B": 8, "n_heads": 32, "n_kv_heads": 8, "S_max": 4096, "D": 128,
                                           "split_size": 1024, "dtype": "bfloat16"}, rep))
    for bl in (16, 32):
        split = decode_attention.default_paged_split(bl)
        rep = decode_attention.estimate_paged(8, 32, 8, 4096, 128, block_len=bl, split_size=split, target=target)
        out.append(_entry("decode_attention_paged", {"B": 8, "n_heads": 32, "n_kv_heads": 8, "S_max": 4096,
                                                     "D": 128, "block_len": bl, "split_size": split,
                                                     "dtype": "bfloat16"}, rep))
    for residual in (False, True):
        rep = rmsnorm.estimate(4096, 4096, residual=residual, target=target)
        out.append(_entry("rmsnorm", {"N": 4096, "H": 4096, "residual": residual, "dtype": "bfloat16"}, rep))
    if importlib.util.find_spec("kernels_nki.matmul") is not None:
        from kernels_nki import matmul

        rep = matmul.estimate(4096, 8192, 8192, target=target)
        out.append(_entry("matmul", {"M": 4096, "K": 8192, "N": 8192, "dtype": "bfloat16"}, rep,
                          2 * 4096 * 8192 * 8192))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print a JSON list of reports")
    ap.add_argument("--target", default="trn1", choices=["trn1", "inf2", "trn2"])
    args = ap.parse_args()
    results = run_all(args.target)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for r in results:
        util = r.get("useful_tensor_utilization", r["tensor_utilization"])
        print(f"{r['kernel']:<17} {json.dumps(r['shape'])}")
        print(f"  latency {r['latency_us']:10.2f} us  bound by {r['bound_by']:<7} "
              f"TensorE util {util * 100:5.1f}%  "
              f"DMA {r['dma_bytes'] / 2**20:8.2f} MiB ({r['of_bandwidth_bound'] * 100:5.1f}% of the bandwidth "
              f"bound)  {r['static_instructions']} static instructions")
        busy = "  ".join(f"{e} {st['busy_us']:.1f} ({r['utilization'][e] * 100:.0f}%)"
                         for e, st in r["engines"].items())
        print(f"  busy us (of latency): {busy}  dma {r['dma_busy_us']:.1f} ({r['utilization']['dma'] * 100:.0f}%, "
              f"{r['dma_descriptors']} descriptors); throughput bound {r['throughput_bound_us']:.1f} us")
        if r["port_busy_us"]:  # NeuronCore-v2's shared ports (VectorE with GpSimd on SBUF, with ScalarE on PSUM)
            ports = "  ".join(f"{p} {us:.1f} ({r['utilization'][p] * 100:.0f}%)" for p, us in r["port_busy_us"].items())
            print(f"  shared ports us (of latency): {ports}")


if __name__ == "__main__":
    main()
