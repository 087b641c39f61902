"""QDQ → QOperator conversion (``--quant_format QOP``): QLinearConv, QLinearMatMul, QGemm, QLinearAdd…

A quantized op whose inputs come from DequantizeLinear nodes and whose output goes only into a
QuantizeLinear (directly, or through a Relu the integer grid can absorb) is replaced by its
QLinear form reading the integer tensors. Everything else stays QDQ, so the result runs in
onnxruntime whatever was converted. The reference tool's QOP path relies on onnxruntime internals
that changed in 1.16; this one only writes standard ONNX and ``com.microsoft`` ops that
onnxruntime's CPU provider implements.

Op mapping (domain): Conv → QLinearConv (ai.onnx), MatMul → QLinearMatMul (ai.onnx),
Gemm → QGemm, Add → QLinearAdd, Mul → QLinearMul, GlobalAveragePool → QLinearGlobalAveragePool,
AveragePool → QLinearAveragePool, Sigmoid → QLinearSigmoid, LeakyRelu → QLinearLeakyRelu,
Concat → QLinearConcat (com.microsoft); MaxPool runs on the integers as is (same grid in and out).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS = "com.microsoft"
_PLAIN = {"Add": "QLinearAdd", "Mul": "QLinearMul", "GlobalAveragePool": "QLinearGlobalAveragePool",
          "AveragePool": "QLinearAveragePool", "Sigmoid": "QLinearSigmoid", "LeakyRelu": "QLinearLeakyRelu"}


class _View:
    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.init = {t.name: t for t in g.initializer}
        self.prod = {o: n for n in g.node for o in n.output}
        self.cons: dict[str, list] = {}
        for n in g.node:
            for i in n.input:
                self.cons.setdefault(i, []).append(n)
        self.outputs = {o.name for o in g.output}

    def dq(self, tensor):
        n = self.prod.get(tensor)
        return n if n is not None and n.op_type == "DequantizeLinear" else None

    def only_q(self, tensor):
        users = self.cons.get(tensor, [])
        if len(users) == 1 and users[0].op_type == "QuantizeLinear" and tensor not in self.outputs:
            return users[0]
        return None

    def value(self, name):
        return numpy_helper.to_array(self.init[name]) if name in self.init else None


def _output_q(v: _View, node):
    """(Q node, Relu node or None) that consumes ``node``'s output alone."""
    q = v.only_q(node.output[0])
    if q is not None:
        return q, None
    users = v.cons.get(node.output[0], [])
    if len(users) == 1 and users[0].op_type == "Relu" and node.output[0] not in v.outputs:
        q = v.only_q(users[0].output[0])
        if q is not None:
            return q, users[0]
    return None, None


def _axis(node) -> int | None:
    return next((a.i for a in node.attribute if a.name == "axis"), None)


def convert(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A QOperator copy of a QDQ model and the number of ops converted."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    v = _View(out)
    replaced, new_nodes, extra_inits, converted = set(), {}, [], 0
    for node in list(g.node):
        if node.op_type not in ("Conv", "MatMul", "Gemm", *_PLAIN) or node.domain not in ("", "ai.onnx"):
            continue
        dqs = [v.dq(i) for i in node.input[:2 if node.op_type in ("Conv", "MatMul", "Gemm", "Add", "Mul") else 1]]
        if not dqs or any(d is None for d in dqs):
            continue
        q, relu = _output_q(v, node)
        if q is None:
            continue
        yz = v.value(q.input[2]) if len(q.input) > 2 else np.zeros((), np.uint8)
        if relu is not None and not (yz.size == 1 and (int(yz) == 0 or int(yz) == np.iinfo(yz.dtype).min)):
            continue
        if any(_axis(d) is not None and node.op_type not in ("Conv", "Gemm", "MatMul") for d in dqs):
            continue
        if node.op_type in ("Conv", "Gemm") and _axis(dqs[0]) is not None:
            continue
        args = [a for d in dqs for a in (d.input[0], d.input[1], d.input[2] if len(d.input) > 2 else "")]
        y_args = [q.input[1], q.input[2] if len(q.input) > 2 else ""]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        name = node.name + "_quant"
        if node.op_type == "Conv":
            bias = _int32_bias(v, node, dqs, extra_inits)
            if bias is False:
                continue
            new = helper.make_node("QLinearConv", args + y_args + ([bias] if bias else []), [q.output[0]],
                                   name=name, **attrs)
        elif node.op_type == "MatMul":
            new = helper.make_node("QLinearMatMul", args + y_args, [q.output[0]], name=name)
        elif node.op_type == "Gemm":
            bias = _int32_bias(v, node, dqs, extra_inits)
            if bias is False:
                continue
            new = helper.make_node("QGemm", args + [bias or ""] + y_args, [q.output[0]], name=name,
                                   domain=MS, **attrs)
        else:
            new = helper.make_node(_PLAIN[node.op_type], args + y_args, [q.output[0]], name=name,
                                   domain=MS, **attrs)
        replaced.update({node.name, q.name} | ({relu.name} if relu is not None else set()))
        new_nodes[node.name] = new
        converted += 1
    if not converted:
        return out, 0
    kept = []
    for node in g.node:
        if node.name in new_nodes:
            kept.append(new_nodes[node.name])
        elif node.name not in replaced:
            kept.append(node)
    del g.node[:]
    g.node.extend(kept)
    g.initializer.extend(extra_inits)
    _drop_dead(out)
    if not any(op.domain == MS for op in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MS, 1))
    return out, converted


def _int32_bias(v: _View, node, dqs, extra_inits):
    """The int32 bias input of a QLinear op: its DQ's integers, or the float bias quantized here."""
    if len(node.input) < 3 or not node.input[2]:
        return None
    dq = v.dq(node.input[2])
    if dq is not None and dq.input[0] in v.init and v.init[dq.input[0]].data_type == onnx.TensorProto.INT32:
        return dq.input[0]
    b = v.value(node.input[2])
    xs, ws = v.value(dqs[0].input[1]), v.value(dqs[1].input[1])
    if b is None or xs is None or ws is None:
        return False
    scale = (xs.astype(np.float64) * ws.astype(np.float64)).reshape(-1)
    q = np.clip(np.rint(b.astype(np.float64) / np.maximum(scale, 1e-30)), -2**31 + 1, 2**31 - 1).astype(np.int32)
    name = node.input[2] + "_int32"
    extra_inits.append(numpy_helper.from_array(q, name))
    return name


def _drop_dead(model: onnx.ModelProto) -> None:
    """Remove nodes and initializers nothing reads any more (orphaned Q/DQ)."""
    g = model.graph
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    used = {i for n in g.node for i in n.input}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
