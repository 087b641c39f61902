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


def export_all(ctx: DeployContext, folder: Path) -> list[Path]:
    written = []
    for fmt in ctx.platform.deploy:
        written.extend(FORMATS[fmt](ctx, folder))
    return written


from dipoorlet.deploy import atlas, imx, magicmind, reference, rockchip, snpe, stpu, ti, trt  # noqa: E402,F401,I001
