"""What the cpu backend compiles: one decoder layer per (phase, batch), and the LM head per batch.

Design decisions (measured; see docs/cpu_backend.md)
- Regional compilation. A bucket's whole 30-layer model takes ~90 s to compile on 2 busy cores; one layer
  takes ~20 s and the same .so serves every layer (each layer gets its own AOTI container holding that
  layer's weights). Decode speed is the same or better: 30 calls into a container cost ~0.3 ms per token.
- KV length is a dynamic dimension. Within a phase and batch, buckets differ only in the attention's KV
  length, so one graph serves them all: the default 25-bucket set needs 5 layer graphs + 4 heads, not 25 models.
  The caches are passed as views `cache[:, :, :kv_len]` of a buffer one position longer than max_length:
  with a contiguous cache, export would guard on `kv_len != max_length` (the view becomes contiguous there)
  and refuse the range; the padded row keeps every view non-contiguous with the same strides.
- bf16: the residual stream between layers (and the norms reading it) stays fp32; only GEMM inputs/weights
  and the KV cache are bf16. Teacher-forced greedy agreement with HF fp32 (SmolLM2-135M, 256 tokens, HF
  eager): all-bf16 0.973, fp32 residual 0.980, bf16 weights with all activations fp32 0.996: the loss
  comes from activation rounding, mostly the residual stream, not from the weights.
- The LM head graph takes the already-gathered last hidden states [B, H], so it depends only on B.
- Attention runs in fp32 when the model runs in bf16 (`Fp32Attention`). The graph calls aten's CPU flash
  attention, whose bf16 path does its q.k and p.v products with MKL's bf16 gemv: 0.39 ms per layer at one
  query (kv 512, 1 thread) against 0.07 ms for upcast + fp32 kernel + downcast, i.e. ~10 ms of a 26 ms decode
  step over 30 layers. Prefill is no slower in fp32 (S=128: 0.50 vs 0.55 ms). The KV cache stays bf16.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from neuron_opt.backends.cpu_constants import (
    ConstantRecipe,
    capture_constants,
    match_constants,
    placeholder_copy,
)
from neuron_opt.buckets import PREFILL, Bucket
from neuron_opt.errors import BackendCompileError


class Fp32Attention:
    """Model ops that delegate to `inner`, but run attention on fp32 copies of q/k/v and cast the result back.

    Norms are untouched. Why: see the module docstring (aten's bf16 CPU attention is 5x slower at decode).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.inner.rms_norm(x, weight, eps)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                  mask: torch.Tensor, scale: float) -> torch.Tensor:
        out = self.inner.attention(q.float(), keys.float(), values.float(), positions, mask, scale)
        return out.to(q.dtype)  # [B, n_heads, S, D]


class LayerGraph(nn.Module):
    """One decoder layer; the KV length is the cache views' dim 2 (dynamic when compiled with it).

    Holds a copy of `layer` in `dtype` (the caller's model is left as it is); with `fp32_attention` the copy's
    attention runs through `Fp32Attention`.
    """

    def __init__(self, layer: nn.Module, dtype: torch.dtype, fp32_attention: bool, fp32_residual: bool) -> None:
        super().__init__()
        self.layer = copy.deepcopy(layer).to(dtype)
        self.dtype, self.fp32_residual = dtype, fp32_residual
        if fp32_attention:
            attn = self.layer.self_attn
            attn.ops = Fp32Attention(attn.ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                slot_ids: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if not self.fp32_residual:
            return self.layer(x, cos, sin, positions, slot_ids, k_cache, v_cache, k_cache.shape[2])
        # x is the fp32 residual stream; norms run on it in fp32, GEMM inputs and weights are in self.dtype.
        # Mirrors models.llama.DecoderLayer.forward (tp=1: no sequence sharding).
        ly = self.layer
        h = ly.input_layernorm(x).to(self.dtype)  # [B, S, H]
        x = x + ly.self_attn(h, cos, sin, positions, slot_ids, k_cache, v_cache, k_cache.shape[2]).float()
        return x + ly.mlp(ly.post_attention_layernorm(x).to(self.dtype)).float()


class HeadGraph(nn.Module):
    """Final norm + LM head on the rows' last hidden states [B, H] -> fp32 logits [B, V]."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x).to(self.lm_head.weight.dtype)).float()  # x may be an fp32 residual


def padded_kv(shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed cache [slots, n_kv, max_length, D] stored with one spare position (see module docstring)."""
    slots, n_kv, length, d = shape
    return torch.zeros(slots, n_kv, length + 1, d, dtype=dtype)[:, :, :length]


def graph_keys(bucket: Bucket) -> tuple[str, str]:
    """(layer graph key, head graph key) for a bucket. Seq 1 (no dynamic dim possible) gets a static graph."""
    layer = f"layer_{bucket.phase}_b{bucket.batch}" + ("_dyn" if bucket.seq >= 2 else f"_s{bucket.seq}")
    return layer, f"head_b{bucket.batch}"


def layer_example(model: nn.Module, bucket: Bucket, num_slots: int, dtype: torch.dtype,
                  residual_dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Example inputs of the layer graph for `bucket`, and the dynamic_shapes spec (None when static)."""
    B, S = bucket.batch, (bucket.seq if bucket.phase == PREFILL else 1)
    H, D = model.cfg.hidden_size, model.cfg.head_dim
    kv_len = bucket.kv_len
    k = padded_kv(model.kv_shape(num_slots), dtype)[:, :, :kv_len]
    v = padded_kv(model.kv_shape(num_slots), dtype)[:, :, :kv_len]
    positions = torch.arange(S).expand(B, S).contiguous() if S > 1 else torch.full((B, 1), kv_len - 1)
    args = (torch.randn(B, S, H).to(residual_dtype), torch.randn(B, S, 1, D).to(dtype), torch.randn(B, S, 1, D).to(dtype),
            positions, torch.arange(B) % num_slots, k, v)
    if bucket.seq < 2:
        return args, None
    kv = Dim("kv_len", min=2, max=model.max_length)
    if bucket.phase == PREFILL:  # S == kv_len for prefill buckets
        return args, ({1: kv}, {1: kv}, {1: kv}, {1: kv}, None, {2: kv}, {2: kv})
    return args, (None, None, None, None, None, {2: kv}, {2: kv})


def inductor_options(gemm: str) -> dict[str, Any]:
    """How GEMMs are compiled (all three are deterministic: no timing-based choice).

    - "cpp": freezing + max_autotune restricted to the C++ GEMM template; weights become blocked constants
      (fastest fp32 decode here: the template's micro-kernels beat aten's gemv 2-3x).
    - "onednn": freezing without autotune; weights become oneDNN-packed constants and GEMMs call oneDNN
      (fastest bf16 here: oneDNN uses avx512_bf16 dot products, the template converts bf16 to fp32 without AMX).
    - "aten": plain AOTI; weights stay in their HF layout, GEMMs call aten.
    """
    opts: dict[str, Any] = {"aot_inductor.package": True, "aot_inductor.package_constants_in_so": False}
    if gemm == "cpp":
        opts.update({"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"})
    elif gemm == "onednn":
        opts.update({"freezing": True})
    return opts


def compile_graph(module: nn.Module, args: tuple[torch.Tensor, ...], dynamic_shapes: Any, gemm: str,
                  so_path: Path, what: str) -> dict[str, ConstantRecipe]:
    # the GEMMs' row count M in the example (Inductor specialises oneDNN weight layouts to it)
    rows = args[0].shape[0] * (args[0].shape[1] if args[0].dim() == 3 else 1)
    """AOT-compile `module` (on a placeholder-weight copy) into `so_path`; return its constant recipes."""
    ph = placeholder_copy(module, seed=0)
    named = dict(ph.state_dict())
    named.update(dict(ph.named_buffers()))
    try:
        with torch.no_grad():
            ep = torch.export.export(ph, args, dynamic_shapes=dynamic_shapes, strict=False)
            with capture_constants() as consts:
                files = torch._inductor.aot_compile(ep.module(), args, options=inductor_options(gemm))
    except Exception as e:  # export/inductor raise many types; name the graph and keep the cause
        raise BackendCompileError(f"{what}: AOTInductor compile failed: {type(e).__name__}: {e}") from e
    sos = [f for f in files if isinstance(f, str) and f.endswith(".so")]
    if len(sos) != 1:
        raise BackendCompileError(f"{what}: expected one .so from AOTInductor, got {files}")
    recipes = match_constants(consts, named, what, onednn_batch=rows)
    so_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sos[0], so_path)
    return recipes
