"""Weights of an AOTInductor graph, bound at load time from ONE shared set of tensors.

Why this module exists
- With `freezing` + `max_autotune`, Inductor's C++ GEMM template (the fast CPU path: 2-3x aten's gemv at batch 1)
  treats every weight as a constant and re-lays it out at compile time ("prepacking": [N, K] -> blocked
  [ceil(N/bn), K, bn], plus VNNI interleaving for some bf16 kernels). Packaged as is, each bucket's graph would
  carry its own copy of all weights.
- We compile with `aot_inductor.package_constants_in_so=False`, so the .so holds code only, and record for every
  graph constant a *recipe*: which model tensor it is, and which packing turns that tensor into the constant.
  At load time the executor packs each weight once and hands the same tensor to every graph
  (`update_constant_buffer(..., user_managed=True)` keeps our pointer, no copy).
- Recipes are found by value, not by reading Inductor internals: we compile a copy of the module whose
  parameters are distinct random numbers (so no two tensors are equal and no weight is uniform: Inductor folds a
  uniform-valued constant into the code, which would silently ignore the real weight later, cf. pytorch#165444),
  capture the graph's constants and match each one against the identity or a packing of one parameter.
  A constant that matches nothing is an error, never a silent fallback.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from neuron_opt.errors import BackendCompileError

PACK_OPS = ("identity", "flat", "flat_fp32", "pack", "onednn", "literal")


@dataclass(frozen=True)
class ConstantRecipe:
    """How to build one graph constant from a model tensor.

    Args:
        sources: the tensor's name relative to the compiled module (e.g. ("layer.mlp.up_proj.weight",)); several
            names: the rows (dim 0) of those tensors concatenated, in order (Inductor's concat-linear pass fuses
            q/k/v and gate/up projections that read the same input into one GEMM).
        op: "identity" (the tensor itself), "flat" (a one-row tensor [1, n] as [n]; "flat_fp32": widened to fp32),
            "pack" (the C++ GEMM template's blocked layout, see `pack_weight`) or "onednn" (an opaque oneDNN weight
            from `torch.ops.mkldnn._reorder_linear_weight`).
        block_n: "pack": block along N (output features).
        vnni: "pack": VNNI interleave along K (0 = none, 2 or 4).
        batch: "onednn": the batch (M) hint oneDNN chose its layout for.
        literal: "literal" (no sources): a 0-d int64 constant the lowering itself made, e.g. the group size Inductor
            turns into a tensor for torch's int4 CPU kernel.
    """

    sources: tuple[str, ...]
    op: str
    block_n: int = 0
    vnni: int = 0
    batch: int = 0
    literal: int = 0

    def __post_init__(self) -> None:
        assert self.op in PACK_OPS, self.op

    def to_dict(self) -> dict[str, list[str] | str | int]:
        return {**asdict(self), "sources": list(self.sources)}

    @classmethod
    def from_dict(cls, d: dict) -> ConstantRecipe:
        return cls(tuple(str(s) for s in d["sources"]), str(d["op"]), int(d.get("block_n", 0)),
                   int(d.get("vnni", 0)), int(d.get("batch", 0)), int(d.get("literal", 0)))


def pack_weight(w: torch.Tensor, block_n: int, vnni: int) -> torch.Tensor:
    """Inductor's CPP GEMM weight layout of a linear weight `w` [N, K] (y = x @ w.T).

    Pads N up to a multiple of block_n, then blocks: [N_pad/block_n, K, block_n]; with VNNI-v, each group of
    v consecutive K rows is interleaved inside a block: [nb, K/v, v, bn] -> [nb, K/v, bn, v].
    Mirrors `CppGemmTemplate.block_weight` / `pack_vnni_weight` (torch 2.13) for tensors.
    """
    n, k = w.shape
    n_pad = -(-n // block_n) * block_n
    wt = torch.nn.functional.pad(w.t(), (0, n_pad - n))  # [K, N_pad]
    b = wt.reshape(k, n_pad // block_n, block_n).transpose(0, 1).contiguous()  # [nb, K, bn]
    if vnni:
        b = b.view(n_pad // block_n, k // vnni, vnni, block_n)  # [nb, K/v, v, bn]
        b = b.transpose(-1, -2).reshape(n_pad // block_n, k, block_n).contiguous()  # [nb, K, bn] interleaved
    return b


def build_constant(parts: list[torch.Tensor], r: ConstantRecipe) -> torch.Tensor:
    """The constant `r` describes, from its source tensors (in `r.sources` order)."""
    if r.op == "literal":
        return torch.tensor(r.literal, dtype=torch.int64)
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if r.op == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(t, r.batch)
    if r.op in ("flat", "flat_fp32"):
        return t.reshape(-1).to(torch.float32 if r.op == "flat_fp32" else t.dtype).contiguous()
    return t.contiguous() if r.op == "identity" else pack_weight(t, r.block_n, r.vnni)


def placeholder_copy(module: nn.Module, seed: int) -> nn.Module:
    """A deep copy whose parameters are distinct random values (buffers, e.g. rope tables, are kept)."""
    mod = copy.deepcopy(module)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            if p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
            else:  # quantized values: uniform over the dtype's range (distinct tensors, no uniform constant)
                lo, hi = (-128, 128) if p.dtype == torch.int8 else (0, 256)
                p.copy_(torch.randint(lo, hi, p.shape, generator=g, dtype=torch.int32).to(p.dtype))
    return mod


@contextlib.contextmanager
def capture_constants() -> Iterator[dict[str, torch.Tensor]]:
    """Record the constants (by the name the .so uses) of every AOTInductor graph compiled inside the block.

    Wraps `AotCodeCompiler.compile`, which receives the lowered graph right before writing the C++ wrapper;
    `graph.constants` minus folded ones is exactly the set `update_constant_buffer` expects.
    """
    from torch._inductor import codecache  # here: only a compile needs Inductor; loading a graph does not

    out: dict[str, torch.Tensor] = {}
    original = codecache.AotCodeCompiler.compile.__func__  # type: ignore[attr-defined]

    def patched(cls, graph, *args, **kwargs):  # type: ignore[no-untyped-def]
        for name in graph.constants:
            if name not in graph.folded_constants:
                out[name] = graph.get_original_value_of_constant(name)
        return original(cls, graph, *args, **kwargs)

    codecache.AotCodeCompiler.compile = classmethod(patched)  # type: ignore[method-assign,assignment]
    try:
        yield out
    finally:
        codecache.AotCodeCompiler.compile = classmethod(original)  # type: ignore[method-assign,assignment]


def _rows_of(d: torch.Tensor, named: dict[str, torch.Tensor], pad_to: int = 1) -> tuple[str, ...] | None:
    """Names whose tensors, concatenated along dim 0 in that order, equal `d` (one name: `d` itself), allowing
    up to `pad_to - 1` trailing zero rows (the C++ GEMM template pads N to its block size).

    Greedy prefix match: parameters are distinct random values, so at most one tensor matches each row block.
    """
    out: list[str] = []
    row = 0
    while row < d.shape[0]:
        if out and d.shape[0] - row < pad_to and not d[row:].any():
            break
        hit = next((name for name, t in named.items() if t.dtype == d.dtype and t.dim() == d.dim()
                    and t.shape[1:] == d.shape[1:] and 0 < t.shape[0] <= d.shape[0] - row
                    and torch.equal(t, d[row:row + t.shape[0]])), None)
        if hit is None:
            return None
        out.append(hit)
        row += named[hit].shape[0]
    return tuple(out) if out else None


def unpack_weight(b: torch.Tensor, vnni: int) -> torch.Tensor:
    """Inverse of `pack_weight` up to padding: blocked [nb, K, bn] -> [N_pad, K]."""
    nb, k, bn = b.shape
    if vnni:
        b = b.view(nb, k // vnni, bn, vnni).transpose(-1, -2).reshape(nb, k, bn)
    return b.transpose(0, 1).reshape(k, nb * bn).t()


def _find(c: torch.Tensor, named: dict[str, torch.Tensor], onednn_batch: int) -> ConstantRecipe | None:
    if c.dim() == 0 and c.dtype == torch.int64:  # no model tensor is 0-d: a literal of the lowering
        return ConstantRecipe((), "literal", literal=int(c))
    if c.is_mkldnn:  # an opaque oneDNN weight: its logical value names the source(s), the batch hint its layout
        sources = _rows_of(c.to_dense(), named)
        return ConstantRecipe(sources, "onednn", batch=onednn_batch) if sources else None
    for name, t in named.items():
        if t.shape == c.shape and t.dtype == c.dtype and torch.equal(t, c):
            return ConstantRecipe((name,), "identity")
    if c.dim() == 1:  # a one-row weight flattened (freezing folds a [1, H] linear into a dot product, e.g.
        # Qwen2-MoE's shared_expert_gate), or concatenated biases
        for name, t in named.items():  # (widened to fp32 when the graph computes it in fp32: exact)
            if t.dim() == 2 and t.shape[0] == 1 and t.shape[1] == c.shape[0] and t.is_floating_point():
                if t.dtype == c.dtype and torch.equal(t[0], c):
                    return ConstantRecipe((name,), "flat")
                if c.dtype == torch.float32 and torch.equal(t[0].float(), c):
                    return ConstantRecipe((name,), "flat_fp32")
        sources = _rows_of(c, named)
        return ConstantRecipe(sources, "identity") if sources else None
    if c.dim() != 3:
        return None
    nb, k, bn = c.shape
    for vnni in (0, 2, 4):
        if vnni and k % vnni:
            continue
        sources = _rows_of(unpack_weight(c, vnni), named, pad_to=bn)
        if sources and torch.equal(pack_weight(torch.cat([named[n] for n in sources]), bn, vnni), c):
            return ConstantRecipe(sources, "pack", bn, vnni)
    return None


def match_constants(consts: dict[str, torch.Tensor], named: dict[str, torch.Tensor], what: str,
                    onednn_batch: int = 0) -> dict[str, ConstantRecipe]:
    """Recipe for every captured constant; raises BackendCompileError naming the ones that match nothing.

    `onednn_batch` is the M the graph's GEMMs were specialised for (Inductor's freezing pass packs oneDNN
    weights for the example's row count).
    """
    recipes: dict[str, ConstantRecipe] = {}
    missing = []
    for cname, c in consts.items():
        r = _find(c, named, onednn_batch)
        if r is None:
            missing.append(f"{cname} {tuple(c.shape)} {c.dtype}")
        else:
            recipes[cname] = r
    if missing:
        raise BackendCompileError(f"{what}: graph constants not derived from any model tensor: {missing[:5]}; "
                                  "the cpu backend cannot share weights for this graph")
    return recipes
