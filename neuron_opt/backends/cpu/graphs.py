"""What the cpu backend compiles: one decoder layer per (phase, batch[, q_len]), and the LM head per row count.

Design decisions (see docs/cpu_backend.md)
- Regional compilation. One layer compiles in a fraction of a whole model's time and the same .so serves every
  layer (each layer gets its own AOTI container holding that layer's weights). Decode speed is the same or
  better: a call into a container per layer costs little next to the step.
- KV length is a dynamic dimension: the block tables' width (blocks per row). Within a phase and batch, buckets
  differ only in the attention's KV length (and a prefill in its token count, also dynamic), so one graph
  serves them all: the default bucket set needs 5 layer graphs + 4 heads, not one model per bucket. The
  executor pads a one-block table with a null-block column (masked: it lies beyond every query's position), so
  the dimension is never 1 (export specialises sizes 0 and 1). The block pools are whole, static-shape inputs,
  except under window-sized KV (CacheConfig.sliding_window), where the pool's block count is dynamic too: the
  sliding layers' pool is smaller and the same layer graph serves both.
- bf16: the residual stream between layers (and the norms reading it) stays fp32; only GEMM inputs/weights
  and the KV cache are bf16. In teacher-forced greedy agreement with HF fp32, the loss comes from rounding
  activations, not from the bf16 weights; fp32 logits (HeadGraph) remove most of the rest.
- The LM head graph takes the already-gathered last hidden states [B, H], so it depends only on B (a verify
  bucket scores every position: B * q_len rows).
- LoRA (a model with `lora_config`, neuron_opt.lora): the layer graph takes the window (every LoRA graph does), the
  rows' adapter slots and a tuple of the layer's A/B stacks as inputs, so loading an adapter writes tensors and
  recompiles nothing; the per-row product is the broadcast-and-sum form (neuron_opt.lora.ops), which Inductor
  fuses into loops (the C++ GEMM template has no batched GEMM).
- Rope and attention run in fp32 when the model runs in bf16: the executor passes fp32 rope tables, so q and k
  come out of rope in fp32 (one bf16 rounding fewer for q; K/V are rounded once, into the bf16 cache). Also
  faster: aten's CPU flash attention does its bf16 q.k and p.v products with MKL's bf16 gemv, slower than the
  fp32 path. Decode graphs use `DecodeAttention` instead.
"""

from __future__ import annotations

import copy
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from models.llama import MLP, Attention, TorchOps, finish_logits, read_blocks, soft_cap
from models.moe import Experts, SparseMoeBlock
from models.pooling import pool
from neuron_opt.backends.base import kv_dtype
from neuron_opt.backends.cpu import ops as cpu_ops
from neuron_opt.backends.cpu.constants import (
    ConstantRecipe,
    capture_constants,
    match_constants,
    placeholder_copy,
)
from neuron_opt.backends.cpu.weights import use_cpu_kernels
from neuron_opt.buckets import PREFILL, VERIFY, Bucket
from neuron_opt.config import CacheConfig
from neuron_opt.errors import BackendCompileError
from neuron_opt.lora.ops import LayerLora, stacks_for
from neuron_opt.parallel.layers import ColumnParallelLinear, RowParallelLinear
from neuron_opt.quant.weights import quantized_modules

# the FutureWarning torch's Inductor gives for its own deep copy of a graph's pytree specs (compile_graph)
LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
PREFILL_SPLIT_STEP = 16  # a split prefill graph's token count is a multiple of this (the executor pads to it)


class WrappedOps(TorchOps):
    """Model ops that replace a layer's attention and delegate its norms to the ops they wrap (`inner`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.inner.rms_norm(x, weight, eps)

    def rms_norm_offset(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        return self.inner.rms_norm_offset(x, weight, eps, offset)


class PrefillAttention(WrappedOps):
    """Model ops for prefill graphs: each row's queries in `parts` equal consecutive parts, each attending only the
    keys its last query can see, so most of the causal upper triangle is never computed (aten's CPU flash attention
    skips it only under `is_causal`, and the graph's mask also carries prefix offsets and windows). Part j holds
    queries [j*S/parts, (j+1)*S/parts) and reads keys [0, kv_len - S + (j+1)*S/parts); the mask, sliced alike,
    still decides what each query sees, so the result is the whole attention's.

    Contract, kept by `CpuExecutor.run`: the row's first position plus S is at most kv_len (its query i then sits
    at a position below kv_len - S + i + 1), and S is a multiple of PREFILL_SPLIT_STEP (the graph's token dimension
    is declared so: parts of 0 or 1 rows would make export specialise). The executor pads the tokens to the step
    and the block table with null blocks to the row's first position plus S; keys beyond max_model_len are masked
    for every query.

    Rows attend one at a time (batch-1 slices): with a batch dimension above 1, Inductor's stride-order check of the
    sliced mask (torch 2.13, lowering.sdpa_constraint) fails with "Exponent must be non-negative" on the key bound
    kv_len - S + i1, whose value range it cannot prove non-negative. The rows' keys are the rows' own either way.

    Why: at 1,504 tokens (SmolLM2-135M, fp32 attention, 2 threads) one layer's attention took 35.7 ms whole and 24.5
    ms in 4 parts (8 parts: 24.7, 2 parts: 29.1); at 160 tokens the two were even (docs/cpu_backend.md)."""

    def __init__(self, inner: Any, parts: int) -> None:
        if parts < 2 or PREFILL_SPLIT_STEP % parts:
            raise ValueError(f"PrefillAttention: parts must be >= 2 and divide {PREFILL_SPLIT_STEP}, got {parts}")
        super().__init__(inner)
        self.parts = parts

    def attention_blocks(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                         scale: float, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
        kv_len, S = mask.shape[-1], q.shape[2]
        torch._check(kv_len >= S)  # the contract (checked by the executor); lets export bound the key slices
        keys = read_blocks(k_cache, block_tables, kv_len).to(q.dtype)  # [B, n_kv, kv_len, D]
        values = read_blocks(v_cache, block_tables, kv_len).to(q.dtype)
        extra: dict[str, Any] = {} if softcap is None else {"softcap": softcap}
        if sinks is not None:
            extra["sinks"] = sinks
        n = S // self.parts
        rows = []
        for b in range(q.shape[0]):  # one row at a time: see the class docstring
            r = slice(b, b + 1)
            outs = []
            for j in range(self.parts):
                i0, i1 = j * n, (j + 1) * n
                kb = kv_len - S + i1
                outs.append(self.inner.attention(q[r, :, i0:i1], keys[r, :, :kb], values[r, :, :kb],
                                                 positions[r, i0:i1], mask[r, i0:i1, :kb], scale, **extra))
            rows.append(torch.cat(outs, dim=2))  # [1, n_heads, S, D]
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)  # [B, n_heads, S, D]


class DecodeAttention(WrappedOps):
    """Model ops for decode graphs (one query per row): attention written as broadcast products and sums that
    Inductor fuses into one loop nest reading the KV cache once (the GQA group's query heads share each K/V
    row), in the dtype of q. Norms delegate to `inner`; queries longer than 1 use `inner.attention_blocks`
    (SDPA). The loop nest reads each row's KV blocks in place, indexed through its block table, with the softmax
    taken over (block, position in block): no gathered copy of K/V. (The model calls only `attention_blocks`.)
    `rows_as_decode` (verify graphs under the cpu backend's exact_verify): queries longer than 1 take the same loop
    with the queries as one more broadcast dimension, so each query's output is bitwise a decode step's.

    Why: aten's CPU flash attention does one gemv per head (MKL), after a gathered copy of K/V per layer; the
    fused loop made bf16 decode faster at longer contexts. Gathering the blocks into a [B, n_kv, kv_len, D] view
    first made batched decode steps slower than reading them in place (docs/cpu_backend.md).
    """

    def __init__(self, inner: Any, rows_as_decode: bool = False, kernel: bool = False) -> None:
        super().__init__(inner)
        self.rows_as_decode = rows_as_decode
        self.kernel = kernel  # torch.ops.neuron_opt.paged_attention (cpu_ops) instead of the Inductor loop nest

    def attention_blocks(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                         scale: float, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`sinks` [n_heads] (GPT-OSS): each head's sink logit joins its softmax. The C++ kernel has no sink
        logit: with sinks the loop nest computes every step (cpu backend: `SINKS_NOT_ON_KERNEL`)."""
        B, n_heads, S, D = q.shape
        if self.kernel and sinks is None and (S == 1 or self.rows_as_decode):  # the C++ kernel: fp32 q, a query's
            if softcap is not None:  # output independent of S; the same kernel with its scores capped
                return cpu_ops.paged_attention_softcap(q.float(), k_cache, v_cache, block_tables, mask, scale,
                                                       softcap).to(q.dtype)
            return cpu_ops.paged_attention(q.float(), k_cache, v_cache, block_tables, mask, scale).to(q.dtype)
        if S != 1 and self.rows_as_decode:
            return self._queries_as_decode(q, k_cache, v_cache, block_tables, mask, scale, softcap, sinks)
        if S != 1:
            if sinks is not None:
                return self.inner.attention_blocks(q, k_cache, v_cache, block_tables, positions, mask, scale,
                                                   softcap=softcap, sinks=sinks)
            if softcap is None:
                return self.inner.attention_blocks(q, k_cache, v_cache, block_tables, positions, mask, scale)
            return self.inner.attention_blocks(q, k_cache, v_cache, block_tables, positions, mask, scale,
                                               softcap=softcap)
        nb = block_tables.shape[1]
        n_kv, per = k_cache.shape[1], k_cache.shape[2]
        g = n_heads // n_kv
        if mask.shape[-1] != nb * per:  # the positions of the last block beyond kv_len: never visible
            mask = F.pad(mask, (0, nb * per - mask.shape[-1]), value=False)
        visible = mask.view(B, nb, 1, 1, per)  # [B, nb, 1, 1, per]
        keys = k_cache[block_tables].to(q.dtype)  # [B, nb, n_kv, per, D], read in place by the fused loop
        values = v_cache[block_tables].to(q.dtype)
        qg = q.view(B, 1, n_kv, g, 1, D)
        scores = (qg * keys[:, :, :, None]).sum(-1) * scale  # [B, nb, n_kv, g, per]
        if softcap is not None:
            scores = soft_cap(scores, softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        m = scores.amax(dim=(1, 4), keepdim=True)  # [B, 1, n_kv, g, 1]
        if sinks is not None:  # the sink logit joins the max and the sum, with no value
            sink = sinks.to(scores.dtype).view(1, 1, n_kv, g, 1)
            m = torch.maximum(m, sink)
        p = torch.exp(scores - m)
        out = (p[..., None] * values[:, :, :, None]).sum(dim=(1, 4))  # [B, n_kv, g, D]
        total = p.sum(dim=(1, 4))  # [B, n_kv, g]
        if sinks is not None:
            total = total + torch.exp(sink - m)[:, 0, :, :, 0]
        out = out / total[..., None]
        return out.view(B, n_heads, 1, D)

    @staticmethod
    def _queries_as_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           mask: torch.Tensor, scale: float, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
        """S queries per row (a verify step) in the one-query loop's form, the queries one more broadcast
        dimension beside the GQA group's: each score, softmax sum and output is reduced over the same dimensions
        in the same loop as a decode step's, and K/V are read once for all S queries."""
        B, n_heads, S, D = q.shape
        nb = block_tables.shape[1]
        n_kv, per = k_cache.shape[1], k_cache.shape[2]
        g = n_heads // n_kv
        if mask.shape[-1] != nb * per:
            mask = F.pad(mask, (0, nb * per - mask.shape[-1]), value=False)
        visible = mask.view(B, S, nb, per).permute(0, 2, 1, 3)[:, :, None, None]  # [B, nb, 1, 1, S, per]
        keys = k_cache[block_tables].to(q.dtype)[:, :, :, None, None]  # [B, nb, n_kv, 1, 1, per, D]
        values = v_cache[block_tables].to(q.dtype)[:, :, :, None, None]
        qg = q.view(B, 1, n_kv, g, S, 1, D)
        scores = (qg * keys).sum(-1) * scale  # [B, nb, n_kv, g, S, per]
        if softcap is not None:
            scores = soft_cap(scores, softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        m = scores.amax(dim=(1, 5), keepdim=True)  # [B, 1, n_kv, g, S, 1]
        if sinks is not None:
            sink = sinks.to(scores.dtype).view(1, 1, n_kv, g, 1, 1)
            m = torch.maximum(m, sink)
        p = torch.exp(scores - m)
        out = (p[..., None] * values).sum(dim=(1, 5))  # [B, n_kv, g, S, D]
        total = p.sum(dim=(1, 5))  # [B, n_kv, g, S]
        if sinks is not None:
            total = total + torch.exp(sink - m)[:, 0, :, :, :, 0]
        out = out / total[..., None]
        return out.view(B, n_heads, S, D)


class KernelLinears(nn.Module):
    """Float linears that read the same input (q/k/v, gate/up) as ONE torch.ops.neuron_opt.bf16_linear call
    (cpu_ops), whose fp32 output is rounded to the input's dtype and split back into theirs, in order:
    `forward(x)` -> (y_1, ..., y_n). The linears stay where they are (their weights keep their names, so the graph's
    constants are the model's tensors as held: no packing, no concatenated copy); this module only refers to them.
    """

    def __init__(self, linears: list[nn.Module]) -> None:
        super().__init__()
        self.__dict__["parts"] = list(linears)  # not submodules: no second name for their weights
        self.sizes = [lin.weight.shape[0] for lin in linears]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.ops.neuron_opt.bf16_linear(x.reshape(-1, x.shape[-1]), [lin.weight for lin in self.parts])
        y = y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])
        outs = y.split(self.sizes, dim=-1)
        return tuple(o if lin.bias is None else o + lin.bias for o, lin in zip(outs, self.parts, strict=True))


def _kernel_matmul(self: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`_Linear._matmul` on torch.ops.neuron_opt.bf16_linear (one float linear of a kernel-GEMM graph)."""
    y = torch.ops.neuron_opt.bf16_linear(x.reshape(-1, x.shape[-1]), [self.weight])
    y = y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


_KERNEL_CLASSES: dict[type, type] = {}


def use_linear_kernel(module: nn.Module) -> int:
    """Put every bf16 float linear of `module` (a layer copy being compiled) on torch.ops.neuron_opt.bf16_linear:
    q/k/v and gate/up as one call each (KernelLinears), the others one call each (their class swapped for a
    subclass whose `_matmul` calls the operator). Quantized linears are left as they are. Returns how many linears
    it moved."""
    def floats(linears: list[Any]) -> bool:
        return all(isinstance(lin, (ColumnParallelLinear, RowParallelLinear)) and "quant" not in lin._modules
                   and lin.weight.dtype == torch.bfloat16 for lin in linears)

    moved = 0
    for m in list(module.modules()):
        if isinstance(m, Attention) and "qkv_proj" not in m._modules:
            projs = [m.q_proj, m.k_proj, m.v_proj]
            if floats(projs):
                m.qkv_proj = KernelLinears(projs)
        elif isinstance(m, MLP) and "gate_up_proj" not in m._modules:
            projs = [m.gate_proj, m.up_proj]
            if floats(projs):
                m.gate_up_proj = KernelLinears(projs)
    for m in list(module.modules()):
        if floats([m]) and type(m) not in _KERNEL_CLASSES.values():
            cls = type(m)
            if cls not in _KERNEL_CLASSES:
                _KERNEL_CLASSES[cls] = type(f"Kernel{cls.__name__}", (cls,), {"_matmul": _kernel_matmul})
            m.__class__ = _KERNEL_CLASSES[cls]
            moved += 1
    return moved


def use_cpu_layout(module: nn.Module, int8_kernel: bool = False, int8_widened: bool = False,
                   gguf_exact: bool = False) -> None:
    """The cpu backend's form of a model or layer, the same at compile and at load (graph constants are named by
    it): quantized q/k/v and gate/up fused into one GEMM each, then every quantized linear on torch's CPU
    weight-only kernels (cpu.weights); with `int8_kernel`, int8 products of few rows on cpu_ops' int8_linear, with
    `int8_widened` those of more rows on its int8_linear_widened, with `gguf_exact` gguf products of few rows on
    gguf_linear_exact (fp32 x) rather than gguf_linear."""
    for m in list(module.modules()):
        if isinstance(m, (Attention, MLP)):
            m.fuse_quantized_projections()
    use_cpu_kernels(module, int8_kernel, int8_widened, gguf_exact)


class LayerGraph(nn.Module):
    """One decoder layer in `dtype`; the KV length is the cache views' dim 2 (dynamic when compiled with it).

    The residual stream x and the rope tables come in the dtypes the executor chooses (fp32 for accuracy under
    bf16 weights: models.llama.DecoderLayer and Attention handle the mix). Decode graphs attend with
    `DecodeAttention`, prefill graphs given `prefill_parts` with `PrefillAttention`. Holds a copy of
    `layer`; the caller's model is left as it is.
    """

    def __init__(self, layer: nn.Module, dtype: torch.dtype, decode_attention: bool, decode: bool,
                 rows_as_decode: bool = False, kernel: bool = False, int8_kernel: bool = False,
                 moe_kernel: bool = False, window_input: bool = False, linear_kernel: bool = False,
                 lora_targets: tuple[str, ...] = (), int8_widened: bool = False, prefill_parts: int = 0,
                 gguf_exact: bool = False) -> None:
        super().__init__()
        # LoRA: after the window (always an input then) the rows' slots [B], then a tuple of the target modules'
        # A and B stacks
        self.lora_targets = lora_targets
        # a model whose layers mix sliding windows (ModelConfig.mixed_windows): the window is the graph's last input
        # (1-element int64; the executor passes each layer's), so one graph serves every layer
        self.window_input = window_input
        self.decode = decode  # a token-generation graph (decode, verify): models.llama.DecoderLayer's `decode`
        self.layer = copy.deepcopy(layer).to(dtype)
        use_cpu_layout(self.layer, int8_kernel, int8_widened, gguf_exact)
        for m in self.layer.modules():
            if isinstance(m, Experts):
                m.kernel = moe_kernel  # gathered experts on cpu_ops' moe_gather
        if decode_attention:
            attn = self.layer.self_attn
            attn.ops = DecodeAttention(attn.ops, rows_as_decode, kernel)
        elif prefill_parts:  # a prefill graph: each row's attention in parts (PrefillAttention)
            attn = self.layer.self_attn
            attn.ops = PrefillAttention(attn.ops, prefill_parts)
        if linear_kernel:  # bf16 float linears on cpu_ops' bf16_linear (the cpu backend's one_row_gemm "kernel")
            use_linear_kernel(self.layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, window: torch.Tensor | None = None, lora_slots: torch.Tensor | None = None,
                lora_stacks: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        kv_len = block_tables.shape[1] * k_cache.shape[2]  # every position the blocks hold
        lora = None
        if self.lora_targets:
            assert lora_slots is not None
            lora = LayerLora(lora_slots, {m: (lora_stacks[2 * j], lora_stacks[2 * j + 1])
                                          for j, m in enumerate(self.lora_targets)}, loop=True)
        return self.layer(x, cos, sin, positions, slot_mapping, block_tables, k_cache, v_cache, kv_len,
                          decode=self.decode, window=window if self.window_input else None, lora=lora)


class HeadGraph(nn.Module):
    """Final norm + LM head on the rows' last hidden states [B, H] -> fp32 logits [B, V].

    The GEMM's output goes to fp32. Compiled with the C++ GEMM template (the cpu backend's heads below fp32 with
    `logits` "fp32"), that `.float()` is fused into the template's epilogue, which stores its fp32 accumulator without
    rounding: fp32 logits of the bf16-rounded normed state and the bf16 weights, at GEMM speed. That matters: logits
    of magnitude 16-32 rounded to bf16 (steps of 0.125) create argmax ties, which cost teacher-forced agreement
    with HF fp32 (docs/cpu_backend.md). A oneDNN GEMM returns bf16, rounded, then widened.
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Module, dtype: torch.dtype, int8_kernel: bool = False,
                 cfg: Any = None, linear_kernel: bool = False, gguf_exact: bool = False) -> None:
        super().__init__()
        # a bf16 float head on cpu_ops' bf16_linear, whose fp32 output is the logits as summed (not rounded): the
        # cpu backend's head_gemm "kernel"
        self.linear_kernel = linear_kernel
        self.cfg = cfg  # the model's ModelConfig: logits scaling and soft-capping after the head (finish_logits)
        # in `dtype`, leaving the caller's modules as they are: a copy of each that converting would change (a large
        # head already in `dtype` is not copied), and of a quantized head, which moves to the CPU kernels' layouts
        def converts(m: nn.Module) -> bool:
            return any(p.is_floating_point() and p.dtype != dtype for p in m.parameters())

        quantized = "quant" in lm_head._modules
        if converts(norm):
            norm = copy.deepcopy(norm)
        if quantized or converts(lm_head):
            lm_head = copy.deepcopy(lm_head)
        if quantized:
            use_cpu_kernels(lm_head, int8_kernel, gguf_exact=gguf_exact)
        self.norm, self.lm_head = norm.to(dtype), lm_head.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)  # x may be an fp32 residual: then h is fp32
        h = h.to(self.norm.weight.dtype)
        if self.linear_kernel:
            logits = torch.ops.neuron_opt.bf16_linear(h.reshape(-1, h.shape[-1]), [self.lm_head.weight])
            logits = logits.view(*h.shape[:-1], logits.shape[-1])  # models.llama's lm_head has no bias
        else:
            logits = self.lm_head(h).float()
        return logits if self.cfg is None else finish_logits(logits, self.cfg)


class PoolGraph(nn.Module):
    """An embedding model's head (models.pooling): the final norm over every row of the layers' output [B, S, H]
    and the pooling step at `last_index` [B] -> fp32 embeddings [B, H]. One per prefill graph's batch and token
    kind (the token count is dynamic like the layer graph's)."""

    def __init__(self, norm: nn.Module, dtype: torch.dtype, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg  # the model's ModelConfig: its pooling mode and normalisation
        if any(p.dtype != dtype for p in norm.parameters()):
            norm = copy.deepcopy(norm)
        self.norm = norm.to(dtype)

    def forward(self, x: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        return pool(self.norm(x), last_index, self.cfg)  # x may be the fp32 residual: the norm then runs in fp32


def pool_example(cfg: Any, bucket: Bucket, cache: CacheConfig,
                 residual_dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Example inputs of the pool graph for a prefill `bucket`, and its dynamic_shapes spec (the layer graph's
    token dimension)."""
    B, S = bucket.batch, bucket.tokens
    args = (torch.randn(B, S, cfg.hidden_size).to(residual_dtype), torch.full((B,), S - 1, dtype=torch.int64))
    if static_tokens(bucket):
        return args, None
    return args, ({1: Dim("tokens", min=2, max=cache.max_model_len)}, None)


def head_rows(bucket: Bucket) -> int:
    """Rows the LM head scores: one per batch row, q_len per row for a verify bucket."""
    return bucket.batch * (bucket.q_len if bucket.phase == VERIFY else 1)


def static_tokens(bucket: Bucket) -> bool:
    """Whether the bucket's layer graph has a static token count: all but prefills of 2 or more tokens per row,
    whose count is a dynamic dimension (one graph for every prompt length)."""
    return not (bucket.phase == PREFILL and bucket.tokens >= 2)


def graph_keys(bucket: Bucket, pooled: bool = False) -> tuple[str, str]:
    """(layer graph key, head graph key) for a bucket. The KV length is always dynamic; a prefill's token count is
    too, except for one-token prefills (no dynamic dim of size 1), which get their own static graph. `pooled`: an
    embedding model, whose head is a pool graph (PoolGraph) over every row of the prefill."""
    if bucket.phase == VERIFY:
        layer = f"layer_verify_b{bucket.batch}_q{bucket.q_len}"
    elif bucket.phase == PREFILL:
        layer = f"layer_prefill_b{bucket.batch}" + ("_t1" if static_tokens(bucket) else "_dyn")
    else:
        layer = f"layer_decode_b{bucket.batch}"
    if bucket.phase == VERIFY:
        return layer, f"head_verify_b{bucket.batch}_q{bucket.q_len}"
    if pooled:
        return layer, layer.replace("layer_prefill", "pool")
    return layer, f"head_b{head_rows(bucket)}"


def split_extra_blocks(cache: CacheConfig) -> int:
    """Null blocks a split prefill graph's table may hold beyond a sequence's: the padding to PREFILL_SPLIT_STEP
    tokens past max_model_len (PrefillAttention's contract)."""
    return -(-(PREFILL_SPLIT_STEP - 1) // cache.block_size)


def layer_example(model: nn.Module, bucket: Bucket, cache: CacheConfig, dtype: torch.dtype,
                  residual_dtype: torch.dtype, rope_dtype: torch.dtype,
                  split: bool = False) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Example inputs of the layer graph for `bucket`, and its dynamic_shapes spec. `split`: a PrefillAttention
    graph, whose token count is a multiple of PREFILL_SPLIT_STEP and whose table may hold split_extra_blocks more."""
    B, S = bucket.batch, bucket.tokens
    if split:  # at least two steps: export specialises a dimension whose example is 1
        S = max(2, -(-S // PREFILL_SPLIT_STEP)) * PREFILL_SPLIT_STEP
    H, R = model.cfg.hidden_size, model.cfg.rotary_dim  # rope tables: the rotated features only
    bs = cache.block_size
    nb = max(2, -(-max(bucket.kv_len, S) // bs))
    k = torch.zeros(model.kv_shape(cache.num_blocks, bs), dtype=kv_dtype(cache, dtype))
    v = torch.zeros(model.kv_shape(cache.num_blocks, bs), dtype=kv_dtype(cache, dtype))
    positions = torch.arange(nb * bs - S, nb * bs).expand(B, S).contiguous()
    tables = (torch.arange(B * nb).view(B, nb) % (cache.num_blocks - 1)) + 1
    slots = tables[:, -1:] * bs + positions % bs
    args = (torch.randn(B, S, H).to(residual_dtype), torch.randn(B, S, 1, R).to(rope_dtype),
            torch.randn(B, S, 1, R).to(rope_dtype), positions, slots, tables, k, v)
    extra: tuple[Any, ...] = ()
    stacks = stacks_for(model, dtype)
    if model.cfg.mixed_windows or stacks is not None:  # LayerGraph's window input (LoRA graphs always take it)
        args, extra = (*args, torch.tensor([cache.max_model_len], dtype=torch.int64)), (None,)
    if stacks is not None:  # LayerGraph's LoRA inputs: the rows' slots, then the layer's stacks (random: no folding)
        lora_slots = torch.arange(B, dtype=torch.int64) % (stacks.max_loras + 1)
        tensors = tuple(torch.randn(t.shape).to(dtype) for t in stacks.layer_tensors(0))
        args, extra = (*args, lora_slots, tensors), (*extra, None, tuple(None for _ in tensors))
    extra_blocks = split_extra_blocks(cache) if split else 0
    blocks = Dim("blocks", min=2, max=max(3, cache.blocks_per_sequence + extra_blocks))  # min < max, always
    # window-sized KV: the sliding layers' pool is smaller, and one layer graph serves both pools
    pool = {0: Dim("pool", min=2, max=max(3, cache.num_blocks, cache.window_num_blocks))} if cache.sliding_window \
        else None
    if split:
        t = PREFILL_SPLIT_STEP * Dim("steps", min=1, max=-(-cache.max_model_len // PREFILL_SPLIT_STEP))
        return args, ({1: t}, {1: t}, {1: t}, {1: t}, {1: t}, {1: blocks}, pool, pool, *extra)
    if not static_tokens(bucket):
        t = Dim("tokens", min=2, max=cache.max_model_len)
        return args, ({1: t}, {1: t}, {1: t}, {1: t}, {1: t}, {1: blocks}, pool, pool, *extra)
    return args, (None, None, None, None, None, {1: blocks}, pool, pool, *extra)


def inductor_options(gemm: str, fuse_projections: bool = True, quantized: bool = False,
                     decode_attention: bool = False) -> dict[str, Any]:
    """How GEMMs are compiled (all three are deterministic: no timing-based choice).

    - "cpp": freezing + max_autotune restricted to the C++ GEMM template; weights become blocked constants
      (fastest fp32 decode here: the template's micro-kernels beat aten's gemv 2-3x).
    - "onednn": freezing without autotune; weights become oneDNN-packed constants and GEMMs call oneDNN
      (the bf16 default, one-row graphs included; the cpu backend's `one_row_gemm` option puts one-row graphs on
      another choice or on the bf16_linear operator: docs/cpu_backend.md).
    - "aten": plain AOTI; weights stay in their HF layout, GEMMs call aten.

    Every choice also fuses GEMMs that read the same input (q/k/v, gate/up: `cpp.enable_concat_linear`): fewer,
    larger GEMM calls, and faster bf16 batch-1 decode (docs/cpu_backend.md). The fused weight is a row concatenation
    of the projections (a `ConstantRecipe` with several sources), still built once at load.

    `quantized` (graphs with int8/int4 weights): one-row int8 GEMMs are dot-product loops Inductor generates
    (cpu.weights), and Inductor inlines their input, the normed activation, into those loops, recomputing the
    RMSNorm once per output row (the int8 decode step ran far slower than with the activation stored);
    `realize_opcount_threshold` 4 stores any pointwise result of more than 4 ops that reads several buffers.

    Every constant stays a graph constant (`always_keep_tensor_constants`): by default Inductor writes the values of
    a one-dimensional constant of up to 8 elements into the generated code, which would compile in the placeholder
    copy's random values (cpu_constants.placeholder_copy) where the model's tensor belongs, and no recipe would
    bind the real one at load. GPT-OSS's sinks (one per query head) and router bias (one per expert) are such
    tensors in models with 8 heads or experts or fewer.

    `decode_attention` (bf16 dense decode and verify layer graphs, `DecodeAttention`): threshold 8. Inductor (default
    30) otherwise inlines the rotary embedding of the query into the score loop, recomputing it for every cached
    position; stored once, bf16 batch-1 decode and the exact verify ran faster, more at longer contexts
    (docs/cpu_backend.md). 4 there made the verify many times slower: it stores broadcast products.
    """
    opts: dict[str, Any] = {"aot_inductor.package": True, "aot_inductor.package_constants_in_so": False,
                            "cpp.enable_concat_linear": fuse_projections, "always_keep_tensor_constants": True}
    if quantized:
        opts["realize_opcount_threshold"] = 4
    elif decode_attention:
        opts["realize_opcount_threshold"] = 8
    if gemm == "cpp":
        opts.update({"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"})
    elif gemm == "onednn":
        opts.update({"freezing": True})
    return opts


def has_moe_block(module: nn.Module) -> bool:
    """Whether `module` holds a mixture-of-experts block (its graphs keep Inductor's defaults: cpu.layer_gemm,
    inductor_options)."""
    return any(isinstance(m, SparseMoeBlock) for m in module.modules())


def has_capped_score_gemm(module: nn.Module) -> bool:
    """Whether `module` computes soft-capped attention scores, or scores with sinks, as batched GEMMs
    (TorchOps.attention with a softcap or sinks: Gemma 2's and GPT-OSS's prefill graphs; decode and exact-verify
    graphs cap inside DecodeAttention's loop or the C++ kernel). Inductor's C++ GEMM template has no batched GEMM,
    so these graphs compile with gemm "aten" (cpu.layer_gemm), as MoE graphs do."""
    for m in module.modules():
        if isinstance(m, Attention) and (m.softcap is not None or m.sinks is not None):
            ops = m.ops
            if not (isinstance(ops, DecodeAttention) and (ops.rows_as_decode or ops.kernel)):
                return True
    return False


def _bf16_dense_decode_attention(module: nn.Module) -> bool:
    """Whether `module` holds bf16 weights, attends with DecodeAttention and has no MoE block. The lower
    realization threshold (inductor_options) was measured a gain there only: in fp32 it made decode and verify
    slower, and so it did a bf16 MoE decode step (the random Mixtral; docs/cpu_backend.md)."""
    return (any(p.dtype == torch.bfloat16 for p in module.parameters())
            and any(isinstance(ops := getattr(m, "ops", None), DecodeAttention) and not ops.kernel
                    for m in module.modules())
            and not has_moe_block(module))


def op_calls_file(so: Path) -> Path:
    """Where AOTInductor's proxy executor looks for a graph's calls to custom operators: `<so stem>.json` beside
    the `.so` (written by the compile only when the graph makes such calls)."""
    return Path(so).with_suffix(".json")


def compile_graph(module: nn.Module, args: tuple[torch.Tensor, ...], dynamic_shapes: Any, gemm: str,
                  so_path: Path, what: str, fuse_projections: bool = True) -> dict[str, ConstantRecipe]:
    """AOT-compile `module` (on a placeholder-weight copy) into `so_path`; return its constant recipes."""
    # the GEMMs' row count M in the example (Inductor specialises oneDNN weight layouts to it)
    rows = args[0].shape[0] * (args[0].shape[1] if args[0].dim() == 3 else 1)
    ph = placeholder_copy(module, seed=0)
    named = dict(ph.state_dict())
    named.update(dict(ph.named_buffers()))
    try:
        with torch.no_grad():
            ep = torch.export.export(ph, args, dynamic_shapes=dynamic_shapes, strict=False)
            with capture_constants() as consts, warnings.catch_warnings():
                # torch 2.13's Inductor deep-copies the exported graph, whose pytree specs hold LeafSpec leaves:
                # each copy re-creates them and warns that LeafSpec is deprecated (torch's own use, nothing of
                # ours; once per graph, five times in `make demo`'s compile)
                warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, category=FutureWarning)
                options = inductor_options(gemm, fuse_projections, quantized=bool(quantized_modules(module)),
                                           decode_attention=_bf16_dense_decode_attention(module))
                files = torch._inductor.aot_compile(ep.module(), args, options=options)
    except Exception as e:  # export/inductor raise many types; name the graph and keep the cause
        raise BackendCompileError(f"{what}: AOTInductor compile failed: {type(e).__name__}: {e}") from e
    sos = [f for f in files if isinstance(f, str) and f.endswith(".so")]
    if len(sos) != 1:
        raise BackendCompileError(f"{what}: expected one .so from AOTInductor, got {files}")
    recipes = match_constants(consts, named, what, onednn_batch=rows)
    so_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sos[0], so_path)
    calls = op_calls_file(Path(sos[0]))
    if calls.is_file():
        shutil.copyfile(calls, op_calls_file(so_path))
    elif op_calls_file(so_path).exists():
        op_calls_file(so_path).unlink()
    return recipes
