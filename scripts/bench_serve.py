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
   GGUF loader), loaded and warmed up once.
5. Rounds (`--rounds`): every concurrency level on the server, then the HF baseline, again and again while the
   server stays up (idle between its loads): every figure is the median of the rounds, throughput with its min
   and max, and the ratio to HF is taken per round as well.

`--scenario peer` puts llama.cpp's own server (`llama-server`, built once from the llama.cpp that the installed
llama-cpp-python vendors) beside ours on the same weights, one pair of servers per `--pair` width: the same prompts
through the same streaming client, one server alive at a time, rounds interleaved (neuron_opt.bench.llamacpp_server
has the peer's build and configuration).

`--scenario lora` serves one `--enable-lora` artifact with random PEFT adapters made by the script on HF's model of
the same weights (loaded through /v1/load_lora_adapter, timed): the same prompts on the base model alone and as a mix
over the adapters and the base, rounds interleaved; the mixed / base throughput and TPOT ratios per level.

Every report records the machine (CPU model, ISA flags, cores, a bandwidth probe, torch) and whether it was idle
before and during the run (neuron_opt.bench.RunRecord); `--require-idle` refuses a busy machine.

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
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuron_opt.bench import MachineBusyError, RunRecord, rounds_summary  # noqa: E402 (after the sys.path line)


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    finish_reason: str = ""
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


def start_server(args: argparse.Namespace, port: int, extra: tuple[str, ...] = (), model: str | None = None,
                 source: Path = ROOT) -> subprocess.Popen:
    """`neuron-opt serve` from the checkout `source` (another version of this repository, for an A/B)."""
    model = model or args.model
    is_artifact = (Path(model) / "manifest.json").exists()
    src = (
        [model]
        if is_artifact
        else ["--model", model, "--max-model-len", str(max(256, args.input_len + args.output_len))]
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
        *extra,
    ]
    print("+", " ".join(cmd), file=sys.stderr)
    env = {**os.environ, "PYTHONPATH": str(source)}
    return subprocess.Popen(cmd, cwd=source, stdout=sys.stderr, stderr=sys.stderr, env=env)


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


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


async def one_request(client, url: str, index: int, prompt: list[int] | str, output_len: int,
                      delay: float = 0.0, extra: dict | None = None) -> RequestResult:
    """A streamed greedy request. `prompt`: token ids for /v1/completions with `ignore_eos` (exactly `output_len`
    tokens come back), or a user message for /v1/chat/completions whose answer ends at EOS (at most
    `output_len`). `extra`: more request fields (a response_format, say)."""
    chat = isinstance(prompt, str)
    body = {
        "model": "bench",
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | ({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt, "ignore_eos": True})
    body |= extra or {}
    r = RequestResult(index)
    if delay:
        await asyncio.sleep(delay)
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"),
                                 json=body) as resp:
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
                    if c.get("finish_reason"):
                        r.finish_reason = c["finish_reason"]
                    if text := (c["delta"].get("content") if chat else c["text"]):
                        now = time.perf_counter()
                        if not r.text:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
                        r.text += text
        r.latency = time.perf_counter() - t0
        length_ok = 0 < r.output_tokens <= output_len if chat else r.output_tokens == output_len
        r.ok = r.done_markers == 1 and length_ok and not r.error
        if not r.ok and not r.error:
            r.error = f"done markers {r.done_markers}, output tokens {r.output_tokens} (want {output_len})"
    except Exception as e:  # noqa: BLE001 -- a benchmark records failures instead of stopping
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run_load(
    url: str, prompts: list[list[int]] | list[str], output_len: int, concurrency: int, request_rate: float, seed: int,
    extra: dict | None = None, models: list[str] | None = None,
) -> tuple[list[RequestResult], float]:
    """`models`: each request's `model` (a LoRA adapter's name, say); default the served name."""
    import httpx

    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(concurrency)
    # a fresh connection per request (no keep-alive), for every server alike: llama-server closes a kept-alive
    # connection after a few requests, and a request sent on it as it closes fails without a response
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def limited(i: int, p: list[int]) -> RequestResult:
            more = extra if models is None else (extra or {}) | {"model": models[i]}
            async with sem:
                return await one_request(client, url, i, p, output_len, extra=more)

        tasks = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(i, p)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


# ---- HF transformers baseline --------------------------------------------------------------------


def load_hf_model(model: str, attn: str = "eager"):  # noqa: ANN201
    """HF transformers' model of checkpoint `model` ('default': the default GGUF, which transformers dequantizes to
    fp32 like our loader), fp32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from neuron_opt.checkpoint import default_model_path

    path = default_model_path() if model == "default" else Path(model)
    kw = {"dtype": torch.float32, "attn_implementation": attn}
    if path.is_file():
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    return hf.eval()


def hf_baseline(model: str, attn: str):  # noqa: ANN201
    """HF transformers with `attn` attention, loaded and warmed up: a function serving prompts one after another,
    (prompts, output_len) -> (results, wall seconds)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    hf = load_hf_model(model, attn)
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

    gen(list(range(100, 132)), 2)  # warm-up

    def serve(prompts: list[list[int]], output_len: int) -> tuple[list[RequestResult], float]:
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

    return serve


# ---- main ----------------------------------------------------------------------------------------


def over_rounds(rounds: list[dict[str, object]]) -> dict[str, object]:
    """One setup's rounds (summarize() each) as one figure: output throughput the median of the rounds with their
    min and max, every other rate and latency percentile the median of the rounds'; counts summed."""
    thr = rounds_summary([r["output_throughput"] for r in rounds])
    out: dict[str, object] = {"rounds": rounds, "output_throughput": thr["median"],
                              "output_throughput_min": thr["min"], "output_throughput_max": thr["max"],
                              "completed": sum(r["completed"] for r in rounds),
                              "failed": sum(r["failed"] for r in rounds)}
    for key in ("request_throughput", "total_token_throughput", "duration_s"):
        out[key] = float(np.median([r[key] for r in rounds]))
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        out[key] = {p: float(np.median([r[key][p] for r in rounds])) for p in rounds[0][key]}
    return out


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
    thr = [r["output_throughput"] for r in engine + hf]
    span = [[v - r.get("output_throughput_min", v) for v, r in zip(thr, engine + hf, strict=True)],
            [r.get("output_throughput_max", v) - v for v, r in zip(thr, engine + hf, strict=True)]]
    for ax, values, err, title in (
        (a, thr, span, f"Output throughput (tokens/s), median of {report.get('rounds', 1)} rounds (min-max)"),
        (b, [r["tpot_ms"]["p50"] for r in engine + hf], None, "TPOT p50 (ms), median of the rounds"),
    ):
        bars = ax.bar(names, values, color=colors, yerr=err, capsize=3)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(title)
    cfg = report["config"]
    title = f"{cfg['model']}: {cfg['num_prompts']} prompts, in {cfg['input_len']} / out {cfg['output_len']}"
    note = report.get("provisional_note")
    fig.suptitle(f"{title} ({note})" if note else title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- block KV cache scenarios --------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as {name: value} (our model label only; histograms skipped)."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("neuron_opt:", "vllm:")) and "{" in line:
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            if not name.endswith(("_bucket", "_sum", "_count", "_created")):
                out[name.split(":", 1)[1]] = float(value)
    return out


async def poll_running(url: str, stop: asyncio.Event, every: float = 0.05) -> list[float]:
    """num_requests_running, sampled until `stop` is set."""
    import httpx

    seen: list[float] = []
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            text = (await client.get(url + "/metrics")).text
            seen += [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                     if ln.startswith("vllm:num_requests_running{")]
            await asyncio.sleep(every)
    return seen


def with_server(args: argparse.Namespace, extra: tuple[str, ...], body) -> object:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, extra)
    try:
        wait_healthy(url, proc)
        asyncio.run(run_load(url, [[100, 101, 102]], 2, 1, float("inf"), 0))  # warm-up
        return body(url)
    finally:
        stop_server(proc)


def scenario_shared_prefix(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """64 requests sharing a 1,024-token system prompt, 32 distinct tokens each, 32 out: TTFT with and without
    prefix caching, alternating `--rounds` times."""
    system = make_prompts(1, 1024, vocab, args.seed)[0]
    prompts = [system + tail for tail in make_prompts(64, 32, vocab, args.seed + 1)]
    budget = ("--max-num-batched-tokens", str(args.max_num_batched_tokens))
    runs: dict[str, list[dict[str, object]]] = {"prefix_caching": [], "no_prefix_caching": []}
    for _ in range(args.rounds):
        for mode, flag in (("no_prefix_caching", "--no-enable-prefix-caching"),
                           ("prefix_caching", "--enable-prefix-caching")):
            def body(url: str) -> dict[str, object]:
                results, dur = asyncio.run(run_load(url, prompts, 32, int(args.concurrency), float("inf"), 0))
                return summarize(results, dur, len(prompts[0])) | {"metrics": scrape(url)}
            runs[mode].append(with_server(args, (*budget, flag), body))
            r = runs[mode][-1]
            print(f"{mode}: TTFT p50 {r['ttft_ms']['p50']:.0f} ms, {r['completed']} ok", file=sys.stderr)
    best = {m: min(rs, key=lambda r: r["ttft_ms"]["p50"]) for m, rs in runs.items()}
    return {"scenario": "shared-prefix", "runs": runs, "best": best,
            "ttft_p50_ratio": best["no_prefix_caching"]["ttft_ms"]["p50"] / best["prefix_caching"]["ttft_ms"]["p50"]}


def scenario_long_prompts(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """16 streams decoding (in 128 / out 256) while 2,048-token prompts (16 out) arrive every 3 s: the streams'
    TPOT and inter-token latency with chunked prefill (token budget --max-num-batched-tokens) and without (each
    prompt prefilled whole in one step)."""
    streams = make_prompts(16, 128, vocab, args.seed)
    longs = make_prompts(4, 2048, vocab, args.seed + 2)

    async def load(url: str) -> tuple[list[RequestResult], list[RequestResult]]:
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
            s_tasks = [asyncio.create_task(one_request(client, url, i, p, 256)) for i, p in enumerate(streams)]
            l_tasks = [asyncio.create_task(one_request(client, url, 100 + i, p, 16, delay=3.0 * (i + 1)))
                       for i, p in enumerate(longs)]
            return list(await asyncio.gather(*s_tasks)), list(await asyncio.gather(*l_tasks))

    runs: dict[str, list[dict[str, object]]] = {"chunked": [], "not_chunked": []}
    for _ in range(args.rounds):
        for mode, extra in (("not_chunked", ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048")),
                            ("chunked", ("--enable-chunked-prefill", "--max-num-batched-tokens",
                                         str(args.max_num_batched_tokens)))):
            def body(url: str, budget: str = extra[-1]) -> dict[str, object]:
                t0 = time.perf_counter()
                s_res, l_res = asyncio.run(load(url))
                dur = time.perf_counter() - t0
                return {"streams": summarize(s_res, dur, 128), "long_prompts": summarize(l_res, dur, 2048),
                        "budget": budget}
            runs[mode].append(with_server(args, extra, body))
            r = runs[mode][-1]["streams"]
            print(f"{mode}: streams TPOT p99 {r['tpot_ms']['p99']:.1f} ms, ITL p99 {r['itl_ms']['p99']:.0f} ms, "
                  f"{r['completed']} ok", file=sys.stderr)
    best = {m: min(rs, key=lambda r: r["streams"]["itl_ms"]["p99"]) for m, rs in runs.items()}
    c, n = best["chunked"]["streams"], best["not_chunked"]["streams"]
    return {"scenario": "long-prompts", "runs": runs, "best": best,
            "tpot_p99_ratio": c["tpot_ms"]["p99"] / n["tpot_ms"]["p99"],
            "itl_p99_ratio": c["itl_ms"]["p99"] / n["itl_ms"]["p99"]}


def scenario_capacity(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """64 requests whose total lengths are uniform in 32..1,024 (prompt + 32 out), all at once, on an artifact whose
    KV pool is a fixed memory: how many run concurrently, against the contiguous-slot engine's count for the same
    memory (pool positions // max_model_len: each of its slots held a whole max_model_len)."""
    from neuron_opt.artifact import read_manifest

    cache = read_manifest(Path(args.model), verify_hashes=False).cache
    rng = np.random.default_rng(args.seed)
    totals = rng.integers(32, 1025, size=64)
    prompts = [rng.integers(100, vocab, size=int(t) - 32).tolist() if t > 32 else [100] for t in totals]

    def body(url: str) -> dict[str, object]:
        async def go() -> tuple[list[RequestResult], float, list[float]]:
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_running(url, stop))
            results, dur = await run_load(url, prompts, 32, 64, float("inf"), 0)
            stop.set()
            return results, dur, await poller
        results, dur, running = asyncio.run(go())
        busy = [x for x in running if x > 0]
        return summarize(results, dur, int(totals.mean()) - 32) | {
            "running_max": max(running), "running_mean": float(np.mean(busy)) if busy else 0.0,
            "metrics": scrape(url)}

    res = with_server(args, ("--max-num-batched-tokens", str(args.max_num_batched_tokens)), body)
    contiguous = (cache.num_blocks - 1) * cache.block_size // cache.max_model_len
    print(f"capacity: {res['running_max']:.0f} running at most (mean {res['running_mean']:.1f}) vs {contiguous} "
          f"contiguous slots of {cache.max_model_len}", file=sys.stderr)
    return {"scenario": "capacity", "pool_blocks": cache.num_blocks, "block_size": cache.block_size,
            "max_model_len": cache.max_model_len, "contiguous_slots_same_memory": contiguous, "run": res,
            "capacity_ratio_max": res["running_max"] / contiguous,
            "capacity_ratio_mean": res["running_mean"] / contiguous}


SPEC_MODES = {
    "plain": (),
    "ngram-adaptive": ("--speculative-method", "ngram"),
    "ngram-always": ("--speculative-method", "ngram", "--no-speculative-adaptive"),
}


def scenario_speculative(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """`--num-prompts` chat requests of the speculative benchmark's workload (`--spec-workload`: grounded, distinct
    "repeat this text" prompts, or open-ended), `--concurrency` streams at once, greedy, answers ending at EOS (at
    most --output-len tokens), on an artifact compiled with --num-speculative-tokens K: served plainly, with
    prompt lookup under the adaptive rule, and with prompt lookup verifying every step, alternating --rounds
    times; the best round of each. Texts are compared request for request with the plain server's; the
    spec_decode counters come from /metrics."""
    from neuron_opt.bench.spec_workloads import OPEN, grounded_prompts

    base = grounded_prompts(min(args.num_prompts, 18)) if args.spec_workload == "grounded" else OPEN
    prompts = [base[i % len(base)] for i in range(args.num_prompts)]
    runs: dict[str, list[dict[str, object]]] = {m: [] for m in SPEC_MODES}
    for _ in range(args.rounds):
        for mode, extra in SPEC_MODES.items():
            def body(url: str) -> dict[str, object]:
                results, dur = asyncio.run(run_load(url, prompts, args.output_len, int(args.concurrency),
                                                    float("inf"), 0))
                s = summarize(results, dur, 0)
                del s["total_token_throughput"]  # prompt lengths differ: output throughput is the measure
                return s | {"metrics": scrape(url), "texts": [r.text for r in results],
                            "errors": [r.error for r in results if r.error][:5]}
            runs[mode].append(with_server(args, extra, body))
            r = runs[mode][-1]
            print(f"{mode}: {r['output_throughput']:.1f} out tok/s, {r['completed']}/{len(prompts)} ok",
                  file=sys.stderr)
    best = {m: max(rs, key=lambda r: r["output_throughput"]) for m, rs in runs.items()}
    plain = best["plain"]
    summary = {}
    for mode, r in best.items():
        m = r["metrics"]
        drafted, accepted = m.get("spec_decode_num_draft_tokens_total", 0.0), m.get(
            "spec_decode_num_accepted_tokens_total", 0.0)
        summary[mode] = {
            "output_throughput": r["output_throughput"],
            "ratio_to_plain": r["output_throughput"] / plain["output_throughput"],
            "tpot_p50_ms": r["tpot_ms"]["p50"],
            "identical_to_plain": sum(a == b for a, b in zip(r["texts"], plain["texts"], strict=True)),
            "verify_steps": m.get("spec_decode_num_verify_steps_total"),
            "skipped_steps": m.get("spec_decode_num_skipped_steps_total"),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": m.get("spec_decode_mean_accepted_length"),
        }
        print(f"best {mode}: {json.dumps(summary[mode])}", file=sys.stderr)
    # the noise floor of "identical": plain rounds against each other (batch composition moves bf16 rounding)
    plain_agree = [sum(a == b for a, b in zip(r["texts"], runs["plain"][0]["texts"], strict=True))
                   for r in runs["plain"][1:]]
    from neuron_opt.artifact import read_manifest

    dtype = read_manifest(Path(args.model), verify_hashes=False).dtype if Path(args.model).is_dir() else None
    return {"scenario": "speculative", "workload": args.spec_workload, "dtype": dtype, "requests": len(prompts),
            "concurrency": int(args.concurrency), "max_tokens": args.output_len, "runs": runs, "summary": summary,
            "plain_rounds_identical_to_first": plain_agree}


# a schema as pydantic writes one (strings without lengths), whose answers run long (eight records), so TPOT is
# measured over many constrained steps
PEOPLE_SCHEMA = {"type": "object", "properties": {"people": {
    "type": "array", "minItems": 8, "maxItems": 8, "items": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "city": {"type": "string"}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
STRUCTURED_MODES = {
    "free": {"ignore_eos": True},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "people",
                                                                               "schema": PEOPLE_SCHEMA}}},
}


def scenario_structured(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """Chat requests answered freely (ignore_eos, --output-len tokens) and under a JSON schema (eight records,
    ending with the grammar or at --output-len), on one server, at each --concurrency level, the two modes
    alternating in order over --rounds rounds. TPOT p50 of each round; the medians' ratio is the cost of the
    grammar per token. Every constrained answer that ended with the grammar (finish_reason "stop") is validated
    (jsonschema); the count of answers cut at --output-len is reported beside it."""
    import jsonschema

    prompts = [f"List eight people (name, age, city) as JSON. Batch {i}." for i in range(args.num_prompts)]
    levels = [int(c) for c in args.concurrency.split(",")]
    runs: dict[str, dict[int, list[dict[str, object]]]] = {m: {c: [] for c in levels} for m in STRUCTURED_MODES}

    def body(url: str) -> None:
        for r in range(args.rounds):
            for c in levels:
                modes = list(STRUCTURED_MODES) if r % 2 == 0 else list(reversed(STRUCTURED_MODES))
                for mode in modes:
                    results, dur = asyncio.run(run_load(url, prompts, args.output_len, c, float("inf"), 0,
                                                        STRUCTURED_MODES[mode]))
                    s = summarize(results, dur, 0)
                    if mode == "json_schema":
                        ended = [r for r in results if r.ok and r.finish_reason == "stop"]
                        s["ended_by_grammar"] = len(ended)
                        s["valid"] = sum(_validates(r.text, PEOPLE_SCHEMA, jsonschema) for r in ended)
                    s["errors"] = [x.error for x in results if x.error][:5]
                    runs[mode][c].append(s)
                    print(f"round {r} c={c} {mode}: TPOT p50 {s['tpot_ms']['p50']:.2f} ms, "
                          f"{s['output_throughput']:.1f} out tok/s, {s['completed']}/{len(prompts)} ok",
                          file=sys.stderr)

    with_server(args, (args.budget_flag, str(args.max_num_batched_tokens)), body)
    summary = {}
    for c in levels:
        med = {m: float(np.median([s["tpot_ms"]["p50"] for s in runs[m][c]])) for m in STRUCTURED_MODES}
        summary[str(c)] = {
            "tpot_p50_ms": {m: {"median": med[m], "min": min(s["tpot_ms"]["p50"] for s in runs[m][c]),
                                "max": max(s["tpot_ms"]["p50"] for s in runs[m][c])} for m in STRUCTURED_MODES},
            "ratio_json_schema_to_free": med["json_schema"] / med["free"],
            "json_schema_ended_by_grammar": f"{sum(s['ended_by_grammar'] for s in runs['json_schema'][c])} of "
                                            f"{sum(s['completed'] for s in runs['json_schema'][c])}",
            "json_schema_valid": f"{sum(s['valid'] for s in runs['json_schema'][c])} of "
                                 f"{sum(s['ended_by_grammar'] for s in runs['json_schema'][c])} that ended",
        }
        print(f"c={c}: {json.dumps(summary[str(c)])}", file=sys.stderr)
    return {"scenario": "structured", "model": str(args.model), "requests_per_run": len(prompts),
            "max_tokens": args.output_len, "rounds": args.rounds, "schema": PEOPLE_SCHEMA, "runs": runs,
            "summary": summary}


def _validates(text: str, schema: dict, jsonschema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def plot_structured(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(report["summary"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, mode in enumerate(STRUCTURED_MODES):
        t = [report["summary"][c]["tpot_p50_ms"][mode] for c in levels]
        ax.bar([i + 0.4 * k for i in range(len(levels))], [x["median"] for x in t], width=0.4, label=mode,
               yerr=[[x["median"] - x["min"] for x in t], [x["max"] - x["median"] for x in t]], capsize=3)
    ax.set_xticks([i + 0.2 for i in range(len(levels))], [f"{c} stream(s)" for c in levels])
    ax.set_ylabel("TPOT p50 (ms), median of rounds")
    ax.set_title(f"JSON schema vs free decoding ({report['machine']['cpu']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_speculative(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["summary"])
    fig, ax = plt.subplots(figsize=(5.5, 4))
    vals = [report["summary"][m]["output_throughput"] for m in modes]
    ax.bar(range(len(modes)), vals, color=["#888", "#2a7", "#7a2"][: len(modes)])
    ax.set_xticks(range(len(modes)), modes)
    for i, m in enumerate(modes):
        ax.text(i, vals[i], f"{report['summary'][m]['ratio_to_plain']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("output tokens/s (whole run)")
    ax.set_title(f"{report['concurrency']} streams, {report['workload']} chat, {report['requests']} requests, "
                 f"best of {len(report['runs']['plain'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def wait_replicas(url: str, proc: subprocess.Popen, n: int, timeout: float = 600.0) -> None:
    """Until the `serve --data-parallel` router counts `n` live replicas (its /health is up as soon as one is)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode}")
        try:
            for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
                if line.startswith("neuron_opt:cluster_replicas ") and float(line.split()[1]) >= n:
                    return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{n} replicas did not come up")


def scenario_data_parallel(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """The same load (every --concurrency level) on the single-process server and on `serve --data-parallel N` for
    each N of --data-parallel, alternating --rounds times (the machine's speed drifts); the best round of each, and
    each data-parallel figure as a ratio to the single-process server's in the same run."""
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    levels = [int(c) for c in args.concurrency.split(",")]
    budget = (args.budget_flag, str(args.max_num_batched_tokens))
    modes = [("single", 0)] + [(f"dp{n}", n) for n in (int(x) for x in args.data_parallel.split(","))]
    runs: dict[str, list[list[dict[str, object]]]] = {m: [] for m, _ in modes}
    for _ in range(args.rounds):
        for mode, n in modes:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start_server(args, port, (*budget, *(("--data-parallel", str(n)) if n else ())))
            try:
                wait_healthy(url, proc)
                if n:
                    wait_replicas(url, proc, n)
                asyncio.run(run_load(url, prompts[: 2 * max(n, 1)], 4, 2 * max(n, 1), float("inf"), 0))  # warm-up
                res = []
                for c in levels:
                    results, dur = asyncio.run(run_load(url, prompts, args.output_len, c, args.request_rate,
                                                        args.seed))
                    res.append(summarize(results, dur, args.input_len) | {"concurrency": c, "errors": [
                        r.error for r in results if r.error][:5]})
                    print(f"{mode} c={c}: {res[-1]['output_throughput']:.1f} out tok/s, TTFT p50 "
                          f"{res[-1]['ttft_ms']['p50']:.0f} ms, TPOT p50 {res[-1]['tpot_ms']['p50']:.1f} ms, "
                          f"{res[-1]['completed']}/{len(results)} ok", file=sys.stderr)
            finally:
                stop_server(proc, timeout=120)
            runs[mode].append(res)
    best = {m: [max((r[i] for r in rs), key=lambda s: s["output_throughput"]) for i in range(len(levels))]
            for m, rs in runs.items()}
    ratios = {m: [{"concurrency": c, "throughput": b["output_throughput"] / s["output_throughput"],
                   "ttft_p50": b["ttft_ms"]["p50"] / s["ttft_ms"]["p50"],
                   "tpot_p50": b["tpot_ms"]["p50"] / s["tpot_ms"]["p50"]}
                  for c, b, s in zip(levels, best[m], best["single"], strict=True)] for m in best if m != "single"}
    return {"scenario": "data-parallel", "cores": len(os.sched_getaffinity(0)), "runs": runs, "best": best,
            "ratio_to_single": ratios}


def plot_data_parallel(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mode, rows in report["best"].items():
        cs = [r["concurrency"] for r in rows]
        label = "single process" if mode == "single" else f"--data-parallel {mode[2:]}"
        for ax, key in zip(axes, ("output_throughput", "ttft_ms", "tpot_ms"), strict=True):
            ax.plot(cs, [r[key] if key == "output_throughput" else r[key]["p50"] for r in rows], "o-", label=label)
    for ax, title in zip(axes, ("output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"serve vs serve --data-parallel, {report['cores']} cores, same run (best of "
                 f"{len(next(iter(report['runs'].values())))} rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def routing_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """--prefix-groups groups of --group-requests requests: each group's own --prefix-len-token system prompt,
    then a distinct --input-len-token tail per request; in waves (the i-th request of every group, group order
    shuffled per wave), so each group's first request finds its prefix nowhere and the later ones find it where
    the router sent the first."""
    rng = np.random.default_rng(args.seed)
    systems = make_prompts(args.prefix_groups, args.prefix_len, vocab, args.seed + 1)
    tails = make_prompts(args.prefix_groups * args.group_requests, args.input_len, vocab, args.seed + 2)
    prompts = []
    for i in range(args.group_requests):
        for g in rng.permutation(args.prefix_groups):
            prompts.append(systems[g] + tails[i * args.prefix_groups + g])
    return prompts


def _routing_run(url: str, args: argparse.Namespace, prompts: list[list[int]], concurrency: int,
                 vocab: int) -> dict[str, object]:
    """One load of the routing workload on a started server: latency figures, and the prefix-cache hit rate over
    this load alone (the replicas' hits / queries counters before and after, in prompt tokens)."""
    from neuron_opt.bench.cluster import routed, router_metrics, summed, wait_counted

    warm = make_prompts(4, 16, vocab, args.seed + 3)  # first calls of each replica; no prefix of the workload
    asyncio.run(run_load(url, warm, 2, len(warm), float("inf"), 0))
    before = wait_counted(url, len(warm))
    reasons_before = router_metrics(url, "reason")
    results, dur = asyncio.run(run_load(url, prompts, args.output_len, concurrency, args.request_rate, args.seed))
    after = wait_counted(url, len(warm) + len(results))
    reasons_after = router_metrics(url, "reason")
    hits = summed(after, "prefix_cache_hits_total") - summed(before, "prefix_cache_hits_total")
    queries = summed(after, "prefix_cache_queries_total") - summed(before, "prefix_cache_queries_total")
    name = "neuron_opt:cluster_routed_total"
    return summarize(results, dur, len(prompts[0])) | {
        "prefix_cache_hits": hits, "prefix_cache_queries": queries,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "routed": {r: n - routed(before).get(r, 0.0) for r, n in routed(after).items()},
        "routed_by_reason": {reason: n - reasons_before.get((name, reason), 0.0)
                             for (n_, reason), n in reasons_after.items() if n_ == name},
        "errors": [r.error for r in results if r.error][:5]}


def scenario_routing(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """`serve --data-parallel N --routing P` for each policy P of --routing, and one single-process server (the
    hit rate one replica keeps), on the prefix-group workload (routing_prompts), alternating --rounds times: the
    cluster's prefix-cache hit rate and TTFT per policy in the same run; medians of the rounds."""
    n = int(args.data_parallel)
    policies = args.routing.split(",")
    prompts = routing_prompts(args, vocab)
    concurrency = int(args.concurrency.split(",")[0])
    sized = argparse.Namespace(**{**vars(args), "input_len": len(prompts[0])})  # start_server's max model len
    budget = (args.budget_flag, str(args.max_num_batched_tokens), "--enable-prefix-caching")
    threshold = (() if args.routing_balance_threshold is None else
                 ("--routing-balance-threshold", str(args.routing_balance_threshold)))
    modes = [("single", ())] + [(f"dp{n}-{p}", ("--data-parallel", str(n), "--routing", p, *threshold))
                                for p in policies]
    runs: dict[str, list[dict[str, object]]] = {m: [] for m, _ in modes}
    for _ in range(args.rounds):
        for mode, flags in modes:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start_server(sized, port, (*budget, *flags))
            try:
                wait_healthy(url, proc)
                if flags:
                    wait_replicas(url, proc, n)
                r = _routing_run(url, args, prompts, concurrency, vocab)
            finally:
                stop_server(proc, timeout=120)
            runs[mode].append(r)
            print(f"{mode}: prefix hit rate {r['prefix_hit_rate']:.3f}, TTFT p50 {r['ttft_ms']['p50']:.0f} ms, "
                  f"{r['completed']}/{len(prompts)} ok, routed {r['routed']}", file=sys.stderr)
    summary = {m: {"prefix_hit_rate": float(np.median([r["prefix_hit_rate"] for r in rs])),
                   "prefix_hit_rate_min": min(r["prefix_hit_rate"] for r in rs),
                   "prefix_hit_rate_max": max(r["prefix_hit_rate"] for r in rs),
                   "ttft_p50_ms": float(np.median([r["ttft_ms"]["p50"] for r in rs])),
                   "ttft_p50_ms_min": min(r["ttft_ms"]["p50"] for r in rs),
                   "ttft_p50_ms_max": max(r["ttft_ms"]["p50"] for r in rs),
                   "ttft_p99_ms": float(np.median([r["ttft_ms"]["p99"] for r in rs])),
                   "output_throughput": float(np.median([r["output_throughput"] for r in rs])),
                   "completed": sum(r["completed"] for r in rs), "failed": sum(r["failed"] for r in rs)}
               for m, rs in runs.items()}
    single = summary["single"]["prefix_hit_rate"]
    for s in summary.values():
        s["hit_rate_vs_single"] = s["prefix_hit_rate"] / single if single else None
    return {"scenario": "routing", "data_parallel": n, "cores": len(os.sched_getaffinity(0)),
            "workload": {"prefix_groups": args.prefix_groups, "group_requests": args.group_requests,
                         "prefix_len": args.prefix_len, "tail_len": args.input_len, "output_len": args.output_len,
                         "concurrency": concurrency, "request_rate": str(args.request_rate),
                         # every later request of a group finding its whole prefix cached, and nothing else
                         "ideal_hit_rate": (args.group_requests - 1) * args.prefix_len
                         / (args.group_requests * len(prompts[0])),
                         "order": "waves: the i-th request of every group, groups shuffled per wave"},
            "balance_threshold": args.routing_balance_threshold, "rounds": args.rounds, "runs": runs,
            "summary": summary}


def plot_routing(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["summary"])
    labels = ["single process" if m == "single" else f"dp{report['data_parallel']} --routing {m.split('-', 1)[1]}"
              for m in modes]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in ((axes[0], "prefix_hit_rate", "prefix-cache hit rate (prompt tokens)"),
                           (axes[1], "ttft_p50_ms", "TTFT p50 (ms)")):
        vals = [report["summary"][m][key] for m in modes]
        lo = [v - report["summary"][m][f"{key}_min"] for m, v in zip(modes, vals, strict=True)]
        hi = [report["summary"][m][f"{key}_max"] - v for m, v in zip(modes, vals, strict=True)]
        ax.bar(labels, vals, yerr=[lo, hi], capsize=4, color=["#888", "#2a7", "#c52", "#27c"][: len(modes)])
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    w = report["workload"]
    fig.suptitle(f"{w['prefix_groups']} prefix groups x {w['group_requests']} requests, {w['prefix_len']}-token "
                 f"prefix + {w['tail_len']}-token tail, {report['cores']} cores (median of {report['rounds']} "
                 "rounds, min-max bars)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ab_versions(args: argparse.Namespace, prompts: list[list[int]], concurrency: int,
                budget: tuple[str, str]) -> dict[str, object]:
    """The same load on this checkout and on `--baseline-source`, alternating `--rounds` times (the machine's
    speed drifts); the best round of each."""
    runs: dict[str, list[dict[str, object]]] = {"ours": [], "baseline": []}
    for _ in range(args.rounds):
        for who in ("baseline", "ours"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = (start_server(args, port, budget) if who == "ours" else
                    start_server(args, port, (args.baseline_budget_flag, str(args.max_num_batched_tokens)),
                                 args.baseline_model, args.baseline_source))
            try:
                wait_healthy(url, proc)
                asyncio.run(run_load(url, prompts[:1], 4, 1, float("inf"), args.seed))  # warm-up
                results, dur = asyncio.run(run_load(url, prompts, args.output_len, concurrency, args.request_rate,
                                                    args.seed))
            finally:
                stop_server(proc)
            s = summarize(results, dur, args.input_len) | {"concurrency": concurrency}
            runs[who].append(s)
            print(f"{who}: {s['output_throughput']:.1f} out tok/s, {s['completed']}/{len(results)} ok",
                  file=sys.stderr)
    best = {who: max(rs, key=lambda r: r["output_throughput"]) for who, rs in runs.items()}
    return {"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "best": best,
            "throughput_ratio": best["ours"]["output_throughput"] / best["baseline"]["output_throughput"]}


# ---- llama.cpp's server as the peer (neuron_opt.bench.llamacpp_server) ---------------------------------------


def start_llama_server(cmd: list[str], log: Path) -> subprocess.Popen:
    """llama-server from `cmd`, its output appended to `log`, with libgomp's default wait policy (the variables
    that change it removed from its environment, as for the decode benchmark's llama.cpp)."""
    from neuron_opt.bench.decode import LLAMACPP_UNSET_ENV

    print("+", shlex.join(cmd), file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if k not in LLAMACPP_UNSET_ENV}
    with log.open("a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def _serve_loads(proc: subprocess.Popen, url: str, args: argparse.Namespace, warm: list[list[int]],
                 loads: list[tuple[int, int, list[list[int]]]], who: str) -> list[dict[str, object]]:
    """On the server `proc` (stopped at the end): a warm-up (every stream at once, a short answer), then every load
    (prompt length, streams, prompts) in turn; summarize() of each."""
    try:
        wait_healthy(url, proc)
        warmed, _ = asyncio.run(run_load(url, warm, 4, len(warm), float("inf"), args.seed))
        bad = [r.error for r in warmed if not r.ok]
        if bad:
            raise SystemExit(f"{who}: the warm-up failed ({len(bad)} of {len(warm)} requests): {bad[0]}")
        out = []
        for plen, c, prompts in loads:
            results, dur = asyncio.run(run_load(url, prompts, args.output_len, c, args.request_rate, args.seed))
            s = summarize(results, dur, plen) | {"prompt_len": plen, "concurrency": c,
                                                 "errors": [r.error for r in results if r.error][:5]}
            out.append(s)
            print(f"{who} in {plen} c={c}: {s['output_throughput']:.1f} out tok/s, TTFT p50 "
                  f"{s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.1f} ms, "
                  f"{s['completed']}/{len(results)} ok", file=sys.stderr)
        return out
    finally:
        stop_server(proc)


def _port_free(cmd: list[str]) -> str:
    """A command line with its port (a fresh one per start) as PORT."""
    return shlex.join(["PORT" if i and cmd[i - 1] == "--port" else a for i, a in enumerate(cmd)])


def _peer_turn(args: argparse.Namespace, who: str, artifact: Path, llama_cmd: Callable[[int], list[str]],
               log: Path, warm: list[list[int]], loads: list[tuple[int, int, list[list[int]]]], label: str,
               record: RunRecord) -> tuple[str, list]:
    """One server's turn in a round: started (ours on `artifact`, or llama-server from `llama_cmd(port)` logging
    to `log`), warmed up, every load run, stopped; the other processes' CPU use watched over it. Returns its
    command line (port as PORT) and the loads' summaries."""
    from neuron_opt.bench import CpuWatch

    port = free_port()
    watch = CpuWatch()
    if who == "ours":
        proc = start_server(args, port, (args.budget_flag, str(args.max_num_batched_tokens)), model=str(artifact))
    else:
        proc = start_llama_server(llama_cmd(port), log)
    res = _serve_loads(proc, f"http://127.0.0.1:{port}", args, warm, loads, label)
    rec = {"turn": label, **watch.stop()}
    record.idle.setdefault("rounds", []).append(rec)
    record.check(rec, f"during {label}")
    return _port_free(list(proc.args)), res


def scenario_peer(args: argparse.Namespace, vocab: int, record: RunRecord) -> dict[str, object]:
    """Ours against llama.cpp's llama-server on the same weights, per --pair: every --prompt-lens x --concurrency
    load on our server, then the same loads on llama-server (the order alternating by round), one server alive at
    a time, --rounds times; medians with min-max and per-round ratios (neuron_opt.bench.llamacpp_server)."""
    import neuron_opt
    from neuron_opt import envs
    from neuron_opt.bench import llamacpp_server as peer
    from neuron_opt.bench.llamacpp import storage_gguf
    from neuron_opt.checkpoint import open_checkpoint

    pairs, levels, lens = args.peer_pairs, args.peer_levels, args.peer_lens
    build = peer.ensure_built(envs.CACHE_DIR, args.llamacpp_version, args.peer_cmake_args)
    ckpt = open_checkpoint("default")
    ggufs = {w: storage_gguf(ckpt.source, ckpt.weights_fingerprint(), peer.PAIRS[w][0], envs.CACHE_DIR,
                             peer.quantizer(build.quantize)) for w in pairs}
    cores = len(os.sched_getaffinity(0))
    threads, bthreads = args.llamacpp_threads or cores, args.llamacpp_batch_threads or cores
    slots, ctx = args.llamacpp_slots or max(levels), peer.context_per_slot(lens, args.output_len)
    extra = tuple(shlex.split(args.llamacpp_extra))
    loads = [(n, c, make_prompts(peer.requests_per_load(args.num_prompts, c), n, vocab, args.seed + 1009 * n + c))
             for n in lens for c in levels]  # distinct prompts per load: no prefix cache hits on either server
    warm = (make_prompts(max(levels), min(lens), vocab, args.seed + 1)
            + make_prompts(1, max(lens), vocab, args.seed + 2))
    runs: dict[str, dict[str, list]] = {w: {"ours": [], "llamacpp": []} for w in pairs}
    commands: dict[str, dict[str, str]] = {w: {} for w in pairs}
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-peer-"))
    t_run = time.monotonic()
    for rnd in range(1, args.rounds + 1):
        t_round = time.monotonic()
        for w, artifact in pairs.items():
            for who in ("ours", "llamacpp") if rnd % 2 else ("llamacpp", "ours"):
                def llama_cmd(port: int, gguf: Path = ggufs[w]) -> list[str]:
                    return peer.server_command(build.server, gguf, port, threads, bthreads, slots, ctx, extra)

                commands[w][who], res = _peer_turn(args, who, artifact, llama_cmd,
                                                   logs / f"llama-server-{w}.log", warm, loads,
                                                   f"round {rnd} {w} {who}", record)
                runs[w][who].append([s | {"round": rnd} for s in res])
        if rnd == 1:
            took = time.monotonic() - t_round
            print(f"round 1 took {took / 60:.1f} min: the run about {took * args.rounds / 60:.0f} min",
                  file=sys.stderr, flush=True)
    results = {w: [peer.compare([r[i] for r in runs[w]["ours"]], [r[i] for r in runs[w]["llamacpp"]])
                   | {"prompt_len": n, "concurrency": c} for i, (n, c, _) in enumerate(loads)] for w in pairs}
    info = {w: peer.system_info(p.read_text()) for w in pairs if (p := logs / f"llama-server-{w}.log").is_file()}
    shutil.rmtree(logs, ignore_errors=True)
    print(peer.table(results), file=sys.stderr if args.json else sys.stdout, flush=True)
    return {
        "scenario": "peer", "rounds": args.rounds, "duration_s": time.monotonic() - t_run,
        "prompt_lens": lens, "concurrency": levels, "output_len": args.output_len,
        "requests_per_load": {c: peer.requests_per_load(args.num_prompts, c) for c in levels},
        "config": {k: str(v) for k, v in vars(args).items()},
        "ours": {"neuron_opt": neuron_opt.__version__, "git": peer.git_revision(ROOT),
                 "artifacts": {w: str(a) for w, a in pairs.items()},
                 "commands": {w: c["ours"] for w, c in commands.items()},
                 "threads_env": {k: os.environ.get(k) for k in ("NEURON_OPT_NUM_THREADS", "OMP_NUM_THREADS")}},
        "llamacpp": build.to_json() | {
            "threads": threads, "batch_threads": bthreads, "slots": slots, "ctx_per_slot": ctx,
            "ggufs": {w: str(g) for w, g in ggufs.items()}, "commands": {w: c["llamacpp"] for w, c in commands.items()},
            "system_info": info, "omp_wait_policy": "unset (libgomp's default)"},
        "runs": runs, "results": results,
    }


# ---- multi-LoRA serving (docs/lora.md) --------------------------------------------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapters(hf_model: str, out: Path, n: int, rank: int, seed: int) -> list[Path]:
    """`n` PEFT LoRA adapters of rank `rank` on every projection of HF transformers' model of `hf_model`, each saved
    with `save_pretrained` under out/lora<k>: peft's `init_lora_weights=False` initialisation (nn.Linear's, random A
    and B), redrawn with seed + k for each adapter, so each one changes the model's output."""
    import math

    import peft
    import torch

    model = peft.get_peft_model(load_hf_model(hf_model), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0, init_lora_weights=False))
    paths = []
    for k in range(n):
        torch.manual_seed(seed + k)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_A." in name or ".lora_B." in name:
                    torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5))  # nn.Linear's weight initialisation
        model.save_pretrained(out / f"lora{k}")
        paths.append(out / f"lora{k}")
    return paths


def check_lora_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--scenario lora's flags, checked before anything runs (a usage error naming the flag): --model an artifact
    compiled with --enable-lora from the weights of --hf-model (default: the default GGUF), and the adapters'
    count and rank within its capacity. Parsed values go into args.lora_*."""
    from neuron_opt.artifact import read_manifest
    from neuron_opt.checkpoint import open_checkpoint
    from neuron_opt.errors import NeuronOptError

    if not (Path(args.model) / "manifest.json").is_file():
        p.error(f"--scenario lora: --model must be an artifact compiled with --enable-lora, got {args.model!r}")
    try:
        m = read_manifest(Path(args.model), verify_hashes=False)
    except (OSError, NeuronOptError) as e:
        p.error(f"--model {args.model}: not a readable artifact ({e})")
    if m.lora is None:
        p.error(f"--model {args.model}: compiled without --enable-lora (compile it with --enable-lora --max-loras 4 "
                "--max-lora-rank 16)")
    args.lora_capacity = m.lora
    args.lora_rank = m.lora.max_lora_rank if args.lora_rank is None else args.lora_rank
    args.lora_adapters = m.lora.max_loras if args.lora_adapters is None else args.lora_adapters
    if not 1 <= args.lora_rank <= m.lora.max_lora_rank:
        p.error(f"--lora-rank: must be in 1..{m.lora.max_lora_rank} (the artifact's --max-lora-rank), got "
                f"{args.lora_rank}")
    if args.lora_adapters < 1:
        p.error(f"--lora-adapters: must be >= 1, got {args.lora_adapters}")
    if set(m.lora.target_modules) != set(LORA_TARGETS):
        p.error(f"--model {args.model}: compiled for --lora-target-modules {' '.join(m.lora.target_modules)}; the "
                "scenario's adapters target every projection (compile without --lora-target-modules)")
    args.lora_hf_model = args.hf_model or "default"
    if m.source.get("weights_sha256") != open_checkpoint(args.lora_hf_model).weights_fingerprint():
        p.error(f"--model {args.model}: compiled from {m.source.get('model')}, not from --hf-model "
                f"{args.lora_hf_model}, whose HF model the adapters are made on")


def scenario_lora(args: argparse.Namespace, vocab: int) -> dict[str, object]:
    """One server on an --enable-lora artifact: --lora-adapters random PEFT adapters (make_lora_adapters) loaded
    through `POST /v1/load_lora_adapter` (its wall time; the first request under each then writes its cold slot,
    whose TTFT is recorded beside a base request's), then, at every --concurrency level, the same prompts served
    on the base model alone and as a mix (request i under adapter i mod (n + 1), the last share the base model),
    the two alternating in order over --rounds rounds; medians with min-max, and the mixed / base ratios per level
    (throughput, TPOT) over the medians and per round."""
    import httpx

    from neuron_opt.artifact import read_manifest

    manifest = read_manifest(Path(args.model), verify_hashes=False)
    work = Path(tempfile.mkdtemp(prefix="bench-serve-lora-"))
    try:
        t0 = time.perf_counter()
        paths = make_lora_adapters(args.lora_hf_model, work, args.lora_adapters, args.lora_rank, args.seed)
        made_s = time.perf_counter() - t0
        names = [p.name for p in paths]
        mix = [*names, "bench"]  # "bench": the served (base) model's name
        prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
        levels = [int(c) for c in args.concurrency.split(",")]
        runs: dict[str, dict[int, list[dict[str, object]]]] = {m: {c: [] for c in levels} for m in ("base", "mixed")}
        loads: list[dict[str, object]] = []
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        # no prefix caching: the rounds repeat the prompts, which base-model requests would find cached and requests
        # under an adapter never do (their blocks are keyed by adapter)
        proc = start_server(args, port, (args.budget_flag, str(args.max_num_batched_tokens),
                                         "--no-enable-prefix-caching"))
        try:
            wait_healthy(url, proc)
            asyncio.run(run_load(url, prompts[:1], 4, 1, float("inf"), args.seed))  # warm-up, base model

            def first(model: str) -> float:
                r = asyncio.run(run_load(url, [prompts[0]], 4, 1, float("inf"), args.seed, models=[model]))[0][0]
                if not r.ok:
                    raise SystemExit(f"a request under {model} failed: {r.error}")
                return r.ttft * 1000.0

            for name, path in zip(names, paths, strict=True):
                t = time.perf_counter()
                resp = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                                  timeout=600)
                load_s = time.perf_counter() - t
                if resp.status_code != 200:
                    raise SystemExit(f"load_lora_adapter {name}: HTTP {resp.status_code}: {resp.text}")
                loads.append({"lora_name": name, "load_s": load_s, "first_request_ttft_ms": first(name)})
                print(f"{name}: loaded in {1000 * load_s:.0f} ms, first request TTFT "
                      f"{loads[-1]['first_request_ttft_ms']:.0f} ms (its slot written)", file=sys.stderr)
            base_ttft = first("bench")
            for rnd in range(1, args.rounds + 1):
                for c in levels:
                    for mode in ("base", "mixed") if rnd % 2 else ("mixed", "base"):
                        models = ["bench" if mode == "base" else mix[i % len(mix)] for i in range(len(prompts))]
                        results, dur = asyncio.run(run_load(url, prompts, args.output_len, c, args.request_rate,
                                                            args.seed, models=models))
                        s = summarize(results, dur, args.input_len) | {
                            "round": rnd, "concurrency": c, "errors": [r.error for r in results if r.error][:5]}
                        runs[mode][c].append(s)
                        print(f"round {rnd} c={c} {mode}: {s['output_throughput']:.1f} out tok/s, TPOT p50 "
                              f"{s['tpot_ms']['p50']:.1f} ms, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
                              f"{s['completed']}/{len(results)} ok", file=sys.stderr)
            # requests per adapter, adapters loaded and resident
            metrics = [ln for ln in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                       if ln.startswith("neuron_opt:lora_") and "_created{" not in ln]
        finally:
            stop_server(proc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for c in levels:
        base, mixed = over_rounds(runs["base"][c]), over_rounds(runs["mixed"][c])
        summary[str(c)] = {
            "base": {k: v for k, v in base.items() if k != "rounds"},
            "mixed": {k: v for k, v in mixed.items() if k != "rounds"},
            "throughput_ratio_mixed_to_base": mixed["output_throughput"] / base["output_throughput"],
            "throughput_ratio_rounds": [m["output_throughput"] / b["output_throughput"]
                                        for m, b in zip(runs["mixed"][c], runs["base"][c], strict=True)],
            "tpot_p50_ratio_mixed_to_base": mixed["tpot_ms"]["p50"] / base["tpot_ms"]["p50"],
        }
        print(f"c={c}: mixed / base output throughput {summary[str(c)]['throughput_ratio_mixed_to_base']:.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in summary[str(c)]['throughput_ratio_rounds'])}), TPOT p50 "
              f"{summary[str(c)]['tpot_p50_ratio_mixed_to_base']:.3f}x", file=sys.stderr)
    return {"scenario": "lora", "model": str(args.model), "dtype": manifest.dtype,
            "quantize": manifest.quant.method,
            "lora_capacity": args.lora_capacity.to_dict(), "adapters": len(names), "adapter_rank": args.lora_rank,
            "adapter_targets": list(LORA_TARGETS), "adapters_made_s": made_s,
            "mix": "request i under adapter i mod (adapters + 1); the last share runs the base model",
            "prompts": len(prompts), "input_len": args.input_len, "output_len": args.output_len,
            "rounds": args.rounds, "adapter_loads": loads, "base_first_request_ttft_ms": base_ttft,
            "runs": {m: {str(c): rs for c, rs in by.items()} for m, by in runs.items()}, "summary": summary,
            "lora_metrics": metrics,
            "config": {k: str(v) for k, v in vars(args).items()}}


def plot_lora(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(report["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for k, mode in enumerate(("base", "mixed")):
        rows = [report["summary"][c][mode] for c in levels]
        xs = [i + 0.4 * k for i in range(len(levels))]
        thr = [r["output_throughput"] for r in rows]
        err = [[v - r["output_throughput_min"] for v, r in zip(thr, rows, strict=True)],
               [r["output_throughput_max"] - v for v, r in zip(thr, rows, strict=True)]]
        label = "base model only" if mode == "base" else f"mixed: {report['adapters']} adapters + base"
        bars = axes[0].bar(xs, thr, width=0.4, yerr=err, capsize=3, label=label)
        axes[0].bar_label(bars, fmt="%.1f", fontsize=8)
        bars = axes[1].bar(xs, [r["tpot_ms"]["p50"] for r in rows], width=0.4, label=label)
        axes[1].bar_label(bars, fmt="%.1f", fontsize=8)
    ticks = [f"{c} stream(s)\n{report['summary'][c]['throughput_ratio_mixed_to_base']:.2f}x" for c in levels]
    for ax, title in zip(axes, (f"output tok/s, median of {report['rounds']} rounds (min-max)", "TPOT p50 (ms)"),
                         strict=True):
        ax.set_xticks([i + 0.2 for i in range(len(levels))], ticks)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"multi-LoRA: rank {report['adapter_rank']} adapters on every projection, {report['dtype']} "
                 f"artifact, in {report['input_len']} / out {report['output_len']} ({report['machine']['cpu']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def check_peer_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--scenario peer's flags, checked before anything runs (a usage error naming the flag): the pairs and each
    artifact's width, the loads, the llama.cpp version to build. Parsed values go into args.peer_*."""
    from neuron_opt.artifact import read_manifest
    from neuron_opt.bench import llamacpp_server as peer
    from neuron_opt.checkpoint import open_checkpoint
    from neuron_opt.compiler import default_dtype
    from neuron_opt.errors import NeuronOptError

    try:
        args.peer_pairs = peer.parse_pairs(args.pair)
        args.peer_levels = peer.parse_int_list("--concurrency", args.concurrency)
        args.peer_lens = peer.parse_int_list("--prompt-lens", args.prompt_lens)
        source = open_checkpoint("default").weights_fingerprint()
        for width, artifact in args.peer_pairs.items():
            try:
                m = read_manifest(artifact, verify_hashes=False)
            except (OSError, NeuronOptError) as e:
                raise peer.PeerConfigError(f"--pair {width}={artifact}: not a readable artifact ({e})") from None
            peer.check_pair(width, m.dtype, m.quant.method, default_dtype("cpu"))
            if m.source.get("weights_sha256") != source:
                raise peer.PeerConfigError(f"--pair {width}={artifact}: compiled from {m.source.get('model')}, "
                                           "not the default GGUF that llama-server serves")
            if m.cache.max_model_len < max(args.peer_lens) + args.output_len:
                raise peer.PeerConfigError(f"--pair {width}={artifact}: max_model_len {m.cache.max_model_len} < "
                                           f"the longest prompt + --output-len ({max(args.peer_lens)} + "
                                           f"{args.output_len})")
    except peer.PeerConfigError as e:
        p.error(str(e))
    args.llamacpp_version = args.llamacpp_version or peer.installed_llama_cpp_python()
    if not args.llamacpp_version:
        p.error("--scenario peer: llama-cpp-python is not installed, so no llama.cpp version is pinned; install the "
                "`llamacpp` extra or give --llamacpp-version")
    args.peer_cmake_args = (tuple(shlex.split(args.llamacpp_cmake_args)) if args.llamacpp_cmake_args is not None
                            else peer.default_cmake_args())


def write_report(args: argparse.Namespace, report: dict, plot_fn=None, record: RunRecord | None = None) -> int:
    """The report as JSON at --out (and on stdout with --json), its plot at --plot when the run has one; with the
    machine and its idleness over the run (`record`)."""
    if record is not None:
        report = record.finish() | report
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if plot_fn is not None and args.plot:
        plot_fn(report, Path(args.plot))
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def add_peer_args(p: argparse.ArgumentParser) -> None:
    """--scenario peer's flags (llama.cpp's server against ours; neuron_opt.bench.llamacpp_server)."""
    g = p.add_argument_group("--scenario peer: llama.cpp's llama-server against ours on the same weights")
    g.add_argument("--pair", action="append", default=[], metavar="WIDTH=ARTIFACT",
                   help="one of our artifacts and the width it is compared at: bf16 (llama.cpp BF16), int8 (Q8_0), "
                        "int4 (Q4_1, the shipped file); repeat for several, e.g. --pair bf16=artifacts/peer-bf16 "
                        "--pair int8=artifacts/peer-int8")
    g.add_argument("--prompt-lens", default="150,1500",
                   help="prompt lengths in tokens (distinct random prompts); every length runs at every --concurrency "
                        "level with max(--num-prompts, 2 x level) requests")
    g.add_argument("--llamacpp-version", default=None,
                   help="the llama-cpp-python sdist whose vendored llama.cpp is built (default: the installed one)")
    g.add_argument("--llamacpp-cmake-args", default=None,
                   help="CMake flags of the build (default: -DGGML_NATIVE=ON, or this CPU's sets without AMX on an "
                        "AMX CPU; give it as --llamacpp-cmake-args=\"-D...\")")
    g.add_argument("--llamacpp-threads", type=int, default=None, help="llama-server -t (default: the usable cores)")
    g.add_argument("--llamacpp-batch-threads", type=int, default=None,
                   help="llama-server -tb (default: the usable cores)")
    g.add_argument("--llamacpp-slots", type=int, default=None,
                   help="llama-server -np (default: the largest --concurrency level)")
    g.add_argument("--llamacpp-extra", default="",
                   help="more llama-server flags, appended as given (e.g. \"--no-cont-batching\")")


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
                            "lora"],
                   help="load: the serving benchmark above; shared-prefix, long-prompts and capacity measure the block "
                        "KV cache (prefix caching, chunked prefill, capacity; docs/serving.md); speculative: plain "
                        "against prompt-lookup serving on chat prompts (docs/speculative.md); structured: TPOT "
                        "under a JSON schema against free decoding (docs/serving.md); peer: ours against llama.cpp's "
                        "llama-server on the same weights (--pair; docs/benchmarks.md); lora: the base model alone "
                        "against a mix of LoRA adapters on one --enable-lora artifact (docs/lora.md)")
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


def run(args: argparse.Namespace) -> int:
    from neuron_opt.api import is_artifact
    from neuron_opt.checkpoint import open_checkpoint

    record = RunRecord(args.require_idle)  # idle check, machine and bandwidth probe, before the run
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
    for s in report["engine"]:
        s["errors"] = [e for r in s["rounds"] for e in r["errors"]][:5]
        print(f"engine c={s['concurrency']}: {s['output_throughput']:.1f} out tok/s (rounds "
              f"{s['output_throughput_min']:.1f}-{s['output_throughput_max']:.1f}), TPOT p50 "
              f"{s['tpot_ms']['p50']:.1f} ms, TTFT p50 {s['ttft_ms']['p50']:.0f} ms", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
