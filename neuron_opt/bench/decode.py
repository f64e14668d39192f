"""Decode throughput, side by side in one run: HF transformers (the peer) vs neuron_opt eager and compiled.

Also, optionally, llama.cpp (llama-cpp-python, `neuron-opt[llamacpp]`) on the checkpoint's GGUF in five storage
formats (systems llamacpp-f32/-bf16/-f16/-q8_0/-q4_1, batch 1 only; see neuron_opt.bench.llamacpp).

Every system runs in its own fresh process and decodes the same prompts greedily for the same number of steps;
only decode steps are timed (prefill excluded). `--repeats` rounds run every system once each, interleaved, so all
see the same drift of the machine; a row reports the median of its rounds with their min and max. A compiled
system's artifact is compiled in its first round and loaded from disk in the later ones. Reported:
tokens/s, ratio to HF eager fp32, and model-bandwidth utilisation (MBU): bytes a decode step must read (weights +
the KV positions it attends over) x steps/s, over the memory-read bandwidth probed in the same process right
after the timed steps.

The run checks that the machine is idle before it starts and watches the other processes' CPU use over every
round (neuron_opt.bench.idle_check, CpuWatch): a busy verdict is recorded in the JSON with a warning, and
`--require-idle` refuses to start (or stops) instead.

Mixture-of-experts models (`--model random-moe`, neuron_opt.bench.random_moe, or any MoE checkpoint): a step reads
the experts it selects (neuron_opt.planner.moe: min(batch x top-k, experts) of them per layer), so bytes per step
count those; `active_bytes` is the bound a token cannot go below, the active parameters' bytes (plus its KV).

JSON: {"mem_bw_gbs": x, "machine": {cpu_model, isa, cores, mem_bw_gbs, torch, ...}, "idle": {start, rounds,
warnings}, "llamacpp": {version, system_info, flash_attn, omp_wait_policy} | null,
"results": [{"system", "dtype", "batch", "tok_s" (median), "tok_s_min", "tok_s_max", "runs_tok_s", "ratio_vs_hf",
"mbu"}, ...], ...}
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, StaticCache

from neuron_opt import envs
from neuron_opt.api import LLM, is_artifact
from neuron_opt.backends.cpu.backend import onednn_bf16_supported
from neuron_opt.bench import (
    CpuWatch,
    MachineBusyError,
    RunRecord,
    host,
    llamacpp,
    llc_bytes,
    read_bandwidth_gbs,
    rounds_summary,
)
from neuron_opt.bench.llamacpp import LlamaCppMissingError, build_info, import_llama_cpp
from neuron_opt.bench.random_moe import random_moe_dir
from neuron_opt.bench.sizes import SIZES, Size, parse_sizes, quantizer, size_gguf
from neuron_opt.checkpoint import CheckpointError, open_checkpoint
from neuron_opt.compiler import CompileRequest, compile_artifact, default_dtype
from neuron_opt.config import ParallelConfig
from neuron_opt.errors import BackendCompileError
from neuron_opt.hub import resolve_model
from neuron_opt.parallel import head_layout
from neuron_opt.planner.memory import weight_bytes, weight_count
from neuron_opt.planner.moe import expert_step
from neuron_opt.runtime.runner import DecodeRow

PROMPT_LEN = 32
SYSTEMS = ("hf", "hf-compile", "eager", "cpu-fp32", "cpu-bf16", "cpu-int8", "cpu-int4", "cpu-q4_k_m",
           "llamacpp-f32", "llamacpp-bf16", "llamacpp-f16", "llamacpp-q8_0",
           "llamacpp-q4_1", "llamacpp-q4_k_m")  # llamacpp-<GGUF storage format>
# our row's dtype -> the llama.cpp storage format it is paired with (ratio_vs_llamacpp)
LLAMACPP_PAIRS = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_1", "q4_k_m": "q4_k_m"}
# --quick: the whole pipeline once, in about a minute on the default size (llama.cpp's row where it is installed)
QUICK = dict(batches="1", steps=8, repeats=1, agreement_tokens=0, max_model_len=128)
QUICK_SYSTEMS = ("cpu-q4_k_m", "llamacpp-q4_k_m")
# removed from a llama.cpp process's environment: it runs with libgomp's default wait policy, as its users run it
LLAMACPP_UNSET_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass
class Result:
    system: str
    dtype: str
    batch: int
    tok_s: float
    steps: int
    bytes_per_step: float
    ratio_vs_hf: float | None = None  # median against HF eager's median (same batch)
    ratio_vs_hf_runs: list[float] | None = None  # round i against HF eager's round i
    mbu: float | None = None
    agreement_vs_hf_fp32: float | None = None  # teacher-forced greedy agreement over --agreement-tokens
    runs_tok_s: list[float] | None = None  # every round's tok/s (--repeats); tok_s is their median
    tok_s_min: float | None = None  # the slowest and fastest round
    tok_s_max: float | None = None
    mem_bw_gbs: float | None = None  # read bandwidth probed in the same process right after the timed steps
    active_bytes: float | None = None  # MoE: active parameters' bytes per token (+ its KV), the bytes bound
    size: str | None = None  # --sizes: the size's name (neuron_opt.bench.sizes)
    fits_llc: bool | None = None  # bytes_per_step fit in the last-level cache: MBU above 1 is possible
    ratio_vs_llamacpp: float | None = None  # median against llama.cpp's paired storage format (LLAMACPP_PAIRS)


def _prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab - 1, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]


def bench_runner(runner, batch: int, steps: int, vocab: int) -> float:
    """tok/s of `steps` batched greedy decode steps through a neuron_opt ModelRunner."""
    toks = [int(runner.prefill(slot, p).argmax()) for slot, p in enumerate(_prompts(batch, vocab))]
    pos = PROMPT_LEN
    for _ in range(2):  # warm-up
        runner.decode([DecodeRow(s, t, pos) for s, t in enumerate(toks)])
    t0 = time.perf_counter()
    for i in range(steps):
        logits = runner.decode([DecodeRow(s, t, pos + 2 + i) for s, t in enumerate(toks)])
        toks = logits.argmax(-1).tolist()
    return batch * steps / (time.perf_counter() - t0)


def bench_hf(model, batch: int, steps: int, vocab: int, static_compile: bool = False) -> float:
    """tok/s of HF transformers decoding with its KV cache (DynamicCache, or StaticCache + torch.compile)."""
    ids = torch.tensor(_prompts(batch, vocab))
    with torch.inference_mode():
        if static_compile:
            cache = StaticCache(config=model.config, max_batch_size=batch, max_cache_len=PROMPT_LEN + steps + 8)
            fwd = torch.compile(model.forward, fullgraph=True)
        else:
            cache, fwd = DynamicCache(config=model.config), model.forward
        out = model(ids, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(PROMPT_LEN))
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = PROMPT_LEN
        t0 = None
        for i in range(steps + 2):  # 2 warm-up steps
            if i == 2:
                t0 = time.perf_counter()
            out = fwd(tok, past_key_values=cache, use_cache=True, cache_position=torch.tensor([pos]))
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            pos += 1
    return batch * steps / (time.perf_counter() - t0)


AGREEMENT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# perplexity of quantized weights against the float reference (the quantization slow test, scripts/quant_schemes.py);
# not the fp8 KV calibration text
PERPLEXITY_TEXT = (
    "The lighthouse stood on a rock a mile from the shore, and for forty years its lamp had turned every night. "
    "Its keeper kept a log of ships, storms and the birds that struck the glass in autumn. When the coast guard "
    "replaced the lamp with an automatic beacon, the keeper stayed on to paint the iron railings and to write "
    "down, as before, the weather at dawn and at dusk. Scientists later used his notes to reconstruct a century "
    "of sea temperatures, because no instrument had been there as long as he had."
)


def hf_reference(hf, tokenizer, n_tokens: int) -> tuple[list[int], list[int]]:
    """HF fp32 greedy continuation of a chat prompt: (prompt ids, generated ids)."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": AGREEMENT_PROMPT}], add_generation_prompt=True,
                                        tokenize=True)
    prompt = list(out["input_ids"] if hasattr(out, "keys") else out)
    with torch.inference_mode():
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    return prompt, gen


def teacher_forced_agreement(runner, prompt: list[int], ref: list[int]) -> float:
    """Fraction of positions where the runner's greedy next token equals the reference's, when fed the reference
    sequence (teacher forcing: one early near-tie flip does not derail the rest of the comparison)."""
    agree = int(int(runner.prefill(0, prompt).argmax()) == ref[0])
    for i in range(len(ref) - 1):
        logits = runner.decode([DecodeRow(0, ref[i], len(prompt) + i)])[0]
        agree += int(int(logits.argmax()) == ref[i + 1])
    return agree / len(ref)


def kv_bytes(cfg, esz: int, batch: int, kv_len: int) -> float:
    """Bytes of K and V a decode step attends over: every layer, `kv_len` positions of each row."""
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * kv_len * cfg.head_dim * esz


def _embedding_not_read(cfg, batch: int) -> int:
    """Elements of an untied embedding table a step does not read (it looks up `batch` rows); a tied table is the
    LM head, read whole."""
    return 0 if cfg.tie_word_embeddings else (cfg.vocab_size - batch) * cfg.hidden_size


def step_bytes(cfg, dtype: torch.dtype, batch: int, kv_len: int) -> float:
    """Weights and KV a decode step reads (an untied embedding: its looked-up rows); MoE: only the experts it selects
    (planner.moe.experts_read)."""
    esz = torch.finfo(dtype).bits // 8
    weights = cfg.num_parameters() - _embedding_not_read(cfg, batch)
    if cfg.is_moe:
        lay = head_layout(cfg, ParallelConfig())
        weights += expert_step(cfg, lay, batch)[0] - weight_count(cfg, lay).experts
    return weights * esz + kv_bytes(cfg, esz, batch, kv_len)


def active_bytes(cfg, dtype: torch.dtype, batch: int, kv_len: int) -> float | None:
    """MoE: the active parameters' bytes per token plus its KV (what no implementation can read less of)."""
    esz = torch.finfo(dtype).bits // 8
    if not cfg.is_moe:
        return None
    return (cfg.active_parameters() - _embedding_not_read(cfg, 1)) * esz + kv_bytes(cfg, esz, 1, kv_len)


def quantized_step_bytes(cfg, method: str, compute: torch.dtype, batch: int, kv_len: int) -> float:
    """Bytes a decode step reads with the decoder linears in `method`'s stored format (neuron_opt.quant.weights: the
    planner's count), the LM head in int8 per channel, and the rest (norms) in the compute dtype; the embedding
    table is not read beyond one row."""
    lay = head_layout(cfg, ParallelConfig())
    esz = torch.finfo(compute).bits // 8
    n = weight_count(cfg, lay)
    linear = weight_bytes(cfg, lay, method) - 2 * n.other  # the planner counts the rest in bf16
    head = lay.vocab_local * (cfg.hidden_size + 4)  # int8 values + an fp32 scale per row
    norms = 2 * cfg.num_hidden_layers * cfg.hidden_size + cfg.hidden_size
    return linear + head + esz * norms + kv_bytes(cfg, esz, batch, kv_len)


def gguf_step_bytes(path: Path, cfg, batch: int) -> float:  # noqa: ANN001
    """Bytes of a GGUF's tensors a decode step reads, as stored: all of them, except that an untied embedding
    table (the file has an `output.weight`) is looked up `batch` rows."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        total -= tensors["token_embd.weight"] * max(cfg.vocab_size - batch, 0) / cfg.vocab_size
    return total


def _storage_file(ckpt, storage: str) -> Path:  # noqa: ANN001
    """The checkpoint's GGUF in llama.cpp's `storage` format (neuron_opt.bench.llamacpp.storage_gguf): Q4_K_M
    from llama.cpp's `llama-quantize` (built once: our row needs it without llama-cpp-python), the others from
    llama-cpp-python's in-process quantizer."""
    if ckpt.format != "gguf":
        raise CheckpointError(f"llama.cpp storage {storage}: needs a GGUF checkpoint; {ckpt.source} is a HF "
                              f"directory")
    make = quantizer(envs.CACHE_DIR) if storage == "q4_k_m" and llamacpp.file_storage(ckpt.source) != storage \
        else None
    return llamacpp.storage_gguf(ckpt.source, ckpt.weights_fingerprint(), storage, envs.CACHE_DIR, make)


def compiled_runner(model: str, backend: str, dtype: str, batch: int, out: Path, max_model_len: int,
                    quantize: str | None = None):
    """The runner of the artifact at `out`, compiled there first unless an earlier round of the run did (later
    rounds load it, as a user loads a compiled artifact, instead of compiling it again from the cache)."""
    # decode buckets: the default set (KV lengths 128, 256, ... max_model_len), as `neuron-opt compile` builds it, so
    # each step attends over the smallest bucket that holds its context, like HF attends over the real length
    if not is_artifact(out):
        compile_artifact(CompileRequest(model=model, out=out, backend=backend, dtype=dtype, batch_size=batch,
                                        max_model_len=max_model_len, prefill_buckets=(PROMPT_LEN, 128),
                                        decode_batches=(batch,), quantize=quantize,
                                        quantize_lm_head=True if quantize in ("int8", "int4") else None),
                          progress=True)
    return LLM(out).runner


def _measure(system: str, batch: int, opts: dict, reference: tuple[list[int], list[int]] | None) -> dict:
    """`_measure_one`, then the memory bandwidth probed in the same process (this VM's bandwidth drifts by tens of
    percent within minutes, so each result's MBU is taken against the bandwidth of its own moment)."""
    out = _measure_one(system, batch, opts, reference)
    if "result" in out:
        out["result"]["mem_bw_gbs"] = read_bandwidth_gbs()
    return out


def _measure_llamacpp(system: str, ckpt, opts: dict,
                      reference: tuple[list[int], list[int]] | None) -> Result:
    """One llama.cpp row (batch 1): the checkpoint's GGUF in the system's storage format, requantized by llama.cpp
    and cached on first use. Weight bytes per step are the file's tensor bytes; its KV cache is f16."""
    storage, steps, cfg = system.removeprefix("llamacpp-"), opts["steps"], ckpt.config
    path = _storage_file(ckpt, storage)
    n_ctx = max(PROMPT_LEN + steps + 2, sum(map(len, reference)) if reference else 0)
    llm = llamacpp.load(path, n_ctx, opts["threads"] or torch.get_num_threads(), opts["llamacpp_flash_attn"])
    tps = llamacpp.bench_llamacpp(llm, _prompts(1, cfg.vocab_size)[0], steps)
    agree = llamacpp.teacher_forced_agreement(llm, *reference) if reference else None
    nbytes = gguf_step_bytes(path, cfg, 1) + kv_bytes(cfg, 2, 1, PROMPT_LEN + steps)
    return Result("llama.cpp", storage, 1, tps, steps, nbytes, agreement_vs_hf_fp32=agree)


def _measure_one(system: str, batch: int, opts: dict, reference: tuple[list[int], list[int]] | None) -> dict:
    """One (system, batch) measurement; runs in a fresh process (see main). Returns the Result as a dict, plus
    the HF fp32 reference continuation when this job computed it."""
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    ckpt = open_checkpoint(resolve_model(opts["model"]))  # a Hub id: from the Hub cache (neuron_opt.hub)
    cfg, steps = ckpt.config, opts["steps"]
    kv_len = PROMPT_LEN + steps
    if system.startswith("llamacpp-"):
        return {"result": asdict(_measure_llamacpp(system, ckpt, opts, reference))}
    if system in ("hf", "hf-compile", "reference"):
        src = ckpt.source
        kw = {"gguf_file": src.name} if ckpt.format == "gguf" else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(src.parent if kw else src, dtype=torch.float32,
                                                               **kw).eval()
        if system == "reference":
            return {"reference": hf_reference(hf, ckpt.tokenizer(), opts["agreement_tokens"])}
        tps = bench_hf(hf, batch, steps, cfg.vocab_size, static_compile=system == "hf-compile")
        name = f"transformers-{'static-compile' if system == 'hf-compile' else 'eager'}"
        return {"result": asdict(Result(name, "float32", batch, tps, steps,
                                        step_bytes(cfg, torch.float32, batch, kv_len),
                                        active_bytes=active_bytes(cfg, torch.float32, batch, kv_len)))}

    def agreement(runner) -> float | None:
        return teacher_forced_agreement(runner, *reference) if batch == 1 and reference else None

    if system == "eager":
        llm = LLM(opts["model"], max_model_len=opts["max_model_len"], batch_size=batch)
        tps = bench_runner(llm.runner, batch, steps, cfg.vocab_size)
        r = Result("neuron_opt-eager", "float32", batch, tps, steps, step_bytes(cfg, torch.float32, batch, kv_len),
                   agreement_vs_hf_fp32=agreement(llm.runner),
                   active_bytes=active_bytes(cfg, torch.float32, batch, kv_len))
        return {"result": asdict(r)}
    if system == "cpu-q4_k_m":  # the Q4_K_M file's blocks as stored (--quantize auto), compute in the default dtype
        path = _storage_file(ckpt, "q4_k_m")
        dtype = default_dtype("cpu")
        out = Path(opts["artifacts"]) / f"{system}-b{batch}"
        runner = compiled_runner(str(path), "cpu", dtype, batch, out, opts["max_model_len"], "auto")
        tps = bench_runner(runner, batch, steps, cfg.vocab_size)
        nbytes = gguf_step_bytes(path, cfg, batch) + kv_bytes(cfg, torch.finfo(getattr(torch, dtype)).bits // 8,
                                                               batch, kv_len)
        return {"result": asdict(Result("neuron_opt-cpu-compiled", "q4_k_m", batch, tps, steps, nbytes,
                                        agreement_vs_hf_fp32=agreement(runner)))}
    quantize = {"cpu-int8": "int8", "cpu-int4": "int4"}.get(system)
    if quantize:  # compute in the cpu backend's default dtype; int4: group 32 (a Q4_0/Q4_1 GGUF's blocks as stored);
        # the LM head int8 per channel in both, as in llama.cpp's files (their output tensor is Q8_0)
        dtype = default_dtype("cpu")
    else:
        dtype = {"cpu-fp32": "float32", "cpu-bf16": "bfloat16"}[system]
    out = Path(opts["artifacts"]) / f"{system}-b{batch}"  # the run's own directory, removed when the run ends
    runner = compiled_runner(opts["model"], "cpu", dtype, batch, out, opts["max_model_len"], quantize)
    tps = bench_runner(runner, batch, steps, cfg.vocab_size)
    nbytes = (quantized_step_bytes(cfg, quantize, getattr(torch, dtype), batch, kv_len) if quantize else
              step_bytes(cfg, getattr(torch, dtype), batch, kv_len))
    r = Result("neuron_opt-cpu-compiled", quantize or dtype, batch, tps, steps, nbytes,
               agreement_vs_hf_fp32=agreement(runner),
               active_bytes=active_bytes(cfg, getattr(torch, dtype), batch, kv_len))
    return {"result": asdict(r)}


@contextlib.contextmanager
def _env_without(names: tuple[str, ...]) -> Iterator[None]:
    """os.environ without `names` inside the block (a process spawned there inherits that), restored after."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _in_fresh_process(fn, *args, unset_env: tuple[str, ...] = ()):  # noqa: ANN001, ANN202
    """Run fn(*args) in a new process, whose environment lacks `unset_env`: each system starts from a clean heap
    and thread pool (a system run after HF in the same process ran slower, from the allocator state HF left behind)."""
    with _env_without(unset_env), ProcessPoolExecutor(max_workers=1,
                                                      mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _survive(fn, *args, unset_env: tuple[str, ...] = ()) -> tuple[dict | None, str | None]:  # noqa: ANN001
    """`_in_fresh_process(fn, *args)`: (its result, None), or (None, why) when that process died (a segfault in a
    peer's native code must not take the other systems' results with it) or our compile of the system failed (one
    width that does not compile must not end a run of hours)."""
    try:
        return _in_fresh_process(fn, *args, unset_env=unset_env), None
    except BrokenProcessPool:
        return None, "its process died (a crash in native code, e.g. a signal)"
    except BackendCompileError as e:
        return None, f"its compile failed: {e}"


def _llamacpp_systems(ap: argparse.ArgumentParser, systems: list[str]) -> list[str]:
    """The llama.cpp systems asked for; a usage error saying what to install when llama-cpp-python is missing."""
    asked = [s for s in systems if s.startswith("llamacpp-")]
    if asked:
        try:
            import_llama_cpp()
        except LlamaCppMissingError as e:
            ap.error(f"--systems {','.join(asked)}: {e}")
    return asked


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default",
                    help="a checkpoint (HF directory, .gguf, 'default', a Hub id org/name[:QUANT]), or "
                         "'random-moe': a random 8-expert top-2 Mixtral written once under the cache directory "
                         "(neuron_opt.bench.random_moe)")
    ap.add_argument("--sizes", default=None,
                    help="model sizes instead of --model, each run in turn (every system interleaved within a size): "
                         "a comma list of " + ", ".join(f"{k} ({v.title})" for k, v in SIZES.items()) +
                         "; the random ones are made once under the cache directory (neuron_opt.bench.sizes)")
    ap.add_argument("--quick", action="store_true",
                    help="check the pipeline end to end in about a minute, not a result: --sizes 135m (unless "
                         "given), --systems " + ",".join(QUICK_SYSTEMS) + " (unless given; llama.cpp's where "
                         "llama-cpp-python is installed), " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                     for k, v in QUICK.items()))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--systems", default=None,
                    help="comma list of: " + ", ".join(SYSTEMS) + " (default: hf,hf-compile,eager,cpu-fp32,cpu-bf16)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads of every system, llama.cpp's included (default: torch's, the usable cores)")
    ap.add_argument("--agreement-tokens", type=int, default=256,
                    help="teacher-forced greedy agreement with HF fp32 over this many tokens (batch-1 rows; 0: skip)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of every system (fresh processes, interleaved); tok/s is the median of the rounds, "
                         "with their min and max")
    ap.add_argument("--llamacpp-flash-attn", choices=("on", "off"), default="on",
                    help="llama.cpp's flash attention (default on: what llama.cpp's own default, auto, picks on the "
                         "CPU)")
    ap.add_argument("--require-idle", action="store_true",
                    help="refuse to start, or stop, when the machine is not idle (other processes busy on the "
                         "cores, a high load average) instead of recording a warning in the JSON")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return ap


def _summarize(runs: dict[str, list[Result]], llc: int | None = None) -> list[Result]:
    """One Result per system from its rounds: tok/s the median with min and max, MBU and bandwidth medians, whether
    a step's bytes fit in the last-level cache of `llc` bytes, and ratios to HF eager and to llama.cpp's paired
    storage format."""
    out = []
    for rs in runs.values():
        r = rs[0]
        r.runs_tok_s = [x.tok_s for x in rs]
        s = rounds_summary(r.runs_tok_s)
        r.tok_s, r.tok_s_min, r.tok_s_max = s["median"], s["min"], s["max"]
        r.mbu = statistics.median(x.bytes_per_step * (x.tok_s / x.batch) / (x.mem_bw_gbs * 1e9) for x in rs)
        r.mem_bw_gbs = statistics.median(x.mem_bw_gbs for x in rs)
        r.fits_llc = None if llc is None else r.bytes_per_step <= llc
        out.append(r)
    peers = {r.dtype: r for r in out if r.system == "llama.cpp"}
    hf = next((r for r in out if r.system == "transformers-eager"), None)
    for r in out:
        r.ratio_vs_hf = r.tok_s / hf.tok_s if hf else None
        if hf and len(hf.runs_tok_s) == len(r.runs_tok_s):  # rounds are interleaved: round i against round i
            r.ratio_vs_hf_runs = [a / b for a, b in zip(r.runs_tok_s, hf.runs_tok_s, strict=True)]
        peer = peers.get(LLAMACPP_PAIRS.get(r.dtype, "")) if r.system != "llama.cpp" else None
        r.ratio_vs_llamacpp = r.tok_s / peer.tok_s if peer else None
    return out


def _round(batch: int, rep: int, systems: list[str], skip: set[str], failed: dict[str, str], opts: dict,
           reference: tuple[list[int], list[int]] | None, runs: dict[str, list[Result]], log) -> None:  # noqa: ANN001
    """One round at `batch`: every system once, in SYSTEMS order, each in a fresh process."""
    for system in SYSTEMS:
        if system in systems and system not in skip and system not in failed:
            unset = LLAMACPP_UNSET_ENV if system.startswith("llamacpp-") else ()
            out, why = _survive(_measure, system, batch, opts, reference if rep == 0 else None, unset_env=unset)
            if out is None:  # reported and left out of later rounds; the rest still runs
                failed[system] = f"batch {batch}, round {rep + 1}: {why}; no result"
                log(f"{system}: {failed[system]}")
                continue
            r = Result(**out["result"])
            runs.setdefault(system, []).append(r)
            log(f"{r.system + ' ' + r.dtype:40s} b={batch} round {rep + 1} {r.tok_s:7.1f} tok/s")


def _watched(batch: int, rep: int, record: RunRecord, fn) -> None:  # noqa: ANN001
    """fn() while the other processes' CPU use is watched; the round's verdict (and any warning) into `record`."""
    watch = CpuWatch()
    fn()
    rnd = {"batch": batch, "round": rep + 1, **watch.stop()}
    record.idle.setdefault("rounds", []).append(rnd)
    record.check(rnd, f"during batch {batch}, round {rep + 1}")


def _print_table(results: list[Result], failed: dict[str, str], bw: float, llc: int | None) -> None:
    print(f"\nmemory read bandwidth: up to {bw:.1f} GB/s; MBU is against the probe run beside each result")
    if llc:
        print(f"last-level cache: {llc / 2**20:.0f} MiB; * after MBU: the step's bytes fit in it (MBU above 1 "
              f"possible)")
    moe = any(r.active_bytes for r in results)
    print(f"{'size':9s} {'system':24s} {'dtype':8s} {'batch':>5s} {'tok/s':>8s} {'(min-max)':>15s} {'vs HF':>6s} "
          f"{'vs l.cpp':>8s} {'MB/step':>8s} {'MBU':>7s} {'agree':>6s}"
          + ("  read/token vs active bound" if moe else ""))
    for r in results:
        ratio = f"{r.ratio_vs_hf:.2f}x" if r.ratio_vs_hf else "-"
        peer = f"{r.ratio_vs_llamacpp:.2f}x" if r.ratio_vs_llamacpp else "-"
        agree = f"{r.agreement_vs_hf_fp32:.3f}" if r.agreement_vs_hf_fp32 is not None else "-"
        extra = f"  {r.bytes_per_step / r.batch / r.active_bytes:.2f}x" if r.active_bytes else ""
        span = f"({r.tok_s_min:.1f}-{r.tok_s_max:.1f})"
        mbu = f"{r.mbu:.1%}" + ("*" if r.fits_llc else " ")
        print(f"{r.size or '-':9s} {r.system.removeprefix('neuron_opt-'):24s} {r.dtype:8s} {r.batch:5d} "
              f"{r.tok_s:8.1f} {span:>15s} {ratio:>6s} {peer:>8s} {r.bytes_per_step / 1e6:8.0f} {mbu:>7s} "
              f"{agree:>6s}" + extra)
    for system, why in failed.items():
        print(f"{system:30s} failed: {why}")


def estimate_minutes(sizes: list[Size], systems: list[str], batches: list[int], repeats: int) -> float:
    """Minutes a --sizes run takes on 2 cores, from each size's own figures (Size.minutes_per_round: the record's 15
    system-batch pairs; Size.setup_minutes: making its files and compiling, the first time), scaled by the pairs
    asked for (llama.cpp's at batch 1 only)."""
    pairs = sum(1 for b in batches for s in systems if b == 1 or not s.startswith("llamacpp-"))
    return sum(z.setup_minutes + repeats * z.minutes_per_round * pairs / 15 for z in sizes)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        args.sizes = args.sizes or "135m"
        if args.systems is None:
            try:
                import_llama_cpp()
                args.systems = ",".join(QUICK_SYSTEMS)
            except LlamaCppMissingError:
                args.systems = ",".join(s for s in QUICK_SYSTEMS if not s.startswith("llamacpp-"))
    args.systems = args.systems or "hf,hf-compile,eager,cpu-fp32,cpu-bf16"
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.sizes and args.model != "default":
        ap.error("--sizes and --model: give one (--sizes names the models)")
    try:
        args.sizes = parse_sizes(args.sizes) if args.sizes else None
    except ValueError as e:
        ap.error(str(e))
    if args.model == "random-moe":
        args.model = str(random_moe_dir(envs.CACHE_DIR))
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        ap.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    llamacpp_systems = _llamacpp_systems(ap, systems)
    try:
        return _run(args, systems, llamacpp_systems)
    except MachineBusyError as e:
        print(f"bench decode: {e}", file=sys.stderr)
        return 3


def _run(args: argparse.Namespace, systems: list[str], llamacpp_systems: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as artifacts:  # compiled once per run, loaded per round
        return _run_in(args, systems, llamacpp_systems, artifacts)


def _run_in(args: argparse.Namespace, systems: list[str], llamacpp_systems: list[str], artifacts: str) -> int:
    log = (lambda s: print(s, flush=True)) if not args.json else (lambda s: None)
    batches = [int(b) for b in args.batches.split(",")]
    if args.sizes:
        log(f"bench decode: sizes {', '.join(z.name for z in args.sizes)}, estimated duration about "
            f"{estimate_minutes(args.sizes, systems, batches, args.repeats):.0f} minutes on 2 cores (the random "
            f"sizes' files and compiles included the first time); keep the machine otherwise idle until it ends")
    record = RunRecord(args.require_idle)  # idle check, machine and bandwidth probe, before anything of ours runs
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = args.threads or torch.get_num_threads()
    opts = {"model": args.model, "steps": args.steps, "max_model_len": args.max_model_len, "threads": args.threads,
            "agreement_tokens": args.agreement_tokens, "llamacpp_flash_attn": args.llamacpp_flash_attn == "on"}
    llamacpp_info = None
    if llamacpp_systems:
        llamacpp_info = build_info() | {"threads": threads, "flash_attn": opts["llamacpp_flash_attn"],
                                        "omp_wait_policy": "unset (libgomp's default)"}
    if "cpu-bf16" in systems:
        if not onednn_bf16_supported():  # refused by the cpu backend on this CPU: say so, measure the rest
            log("cpu-bf16: skipped, oneDNN has no bf16 GEMMs on this CPU (no AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
            systems = [s for s in systems if s != "cpu-bf16"]
    llc = llc_bytes()
    results: list[Result] = []
    failed: dict[str, str] = {}  # [size ]system -> why its process died (a peer that crashes is reported, not fatal)
    sizes_doc = []
    for size in args.sizes or [None]:  # one size after another: its systems interleaved in every round
        size_opts = dict(opts, artifacts=str(Path(artifacts) / (size.name if size else "model")))
        if size:
            log(f"size {size.name}: {size.title}")
            size_opts["model"] = str(size_gguf(size, envs.CACHE_DIR))
            cfg = open_checkpoint(Path(size_opts["model"])).config
            sizes_doc.append({"name": size.name, "title": size.title, "model": size_opts["model"],
                              "parameters": cfg.num_parameters(), "layers": cfg.num_hidden_layers,
                              "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
                              "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                              "vocab": cfg.vocab_size})
        real = size is None or size.config is None  # random weights: no greedy agreement with HF to speak of
        reference = None
        if real and args.agreement_tokens and 1 in batches and set(systems) - {"hf", "hf-compile"}:
            reference = _in_fresh_process(_measure, "reference", 1, size_opts, None)["reference"]
        size_failed: dict[str, str] = {}
        for batch in batches:
            runs: dict[str, list[Result]] = {}
            skip = set(llamacpp_systems) if batch > 1 else set()  # llama-cpp-python's Llama drives one sequence
            if skip:
                log(f"{','.join(llamacpp_systems)}: b={batch} skipped, llama.cpp is measured at batch 1 only")
            for rep in range(args.repeats):  # rounds: every system once per round, so all see the same drift
                _watched(batch, rep, record, functools.partial(_round, batch, rep, systems, skip, size_failed,
                                                               size_opts, reference, runs, log))
            for r in _summarize(runs, llc):
                r.size = size.name if size else None
                results.append(r)
        failed.update({f"{size.name} {k}" if size else k: v for k, v in size_failed.items()})
        shutil.rmtree(size_opts["artifacts"], ignore_errors=True)  # a size's compiled artifacts: GBs at 3b
    bw = max((r.mem_bw_gbs for r in results), default=0.0)  # the best of the probes run beside each result
    doc = {"mem_bw_gbs": bw, "model": str(args.model) if not args.sizes else "sizes", "sizes": sizes_doc or None,
           "threads": threads, "repeats": args.repeats, "llc_bytes": llc,
           "cpu": host(), **record.finish(), "llamacpp": llamacpp_info,
           "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "NEURON_OPT_NUM_THREADS")},
           "torch": torch.__version__, "prompt_len": PROMPT_LEN, "steps": args.steps,
           "results": [asdict(r) for r in results], "failed": failed}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_table(results, failed, bw, llc)
        for w in doc["idle"]["warnings"]:
            print(f"warning: {w}")
    return 1 if failed else 0
