"""Time one compiled decode step, executor only: the graph calls of `executor.run` on one prepared step, no
input building, sampling or engine; with `--verify`, also the verify step of the same rows (k + 1 tokens each, the
speculative-decoding graph; its time over the decode step's is the r(B) of docs/speculative.md). For A/B runs
between versions of this repository: run it from each checkout (`PYTHONPATH=<checkout>`) on an artifact that
checkout compiled, alternating, in fresh processes.

    python scripts/bench_decode_step.py ARTIFACT --batches 1,16 --positions 100,400 --json

--json prints {bucket key: median ms of one graph call, ..., "machine": {CPU, ISA, cores, bandwidth, ...}}.
`--breakdown` adds "<bucket key>:split": the median ms of a step's layer graph calls, its head call and the rest
(the embedding, rope tables, row gather and Python of `executor.run`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def split(executor, bucket, inputs, repeats: int) -> dict[str, float]:  # noqa: ANN001
    """Median ms per step of (the layer graph calls, the head call, the rest of `executor.run`) for a cpu executor:
    its routes' containers are wrapped in timers for the measurement and put back after."""
    spent = {"layers": 0.0, "head": 0.0}

    class Timed:
        def __init__(self, inner, kind: str) -> None:  # noqa: ANN001
            self.inner, self.kind = inner, kind

        def run(self, *a):  # noqa: ANN002, ANN202
            t = time.perf_counter()
            try:
                return self.inner.run(*a)
            finally:
                spent[self.kind] += time.perf_counter() - t

        def __call__(self, *a):  # noqa: ANN002, ANN204
            t = time.perf_counter()
            try:
                return self.inner(*a)
            finally:
                spent[self.kind] += time.perf_counter() - t

    routes = executor._routes
    executor._routes = {k: ([Timed(r, "layers") for r in layers], Timed(head, "head"))
                        for k, (layers, head) in routes.items()}
    rows: dict[str, list[float]] = {"layers": [], "head": [], "rest": []}
    try:
        for _ in range(repeats):
            spent.update(layers=0.0, head=0.0)
            t0 = time.perf_counter()
            executor.run(bucket, inputs)
            total = time.perf_counter() - t0
            rows["layers"].append(spent["layers"])
            rows["head"].append(spent["head"])
            rows["rest"].append(total - spent["layers"] - spent["head"])
    finally:
        executor._routes = routes
    return {k: round(1e3 * sorted(v)[len(v) // 2], 3) for k, v in rows.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--batches", default="1,16", help="decode batch sizes")
    p.add_argument("--positions", default="100,400", help="the position every row decodes at (its KV length - 1)")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--verify", action="store_true", help="also time the verify graphs (artifact compiled with "
                                                          "--num-speculative-tokens K)")
    p.add_argument("--breakdown", action="store_true", help="also split each step into its layer graph calls, its "
                                                             "head call and the rest (embedding, rope, Python)")
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
            if args.breakdown:
                for bucket, inputs in steps:
                    out[bucket.key + ":split"] = split(runner.executor, bucket, inputs, args.repeats)
    if args.json:
        from neuron_opt.bench import machine

        print(json.dumps(out | {"machine": machine()}))
    else:
        print("  ".join(f"{k}: {v} ms" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
