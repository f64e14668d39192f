"""Run as a script (a fresh process per tp: SPMD mode is per process). Compiles a tiny checkpoint with
`--backend neuron` at the given tp (CKPT: an HF directory or a GGUF file), then prints one JSON object: per step the
largest |logit difference| against the eager fp32 reference (teacher forced), the device's own greedy token and the
bucket it ran, and the bytes the device holds.

    python device_parity.py CKPT OUT TP [K [EP [EP_DECODE]]]

EP > 1: a mixture-of-experts checkpoint's experts in EP expert-parallel groups; EP_DECODE (0: as EP) another
degree for the decode and verify graphs (a hybrid layout). K > 0 also compiles verify
buckets of K + 1 tokens (speculative decoding) and scores one verify row at the end
(its largest |logit difference| is the last entry of `diffs`, its bucket the last of `buckets`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # the package before tests/ (whose neuron_opt/ folder would shadow it)
sys.path.append(str(ROOT / "tests"))  # tests/helpers.py


def main(ckpt: Path, out: Path, tp: int, k: int = 0, ep: int = 1, ep_decode: int = 0) -> dict:
    from neuron_opt.backends.neuron.backend import import_xla

    import_xla(dump=True, devices=tp)
    from helpers import eager_runner

    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ParallelConfig
    from neuron_opt.executors import load_model
    from neuron_opt.runtime.runner import DecodeRow, VerifyRow

    par = ParallelConfig(tp=tp, ep=ep, ep_decode=ep_decode or None)
    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", dtype="float32", max_model_len=32,
                                    prefill_buckets=(16, 32), decode_buckets=(16, 32), parallel=par, use_cache=False,
                                    num_speculative_tokens=k),
                     log=lambda s: None, progress=False)
    loaded = load_model(out)
    runner = loaded.runner
    ranks = runner.executor.ranks  # what the device holds: every rank's weights and KV caches
    params = getattr(ranks, "params", None) or dict(ranks.model.named_parameters())
    device_bytes = {"weights": sum(t.numel() * t.element_size() for t in params.values()) // tp,
                    "kv": sum(c.numel() * c.element_size() for c in [*ranks.k_caches, *ranks.v_caches]) // tp}
    ref = eager_runner(ckpt, max_model_len=32, prefill_lens=[16, 32], decode_kv_lens=[16, 32],
                       num_speculative_tokens=k)
    prompt = [(7 * i + 3) % 200 + 3 for i in range(12)]
    diffs, buckets, tokens = [], [], []
    a, b = runner.prefill(0, prompt), ref.prefill(0, prompt)
    diffs.append((a - b).abs().max().item())
    buckets.append(runner.last_bucket.key)
    tokens.append(int(a.argmax()))
    tok, pos = int(b.argmax()), len(prompt)
    for _ in range(16):  # positions 12..27: crosses the decode bucket edge at 16
        a, b = runner.decode([DecodeRow(0, tok, pos)]), ref.decode([DecodeRow(0, tok, pos)])
        diffs.append((a - b).abs().max().item())
        buckets.append(runner.last_bucket.key)
        tokens.append(int(a[0].argmax()))
        tok, pos = int(b[0].argmax()), pos + 1
    if k:  # the last accepted token and k proposals at positions 28.. in one verify step
        rows = [VerifyRow(0, (tok, *[(13 * j + 5) % 200 + 3 for j in range(k)]), pos)]
        a, b = runner.verify(rows), ref.verify(rows)
        diffs.append((a - b).abs().max().item())
        buckets.append(runner.last_bucket.key)
    return {"diffs": diffs, "buckets": buckets, "tokens": tokens, "device_bytes": device_bytes}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), *map(int, sys.argv[3:]))))
