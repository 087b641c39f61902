"""Qualcomm SNPE / QNN side file: AIMET quantization encodings, format version 0.6.1.

``snpe_encodings.json`` (and the same content as ``qnn_encodings.json`` for QNN, whose
``--quantization_overrides`` reads the same format)::

    {"version": "0.6.1",
     "activation_encodings": {tensor: [enc]},
     "param_encodings": {weight: [enc, ...one per output channel when per-channel]},
     "quantizer_args": {"activation_bitwidth": 8, "dtype": "int", "is_symmetric": false,
                        "param_bitwidth": 8, "per_channel_quantization": true,
                        "quant_scheme": "post_training_tf"}}

    enc = {"bitwidth": b, "dtype": "int", "is_symmetric": "True"|"False",
           "max": float, "min": float, "offset": int, "scale": float}

Sources: AIMET ``Docs/api_docs/quantization_encoding_specification.rst`` (encoding fields,
``is_symmetric`` as the strings "True"/"False", several encodings = per channel);
``aimet_common/quantsim.py: extract_global_quantizer_args`` (the ``quantizer_args`` block, whose
``is_symmetric`` and ``per_channel_quantization`` AIMET writes as JSON booleans, not strings);
ModelTC Dipoorlet ``deploy/deploy_snpe.py`` (file name, activations only).

Convention (AIMET / QNN): ``float = (q + offset) * scale`` with ``q`` unsigned in
``[0, 2^b - 1]``, ``min = offset * scale``, ``max = min + (2^b - 1) * scale``. Our grids map onto
it exactly: ``offset = full_qmin - zero_point`` where ``full_qmin`` is ``-2^(b-1)`` for a signed
grid and 0 for an unsigned one, so an unsigned asymmetric grid gets ``offset = -zero_point`` and a
signed symmetric grid gets AIMET's symmetric form ``offset = -2^(b-1)``, ``min = -2^(b-1) * scale``,
``max = (2^(b-1) - 1) * scale``. A narrow-range grid (qmin = -127) is written with the full range
(the format has no narrow flag); the extra level is never produced by our simulation. Because
everything is derived from the plan's scale and zero point, ``min <= 0 <= max`` always holds and
the numbers describe exactly the grid ``quant_model.onnx`` simulates (the reference wrote the raw
clip range, whose ``min`` could be > 0, e.g. a sigmoid's [0.02, 0.98], and no scale/offset).

Biases get a 32-bit symmetric encoding (scale = input scale x weight scale, per channel when the
weight is) only when the platform quantizes biases (``[bias] quantize = true``), as AIMET writes
bias encodings only when its bias quantizers are enabled; otherwise pass ``--bias_bitwidth 32``
to the QNN converter.

This module also holds the small grid helpers the other exporters of this package share.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from dipoorlet.deploy import register
from dipoorlet.util import write_json

log = logging.getLogger(__name__)

AIMET_VERSION = "0.6.1"
BIAS_OPS = ("Conv", "ConvTranspose", "Gemm")


# ---- grid helpers shared by the other exporters of this package ------------------------------
@dataclass
class Grid:
    """The fields of :class:`dipoorlet.qparams.QParams` the exporters read (for derived grids)."""

    scale: np.ndarray
    zero_point: np.ndarray
    bits: int
    signed: bool
    qmin: int
    qmax: int
    axis: int | None = None


def grid_range(qp) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) the grid represents: ``scale * (qmin - zp)``, ``scale * (qmax - zp)`` (float64).

    The scales are float32, so these products are exact in float64.
    """
    s = np.asarray(qp.scale, dtype=np.float64)
    zp = np.asarray(qp.zero_point).astype(np.int64)
    return s * (qp.qmin - zp), s * (qp.qmax - zp)


def full_qmin(qp) -> int:
    """The lowest integer of the full ``bits``-wide storage type: -2^(b-1) or 0."""
    return -(2 ** (qp.bits - 1)) if qp.signed else 0


def is_symmetric(qp) -> bool:
    return bool(qp.signed) and not np.any(np.asarray(qp.zero_point) != 0)


def unsigned_zero_point(qp) -> np.ndarray:
    """The zero point of the same grid stored unsigned (q' = q - full_qmin), as int64."""
    return np.asarray(qp.zero_point).astype(np.int64) - full_qmin(qp)


def sym_amax(qp) -> np.ndarray:
    """Half-width A of the range [-A, A] a symmetric-only chip derives its scale from.

    For a symmetric grid A = scale * qmax, so the chip's scale A / qmax is the plan's scale; for
    any other grid A covers the whole grid.
    """
    if is_symmetric(qp):
        return np.asarray(qp.scale, dtype=np.float64) * qp.qmax
    lo, hi = grid_range(qp)
    return np.maximum(-lo, hi)


def floats(a) -> list[float]:
    return [float(v) for v in np.ravel(np.asarray(a, dtype=np.float64))]


def ints(a) -> list[int]:
    return [int(v) for v in np.ravel(np.asarray(a).astype(np.int64))]


def scalar_or_list(values: list):
    return values[0] if len(values) == 1 else values


def tensor_grid(ctx, node, index: int):
    """(tensor, grid) of the Q/DQ that ``node.input[index]`` reads, or (None, None).

    Follows a Pad whose Q/DQ the placement moved in front of it (the Pad keeps the grid: its
    zero padding is on it).
    """
    for _ in range(8):
        for point in ctx.placement.activations.values():
            if (node.name, index) in point.uses and point.tensor in ctx.plan.activations:
                return point.tensor, ctx.plan.activations[point.tensor]
        prod = ctx.graph.producer.get(node.input[index])
        if prod is None or prod.op_type != "Pad":
            break
        node, index = prod, 0
    return None, None


@dataclass
class Layer:
    """A node with a quantized weight, its data input's grid and its int32 bias grid."""

    node: object                 # onnx.NodeProto
    weight: str
    wqp: object                  # the weight's QParams
    data: str | None = None      # the tensor carrying the data input's Q/DQ
    dqp: object = None           # its QParams
    bias: str | None = None      # the bias initializer, if any
    bqp: object = None           # its grid: from the plan, else scale = s_in * s_w


def weighted_layers(ctx) -> list[Layer]:
    """One :class:`Layer` per (node, weight) the placement quantizes, in graph order."""
    g, plan = ctx.graph, ctx.plan
    layers = []
    for wp in ctx.placement.weights.values():
        wqp = plan.weights.get(wp.tensor)
        node = g.node_by_name.get(wp.node)
        if wqp is None or node is None or _is_bias(node, wp.index, wqp):
            continue
        layer = Layer(node, wp.tensor, wqp)
        for i, name in enumerate(node.input):
            if i != wp.index and name and not g.is_constant(name):
                layer.data, layer.dqp = tensor_grid(ctx, node, i)
                break
        bias = node.input[2] if node.op_type in BIAS_OPS and len(node.input) > 2 else ""
        if bias and g.is_constant(bias):
            layer.bias = bias
            # the plan's grid of the bias where this layer reads it quantized; a bias another
            # layer's grid quantizes (two layers sharing it; this one reads it float) gets this
            # layer's own s_in * s_w: it had been written with the other layer's scale (found by
            # a hunt: 6.3x too small on one Conv)
            own = ctx.placement.weights.get((node.name, 2))
            layer.bqp = plan.weights.get(bias) if own is not None and own.tensor == bias else None
            if layer.bqp is None and layer.dqp is not None:
                s = (np.float32(np.asarray(layer.dqp.scale, dtype=np.float32).reshape(-1)[0])
                     * np.asarray(wqp.scale, dtype=np.float32)).astype(np.float32)
                layer.bqp = Grid(s, np.zeros(s.shape, np.int32), 32, True, -2**31, 2**31 - 1, wqp.axis)
        layers.append(layer)
    order = {n.name: i for i, n in enumerate(g.graph.node)}
    layers.sort(key=lambda l: order.get(l.node.name, 0))
    return layers


def _is_bias(node, index: int, qp) -> bool:
    return (node.op_type in BIAS_OPS and index == 2) or int(qp.bits) >= 32


def relu_fill_ins(ctx, ops=("Relu",)) -> dict[str, str]:
    """{pre-activation tensor: activation output} for a ReLU-like node a backend fuses into its
    producer: the input comes from a node (not a network input), is read only by the ReLU, has no
    grid of its own in the plan, and the ReLU's output has one. Exporters give the fused
    producer's output the ReLU output's range, as the reference does, but never override a grid
    the plan holds (the reference overwrote it, and matched node names by substring)."""
    g, acts = ctx.graph, ctx.plan.activations
    # a producer kept float (--skip_layers, --auto_skip) computes in float: no range for its
    # output (the files gave one to a skipped Conv's output, which the simulated model leaves float)
    quantized = getattr(ctx.placement, "quantized_nodes", None)
    quantizable = getattr(ctx.platform, "quantize_ops", None)
    if quantized is not None and quantizable is not None:       # the placement (skipped layers are float there)
        quantized = set(quantized)
        skipped = {n.name for n in g.graph.node if n.op_type in quantizable and n.name not in quantized}
    else:                                                        # a context built by hand
        skipped = set(getattr(ctx.config, "skip_layers", ()) or ())
    out = {}
    for node in g.graph.node:
        if node.op_type not in ops or not node.input or not node.output:
            continue
        src, dst = node.input[0], node.output[0]
        if (src in acts or dst not in acts or src not in g.producer or len(g.consumers[src]) != 1
                or src in g.output_names or g.producer[src].name in skipped):
            continue
        out[src] = dst
    return out


def pass_through_fill_ins(ctx) -> dict[str, str]:
    """{tensor: gridded tensor} for a quantized node's output that reaches a grid only through
    ops that move values (PRelu -> Transpose -> Flatten -> MatMul): the PRelu's and the
    Transpose's outputs take the Flatten output's grid, the one quant_model.onnx rounds them onto
    (the side files had nothing for them; found by a hunt). The nearest grid along the chain
    serves; a grid of their own is never overridden."""
    from dipoorlet.placement import pass_through_chain

    g, acts = ctx.graph, ctx.plan.activations
    quantized = set(getattr(ctx.placement, "quantized_nodes", ()) or ())
    out = {}
    for node in g.graph.node:
        if node.name not in quantized:
            continue
        for o in node.output:
            if not o or o in acts:
                continue
            chain = pass_through_chain(g, o)
            end = next((t for t in chain[1:] if t in acts), None)
            if end is not None:
                out.update({t: end for t in chain[:chain.index(end)] if t not in acts})
    return out


# ---- AIMET encodings -------------------------------------------------------------------------
def aimet_encodings(qp) -> list[dict]:
    """One AIMET encoding per channel (one for a per-tensor grid)."""
    b = int(qp.bits)
    scale = np.asarray(qp.scale, dtype=np.float64).reshape(-1)
    offset = full_qmin(qp) - np.asarray(qp.zero_point).astype(np.int64).reshape(-1)
    sym = "True" if is_symmetric(qp) else "False"
    encs = []
    for s, o in zip(scale, offset):
        lo = float(o * s)
        encs.append({"bitwidth": b, "dtype": "int", "is_symmetric": sym,
                     "max": float(lo + (2**b - 1) * s), "min": lo,
                     "offset": int(o), "scale": float(s)})
    return encs


def _most_common(values, default):
    values = list(values)
    return max(set(values), key=values.count) if values else default


def encodings(ctx) -> dict:
    plan = ctx.plan
    acts = {t: aimet_encodings(qp) for t, qp in plan.activations.items()}
    for src, dst in pass_through_fill_ins(ctx).items():
        acts[src] = acts[dst]
    params = {}
    for wp in ctx.placement.weights.values():
        qp = plan.weights.get(wp.tensor)
        if qp is not None and wp.tensor not in params:
            params[wp.tensor] = aimet_encodings(qp)
    if getattr(ctx.platform, "quantize_bias", False):
        # only biases the model holds as int32; one left float (a grouped ConvTranspose's, a
        # broadcast Gemm bias) gets no encoding that would claim otherwise
        readers: dict[str, list[str]] = {}
        for layer in weighted_layers(ctx):
            if layer.bias:
                readers.setdefault(layer.bias, []).append(layer.node.name)
            if layer.bias and layer.bias in plan.weights and layer.bias not in params:
                params[layer.bias] = aimet_encodings(plan.weights[layer.bias])
        for bias, nodes in readers.items():
            if len(nodes) > 1 and bias in params:
                # one encoding per tensor name: the converter applies it to every reader
                log.warning("%s: bias %s is read by %s; the encodings hold one 32-bit grid for it (scale = input "
                            "scale x weight scale of the layer quant_model.onnx quantizes it for), which the "
                            "converter applies to every reader: give each layer a bias tensor of its own",
                            ctx.platform.name, bias, ", ".join(nodes))
    weights = [plan.weights[t] for t in params if t in plan.weights and plan.weights[t].bits < 32]
    return {
        "version": AIMET_VERSION,
        "activation_encodings": acts,
        "param_encodings": params,
        "quantizer_args": {
            "activation_bitwidth": int(_most_common((qp.bits for qp in plan.activations.values()), 8)),
            "dtype": "int",
            "is_symmetric": bool(weights) and all(is_symmetric(qp) for qp in weights),
            "param_bitwidth": int(_most_common((qp.bits for qp in weights), 8)),
            "per_channel_quantization": any(qp.axis is not None for qp in weights),
            "quant_scheme": "post_training_tf",
        },
    }


@register("snpe")
def export(ctx, folder):
    return [write_json(folder / "snpe_encodings.json", encodings(ctx))]


@register("qnn")
def export_qnn(ctx, folder):
    return [write_json(folder / "qnn_encodings.json", encodings(ctx))]
