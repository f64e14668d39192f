"""Operator tables: ALU ops and activation functions, by canonical name, with their fp32 numpy semantics.

Kernels name operators three ways: our front-end functions (`nl.exp`, carrying `_nki_op`), numpy functions
(`np.exp`, `np.max`: legacy kernels pass them as `op=`), or strings. `resolve_*` maps all three to a name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from neuron_opt.nki_sim.core.errors import SimulatorError


def _erf(x: np.ndarray) -> np.ndarray:
    import torch  # numpy has no erf; imported here so that the simulator itself imports without torch

    return torch.special.erf(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / np.sqrt(np.float32(2.0))))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(np.sqrt(2.0 / np.pi))
    return 0.5 * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x**3)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.float32(0.0), x)


_ERRSTATE = dict(divide="ignore", invalid="ignore", over="ignore")

ACTIVATIONS: dict[str, Callable[..., Any]] = {
    "copy": lambda x: x,
    "identity": lambda x: x,
    "exp": np.exp,
    "log": np.log,
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
    "relu": lambda x: np.maximum(x, np.float32(0.0)),
    "gelu": _gelu,
    "gelu_apprx_tanh": _gelu_tanh,
    "gelu_apprx_sigmoid": lambda x: x * _sigmoid(np.float32(1.702) * x),
    "silu": lambda x: x * _sigmoid(x),
    "softplus": _softplus,
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "erf": _erf,
    "square": np.square,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "reciprocal": lambda x: 1.0 / x,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "arctan": np.arctan,
    "sign": np.sign,
    "abs": np.abs,
    "negative": np.negative,
    "floor": np.floor,
    "ceil": np.ceil,
    "trunc": np.trunc,
}

_BOOL = lambda f: lambda a, b: f(a, b).astype(np.float32)  # noqa: E731 - comparisons give 1.0 / 0.0

ALU: dict[str, Callable[..., Any]] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "power": np.power,
    "abs_max": lambda a, b: np.maximum(np.abs(a), np.abs(b)),
    "abs_min": lambda a, b: np.minimum(np.abs(a), np.abs(b)),
    "equal": _BOOL(np.equal),
    "not_equal": _BOOL(np.not_equal),
    "greater": _BOOL(np.greater),
    "greater_equal": _BOOL(np.greater_equal),
    "less": _BOOL(np.less),
    "less_equal": _BOOL(np.less_equal),
    "logical_and": _BOOL(lambda a, b: (a != 0) & (b != 0)),
    "logical_or": _BOOL(lambda a, b: (a != 0) | (b != 0)),
    "logical_xor": _BOOL(lambda a, b: (a != 0) ^ (b != 0)),
    "bitwise_and": lambda a, b: np.bitwise_and(a.astype(np.int64), b.astype(np.int64)),
    "bitwise_or": lambda a, b: np.bitwise_or(a.astype(np.int64), b.astype(np.int64)),
    "bitwise_xor": lambda a, b: np.bitwise_xor(a.astype(np.int64), b.astype(np.int64)),
    "left_shift": lambda a, b: np.left_shift(a.astype(np.int64), b.astype(np.int64)),
    "right_shift": lambda a, b: np.right_shift(a.astype(np.int64), b.astype(np.int64)),
}

# Reduction ops and their numpy reducers (legal reduction ops of the ALU table, nki.md 3.6).
REDUCERS: dict[str, Callable[..., Any]] = {
    "add": np.sum,
    "multiply": np.prod,
    "maximum": np.max,
    "minimum": np.min,
    "logical_and": lambda x, axis, keepdims: np.all(x != 0, axis=axis, keepdims=keepdims).astype(np.float32),
    "logical_or": lambda x, axis, keepdims: np.any(x != 0, axis=axis, keepdims=keepdims).astype(np.float32),
}

_NUMPY_NAMES: dict[Any, str] = {
    np.exp: "exp",
    np.log: "log",
    np.tanh: "tanh",
    np.square: "square",
    np.sqrt: "sqrt",
    np.reciprocal: "reciprocal",
    np.negative: "negative",
    np.abs: "abs",
    np.absolute: "abs",
    np.copy: "copy",
    np.sin: "sin",
    np.cos: "cos",
    np.tan: "tan",
    np.arctan: "arctan",
    np.sign: "sign",
    np.floor: "floor",
    np.ceil: "ceil",
    np.trunc: "trunc",
    np.add: "add",
    np.subtract: "subtract",
    np.multiply: "multiply",
    np.divide: "divide",
    np.maximum: "maximum",
    np.minimum: "minimum",
    np.power: "power",
    np.max: "maximum",
    np.amax: "maximum",
    np.min: "minimum",
    np.amin: "minimum",
    np.sum: "add",
    np.prod: "multiply",
    np.equal: "equal",
    np.not_equal: "not_equal",
    np.greater: "greater",
    np.greater_equal: "greater_equal",
    np.less: "less",
    np.less_equal: "less_equal",
    np.logical_and: "logical_and",
    np.logical_or: "logical_or",
    np.logical_xor: "logical_xor",
    np.bitwise_and: "bitwise_and",
    np.bitwise_or: "bitwise_or",
    np.bitwise_xor: "bitwise_xor",
    np.left_shift: "left_shift",
    np.right_shift: "right_shift",
}


def op_name(op: Any) -> str:
    """Canonical name of an operator given as front-end function, numpy function or string."""
    if isinstance(op, str):
        return op
    name = getattr(op, "_nki_op", None)
    if name is not None:
        return str(name)
    try:
        if op in _NUMPY_NAMES:
            return _NUMPY_NAMES[op]
    except TypeError:
        pass
    raise SimulatorError(f"unsupported operator {op!r}")


def resolve_activation(op: Any) -> tuple[str, Callable[..., Any]]:
    name = op_name(op)
    if name not in ACTIVATIONS:
        raise SimulatorError(
            f"'{name}' is not a supported activation function; supported: {sorted(ACTIVATIONS)}"
        )
    fn = ACTIVATIONS[name]
    return name, lambda x: _quiet(fn, x)


def resolve_alu(op: Any) -> tuple[str, Callable[..., Any]]:
    name = op_name(op)
    if name not in ALU:
        raise SimulatorError(f"'{name}' is not a supported ALU operator; supported: {sorted(ALU)}")
    fn = ALU[name]
    return name, lambda a, b: _quiet(fn, a, b)


def resolve_reducer(op: Any) -> tuple[str, Callable[..., Any]]:
    name = op_name(op)
    if name not in REDUCERS:
        raise SimulatorError(f"'{name}' is not a legal reduction operator; legal: {sorted(REDUCERS)}")
    return name, REDUCERS[name]


def _quiet(fn: Callable[..., Any], *args: Any) -> Any:
    with np.errstate(**_ERRSTATE):  # type: ignore[arg-type]
        return np.asarray(fn(*args))
