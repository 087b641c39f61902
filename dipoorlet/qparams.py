"""Quantization parameters and the plan that holds them.

A :class:`QParams` is a grid: ``q = clamp(round(x / scale) + zero_point, qmin, qmax)``. The plan
maps every activation tensor and weight that gets Q/DQ to its grid, plus the clip range it came
from (for deploy files and reports). Bit widths other than 8 are carried through: weights of
fewer bits are stored in int8 with values inside their narrower range; activations of fewer bits
get a Clip between Q and DQ so onnxruntime simulates the narrower grid exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dipoorlet.platform import TensorRule

MIN_SCALE = 1e-8


@dataclass
class QParams:
    scale: np.ndarray            # float32, () or [C]
    zero_point: np.ndarray       # int, same shape as scale
    bits: int
    signed: bool
    qmin: int
    qmax: int
    axis: int | None = None      # per-channel axis, None for per-tensor
    lo: np.ndarray = None        # the clip range the grid was made from
    hi: np.ndarray = None

    @property
    def amax(self) -> np.ndarray:
        return np.maximum(np.abs(self.lo), np.abs(self.hi))


def levels(rule: TensorRule) -> tuple[int, int]:
    """(qmin, qmax) of the integer grid for a rule."""
    b = rule.bits
    if rule.unsigned:
        return 0, 2**b - 1
    if rule.narrow_range:
        return -(2 ** (b - 1) - 1), 2 ** (b - 1) - 1
    return -(2 ** (b - 1)), 2 ** (b - 1) - 1


def make_qparams(lo, hi, rule: TensorRule, axis: int | None = None) -> QParams:
    """The grid a rule gives to the clip range [lo, hi] (scalars or per-channel arrays)."""
    lo = np.minimum(np.asarray(lo, dtype=np.float64), 0.0)
    hi = np.maximum(np.asarray(hi, dtype=np.float64), 0.0)
    qmin, qmax = levels(rule)
    if rule.symmetric:
        amax = np.maximum(np.maximum(-lo, hi), MIN_SCALE)
        # symmetric grids use the positive side: scale = amax / qmax (127 for int8)
        scale = amax / (qmax if not rule.unsigned else qmax)
        if rule.power_of_two:
            scale = 2.0 ** np.ceil(np.log2(scale))
        zp = np.zeros_like(scale)
    else:
        span = np.maximum(hi - lo, MIN_SCALE)
        scale = span / (qmax - qmin)
        if rule.power_of_two:
            scale = 2.0 ** np.ceil(np.log2(scale))
        zp = np.clip(np.round(qmin - lo / scale), qmin, qmax)
    dtype = np.uint8 if not rule_signed(rule) else np.int8
    if rule.bits > 8:
        dtype = np.uint16 if not rule_signed(rule) else np.int16
    return QParams(scale=scale.astype(np.float32), zero_point=zp.astype(dtype), bits=rule.bits,
                   signed=rule_signed(rule), qmin=qmin, qmax=qmax, axis=axis,
                   lo=lo.astype(np.float32), hi=hi.astype(np.float32))


def rule_signed(rule: TensorRule) -> bool:
    return not rule.unsigned


def quantize_array(x: np.ndarray, qp: QParams) -> np.ndarray:
    """Integer values of ``x`` on ``qp``'s grid (round half to even, as ONNX QuantizeLinear)."""
    scale, zp = qp.scale.astype(np.float32), qp.zero_point.astype(np.float32)
    if qp.axis is not None:
        shape = [1] * x.ndim
        shape[qp.axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    q = np.clip(np.rint(x.astype(np.float32) / scale) + zp, qp.qmin, qp.qmax)
    return q.astype(qp.zero_point.dtype)


@dataclass
class QuantPlan:
    """Every grid the quantized model will use, keyed by tensor name."""

    activations: dict[str, QParams] = field(default_factory=dict)
    weights: dict[str, QParams] = field(default_factory=dict)
