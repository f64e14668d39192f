"""The image scenario: one image and a question per request, through the chat completions endpoint, against HF
transformers `generate` on the same model and the same processor outputs.

Requests: `--num-prompts` images drawn with PIL (neuron_opt.bench.tiny_vlm.draw), their sizes drawn from `--seed`
(each side in [IMAGE_MIN_SIDE, IMAGE_MAX_SIDE] pixels, so the processor resizes and tiles them differently), sent
as base64 PNG data URLs in an `image_url` part before a question (QUESTIONS, in turn); streamed, greedy,
`ignore_eos`, so every answer has `--output-len` tokens; arrivals at `--request-rate` (default: all at once). The
prompt is the checkpoint's processor's (chat template, image placeholder tokens), on the server and in the baseline
alike.

Baseline: the checkpoint's HF model (AutoModelForImageTextToText, fp32, each `--hf-attn`) serving the requests one
after another in this process: per request the PNG decoded, the processor's outputs made (apply_chat_template on
the same messages) and `generate` run, all inside the timed span, as the server's TTFT holds its decoding and
preprocessing. EOS disabled, `--output-len` new tokens.

Rounds (`--rounds`): every `--concurrency` level on the server (default 1 and 8 streams), then the baseline, again
and again with the server up; figures are medians of the rounds (client.over_rounds). Correctness under load: where
the served model runs in fp32 (a checkpoint, or an fp32 artifact), every served answer, at every level and round,
must be the text of HF's greedy tokens for the same image and question (the first `--hf-attn` baseline's, decoded
with special tokens skipped as the server does); the report counts the mismatches.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from neuron_opt.bench.serve.client import (
    RequestResult,
    over_rounds,
    run_load,
    summarize,
    token_times_streamer,
    with_server,
)

IMAGE_MIN_SIDE, IMAGE_MAX_SIDE = 64, 768
QUESTIONS = ("What is in this picture?", "Describe the shapes and their colors.",
             "How many objects are there, and where?", "What color is the background?")


def image_requests(n: int, seed: int) -> tuple[list[bytes], list[tuple[int, int]], list[str]]:
    """`n` PNG images (their sizes drawn from `seed`), their sizes, and the question asked about each."""
    from neuron_opt.bench.tiny_vlm import draw

    rng = np.random.default_rng(seed)
    sizes = [(int(w), int(h)) for w, h in rng.integers(IMAGE_MIN_SIDE, IMAGE_MAX_SIDE + 1, size=(n, 2))]
    pngs = []
    for i, (w, h) in enumerate(sizes):
        buf = io.BytesIO()
        draw(w, h, seed * 100_003 + i).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    return pngs, sizes, [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]


def chat_messages(png: bytes, question: str) -> list[dict[str, Any]]:
    """The request's messages: the image as a base64 data URL, then the question."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def hf_messages(png: bytes, question: str) -> list[dict[str, Any]]:
    """The same messages as the server hands them to the processor: the image decoded to RGB (server/media.py)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


def prompt_lengths(processor: Any, pngs: list[bytes], questions: list[str]) -> list[int]:
    """Each request's prompt tokens as the processor renders it (image placeholders included)."""
    return [len(processor.apply_chat_template(hf_messages(p, q), add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"][0])
            for p, q in zip(pngs, questions, strict=True)]


def hf_image_baseline(model: str, attn: str, processor: Any):  # noqa: ANN201
    """HF transformers' model of checkpoint `model` (fp32, `attn` attention), loaded and warmed up: a function
    serving requests one after another, (pngs, questions, output_len) -> (results, wall seconds, token ids)."""
    import torch
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32, attn_implementation=attn).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: never stop early, never ban EOS
    hf.generation_config.pad_token_id = 0

    Times = token_times_streamer()

    def one(png: bytes, question: str, n: int, streamer: Times | None = None) -> list[int]:
        inputs = processor.apply_chat_template(hf_messages(png, question), add_generation_prompt=True,
                                               tokenize=True, return_dict=True, return_tensors="pt")
        with torch.inference_mode():
            out = hf.generate(**inputs, max_new_tokens=n, do_sample=False, streamer=streamer)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    warm, _, _ = image_requests(1, 12345)
    one(warm[0], QUESTIONS[0], 2)  # warm-up

    def serve(pngs: list[bytes], questions: list[str], output_len: int
              ) -> tuple[list[RequestResult], float, list[list[int]]]:
        results, tokens = [], []
        t_start = time.perf_counter()
        for i, (png, q) in enumerate(zip(pngs, questions, strict=True)):
            st = Times()
            t0 = time.perf_counter()
            ids = one(png, q, output_len, st)
            r = RequestResult(i, ok=True, latency=time.perf_counter() - t0, output_tokens=len(ids))
            r.ttft = st.t[1] - t0  # the first put() is the prompt, the second the first new token
            r.itl = list(np.diff(st.t[1:]))
            results.append(r)
            tokens.append(ids)
        return results, time.perf_counter() - t_start, tokens

    return serve


def served_in_fp32(model: str) -> bool:
    """A checkpoint is served in fp32 (serve --model's dtype); an artifact in the dtype it was compiled for."""
    manifest = Path(model) / "manifest.json"
    return not manifest.is_file() or json.loads(manifest.read_text())["dtype"] == "float32"


def scenario_image(args: argparse.Namespace, hf_model: str) -> dict[str, object]:
    """The image scenario (the module's doc) on `args.model` (a vision-language checkpoint or artifact); the
    requests rendered by, and the baseline run on, checkpoint `hf_model`."""
    from neuron_opt.multimodal.vision import hf_config, load_processor

    processor = load_processor(Path(hf_model), hf_config(Path(hf_model)))
    pngs, sizes, questions = image_requests(args.num_prompts, args.seed)
    lengths = prompt_lengths(processor, pngs, questions)
    messages = [chat_messages(p, q) for p, q in zip(pngs, questions, strict=True)]
    levels = [int(c) for c in args.concurrency.split(",")]
    n_hf = args.hf_num_prompts or args.num_prompts
    hf = {} if args.no_hf else {a: hf_image_baseline(hf_model, a, processor) for a in args.hf_attn.split(",")}
    fp32 = served_in_fp32(args.model)
    engine: dict[int, list[dict]] = {c: [] for c in levels}
    texts: dict[int, list[list[str]]] = {c: [] for c in levels}  # per level, per round, each request's text
    hf_runs: dict[str, list[dict]] = {a: [] for a in hf}
    hf_tokens: list[list[int]] = []
    mean_len = round(float(np.mean(lengths)))

    def body(url: str) -> None:
        asyncio.run(run_load(url, messages[:1], 2, 1, float("inf"), args.seed, {"ignore_eos": True}))  # warm-up
        for rnd in range(1, args.rounds + 1):
            for c in levels:
                results, dur = asyncio.run(run_load(url, messages, args.output_len, c, args.request_rate,
                                                    args.seed, {"ignore_eos": True}))
                s = summarize(results, dur, mean_len) | {"concurrency": c, "round": rnd}
                s["errors"] = [r.error for r in results if r.error][:5]
                s["short"] = sum(r.ok and r.output_tokens != args.output_len for r in results)
                engine[c].append(s)
                texts[c].append([r.text if r.ok else None for r in results])
                print(f"round {rnd} engine c={c}: {s['output_throughput']:.1f} out tok/s, TTFT p50 "
                      f"{s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.1f} ms, "
                      f"{s['completed']}/{len(results)} ok", file=sys.stderr)
            for attn, serve in hf.items():
                results, dur, tokens = serve(pngs[:n_hf], questions[:n_hf], args.output_len)
                hf_runs[attn].append(summarize(results, dur, mean_len) | {"round": rnd})
                if not hf_tokens:
                    hf_tokens.extend(tokens)
                print(f"round {rnd} HF sequential ({attn}): {hf_runs[attn][-1]['output_throughput']:.1f} out "
                      f"tok/s, TTFT p50 {hf_runs[attn][-1]['ttft_ms']['p50']:.0f} ms", file=sys.stderr)

    serve_args = argparse.Namespace(**vars(args) | {"input_len": max(lengths)})  # --max-model-len covers them
    with_server(serve_args, (args.budget_flag, str(args.max_num_batched_tokens)), body)
    report: dict[str, object] = {
        "scenario": "image", "model": str(args.model), "hf_model": hf_model, "served_fp32": fp32,
        "rounds": args.rounds, "output_len": args.output_len,
        "requests": [{"width": w, "height": h, "prompt_tokens": n, "question": q}
                     for (w, h), n, q in zip(sizes, lengths, questions, strict=True)],
        "config": {k: str(v) for k, v in vars(args).items()},
        "engine": [over_rounds(engine[c]) | {"concurrency": c} for c in levels],
    }
    for s in report["engine"]:
        s["errors"] = [e for r in s["rounds"] for e in r["errors"]][:5]
        s["short"] = sum(r["short"] for r in s["rounds"])
    if hf:
        report["hf_runs"] = [over_rounds(hf_runs[a]) | {"num_prompts": n_hf, "attn": a} for a in hf]
        best = report["hf"] = max(report["hf_runs"], key=lambda r: r["output_throughput"])
        for s in report["engine"]:
            s["speedup_vs_hf"] = s["output_throughput"] / best["output_throughput"]
            s["ttft_p50_hf_over_ours"] = best["ttft_ms"]["p50"] / s["ttft_ms"]["p50"]
        report["greedy_check"] = greedy_check(texts, hf_tokens, processor.tokenizer) if fp32 else (
            "skipped: the served model is not fp32")
    else:
        report["greedy_check"] = "skipped: no HF baseline (--no-hf)"
    for s in report["engine"]:
        vs = f", {s['speedup_vs_hf']:.2f}x HF's out tok/s" if hf else ""
        print(f"engine c={s['concurrency']}: {s['output_throughput']:.1f} out tok/s (rounds "
              f"{s['output_throughput_min']:.1f}-{s['output_throughput_max']:.1f}), TTFT p50 "
              f"{s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.1f} ms{vs}", file=sys.stderr)
    if hf:
        print(f"HF sequential (best: {best['attn']}): {best['output_throughput']:.1f} out tok/s, TTFT p50 "
              f"{best['ttft_ms']['p50']:.0f} ms, TPOT p50 {best['tpot_ms']['p50']:.1f} ms", file=sys.stderr)
    print(f"greedy check: {json.dumps(report['greedy_check'])}", file=sys.stderr)
    return report


def greedy_check(texts: dict[int, list[list[str | None]]], hf_tokens: list[list[int]], tokenizer: Any
                 ) -> dict[str, object]:
    """Every served answer (per level, every round) against the text of HF's greedy tokens for the same request
    (the requests the baseline served; their texts under `hf_texts`); a failed request counts as a mismatch."""
    want = [tokenizer.decode(ids, skip_special_tokens=True) for ids in hf_tokens]
    out: dict[str, object] = {"hf_texts": want}
    for c, rounds in texts.items():
        bad = sorted({i for got in rounds for i, w in enumerate(want) if got[i] != w})
        out[str(c)] = {"compared": len(want) * len(rounds), "mismatched": sum(got[i] != w for got in rounds
                                                                              for i, w in enumerate(want)),
                       "mismatched_indices": bad}
    return out


def plot_image(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engine, hf = report["engine"], report.get("hf_runs", [])
    names = [f"neuron-opt\n{r['concurrency']} stream(s)" for r in engine] + [f"HF generate\n({r['attn']})"
                                                                               for r in hf]
    colors = ["tab:blue"] * len(engine) + ["tab:gray"] * len(hf)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    rows = engine + hf
    thr = [r["output_throughput"] for r in rows]
    span = [[v - r["output_throughput_min"] for v, r in zip(thr, rows, strict=True)],
            [r["output_throughput_max"] - v for v, r in zip(thr, rows, strict=True)]]
    for ax, values, err, title in (
        (axes[0], thr, span, f"Output tokens/s, median of {report['rounds']} rounds (min-max)"),
        (axes[1], [r["ttft_ms"]["p50"] for r in rows], None, "TTFT p50 (ms)"),
        (axes[2], [r["tpot_ms"]["p50"] for r in rows], None, "TPOT p50 (ms)"),
    ):
        bars = ax.bar(names, values, color=colors, yerr=err, capsize=3)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(title, fontsize=9)
    n = len(report["requests"])
    tokens = [r["prompt_tokens"] for r in report["requests"]]
    fig.suptitle(f"{report['model']}: {n} image requests, prompt {min(tokens)}-{max(tokens)} tokens, out "
                 f"{report['output_len']} ({report['machine']['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
