"""SenseTime STPU side file: ``stpu_minmax.json``, symmetric ranges per tensor and layer.

Source: ModelTC Dipoorlet ``deploy/deploy_stpu.py``. One flat table:

- ``<node>_weights: {"min": -A, "max": A}`` per node with a quantized weight;
- ``<tensor>: {"min": -A, "max": A}`` per quantized activation;
- ``<node>_bias: {"alpha": s_w * s_in, "zero_point": 0}`` per Conv/ConvTranspose/Gemm with a
  bias: the plan's int32 bias scale, else the product of the plan's scales (the reference derived
  both as (max - min) / 254 = A / 127 from the written ranges; for a Winograd layer, as there,
  s_w = A / qmax of the Winograd-domain range);
- with ``--stpu_wg``: ``layer_<node>: {"wg": true}`` for Winograd-eligible convolutions, whose
  ``<node>_weights`` range is then that of the Winograd-domain weights.

A is taken from the plan's grid: ``scale * qmax`` for a symmetric grid (so the chip's
``A / 127`` is the plan's scale), the grid's half-width otherwise; per-channel scales (which the
chip does not have) give the largest channel. Like the reference, a ReLU/Clip output's range is
given to the tensor feeding it when that is fused into its producer — here only when the plan
has no grid of its own for it.

Winograd: a Conv qualifies with group 1, a 3x3 kernel, strides 1 and dilations 1 (missing
attributes take their ONNX defaults; the reference did not check dilations, and its ``--stpu_wg``
crashed calling ``get_attribute_value`` on an ONNX ``NodeProto``). The weight range is
``± max |G w Gᵀ|`` over all (output, input) kernels with the standard F(2x2, 3x3) transform
``G = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]]`` (Lavin & Gray 2015). The
reference used ``2 G`` (integer entries), which makes every value 4 times larger; which one the
STPU compiler expects could not be checked. ``quant_model.onnx`` does not simulate
Winograd-domain weight quantization, so ``--stpu_wg`` results are not covered by our report.

Left out: the reference's ``emin`` entries (exponent floors for Conv/Gemm/Upsample/Corr outputs),
which need the ranges of layer outputs the placement may not quantize.
"""
from __future__ import annotations

import numpy as np

from dipoorlet.deploy import register
from dipoorlet.deploy.snpe import floats, pass_through_fill_ins, relu_fill_ins, scalar_or_list, sym_amax, weighted_layers
from dipoorlet.graph import node_attr
from dipoorlet.util import write_json

CHIP_QMAX = 127     # the chip's int8 grids: scale = A / 127 of the range written
WINOGRAD_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


def _sym(a: float) -> dict:
    return {"min": -float(a), "max": float(a)}


def winograd_eligible(node, weight: np.ndarray) -> bool:
    if node.op_type != "Conv" or weight.ndim != 4:
        return False
    kernel = list(node_attr(node, "kernel_shape", weight.shape[2:]))
    return (node_attr(node, "group", 1) == 1 and kernel == [3, 3] and list(weight.shape[2:]) == [3, 3]
            and all(s == 1 for s in node_attr(node, "strides", [1, 1]))
            and all(d == 1 for d in node_attr(node, "dilations", [1, 1])))


def winograd_amax(weight: np.ndarray) -> float:
    """max |G w Gᵀ| over every (output, input) 3x3 kernel."""
    u = np.einsum("ij,ocjk,lk->ocil", WINOGRAD_G, weight.astype(np.float64), WINOGRAD_G)
    return float(np.abs(u).max(initial=0.0))


@register("stpu")
def export(ctx, folder):
    acts = ctx.plan.activations
    param = {}
    layers = weighted_layers(ctx)
    for layer in layers:
        param[f"{layer.node.name}_weights"] = _sym(sym_amax(layer.wqp).max())
    for t, qp in acts.items():
        param[t] = _sym(sym_amax(qp).max())
    for src, dst in {**relu_fill_ins(ctx, ("Relu", "Clip")), **pass_through_fill_ins(ctx)}.items():
        param.setdefault(src, _sym(sym_amax(acts[dst]).max()))
    wg_scale = {}
    if getattr(ctx.config, "stpu_wg", False):
        for layer in layers:
            w = ctx.graph.weight(layer.weight)
            if winograd_eligible(layer.node, w):
                a = winograd_amax(w)
                param[f"layer_{layer.node.name}"] = {"wg": True}
                param[f"{layer.node.name}_weights"] = _sym(a)
                wg_scale[layer.node.name] = a / CHIP_QMAX
    for layer in layers:
        if not layer.bias or layer.bqp is None:
            continue
        alpha = floats(layer.bqp.scale)
        name = layer.node.name
        # the chip builds its int8 grids from the written ranges (A / 127): a grid narrower than 8
        # bits (--w_bits 4, --a_bits 6) is written as its range, so the bias scale must be the
        # product of those 8-bit steps (the plan's narrow steps made it 127/7 = 18x too large for
        # 4-bit weights)
        narrow = layer.wqp.bits < 8 or (layer.dqp is not None and layer.dqp.bits < 8)
        if (name in wg_scale or narrow) and layer.dqp is not None:
            w_step = wg_scale.get(name, param[f"{name}_weights"]["max"] / CHIP_QMAX)
            in_step = (floats(layer.dqp.scale)[0] if layer.dqp.bits >= 8 else
                       float(sym_amax(layer.dqp).max()) / CHIP_QMAX)
            alpha = [w_step * in_step]
        param[f"{name}_bias"] = {"alpha": scalar_or_list(alpha), "zero_point": 0}
    return [write_json(folder / "stpu_minmax.json", param)]
