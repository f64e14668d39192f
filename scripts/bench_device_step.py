#!/usr/bin/env python
"""What a decode step costs the host, and what sampling in the graph and async scheduling save, in one run: the
host time and device -> host bytes of one decode step with host sampling (the graph returns the logits [B, V]) and
with the graph's own sampling (it returns the token ids), on the cpu backend and on the XLA tier; cpu serving TPOT
at 1 and 8 streams with async scheduling against the synchronous loop; and the planner's predicted TPOT change of
sampling in the graph for Llama-3.1-8B on inf2.48xlarge and trn1.32xlarge.

    python scripts/bench_device_step.py --cpu-model ARTIFACT --xla-model ARTIFACT --xla-python PATH \
        --rounds 3 --out FILE --plot FILE --require-idle
    python scripts/bench_device_step.py --quick --cpu-model PATH --out FILE        # a cheap check of the JSON

The run of record and the artifacts it takes: docs/neuron_backend.md, "Sampling on the device".

Parts (each backend's step measurement in a fresh process; the XLA one under `--xla-python` with PJRT_DEVICE=CPU):
- step: per batch (`--batches`) and kind of row (greedy; temperature 0.8 + top-p 0.9, seeded), the runner's decode
  call and its sampling, the two ways alternating step by step: `host` (`runner.decode` then `sample_batch` on the
  logits) and, where the executor samples in its graphs, `graph` (`runner.decode_sampled`, the ids back). Per way:
  the median step ms, the graph calls' ms (`runner.stats.graph_s`), the host's ms (step less graph), the host
  sampler's ms alone, the bytes the step moved device -> host (`runner.stats`; a cpu backend has no device: 0) and
  the bytes of what the step handed the host (logits or ids); and the process CPU ms of the step and of its
  sampling (`*_cpu_ms`: every thread's, so with `--threads 1` they stand on a busy machine where wall times do
  not). Per batch, `argmax_cpu_ms`: the CPU ms of the argmax of the step's logits, what a graph returning greedy
  ids would still compute on a cpu backend's cores.
- serve: `scripts/bench_async.py`'s levels (one fresh process each, as `serve` runs its engine), synchronous and
  async loop alternating who goes first, round by round; TPOT p50 and the host ms per step.
- planner: `planner.recommend.evaluate` at the decode batch of each stream count: TPOT (the graph samples) and
  `planner.latency.host_sampling_time` (what host sampling adds).
`--quick`: one round, batch 1, a few steps, 1 stream, no bandwidth probe or idle wait; for tests, not a record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLANNER_MODEL = "Llama-3.1-8B"
PLANNER_INSTANCES = (("inf2.48xlarge", 8), ("trn1.32xlarge", 8))  # (instance, tp): the model on 8 NeuronCores
PLANNER_LENGTHS = (1024, 256)  # prompt and output tokens of the planner's traffic


def _kinds() -> dict[str, object]:
    from neuron_opt.runtime.sampling import SamplingParams

    return {"greedy": SamplingParams(), "top_p": SamplingParams(temperature=0.8, top_p=0.9)}


def _median_ms(xs: list[float]) -> float:
    return round(1e3 * statistics.median(xs), 4)


def time_step(runner, batch: int, params, steps: int) -> dict[str, dict]:  # noqa: ANN001
    """One decode step of `batch` rows sampled with `params`, each way the runner can (module docstring)."""
    from neuron_opt.runtime.runner import DecodeRow
    from neuron_opt.runtime.sampling import SamplerState, device_inputs, device_results, sample_batch

    V = runner.vocab_size
    rows = [DecodeRow(i, 7, 4) for i in range(batch)]
    states = [SamplerState.create(replace(params, seed=i)) for i in range(batch)]
    ways = ["host", "graph"] if runner.samples_on_device else ["host"]
    spent: dict[str, dict[str, list[float]]] = {w: {k: [] for k in ("step", "graph", "sample", "step_cpu",
                                                                    "sample_cpu")} for w in ways}
    out: dict[str, dict] = {}
    for step in range(steps + 2):  # the first two rounds compile and warm (the sampling graphs): not counted
        for way in ways:
            g0, c0, t0 = runner.stats.graph_s, time.process_time(), time.perf_counter()
            if way == "host":
                logits = runner.decode(rows)
                s0, sc0 = time.perf_counter(), time.process_time()
                sample_batch(logits, states, [()] * batch)
                handed = logits.numel() * logits.element_size()
            else:
                outs = runner.decode_sampled(rows, device_inputs(states, [()] * batch, V))
                s0, sc0 = time.perf_counter(), time.process_time()
                device_results(outs[0].tolist(), None, states)
                handed = sum(t.numel() * t.element_size() for t in outs)
            t1, c1 = time.perf_counter(), time.process_time()
            if step >= 2:
                for k, v in (("step", t1 - t0), ("graph", runner.stats.graph_s - g0), ("sample", t1 - s0),
                             ("step_cpu", c1 - c0), ("sample_cpu", c1 - sc0)):
                    spent[way][k].append(v)
            out[way] = {"d2h_bytes": runner.stats.last_d2h_bytes, "out_bytes": handed}
    for way in ways:
        s = {k: _median_ms(v) for k, v in spent[way].items()}
        out[way].update(step_ms=s["step"], graph_ms=s["graph"], host_ms=round(s["step"] - s["graph"], 4),
                        sample_ms=s["sample"], step_cpu_ms=s["step_cpu"], sample_cpu_ms=s["sample_cpu"])
    return out


def argmax_cpu_ms(runner, batch: int, repeats: int = 20) -> float:  # noqa: ANN001
    """Process CPU ms of the argmax of a decode step's logits [batch, V]: what a graph that returns greedy ids
    would compute on the same cores (the floor of its cost there)."""
    from neuron_opt.runtime.runner import DecodeRow

    logits = runner.decode([DecodeRow(i, 7, 4) for i in range(batch)])
    spent = []
    for _ in range(repeats + 2):
        c0 = time.process_time()
        logits.argmax(-1)
        spent.append(time.process_time() - c0)
    return _median_ms(spent[2:])


def _bench_async():  # noqa: ANN202
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_async

    return bench_async


def load(model: str, batches: list[int]):  # noqa: ANN201
    """The model as `serve` loads it: an artifact as compiled, a checkpoint (eager) with a KV slot per row."""
    from neuron_opt.api import LLM
    from neuron_opt.executors.loader import is_artifact

    return LLM(model) if is_artifact(model) else LLM(model, batch_size=max(batches))


def measure_steps(llm, batches: list[int], steps: int, threads: int) -> dict:  # noqa: ANN001
    """The step part on a loaded model: each batch and kind of row, each way (`time_step`)."""
    runner = llm.runner
    runner.num_threads = threads
    for i in range(max(batches)):
        runner.prefill(i, [3 + i, 4, 5, 6])
    res: dict[str, object] = {"executor": type(runner.executor).__name__, "vocab": runner.vocab_size,
                              "threads": threads, "steps": steps, "samples_in_graph": runner.samples_on_device,
                              "batches": {}}
    for b in batches:
        res["batches"][str(b)] = {kind: time_step(runner, b, params, steps) for kind, params in _kinds().items()}
        res["batches"][str(b)]["argmax_cpu_ms"] = argmax_cpu_ms(runner, b)
    return res


def step_child(args: argparse.Namespace) -> int:
    """The step part on `--model`, in this process: printed as one JSON line."""
    import torch

    threads = _bench_async().threads_for(args)
    torch.set_num_threads(threads)  # before the load, as `serve` does
    batches = [int(b) for b in args.batches.split(",")]
    print(json.dumps({"model": str(args.model), **measure_steps(load(args.model, batches), batches, args.steps,
                                                                threads)}))
    return 0


def _child_json(cmd: list[str], env: dict[str, str]) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_steps(args: argparse.Namespace, env: dict[str, str], quick_llm) -> dict[str, dict]:  # noqa: ANN001
    """The step part on each backend given, each in a fresh process (`--quick`: the cpu one on `quick_llm`)."""
    out = {}
    for name, model, python, extra in (("cpu", args.cpu_model, sys.executable, {}),
                                       ("xla", args.xla_model, args.xla_python, {"PJRT_DEVICE": "CPU"})):
        if model is None:
            continue
        if name == "cpu" and quick_llm is not None:
            threads = _bench_async().threads_for(args)
            out[name] = {"model": str(model), **measure_steps(quick_llm, [1], args.steps, threads)}
            continue
        cmd = [python, __file__, "--part", "step", "--model", str(model), "--batches", args.batches,
               "--steps", str(args.steps)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out[name] = _child_json(cmd, {**env, **extra})
        print(f"step {name}: {json.dumps(out[name]['batches'])[:400]}", file=sys.stderr, flush=True)
    return out


def run_serve(args: argparse.Namespace, env: dict[str, str], quick_llm) -> tuple[dict, dict]:  # noqa: ANN001
    """scripts/bench_async.py's levels, sync and async interleaved round by round, each in a fresh process
    (`--quick`: on `quick_llm`, in this process): (summary, runs)."""
    from neuron_opt.bench import rounds_summary

    streams = [int(s) for s in args.streams.split(",")]
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for s in streams:
            for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):  # alternate who goes first
                if quick_llm is not None:
                    level = _bench_async().level(quick_llm, mode, argparse.Namespace(
                        threads=args.threads, input_len=args.input_len, output_len=args.output_len, streams=s,
                        requests=0, seed=0))
                else:
                    cmd = [sys.executable, str(ROOT / "scripts" / "bench_async.py"), str(args.serve_model), "--mode",
                           mode, "--streams", str(s), "--requests", "0", "--input-len", str(args.input_len),
                           "--output-len", str(args.output_len)]
                    level = _child_json(cmd + (["--threads", str(args.threads)] if args.threads else []), env)
                runs.setdefault(f"{mode}/{s}", []).append(level)
                print(f"serve round {r + 1} {mode:>5} {s} streams: TPOT p50 {level['tpot_p50_ms']:.2f} ms, host "
                      f"{level['host_ms']:.2f} ms/step", file=sys.stderr, flush=True)
    summary = {}
    for s in streams:
        row = {mode: {k: rounds_summary([lv[k] for lv in runs[f"{mode}/{s}"]])
                      for k in ("tpot_p50_ms", "step_ms", "graph_ms", "host_ms", "sample_ms")}
               for mode in ("sync", "async")}
        row["tpot_change"] = row["async"]["tpot_p50_ms"]["median"] / row["sync"]["tpot_p50_ms"]["median"] - 1
        summary[str(s)] = row
    return summary, runs


def planner_rows(streams: list[int]) -> list[dict]:
    """The planner's TPOT with the graph sampling and with host sampling added, per instance and stream count."""
    from neuron_opt.planner.hardware import get_instance
    from neuron_opt.planner.latency import host_sampling_time
    from neuron_opt.planner.recommend import Deployment, Traffic, evaluate
    from neuron_opt.planner.validation import models

    cfg = models()[PLANNER_MODEL]
    inp, outp = PLANNER_LENGTHS
    rows = []
    for name, tp in PLANNER_INSTANCES:
        for s in streams:
            dep = Deployment(tp=tp, batch=max(streams), max_prompt_len=inp, max_model_len=2 * (inp + outp))
            plan = evaluate(cfg, get_instance(name), dep, Traffic(inp, outp, s), limits=False)
            assert plan.tpot is not None and plan.decode_bucket is not None  # a Neuron instance with traffic
            tpot, host = plan.tpot.total, host_sampling_time(cfg, plan.decode_bucket.batch)
            rows.append({"model": PLANNER_MODEL, "instance": name, "tp": tp, "streams": s,
                         "decode_batch": plan.decode_bucket.batch, "tpot_graph_sampling_ms": round(1e3 * tpot, 3),
                         "host_sampling_ms": round(1e3 * host, 3),
                         "tpot_host_sampling_ms": round(1e3 * (tpot + host), 3),
                         "tpot_change": round(-host / (tpot + host), 4),
                         "logits_bytes": 4 * plan.decode_bucket.batch * cfg.vocab_size,
                         "ids_bytes": 4 * plan.decode_bucket.batch})
    return rows


def plot(doc: dict, out: Path) -> None:
    """Host ms per decode step (host sampling against the graph's) per backend and batch, and serving TPOT p50
    (sync against async) per stream count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels, vals, colors = [], [], []
    for backend, res in doc["step"].items():
        for batch, kinds in res["batches"].items():
            for kind, ways in kinds.items():
                if not isinstance(ways, dict):  # argmax_cpu_ms
                    continue
                for way, m in ways.items():
                    labels.append(f"{backend} b{batch} {kind}\n{way}")
                    vals.append(m["host_ms"])
                    colors.append("#c73" if way == "host" else "#2a7")
    a.bar(range(len(vals)), vals, color=colors)
    a.set_xticks(range(len(vals)), labels, rotation=60, ha="right", fontsize=7)
    a.set_yscale("log")
    a.set_ylabel("host ms per decode step (step less graph calls)")
    a.set_title("host sampling (orange) vs the graph's (green)", fontsize=9)
    serve = doc.get("serve") or {}
    xs = list(serve)
    for i, mode in enumerate(("sync", "async")):
        b.bar([j + 0.4 * i for j in range(len(xs))], [serve[s][mode]["tpot_p50_ms"]["median"] for s in xs], 0.4,
              label=mode)
    b.set_xticks([j + 0.2 for j in range(len(xs))], [f"{s} streams" for s in xs])
    b.set_ylabel(f"TPOT p50 ms, median of {doc['rounds']} rounds")
    b.set_title("cpu serving: async scheduling vs the synchronous loop", fontsize=9)
    b.legend()
    m = doc["machine"]
    fig.suptitle(f"{m['cpu']} ({', '.join(m['isa'])}), load average {m['load_average'][0]:.2f}"
                 + ("" if doc["idle"].get("start", {}).get("idle", True) else " (NOT IDLE)"), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-model", default=None, help="a cpu artifact (or a checkpoint: the eager backend)")
    p.add_argument("--xla-model", default=None, help="a neuron artifact, run on the XLA tier by --xla-python")
    p.add_argument("--xla-python", default=None, help="the python of the torch-xla venv (.venv-xla/bin/python)")
    p.add_argument("--serve-model", default=None, help="the model the serve part runs (default: --cpu-model)")
    p.add_argument("--batches", default="1,8", help="decode batches of the step part")
    p.add_argument("--steps", type=int, default=30, help="steps per way, batch and kind of row")
    p.add_argument("--streams", default="1,8", help="stream counts of the serve part (and the planner's)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the serve part")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: serve's thread policy)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout)")
    p.add_argument("--plot", type=Path, default=None, help="write the plot here (a .png)")
    p.add_argument("--require-idle", action="store_true", help="refuse to run, or to finish, on a busy machine")
    p.add_argument("--quick", action="store_true", help="batch 1, 3 steps, 1 stream, 1 round, 8 output tokens, "
                                                        "no bandwidth probe or idle wait: a check, not a record")
    p.add_argument("--part", choices=["step"], help=argparse.SUPPRESS)  # a child's part
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part is None and args.cpu_model is None and args.xla_model is None:
        p.error("give --cpu-model and/or --xla-model")
    if (args.xla_model is None) != (args.xla_python is None):
        p.error("--xla-model and --xla-python go together (the XLA tier runs in its own venv)")
    if args.quick:
        if args.require_idle:
            p.error("--quick is a check, not a record: it does not take --require-idle")
        args.batches, args.steps, args.streams, args.rounds, args.input_len, args.output_len = "1", 3, "1", 1, 16, 8
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    args.serve_model = args.serve_model or args.cpu_model
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.part == "step":
        return step_child(args)
    from neuron_opt.bench import CpuWatch, RunRecord, busy_reasons, machine

    quick_llm = None
    if args.quick:  # no idle wait or bandwidth probe, one process: the load average and the others' use are recorded
        watch, rec = CpuWatch(), {"machine": machine(None)}
        quick_llm = load(args.cpu_model, [1]) if args.cpu_model is not None else None
    else:
        record = RunRecord(args.require_idle)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    doc: dict[str, object] = {"bench": "device_step", "quick": args.quick, "batches": args.batches,
                              "steps": args.steps, "streams": args.streams, "rounds": args.rounds,
                              "input_len": args.input_len, "output_len": args.output_len,
                              "step": run_steps(args, env, quick_llm)}
    if args.serve_model is not None:
        doc["serve_model"] = str(args.serve_model)
        doc["serve"], doc["serve_runs"] = run_serve(args, env, quick_llm if args.serve_model == args.cpu_model
                                                    else None)
    doc["planner"] = planner_rows([int(s) for s in args.streams.split(",")])
    if args.quick:
        run = watch.stop()
        reasons = busy_reasons(run, os.getloadavg()[0], len(os.sched_getaffinity(0)))
        rec["idle"] = {"start": {"idle": not reasons, "reasons": reasons}, "run": run}
    doc.update(rec if args.quick else record.finish())
    text = json.dumps(doc, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    else:
        print(text)
    if args.plot is not None:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
