"""The serving benchmark's parts every scenario uses: starting and stopping `neuron-opt serve`, the streaming
client and its load (vLLM's metric definitions, in the package doc), the HF transformers baseline, rounds, the
stream-correctness check, /metrics scrapes and the report writer."""

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

from neuron_opt.bench import RunRecord, rounds_summary

ROOT = Path(__file__).resolve().parents[3]  # the source tree (a checkout), as the script had it


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


async def one_request(client, url: str, index: int, prompt: list[int] | str | list[dict], output_len: int,
                      delay: float = 0.0, extra: dict | None = None) -> RequestResult:
    """A streamed greedy request. `prompt`: token ids for /v1/completions with `ignore_eos` (exactly `output_len`
    tokens come back), or a user message (a string, or the chat messages themselves: content parts with images,
    say) for /v1/chat/completions whose answer ends at EOS (at most `output_len`). `extra`: more request fields (a
    response_format, say)."""
    chat = isinstance(prompt, str) or bool(prompt) and isinstance(prompt[0], dict)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {
        "model": "bench",
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | ({"messages": messages} if chat else {"prompt": prompt, "ignore_eos": True})
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
    url: str, prompts: list[list[int]] | list[str] | list[list[dict]], output_len: int, concurrency: int,
    request_rate: float, seed: int,
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


def token_times_streamer() -> type:
    """A transformers streamer class recording when each chunk of tokens arrives (`t`: perf_counter seconds), for
    the HF baselines' TTFT and TPOT."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Times(BaseStreamer):
        def __init__(self) -> None:
            self.t: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.t.append(time.perf_counter())

        def end(self) -> None:
            pass

    return Times


def hf_baseline(model: str, attn: str):  # noqa: ANN201
    """HF transformers with `attn` attention, loaded and warmed up: a function serving prompts one after another,
    (prompts, output_len) -> (results, wall seconds)."""
    import torch

    hf = load_hf_model(model, attn)
    hf.generation_config.eos_token_id = None  # like ignore_eos: never stop early, never ban EOS
    hf.generation_config.pad_token_id = 0

    Times = token_times_streamer()

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


def serving_step_bytes(artifact: Path, streams: int, context: int) -> float:
    """Bytes one decode step of the server reads: the artifact's weights as stored (its weights/*.safetensors; an
    untied embedding table counted whole) and the KV of `streams` sequences at a mean context of `context`
    positions (K and V, every layer, in the artifact's KV dtype)."""
    import torch

    from neuron_opt.artifact import read_manifest

    m = read_manifest(artifact, verify_hashes=False)
    weights = sum(f.stat().st_size for f in (Path(artifact) / "weights").glob("*.safetensors"))
    esz = torch.finfo(getattr(torch, m.cache.dtype)).bits // 8
    kv = 2 * m.model.num_hidden_layers * m.model.num_key_value_heads * m.model.head_dim * esz
    return weights + streams * context * kv


def serving_mbu(step_bytes: float, tpot_ms: float, bw_gbs: float) -> float:
    """Model-bandwidth utilisation of a serving row: the bytes a decode step reads x steps/s (one step per TPOT: a
    step gives every running stream its next token) over the read bandwidth in GB/s."""
    return step_bytes * (1000.0 / tpot_ms) / (bw_gbs * 1e9)


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

