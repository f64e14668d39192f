"""The serving benchmark's command line (scripts/bench_serve.py): arguments, their checks, and the default
scenario (load at each concurrency against the HF baseline, rounds interleaved)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from neuron_opt.artifact import is_artifact_dir
from neuron_opt.bench import MachineBusyError, RunRecord, llc_bytes, read_bandwidth_gbs
from neuron_opt.bench.serve import __doc__ as serve_doc
from neuron_opt.bench.serve.client import (
    ROOT,
    ab_versions,
    check_streams,
    free_port,
    hf_baseline,
    make_prompts,
    over_rounds,
    plot,
    run_load,
    serving_mbu,
    serving_step_bytes,
    start_server,
    stop_server,
    summarize,
    wait_healthy,
    write_report,
)
from neuron_opt.bench.serve.fleet import plot_data_parallel, plot_routing, scenario_data_parallel, scenario_routing
from neuron_opt.bench.serve.image import plot_image, scenario_image
from neuron_opt.bench.serve.kv import scenario_capacity, scenario_long_prompts, scenario_shared_prefix
from neuron_opt.bench.serve.lora import check_lora_args, plot_lora, scenario_lora
from neuron_opt.bench.serve.peer import add_peer_args, check_peer_args, scenario_peer
from neuron_opt.bench.serve.speculative import plot_speculative, scenario_speculative
from neuron_opt.bench.serve.structured import plot_structured, scenario_structured


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=serve_doc.split("\n\n")[0])
    p.add_argument(
        "--model", default="default", help="artifact directory, HF checkpoint dir, GGUF, or 'default'"
    )
    p.add_argument(
        "--hf-model",
        default=None,
        help="checkpoint for the HF baseline (default: --model, or 'default' when --model is an artifact)",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default=None,
                   help="comma-separated levels, e.g. 1,4,16 (default: 16; 1,8 for --scenario image)")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = burst"
    )
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--budget-flag", default="--max-num-batched-tokens",
                   help="the serve flag that sets the step's token budget (--max-prefill-tokens before the block KV "
                        "cache: for --baseline-source)")
    p.add_argument("--baseline-source", type=Path, default=None,
                   help="another checkout of this repository: its server runs the same load on --baseline-model, "
                        "alternating with ours (an A/B between versions in one run)")
    p.add_argument("--baseline-model", default=None, help="the artifact --baseline-source serves")
    p.add_argument("--baseline-budget-flag", default="--max-prefill-tokens")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds: alternations between the setups compared (load: the server's levels and the HF "
                        "baseline; figures are the medians of the rounds)")
    p.add_argument("--require-idle", action="store_true",
                   help="refuse to run, or to write the report, when the machine is not idle (other processes busy "
                        "on the cores, a high load average) instead of recording a warning in it")
    p.add_argument("--scenario", default="load",
                   choices=["load", "shared-prefix", "long-prompts", "capacity", "speculative", "structured", "peer",
                            "lora", "image"],
                   help="load: the serving benchmark above; shared-prefix, long-prompts and capacity measure the block "
                        "KV cache (prefix caching, chunked prefill, capacity; docs/serving.md); speculative: plain "
                        "against prompt-lookup serving on chat prompts (docs/speculative.md); structured: TPOT "
                        "under a JSON schema against free decoding (docs/serving.md); peer: ours against llama.cpp's "
                        "llama-server on the same weights (--pair; docs/benchmarks.md); lora: the base model alone "
                        "against a mix of LoRA adapters on one --enable-lora artifact (docs/lora.md); image: one "
                        "image and a question per chat request on a vision-language --model against HF generate "
                        "(docs/multimodal.md)")
    p.add_argument("--make-tiny-vlm", type=Path, default=None, metavar="DIR",
                   help="--scenario image: write a random Idefics3 checkpoint (SmolVLM's architecture, the default "
                        "model's tokenizer; neuron_opt/bench/tiny_vlm.py) to DIR and serve it (instead of --model)")
    p.add_argument("--tiny-vlm-shape", default=None, choices=["tiny", "256m"],
                   help="--make-tiny-vlm's shapes: tiny (the tests' model, default) or 256m (SmolVLM-256M's "
                        "encoder and decoder shapes, one 512-pixel tile per image)")
    p.add_argument("--lora-adapters", type=int, default=None, metavar="N",
                   help="--scenario lora: random PEFT adapters made and loaded (default: the artifact's --max-loras)")
    p.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="--scenario lora: their rank (default: the artifact's --max-lora-rank)")
    p.add_argument("--spec-workload", default="grounded", choices=["grounded", "open-ended"],
                   help="the speculative scenario's prompts (neuron_opt/bench/spec_workloads.py)")
    p.add_argument("--data-parallel", default=None, metavar="N[,N...]",
                   help="the load on the single-process server and on `serve --data-parallel N` for each N (Ray "
                        "Serve, the `cluster` extra), alternating --rounds times; ratios to the single process "
                        "(docs/scale_out.md)")
    p.add_argument("--routing", default=None, metavar="POLICY[,POLICY...]",
                   help="with --data-parallel N (one N): the routing scenario, `serve --data-parallel N --routing P` "
                        "for each policy (prefix, load) and a single-process server on --prefix-groups groups of "
                        "--group-requests requests, each a group's --prefix-len-token prefix and an --input-len-token "
                        "tail: the cluster's prefix-cache hit rate and TTFT per policy (docs/scale_out.md)")
    p.add_argument("--prefix-groups", type=int, default=16)
    p.add_argument("--group-requests", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--routing-balance-threshold", type=int, default=None,
                   help="passed to serve (default: serve's)")
    p.add_argument(
        "--check-streams", type=int, default=64, help="concurrent streams for the correctness check (0: skip)"
    )
    p.add_argument("--check-input-len", type=int, default=32)
    p.add_argument("--check-output-len", type=int, default=16)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="baseline on the first N prompts only (sequential throughput does not depend on N)",
    )
    p.add_argument(
        "--hf-attn",
        default="eager,sdpa",
        help="HF attention implementations to measure; speedups use the fastest (sdpa's CPU kernel was "
        "several times slower per token than eager attention for this model on our 2-core machine)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "docs" / "bench_serve.json"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "bench_serve.png"))
    p.add_argument(
        "--note", default="", help="free text stored in the report (e.g. 'provisional: shared machine')"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    add_peer_args(p)
    args = p.parse_args(argv)

    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    args.concurrency = args.concurrency or ("1,8" if args.scenario == "image" else "16")
    check_image_args(p, args)
    if args.scenario == "peer":
        check_peer_args(p, args)
    if args.scenario == "lora":
        check_lora_args(p, args)
    elif args.lora_adapters is not None or args.lora_rank is not None:
        p.error("--lora-adapters / --lora-rank: only with --scenario lora")
    if args.routing is not None:
        if not args.data_parallel or not args.data_parallel.isdigit() or int(args.data_parallel) < 2:
            p.error("--routing: needs --data-parallel N with one N >= 2")
        if not args.routing or any(x not in ("prefix", "load") for x in args.routing.split(",")):
            p.error(f"--routing: a comma-separated list of prefix, load; got {args.routing!r}")
        for name in ("prefix_groups", "group_requests", "prefix_len", "input_len"):
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    try:
        return run(args)
    except MachineBusyError as e:
        print(f"bench_serve: {e}", file=sys.stderr)
        return 3


def check_image_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--scenario image's model: --model (a vision-language checkpoint or artifact; --hf-model the checkpoint for
    an artifact) or --make-tiny-vlm, not both; --make-tiny-vlm and --tiny-vlm-shape only with it."""
    if args.scenario != "image":
        if args.make_tiny_vlm is not None or args.tiny_vlm_shape is not None:
            p.error("--make-tiny-vlm / --tiny-vlm-shape: only with --scenario image")
        return
    if args.make_tiny_vlm is None:
        if args.tiny_vlm_shape is not None:
            p.error("--tiny-vlm-shape: only with --make-tiny-vlm")
        if args.model == "default":
            p.error("--scenario image: give --model (a vision-language checkpoint or artifact) or --make-tiny-vlm DIR")
    elif args.model != "default" or args.hf_model is not None:
        p.error("--make-tiny-vlm: serves the checkpoint it writes; give it or --model / --hf-model, not both")


def run(args: argparse.Namespace) -> int:
    from neuron_opt.api import is_artifact
    from neuron_opt.checkpoint import open_checkpoint

    record = RunRecord(args.require_idle)  # idle check, machine and bandwidth probe, before the run
    if args.scenario == "image":
        return write_report(args, run_image(args) | {"note": args.note}, plot_image, record)
    hf_model = args.hf_model or ("default" if is_artifact(args.model) else args.model)
    vocab = open_checkpoint(hf_model).config.vocab_size
    if args.scenario == "peer":
        from neuron_opt.bench.llamacpp_server import plot as plot_peer

        return write_report(args, scenario_peer(args, vocab, record) | {"note": args.note}, plot_peer, record)
    if args.scenario == "lora":
        return write_report(args, scenario_lora(args, vocab) | {"note": args.note}, plot_lora, record)
    if args.routing:
        rep = scenario_routing(args, vocab) | {"note": args.note, "config": {k: str(v) for k, v in vars(args).items()}}
        return write_report(args, rep, plot_routing, record)
    if args.data_parallel:
        rep = scenario_data_parallel(args, vocab) | {"note": args.note, "config": {k: str(v) for k, v in
                                                                                    vars(args).items()}}
        return write_report(args, rep, plot_data_parallel, record)
    if args.scenario != "load":
        if args.scenario == "speculative":
            rep = scenario_speculative(args, vocab) | {"note": args.note}
            return write_report(args, rep, plot_speculative, record)
        if args.scenario == "structured":
            rep = scenario_structured(args, vocab) | {"note": args.note}
            return write_report(args, rep, plot_structured, record)
        fn = {"shared-prefix": scenario_shared_prefix, "long-prompts": scenario_long_prompts,
              "capacity": scenario_capacity}[args.scenario]
        return write_report(args, fn(args, vocab) | {"note": args.note}, record=record)
    if args.baseline_source is not None:
        prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
        budget = (args.budget_flag, str(args.max_num_batched_tokens))
        return write_report(args, ab_versions(args, prompts, int(args.concurrency.split(",")[-1]), budget),
                            record=record)
    return write_report(args, scenario_load(args, vocab, hf_model), plot, record)


def run_image(args: argparse.Namespace) -> dict[str, object]:
    """--scenario image: its model written first with --make-tiny-vlm; the checkpoint that renders the requests and
    runs the HF baseline checked to be a vision-language one."""
    from neuron_opt.api import is_artifact
    from neuron_opt.bench.tiny_vlm import make_idefics3
    from neuron_opt.errors import ConfigError
    from neuron_opt.multimodal.vision import is_multimodal

    if args.make_tiny_vlm is not None:
        shape = args.tiny_vlm_shape or "tiny"
        args.model = str(make_idefics3(args.make_tiny_vlm, args.seed, shape))
        print(f"wrote a random Idefics3 checkpoint ({shape}) to {args.model}", file=sys.stderr)
    hf_model = args.hf_model or args.model
    if is_artifact(hf_model) or not is_multimodal(hf_model):
        raise ConfigError(f"--scenario image: {hf_model} is not a vision-language checkpoint directory (the requests "
                          "are rendered, and the HF baseline run, from one: --hf-model for an artifact's)")
    return scenario_image(args, hf_model)


def _load_round(url: str, args: argparse.Namespace, prompts: list[list[int]], levels: list[int], rnd: int,
                engine: dict[int, list[dict]], hf: dict, hf_prompts: list[list[int]],
                hf_runs: dict[str, list[dict]]) -> None:
    """One round of the load scenario: every concurrency level on the server, then every HF baseline."""
    for c in levels:
        results, dur = asyncio.run(run_load(url, prompts, args.output_len, c, args.request_rate, args.seed))
        s = summarize(results, dur, args.input_len) | {"concurrency": c, "round": rnd}
        s["errors"] = [r.error for r in results if r.error][:5]
        engine[c].append(s)
        print(f"round {rnd} engine c={c}: {s['output_throughput']:.1f} out tok/s, TPOT p50 "
              f"{s['tpot_ms']['p50']:.1f} ms, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
              f"{s['completed']}/{len(results)} ok", file=sys.stderr)
    for attn, serve in hf.items():
        results, dur = serve(hf_prompts, args.output_len)
        hf_runs[attn].append(summarize(results, dur, args.input_len) | {"round": rnd})
        print(f"round {rnd} HF sequential ({attn}): {hf_runs[attn][-1]['output_throughput']:.1f} out tok/s",
              file=sys.stderr)


def scenario_load(args: argparse.Namespace, vocab: int, hf_model: str) -> dict[str, object]:
    """The serving benchmark: --rounds rounds of every --concurrency level on one server and of the HF baseline
    (each attention of --hf-attn) in this process, alternating; medians of the rounds (over_rounds)."""
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    levels = [int(c) for c in args.concurrency.split(",")]
    hf = {} if args.no_hf else {attn: hf_baseline(hf_model, attn) for attn in args.hf_attn.split(",")}
    hf_prompts = prompts[: args.hf_num_prompts] if args.hf_num_prompts else prompts
    engine: dict[int, list[dict]] = {c: [] for c in levels}
    hf_runs: dict[str, list[dict]] = {attn: [] for attn in hf}
    report: dict[str, object] = {
        "config": vars(args) | {"hf_model": hf_model, "request_rate": str(args.request_rate), "baseline_source": None},
        "provisional_note": args.note, "rounds": args.rounds,
        "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NEURON_OPT_NUM_THREADS",
                                                   "NEURON_OPT_THREAD_POLICY", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, (args.budget_flag, str(args.max_num_batched_tokens)))
    try:
        wait_healthy(url, proc)
        asyncio.run(run_load(url, prompts[:1], 4, 1, float("inf"), args.seed))  # warm-up
        for rnd in range(1, args.rounds + 1):
            _load_round(url, args, prompts, levels, rnd, engine, hf, hf_prompts, hf_runs)
        if args.check_streams:
            report["check"] = check_streams(
                url, args.check_streams, args.check_input_len, args.check_output_len, vocab, args.seed
            )
            print(f"check: {report['check']}", file=sys.stderr)
    finally:
        stop_server(proc)
    report["engine"] = [over_rounds(engine[c]) | {"concurrency": c} for c in levels]
    report["mem_bw_gbs"] = bw = read_bandwidth_gbs()  # probed after the load, as the decode benchmark does
    llc = llc_bytes()
    for s in report["engine"]:
        s["errors"] = [e for r in s["rounds"] for e in r["errors"]][:5]
        # MBU: a step's bytes (weights as stored, KV at the mean context) x steps/s (1 / TPOT p50) over the probe
        if is_artifact_dir(Path(args.model)):
            s["step_bytes"] = serving_step_bytes(Path(args.model), s["concurrency"],
                                                 args.input_len + args.output_len // 2)
            s["mbu"] = serving_mbu(s["step_bytes"], s["tpot_ms"]["p50"], bw)
            s["fits_llc"] = None if llc is None else s["step_bytes"] <= llc
        print(f"engine c={s['concurrency']}: {s['output_throughput']:.1f} out tok/s (rounds "
              f"{s['output_throughput_min']:.1f}-{s['output_throughput_max']:.1f}), TPOT p50 "
              f"{s['tpot_ms']['p50']:.1f} ms, TTFT p50 {s['ttft_ms']['p50']:.0f} ms"
              + (f", MBU {s['mbu']:.0%}" if "mbu" in s else "")
              + (" (fits the last-level cache)" if s.get("fits_llc") else ""), file=sys.stderr)
    if hf:
        report["hf_runs"] = [over_rounds(hf_runs[a]) | {"num_prompts": len(hf_prompts), "attn": a} for a in hf]
        report["hf"] = max(report["hf_runs"], key=lambda r: r["output_throughput"])  # the fastest baseline
        hf_thr = report["hf"]["output_throughput"]
        # per round: against that round's fastest HF baseline
        best_hf = [max(hf_runs[a][i]["output_throughput"] for a in hf) for i in range(args.rounds)]
        for s in report["engine"]:
            s["speedup_vs_hf"] = s["output_throughput"] / hf_thr
            s["speedup_vs_hf_rounds"] = [r["output_throughput"] / b for r, b in zip(s["rounds"], best_hf,
                                                                                    strict=True)]
        print(f"HF sequential (best: {report['hf']['attn']}): {hf_thr:.1f} out tok/s (rounds "
              f"{report['hf']['output_throughput_min']:.1f}-{report['hf']['output_throughput_max']:.1f}), "
              f"TPOT p50 {report['hf']['tpot_ms']['p50']:.1f} ms", file=sys.stderr)
    return report

