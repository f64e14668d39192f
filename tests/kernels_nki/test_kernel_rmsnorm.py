"""rmsnorm kernel (NKI simulator) vs the float64 numpy reference over a table of shapes.

Tolerances per dtype: float32 (1e-5 relative; fp32 accumulation of the mean square); bfloat16 output
is one bf16 rounding of a value of magnitude ~|weight| * 4 (2^-8 relative, 1e-2 absolute). The fused residual
sum must equal the bf16/fp32-rounded x + residual exactly.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels_nki import rmsnorm
from kernels_nki.rmsnorm_ref import rmsnorm_ref
from neuron_opt.errors import KernelArgumentError

TOL = {"float32": (1e-5, 1e-5), "bfloat16": (1e-2, 1e-2)}  # (rtol, atol)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# (N, H, with_residual, dtype): N crosses the 128-row tile (odd tails), H odd and large.
CASES = [
    (1, 8, False, "float32"), (1, 8, True, "bfloat16"), (3, 17, False, "float32"), (7, 64, True, "float32"),
    (31, 100, False, "bfloat16"), (64, 128, True, "bfloat16"), (127, 96, False, "float32"),
    (128, 256, True, "float32"), (129, 33, False, "bfloat16"), (130, 512, True, "bfloat16"),
    (200, 1000, False, "float32"), (255, 64, True, "float32"), (256, 128, False, "bfloat16"),
    (257, 300, True, "float32"), (300, 2048, False, "bfloat16"), (5, 4096, True, "bfloat16"),
    (2, 8192, False, "float32"), (384, 48, True, "bfloat16"), (100, 576, False, "float32"),
    (16, 960, True, "float32"), (9, 1536, False, "bfloat16"), (45, 2049, True, "float32"),
    (128, 1, False, "float32"), (1, 1, True, "float32"), (513, 16, False, "float32"),
    (77, 768, True, "bfloat16"), (140, 3072, False, "float32"), (12, 5120, True, "bfloat16"),
    (260, 40, False, "bfloat16"), (33, 4096, True, "float32"),
]


@pytest.mark.parametrize("n,h,with_res,dtype", CASES)
def test_matches_reference(n, h, with_res, dtype):
    rng = np.random.default_rng(n * 13 + h)
    dt = DTYPES[dtype]
    x = (rng.standard_normal((n, h)) * 3.0).astype(dt)
    w = (1.0 + 0.1 * rng.standard_normal(h)).astype(dt)
    res = (rng.standard_normal((n, h)) * 3.0).astype(dt) if with_res else None
    eps = 1e-5
    rtol, atol = TOL[dtype]
    got = rmsnorm.run(x, w, eps, residual=res)
    ref = rmsnorm_ref(x, w, eps, residual=res)
    if with_res:
        (got, got_h), (ref, ref_h) = got, ref
        assert got_h.dtype == x.dtype
        np.testing.assert_array_equal(got_h.astype(np.float32), ref_h.astype(np.float32))
    assert got.shape == x.shape and got.dtype == x.dtype
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=rtol, atol=atol)


def test_rejects_mismatched_shapes():
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(KernelArgumentError):
        rmsnorm.run(x, np.ones(9, np.float32), 1e-6)
    with pytest.raises(KernelArgumentError):
        rmsnorm.run(x, np.ones(8, np.float32), 1e-6, residual=np.zeros((4, 9), np.float32))
