"""Table of illegal kernels, one per hardware/compiler rule, each next to a legal twin that must pass.

Every case builds a kernel from a `bad` flag: bad=True breaks exactly one rule and must raise the listed
SimulatorError subclass (with a message naming the rule); bad=False is the same kernel made legal.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from neuron_opt import nki_sim as nki
from neuron_opt.nki_sim import isa as nisa
from neuron_opt.nki_sim import language as nl

BF16 = ml_dtypes.bfloat16


def _out(shape: tuple[int, ...] = (128, 64)) -> Any:
    return nl.ndarray(shape, dtype=nl.float32, buffer=nl.shared_hbm)


def sbuf_partition(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        t = nl.ndarray((256 if bad else 128, 64), dtype=nl.float32, buffer=nl.sbuf)
        t[...] = 0.0
        return a

    return k


def load_partition(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        t = nl.load(a[0 : 256 if bad else 128, :])
        nl.store(out, value=t[0:128, :])
        return out

    return k


def _mm(
    st_shape: tuple[int, int],
    mv_shape: tuple[int, int],
    st_buf: Any = nl.sbuf,
    st_dt: Any = nl.bfloat16,
    mv_dt: Any = nl.bfloat16,
) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        st = nl.zeros(st_shape, dtype=st_dt, buffer=st_buf)
        mv = nl.zeros(mv_shape, dtype=mv_dt, buffer=nl.sbuf)
        res = nisa.nc_matmul(st, mv)
        out = nl.ndarray(res.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=res)
        return out

    return k


def mm_contraction(bad: bool) -> Callable[..., Any]:
    return _mm((128, 128), (64 if bad else 128, 512))


def mm_stationary_free(bad: bool) -> Callable[..., Any]:
    return _mm((128, 256 if bad else 128), (128, 512))


def mm_moving_free(bad: bool) -> Callable[..., Any]:
    return _mm((128, 128), (128, 1024 if bad else 512))


def mm_operand_psum(bad: bool) -> Callable[..., Any]:
    return _mm((128, 128), (128, 512), st_buf=nl.psum if bad else nl.sbuf, st_dt=nl.float32, mv_dt=nl.float32)


def mm_mixed_fp32(bad: bool) -> Callable[..., Any]:
    return _mm((128, 128), (128, 512), st_dt=nl.float32, mv_dt=nl.bfloat16 if bad else nl.float32)


def psum_tile_bank(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        nl.zeros((128, 1024 if bad else 512), dtype=nl.float32, buffer=nl.psum)
        return a

    return k


def psum_banks(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        live = [nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(9 if bad else 8)]
        assert len(live) >= 8
        return a

    return k


def sbuf_capacity(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        big = nl.ndarray((128, 40000), dtype=nl.float32, buffer=nl.sbuf)  # 160000 B per partition
        more = nl.ndarray((128, 10000 if bad else 1000), dtype=nl.float32, buffer=nl.sbuf)
        assert big.shape[0] == more.shape[0]
        return a

    return k


def sbuf_usable_capacity(bad: bool) -> Callable[..., Any]:
    """Past the 180224 bytes per partition the compiler lets a kernel use on trn1, short of the physical 192 KiB."""

    def k(a: Any) -> Any:
        big = nl.ndarray((128, 40000), dtype=nl.float32, buffer=nl.sbuf)  # 160000 B per partition
        more = nl.ndarray((128, 5057 if bad else 5056), dtype=nl.float32, buffer=nl.sbuf)  # 180228 / 180224
        assert big.shape[0] == more.shape[0]
        return a

    return k


def compute_on_hbm(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        src = a[0:128, :] if bad else nl.load(a[0:128, :])
        nl.store(out, value=nl.exp(src))
        return out

    return k


def load_from_sbuf(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        t = nl.load(a[0:128, :])
        t2 = nl.load(t if bad else a[0:128, :])
        nl.store(out, value=t2)
        return out

    return k


def store_to_sbuf(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        t = nl.load(a[0:128, :])
        dst = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf) if bad else out
        nl.store(dst, value=t)
        return out

    return k


def dma_from_psum(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        t = nl.load(a[0:128, :])
        src = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum if bad else nl.sbuf)
        src[...] = nl.copy(t)
        nisa.dma_copy(dst=out, src=src)
        return out

    return k


def hbm_oob(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:  # a has 200 rows: the second 128-row tile runs past the end
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        i_p, i_f = nl.mgrid[0:128, 0:64]
        for t in nl.affine_range(2):
            rows = t * 128 + i_p
            m = None if bad else rows < a.shape[0]
            x = nl.load(a[rows, i_f], mask=m)
            nl.store(out[rows, i_f], value=x, mask=m)
        return out

    return k


def tt_partitions(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        x = nl.load(a[0:128, :])
        y = nl.load(a[0:1, :]) if bad else nl.load(a[128:256, :])
        nl.store(out, value=nisa.tensor_tensor(x, y, op=nl.add))
        return out

    return k


def tt_both_psum(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        x = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum)
        x[...] = nl.load(a[0:128, :])
        y = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum if bad else nl.sbuf)
        y[...] = nl.load(a[128:256, :])
        nl.store(out, value=nisa.tensor_tensor(x, y, op=nl.multiply))
        return out

    return k


def gpsimd_psum(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        p = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum)
        p[...] = nl.load(a[0:128, :])
        eng = nisa.gpsimd_engine if bad else nisa.vector_engine
        nl.store(out, value=nisa.tensor_copy(p, engine=eng))
        return out

    return k


def reduce_partition_axis(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out((128, 1))
        x = nl.load(a[0:128, :])
        r = nisa.tensor_reduce(nl.add, x, axis=0 if bad else 1, keepdims=True)
        nl.store(out, value=r[0:128, 0:1] if not bad else r)
        return out

    return k


def activation_bias(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        x = nl.load(a[0:128, :])
        bias = nl.load(a[128:256, 0 : 4 if bad else 1])
        nl.store(out, value=nisa.activation(nl.exp, x, bias=bias))
        return out

    return k


def transpose_size(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:  # a is [128, 256]
        x = nl.load(a[:, 0 : 256 if bad else 128])
        t = nisa.nc_transpose(x, engine=nisa.tensor_engine)
        out = nl.ndarray(t.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=t)
        return out

    return k


def out_of_scope(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        keep = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        for i in nl.static_range(2):  # unrolled: the body may differ per iteration and carry `keep`
            t = nl.load(a[i * 128 : (i + 1) * 128, :])
            keep[...] = nl.add(keep, t) if i else nl.copy(t)
        nl.store(out, value=t if bad else keep)
        return out

    return k


def affine_carried(bad: bool) -> Callable[..., Any]:
    """A running sum read back each iteration: a carried dependency, legal only in a sequential_range."""

    def k(a: Any) -> Any:
        out = _out()
        run = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        for i in (nl.affine_range if bad else nl.sequential_range)(2):
            t = nl.load(a[i * 128 : (i + 1) * 128, :])
            run[...] = nl.add(run, t)
        nl.store(out, value=run)
        return out

    return k


def affine_overwrite(bad: bool) -> Callable[..., Any]:
    """Every iteration writes the same rows of the output (the last one wins): order-dependent."""

    def k(a: Any) -> Any:
        out = _out((256, 64))
        for i in nl.affine_range(2):
            t = nl.load(a[i * 128 : (i + 1) * 128, :])
            r = 0 if bad else i * 128
            nl.store(out[r : r + 128, :], value=t)
        return out

    return k


def affine_read_then_overwritten(bad: bool) -> Callable[..., Any]:
    """Iteration 1 overwrites columns iteration 0 read (write after read across iterations)."""

    def k(a: Any) -> Any:
        out = _out((256, 64))
        buf = nl.zeros((128, 192), dtype=nl.float32, buffer=nl.sbuf)
        for i in nl.affine_range(2):
            rd, wr = (64 - 64 * i, 128 - 64 * i) if bad else (64 * i, 64 * i)
            y = nl.copy(buf[:, rd : rd + 64])
            buf[:, wr : wr + 64] = nl.load(a[i * 128 : (i + 1) * 128, :])
            nl.store(out[i * 128 : (i + 1) * 128, :], value=y)
        return out

    return k


def rolled_nonuniform(bad: bool) -> Callable[..., Any]:
    """A tile extent computed from the index of a rolled loop (the tail of 200 rows)."""

    def k(a: Any) -> Any:
        out = _out((200, 64))
        for i in (nl.affine_range if bad else nl.static_range)(2):
            rows = min(128, 200 - i * 128)
            t = nl.load(a[i * 128 : i * 128 + rows, :])
            nl.store(out[i * 128 : i * 128 + rows, :], value=t)
        return out

    return k


def mixed_indexing(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        i_p = nl.arange(128)[:, None]
        i_f = nl.arange(64)[None, :]
        x = nl.load(a[:, i_f] if bad else a[i_p, i_f])
        nl.store(out, value=x)
        return out

    return k


def psum_accumulate_dtype(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out((128, 512))
        acc = nl.zeros((128, 512), dtype=nl.bfloat16 if bad else nl.float32, buffer=nl.psum)
        st = nl.zeros((128, 128), dtype=nl.bfloat16)
        mv = nl.ones((128, 512), dtype=nl.bfloat16)
        acc += nisa.nc_matmul(st, mv)
        nl.store(out, value=acc)
        return out

    return k


def return_sbuf(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out()
        t = nl.load(a[0:128, :])
        nl.store(out, value=t)
        return t if bad else out

    return k


def store_slice_oob(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        w = 72 if bad else 64  # out is 64 wide
        t = nl.load(a[0:128, 0:w])
        nl.store(out[0:128, 0:w], value=t)
        return out

    return k


def _rows(dtype: Any = nl.int32) -> Any:
    return nisa.iota(nl.arange(64)[:, None] * 2, dtype=dtype)  # [64, 1]: rows 0, 2, ..., 126


def indirect_index_in_hbm(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out((64, 64))
        idx = _rows()
        if bad:
            hbm = nl.ndarray((64, 1), dtype=nl.int32, buffer=nl.shared_hbm)
            nl.store(hbm, value=idx)
            idx = hbm
        nl.store(out, value=nl.load(a[idx, :]))
        return out

    return k


def indirect_index_not_integer(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out((64, 64))
        nl.store(out, value=nl.load(a[_rows(nl.float32 if bad else nl.int32), :]))
        return out

    return k


def indirect_index_not_first(bad: bool) -> Callable[..., Any]:
    def k(a: Any) -> Any:
        out = _out((64, 1))
        idx = _rows()
        i_p = nl.arange(64)[:, None]
        nl.store(out, value=nl.load(a[i_p, idx] if bad else a[idx, 0:1]))
        return out

    return k


CASES: list[tuple[str, Callable[[bool], Callable[..., Any]], tuple[int, int], type[Exception], str]] = [
    (
        "sbuf_partition_over_128",
        sbuf_partition,
        (256, 64),
        nki.PartitionError,
        "exceeds architecture limitation",
    ),
    (
        "load_partition_over_128",
        load_partition,
        (256, 64),
        nki.PartitionError,
        "exceeds architecture limitation",
    ),
    ("matmul_contraction_mismatch", mm_contraction, (128, 64), nki.PartitionError, "contraction"),
    ("matmul_stationary_free", mm_stationary_free, (128, 64), nki.ShapeError, "gemm_stationary_fmax"),
    ("matmul_moving_free", mm_moving_free, (128, 64), nki.ShapeError, "gemm_moving_fmax"),
    ("matmul_operand_in_psum", mm_operand_psum, (128, 64), nki.MemoryPlacementError, "address space 'sbuf'"),
    ("matmul_fp32_with_bf16", mm_mixed_fp32, (128, 64), nki.DtypeError, "both must be"),
    ("psum_tile_over_one_bank", psum_tile_bank, (128, 64), nki.CapacityError, "one bank"),
    ("psum_more_than_8_banks", psum_banks, (128, 64), nki.CapacityError, "PSUM exhausted"),
    ("sbuf_capacity", sbuf_capacity, (128, 64), nki.CapacityError, "SBUF capacity exceeded"),
    ("sbuf_usable_capacity", sbuf_usable_capacity, (128, 64), nki.CapacityError, "of 180224 usable bytes"),
    ("compute_engine_reads_hbm", compute_on_hbm, (128, 64), nki.MemoryPlacementError, "'psum|sbuf'"),
    (
        "load_from_sbuf",
        load_from_sbuf,
        (128, 64),
        nki.MemoryPlacementError,
        "'load' to be in address space 'hbm'",
    ),
    (
        "store_to_sbuf",
        store_to_sbuf,
        (128, 64),
        nki.MemoryPlacementError,
        "'store' to be in address space 'hbm'",
    ),
    ("dma_copy_from_psum", dma_from_psum, (128, 64), nki.MemoryPlacementError, "dma_copy"),
    ("hbm_out_of_bounds_unmasked", hbm_oob, (200, 64), nki.OutOfBoundsError, "Out-of-bound access"),
    ("tensor_tensor_partition_mismatch", tt_partitions, (256, 64), nki.PartitionError, "mismatch"),
    ("tensor_tensor_both_psum", tt_both_psum, (256, 64), nki.MemoryPlacementError, "both be in PSUM"),
    ("gpsimd_accesses_psum", gpsimd_psum, (128, 64), nki.MemoryPlacementError, "GpSimd"),
    ("reduce_over_partition_axis", reduce_partition_axis, (128, 64), nki.ShapeError, "partition dimension"),
    ("activation_bias_not_vector", activation_bias, (256, 64), nki.ShapeError, "bias"),
    ("pe_transpose_over_128", transpose_size, (128, 256), nki.ShapeError, "exceed architecture limitation"),
    ("tile_used_out_of_scope", out_of_scope, (256, 64), nki.ScopeError, "out of its scope"),
    ("affine_range_carried_read", affine_carried, (256, 64), nki.LoopDependencyError, "iteration 1 reads"),
    ("affine_range_same_output", affine_overwrite, (256, 64), nki.LoopDependencyError, "which iteration 0 wrote"),
    ("affine_range_write_after_read", affine_read_then_overwritten, (256, 64), nki.LoopDependencyError,
     "which iteration 0 read"),
    ("rolled_loop_body_varies", rolled_nonuniform, (200, 64), nki.RolledLoopError, "differs between iteration 0"),
    ("mixed_basic_advanced_indexing", mixed_indexing, (128, 64), nki.IndexingError, "Mixing basic"),
    ("psum_accumulate_not_fp32", psum_accumulate_dtype, (128, 64), nki.DtypeError, "fp32"),
    ("kernel_returns_sbuf_tile", return_sbuf, (128, 64), nki.MemoryPlacementError, "HBM tensors"),
    ("store_slice_out_of_bounds", store_slice_oob, (128, 72), nki.OutOfBoundsError, "Out-of-bound access"),
    ("indirect_index_in_hbm", indirect_index_in_hbm, (128, 64), nki.IndexingError, "index tile must be in SBUF"),
    ("indirect_index_not_integer", indirect_index_not_integer, (128, 64), nki.IndexingError, "must hold integers"),
    ("indirect_index_not_first", indirect_index_not_first, (128, 64), nki.IndexingError,
     "must be the first (partition) index"),
]


def _input(shape: tuple[int, int]) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("name,build,shape,exc,msg", CASES, ids=[c[0] for c in CASES])
def test_illegal_kernel_raises(
    name: str,
    build: Callable[[bool], Callable[..., Any]],
    shape: tuple[int, int],
    exc: type[Exception],
    msg: str,
) -> None:
    with pytest.raises(exc, match=re.escape(msg)) as info:
        nki.simulate_kernel(nki.jit(build(True)), _input(shape))
    assert isinstance(info.value, nki.SimulatorError)


@pytest.mark.parametrize("name,build,shape,exc,msg", CASES, ids=[c[0] for c in CASES])
def test_legal_twin_runs(
    name: str,
    build: Callable[[bool], Callable[..., Any]],
    shape: tuple[int, int],
    exc: type[Exception],
    msg: str,
) -> None:
    nki.simulate_kernel(nki.jit(build(False)), _input(shape))


def test_every_rule_also_fires_in_count_only_mode() -> None:
    """Rules are checked from shapes alone, so count-only runs reject the same kernels."""
    for _name, build, shape, exc, _msg in CASES:
        with pytest.raises(exc):
            nki.simulate_kernel(nki.jit(build(True)), nki.ShapeDtype(shape, np.float32), count_only=True)


def test_affine_range_allows_accumulation_and_disjoint_writes() -> None:
    """`+=` into one tile from every iteration (SBUF and PSUM) is the allowed carried dependency."""

    @nki.jit
    def k(a: Any, w: Any) -> Any:
        out = _out((128, 64))
        acc = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        ps = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.psum)
        wt = nl.load(w)
        for i in nl.affine_range(3):
            t = nl.load(a[i * 128 : (i + 1) * 128, :])
            acc += t
            ps += nisa.nc_matmul(wt, t)
        nl.store(out, value=nl.add(acc, ps))
        return out

    a = _input((384, 64))
    w = np.eye(128, dtype=np.float32)
    got = nki.simulate_kernel(k, a, w)
    want = 2 * a.reshape(3, 128, 64).sum(axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_affine_range_accumulation_then_read_back_is_carried() -> None:
    @nki.jit
    def k(a: Any) -> Any:
        out = _out((256, 64))
        acc = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        for i in nl.affine_range(2):
            acc += nl.load(a[i * 128 : (i + 1) * 128, :])
            nl.store(out[i * 128 : (i + 1) * 128, :], value=acc)  # a prefix sum: needs the earlier iterations
        return out

    with pytest.raises(nki.LoopDependencyError, match="iteration 1 accumulates into .* which iteration 0 read"):
        nki.simulate_kernel(k, _input((256, 64)))
