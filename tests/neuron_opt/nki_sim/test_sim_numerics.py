"""Numerics of the simulator against numpy: rounding on store, fp32 PSUM accumulation, engine ops, masks,
index expressions, SPMD grids, uninitialised-memory sentinels."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from neuron_opt import nki_sim as nki
from neuron_opt.nki_sim import isa as nisa
from neuron_opt.nki_sim import language as nl

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(1234)


def _f32(shape: tuple[int, ...]) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@nki.jit
def _unary(a: Any, op: Any) -> Any:
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=op(nl.load(a)))
    return out


@pytest.mark.parametrize(
    "op,ref",
    [
        (nl.exp, np.exp),
        (nl.tanh, np.tanh),
        (nl.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
        (nl.silu, lambda x: x / (1 + np.exp(-x))),
        (nl.square, np.square),
        (nl.negative, np.negative),
        (nl.gelu, lambda x: 0.5 * x * (1 + np.vectorize(__import__("math").erf)(x / np.sqrt(2)))),
    ],
)
def test_unary_math_matches_numpy(op: Any, ref: Any) -> None:
    x = _f32((64, 48))
    np.testing.assert_allclose(nki.simulate_kernel(_unary, x, op), ref(x), rtol=1e-5, atol=1e-6)


def test_store_into_bf16_rounds_to_nearest_even() -> None:
    @nki.jit
    def k(a: Any) -> Any:
        out = nl.ndarray(a.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(out, value=nl.multiply(nl.load(a), 3.0))
        return out

    x = _f32((32, 40))
    got = nki.simulate_kernel(k, x)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got, (x * np.float32(3.0)).astype(BF16))


def test_psum_accumulates_in_fp32_and_bf16_operands_are_exact() -> None:
    @nki.jit
    def k(lhs_t: Any, rhs: Any) -> Any:
        kk, m = lhs_t.shape
        out = nl.ndarray((m, rhs.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
        acc = nl.zeros((m, rhs.shape[1]), dtype=nl.float32, buffer=nl.psum)
        for i in nl.affine_range(kk // 128):
            acc += nisa.nc_matmul(
                nl.load(lhs_t[i * 128 : (i + 1) * 128, :]), nl.load(rhs[i * 128 : (i + 1) * 128, :])
            )
        nl.store(out, value=acc)
        return out

    a = RNG.standard_normal((512, 96)).astype(BF16)
    b = RNG.standard_normal((512, 200)).astype(BF16)
    ref = a.astype(np.float64).T @ b.astype(np.float64)
    got = nki.simulate_kernel(k, a, b)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_nl_matmul_both_layouts_and_transposes() -> None:
    @nki.jit
    def k(x: Any, y: Any) -> Any:  # x [M, K], y [K, N]
        o1 = nl.ndarray((x.shape[0], y.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((x.shape[0], y.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
        o3 = nl.ndarray((x.shape[1], x.shape[0]), dtype=nl.float32, buffer=nl.shared_hbm)
        xs, ys = nl.load(x), nl.load(y)
        nl.store(o1, value=nl.matmul(xs, ys))
        xt = nl.transpose(xs)
        nl.store(o2, value=nl.matmul(xt, ys, transpose_x=True))
        nl.store(o3, value=nisa.nc_transpose(xs))
        return o1, o2, o3

    x, y = _f32((64, 96)), _f32((96, 300))
    o1, o2, o3 = nki.simulate_kernel(k, x, y)
    np.testing.assert_allclose(o1, x @ y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(o2, x @ y, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(o3, x.T)


def test_activation_scale_bias_and_reduce() -> None:
    @nki.jit
    def k(x: Any, b: Any) -> Any:
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        sums = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.shared_hbm)
        red = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
        y = nisa.activation_reduce(
            nl.exp, nl.load(x), bias=nl.load(b), scale=-0.5, reduce_op=nl.add, reduce_res=red
        )
        nl.store(out, value=y)
        nl.store(sums, value=red)
        return out, sums

    x, b = _f32((100, 70)), _f32((100, 1))
    out, sums = nki.simulate_kernel(k, x, b)
    ref = np.exp(x * -0.5 + b)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    np.testing.assert_allclose(sums[:, 0], ref.sum(axis=1), rtol=1e-5)


def test_reductions_tensor_scalar_and_tensor_tensor() -> None:
    @nki.jit
    def k(x: Any, v: Any) -> Any:
        o_max = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.shared_hbm)
        o_mean = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.shared_hbm)
        o_ts = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        o_tt = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        t, col = nl.load(x), nl.load(v)
        nl.store(o_max, value=nisa.tensor_reduce(np.max, t, axis=(1,), keepdims=True))
        nl.store(o_mean, value=nl.mean(t, axis=1, keepdims=True))
        nl.store(o_ts, value=nisa.tensor_scalar(t, np.subtract, col, op1=nl.multiply, operand1=2.0))
        nl.store(o_tt, value=nisa.tensor_tensor(t, nl.exp(t), op=nl.maximum))
        return o_max, o_mean, o_ts, o_tt

    x, v = _f32((90, 33)), _f32((90, 1))
    o_max, o_mean, o_ts, o_tt = nki.simulate_kernel(k, x, v)
    np.testing.assert_allclose(o_max[:, 0], x.max(axis=1))
    np.testing.assert_allclose(o_mean[:, 0], x.mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(o_ts, (x - v) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(o_tt, np.maximum(x, np.exp(x)), rtol=1e-6)


def test_softmax_where_broadcast_iota_and_affine_select() -> None:
    @nki.jit
    def k(x: Any, row: Any) -> Any:
        p, f = x.shape
        o_sm = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        o_bc = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        o_causal = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        o_iota = nl.ndarray(x.shape, dtype=nl.int32, buffer=nl.shared_hbm)
        t = nl.load(x)
        nl.store(o_sm, value=nl.softmax(t, axis=1))
        nl.store(o_bc, value=nl.load(row).broadcast_to((p, f)))
        i_p, i_f = nl.mgrid[0:p, 0:f]
        nl.store(o_causal, value=nisa.affine_select(i_p >= i_f, t, -1e9))
        nl.store(o_iota, value=nisa.iota(i_p * f + i_f, dtype=nl.int32))
        return o_sm, o_bc, o_causal, o_iota

    x, row = _f32((16, 24)), _f32((1, 24))
    sm, bc, causal, io = nki.simulate_kernel(k, x, row)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(sm, e / e.sum(axis=1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(bc, np.broadcast_to(row, x.shape))
    np.testing.assert_array_equal(causal, np.where(np.tril(np.ones_like(x)) > 0, x, np.float32(-1e9)))
    np.testing.assert_array_equal(io, np.arange(16 * 24).reshape(16, 24))


def test_masked_load_store_with_block_dims_and_ds() -> None:
    """A ragged row count processed in 128-row tiles kept in a block-dim SBUF buffer."""

    @nki.jit
    def k(x: Any) -> Any:
        n, f = x.shape
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        buf = nl.ndarray((2, nl.par_dim(128), f), dtype=x.dtype, buffer=nl.sbuf)
        i_p, i_f = nl.mgrid[0:128, 0:f]
        for t in nl.affine_range(2):
            rows = t * 128 + i_p
            buf[t, i_p, i_f] = nl.load(x[rows, i_f], mask=rows < n)
            nl.store(out[rows, i_f], value=nl.add(buf[t, i_p, i_f], 1.0), mask=rows < n)
        return out

    x = _f32((200, 20))
    np.testing.assert_array_equal(nki.simulate_kernel(k, x), x + 1.0)


def test_uninitialised_reads_are_nan_and_int_sentinel() -> None:
    @nki.jit
    def k(x: Any) -> Any:
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        out_i = nl.ndarray(x.shape, dtype=nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        t[0:4, :] = nl.load(x[0:4, :])
        nl.store(out, value=t)
        ti = nl.ndarray(x.shape, dtype=nl.int32, buffer=nl.sbuf)
        nl.store(out_i, value=ti)
        return out, out_i

    out, out_i = nki.simulate_kernel(k, _f32((8, 4)))
    assert np.isfinite(out[:4]).all() and np.isnan(out[4:]).all()
    assert (out_i == np.iinfo(np.int32).max).all()


def test_spmd_grid_program_ids_share_the_output() -> None:
    @nki.jit
    def k(x: Any) -> Any:
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        b, h = nl.program_id(0), nl.program_id(1)
        assert nl.num_programs(1) == x.shape[1] and nl.program_ndim() == 2
        t = nl.load(x[b, h])  # [S, D]
        nl.store(out[b, h], value=nl.add(t, float(10 * b + h)))
        return out

    x = _f32((2, 3, 16, 8))
    bias = (10 * np.arange(2)[:, None] + np.arange(3)[None, :]).astype(np.float32)[:, :, None, None]
    np.testing.assert_array_equal(nki.simulate_kernel(k[2, 3], x), x + bias)


def test_inputs_written_by_the_kernel_are_updated_in_place() -> None:
    @nki.jit
    def k(x: Any) -> Any:
        nl.store(x, value=nl.multiply(nl.load(x), 2.0))
        return x

    x = _f32((4, 4))
    x0 = x.copy()
    nki.simulate_kernel(k, x)
    np.testing.assert_array_equal(x, x0 * 2)


def test_count_only_matches_full_run_cost_and_returns_no_values() -> None:
    @nki.jit
    def k(a: Any, b: Any) -> Any:
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        ps = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
        for i in nl.affine_range(2):
            ps += nisa.nc_matmul(
                nl.load(a[i * 128 : (i + 1) * 128, :]), nl.load(b[i * 128 : (i + 1) * 128, :])
            )
        nl.store(out, value=nl.exp(ps))
        return out

    a, b = RNG.standard_normal((256, 128)).astype(BF16), RNG.standard_normal((256, 512)).astype(BF16)
    _, full = nki.simulate_kernel(k, a, b, report=True)
    out, counted = nki.simulate_kernel(
        k, nki.ShapeDtype(a.shape, BF16), nki.ShapeDtype(b.shape, BF16), count_only=True, report=True
    )
    assert out is None
    assert counted.to_dict() == full.to_dict()


def test_indirect_load_gathers_rows_by_an_sbuf_index_tile() -> None:
    """`nl.load(t[idx_tile, ...])`: partition p gets t[idx[p], ...]; any order, repeats allowed; an index past
    dim 0 is an out-of-bound error when the load runs (it is runtime data: count-only runs cannot see it)."""

    @nki.jit
    def k(t: Any, idx: Any) -> Any:
        n = idx.shape[0]
        out = nl.ndarray((n, 3, 8), dtype=t.dtype, buffer=nl.shared_hbm)
        rows = nl.load(idx)  # [n, 1] int32, one index per partition
        nl.store(out, value=nl.load(t[rows, 1, :, 0:8]))
        return out

    rng = np.random.default_rng(0)
    t = rng.standard_normal((40, 2, 3, 16)).astype(np.float32)
    idx = np.array([[7], [0], [39], [7], [12]], dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(nki.simulate_kernel(k, t, idx)), t[idx[:, 0], 1, :, 0:8])
    with pytest.raises(nki.OutOfBoundsError, match="index 40 on dimension 0 of size 40"):
        nki.simulate_kernel(k, t, np.array([[3], [40]], dtype=np.int32))
    nki.simulate_kernel(k, nki.ShapeDtype(t.shape, nl.float32), nki.ShapeDtype((2, 1), nl.int32), count_only=True)
