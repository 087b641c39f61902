"""Insert QuantizeLinear/DequantizeLinear pairs from a placement and a plan, in one rewrite.

Activations: ``t -> QuantizeLinear -> t_q -> DequantizeLinear -> t_dq``; exactly the node inputs
the placement names are rewired to ``t_dq`` (others keep reading ``t``). Grids narrower than 8
bits get a ``Clip`` on the integers between Q and DQ, so onnxruntime simulates them exactly.
Weights are stored already quantized (``w_quantized``, int8) and read through one
DequantizeLinear (per-channel with ``axis``): a quarter of the float size, the layout TensorRT,
QNN and onnxruntime all accept. Biases stay float unless the platform asks for int32 biases
(scale = input scale x weight scale). Names follow the reference tool (``<t>_scale``,
``<t>_zero_point``, ``<t>_QuantizeLinear``…) so side files and reports line up.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dipoorlet.graph import Graph, drop_unused_initializers
from dipoorlet.placement import Placement
from dipoorlet.qparams import QParams, QuantPlan, quantize_array


def _const(g: onnx.GraphProto, name: str, value: np.ndarray) -> str:
    g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return name


def _int_clip(graph, src: str, qp: QParams, name: str) -> str:
    full_min, full_max = (-128, 127) if qp.signed else (0, 255)
    if qp.bits > 8 or (qp.qmin <= full_min and qp.qmax >= full_max):
        return src
    dtype = qp.zero_point.dtype
    lo = _const(graph, name + "_clip_min", np.array(qp.qmin, dtype=dtype))
    hi = _const(graph, name + "_clip_max", np.array(qp.qmax, dtype=dtype))
    out = name + "_clipped"
    graph.node.append(helper.make_node("Clip", [src, lo, hi], [out], name=name + "_Clip"))
    return out


ACT_SUFFIXES = ("_scale", "_zero_point", "_q", "_dq", "_QuantizeLinear", "_DequantizeLinear", "_clip_min",
                "_clip_max", "_clipped", "_Clip", "_float")
WEIGHT_SUFFIXES = ("_quantized", "_scale", "_zero_point", "_dq", "_DequantizeLinear")


def _all_names(model: onnx.ModelProto) -> set[str]:
    g = model.graph
    names = {n.name for n in g.node} | {o for n in g.node for o in n.output} | {i for n in g.node for i in n.input}
    names |= {t.name for t in g.initializer} | {v.name for v in [*g.input, *g.output, *g.value_info]}
    return names


def _base(tensor: str, taken: set[str], suffixes) -> str:
    """``tensor`` itself when none of ``tensor + suffix`` is taken (the reference tool's names),
    else the first ``tensor_<i>`` that is free; its derived names are then reserved."""
    base, i = tensor, 0
    while any(base + sfx in taken for sfx in suffixes):
        i += 1
        base = f"{tensor}_{i}"
    taken.update(base + sfx for sfx in suffixes)
    return base


def insert_qdq(g: Graph, placement: Placement, plan: QuantPlan) -> onnx.ModelProto:
    """A new model with Q/DQ inserted; ``g`` is not modified."""
    model = onnx.ModelProto()
    model.CopyFrom(g.model)
    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    new_nodes: dict[str, list] = {}   # producer tensor -> nodes to insert after its producer
    taken = _all_names(model)

    for tensor, point in placement.activations.items():
        qp = plan.activations.get(tensor)
        if qp is None or not (point.uses or point.output):
            continue
        base = _base(tensor, taken, ACT_SUFFIXES)
        s = _const(graph, base + "_scale", qp.scale)
        z = _const(graph, base + "_zero_point", qp.zero_point)
        q_out = base + "_q"
        q = helper.make_node("QuantizeLinear", [tensor, s, z], [q_out], name=base + "_QuantizeLinear")
        before = len(graph.node)
        q_src = _int_clip(graph, q_out, qp, base)
        extra = [graph.node.pop() for _ in range(len(graph.node) - before)][::-1]
        dq = helper.make_node("DequantizeLinear", [q_src, s, z], [base + "_dq"],
                              name=base + "_DequantizeLinear")
        new_nodes[tensor] = [q, *extra, dq]
        for node_name, index in point.uses:
            nodes[node_name].input[index] = base + "_dq"
        if point.output:
            _quantize_output(graph, tensor, base, q, dq, nodes, new_nodes)

    # transformed constants (plan.values), each only while the layer it belongs to is quantized
    quantized_nodes = {wp.node for wp in placement.weights.values() if wp.tensor in plan.weights}
    values = {k: v for k, v in plan.values.items()
              if k not in plan.value_owners or plan.value_owners[k] in quantized_nodes}
    weight_names_used = {}
    for (node_name, index), wp in placement.weights.items():
        qp = plan.weights.get(wp.tensor)
        if qp is None:
            continue
        node = nodes[node_name]
        key = wp.tensor
        if key not in weight_names_used:
            value = values[wp.tensor] if wp.tensor in values else g.weight(wp.tensor)
            base = _base(wp.tensor, taken, WEIGHT_SUFFIXES)
            qname = base + "_quantized"
            _const(graph, qname, quantize_array(value, qp))
            s = _const(graph, base + "_scale", qp.scale)
            z = _const(graph, base + "_zero_point", qp.zero_point)
            attrs = {"axis": qp.axis} if qp.axis is not None else {}
            dq = helper.make_node("DequantizeLinear", [qname, s, z], [base + "_dq"],
                                  name=base + "_DequantizeLinear", **attrs)
            new_nodes.setdefault("", []).append(dq)
            weight_names_used[key] = base + "_dq"
        node.input[index] = weight_names_used[key]

    _replace_values(graph, values, set(weight_names_used))
    _rebuild(graph, new_nodes)
    drop_unused_initializers(graph)
    return model


def _replace_values(graph: onnx.GraphProto, values: dict, quantized: set) -> None:
    """Float constants changed by a weight transform (plan.values) replace the model's own."""
    todo = {k: v for k, v in values.items() if k not in quantized}
    if not todo:
        return
    for t in graph.initializer:
        if t.name in todo:
            t.CopyFrom(numpy_helper.from_array(np.asarray(todo.pop(t.name), dtype=np.float32), t.name))
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] in todo:
            name = n.output[0]
            del n.attribute[:]
            n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(
                np.asarray(todo.pop(name), dtype=np.float32), name)))


def _quantize_output(graph, tensor: str, base: str, q, dq, nodes: dict, new_nodes: dict) -> None:
    """Make network output ``tensor`` the dequantized value, keeping its name.

    The producer now writes ``<t>_float``; Q reads it and DQ writes ``<t>``, so every consumer
    and the graph output see what the chip outputs, under the name users already know.
    """
    src = base + "_float"
    for node in graph.node:
        for i, out in enumerate(node.output):
            if out == tensor:
                node.output[i] = src
    for node in nodes.values():
        for i, name in enumerate(node.input):
            if name == base + "_dq":
                node.input[i] = tensor
    q.input[0] = src
    dq.output[0] = tensor
    new_nodes[src] = new_nodes.pop(tensor)


def _rebuild(graph: onnx.GraphProto, new_nodes: dict[str, list]) -> None:
    """Put inserted nodes right after their producers, keeping topological order."""
    order = list(new_nodes.pop("", []))
    produced = {o for n in graph.node for o in n.output}
    for name in list(new_nodes):
        if name not in produced:
            order.extend(new_nodes.pop(name))
    for node in graph.node:
        order.append(node)
        for out in node.output:
            order.extend(new_nodes.pop(out, []))
    del graph.node[:]
    graph.node.extend(order)
