"""Deploy side files, one module per format, each a single ``export(ctx, folder)`` registered by name.

A platform spec lists the formats it writes (``deploy = [...]``). Exporters write into the run's
staging folder; the pipeline moves the finished files into -O only when the whole run succeeded.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

FORMATS: dict[str, Callable] = {}


def register(name: str):
    def deco(fn):
        FORMATS[name] = fn
        return fn
    return deco


@dataclass
class DeployContext:
    graph: object          # dipoorlet.graph.Graph (the prepared float graph)
    plan: object           # dipoorlet.qparams.QuantPlan
    placement: object      # dipoorlet.placement.Placement
    platform: object       # dipoorlet.platform.Platform
    config: object         # dipoorlet.config.QuantConfig

    def value(self, name: str):
        """A constant as the quantized model holds it: a weight transform's value (a corrected
        bias) where the plan has one, else the float graph's."""
        values = getattr(self.plan, "values", None) or {}
        return values[name] if name in values else self.graph.weight(name)


# formats that hold clip ranges only, from which the vendor's tool builds 8-bit grids of its own
# (trt says so itself, for asymmetric grids as well)
RANGES_ONLY = {"rockchip_rk": "rk_quantized_param", "stpu": "stpu_minmax.json", "ti": "ti_blob_range",
               "magicmind": "magicmind_quant_param.json"}
# formats that hold a scale (and offset) per tensor, no bit width: the toolkit's int8 grid has the
# simulated grid's step but a wider range
SCALES_ONLY = {"atlas": "atlas_record (int8 scale/offset)", "imx": "imx_scale.json"}


def warn_narrow(ctx: DeployContext) -> None:
    """Warn where a format without bit widths gets grids narrower than 8 bits (--w_bits 4,
    --a_bits 6, --layer_bits): from ranges the toolkit builds finer 8-bit grids than the ones
    quant_model.onnx simulates, from scales int8 grids of the same step over a wider range."""
    narrow = sorted({(t, int(qp.bits)) for grids in (ctx.plan.activations, ctx.plan.weights)
                     for t, qp in grids.items() if int(qp.bits) < 8})
    if not narrow:
        return
    import logging

    for table, holds, result in (
            (RANGES_ONLY, "clip ranges only", "the toolkit builds 8-bit grids of its own: the deployed model is finer "
                                              "than the one quant_model.onnx simulates and the report measures"),
            (SCALES_ONLY, "scales", "the toolkit builds int8 grids on them: the same steps over a wider range, so the "
                                    "deployed model does not clip where quant_model.onnx simulates and the report "
                                    "measures")):
        formats = [f for f in ctx.platform.deploy if f in table]
        if formats:
            logging.getLogger(__name__).warning(
                "%s: %d grids narrower than 8 bits (e.g. %s, %d bits); %s holds %s, no bit widths, and %s",
                ctx.platform.name, len(narrow), narrow[0][0], narrow[0][1], " and ".join(table[f] for f in formats),
                holds, result)


def export_all(ctx: DeployContext, folder: Path) -> list[Path]:
    warn_narrow(ctx)
    written = []
    for fmt in ctx.platform.deploy:
        written.extend(FORMATS[fmt](ctx, folder))
    return written


from dipoorlet.deploy import atlas, imx, magicmind, reference, rockchip, snpe, stpu, ti, trt  # noqa: E402,F401,I001
