"""NKI kernels inside the neuron backend's device graphs (`--backend-option ops=nki`).

`DeviceKernelOps` has the contract of `models.llama.TorchOps` and replaces it in every attention and RMSNorm call
site of the rank model. While a bucket's step is traced, each call site picks its implementation once, from
facts that are static per graph (shapes, dtype, the model's sliding window, the device):
- On a NeuronCore, a call that fits a kernel's argument contract calls the kernel on the XLA tensors. The SDK's
  `nki.jit` (what `kernels_nki._nki` imports there) turns that call into a custom call in the graph:
  - `flash_attention` for a prefill from position 0 (a prompt always starts at 0: no prefix reuse yet);
  - the paged `decode_attention` for a decode step: it reads the layer's KV block pools through the rows' block
    tables in place (`attention_blocks`), where the torch op gathers the blocks first (`read_blocks`);
  - `rmsnorm` for the norms.
  Attention logit soft-capping (Gemma 2) is the kernels' own `softcap` argument (a tanh on the scores tile).
- Everywhere else the call uses the torch op, each time with a reason recorded:
  - the XLA CPU device, which has no NKI runtime;
  - a sliding window (the kernels apply a plain causal mask); a model whose layers mix windows (Gemma 2/3) takes the
    torch op in every layer, the model-wide window being what the call sites are told;
  - a call outside a kernel's contract (the kernel's own `_check` says which limit).

The contract check reuses each kernel's `_check`. It runs on zero-memory arrays (`np.broadcast_to`) of the
exact shapes and dtype the call would pass, so there is one source of truth per kernel. The layouts handed to a
kernel come from `attention_kernel_call` / `rms_norm_kernel_call`. Tests run those same layout functions
through the kernels on our simulator and compare the result with TorchOps. What only a NeuronCore can show
(neuronx-cc accepting the custom calls, their speed) is listed in docs/neuron_backend.md, not claimed.

The choices of a bucket's graph are written beside its HLO (`<bucket>.kernels.json`) and shown by `inspect`.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

from kernels_nki import decode_attention, flash_attention, rmsnorm
from kernels_nki.decode_attention import default_paged_split, default_split, v_kernel_layout
from models.llama import TorchOps
from neuron_opt.errors import KernelArgumentError

KERNEL_DEVICE = "NEURON"  # the PJRT device with an NKI runtime


@dataclass(frozen=True)
class KernelChoice:
    """What one call site of a graph runs: `kernel` (a kernels_nki module name) or None for the torch op."""

    op: str  # "attention" | "rms_norm"
    shape: str  # the call's shapes, e.g. "q [1, 9, 128, 64], kv [1, 3, 128, 64]"
    kernel: str | None
    reason: str


def _np_dtype(dtype: torch.dtype) -> Any:
    if dtype == torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(str(dtype).removeprefix("torch."))


def _shaped(shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
    """An array with this shape and dtype and no memory: what a kernel's `_check` inspects."""
    return np.broadcast_to(np.zeros((), _np_dtype(dtype)), shape)


SINKS_REASON = "attention sinks: the kernels' softmax has no sink logit"


def choose_attention(B: int, n_heads: int, n_kv: int, S: int, kv_len: int, D: int, dtype: torch.dtype,
                     window: int | None, device_type: str, softcap: float | None = None,
                     sinks: bool = False) -> KernelChoice:
    """The implementation of one attention call site: q [B, n_heads, S, D] over kv_len cache positions, its
    scores soft-capped at `softcap` when given (the kernels' `softcap`; part of the recorded shape)."""
    shape = f"q [{B}, {n_heads}, {S}, {D}], kv [{B}, {n_kv}, {kv_len}, {D}], {str(dtype).removeprefix('torch.')}"
    shape += f", softcap {softcap:g}" if softcap is not None else ""

    def torch_op(reason: str) -> KernelChoice:
        return KernelChoice("attention", shape, None, reason)

    if device_type != KERNEL_DEVICE:
        return torch_op(f"the {device_type} device has no NKI runtime")
    if window is not None:
        return torch_op(f"sliding window {window}: the kernels apply a plain causal mask")
    if sinks:
        return torch_op(SINKS_REASON)
    try:
        if S == 1:
            decode_attention._check(_shaped((B, n_heads, D), dtype), _shaped((B, n_kv, kv_len, D), dtype),
                                    _shaped((B, n_kv, kv_len, D), dtype), np.full(B, kv_len),
                                    decode_attention.default_split(n_heads // n_kv))
            return KernelChoice("attention", shape, "decode_attention", "decode step")
        if S == kv_len:
            flash_attention._check(_shaped((B, n_heads, S, D), dtype), _shaped((B, n_kv, S, D), dtype),
                                   _shaped((B, n_kv, S, D), dtype))
            return KernelChoice("attention", shape, "flash_attention", "prefill from position 0, causal")
    except KernelArgumentError as e:
        return torch_op(f"outside the kernel's contract: {e}")
    return torch_op(f"{S} queries over {kv_len} positions continue a prefix: no kernel")


def choose_paged_attention(B: int, n_heads: int, n_kv: int, S: int, num_blocks: int, block_len: int,
                           max_blocks: int, D: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                           window: int | None, device_type: str, softcap: float | None = None,
                           sinks: bool = False) -> KernelChoice | None:
    """The implementation of an attention call site over block pools `[num_blocks, n_kv, block_len, D]` and
    tables `[B, max_blocks]`: the paged decode kernel, a reason not to, or None for a step that is not a decode
    (prefill call sites gather the blocks and choose with `choose_attention`)."""
    if S != 1:
        return None
    shape = (f"q [{B}, {n_heads}, 1, {D}], blocks [{num_blocks}, {n_kv}, {block_len}, {D}], tables [{B}, "
             f"{max_blocks}], {str(dtype).removeprefix('torch.')}")
    shape += f", softcap {softcap:g}" if softcap is not None else ""
    if device_type != KERNEL_DEVICE:
        return KernelChoice("attention", shape, None, f"the {device_type} device has no NKI runtime")
    if window is not None:
        return KernelChoice("attention", shape, None, f"sliding window {window}: the kernels apply a plain "
                                                      "causal mask")
    if sinks:
        return KernelChoice("attention", shape, None, SINKS_REASON)
    if cache_dtype != dtype:
        return KernelChoice("attention", shape, None, f"a {str(cache_dtype).removeprefix('torch.')} cache: the "
                                                      "kernel reads the compute dtype")
    pool = _shaped((num_blocks, n_kv, block_len, D), dtype)
    try:
        decode_attention._check_paged(_shaped((B, n_heads, D), dtype), pool, pool,
                                      np.zeros((B, max_blocks), np.int32), np.ones(B, np.int64),
                                      decode_attention.default_paged_split(block_len))
    except KernelArgumentError as e:
        return KernelChoice("attention", shape, None, f"outside the kernel's contract: {e}")
    return KernelChoice("attention", shape, "paged_decode_attention", "decode step, KV read through the block "
                                                                      "table")


def paged_attention_kernel_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, positions: torch.Tensor, scale: float,
                                softcap: float | None = None) -> tuple[tuple[int, ...], tuple[Any, ...],
                                                                       dict[str, Any]]:
    """(grid, inputs, compile-time kwargs) of the paged decode kernel for q [B, n_heads, 1, D] over the pools
    [num_blocks, n_kv, block_len, D] as they are (no copy) and the rows' block tables [B, max_blocks];
    `softcap`: the scores' soft-cap (None: none)."""
    B, n_heads, _, D = q.shape
    n_kv, block_len = k_cache.shape[1], k_cache.shape[2]
    q_g = q[:, :, 0].reshape(B, n_kv, n_heads // n_kv, D).contiguous()  # [B, n_kv, G, D]
    lengths = (positions[:, :1] + 1).to(torch.int32)  # [B, 1]: keys [0, position] of each row
    return ((B, n_kv), (q_g, k_cache, v_cache, block_tables.to(torch.int32), lengths),
            dict(softmax_scale=scale, split_size=default_paged_split(block_len), softcap=float(softcap or 0.0)))


def choose_rms_norm(N: int, H: int, dtype: torch.dtype, device_type: str) -> KernelChoice:
    shape = f"x [{N}, {H}], {str(dtype).removeprefix('torch.')}"
    if device_type != KERNEL_DEVICE:
        return KernelChoice("rms_norm", shape, None, f"the {device_type} device has no NKI runtime")
    try:
        rmsnorm._check(_shaped((N, H), dtype), _shaped((H,), dtype), None)
    except KernelArgumentError as e:
        return KernelChoice("rms_norm", shape, None, f"outside the kernel's contract: {e}")
    return KernelChoice("rms_norm", shape, "rmsnorm", "fits")


def attention_kernel_call(kernel: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          positions: torch.Tensor, scale: float,
                          softcap: float | None = None) -> tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any]]:
    """(grid, inputs, compile-time kwargs) of the kernel call for q [B, n_heads, S, D], keys/values
    [B, n_kv, kv_len, D] in the kernels' own layouts (as their `run` wrappers lay numpy arrays out); `softcap`:
    the scores' soft-cap (None: none)."""
    cap = float(softcap or 0.0)
    B, n_heads, S, D = q.shape
    n_kv = keys.shape[1]
    if kernel == "flash_attention":
        q_t = q.transpose(2, 3).contiguous()  # [B, n_heads, D, S]
        k_t = keys.transpose(2, 3).contiguous()  # [B, n_kv, D, S]
        return (B, n_kv, n_heads // n_kv), (q_t, k_t, values.contiguous()), dict(causal=True,
                                                                                  softmax_scale=scale, softcap=cap)
    if kernel == "decode_attention":
        G = n_heads // n_kv
        q_g = q[:, :, 0].reshape(B, n_kv, G, D).contiguous()  # [B, n_kv, G, D]
        k_t = keys.transpose(2, 3).contiguous()  # [B, n_kv, D, kv_len]
        lengths = (positions[:, :1] + 1).to(torch.int32)  # [B, 1]: keys [0, position] of each row
        split = default_split(G)
        v_k = v_kernel_layout(values, split).contiguous()  # [B, n_kv, kv_len, D] in the kernel's row order
        return (B, n_kv), (q_g, k_t, v_k, lengths), dict(softmax_scale=scale, split_size=split, softcap=cap)
    raise ValueError(f"no attention kernel {kernel!r}")


def attention_from_kernel(kernel: str, out: Any, q_shape: tuple[int, ...]) -> Any:
    """The kernel's output back in the model's layout [B, n_heads, S, D]."""
    B, n_heads, S, D = q_shape
    return out.reshape(B, n_heads, 1, D) if kernel in ("decode_attention", "paged_decode_attention") else out


def rms_norm_kernel_call(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[tuple[Any, ...],
                                                                                     dict[str, Any]]:
    """(inputs, kwargs) of the rmsnorm kernel for x [..., H]: x as [N, H], the weight as one row [1, H]."""
    H = x.shape[-1]
    return (x.reshape(-1, H).contiguous(), weight.to(x.dtype).reshape(1, H).contiguous()), dict(eps=float(eps))


def _kernel(name: str) -> Any:
    module = "decode_attention" if name == "paged_decode_attention" else name
    return getattr(importlib.import_module(f"kernels_nki.{module}"), f"{name}_kernel")


class DeviceKernelOps(TorchOps):
    """TorchOps whose call sites run NKI kernels where `choose_*` says so (see the module docstring)."""

    def __init__(self, device_type: str, window: int | None) -> None:
        self.device_type, self.window = device_type, window
        # distinct choices since the last `take_choices`, in first-call order (a dict: a traced step per token
        # must not grow it)
        self.choices: dict[KernelChoice, None] = {}

    def take_choices(self) -> list[dict[str, Any]]:
        """The distinct choices of the graph traced since the last call, in first-call order."""
        taken, self.choices = list(self.choices), {}
        return [asdict(c) for c in taken]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        c = choose_rms_norm(math.prod(x.shape[:-1]), x.shape[-1], x.dtype, self.device_type)
        self.choices[c] = None
        if c.kernel is None:
            return super().rms_norm(x, weight, eps)
        args, kwargs = rms_norm_kernel_call(x, weight, eps)
        return _kernel("rmsnorm")(*args, **kwargs).reshape(x.shape)

    def rms_norm_offset(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        """Gemma's (offset + w) norms: the rmsnorm kernel (or the torch op, as `rms_norm` chooses) on the weight
        plus the offset, added on the device (no compiled constant stands for the parameter there)."""
        return self.rms_norm(x, weight + offset, eps)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                  mask: torch.Tensor, scale: float, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        B, n_heads, S, D = q.shape
        c = choose_attention(B, n_heads, keys.shape[1], S, keys.shape[2], D, q.dtype, self.window,
                             self.device_type, softcap, sinks is not None)
        self.choices[c] = None
        if c.kernel is None:
            return super().attention(q, keys, values, positions, mask, scale, softcap=softcap, sinks=sinks)
        grid, args, kwargs = attention_kernel_call(c.kernel, q, keys.to(q.dtype), values.to(q.dtype), positions,
                                                   scale, softcap)
        return attention_from_kernel(c.kernel, _kernel(c.kernel)[grid](*args, **kwargs), q.shape)


    def attention_blocks(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                         scale: float, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
        B, n_heads, S, D = q.shape
        c = choose_paged_attention(B, n_heads, k_cache.shape[1], S, k_cache.shape[0], k_cache.shape[2],
                                   block_tables.shape[1], D, q.dtype, k_cache.dtype, self.window, self.device_type,
                                   softcap, sinks is not None)
        if c is not None:
            self.choices[c] = None
        if c is None or c.kernel is None:  # gather the blocks; `attention` then chooses (and records) for prefill
            return super().attention_blocks(q, k_cache, v_cache, block_tables, positions, mask, scale,
                                            softcap=softcap, sinks=sinks)
        grid, args, kwargs = paged_attention_kernel_call(q, k_cache, v_cache, block_tables, positions, scale,
                                                         softcap)
        return attention_from_kernel(c.kernel, _kernel(c.kernel)[grid](*args, **kwargs), q.shape)


def set_ops(model: torch.nn.Module, ops: TorchOps) -> None:
    """Makes every attention and norm call site of `model` use `ops` (chosen once per model build)."""
    for m in model.modules():
        if hasattr(m, "ops"):
            m.ops = ops
