"""Graph preparation before calibration: small, declared rewrites.

- ``constants_to_initializers``: weights stored as Constant nodes (paddle2onnx does this) become
  initializers, so weight quantization sees them.
- ``ensure_opset``: Q/DQ with per-channel ``axis`` needs opset 13; models at opset 11–12 are
  converted with onnx's version converter.
- ``remove_identities``: Identity nodes between tensors are bypassed so that a Q/DQ pair is not
  split from the op it belongs to.
- ``fold_into_conv``: an Add, Sub, Mul or Div by one constant per output channel right after a
  Conv or ConvTranspose (paddle2onnx exports every ConvTranspose bias as such an Add, and
  PP-LCNetV3's learnable affine block after a Conv as a Mul and an Add) goes into the layer's
  weight and bias, as the backends' converters do.
- ``fold_batchnorm``: an inference BatchNormalization right after a Conv or ConvTranspose is
  folded into its weight and bias, as TensorRT and every other backend do before running int8. The weights are
  then quantized as the backend will hold them, and the Conv output the quantizer sees is the one
  the chip computes.

- ``widen_float16``: a float16 (or bfloat16) model is calibrated and written in float32: its
  weights, constants, Casts and declared types become float32. The backends take float32 Q/DQ
  models and run the layers left float in FP16 when asked (TensorRT's ``--fp16``); calibration
  in float16 itself would only add float16 rounding to the ranges.

Each pass returns the number of things it changed, for the log.
"""
from __future__ import annotations

import logging

import onnx
from onnx import helper, numpy_helper, version_converter

import numpy as np

from dipoorlet.errors import ModelError
from dipoorlet.graph import (MAX_OPSET, MIN_OPSET, QDQ_OPSET, Graph, _all_nodes, _subgraph_outer_refs, add_initializer,
                             constant_value, drop_unused_initializers, fresh_name, infer_shapes, node_attr)

log = logging.getLogger(__name__)


_HALF = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _widen_tensor(t: onnx.TensorProto) -> bool:
    if t.data_type not in _HALF:
        return False
    value = numpy_helper.to_array(t).astype(np.float32)
    t.CopyFrom(numpy_helper.from_array(value, t.name))
    return True


def _widen_graph(graph: onnx.GraphProto) -> int:
    n = sum(_widen_tensor(t) for t in graph.initializer)
    n += sum(_widen_tensor(sp.values) for sp in graph.sparse_initializer)
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.elem_type in _HALF:
            tt.elem_type = onnx.TensorProto.FLOAT
            n += 1
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                n += _widen_tensor(a.t)
            elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
                n += _widen_tensor(a.sparse_tensor.values)
            elif a.type == onnx.AttributeProto.TENSORS:
                n += sum(_widen_tensor(t) for t in a.tensors)
            elif a.type == onnx.AttributeProto.GRAPH:
                n += _widen_graph(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                n += sum(_widen_graph(sub) for sub in a.graphs)
            elif a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype", "output_datatype") \
                    and a.i in _HALF:
                a.i = onnx.TensorProto.FLOAT     # Cast(to=float16), EyeLike/Random*(dtype=...), windows
                n += 1
    return n


def widen_float16(g: Graph) -> int:
    """float16/bfloat16 weights, constants, Casts and declared types -> float32 (whole model,
    subgraphs included). The inputs' original dtypes stay in ``g.file_dtypes``: raw ``.bin``
    calibration files are read in them."""
    half_inputs = {vi.name: np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
                   for vi in g.graph.input
                   if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in _HALF}
    # which half type the model holds, for the warning (a bfloat16 model was called float16)
    seen = {t.data_type for t in g.graph.initializer} | {
        vi.type.tensor_type.elem_type for vi in [*g.graph.input, *g.graph.output, *g.graph.value_info]
        if vi.type.HasField("tensor_type")}
    g.__dict__["half_types"] = [name for code, name in ((onnx.TensorProto.FLOAT16, "float16"),
                                                        (onnx.TensorProto.BFLOAT16, "bfloat16")) if code in seen]
    n = _widen_graph(g.graph)
    if n:
        g.file_dtypes.update(half_inputs)
        g.refresh()
    return n


def constants_to_initializers(g: Graph) -> int:
    keep, moved = [], 0
    for node in g.graph.node:
        if node.op_type == "Constant" and len(node.output) == 1 and node.output[0] not in g.output_names:
            try:
                value = constant_value(node)
            except ModelError:
                keep.append(node)
                continue
            g.graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
            moved += 1
        else:
            keep.append(node)
    if moved:
        del g.graph.node[:]
        g.graph.node.extend(keep)
        g.refresh()
    return moved


_NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
               "Bernoulli", "If", "Loop", "Scan", "QuantizeLinear", "DequantizeLinear",
               # onnx.reference computes these wrong (onnx 1.x: Unique(sorted=0) sorts anyway,
               # LpNormalization(p=1) normalizes by the L2 norm; found by a bug hunt): left to onnxruntime
               "Unique", "LpNormalization"}
FOLD_LIMIT = 64 * 2**20  # bytes: never materialize a folded tensor larger than this


def fold_constants(g: Graph) -> int:
    """Evaluate nodes whose inputs are all constants and store their outputs as initializers.

    Exporters leave chains like ``Reshape(bias, [1, C, 1, 1]) → Add`` (paddle2onnx does this for
    every Conv bias). Left in the graph, such a tensor looks like an activation: a backend rule
    would quantize the bias as if it were the residual input of an Add. Folding it makes it the
    constant it is. Nodes are evaluated one at a time with onnx's reference evaluator.
    """
    from onnx.reference import ReferenceEvaluator

    folded, keep = 0, []
    const = {name: None for name in g.initializers}
    values: dict[str, np.ndarray] = {}
    for node in g.topological_nodes():
        ins = [i for i in node.input if i]
        if (node.op_type in _NOT_FOLDED or node.domain not in ("", "ai.onnx") or not ins
                or not all(i in const for i in ins) or any(o in g.output_names for o in node.output)):
            keep.append(node)
            continue
        try:
            feeds = {i: values[i] if i in values else g.weight(i) for i in ins}
            sub = helper.make_graph([node], "fold", [helper.make_tensor_value_info(i, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for i, v in feeds.items()],
                                    [helper.make_tensor_value_info(o, 0, None) for o in node.output if o])
            model = helper.make_model(sub, opset_imports=list(g.model.opset_import))
            outs = ReferenceEvaluator(model).run(None, feeds)
        except Exception:  # an op the reference evaluator lacks: leave it to the runtime
            keep.append(node)
            continue
        if not all(isinstance(o, np.ndarray) for o in outs):
            # a sequence or an optional (SplitToSequence, SequenceConstruct...): no initializer
            # holds one (a sequence stored as a stacked tensor broke the model, an uneven one crashed)
            keep.append(node)
            continue
        if sum(o.nbytes for o in outs) > FOLD_LIMIT:
            keep.append(node)
            continue
        for name, value in zip([o for o in node.output if o], outs):
            values[name] = np.asarray(value)
            const[name] = None
        folded += 1
    if folded:
        used = {i for n in keep for i in n.input} | set(g.output_names)
        for n in keep:
            used.update(_subgraph_outer_refs(n))
        for name, value in values.items():
            if name in used:
                g.graph.initializer.append(numpy_helper.from_array(value, name))
        del g.graph.node[:]
        g.graph.node.extend(keep)
        g.refresh()
    return folded


def remove_identities(g: Graph) -> int:
    """Bypass Identity nodes (one pass). An Identity whose output a subgraph reads is kept."""
    sub_refs = {r for n in g.graph.node for r in _subgraph_outer_refs(n)}
    alias = {n.output[0]: n.input[0] for n in g.graph.node
             if n.op_type == "Identity" and n.output[0] not in g.output_names and n.output[0] not in sub_refs}
    if not alias:
        return 0

    def root(name):
        while name in alias:
            name = alias[name]
        return name

    keep = [n for n in g.graph.node if not (n.op_type == "Identity" and n.output[0] in alias)]
    for n in keep:
        for i, name in enumerate(n.input):
            if name in alias:
                n.input[i] = root(name)
    del g.graph.node[:]
    g.graph.node.extend(keep)
    g.refresh()
    return len(alias)


def _out_channels(node, w: np.ndarray) -> int:
    """Output channels of a Conv ([C_out, C_in/group, k...]) or ConvTranspose
    ([C_in, C_out/group, k...]) weight."""
    if node.op_type == "ConvTranspose":
        return w.shape[1] * int(node_attr(node, "group", 1) or 1)
    return w.shape[0]


def _scale_out_channels(node, w: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The weight with output channel c multiplied by k[c]."""
    if node.op_type != "ConvTranspose":
        return w * k.reshape((-1,) + (1,) * (w.ndim - 1))
    group = int(node_attr(node, "group", 1) or 1)
    cin, per = w.shape[0], w.shape[1]
    # input channel i belongs to group i // (C_in/group), whose output channels are
    # group * per + j for j < per
    rows = (np.arange(cin) // (cin // group))[:, None] * per + np.arange(per)[None, :]
    return w * k[rows].reshape(cin, per, *([1] * (w.ndim - 2)))


def _layer_bias(g: Graph, conv, cout: int) -> np.ndarray:
    """The layer's bias as float64 (zeros where it has none)."""
    has = len(conv.input) > 2 and conv.input[2]
    return g.weight(conv.input[2]).astype(np.float64) if has else np.zeros(cout)


def _absorb(g: Graph, node, conv, w_new, b_new, tag: str) -> None:
    """``node`` (right after ``conv``) is now part of it: the new weight (None: unchanged) and
    bias go in as fresh initializers, ``conv`` writes ``node``'s output, ``node`` is removed.
    ``g.folded_into`` records removed node name -> the layer it went into (options naming it
    follow)."""
    base = conv.name or conv.output[0]
    params = [(1, w_new), (2, b_new)] if w_new is not None else [(2, b_new)]
    for index, value in params:
        name = fresh_name(g, f"{base}.{'weight' if index == 1 else 'bias'}_{tag}")
        t = numpy_helper.from_array(value, name)
        g.graph.initializer.append(t)
        g.initializers[name] = g.graph.initializer[-1]
        g.types[name] = (t.data_type, list(t.dims))
        if index < len(conv.input):
            _drop_consumer(g, conv.input[index], conv)
            conv.input[index] = name
        else:
            conv.input.append(name)
        g.consumers[name].append(conv)
    if node.name:
        g.__dict__.setdefault("folded_into", {})[node.name] = conv.name
    # the maps follow the edit here: a whole g.refresh() per fold made the folds quadratic in
    # the graph's size (53 folds took 0.2 s of a 1.1 s run on the PP-OCR classifier)
    for inp in node.input:
        _drop_consumer(g, inp, node)
    for out in [conv.output[0], *node.output]:
        g.producer.pop(out, None)
    conv.output[0] = node.output[0]
    g.producer[node.output[0]] = conv
    g.graph.node.remove(node)
    if node.name and g.node_by_name.get(node.name) is node:
        del g.node_by_name[node.name]
        if any(n.name == node.name for n in g.graph.node):
            g.refresh()   # another node shares the name: the full rebuild picks the first


def _drop_consumer(g: Graph, tensor: str, node) -> None:
    """Remove ``node`` (by identity) from the readers of ``tensor``."""
    left = [c for c in g.consumers.get(tensor, []) if c is not node]
    if left:
        g.consumers[tensor] = left
    else:
        g.consumers.pop(tensor, None)


def _foldable_layer(g: Graph, tensor: str, outputs: set):
    """The Conv/ConvTranspose producing ``tensor`` when nothing else reads it and its weight
    and bias are float32 constants; else None."""
    conv = g.producer.get(tensor)
    if conv is None or conv.op_type not in ("Conv", "ConvTranspose") or conv.domain not in ("", "ai.onnx") \
            or len(g.consumers.get(tensor, [])) != 1 \
            or tensor in outputs or len(conv.input) < 2:
        return None
    params = [conv.input[1]] + ([conv.input[2]] if len(conv.input) > 2 and conv.input[2] else [])
    if not all(g.is_constant(t) and g.elem_type(t) in (None, onnx.TensorProto.FLOAT) for t in params):
        return None
    if g.weight(conv.input[1]).ndim < 3:
        return None
    return conv


def fold_into_conv(g: Graph) -> int:
    """Fold ``Conv/ConvTranspose -> Add/Sub/Mul/Div(constant)`` into the layer's weight and bias
    where the constant is one value per output channel (or one for all), as the backends'
    converters do before quantizing (SNPE's and QNN's squash the elementwise op into the
    convolution, TensorRT fuses a scale, onnxruntime has ConvAddFusion and ConvMulFusion), so
    the quantizer does not see a tensor between them: paddle2onnx exports every ConvTranspose
    bias as an Add, and PP-LCNetV3's learnable affine block after a Conv as a Mul and an Add of
    scalars. ``x + c``, ``x - c``: bias + c, bias - c; ``x * k``, ``x / k``: weight and bias
    scaled per output channel (Sub and Div only with the layer's output first; never by 0)."""
    folded = 0
    outputs = set(g.output_names)
    for op in list(g.graph.node):
        if op.op_type not in ("Add", "Sub", "Mul", "Div") or op.domain not in ("", "ai.onnx") or len(op.input) != 2:
            continue
        sides = (0, 1) if op.op_type in ("Add", "Mul") else (0,)
        for side in sides:
            conv = _foldable_layer(g, op.input[side], outputs)
            other = op.input[1 - side]
            if conv is None or not g.is_constant(other) or g.elem_type(other) not in (None, onnx.TensorProto.FLOAT):
                continue
            w = g.weight(conv.input[1]).astype(np.float64)
            c = g.weight(other).astype(np.float64)
            rank, cout = w.ndim, _out_channels(conv, w)
            if c.ndim > rank:
                continue
            shape = (1,) * (rank - c.ndim) + c.shape
            if shape[0] != 1 or any(d != 1 for d in shape[2:]) or shape[1] not in (1, cout):
                continue   # not one value per output channel
            c = np.broadcast_to(c.reshape(-1), (cout,))
            if op.op_type == "Div" and not np.all(c != 0):
                continue
            b = _layer_bias(g, conv, cout)
            w_new = None
            if op.op_type == "Add":
                b = b + c
            elif op.op_type == "Sub":
                b = b - c
            else:
                k = c if op.op_type == "Mul" else 1.0 / c
                w_new = _scale_out_channels(conv, w, k).astype(np.float32)
                b = b * k
            _absorb(g, op, conv, w_new, b.astype(np.float32), "fold")
            folded += 1
            break
    if folded:
        drop_unused_initializers(g.graph)
        g.refresh()
    return folded


def fold_batchnorm(g: Graph) -> int:
    """Fold ``Conv/ConvTranspose -> BatchNormalization`` into the layer (W' = W k per output
    channel, b' = (b - mean) k + beta with k = gamma / sqrt(var + eps)). Only when the layer's
    output feeds nothing else, every BN parameter and the weight/bias are float32 constants,
    and the BN is in inference mode."""
    folded = 0
    outputs = set(g.output_names)
    for bn in list(g.graph.node):
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx") or any(o for o in bn.output[1:]):
            continue
        if node_attr(bn, "training_mode", 0):
            continue
        conv = _foldable_layer(g, bn.input[0], outputs)
        if conv is None or not all(g.is_constant(t) and g.elem_type(t) in (None, onnx.TensorProto.FLOAT)
                                   for t in bn.input[1:5]):
            continue
        gamma, beta, mean, var = (g.weight(t).astype(np.float64) for t in bn.input[1:5])
        w = g.weight(conv.input[1]).astype(np.float64)
        cout = _out_channels(conv, w)
        if gamma.ndim != 1 or gamma.shape[0] != cout:
            continue
        b = _layer_bias(g, conv, cout)
        k = gamma / np.sqrt(var + float(node_attr(bn, "epsilon", 1e-5)))
        w_new = _scale_out_channels(conv, w, k).astype(np.float32)
        b_new = ((b - mean) * k + beta).astype(np.float32)
        _absorb(g, bn, conv, w_new, b_new, "bnfold")
        folded += 1
    if folded:
        drop_unused_initializers(g.graph)
        g.refresh()
    return folded


LAYERNORM_OPSET = 17   # LayerNormalization joined the default domain at opset 17


def _single_reader(g: Graph, tensor: str, op_types: tuple[str, ...]):
    """The one default-domain node of ``op_types`` reading ``tensor``, when nothing else reads it
    and it is no graph output; else None."""
    readers = g.consumers.get(tensor, [])
    if len(readers) != 1 or tensor in g.output_names:
        return None
    node = readers[0]
    return node if node.op_type in op_types and node.domain in ("", "ai.onnx") else None


def _scalar(g: Graph, name: str) -> float | None:
    """A constant of one float value, as a Python float; else None."""
    if not name or not g.is_constant(name) or g.elem_type(name) not in (None, onnx.TensorProto.FLOAT):
        return None
    value = g.weight(name)
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def _const_fits_rank(g: Graph, name: str, rank: int | None) -> bool:
    """A constant broadcast against a tensor of ``rank`` leaves its rank as it is (a (1,1,1,8)
    gamma on a rank-3 tensor would make the output rank 4, which a fused op does not)."""
    return g.weight(name).ndim <= (rank if rank else 1)


def _reduced_axes(g: Graph, node) -> list[int] | None:
    """The axes a ReduceMean with keepdims=1 averages over (attribute before opset 18, input
    from it), or None."""
    if node.op_type != "ReduceMean" or node.domain not in ("", "ai.onnx") or not node_attr(node, "keepdims", 1):
        return None
    axes = node_attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1] and g.is_constant(node.input[1]):
        axes = g.weight(node.input[1]).reshape(-1).tolist()
    return [int(a) for a in axes] if axes else None


def _other_input(node, tensor: str) -> str | None:
    """The input of a two-input node that is not ``tensor`` (None unless exactly one is)."""
    if len(node.input) != 2 or list(node.input).count(tensor) != 1:
        return None
    return node.input[1] if node.input[0] == tensor else node.input[0]


def _match_layernorm(g: Graph, mean):
    """The decomposed LayerNorm starting at ReduceMean ``mean`` as a dict, or None.

    X -> ReduceMean -> Sub(X, mean) = d -> Pow(d, 2) | Mul(d, d) -> ReduceMean -> Add(eps) -> Sqrt
      -> Div(d, sqrt) | Mul(d, Reciprocal(sqrt)), then optionally Mul(gamma) and Add(beta) by
    constants along the normalized axis (onnxruntime's LayerNormFusion pattern, which exporters
    below opset 17 write for torch.nn.LayerNorm, plus the Reciprocal form)."""
    x = mean.input[0]
    axes = _reduced_axes(g, mean)
    rank = len(g.shape(x) or []) or None
    if axes is None or (rank is None and any(a >= 0 for a in axes)):
        return None
    axes = sorted(a - rank if a >= 0 else a for a in axes) if rank else sorted(axes)
    if axes != list(range(-len(axes), 0)):
        return None   # not a contiguous run of trailing axes
    sub = _single_reader(g, mean.output[0], ("Sub",))
    if sub is None or list(sub.input) != [x, mean.output[0]]:
        return None
    d = sub.output[0]
    readers = list({id(n): n for n in g.consumers.get(d, [])}.values())   # Mul(d, d) reads it twice
    if len(readers) != 2 or d in g.output_names:
        return None
    square = next((n for n in readers if (n.op_type == "Pow" and n.input[0] == d and _scalar(g, n.input[1]) == 2.0
                                          and _const_fits_rank(g, n.input[1], rank))
                   or (n.op_type == "Mul" and list(n.input) == [d, d])), None)
    norm = next((n for n in readers if n is not square), None)
    if square is None or norm is None:
        return None
    var = _single_reader(g, square.output[0], ("ReduceMean",))
    if var is None or _reduced_axes(g, var) is None or var.input[0] != square.output[0]:
        return None
    vaxes = _reduced_axes(g, var)
    vaxes = sorted(a - rank if a >= 0 else a for a in vaxes) if rank else sorted(vaxes)
    if vaxes != axes:
        return None
    add = _single_reader(g, var.output[0], ("Add",))
    eps = _scalar(g, _other_input(add, var.output[0])) if add is not None else None
    if eps is None or eps < 0 or not _const_fits_rank(g, _other_input(add, var.output[0]), rank):
        return None
    sqrt = _single_reader(g, add.output[0], ("Sqrt",))
    if sqrt is None:
        return None
    nodes = [mean, sub, square, var, add, sqrt]
    if norm.op_type == "Div" and list(norm.input) == [d, sqrt.output[0]]:
        if _single_reader(g, sqrt.output[0], ("Div",)) is not norm:
            return None   # the standard deviation is read elsewhere too (RevIN de-normalizes with it)
    elif norm.op_type == "Mul":
        recip = _single_reader(g, sqrt.output[0], ("Reciprocal",))
        if recip is None or _other_input(norm, d) != recip.output[0] \
                or _single_reader(g, recip.output[0], ("Mul",)) is not norm:
            return None
        nodes.append(recip)
    else:
        return None
    if norm.domain not in ("", "ai.onnx"):
        return None
    nodes.append(norm)
    out, gamma, beta = norm.output[0], None, None
    for op in ("Mul", "Add"):
        nxt = _single_reader(g, out, (op,))
        const = _other_input(nxt, out) if nxt is not None else None
        if const is None or not g.is_constant(const) or g.elem_type(const) not in (None, onnx.TensorProto.FLOAT):
            break
        value = g.weight(const).astype(np.float32)
        if not _const_fits_rank(g, const, rank):
            break   # would broadcast the output to a higher rank
        if value.ndim > len(axes) and any(s != 1 for s in value.shape[:value.ndim - len(axes)]):
            break   # varies along a kept axis: not one affine map over the normalized axes
        if op == "Mul":
            gamma = value
        elif gamma is None:
            break   # a bias without a scale first: leave the Add
        else:
            beta = value
        nodes.append(nxt)
        out = nxt.output[0]
    return {"x": x, "axis": axes[0], "eps": eps, "gamma": gamma, "beta": beta, "nodes": nodes, "out": out}


def _layernorm_params(g: Graph, m: dict):
    """(scale, bias) for the fused LayerNormalization: the pattern's gamma and beta (ones and
    zeros where absent) over the normalized shape, which onnxruntime wants them to fill. None
    where that shape is unknown and the constants do not give it (a scalar gamma, or none,
    with normalized dimensions of unknown size)."""
    xs = g.shape(m["x"])
    width = xs[m["axis"]:] if xs else None
    shape = tuple(width) if width and all(isinstance(d, int) and d > 0 for d in width) else None
    given = [v for v in (m["gamma"], m["beta"]) if v is not None and v.size > 1]
    if shape is None:   # the constants must say it: one trailing axis, its length their size
        if m["axis"] != -1 or not given:
            return None
        shape = (given[0].size,)
    out = []
    for value, fill in ((m["gamma"], 1.0), (m["beta"], 0.0)):
        value = np.float32(fill) if value is None else value
        try:
            out.append(np.ascontiguousarray(np.broadcast_to(value, (1,) * 8 + shape)
                                            .reshape(shape)).astype(np.float32))
        except ValueError:
            return None
    return out


def _opset_for_fusion(g: Graph, target: int, found: int, what: str) -> bool:
    """Raise the model to ``target`` for a fusion (False, logged, where that fails)."""
    if g.opset >= target:
        return True
    try:
        ensure_opset(g, target, why=f"to fuse its decomposed {what}")
    except ModelError as exc:
        log.info("%d decomposed %s stay as they are: %s", found, what, exc)
        return False
    name_nodes(g)   # the version converter may add unnamed nodes
    return True


def _replace_chain(g: Graph, nodes, new, position: int) -> None:
    """``new`` at ``position`` in place of ``nodes``; options naming them follow to it."""
    for node in nodes:
        if node.name:
            g.__dict__.setdefault("folded_into", {})[node.name] = new.name
        g.graph.node.remove(node)
    g.graph.node.insert(position, new)
    g.refresh()


def fuse_layernorm(g: Graph) -> int:
    """Fuse decomposed LayerNorms (see :func:`_match_layernorm`) into LayerNormalization, as
    onnxruntime's LayerNormFusion and TensorRT do before running int8 and as a model exported
    at opset 17 has it: the normalization's internal tensors (a variance, a reciprocal square
    root) are never quantized, so a model quantizes the same whichever opset it was exported at.
    Backends that quantize every op's inputs rounded them to 8 bits (magika's file-type model
    on qnn: one LayerNorm's reciprocal at -20 dB). A model below opset 17 is converted to 17
    first; where that fails the LayerNorms stay as they are."""
    means = [n for n in g.graph.node if n.op_type == "ReduceMean" and n.domain in ("", "ai.onnx")]
    if any(g.shape(n.input[0]) is None for n in means):
        # positive axes (tf2onnx, Keras) need the input's rank
        g.model = infer_shapes(g.model)
        g.refresh()
        means = [n for n in g.graph.node if n.op_type == "ReduceMean" and n.domain in ("", "ai.onnx")]
    found = [m for n in means for m in [_match_layernorm(g, n)] if m is not None]
    if not found:
        return 0
    if not _opset_for_fusion(g, LAYERNORM_OPSET, len(found), "LayerNorms"):
        return 0
    if any(m["gamma"] is None or m["gamma"].size == 1 for m in found):
        g.model = infer_shapes(g.model)   # the normalized width for ones, zeros or a scalar scale
        g.refresh()
    fused = 0
    # by name (every node has a unique one by now): a fusion removes nodes and rebuilds the maps
    for name in [n.name for n in g.graph.node if n.op_type == "ReduceMean" and n.domain in ("", "ai.onnx")]:
        mean = g.node_by_name.get(name)
        if mean is None:
            continue   # part of a pattern fused already
        m = _match_layernorm(g, mean)
        if m is None:
            continue
        params = _layernorm_params(g, m)
        if params is None:
            continue
        base = mean.name or m["out"]
        names = [add_initializer(g, fresh_name(g, f"{base}.ln_{tag}"), value)
                 for value, tag in zip(params, ("scale", "bias"))]
        ln = helper.make_node("LayerNormalization", [m["x"], *names], [m["out"]],
                              name=fresh_name(g, f"{base}_layernorm"), axis=m["axis"], epsilon=m["eps"])
        _replace_chain(g, m["nodes"], ln, [i for i, n in enumerate(g.graph.node) if n.name == name][0])
        fused += 1
    if fused:
        drop_unused_initializers(g.graph)
        g.refresh()
    return fused


HARDSWISH_OPSET = 14   # HardSwish joined the default domain at opset 14


def _is_const(g: Graph, name: str, value: float, rtol: float = 1e-6) -> bool:
    v = _scalar(g, name)
    return v is not None and abs(v - value) <= rtol * abs(value)


def _clip_bounds(g: Graph, clip) -> tuple[float | None, float | None]:
    """A Clip's (min, max) as floats (opset 11+: inputs; None where absent or not constant)."""
    lo = _scalar(g, clip.input[1]) if len(clip.input) > 1 and clip.input[1] else None
    hi = _scalar(g, clip.input[2]) if len(clip.input) > 2 and clip.input[2] else None
    return lo, hi


def _match_hardswish(g: Graph, node):
    """The decomposed HardSwish ending at ``node`` (its last op) as ``(x, nodes)``, or None.

    Matched: ``x * Clip(x + 3, 0, 6) / 6`` (paddle2onnx's hard_swish; the division as Div by 6
    or Mul by 1/6, before or after the product) and ``x * HardSigmoid(x)`` with alpha 1/6 and
    beta 1/2 (torch's export below opset 14). Every intermediate is read by the next op alone."""
    def is_sixth(n) -> str | None:
        """The non-constant input of a Div by 6 or a Mul by 1/6, else None."""
        if n is None or n.domain not in ("", "ai.onnx") or len(n.input) != 2:
            return None
        if n.op_type == "Div" and _is_const(g, n.input[1], 6.0):
            return n.input[0]
        if n.op_type == "Mul":
            for a, b in (n.input, reversed(n.input)):
                if _is_const(g, b, 1.0 / 6.0, 1e-5):
                    return a
        return None

    def gate_of(t: str):
        """(x, nodes) where tensor t is Clip(x + 3, 0, 6) or its sixth, or HardSigmoid(x)."""
        prod = g.producer.get(t)
        if prod is None or prod.domain not in ("", "ai.onnx") or t in g.output_names \
                or len(g.consumers.get(t, [])) != 1:
            return None
        if prod.op_type == "HardSigmoid":
            if abs(node_attr(prod, "alpha", 0.2) - 1 / 6) <= 1e-5 and abs(node_attr(prod, "beta", 0.5) - 0.5) <= 1e-6:
                return prod.input[0], [prod], True
            return None
        sixth = None
        inner = is_sixth(prod)
        if inner is not None:
            sixth, prod = prod, g.producer.get(inner)
            if prod is None or inner in g.output_names or len(g.consumers.get(inner, [])) != 1:
                return None
        if prod.op_type != "Clip" or prod.domain not in ("", "ai.onnx") or _clip_bounds(g, prod) != (0.0, 6.0):
            return None
        add = g.producer.get(prod.input[0])
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") \
                or prod.input[0] in g.output_names or len(g.consumers.get(prod.input[0], [])) != 1:
            return None
        for a, b in (add.input, reversed(add.input)):
            if _is_const(g, b, 3.0):
                return a, [add, prod] + ([sixth] if sixth is not None else []), sixth is not None
        return None

    if node.domain not in ("", "ai.onnx"):
        return None
    outer = None
    product = node
    inner = is_sixth(node)
    if inner is not None:   # (x * gate) / 6: the product must be this node's input
        outer, product = node, g.producer.get(inner)
        if product is None or inner in g.output_names or len(g.consumers.get(inner, [])) != 1:
            return None
    if product.op_type != "Mul" or product.domain not in ("", "ai.onnx") or len(product.input) != 2:
        return None
    for x, gate in (product.input, reversed(product.input)):
        found = gate_of(gate)
        if found is None or found[0] != x:
            continue
        x, chain, scaled = found
        if scaled == (outer is not None):
            return None   # divided by 6 twice, or not at all
        chain = chain + [product] + ([outer] if outer is not None else [])
        rank = len(g.shape(x) or []) or None
        if any(i and g.is_constant(i) and not _const_fits_rank(g, i, rank) for n in chain for i in n.input):
            return None   # a constant that broadcasts the output to a higher rank
        return x, chain
    return None


def fuse_hardswish(g: Graph) -> int:
    """Fuse decomposed HardSwish (see :func:`_match_hardswish`) into one HardSwish op, as
    Qualcomm's, Rockchip's, NXP's and TI's converters run it (one elementwise neuron, its input
    and output quantized): where every op's inputs are quantized, the chain's gate ``Clip(x+3,
    0, 6)`` otherwise got an 8-bit grid of its own. Called for backends whose spec quantizes
    HardSwish; a model below opset 14 is converted to 14 first (where that fails nothing is
    fused)."""
    candidates = [n.name for n in g.graph.node if n.op_type in ("Mul", "Div")]
    found = [c for c in candidates if _match_hardswish(g, g.node_by_name[c]) is not None]
    if not found:
        return 0
    if not _opset_for_fusion(g, HARDSWISH_OPSET, len(found), "HardSwish"):
        return 0
    fused = 0
    for name in found:
        last = g.node_by_name.get(name)
        m = _match_hardswish(g, last) if last is not None else None
        if m is None:
            continue
        x, nodes = m
        hs = helper.make_node("HardSwish", [x], [last.output[0]], name=fresh_name(g, f"{name}_hardswish"))
        _replace_chain(g, nodes, hs, min(i for i, n in enumerate(g.graph.node) if any(n is c for c in nodes)))
        fused += 1
    if fused:
        drop_unused_initializers(g.graph)
        g.refresh()
    return fused


def ensure_opset(g: Graph, target: int = QDQ_OPSET, why: str = "for per-channel Q/DQ") -> int:
    """Raise the default-domain opset to ``target``; returns the opset the model had."""
    version = g.opset
    if version == 0 and not any(op.domain in ("", "ai.onnx") for op in g.model.opset_import):
        # ai.onnx.ml alone (a scikit-learn export) had been told "opset 0 is outside ..." (found by a sweep)
        domains = ", ".join(sorted(op.domain for op in g.model.opset_import)) or "none"
        raise ModelError(f"model imports no ONNX operator set (ai.onnx), only {domains}: it has no Conv, MatMul "
                         "or other op to quantize; dipoorlet quantizes neural networks exported to ONNX")
    if version < MIN_OPSET - 4 or version > MAX_OPSET + 4:
        raise ModelError(f"model opset {version} is outside what this tool reads ({MIN_OPSET - 4}-{MAX_OPSET + 4}; "
                         f"tested on {MIN_OPSET}-{MAX_OPSET}); export the model at opset 13-17")
    if version >= target:
        return version
    if version < 13:
        from dipoorlet.graph import _all_nodes

        for node in _all_nodes(g.model):      # If/Loop bodies too (their shapes are rarely known)
            if node.op_type != "Hardmax" or node.domain not in ("", "ai.onnx"):
                continue
            axis = node_attr(node, "axis", 1)
            rank = len(g.shape(node.input[0]) or [])
            if axis != -1 and (not rank or axis != rank - 1):
                # onnx's converter keeps the node as is, but Hardmax-13 no longer flattens the
                # input from ``axis`` on: the output would change
                raise ModelError(f"Hardmax {node.name or node.output[0]} (opset {version}, axis {axis}) "
                                 f"changes meaning when converted to opset {target}; export the model "
                                 f"at opset {target} or later")
    try:
        converted = version_converter.convert_version(g.model, target)
    except Exception as exc:
        raise ModelError(f"could not convert the model from opset {version} to {target} "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                         f"export it at opset {target} or later") from exc
    if version < 11:
        _resize_as_before_11(converted.graph)
    try:   # the IR version the new opsets need (opset 13: 7, opset 17: 8)
        need = helper.find_min_ir_version_for(list(converted.opset_import), ignore_unknown=True)
    except Exception:
        need = 7
    if converted.ir_version < max(need, 7):
        converted.ir_version = max(need, 7)
    g.model = converted
    g.refresh()
    log.info("converted the model from opset %d to %d %s", version, target, why)
    return version


def _resize_as_before_11(graph) -> None:
    """Upsample and Resize-10 sample at ``x_out / scale`` (asymmetric); onnx's converter emits a
    Resize with the opset-11 defaults (half_pixel, round_prefer_floor), which moves a bilinear
    upsampling by half a pixel. Write the old sampling out explicitly, in If/Loop/Scan bodies too.
    Nearest sampling as onnxruntime runs the old op: the floor of ``x_out / scale`` where the
    scales enlarge, its ceiling where they shrink (an axis scaled by 0.6 reads pixels 0 and 2 of
    4, not 0 and 1); an op that does both in one node has no opset-13 form."""
    from onnx import numpy_helper

    consts: dict[str, np.ndarray] = {}

    def walk(g):
        for t in g.initializer:
            consts[t.name] = numpy_helper.to_array(t)
        for node in g.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        for node in g.node:
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    yield from walk(sub)
            yield node

    for node in list(walk(graph)):
        if node.op_type != "Resize" or node.domain not in ("", "ai.onnx"):
            continue
        names = {a.name for a in node.attribute}
        if "coordinate_transformation_mode" not in names:
            node.attribute.append(helper.make_attribute("coordinate_transformation_mode", "asymmetric"))
        mode = node_attr(node, "mode", b"nearest")
        if mode not in (b"nearest", "nearest") or "nearest_mode" in names:
            continue
        scales = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        rounding = "floor"
        if scales is not None and scales.size:
            moved = [float(v) for v in np.asarray(scales, np.float64).ravel() if float(v) != 1.0]
            if moved and all(v < 1.0 for v in moved):
                rounding = "ceil"
            elif any(v < 1.0 for v in moved):
                raise ModelError(f"Resize {node.name or node.output[0]} (opset 10, nearest) enlarges some axes and "
                                 f"shrinks others (scales {np.asarray(scales).ravel().tolist()}), which no opset-13 "
                                 "Resize reproduces; export the model at opset 11 or later")
        elif scales is None:
            log.warning("Resize %s (opset 10, nearest): its scales are computed, so its sampling is taken as "
                        "enlarging (floor); a shrinking one reads other pixels after conversion: export the "
                        "model at opset 11 or later", node.name or node.output[0])
        node.attribute.append(helper.make_attribute("nearest_mode", rounding))


def lower_ir_version(g: Graph) -> int:
    """Lower an IR version newer than the opsets need (onnx's latest writer vs an older runtime).

    ``onnx.helper.make_model`` stamps the newest IR version, which onnxruntime releases older
    than that onnx reject ("Unsupported model IR version"). The lowest IR version that covers the
    model's opsets is enough and changes nothing in the graph.
    """
    try:
        need = helper.find_min_ir_version_for(list(g.model.opset_import), ignore_unknown=True)
    except Exception:
        return g.model.ir_version
    old = g.model.ir_version
    if old > need:
        g.model.ir_version = max(need, 7)
    return old


def name_nodes(g: Graph) -> int:
    """Give every node a unique name (the report and --skip_layers refer to nodes by name). A
    name several nodes shared is recorded in ``g.duplicate_names`` (name -> every node's name now,
    the first keeping it), so that flags naming it reach all of them."""
    taken = {n.name for n in g.graph.node if n.name}
    seen, renamed = set(), 0
    dups = getattr(g, "duplicate_names", {})
    for i, node in enumerate(g.graph.node):
        if not node.name or node.name in seen:
            base = node.name or f"{node.op_type}_{i}"
            name, k = base, 1
            while name in seen or (name in taken and name != node.name):
                name, k = f"{base}_{k}", k + 1
            if node.name:
                dups.setdefault(node.name, [node.name]).append(name)
            node.name = name
            renamed += 1
        seen.add(node.name)
    g.duplicate_names = dups
    if renamed:
        g.refresh()
    return renamed


def inline_functions(g: Graph) -> int:
    """Inline the model's local functions (torch.onnx.export(..., export_modules_as_functions=True)
    wraps each module in one): their Convs and MatMuls are then the main graph's, quantized like
    any other; left as calls, they stayed float without a word. Returns the calls inlined."""
    if not g.model.functions:
        return 0
    from onnx import inliner

    local = {(f.domain, f.name) for f in g.model.functions}
    calls = sum((n.domain, n.op_type) in local for n in _all_nodes(g.model))
    for fn in g.model.functions:        # names that say where a layer came from (the inliner adds __k per call)
        for i, node in enumerate(fn.node):
            if not node.name:
                node.name = f"{fn.name}/{node.op_type}_{i}"
    try:
        model = inliner.inline_local_functions(g.model)
    except Exception as exc:  # noqa: BLE001 - onnx raises its own types
        raise ModelError(f"the model's local functions ({', '.join(sorted(f'{d}.{n}' for d, n in local)[:4])}) cannot be "
                         f"inlined ({' '.join(str(exc).split())[:200]}); export the model without them "
                         "(torch.onnx.export(..., export_modules_as_functions=False))") from exc
    g.model = model
    g.refresh()
    log.info("%d calls of %d local functions inlined into the graph", calls, len(local))
    return calls


def _counted_ceil_pool(node):
    """(auto_pad, pads) of an AveragePool with ``ceil_mode=1`` and ``count_include_pad=1``, else None."""
    if node.op_type != "AveragePool" or node.domain not in ("", "ai.onnx"):
        return None
    if not node_attr(node, "ceil_mode", 0) or not node_attr(node, "count_include_pad", 0):
        return None
    auto_pad = node_attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    return auto_pad, list(node_attr(node, "pads", None) or [])


def padded_ceil_pool(node, shape=None) -> bool:
    """An AveragePool whose border windows onnxruntime's QLinearAveragePool divides wrongly and
    :func:`unpadded_pool_counts` cannot rewrite: ceil mode, padding, and the padding counted, where
    ceil mode adds a window past the padded input: on an input ``shape`` whose spatial sizes are
    known, only where a stride does not divide what the kernel leaves (with no window added the
    kernel is exact; a review found QOP and the warning had left such pools alone too)."""
    found = _counted_ceil_pool(node)
    if found is None:
        return False
    auto_pad, pads = found
    if auto_pad.startswith("SAME"):
        return True
    if auto_pad != "NOTSET" or not any(pads):
        return False
    kernel = list(node_attr(node, "kernel_shape", []))
    n = len(kernel)
    spatial = list(shape)[-n:] if shape is not None and n and len(shape) >= n + 2 else None
    if spatial is None or not all(isinstance(d, int) and d > 0 for d in spatial) or len(pads) != 2 * n:
        return True               # sizes unknown: it may add one
    strides = list(node_attr(node, "strides", None) or [1] * n)
    dilations = list(node_attr(node, "dilations", None) or [1] * n)
    return any((size + pads[i] + pads[i + n] - ((kernel[i] - 1) * dilations[i] + 1)) % strides[i] != 0
               for i, size in enumerate(spatial))


def unpadded_pool_counts(g: Graph) -> int:
    """An AveragePool with ``ceil_mode=1`` and ``count_include_pad=1`` but no padding gets
    ``count_include_pad=0``: the same function (with no pads, both divide a window by its cells
    inside the input; onnxruntime, onnx.reference and torch agree), and the form onnxruntime's
    integer kernel gets right. Its QLinearAveragePool, which a default session fuses a quantized
    pool into and ``--quant_format QOP`` writes, divides the windows ceil mode adds at the border
    by the whole kernel (``torch.nn.AvgPool2d(k, ceil_mode=True)`` exports this form; found by a
    bug hunt: output cosine 0.976 deployed where the simulation read 0.99995)."""
    changed = 0
    for node in g.graph.node:
        found = _counted_ceil_pool(node)
        if found is not None and (found[0] == "VALID" or (found[0] == "NOTSET" and not any(found[1]))):
            next(a for a in node.attribute if a.name == "count_include_pad").i = 0    # (set: found says so)
            changed += 1
    return changed


def prepare(g: Graph, hardswish: bool = False) -> dict:
    """Run every preparation pass; returns what each changed. ``hardswish``: fuse decomposed
    HardSwish (for backends that quantize a HardSwish op's input and output only)."""
    inlined = inline_functions(g)
    order = g.topological_nodes()  # some exporters list nodes out of order; ONNX wants them sorted
    if [id(n) for n in order] != [id(n) for n in g.graph.node]:
        sorted_nodes = [onnx.NodeProto() for _ in order]
        for dst, src in zip(sorted_nodes, order):
            dst.CopyFrom(src)
        del g.graph.node[:]
        g.graph.node.extend(sorted_nodes)
        g.refresh()
    done = {"functions_inlined": inlined, "float16_widened": widen_float16(g)}
    done.update(ir_version_from=lower_ir_version(g), opset_from=ensure_opset(g))
    # after the version converter, which adds nodes of its own (unnamed Constants for axes)
    done["nodes_named"] = name_nodes(g)
    done["constants_to_initializers"] = constants_to_initializers(g)
    done["constants_folded"] = fold_constants(g)
    done["identities_removed"] = remove_identities(g)
    # a bias Add between a convolution and its BatchNormalization first (paddle2onnx's
    # ConvTranspose), then the BN, then what follows a folded BN
    done["elementwise_folded"] = fold_into_conv(g)
    done["batchnorms_folded"] = fold_batchnorm(g)
    done["elementwise_folded"] += fold_into_conv(g)
    done["layernorms_fused"] = fuse_layernorm(g)
    done["hardswish_fused"] = fuse_hardswish(g) if hardswish else 0
    done["pool_counts_unpadded"] = unpadded_pool_counts(g)
    g.model = infer_shapes(g.model)
    g.refresh()
    return done
