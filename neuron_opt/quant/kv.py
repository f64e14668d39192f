"""The fp8 KV cache (`compile --kv-cache-dtype fp8`): per-layer scales, calibrated once and folded into weights.

K and V are stored as float8_e4m3fn (1 byte, 3 mantissa bits) and widened to the compute dtype when read. A scale
per layer keeps them inside e4m3's range: K is stored as K / s_k and V as V / s_v. Those divisions are folded
into the weights at compile time, so no graph multiplies by a scale:
  - k_proj (weight and bias) / s_k and q_proj (weight and bias) * s_k: q . k is unchanged (rope is linear, so
    rope(K) / s_k = rope(K / s_k));
  - v_proj (weight and bias) / s_v and o_proj's weight * s_v: softmax(.) V Wo^T is unchanged.
Per-layer scalars commute with every tp sharding and with our quantized formats (they multiply scales and
offsets exactly), so the fold works on canonical or stored-quantized tensors alike.

Calibration: the tp=1 model runs one prefill of a fixed text (`CALIBRATION_TEXT`, about 300 tokens) in the
compute dtype; forward hooks on k_proj and v_proj record, per layer, max |V| and a bound on max |rope(K)| (per
rotary pair, sqrt(k_i^2 + k_{i+R/2}^2) over the R rotated features, times the rope tables' attention factor (yarn,
longrope); |k_i| for features past R (partial rotary): rope never exceeds it, at any position). The scale maps that
maximum to FP8_MAX / HEADROOM, leaving 4x for activations larger than the text produced; anything beyond e4m3's
range is clamped when written (models.llama.write_blocks). Relative precision does not depend on the scale (3 mantissa
bits) except for values far below the maximum, which e4m3's subnormals absorb.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from neuron_opt.quant.weights import FP8_MAX, QuantTensor, scale_quant

HEADROOM = 4.0
CALIBRATION_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring panels; "
    "stored programs replaced the wires, assemblers replaced the numbers, and compilers replaced the assembly. "
    "Each step let people say more while writing less.\n\n"
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n    for _ in range(n):\n"
    "        out.append(a)\n        a, b = b, a + b\n    return out\n\n"
    "Q: What is the capital of France?\nA: Paris is the capital and largest city of France, on the Seine.\n"
    "Temperatures in July averaged 25.3 C (77.5 F); rainfall was 61 mm, about 12% above the 1991-2020 mean. "
    "User: Summarise the paragraph above in one sentence.\nAssistant: Computing advanced by layering "
    "abstractions, each letting programmers express more with less effort. "
    "Les langues romanes, comme le francais et l'espagnol, descendent du latin vulgaire. "
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987. {\"name\": \"test\", \"values\": [1, 2, 3]}"
)

_PROJ = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)")


def calibrate(model: torch.nn.Module, token_ids: list[int], block_size: int) -> tuple[list[float], list[float]]:
    """Per-layer (s_k, s_v) from one prefill of `token_ids` through the tp=1 `model` (KV pools in its dtype)."""
    layers = model.model.layers
    D, R = model.cfg.head_dim, model.cfg.rotary_dim
    # the rope tables carry an attention factor (yarn, longrope: cos/sin times it; cos at position 0 is it): a
    # rotated pair's values reach its norm times the largest factor
    gain = max(float(b[0].abs().max()) for n, b in model.named_buffers() if n.startswith("rope_cos"))
    amax_k = [0.0] * len(layers)
    amax_v = [0.0] * len(layers)

    def hook(i: int, which: str) -> Callable[..., None]:
        def fn(_mod: Any, _inp: Any, out: torch.Tensor) -> None:
            x = out.detach().float().view(*out.shape[:-1], -1, D)  # [B, S, n_kv, D]
            if which == "k":  # rope rotates pairs (i, i + R/2) of the first R features: their norm (times the
                half = R // 2  # attention factor) bounds both rotated values; features past R pass through
                bound = gain * (x[..., :half].square() + x[..., half:R].square()).sqrt().amax().item()
                if R < D:
                    bound = max(bound, x[..., R:].abs().amax().item())
                amax_k[i] = max(amax_k[i], bound)
            else:
                amax_v[i] = max(amax_v[i], x.abs().amax().item())
        return fn

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.k_proj.register_forward_hook(hook(i, "k")))
        handles.append(layer.self_attn.v_proj.register_forward_hook(hook(i, "v")))
    try:
        _prefill(model, token_ids, block_size)
    finally:
        for h in handles:
            h.remove()
    target = FP8_MAX / HEADROOM
    return [max(a, 1e-6) / target for a in amax_k], [max(a, 1e-6) / target for a in amax_v]


@torch.inference_mode()
def _prefill(model: torch.nn.Module, token_ids: list[int], block_size: int) -> None:
    S = len(token_ids)
    nb = -(-S // block_size)
    dtype = model.model.embed_tokens.weight.dtype
    shape = model.kv_shape(nb + 1, block_size)  # blocks 1..nb, and the null block 0
    L = len(model.model.layers)
    k = [torch.zeros(shape, dtype=dtype) for _ in range(L)]
    v = [torch.zeros(shape, dtype=dtype) for _ in range(L)]
    pos = torch.arange(S)[None]  # [1, S]
    model(torch.tensor([token_ids]), pos, pos + block_size, torch.arange(1, nb + 1)[None], torch.tensor([S - 1]),
          k, v, nb * block_size)


def fold_factor(name: str, k_scales: list[float], v_scales: list[float]) -> float:
    """What the canonical tensor `name` is multiplied by (1.0 for every tensor the fold leaves alone)."""
    m = _PROJ.fullmatch(name)
    if m is None:
        return 1.0
    i, proj, kind = int(m.group(1)), m.group(2), m.group(3)
    return {"q": k_scales[i], "k": 1 / k_scales[i], "v": 1 / v_scales[i],
            "o": v_scales[i] if kind == "weight" else 1.0}[proj]


def fold(tensors: Iterable[tuple[str, Any]], k_scales: list[float],
         v_scales: list[float]) -> Iterator[tuple[str, Any]]:
    """The canonical (name, tensor | QuantTensor) stream with the KV scales folded in (see the module docstring)."""
    for name, w in tensors:
        f = fold_factor(name, k_scales, v_scales)
        if f == 1.0:
            yield name, w
        elif isinstance(w, QuantTensor):
            yield name, scale_quant(w, f)
        else:
            yield name, (w.float() * f).to(w.dtype)
