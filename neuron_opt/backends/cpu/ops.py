"""The cpu backend's C++ operators (`torch.ops.neuron_opt.*`), built on first use for this machine's CPU.

`paged_attention` (csrc/paged_attention.cpp) is the attention of the decode and verify layer graphs, and
`int8_linear` (csrc/int8_linear.cpp) the int8 weight-only product of graphs with few rows (`int8_linear_widened`
that of prefills, where the CPU has native bf16), and `moe_gather`
(csrc/moe_gather.cpp) a sparse MoE block's selected experts, and `gguf_linear` / `gguf_linear_widened`
(csrc/gguf_linear.cpp) the products of GGUF K-quant blocks kept as stored: AOTInductor calls them
from the compiled graph through its proxy executor (the graph's `<key>.json` beside its `.so`). They are built
with torch's extension builder (ninja, the C++ compiler Inductor uses anyway) and the vector ISA flags Inductor picks
for its own kernels, into torch's extension cache, so later processes load it in well under a second. Compile and
load both call `load()`; an artifact whose graphs call it cannot run without it (`ensure()` says why).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / f for f in ("paged_attention.cpp", "int8_linear.cpp", "moe_gather.cpp", "bf16_linear.cpp",
                                    "gguf_linear.cpp")]
# included by the sources: part of the build's digest
HEADERS = [CSRC / "gemv_tiles.h", CSRC / "gguf_blocks.h", CSRC / "gguf_q8.h"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _flags() -> list[str]:
    isa = pick_vec_isa()
    return ["-O3", "-fopenmp", *str(isa.build_arch_flags()).split(), *[f"-D{m}" for m in isa.build_macro()]]


def load() -> str | None:
    """Build (once per machine and source) and load the operators; None when they are loaded, else why not."""
    with _lock:
        if "error" in _state:
            return _state["error"]  # type: ignore[return-value]
        try:
            # torch's extension builder (setuptools) only when the operators are built, not with this module
            from torch.utils.cpp_extension import load as load_extension

            # ninja from this environment's bin directory when it is not on PATH (a venv run without activating it)
            bin_dir = str(Path(sys.executable).parent)
            if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bin_dir
            # one build per torch version (torch's extension cache does not key on it; the ABI differs) and per
            # source text (checkouts with different sources would otherwise rebuild one shared directory in turn)
            digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS)).hexdigest()[:12]
            name = "neuron_opt_cpu_ops_" + "".join(c if c.isalnum() else "_" for c in torch.__version__) + "_" + digest
            load_extension(name=name, sources=[str(s) for s in SOURCES], extra_cflags=_flags(),
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            _register_fake()
            _state["error"] = None
        except Exception as e:  # a missing compiler or ninja, a build error: say which
            _state["error"] = f"{type(e).__name__}: {e}".strip()[:2000]
            log.warning("cpu backend: the C++ operators (paged attention, int8 linear, MoE gather) could not be "
                        "built, so graphs compile without them (decode_attention=fused, int8_linear=inductor, "
                        "moe_gather=inductor: slower decode and verify steps): %s", _state["error"])
        return _state["error"]  # type: ignore[return-value]


def ensure(what: str, error: type[Exception] = RuntimeError) -> None:
    """Load the operators or raise `error` saying that `what` needs them and why they did not load."""
    err = load()
    if err is not None:
        raise error(f"{what} needs the cpu backend's C++ operators (paged attention, int8 linear, MoE gather), "
                    f"which did not build on this machine ({err}); compile with --backend-option "
                    "decode_attention=fused "
                    "--backend-option int8_linear=inductor --backend-option moe_gather=inductor to do without them "
                    "(GGUF K-quant blocks kept as stored have no other form: compile such a file with --quantize "
                    "int8)")


def _register_fake() -> None:
    @torch.library.register_fake("neuron_opt::paged_attention")
    def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          mask: torch.Tensor, scale: float) -> torch.Tensor:
        return q.new_empty(q.shape)

    @torch.library.register_fake("neuron_opt::paged_attention_softcap")
    def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
        return q.new_empty(q.shape)

    @torch.library.register_fake("neuron_opt::int8_linear")
    def _(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("neuron_opt::int8_linear_widened")
    def _(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("neuron_opt::bf16_linear")
    def _(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
        return x.new_empty((x.shape[0], sum(w.shape[0] for w in ws)), dtype=torch.float32)

    @torch.library.register_fake("neuron_opt::bf16_linear_path")
    def _(x: torch.Tensor, ws: list[torch.Tensor], path: str) -> torch.Tensor:
        return x.new_empty((x.shape[0], sum(w.shape[0] for w in ws)), dtype=torch.float32)

    @torch.library.register_fake("neuron_opt::gguf_linear")
    def _(x: torch.Tensor, w: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("neuron_opt::gguf_linear_exact")
    def _(x: torch.Tensor, w: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("neuron_opt::gguf_linear_widened")
    def _(x: torch.Tensor, w: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("neuron_opt::moe_gather")
    def _(t: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
          weights: torch.Tensor) -> torch.Tensor:
        return t.new_empty(t.shape, dtype=torch.float32)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over each row's blocks (csrc/paged_attention.cpp): q [B, H, S, D] float32, the pools
    [num_blocks, n_kv, block_size, D] (float32, bfloat16 or float8_e4m3fn), block_tables [B, nb] int64, mask
    [B, S, kv_len] bool; [B, H, S, D] float32. A query's output does not depend on S."""
    return torch.ops.neuron_opt.paged_attention(q, k_cache, v_cache, block_tables, mask, scale)


def paged_attention_softcap(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """`paged_attention` with each score s capped to softcap * tanh(s / softcap) before the mask (Gemma 2's
    attention logit soft-capping; softcap > 0)."""
    return torch.ops.neuron_opt.paged_attention_softcap(q, k_cache, v_cache, block_tables, mask, scale, softcap)


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) times the int8 weight w [N, K] with per-row scale [N] (csrc/int8_linear.cpp):
    [M, N] float32, each sum in fp32 over k in order of W-lane vectors; a row's result does not depend on M."""
    return torch.ops.neuron_opt.int8_linear(x, w, scale)


def int8_linear_widened(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_linear` for many rows (prefills): w widened to x's dtype once per call, then aten's GEMM (oneDNN's
    bf16 GEMM for bf16 x), fp32 accumulation, scaled in fp32; [M, N] float32."""
    return torch.ops.neuron_opt.int8_linear_widened(x, w, scale)


def bf16_linear(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) times each bf16 weight [N_i, K] of `ws` (csrc/bf16_linear.cpp): [M, sum N_i]
    float32, the weights' outputs side by side, each sum in fp32 over k in vector steps; a row's result does not
    depend on M. The path is the first of `bf16_linear_paths(x)`."""
    return torch.ops.neuron_opt.bf16_linear(x, ws)


def bf16_linear_path(x: torch.Tensor, ws: list[torch.Tensor], path: str) -> torch.Tensor:
    """`bf16_linear` on a named path: "avx512_bf16" (a bf16 x on a CPU with avx512_bf16: VDPBF16PS dot products of
    bf16 pairs into fp32 lanes) or "fma" (the weights widened to fp32, FMAs; any x, the build's vector ISA). A path
    that this CPU or x's dtype cannot run raises."""
    return torch.ops.neuron_opt.bf16_linear_path(x, ws, path)


def bf16_linear_paths(x: torch.Tensor) -> list[str]:
    """The paths of `bf16_linear` this CPU runs for an x of x's dtype, the one `bf16_linear` takes first."""
    return list(torch.ops.neuron_opt.bf16_linear_paths(x))


def moe_gather(t: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """The selected experts of a sparse MoE block (csrc/moe_gather.cpp): t [T, H], gate_up [E, 2I, H], down [E, H, I]
    (float32 or bfloat16), ids [T, k] int64, weights [T, k] float32 -> [T, H] float32, as
    models.moe.Experts.gather computes it."""
    return torch.ops.neuron_opt.moe_gather(t, gate_up, down, ids, weights)


def gguf_linear(x: torch.Tensor, w: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) times the GGUF blocks w uint8 [N, width] as stored, row n of GGML type
    kinds[n] (int8 [N]; neuron_opt.quant.gguf_blocks) (csrc/gguf_linear.cpp): [M, N] float32, with x rounded to
    llama.cpp's 8-bit activation blocks (Q8_K for K-quants, Q8_0 for Q8_0/Q5_0) and integer dot products, as
    llama.cpp computes it. A row's result does not depend on M. The path is the first of
    `gguf_linear_paths("q8")`."""
    return torch.ops.neuron_opt.gguf_linear(x, w, kinds)


def gguf_linear_exact(x: torch.Tensor, w: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
    """`gguf_linear` with x kept fp32 (the reference path): each weight gguf's reference dequantized value, each sum
    fp32 in vector steps over k, so the product is dequantize-then-matmul up to the order of the sums. The path is
    the first of `gguf_linear_paths("fp32")`."""
    return torch.ops.neuron_opt.gguf_linear_exact(x, w, kinds)


def gguf_linear_widened(x: torch.Tensor, w: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
    """`gguf_linear` for many rows (prefills): w decoded to fp32 once per call, then aten's fp32 GEMM (x fp32)."""
    return torch.ops.neuron_opt.gguf_linear_widened(x, w, kinds)


def gguf_linear_path(x: torch.Tensor, w: torch.Tensor, kinds: torch.Tensor, path: str,
                     activations: str) -> torch.Tensor:
    """`gguf_linear` ("q8" activations: paths "avx512_vnni", "avx2", "generic") or `gguf_linear_exact` ("fp32":
    "avx512", "avx2", "generic") on a named path; one this CPU cannot run raises."""
    return torch.ops.neuron_opt.gguf_linear_path(x, w, kinds, path, activations)


def gguf_linear_paths(activations: str) -> list[str]:
    """The paths this CPU runs for "q8" or "fp32" activations, the one the operator takes first."""
    return list(torch.ops.neuron_opt.gguf_linear_paths(activations))


def gguf_dequantize(w: torch.Tensor, kinds: torch.Tensor, cols: int, path: str) -> torch.Tensor:
    """The operators' decoding of w (rows of `cols` values) on a named path: fp32 [N, cols]."""
    return torch.ops.neuron_opt.gguf_dequantize(w, kinds, cols, path)
