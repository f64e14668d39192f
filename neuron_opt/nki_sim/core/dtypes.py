"""Data types: numpy / ml_dtypes dtypes, promotion rules, rounding and uninitialised-memory sentinels.

Why ml_dtypes: bf16 and fp8 tiles must round (round-to-nearest-even) every time a value is stored into them,
exactly as the hardware does on write-back; keeping the storage in the real dtype gives that for free.
Engines compute in fp32 internally (nki.md 3.1), so every instruction reads its inputs as fp32, computes, and
casts once into the destination dtype.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from neuron_opt.nki_sim.core.errors import DtypeError

bool_ = np.dtype(np.bool_)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
# The legacy API names fp8 e4m3 after ml_dtypes' IEEE-style `float8_e4m3` (nki.md 3.1).
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
# tfloat32 has no numpy type: stored as fp32 with the mantissa truncated to 10 bits on write.
tfloat32 = np.dtype("V4")

_FP8 = {float8_e4m3, float8_e4m3fn, float8_e5m2}
MATMUL_DTYPES = {bfloat16, float16, float32, tfloat32} | _FP8


def normalize(dtype: Any) -> np.dtype:
    """Return a numpy dtype for anything a kernel may pass (np type, np.dtype, string, our constants)."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise DtypeError(f"unsupported dtype {dtype!r}") from exc
    return dt


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """The numpy dtype used to hold values of `dtype` (tfloat32 is held in fp32)."""
    return float32 if dtype == tfloat32 else dtype


def is_float(dtype: np.dtype) -> bool:
    return dtype == tfloat32 or dtype.kind == "f" or dtype in _FP8 or dtype == bfloat16


def itemsize(dtype: np.dtype) -> int:
    return 4 if dtype == tfloat32 else dtype.itemsize


def sentinel(dtype: np.dtype) -> Any:
    """Fill value of a new allocation: NaN for floats, the dtype's max for integers (reads of it show up)."""
    if is_float(dtype):
        return np.nan
    if dtype == bool_:
        return True
    return np.iinfo(dtype).max


def cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round/convert `values` into `dtype` the way a write-back does (RNE; fp32->tf32 truncates)."""
    if dtype == tfloat32:
        bits = np.asarray(values, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
        return bits.view(np.float32)
    if not is_float(dtype) and is_float_array(values):
        # Float to integer conversion truncates toward zero; NaN would be undefined, keep it visible.
        values = np.nan_to_num(values, nan=0.0)
    return np.asarray(values).astype(dtype, copy=False)


def is_float_array(values: np.ndarray) -> bool:
    return is_float(np.asarray(values).dtype)


def to_f32(values: np.ndarray) -> np.ndarray:
    """Engine input conversion: everything is computed in fp32 (ints of 32 bits stay exact enough)."""
    return np.asarray(values).astype(np.float32, copy=False)


def promote(a: np.dtype | None, b: np.dtype | None) -> np.dtype:
    """Legacy NKI type promotion of two operands; None stands for a weak Python scalar.

    Rules (nki.md 3.1): (float, int) -> float; (fp16, bf16) -> fp32; (fp8 e4m3, fp8 e5m2) -> bf16;
    (int8, uint8) -> int16; (int32, uint32) -> fp32; a Python scalar counts as fp32 (float) or int32.
    """
    if a is None and b is None:
        return float32
    if a is None or b is None:
        known = a if a is not None else b
        assert known is not None
        # Weak scalars: float32 for float scalars is handled by the caller passing float32 explicitly.
        return known
    if a == b:
        return a
    fa, fb = is_float(a), is_float(b)
    if fa and not fb:
        return a
    if fb and not fa:
        return b
    if fa and fb:
        if a in _FP8 and b in _FP8:
            return bfloat16
        if a in _FP8:
            return b
        if b in _FP8:
            return a
        if {a, b} == {float16, bfloat16}:
            return float32
        return a if itemsize(a) >= itemsize(b) else b
    if {a, b} == {int32, uint32}:
        return float32
    return np.promote_types(a, b)


def scalar_dtype(value: Any) -> np.dtype:
    """dtype of a weak Python scalar operand."""
    if isinstance(value, (bool, np.bool_)):
        return uint8
    if isinstance(value, (int, np.integer)):
        return int32
    return float32
