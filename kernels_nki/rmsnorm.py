"""RMSNorm with an optional fused residual add, legacy `neuronxcc.nki` API.

Dimensions: N tokens (rows), H hidden.

Kernel layouts (HBM):
    x         `[N, H]`
    weight    `[1, H]`
    residual  `[N, H]` or None
    out       `[N, H]` normalised; with a residual also `h_out [N, H]` = x + residual (the new residual
              stream)

Layout on chip: tokens on partitions (128 rows per tile), hidden on the free dim, so the mean square is a
free-dim reduction (ScalarE `activation_reduce(square)`, no cross-partition traffic). The weight row is
loaded once and broadcast to 128 partitions once.

Pseudocode (per tile of rows [r0, r0 + rows)):
    h = x[rows] (+ residual[rows], rounded to x's dtype; stored to h_out)
    ss = sum(h^2) over H                                      # ScalarE, fp32 accumulation
    rstd = 1 / sqrt(ss / H + eps)                             # ScalarE rsqrt, [rows, 1]
    hs = h * rstd                                             # ScalarE activation (per-partition scale)
    out[rows] = hs * weight                                   # VectorE tensor_tensor (N cycles in bf16)

Constraints: x, weight (and residual) share float32 or bfloat16; H <= 8192. The working set is four [rows, H]
tiles in x's dtype (five with a residual): about 160 KiB per partition at H = 8192 in float32, within the
176 KiB a trn1 kernel may use, so the H limit alone keeps every accepted input inside SBUF.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels_nki._nki import nisa, nki, nl, simulate
from neuron_opt import nki_sim
from neuron_opt.errors import KernelArgumentError

ROWS = 128  # tokens per tile (partitions)
MAX_H = 8192


@nki.jit
def rmsnorm_kernel(x, weight, residual=None, eps=1e-6):
    """Launch as `rmsnorm_kernel(x, weight[, residual], eps=...)` (no grid)."""
    n, h = x.shape
    out = nl.ndarray((n, h), dtype=x.dtype, buffer=nl.shared_hbm)
    h_out = None if residual is None else nl.ndarray((n, h), dtype=x.dtype, buffer=nl.shared_hbm)
    p = min(ROWS, n)
    w_bc = nl.load(weight).broadcast_to((p, h))  # [p, H], the weight row on every partition
    eps_col = nl.full((p, 1), eps, dtype=nl.float32, buffer=nl.sbuf)  # activation bias is a [P, 1] vector
    for i in nl.static_range((n + ROWS - 1) // ROWS):
        r0 = i * ROWS
        rows = min(ROWS, n - r0)
        hid = nl.load(x[r0:r0 + rows, :])  # [rows, H]
        if residual is not None:
            hid = nl.add(hid, nl.load(residual[r0:r0 + rows, :]), dtype=x.dtype)
            nl.store(h_out[r0:r0 + rows, :], value=hid)
        ss = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(nl.square, hid, reduce_op=nl.add, reduce_res=ss, dtype=x.dtype)
        rstd = nisa.activation(nl.rsqrt, ss, bias=eps_col[0:rows, :], scale=1.0 / h)  # [rows, 1]
        # x * rstd on ScalarE (its per-partition scale, N cycles), then * weight on VectorE (N cycles when all
        # three are bf16): both engines stay under a tile's DMA time, where one scalar_tensor_tensor (2N cycles
        # on VectorE) did not. In bf16 that rounds x * rstd once more (2^-9 relative).
        xs = nisa.activation(nl.copy, hid, scale=rstd, dtype=x.dtype)
        y = nl.multiply(xs, w_bc[0:rows, :], dtype=x.dtype)
        nl.store(out[r0:r0 + rows, :], value=y)
    if residual is None:
        return out
    return out, h_out


def _check(x: np.ndarray, weight: np.ndarray, residual: np.ndarray | None) -> None:
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise KernelArgumentError(f"rmsnorm: want x [N, H] and weight [H]; got {x.shape}, {weight.shape}")
    if residual is not None and residual.shape != x.shape:
        raise KernelArgumentError(f"rmsnorm: residual {residual.shape} must match x {x.shape}")
    if x.shape[1] > MAX_H:
        raise KernelArgumentError(f"rmsnorm: H={x.shape[1]} > {MAX_H} does not fit the SBUF working set")
    dts = {x.dtype, weight.dtype} | ({residual.dtype} if residual is not None else set())
    if len(dts) != 1 or x.dtype.name not in ("float32", "bfloat16"):
        raise KernelArgumentError(f"rmsnorm: x, weight, residual must share float32 or bfloat16; got {dts}")


def run(x: np.ndarray, weight: np.ndarray, eps: float,
        residual: np.ndarray | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Runs the kernel (simulator here, the SDK's NKI where installed).

    Args:
        x: `[N, H]`, float32 or bfloat16.
        weight: `[H]`, same dtype.
        eps: Added to the mean square.
        residual: Optional `[N, H]`, added to x first.

    Returns:
        normed `[N, H]`, or `(normed, x + residual)` when a residual is given; x's dtype.

    Raises:
        KernelArgumentError: Shapes or dtypes the kernel does not support.
    """
    _check(x, weight, residual)
    w_row = np.ascontiguousarray(weight.reshape(1, -1))  # [1, H]
    if residual is None:
        return np.asarray(simulate(rmsnorm_kernel, np.ascontiguousarray(x), w_row, eps=float(eps)))
    normed, h = simulate(rmsnorm_kernel, np.ascontiguousarray(x), w_row, np.ascontiguousarray(residual),
                         eps=float(eps))
    return np.asarray(normed), np.asarray(h)


def estimate(n: int, h: int, *, residual: bool = False, target: str = "trn1", dtype: Any = None) -> Any:
    """Count-only cost Report of the simulator (no values computed)."""
    dt = nl.bfloat16 if dtype is None else dtype
    args = [nki_sim.ShapeDtype((n, h), dt), nki_sim.ShapeDtype((1, h), dt)]
    if residual:
        args.append(nki_sim.ShapeDtype((n, h), dt))
    _, rep = nki_sim.simulate_kernel(rmsnorm_kernel, *args, target=target, count_only=True, report=True,
                                     eps=1e-6)
    return rep
