"""``act_clip_val.json`` and ``weight_clip_val.json`` as ModelTC Dipoorlet writes them.

Source: Dipoorlet ``utils.py: save_clip_val``. Activations: ``{tensor: [min, max]}`` (the clip
range calibration chose). Weights: ``{tensor: [[min per channel], [max per channel]]}``; a
per-tensor weight gets one-element lists. Unlike the reference, which lists every initializer of
Conv/Gemm/ConvTranspose (biases included) and reduces ConvTranspose/Gemm along axis 0 whatever
their layout, we list the weights that are quantized, reduced along their true output-channel axis.
A weight's range is the one its grid was built on, which rebuilds that grid: not its values' own
range, which does not where the grid was widened for an int32 bias (``plan.widened``), nor where
pruning or a fitted rounding took a channel's extreme value. An int32 bias gets its values' range.
"""
from __future__ import annotations

import numpy as np

from dipoorlet.deploy import register
from dipoorlet.qparams import MIN_SCALE
from dipoorlet.util import write_json


def _channel_range(w: np.ndarray, axis):
    if axis is None:
        return [float(w.min())], [float(w.max())]
    moved = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    return moved.min(axis=1).astype(float).tolist(), moved.max(axis=1).astype(float).tolist()


def _floored(qp, lo: list, hi: list) -> tuple[list, list]:
    """A channel whose range is narrower than MIN_SCALE (a dead channel, weights ~1e-30), whose
    grid make_qparams built on MIN_SCALE instead: that range, which rebuilds the grid (the values'
    own range rebuilt a step ~10^22 times too fine)."""
    symmetric = not np.any(np.asarray(qp.zero_point))
    out_lo, out_hi = list(lo), list(hi)
    for c, (a, b) in enumerate(zip(lo, hi)):
        if symmetric and max(-a, b) < MIN_SCALE:
            out_lo[c], out_hi[c] = -MIN_SCALE, MIN_SCALE
        elif not symmetric and b - a < MIN_SCALE:
            out_hi[c] = a + MIN_SCALE
    return out_lo, out_hi


@register("reference")
def export(ctx, folder):
    acts = {t: [float(qp.lo), float(qp.hi)] for t, qp in ctx.plan.activations.items()}
    weights = {}
    for wp in ctx.placement.weights.values():
        if wp.tensor in ctx.plan.weights and wp.tensor not in weights:
            lo, hi = _channel_range(np.asarray(ctx.value(wp.tensor)), wp.axis)
            qp = ctx.plan.weights[wp.tensor]
            if int(qp.bits) < 32:
                # the range the grid was built on, which rebuilds it: the values' own range does
                # not where the grid was widened for an int32 bias, nor where pruning (--sparse)
                # or a fitted rounding took a channel's extreme value (up to 25% finer grids)
                lo, hi = ([float(v) for v in np.broadcast_to(np.asarray(r, np.float64), np.shape(lo))]
                          for r in (qp.lo, qp.hi))
                lo, hi = _floored(qp, lo, hi)
            weights[wp.tensor] = [lo, hi]
    return [write_json(folder / "act_clip_val.json", acts),
            write_json(folder / "weight_clip_val.json", weights)]
