"""Rockchip NPU side files: RV1109/RV1126 (RKNN-Toolkit 1) and RK3566/RK3568/RK3588 (Toolkit 2).

Source: ModelTC Dipoorlet ``deploy/deploy_rv.py`` (``gen1126`` and ``gen3568``), which writes
both files for its ``rv`` platform. Here they are two formats, ``rockchip_rv`` and
``rockchip_rk``, each written as YAML and as JSON with the same content.

``rockchip_rv`` → ``rv_quantized_param.yaml`` / ``.json``, the ``quantize_parameters`` table of
Toolkit 1's quantization config (the VeriSilicon Acuity ``.quantize`` layout)::

    customized_quantize_layers: {}
    quantize_parameters:
      "@<producer node>:out<i>":          # an activation, keyed by its producer and output index
        {dtype: asymmetric_affine, method: layer, max_value: [f], min_value: [f],
         qtype: u8, scale: [f], zero_point: [i]}
      "@<network input>:out0": {...}      # an activation that is a network input
      "@<node>:weight": {... same fields ...}
      "@<node>:bias": {dtype: asymmetric_affine, method: layer, max_value: [], min_value: [],
                       zero_point: [0], scale: [s_in * s_w], qtype: i32}

``rockchip_rk`` → ``rk_quantized_param.yaml`` / ``.json``::

    custom_quantize_layers: {}
    quantize_parameters:
      <tensor>: {max: [f], min: [f]}
      <node>_W: {max: [f per channel], min: [f per channel]}
      <node>_b: {max: [A], min: [-A]}      # A = max |bias|, as the reference

All ranges are those of the plan's grids (``scale * (qmin - zp)``, ``scale * (qmax - zp)``), so
for a full-range 8-bit grid the toolkit's own scale = (max - min) / 255 and zero point =
round(-min / scale) recover the plan's grid exactly (the reference wrote the raw clip range, with
the zero point rounded from it). Toolkit 1 also gets our scale and zero point explicitly. A signed 8-bit grid is written in Toolkit 1's unsigned form (zero point + 128, same values).
For Toolkit 2 a symmetric weight grid is written as ±(qmax * scale), from which its symmetric
weight quantizer recovers ``scale`` (the same as the grid's range for a narrow int8 grid).

Differences from the reference, on purpose:

- ReLU fusion: Toolkit 1/2 fuse Conv+Relu, so the producer's output gets the Relu output's range
  — but only when the plan has no grid of its own for that tensor (see
  :func:`dipoorlet.deploy.snpe.relu_fill_ins`); the reference matched node names by substring
  (``Conv1`` also matched ``Conv10``) and crashed on a Relu right after a network input.
- Every entry is its own dict (the reference shared dict objects, which PyYAML dumps as
  ``&id001`` anchors and ``*id001`` aliases); the YAML dumper here never writes anchors.
- No Concat or Sigmoid special cases: grids that must agree (Concat inputs) are the plan's
  business, and every tensor the plan quantizes is written so the toolkit uses our grid.
- Biases are written for weighted layers with a bias whose input grid is known, whatever the
  platform's ``[bias]`` setting: the NPU always runs int32 biases with scale s_in x s_w.

Not verified against a toolkit: layer keys use ONNX node names, while Toolkit 1's own config
uses its internal layer names (e.g. ``@Conv_Conv_0_1:out0``); per-channel weights (which
Toolkit 1 does not support) are written as per-channel lists with ``method: channel``.
"""
from __future__ import annotations

import logging

import numpy as np
import yaml

from dipoorlet.deploy import register
from dipoorlet.deploy.snpe import (floats, grid_range, ints, is_symmetric, pass_through_fill_ins, relu_fill_ins,
                                   sym_amax, unsigned_zero_point, weighted_layers)
from dipoorlet.util import write_json, write_text

log = logging.getLogger(__name__)


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True


def dump_yaml(obj) -> str:
    return yaml.dump(obj, Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=False)


def _write_both(folder, stem: str, obj) -> list:
    return [write_text(folder / f"{stem}.yaml", dump_yaml(obj)), write_json(folder / f"{stem}.json", obj)]


# ---- Toolkit 1 (RV1126) ---------------------------------------------------------------------
def _fused(ctx) -> tuple:
    """The activations the toolkit fuses into their producer (the platform's list; Relu if none)."""
    return tuple(sorted(getattr(ctx.platform, "fused_activations", ()) or ())) or ("Relu",)


def rv_key(ctx, tensor: str) -> str:
    prod = ctx.graph.producer.get(tensor)
    if prod is None:
        return f"@{tensor}:out0"
    return f"@{prod.name}:out{list(prod.output).index(tensor)}"


def rv_entry(qp) -> dict:
    lo, hi = grid_range(qp)
    per_channel = qp.axis is not None and lo.size > 1
    return {"dtype": "asymmetric_affine", "method": "channel" if per_channel else "layer",
            "max_value": floats(hi), "min_value": floats(lo), "qtype": f"u{int(qp.bits)}",
            "scale": floats(qp.scale), "zero_point": ints(unsigned_zero_point(qp))}


@register("rockchip_rv")
def export_rv(ctx, folder):
    params = {}
    acts = ctx.plan.activations
    owner, clashes = {}, []
    for t, qp in acts.items():
        key = rv_key(ctx, t)
        if key in owner:
            # a node named like a graph input: both are keyed @NAME:out0 (the format keys an input
            # as a node of its name); the second entry had replaced the first without a word
            clashes.append((key, owner[key], t))
            continue
        owner[key] = t
        params[key] = rv_entry(qp)
    for key, first, second in clashes:
        log.warning("rockchip_rv: tensors %s and %s are both keyed %s (a node is named like a graph input): "
                    "the file holds %s's grid only; rename that node in the model", first, second, key, first)
    for src, dst in {**relu_fill_ins(ctx, _fused(ctx)), **pass_through_fill_ins(ctx)}.items():
        params.setdefault(rv_key(ctx, src), rv_entry(acts[dst]))
    for layer in weighted_layers(ctx):
        name = layer.node.name
        if layer.wqp.axis is not None and len(floats(layer.wqp.scale)) > 1:
            log.warning("rockchip_rv: %s has per-channel weights, which RKNN-Toolkit 1 does not "
                        "support; use a per-tensor weight rule for RV1126", name)
        params[f"@{name}:weight"] = rv_entry(layer.wqp)
        if layer.bias and layer.bqp is not None:
            params[f"@{name}:bias"] = {"dtype": "asymmetric_affine", "method": "layer",
                                       "max_value": [], "min_value": [], "zero_point": [0],
                                       "scale": floats(layer.bqp.scale), "qtype": "i32"}
    narrow = sorted(k for k, v in params.items() if v.get("qtype", "u8") not in ("u8", "i32"))
    if narrow:
        # RKNN-Toolkit 1's asymmetric_affine quantization is uint8 only (found by a hunt)
        log.warning("rockchip_rv: %d entries have grids other than 8 bits (e.g. %s: %s); RKNN-Toolkit 1's "
                    "asymmetric_affine quantization takes u8 only: quantize for RV1126 with 8-bit weights and "
                    "activations", len(narrow), narrow[0], params[narrow[0]]["qtype"])
    return _write_both(folder, "rv_quantized_param",
                       {"customized_quantize_layers": {}, "quantize_parameters": params})


# ---- Toolkit 2 (RK3568 and later) -----------------------------------------------------------
def rk_range(qp, weight: bool = False) -> dict:
    if weight and is_symmetric(qp):   # Toolkit 2 weights are symmetric: scale = max / qmax
        a = sym_amax(qp)
        return {"max": floats(a), "min": floats(-a)}
    lo, hi = grid_range(qp)
    return {"max": floats(hi), "min": floats(lo)}


@register("rockchip_rk")
def export_rk(ctx, folder):
    params = {}
    acts = ctx.plan.activations
    for t, qp in acts.items():
        params[t] = rk_range(qp)
    for src, dst in {**relu_fill_ins(ctx, _fused(ctx)), **pass_through_fill_ins(ctx)}.items():
        params.setdefault(src, rk_range(acts[dst]))
    for layer in weighted_layers(ctx):
        name = layer.node.name
        params[f"{name}_W"] = rk_range(layer.wqp, weight=True)
        if layer.bias:
            a = float(abs(np.asarray(ctx.value(layer.bias), dtype="float64")).max(initial=0.0))
            params[f"{name}_b"] = {"max": [a], "min": [-a]}
    return _write_both(folder, "rk_quantized_param",
                       {"custom_quantize_layers": {}, "quantize_parameters": params})
