"""Huawei Ascend (Atlas) side files: activation scale/offset and an AMCT-style record.

Sources: ModelTC Dipoorlet ``deploy/deploy_atlas.py`` (``atlas_quant_param.json``) and the AMCT
record prototype ``SingleLayerRecord {scale_d, offset_d, scale_w, offset_w, ...}`` keyed by layer
name (``amct_onnx/proto/scale_offset_record_onnx.proto``, CANN AMCT guide "Record Files").

AMCT's signed form is ``q = round(x / scale) + offset`` with ``q`` in [-2^(b-1), 2^(b-1) - 1]
([-128, 127] for INT8, [-8, 7] for INT4), so a b-bit unsigned grid's zero point ``zp`` becomes
``offset = zp - 2^(b-1)`` (``zp - 128`` at 8 bits) and a signed grid keeps its zero point
(``offset = 0`` for a symmetric one). Three files:

- ``atlas_quant_param.json``: ``{tensor: {"scale": f, "offset": i}}``, the reference's flat
  layout, kept so its readers still work. One entry per tensor that carries Q/DQ in
  ``quant_model.onnx`` (the reference keyed the first input of each quantized node; the two differ
  only where a Pad sits between the Q/DQ and the Conv). The reference's scale/offset came from
  the raw clip range; these are the plan's.
- ``atlas_record.json``: ``{layer: {"scale_d": f, "offset_d": i, "scale_w": [f...],
  "offset_w": [i...]}}`` keyed by node name, for every quantized node whose data input has a
  grid; ``scale_w``/``offset_w`` (one per output channel, or one) only for nodes with a quantized
  weight. The reference omitted weights, leaving AMCT to recompute them. A layer of two
  activations (attention's Q·Kᵀ) gets its first input's grid: the record has no field for a
  second (a warning says so; both are in ``atlas_quant_param.json``).
- ``atlas_record.txt``: the same records in protobuf text format (``record { key: ... value {
  ... } }``), the form AMCT reads as a record file.

Not verified against AMCT: whether it accepts a record without ``shift_bit``, and layer names
are ONNX node names.
"""
from __future__ import annotations

import logging

import numpy as np

from dipoorlet.deploy import register
from dipoorlet.deploy.snpe import floats, ints, tensor_grid, unsigned_zero_point, weighted_layers
from dipoorlet.util import write_json, write_text

log = logging.getLogger(__name__)


def amct_offset(qp) -> np.ndarray:
    """The zero point in AMCT's signed form: the unsigned zero point minus 2^(b-1)."""
    return unsigned_zero_point(qp) - 2 ** (int(qp.bits) - 1)


def _data_record(qp) -> dict:
    return {"scale_d": floats(qp.scale)[0], "offset_d": ints(amct_offset(qp))[0]}


def records(ctx) -> dict[str, dict]:
    g = ctx.graph
    weighted = {layer.node.name: layer for layer in weighted_layers(ctx)}
    out = {}
    two = []
    for name in ctx.placement.quantized_nodes:
        node = g.node_by_name.get(name)
        if node is None:
            continue
        layer = weighted.get(name)
        if layer is not None:
            dqp = layer.dqp
        else:
            data = [i for i, t in enumerate(node.input) if t and not g.is_constant(t)]
            dqp = tensor_grid(ctx, node, data[0])[1] if data else None
            if dqp is not None and any(tensor_grid(ctx, node, i)[1] is not None for i in data[1:]):
                two.append(name)
        if dqp is None:
            continue
        rec = _data_record(dqp)
        if layer is not None:
            rec["scale_w"] = floats(layer.wqp.scale)
            rec["offset_w"] = ints(amct_offset(layer.wqp))
        out[name] = rec
    if two:
        # AMCT's record holds one data grid per layer (scale_d/offset_d; scale_w/offset_w are a
        # weight's, offset 0): the second input of Q·Kᵀ or softmax·V has no field there
        log.warning("atlas_record: %d layers read two activations (%s%s); the record holds the first one's grid "
                    "(scale_d/offset_d) only, the format having no field for a second: the other's is in "
                    "atlas_quant_param.json", len(two), ", ".join(two[:3]), " ..." if len(two) > 3 else "")
    return out


def _prototxt(recs: dict[str, dict]) -> str:
    lines = []
    for name, rec in recs.items():
        lines += ["record {", f"  key: {_quote(name)}", "  value {"]
        for field, value in rec.items():
            for v in value if isinstance(value, list) else [value]:
                lines.append(f"    {field}: {v!r}")
        lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def _quote(s: str) -> str:
    """A protobuf text-format string: backslash, quote and line breaks escaped (a raw line break
    left the record unparsable)."""
    for raw, esc in (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t")):
        s = s.replace(raw, esc)
    return '"' + s + '"'


@register("atlas")
def export(ctx, folder):
    flat = {t: {"scale": floats(qp.scale)[0], "offset": ints(amct_offset(qp))[0]}
            for t, qp in ctx.plan.activations.items()}
    recs = records(ctx)
    return [write_json(folder / "atlas_quant_param.json", flat),
            write_json(folder / "atlas_record.json", recs),
            write_text(folder / "atlas_record.txt", _prototxt(recs))]
