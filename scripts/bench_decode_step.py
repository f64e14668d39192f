"""Time one compiled decode step, executor only: the graph calls of `executor.run` on one prepared step, no
input building, sampling or engine; with `--verify`, also the verify step of the same rows (k + 1 tokens each, the
speculative-decoding graph; its time over the decode step's is the r(B) of docs/speculative.md). For A/B runs
between versions of this repository: run it from each checkout (`PYTHONPATH=<checkout>`) on an artifact that
checkout compiled, alternating, in fresh processes.

    python scripts/bench_decode_step.py ARTIFACT --batches 1,16 --positions 100,400 --json

--json prints {bucket key: median ms of one graph call, ..., "machine": {CPU, ISA, cores, bandwidth, ...}}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--batches", default="1,16", help="decode batch sizes")
    p.add_argument("--positions", default="100,400", help="the position every row decodes at (its KV length - 1)")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--verify", action="store_true", help="also time the verify graphs (artifact compiled with "
                                                          "--num-speculative-tokens K)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from neuron_opt.api import LLM
    from neuron_opt.runtime.runner import DecodeRow, VerifyRow

    runner = LLM(args.artifact).runner
    batches = [int(b) for b in args.batches.split(",")]
    positions = [int(x) for x in args.positions.split(",")]
    for s in range(max(batches)):
        runner.prefill(s, list(range(100, 100 + min(positions))))
    run = runner.executor.run
    out = {}
    for B in batches:
        for pos in positions:
            seen = {}

            def spy(bucket, inputs, seen=seen, **kw):
                seen["step"] = (bucket, inputs)
                return run(bucket, inputs, **kw)

            runner.executor.run = spy
            steps = []
            runner.decode([DecodeRow(s, 5, pos) for s in range(B)])
            steps.append(seen["step"])
            if args.verify:
                runner.verify([VerifyRow(s, (5,) * runner.verify_len, pos) for s in range(B)])
                steps.append(seen["step"])
            runner.executor.run = run
            for _ in range(3):
                for bucket, inputs in steps:
                    run(bucket, inputs)
            times: dict[str, list[float]] = {bucket.key: [] for bucket, _ in steps}
            for _ in range(args.repeats):  # the phases alternate: both see the same machine state
                for bucket, inputs in steps:
                    t0 = time.perf_counter()
                    run(bucket, inputs)
                    times[bucket.key].append(time.perf_counter() - t0)
            for key, ts in times.items():
                out[key] = round(1e3 * sorted(ts)[len(ts) // 2], 3)  # median ms
    if args.json:
        from neuron_opt.bench import machine

        print(json.dumps(out | {"machine": machine()}))
    else:
        print("  ".join(f"{k}: {v} ms" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
