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
Concat, MaxPool and the reshaping ops stay QDQ between them.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from dipoorlet.graph import PROTOBUF_LIMIT, _subgraph_outer_refs, drop_unused_initializers, model_bytes
from dipoorlet.prepare import padded_ceil_pool

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
            # an If/Loop/Scan whose body reads a tensor of this scope reads it too (the log named
            # such a reader "" and left out layers whose output a body reads; found by a bug hunt)
            for i in list(n.input) + _subgraph_outer_refs(n):
                if not i or n in self.cons.get(i, ()):
                    continue
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


def unquantized_outputs(model: onnx.ModelProto) -> dict[str, int]:
    """Weighted ops (Conv/MatMul/Gemm) with dequantized inputs whose output is not quantized,
    counted by the op type that reads it: a QLinear op needs an output grid, and a backend that
    quantizes only some ops' inputs gives none to a layer whose reader it leaves float."""
    v = _View(model)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type in ("Conv", "MatMul", "Gemm") and v.dq(node.input[0]) is not None \
                and _output_q(v, node)[0] is None:
            users = v.cons.get(node.output[0], [])
            key = "/".join(sorted({u.op_type for u in users}) + (["network output"] if node.output[0] in v.outputs
                                                                 else []))
            readers[key] = readers.get(key, 0) + 1
    return readers


def shape_reader(model: onnx.ModelProto):
    """A function giving a tensor's dims (ints, None where unknown) as the model's value_info,
    inputs or outputs state them, or those of the tensor a Q/DQ chain carries into it; None where
    none does. The lookups are built once."""
    infos = {v.name: v for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
    made = {o: n for n in model.graph.node for o in n.output}

    def shape(name: str):
        for _ in range(4):
            v = infos.get(name)
            if v is not None:
                if not v.type.tensor_type.HasField("shape"):
                    return None
                return [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            node = made.get(name)
            if node is None or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
                return None
            name = node.input[0]
        return None

    return shape


def convert(model: onnx.ModelProto, exclude=(), origin: dict | None = None) -> tuple[onnx.ModelProto, int]:
    """A QOperator copy of a QDQ model and the number of ops converted (nodes named in
    ``exclude`` stay QDQ). ``origin``, if given, receives each new node's name -> the name of the
    node it replaced (``<name>_quant``, or ``<name>_quant_1``… where a node already has that name)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    v = _View(out)
    replaced, new_nodes, extra_inits, converted = set(), {}, [], 0
    taken = {n.name for n in g.node}
    # tensors If/Loop bodies read from this scope: a node whose float output one reads stays
    outer = {r for n in g.node for r in _subgraph_outer_refs(n)}
    # (from the model as given: the conversion below replaces the Q/DQ chains they are read through)
    shape = shape_reader(model)
    pool_shapes = {n.name: shape(n.input[0]) for n in model.graph.node if n.op_type == "AveragePool" and n.input}
    for node in list(g.node):
        if node.op_type not in ("Conv", "MatMul", "Gemm", *_PLAIN) or node.domain not in ("", "ai.onnx"):
            continue
        if node.name in exclude or node.output[0] in outer:
            continue
        if node.op_type == "AveragePool" and padded_ceil_pool(node, pool_shapes.get(node.name)):
            continue     # QLinearAveragePool divides ceil mode's border windows by the whole kernel
        dqs = [v.dq(i) for i in node.input[:2 if node.op_type in ("Conv", "MatMul", "Gemm", "Add", "Mul") else 1]]
        if not dqs or any(d is None for d in dqs):
            continue
        q, relu = _output_q(v, node)
        if q is None or (relu is not None and relu.output[0] in outer):
            continue
        yz = _zero_point(v, q)
        if yz is None:
            continue
        # A Relu is absorbed only where the grid starts at zero (zero point = the type's minimum:
        # uint8 0, int8 -128); on a symmetric int8 grid zero sits mid-grid and negatives survive.
        if relu is not None and not (yz.size == 1 and int(yz.reshape(-1)[0]) == np.iinfo(yz.dtype).min):
            continue
        if any(_axis(d) is not None and node.op_type not in ("Conv", "Gemm", "MatMul") for d in dqs):
            continue
        if node.op_type in ("Conv", "Gemm", "MatMul") and _axis(dqs[0]) is not None:
            continue
        zps = [_zero_point(v, d) for d in dqs]
        if any(z is None for z in zps):
            continue
        if any(z.dtype not in (np.int8, np.uint8) for z in [*zps, yz]):
            continue   # a 16-bit grid: onnxruntime's QLinear ops take 8-bit tensors only
        # onnxruntime's QLinear kernels give the output the activation input's type (a ti model
        # with an int8 input and a uint8 output, or an Add of int8 and uint8, has no kernel)
        acts = zps if node.op_type not in ("Conv", "MatMul", "Gemm") else zps[:1]
        if any(z.dtype != yz.dtype for z in acts):
            continue
        if node.op_type == "MatMul" and _rank(v, dqs[1]) not in (None, 2):
            continue   # onnxruntime's QLinearMatMul takes the grids of a 2-D weight only
        if node.op_type == "Gemm" and not _plain_gemm(node):
            continue
        args = [a for d in dqs for a in (d.input[0], d.input[1], d.input[2] if len(d.input) > 2 else "")]
        y_args = [q.input[1], q.input[2] if len(q.input) > 2 else ""]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute
                 if not (node.op_type == "Gemm" and a.name in ("alpha", "beta"))}
        name, k = node.name + "_quant", 1
        while name in taken:      # a node of the model named so already: onnxruntime refuses two
            name, k = f"{node.name}_quant_{k}", k + 1
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
        taken.add(name)
        if origin is not None:
            origin[name] = node.name
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


def _zero_point(v: _View, qdq) -> np.ndarray | None:
    """The zero point of a Q or DQ node (uint8 0 when absent), None when it is not a constant."""
    if len(qdq.input) < 3 or not qdq.input[2]:
        return np.zeros((), np.uint8)
    return v.value(qdq.input[2])


def _rank(v: _View, dq) -> int | None:
    w = v.init.get(dq.input[0])
    return len(w.dims) if w is not None else None


def _plain_gemm(node) -> bool:
    """alpha = beta = 1: QGemm has no beta, and its bias's scale must be the product's."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return float(attrs.get("alpha", 1.0)) == 1.0 and float(attrs.get("beta", 1.0)) == 1.0


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
    # layers sharing one float bias have their own s_in * s_w: one int32 tensor per distinct value
    # (two initializers of one name failed onnx.checker, and onnxruntime gave both layers one)
    taken = {t.name for t in extra_inits} | set(v.init)
    name, k = node.input[2] + "_int32", 1
    while name in taken:
        same = next((t for t in extra_inits if t.name == name), None)
        if same is not None and np.array_equal(numpy_helper.to_array(same), q):
            return name
        k += 1
        name = f"{node.input[2]}_int32_{k}"
    extra_inits.append(numpy_helper.from_array(q, name))
    return name


def _drop_dead(model: onnx.ModelProto) -> None:
    """Remove nodes and initializers nothing reads any more (orphaned Q/DQ)."""
    g = model.graph
    while True:
        used = ({i for n in g.node for i in n.input} | {o.name for o in g.output}
                | {r for n in g.node for r in _subgraph_outer_refs(n)})
        dead = [n for n in g.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    # initializers too, with the graph-input entries old IR versions give them (a float bias left
    # listed as an input became a required input), keeping those that are network outputs
    drop_unused_initializers(g)


def convert_checked(model: onnx.ModelProto, feed: dict, max_tries: int = 50):
    """:func:`convert`, then run the result in onnxruntime on ``feed``: an op onnxruntime
    rejects (a kernel missing for a type combination, a zero point shape) stays QDQ and the
    conversion is redone. Returns (model, converted, excluded nodes, worst output cosine against
    the QDQ model on ``feed`` (run by a default onnxruntime session where it can), the error of a default (optimizing) onnxruntime session on the
    result or None: its own fusions of the QDQ ops left can fail where the ops themselves run)."""
    import onnxruntime as ort

    from dipoorlet.runtime import ort_message, session_options

    if model_bytes(model) >= PROTOBUF_LIMIT:   # no in-memory session for a model over 2 GB
        out, converted = convert(model)
        return out, converted, [], 1.0, None
    def run(m, optimize=False):
        # optimizations off: the QLinear ops run on their own kernels, the QDQ rest as float, so
        # a failure is one of ours; on: as deployed, onnxruntime also fuses the QDQ rest
        so = session_options()
        if not optimize:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})

    # the yardstick: the QDQ model as onnxruntime deploys it (its own fusions into the same
    # integer kernels); the float simulation differs by each kernel's one rounding per op, which
    # piles up over a deep network (0.988 cosine on the PP-OCRv4 recognizer with no conversion bug)
    try:
        reference, ref_optimized = run(model, optimize=True), True
    except Exception:  # noqa: BLE001 - a fusion onnxruntime cannot do: the simulation then
        reference, ref_optimized = run(model), False
    excluded: list[str] = []
    for _ in range(max_tries):
        origin: dict[str, str] = {}
        out, converted = convert(model, excluded, origin)
        try:
            got = run(out)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises several types
            msg = ort_message(exc)
            bad = [origin[n.name] for n in out.graph.node
                   if n.name in origin and (f"'{n.name}'" in msg or f'"{n.name}"' in msg or f"({n.name})" in msg)]
            if not bad:
                # a kernel's run-time check names its op type, not the node: every node of it
                # stays QDQ
                kinds = [op for op in ("Conv", "MatMul", "Gemm", *_PLAIN) if op.lower() in msg.lower()]
                bad = [origin[n.name] for n in out.graph.node if n.name in origin
                       and any(n.op_type.lower().endswith(k.lower()) for k in kinds)]
            if not bad or set(bad) <= set(excluded):
                raise RuntimeError(f"the QOP model does not run in onnxruntime: {msg}") from exc
            excluded += [b for b in bad if b not in excluded]
            continue
        fused_error = None
        try:
            fused = run(out, optimize=True)
        except Exception as exc:  # noqa: BLE001
            fused_error, fused = ort_message(exc), None
        # compare like with like: both models as a default session runs them (the QDQ ops left in
        # the QOP model then run fused as in the reference, not as float: that alone read 0.981
        # against 0.99999 on the PP-OCR classifier)
        if ref_optimized and fused is not None:
            got = fused
        worst = 1.0
        for a, b in zip(got, reference):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape or not np.issubdtype(b.dtype, np.floating):
                continue   # class ids, indices, shapes: not a signal to compare by cosine
            a, b = a.astype(np.float64).reshape(-1), b.astype(np.float64).reshape(-1)
            na, nb = np.linalg.norm(a), np.linalg.norm(b)
            worst = min(worst, float(a @ b / (na * nb)) if na > 0 and nb > 0 else float(na == nb))
        return out, converted, excluded, worst, fused_error
    raise RuntimeError(f"the QOP model does not run in onnxruntime after leaving {len(excluded)} ops QDQ")

