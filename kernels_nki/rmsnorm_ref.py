"""Reference for `rmsnorm.py`: RMSNorm (optionally after a residual add) in float64 numpy."""

from __future__ import annotations

import numpy as np


def rmsnorm_ref(x: np.ndarray, weight: np.ndarray, eps: float,
                residual: np.ndarray | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """`weight * h / sqrt(mean(h^2) + eps)` with `h = x (+ residual)`.

    The sum is rounded to the input dtype first, as a model adding two bf16 tensors would.

    Args:
        x: `[N, H]`.
        weight: `[H]`.
        eps: Added to the mean square.
        residual: Optional `[N, H]`, added to `x` before normalising.

    Returns:
        The normalised `[N, H]` (float64), or `(normed, h)` when a residual is given (`h` in x's dtype).
    """
    h = x if residual is None else (x.astype(np.float32) + residual.astype(np.float32)).astype(x.dtype)
    hf = h.astype(np.float64)
    normed = hf / np.sqrt(np.mean(hf * hf, axis=-1, keepdims=True) + eps) * weight.astype(np.float64)
    return normed if residual is None else (normed, h)
