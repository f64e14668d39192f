"""Host time and device -> host bytes of one decode step on a neuron artifact, sampling on the host (the graph
returns the logits [B, V], `sample_batch` samples them) against sampling in the graph (it returns the token ids:
docs/neuron_backend.md, "Sampling on the device"). Each step is the runner call plus its sampling, on `--batch` rows
of greedy rows, then of temperature + top-p rows (seeded), the two ways alternating step by step so both see the
same machine.

    PJRT_DEVICE=CPU python scripts/bench_device_sampling.py ARTIFACT --batch 8 --steps 20 --json

--json prints {"greedy": {"host": {...}, "device": {...}}, "top_p": {...}, "machine": {...}}: each way's median
step ms, its share in the graph call (`runner.stats.graph_s`) and the bytes one step moved device -> host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from neuron_opt.executors import load_model
    from neuron_opt.runtime.runner import DecodeRow
    from neuron_opt.runtime.sampling import SamplerState, SamplingParams, device_inputs, device_results, sample_batch

    runner = load_model(args.artifact).runner
    if not runner.samples_on_device:
        raise SystemExit(f"{args.artifact}: its executor does not sample on the device (a neuron artifact does)")
    B, V = args.batch, runner.vocab_size
    for i in range(B):
        runner.prefill(i, [3 + i, 4, 5, 6])
    rows = [DecodeRow(i, 7, 4) for i in range(B)]
    out: dict[str, object] = {"batch": B, "vocab": V, "steps": args.steps}
    for name, params in (("greedy", SamplingParams()), ("top_p", SamplingParams(temperature=0.8, top_p=0.9))):
        states = [SamplerState.create(replace(params, seed=i)) for i in range(B)]
        times: dict[str, list[float]] = {"host": [], "device": []}
        graph: dict[str, list[float]] = {"host": [], "device": []}
        moved: dict[str, int] = {}
        for step in range(args.steps + 1):  # the first round compiles the sampling graph: not counted
            for kind in ("host", "device"):
                g0, t0 = runner.stats.graph_s, time.perf_counter()
                if kind == "host":
                    sample_batch(runner.decode(rows), states, [()] * B)
                else:
                    outs = runner.decode_sampled(rows, device_inputs(states, [()] * B, V))
                    device_results(outs[0].tolist(), None, states)
                if step:
                    times[kind].append(time.perf_counter() - t0)
                    graph[kind].append(runner.stats.graph_s - g0)
                moved[kind] = runner.stats.last_d2h_bytes
        out[name] = {kind: {"step_ms": round(1e3 * statistics.median(times[kind]), 3),
                            "graph_ms": round(1e3 * statistics.median(graph[kind]), 3),
                            "host_ms": round(1e3 * (statistics.median(times[kind]) - statistics.median(graph[kind])),
                                             3),
                            "d2h_bytes": moved[kind]} for kind in times}
    if args.json:
        from neuron_opt.bench import machine

        print(json.dumps(out | {"machine": machine(None)}))
    else:
        for name in ("greedy", "top_p"):
            print(name, out[name])


if __name__ == "__main__":
    main()
