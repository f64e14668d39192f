"""Run as a script (SPMD mode is per process): context-parallel prefill at tp 2 on the XLA CPU device.

    python device_cp.py CKPT OUT [heads]

Compiles CKPT (an MQA checkpoint: one KV head, so tp 2 forms one KV group of two ranks) twice with `--backend
neuron --tp 2`: flash decoding alone (cp_degree 1) and with context-parallel prefill (cp_degree 2). With `heads`,
CKPT has as many KV heads as tp or more (each rank holds whole KV heads): plain tensor parallelism (cp_degree 1)
against context-parallel prefill over all ranks (cp_degree 2). Each prefills
the same 700-token prompt in two chunks (301 tokens from position 0, then 399 from position 301: an odd start, in
an offset bucket) and decodes greedily. Prints one JSON object: each artifact's greedy tokens, the KV pools' largest
|difference| between the two after the prompt's prefill, and the all-reduce count of each artifact's prefill HLO.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # the package before tests/ (whose neuron_opt/ folder would shadow it)

PROMPT = [(37 * i + 11) % 250 + 3 for i in range(700)]
SPLIT = 301
NEW = 8
SHAPES = dict(max_model_len=1024, prefill_buckets=(256, 512), decode_buckets=(512, 1024))


def run(ckpt: Path, out: Path, cp: int, heads: bool = False) -> tuple[list[int], list, dict]:
    import torch

    from neuron_opt.backends.neuron.backend import hlo_summary
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig
    from neuron_opt.executors import load_model
    from neuron_opt.runtime.runner import DecodeRow

    par = ParallelConfig(tp=2, cp_degree=cp) if heads else ParallelConfig(tp=2, flash_decoding=True, cp_degree=cp)
    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", dtype="float32", parallel=par,
                                    use_cache=False, **SHAPES), log=lambda s: None, progress=False)
    runner = load_model(out).runner
    first = runner.prefill(0, PROMPT[:SPLIT])
    buckets = [runner.last_bucket.key]
    logits = runner.prefill(0, PROMPT[SPLIT:], start=SPLIT)
    buckets.append(runner.last_bucket.key)
    ranks = runner.executor.ranks
    pools = [c.cpu().clone() for c in [*ranks.k_caches, *ranks.v_caches]]
    tokens, pos = [int(logits.argmax())], len(PROMPT)
    for _ in range(NEW - 1):
        logits = runner.decode([DecodeRow(0, tokens[-1], pos)])[0]
        tokens.append(int(logits.argmax()))
        pos += 1
    hlo = {p.name.split(".")[0]: hlo_summary(p.read_text()).get("collectives", {})
           for p in sorted((out / "graphs" / "spmd").glob("prefill_*.hlo.txt"))}
    del first
    return tokens, pools, {"buckets": buckets, "hlo": hlo, "pool_shape": list(pools[0].shape),
                           "pool_dtype": str(pools[0].dtype), "torch": torch.__version__}


def main(ckpt: Path, out: Path, heads: bool = False) -> dict:
    from neuron_opt.backends.neuron.backend import import_xla

    import_xla(dump=True, devices=2)
    plain, plain_pools, plain_info = run(ckpt, out / "fd", 1, heads)
    cp, cp_pools, cp_info = run(ckpt, out / "cp", 2, heads)
    diff = max(float((a - b).abs().max()) for a, b in zip(plain_pools, cp_pools, strict=True))
    equal = all(bool((a == b).all()) for a, b in zip(plain_pools, cp_pools, strict=True))
    return {"tokens_fd": plain, "tokens_cp": cp, "pool_max_diff": diff, "pools_equal": equal,
            "fd": plain_info, "cp": cp_info}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] == ["heads"])))
