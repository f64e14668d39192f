"""Serving benchmark, like `vllm bench serve`, plus the no-engine baseline in the same run.

1. Starts `neuron-opt serve` as a subprocess on a free loopback port (artifact or --model PATH|default).
2. Sends `--num-prompts` random prompts (token ids drawn uniformly from the non-special vocabulary, exactly
   `--input-len` long) to /v1/completions, streaming, greedy, `ignore_eos` so every output has `--output-len`
   tokens; at most `--concurrency` in flight, arrivals at `--request-rate` (Poisson; inf = all at once).
3. Correctness under load (`--check-streams`, default 64): that many concurrent streams, each must arrive
   exactly once, complete, with the asked token count, and equal to the same prompt served alone
   (sequentially, same server): nothing lost, duplicated or mixed.
4. Baseline: HF transformers `generate` (greedy, same prompts, EOS disabled, fp32) serving the requests one
   after another in this process, from the same checkpoint (the default GGUF goes through transformers'
   GGUF loader).

Metric definitions follow vLLM (vllm/benchmarks/serve.py): TTFT = first token chunk - send;
TPOT = (latency - TTFT) / (output tokens - 1) per request; ITL = every gap between consecutive chunks;
output throughput = output tokens / wall time of the run; request throughput = completed requests / wall time.

    python scripts/bench_serve.py --model default --num-prompts 32 --concurrency 16 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    done_markers: int = 0
    error: str = ""


def percentiles(xs: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    if not xs:
        return {f"p{p}": float("nan") for p in ps} | {"mean": float("nan")}
    a = np.asarray(xs) * 1000.0  # ms
    return {f"p{p}": float(np.percentile(a, p)) for p in ps} | {"mean": float(a.mean())}


def summarize(results: list[RequestResult], duration: float, input_len: int) -> dict[str, object]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + input_len * len(ok)) / duration,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([g for r in ok for g in r.itl]),
        "e2el_ms": percentiles([r.latency for r in ok]),
    }


# ---- the server under test -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    is_artifact = (Path(args.model) / "manifest.json").exists()
    src = (
        [args.model]
        if is_artifact
        else ["--model", args.model, "--max-model-len", str(max(256, args.input_len + args.output_len))]
    )
    cmd = [
        sys.executable,
        "-m",
        "neuron_opt.cli",
        "serve",
        *src,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-prefill-tokens",
        str(args.max_prefill_tokens),
    ]
    print("+", " ".join(cmd), file=sys.stderr)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become healthy")


async def one_request(client, url: str, index: int, prompt: list[int], output_len: int) -> RequestResult:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = RequestResult(index)
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    r.done_markers += 1
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = chunk["error"]["message"]
                    continue
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    if c["text"]:
                        now = time.perf_counter()
                        if not r.text:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
                        r.text += c["text"]
        r.latency = time.perf_counter() - t0
        r.ok = r.done_markers == 1 and r.output_tokens == output_len and not r.error
        if not r.ok and not r.error:
            r.error = f"done markers {r.done_markers}, output tokens {r.output_tokens} (want {output_len})"
    except Exception as e:  # noqa: BLE001 -- a benchmark records failures instead of stopping
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run_load(
    url: str, prompts: list[list[int]], output_len: int, concurrency: int, request_rate: float, seed: int
) -> tuple[list[RequestResult], float]:
    import httpx

    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def limited(i: int, p: list[int]) -> RequestResult:
            async with sem:
                return await one_request(client, url, i, p, output_len)

        tasks = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(i, p)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


# ---- HF transformers baseline --------------------------------------------------------------------


def hf_baseline(
    model: str, prompts: list[list[int]], output_len: int, attn: str
) -> tuple[list[RequestResult], float]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from neuron_opt.checkpoint import default_model_path

    path = default_model_path() if model == "default" else Path(model)
    kw = {"dtype": torch.float32, "attn_implementation": attn}
    if path.is_file():  # GGUF: transformers dequantizes it to fp32, like our loader
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    hf.eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: never stop early, never ban EOS
    hf.generation_config.pad_token_id = 0

    class Times(BaseStreamer):
        def __init__(self) -> None:
            self.t: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.t.append(time.perf_counter())

        def end(self) -> None:
            pass

    def gen(ids: list[int], n: int, streamer: Times | None = None) -> torch.Tensor:
        x = torch.tensor([ids])
        with torch.inference_mode():
            return hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, streamer=streamer
            )

    gen(prompts[0], 2)  # warm-up
    results = []
    t_start = time.perf_counter()
    for i, ids in enumerate(prompts):
        st = Times()
        t0 = time.perf_counter()
        out = gen(ids, output_len, st)
        r = RequestResult(i, ok=True, latency=time.perf_counter() - t0, output_tokens=out.shape[1] - len(ids))
        r.ttft = st.t[1] - t0  # the first put() is the prompt, the second the first new token
        r.itl = list(np.diff(st.t[1:]))
        results.append(r)
    return results, time.perf_counter() - t_start


# ---- main ----------------------------------------------------------------------------------------


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, size=length).tolist() for _ in range(n)]  # ids < 100: special tokens


def check_streams(
    url: str, n: int, input_len: int, output_len: int, vocab: int, seed: int
) -> dict[str, object]:
    """n concurrent streams vs the same prompts served alone: lost / duplicated / mixed counts."""
    prompts = make_prompts(n, input_len, vocab, seed + 1)
    alone = [asyncio.run(run_load(url, [p], output_len, 1, float("inf"), seed))[0][0] for p in prompts]
    together, dur = asyncio.run(run_load(url, prompts, output_len, n, float("inf"), seed))
    lost = sum(not r.ok for r in together)
    dup = sum(r.done_markers > 1 for r in together)
    mismatched = [r.index for r, a in zip(together, alone, strict=True) if r.ok and r.text != a.text]
    return {
        "streams": n,
        "input_len": input_len,
        "output_len": output_len,
        "lost_or_incomplete": lost,
        "duplicated": dup,
        "mismatched_vs_alone": len(mismatched),
        "mismatched_indices": mismatched,
        "duration_s": dur,
        "errors": [r.error for r in together if r.error][:5],
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engine, hf = report["engine"], report.get("hf_runs", [])
    names = [f"neuron-opt\nc={r['concurrency']}" for r in engine] + [
        f"HF generate\n({r['attn']})" for r in hf
    ]
    colors = ["tab:blue"] * len(engine) + ["tab:gray"] * len(hf)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, values, title in (
        (a, [r["output_throughput"] for r in engine + hf], "Output throughput (tokens/s)"),
        (b, [r["tpot_ms"]["p50"] for r in engine + hf], "TPOT p50 (ms)"),
    ):
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(title)
    cfg = report["config"]
    title = f"{cfg['model']}: {cfg['num_prompts']} prompts, in {cfg['input_len']} / out {cfg['output_len']}"
    note = report.get("provisional_note")
    fig.suptitle(f"{title} ({note})" if note else title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--concurrency", default="16", help="comma-separated levels, e.g. 1,4,16")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = burst"
    )
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
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
    args = p.parse_args(argv)

    from neuron_opt.api import is_artifact
    from neuron_opt.checkpoint import open_checkpoint

    hf_model = args.hf_model or ("default" if is_artifact(args.model) else args.model)
    vocab = open_checkpoint(hf_model).config.vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    levels = [int(c) for c in args.concurrency.split(",")]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    config = vars(args) | {"hf_model": hf_model, "request_rate": str(args.request_rate)}
    report: dict[str, object] = {
        "config": config,
        "provisional_note": args.note,
        "engine": [],
        "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NEURON_OPT_NUM_THREADS")},
    }
    try:
        wait_healthy(url, proc)
        asyncio.run(run_load(url, prompts[:1], 4, 1, float("inf"), args.seed))  # warm-up
        for c in levels:
            results, dur = asyncio.run(
                run_load(url, prompts, args.output_len, c, args.request_rate, args.seed)
            )
            s = summarize(results, dur, args.input_len) | {"concurrency": c}
            s["errors"] = [r.error for r in results if r.error][:5]
            report["engine"].append(s)
            print(
                f"engine c={c}: {s['output_throughput']:.1f} out tok/s, "
                f"TPOT p50 {s['tpot_ms']['p50']:.1f} ms, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
                f"{s['completed']}/{len(results)} ok",
                file=sys.stderr,
            )
        if args.check_streams:
            report["check"] = check_streams(
                url, args.check_streams, args.check_input_len, args.check_output_len, vocab, args.seed
            )
            print(f"check: {report['check']}", file=sys.stderr)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if not args.no_hf:
        base = prompts[: args.hf_num_prompts] if args.hf_num_prompts else prompts
        runs = []
        for attn in args.hf_attn.split(","):
            results, dur = hf_baseline(hf_model, base, args.output_len, attn)
            runs.append(summarize(results, dur, args.input_len) | {"num_prompts": len(base), "attn": attn})
            print(f"HF sequential ({attn}): {runs[-1]['output_throughput']:.1f} out tok/s", file=sys.stderr)
        report["hf_runs"] = runs
        report["hf"] = max(runs, key=lambda r: r["output_throughput"])  # compare against the fastest baseline
        hf_thr = report["hf"]["output_throughput"]
        for s in report["engine"]:
            s["speedup_vs_hf"] = s["output_throughput"] / hf_thr
        print(
            f"HF sequential (best: {report['hf']['attn']}): {hf_thr:.1f} out tok/s, "
            f"TPOT p50 {report['hf']['tpot_ms']['p50']:.1f} ms",
            file=sys.stderr,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, Path(args.plot))
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
