"""Long-context benchmark: TTFT of long prompts against llama.cpp's server, and a multi-turn agent workload with and
without the second KV tier (docs/long_context.md).

The model: the default model (SmolLM2-135M) dequantized to fp32 by transformers' GGUF loader, with a long-context
rope config written into its config.json (`max_position_embeddings` 65,536, linear rope scaling, factor 8: its
8,192 positions stretched eight times), converted for llama.cpp by llama.cpp's own converter
(`convert_hf_to_gguf.py` of the llama-cpp-python sdist, neuron_opt.bench.llamacpp_server) at the same width, so
both servers run the same weights and the same rope.

1. TTFT (`--lens`, default 8,192, 32,768 and 65,536 prompt tokens): one streamed greedy request at a time, one
   token out, a distinct random prompt per request (no prefix cache hit on either server), on our `serve` (cpu
   backend artifact, chunked prefill with `--max-num-batched-tokens`) and on `llama-server` (one slot of the
   longest prompt's context; -t and -tb the usable cores), one server alive at a time, the order alternating by
   round; per length the median over `--rounds` with min and max, and ours / llama.cpp per round.
2. Agent (`--histories` H shared histories of `--history-len` tokens; `--turns` turns each appending
   `--turn-len` tokens to the whole previous prompt; the turns of all histories interleaved round-robin, one request
   at a time) on an artifact whose KV pool (`--pool-histories` x the longest history, in blocks) holds fewer
   histories than H, so a returning turn finds its history evicted from the pool: served without the tier (the
   history is prefilled again) and with `--kv-offloading-size` (restored); the TTFT p50 of returning turns
   (turn 2 on), the tier's hit rate (vllm:external_prefix_cache_hits_total / queries_total) and the pool's.

The JSON names the machine (neuron_opt.bench.RunRecord: CPU, cores, a bandwidth probe, and whether it was idle);
`--require-idle` refuses a busy one. `--quick` runs small sizes that check the script, not a result.

    python scripts/bench_long_context.py --out docs/bench/long_context.json --require-idle
    python scripts/bench_long_context.py --quick --out /tmp/long_context_quick.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import bench_serve as bs  # noqa: E402 (after the sys.path line): the streaming client and the servers' lifecycle

from neuron_opt.bench import RunRecord, rounds_summary  # noqa: E402

MAX_POSITIONS = 65536
ROPE_FACTOR = 8.0  # 8,192 pretrained positions x 8
WIDTHS = {"f32": "float32", "bf16": "bfloat16"}  # llama.cpp outtype -> our artifact's dtype
LLAMACPP_VERSION = "0.3.36"  # the llama-cpp-python whose vendored llama.cpp is built (as tests/llamacpp_gguf.py)


def long_checkpoint(work: Path) -> Path:
    """The default model as an HF directory (fp32) with the long-context rope config."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from neuron_opt.checkpoint import default_model_path

    out = work / "smollm2-long"
    if (out / "config.json").is_file():
        return out
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    out.mkdir(parents=True)
    tok.save_pretrained(out)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)  # transformers marks a GGUF-loaded model quantized: its weights are fp32
    cfg["architectures"] = [type(hf).__name__]  # what save_pretrained writes (converters read it)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)  # the embedding's storage (safetensors keeps one copy)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    cfg["max_position_embeddings"] = MAX_POSITIONS
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": ROPE_FACTOR, "rope_theta": theta}
    cfg.pop("rope_scaling", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def to_gguf(hf_dir: Path, width: str, cache_dir: Path) -> Path:
    """`hf_dir` converted by llama.cpp's converter at `width` (f32 or bf16)."""
    from neuron_opt.bench import llamacpp_server as peer

    out = hf_dir.parent / f"{hf_dir.name}-{width}.gguf"
    if out.is_file():
        return out
    script = peer.ensure_sources(cache_dir, LLAMACPP_VERSION) / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    tmp = out.with_name(out.name + ".tmp")
    r = subprocess.run([sys.executable, str(script), "--outtype", width, "--outfile", str(tmp), str(hf_dir)],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed ({r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
    os.replace(tmp, out)
    return out


def compile_ours(hf_dir: Path, out: Path, dtype: str, max_model_len: int, budget: int, kv_blocks: int = 0) -> Path:
    """A cpu backend artifact of `hf_dir` for contexts of `max_model_len` (prefill chunks of at most `budget`)."""
    if (out / "manifest.json").is_file():
        return out
    cmd = [sys.executable, "-m", "neuron_opt.cli", "compile", "--model", str(hf_dir), "--out", str(out),
           "--backend", "cpu", "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--max-prompt-len", str(min(budget, max_model_len))]
    if kv_blocks:
        cmd += ["--num-kv-blocks", str(kv_blocks)]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out


def start_ours(artifact: Path, port: int, extra: tuple[str, ...]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "neuron_opt.cli", "serve", str(artifact), "--port", str(port),
           "--served-model-name", "bench", *extra]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def serve(proc: subprocess.Popen, url: str, body, warm: list[int]):  # noqa: ANN001, ANN201
    """`body(url)` on the started server `proc`, after two warm-up requests (3 tokens, then `warm`, a prompt no
    measured request shares a block with: each server's first long prefill pays once for what it sets up); the
    server stopped after."""
    try:
        bs.wait_healthy(url, proc, timeout=1800)
        for prompt in ([100, 101, 102], warm):
            (r,), _ = asyncio.run(bs.run_load(url, [prompt], 2, 1, float("inf"), 0))
            if not r.ok:
                raise SystemExit(f"a warm-up request failed: {r.error}")
        return body(url)
    finally:
        bs.stop_server(proc)


def one(url: str, prompt: list[int], output_len: int = 1) -> float:
    """TTFT in seconds of one streamed greedy request."""
    (r,), _ = asyncio.run(bs.run_load(url, [prompt], output_len, 1, float("inf"), 0))
    if not r.ok:
        raise SystemExit(f"a {len(prompt)}-token request failed: {r.error}")
    return r.ttft


def ttft_part(args: argparse.Namespace, hf_dir: Path, work: Path, vocab: int, record: RunRecord) -> dict:
    from neuron_opt import envs
    from neuron_opt.bench import llamacpp_server as peer

    lens = args.lens
    ctx = peer.context_per_slot(lens, 8)
    build = peer.ensure_built(envs.CACHE_DIR, LLAMACPP_VERSION, peer.default_cmake_args())
    gguf = to_gguf(hf_dir, args.width, envs.CACHE_DIR)
    artifact = compile_ours(hf_dir, work / f"ours-{args.width}-{ctx}", WIDTHS[args.width], ctx,
                            args.max_num_batched_tokens)
    cores = len(os.sched_getaffinity(0))
    runs: dict[str, list[dict[int, float]]] = {"ours": [], "llamacpp": []}
    commands: dict[str, str] = {}
    log = work / "llama-server.log"
    for rnd in range(1, args.rounds + 1):
        prompts = {n: bs.make_prompts(1, n, vocab, args.seed + 7919 * rnd + n)[0] for n in lens}
        for who in ("ours", "llamacpp") if rnd % 2 else ("llamacpp", "ours"):
            port = bs.free_port()
            if who == "ours":
                proc = start_ours(artifact, port, ("--max-num-batched-tokens", str(args.max_num_batched_tokens)))
            else:
                proc = bs.start_llama_server(peer.server_command(build.server, gguf, port, cores, cores, 1, ctx),
                                             log)
            commands[who] = bs._port_free(list(proc.args))

            def body(url: str, ps: dict[int, list[int]] = prompts) -> dict[int, float]:
                return {n: one(url, p) for n, p in ps.items()}

            warm = bs.make_prompts(1, min(lens), vocab, args.seed + 1)[0]
            got = serve(proc, f"http://127.0.0.1:{port}", body, warm)
            runs[who].append(got)
            print(f"round {rnd} {who}: " + ", ".join(f"{n}: {t * 1e3:.0f} ms" for n, t in got.items()),
                  file=sys.stderr, flush=True)
    results = {}
    for n in lens:
        ours, llama = [r[n] for r in runs["ours"]], [r[n] for r in runs["llamacpp"]]
        results[n] = {"ours_ms": rounds_summary([1e3 * t for t in ours]),
                      "llamacpp_ms": rounds_summary([1e3 * t for t in llama]),
                      "ours_over_llamacpp": rounds_summary([a / b for a, b in zip(ours, llama, strict=True)])}
    info = peer.system_info(log.read_text()) if log.is_file() else None
    return {"prompt_lens": lens, "rounds": args.rounds, "width": args.width, "results": results, "runs": runs,
            "ours": {"artifact": str(artifact), "command": commands.get("ours"),
                     "max_num_batched_tokens": args.max_num_batched_tokens},
            "llamacpp": build.to_json() | {"gguf": str(gguf), "command": commands.get("llamacpp"),
                                           "threads": cores, "system_info": info}}


def agent_prompts(args: argparse.Namespace, vocab: int) -> list[tuple[int, int, list[int]]]:
    """(history, turn, prompt) in the order sent: turn 1 of every history, then turn 2 of every history, ..."""
    rng = np.random.default_rng(args.seed + 31)
    hist = [rng.integers(3, vocab, args.history_len).tolist() for _ in range(args.histories)]
    out = []
    for turn in range(1, args.turns + 1):
        for h in range(args.histories):
            if turn > 1:
                hist[h] = hist[h] + rng.integers(3, vocab, args.turn_len).tolist()
            out.append((h, turn, list(hist[h])))
    return out


def agent_part(args: argparse.Namespace, hf_dir: Path, work: Path, vocab: int) -> dict:
    longest = args.history_len + (args.turns - 1) * args.turn_len
    block = 32
    max_len = -(-(longest + 8) // 256) * 256
    blocks = args.pool_histories * -(-max_len // block) + 1
    artifact = compile_ours(hf_dir, work / f"agent-{args.width}-{max_len}-{blocks}", WIDTHS[args.width], max_len,
                            args.max_num_batched_tokens, kv_blocks=blocks)
    sends = agent_prompts(args, vocab)
    modes = {"recompute": (), "kv_tier": ("--kv-offloading-size", str(args.kv_offloading_size))}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(1, args.rounds + 1):
        for mode in modes if rnd % 2 else reversed(list(modes)):
            port = bs.free_port()
            proc = start_ours(artifact, port, ("--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                               "--enable-prefix-caching", *modes[mode]))

            def body(url: str) -> dict:
                before = bs.scrape(url)
                ttft = [(h, t, one(url, p, 2)) for h, t, p in sends]
                after = bs.scrape(url)
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                return {"ttft_ms": [(h, t, 1e3 * s) for h, t, s in ttft], "metrics": delta}

            got = serve(proc, f"http://127.0.0.1:{port}", body, bs.make_prompts(1, 256, vocab, args.seed + 2)[0])
            m = got["metrics"]
            returning = [ms for _, t, ms in got["ttft_ms"] if t > 1]
            got |= {"returning_ttft_p50_ms": float(np.median(returning)),
                    "first_turn_ttft_p50_ms": float(np.median([ms for _, t, ms in got["ttft_ms"] if t == 1])),
                    "tier_hit_rate": (m.get("external_prefix_cache_hits_total", 0.0)
                                      / max(1.0, m.get("external_prefix_cache_queries_total", 0.0))),
                    "pool_hit_rate": (m.get("prefix_cache_hits_total", 0.0)
                                      / max(1.0, m.get("prefix_cache_queries_total", 0.0)))}
            runs[mode].append(got)
            print(f"round {rnd} {mode}: returning turns TTFT p50 {got['returning_ttft_p50_ms']:.0f} ms, tier hit "
                  f"rate {got['tier_hit_rate']:.2f}, pool hit rate {got['pool_hit_rate']:.2f}", file=sys.stderr,
                  flush=True)
    p50 = {m: rounds_summary([r["returning_ttft_p50_ms"] for r in rs]) for m, rs in runs.items()}
    return {"histories": args.histories, "history_len": args.history_len, "turns": args.turns,
            "turn_len": args.turn_len, "pool_blocks": blocks, "block_size": block, "max_model_len": max_len,
            "pool_histories": args.pool_histories, "kv_offloading_size_gib": args.kv_offloading_size,
            "artifact": str(artifact), "returning_ttft_p50_ms": p50,
            "recompute_over_tier": rounds_summary([a["returning_ttft_p50_ms"] / b["returning_ttft_p50_ms"] for a, b in
                                                   zip(runs["recompute"], runs["kv_tier"], strict=True)]),
            "tier_hit_rate": rounds_summary([r["tier_hit_rate"] for r in runs["kv_tier"]]), "runs": runs}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    t = report["ttft"]
    lens = t["prompt_lens"]
    for who, label in (("ours_ms", "neuron-opt (cpu backend)"), ("llamacpp_ms", "llama-server")):
        med = [t["results"][n][who]["median"] / 1e3 for n in lens]
        lo = [t["results"][n][who]["min"] / 1e3 for n in lens]
        hi = [t["results"][n][who]["max"] / 1e3 for n in lens]
        a.errorbar(lens, med, yerr=[np.subtract(med, lo), np.subtract(hi, med)], marker="o", capsize=3, label=label)
    a.set(xscale="log", xlabel="prompt tokens", ylabel="TTFT (s)", title="TTFT, one request", ylim=(0, None))
    a.minorticks_off()
    a.set_xticks(lens, [str(n) for n in lens])
    a.legend()
    g = report["agent"]
    modes = ["recompute", "kv_tier"]
    vals = [g["returning_ttft_p50_ms"][m]["median"] for m in modes]
    b.bar(["pool only\n(recompute)", f"with the KV tier\n(hit rate {g['tier_hit_rate']['median']:.2f})"], vals)
    b.set(ylabel="TTFT p50 of returning turns (ms)",
          title=f"agent: {g['histories']} histories of {g['history_len']}+ tokens, pool holds {g['pool_histories']}")
    m = report["machine"]
    busy = "" if report["idle"]["start"]["idle"] and not report["idle"]["warnings"] else "  [machine busy]"
    fig.suptitle(f"{m.get('cpu')}" + ("  [quick: not a result]" if report["quick"] else "") + busy, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_lens(value: str) -> list[int]:
    try:
        lens = sorted({int(v) for v in value.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lens: comma-separated token counts, got {value!r}") from None
    if not lens or lens[0] < 16 or lens[-1] > MAX_POSITIONS - 256:
        raise argparse.ArgumentTypeError(f"--lens: each in 16..{MAX_POSITIONS - 256}, got {value!r}")
    return lens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the JSON report (the plot beside it, .png)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes that check the script (prompts of 512 and 1,024 tokens, 4 histories of 512)")
    p.add_argument("--lens", type=parse_lens, default=None, help="TTFT prompt lengths (default 8192,32768,65536)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of each part (default 3; --quick 1)")
    p.add_argument("--width", choices=sorted(WIDTHS), default="f32", help="both servers' weights (default f32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="our prefill chunk budget")
    p.add_argument("--histories", type=int, default=None, help="agent histories (default 8; --quick 4)")
    p.add_argument("--history-len", type=int, default=None, help="tokens of each history (default 8192; --quick 512)")
    p.add_argument("--turns", type=int, default=3, help="turns per history")
    p.add_argument("--turn-len", type=int, default=None, help="tokens each turn appends (default 256; --quick 64)")
    p.add_argument("--pool-histories", type=int, default=2, help="longest histories the KV pool holds (< histories)")
    p.add_argument("--kv-offloading-size", type=float, default=4.0, help="the tier's GiB (holds every history)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--require-idle", action="store_true", help="refuse to run (or go on) on a busy machine")
    args = p.parse_args(argv)
    q = args.quick
    args.lens = args.lens or ([512, 1024] if q else [8192, 32768, 65536])
    args.rounds = args.rounds or (1 if q else 3)
    args.histories = args.histories or (4 if q else 8)
    args.history_len = args.history_len or (512 if q else 8192)
    args.turn_len = args.turn_len or (64 if q else 256)
    if not 1 <= args.pool_histories < args.histories:
        p.error(f"--pool-histories: must be at least 1 and below --histories ({args.histories}), so that returning "
                "turns find their history evicted")
    record = RunRecord(args.require_idle)
    work = Path(tempfile.mkdtemp(prefix="bench-long-context-"))
    t0 = time.monotonic()
    try:
        hf_dir = long_checkpoint(work)
        vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
        ttft = ttft_part(args, hf_dir, work, vocab, record)
        agent = agent_part(args, hf_dir, work, vocab)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"bench": "long_context", "quick": q, "duration_s": time.monotonic() - t0, **record.finish(),
              "model": {"source": "default (SmolLM2-135M GGUF, dequantized to fp32 by transformers)",
                        "max_position_embeddings": MAX_POSITIONS, "rope": {"rope_type": "linear",
                                                                           "factor": ROPE_FACTOR}},
              "config": {k: str(v) for k, v in vars(args).items()}, "ttft": ttft, "agent": agent}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    for n in args.lens:
        r = ttft["results"][n]
        print(f"TTFT {n:>6} tokens: ours {r['ours_ms']['median']:.0f} ms, llama-server "
              f"{r['llamacpp_ms']['median']:.0f} ms, ours / llama.cpp {r['ours_over_llamacpp']['median']:.2f}")
    print(f"agent: returning turns TTFT p50 {agent['returning_ttft_p50_ms']['recompute']['median']:.0f} ms "
          f"recomputed, {agent['returning_ttft_p50_ms']['kv_tier']['median']:.0f} ms with the tier "
          f"({agent['recompute_over_tier']['median']:.2f}x), tier hit rate {agent['tier_hit_rate']['median']:.2f}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
