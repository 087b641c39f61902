"""``act_clip_val.json`` and ``weight_clip_val.json`` as ModelTC Dipoorlet writes them.

Source: Dipoorlet ``utils.py: save_clip_val``. Activations: ``{tensor: [min, max]}`` (the clip
range calibration chose). Weights: ``{tensor: [[min per channel], [max per channel]]}``; a
per-tensor weight gets one-element lists. Unlike the reference, which lists every initializer of
Conv/Gemm/ConvTranspose (biases included) and reduces ConvTranspose/Gemm along axis 0 whatever
their layout, we list the weights that are quantized, reduced along their true output-channel axis.
A channel whose grid was widened so that an int32 bias fits (``plan.widened``) is given its grid's
range, not its values': a range taken from its values would rebuild the narrower grid.
"""
from __future__ import annotations

import numpy as np

from dipoorlet.deploy import register
from dipoorlet.util import write_json


def _channel_range(w: np.ndarray, axis):
    if axis is None:
        return [float(w.min())], [float(w.max())]
    moved = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    return moved.min(axis=1).astype(float).tolist(), moved.max(axis=1).astype(float).tolist()


@register("reference")
def export(ctx, folder):
    acts = {t: [float(qp.lo), float(qp.hi)] for t, qp in ctx.plan.activations.items()}
    weights = {}
    for wp in ctx.placement.weights.values():
        if wp.tensor in ctx.plan.weights and wp.tensor not in weights:
            lo, hi = _channel_range(np.asarray(ctx.value(wp.tensor)), wp.axis)
            wide = ctx.plan.widened.get(wp.tensor)
            if wide is not None:
                qp = ctx.plan.weights[wp.tensor]
                glo, ghi = (np.broadcast_to(np.asarray(v, np.float64), np.shape(lo)) for v in (qp.lo, qp.hi))
                mask = np.broadcast_to(np.asarray(wide), np.shape(lo))
                lo = np.where(mask, glo, lo).astype(float).tolist()
                hi = np.where(mask, ghi, hi).astype(float).tolist()
            weights[wp.tensor] = [lo, hi]
    return [write_json(folder / "act_clip_val.json", acts),
            write_json(folder / "weight_clip_val.json", weights)]
