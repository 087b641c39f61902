"""Cambricon MagicMind side file: ``magicmind_quant_param.json``.

Source: ModelTC Dipoorlet ``deploy/deploy_magicmind.py``:
``{"blob_range": {tensor: {"min": f, "max": f}}}`` for every quantized activation.

The reference wrote the raw clip range; here ``min``/``max`` are the range of the plan's grid,
``scale * (qmin - zp)`` and ``scale * (qmax - zp)``, so a range-based quantizer recomputes the
plan's scale and zero point exactly. Weights are not listed (as in the reference: MagicMind
quantizes them itself).
"""
from __future__ import annotations

from dipoorlet.deploy import register
from dipoorlet.deploy.snpe import floats, grid_range
from dipoorlet.util import write_json


@register("magicmind")
def export(ctx, folder):
    table = {}
    for t, qp in ctx.plan.activations.items():
        lo, hi = grid_range(qp)
        table[t] = {"min": min(floats(lo)), "max": max(floats(hi))}
    return [write_json(folder / "magicmind_quant_param.json", {"blob_range": table})]
