"""NXP i.MX side file: ``imx_scale.json``, power-of-two scales.

Source: ModelTC Dipoorlet ``deploy/deploy_imx.py`` (the file was ``imx_clip_val.json`` in
earlier versions): ``{"blob_range": {tensor: [scale]}}`` for activations and, since its imx
platform deploys weights, ``{weight: [scale per output channel]}`` in the same table.

The reference recomputed ``2 ** round(log2(amax / 127))`` from the clip range, which rounds to
the nearer power of two and so can clip (a scale smaller than amax / 127). Here the values are
the plan's scales, the ones ``quant_model.onnx`` simulates; on a platform spec with
``power_of_two = true`` they are already powers of two. A scale that is not one is written as it
is, with a warning (the chip would round it).
"""
from __future__ import annotations

import logging

import numpy as np

from dipoorlet.deploy import register
from dipoorlet.deploy.snpe import floats, pass_through_fill_ins
from dipoorlet.util import write_json

log = logging.getLogger(__name__)


def _is_pow2(values: list[float]) -> bool:
    v = np.asarray(values, dtype=np.float64)
    return bool(np.all(v > 0) and np.all(np.frexp(v)[0] == 0.5))


@register("imx")
def export(ctx, folder):
    table = {t: floats(qp.scale) for t, qp in ctx.plan.activations.items()}
    for src, dst in pass_through_fill_ins(ctx).items():
        table[src] = table[dst]
    for wp in ctx.placement.weights.values():
        qp = ctx.plan.weights.get(wp.tensor)
        if qp is not None and int(qp.bits) < 32:   # int32 biases are not in the reference table
            table.setdefault(wp.tensor, floats(qp.scale))
    odd = [t for t, v in table.items() if not _is_pow2(v)]
    if odd:
        log.warning("imx: %d scales are not powers of two (e.g. %s); use a platform spec with "
                    "power_of_two = true for i.MX", len(odd), odd[0])
    return [write_json(folder / "imx_scale.json", {"blob_range": table})]
