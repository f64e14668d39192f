"""llama.cpp (through llama-cpp-python) as a peer system in the decode benchmark (`neuron_opt.bench.decode`).

Design decisions:
- Storage formats come from llama.cpp's own quantizer (`llama_model_quantize`), so each file is laid out exactly
  as llama.cpp would write it, and the source's own format is the GGUF as shipped, untouched ("q4_1" for the
  default model; "bf16" for the benchmark's random sizes, neuron_opt.bench.sizes).
- The default model ships as Q4_1 (its token embedding, tied to the output projection, as Q8_0). F32, BF16, F16
  and Q8_0 files made from it are *requantized* (`allow_requantize`): they hold the Q4_1-rounded weights in a
  wider format (F32/BF16/F16: the same values, more bytes; Q8_0: those values rounded once more to 8 bits). They
  are not the original fp32/bf16 model; what they measure is llama.cpp's decode speed per storage format.
- Each of our widths is compared with llama.cpp's own format of that width: our bf16 with llama.cpp's BF16 (its
  CPU kernels use avx512_bf16 where the CPU has it), and F16 beside it as a second 16-bit row.
- llama.cpp runs as its users run it: the same thread count as our systems, flash attention on (llama.cpp's own
  default, `-fa auto`, turns it on for the CPU backend; llama-cpp-python's default is off), and OpenMP's wait
  policy left unset (libgomp's default: spin briefly at a barrier, then sleep). The benchmark removes
  OMP_WAIT_POLICY from the llama.cpp processes' environment, whatever the caller set for ours.
- Only the decode steps are timed, one token per `llama_decode` call with greedy argmax fed back, like the
  other systems. Batch 1 only: llama-cpp-python's `Llama` drives one sequence, and the benchmark skips batch > 1
  rather than timing a hand-written multi-sequence `llama_batch` loop that no llama.cpp user runs this way.
- llama.cpp's threads spin-wait at every graph barrier (libgomp's `omp barrier`): when other processes take the
  cores, a preempted thread stalls the rest and its throughput collapses. Its rows mean something only on an
  otherwise idle machine, which the benchmark checks and records (neuron_opt.bench.RunRecord).
- The JSON records llama-cpp-python's version (which pins the llama.cpp it vendors) and llama.cpp's system info
  (the instruction sets it was built with, OpenMP, repacking): `build_info`.
- llama-cpp-python is an optional extra (`neuron-opt[llamacpp]`); it is imported only here, inside functions.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

# storage name -> llama.cpp ftype constant in `llama_cpp`; a source already in that format is used as it is
REQUANT_FTYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "bf16": "LLAMA_FTYPE_MOSTLY_BF16", "f16": "LLAMA_FTYPE_MOSTLY_F16",
                  "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
                  "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
# general.file_type (gguf.LlamaFileType) -> storage name, for the file a source already is
FILE_TYPES = {0: "f32", 1: "f16", 3: "q4_1", 7: "q8_0", 15: "q4_k_m", 32: "bf16"}
INSTALL_HINT = ("CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install --no-binary llama-cpp-python 'neuron-opt[llamacpp]' "
                "(built from the sdist with native CPU flags)")


class LlamaCppMissingError(ImportError):
    """A llama.cpp system was asked for and llama-cpp-python is not installed."""


def import_llama_cpp() -> Any:
    """The `llama_cpp` module, or LlamaCppMissingError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise LlamaCppMissingError(f"the llama.cpp systems need llama-cpp-python ({e}); install it with: "
                                   f"{INSTALL_HINT}") from None
    return llama_cpp


def requantize(src_gguf: Path, dst: Path, ftype: str) -> None:
    """Write `src_gguf` requantized to `ftype` (a key of REQUANT_FTYPES) at `dst`, with llama.cpp's quantizer.

    Atomic: written to a temp file beside `dst`, then renamed over it.

    Raises:
        RuntimeError: llama.cpp's quantizer failed (it returns non-zero).
    """
    llama_cpp = import_llama_cpp()
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # else llama.cpp logs a line per tensor
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, REQUANT_FTYPES[ftype])
    params.allow_requantize = True  # the source is already quantized (Q4_1): dequantize, then write `ftype`
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, suffix=".gguf.tmp")
    os.close(fd)
    try:
        rc = llama_cpp.llama_model_quantize(str(src_gguf).encode(), tmp.encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src_gguf} -> {ftype}) returned {rc}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    finally:
        Path(tmp).unlink(missing_ok=True)


def storage_gguf(src_gguf: Path, fingerprint: str, storage: str, cache_dir: Path,
                 quantize: Callable[[Path, Path, str], None] | None = None) -> Path:
    """The GGUF holding `src_gguf`'s weights in `storage`: the file itself when it is stored so (`file_storage`:
    the default model is "q4_1"); else (a key of REQUANT_FTYPES) requantized once and cached under
    `cache_dir/llamacpp`, named by the source's sha256 `fingerprint` and format.
    `quantize(src, dst, storage)` writes the file (default `requantize`, llama-cpp-python's in-process quantizer;
    the serving benchmark passes the `llama-quantize` binary it built from the same llama.cpp)."""
    if storage == file_storage(src_gguf):
        return src_gguf
    dst = cache_dir / "llamacpp" / f"{fingerprint[:40]}-{storage}.gguf"
    if not dst.is_file():
        (quantize or requantize)(src_gguf, dst, storage)
    return dst


def file_storage(path: Path) -> str | None:
    """The storage name of a GGUF's `general.file_type` (FILE_TYPES), None for another or none."""
    field = GGUFReader(path).fields.get("general.file_type")
    return FILE_TYPES.get(int(field.parts[field.data[0]][0])) if field is not None else None


def load(path: Path, n_ctx: int, threads: int, flash_attn: bool = True) -> Any:
    """A `llama_cpp.Llama` on `path`, CPU, `threads` threads for decode and prompt alike, last-token logits only,
    flash attention on (llama.cpp's default on the CPU) unless `flash_attn` is False."""
    llama_cpp = import_llama_cpp()
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           n_batch=max(n_ctx, 32), verbose=False, logits_all=False, flash_attn=flash_attn)


def build_info() -> dict[str, str]:
    """llama-cpp-python's version (it pins the vendored llama.cpp) and llama.cpp's system info: the instruction
    sets its CPU backend was built with (AVX2, AVX512, AVX512_BF16, AMX_INT8, ...), OpenMP, repacking."""
    llama_cpp = import_llama_cpp()
    return {"llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def _next_token(llm: Any, tokens: list[int]) -> int:
    """Evaluate `tokens` after what is already cached; the greedy next token (argmax of the last logits)."""
    llama_cpp = import_llama_cpp()
    llm.eval(tokens)
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    return int(logits.argmax())


def bench_llamacpp(llm: Any, prompt: list[int], steps: int) -> float:
    """tok/s of `steps` greedy single-token decode steps after `prompt` (prefill and 2 warm-up steps untimed)."""
    llm.reset()  # n_tokens = 0: the next eval overwrites the KV cache from position 0
    tok = _next_token(llm, prompt)
    for _ in range(2):  # warm-up
        tok = _next_token(llm, [tok])
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = _next_token(llm, [tok])
    return steps / (time.perf_counter() - t0)


def teacher_forced_agreement(llm: Any, prompt: list[int], ref: list[int]) -> float:
    """Fraction of positions where llama.cpp's greedy next token equals the reference's, fed the reference
    sequence one token per decode call (teacher forcing, as `decode.teacher_forced_agreement` does)."""
    llm.reset()
    agree = int(_next_token(llm, prompt) == ref[0])
    for i in range(len(ref) - 1):
        agree += int(_next_token(llm, [ref[i]]) == ref[i + 1])
    return agree / len(ref)
