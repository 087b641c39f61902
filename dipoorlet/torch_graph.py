"""Run a QDQ ONNX model in PyTorch, with gradients, in two modes (for ``--brecq``/``--drop``).

``q`` mode runs the model as written: every activation QuantizeLinear -> (integer Clip) ->
DequantizeLinear chain is one fake-quantization (rounding half to even, as onnxruntime does,
with a straight-through gradient), every weight DequantizeLinear gives its dequantized constant,
or, for a weight being reconstructed, its soft-rounded value. ``f`` mode runs the float model
the QDQ model was made from: the activation chains are identities and every weight
DequantizeLinear gives the float tensor it was quantized from. Tensor names are the QDQ model's
in both modes, so the two streams can be compared tensor by tensor.

Ops are mapped to ``torch`` functions; an op without a mapping (LSTM, If, ...) runs through
``onnx.reference`` without a gradient and is marked *opaque*: block reconstruction never puts
one inside a block. torch is imported lazily (an optional extra).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import numpy_helper

from dipoorlet.errors import ConfigError


def import_torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("--brecq, --drop and --lsq need PyTorch, an optional extra: pip install 'dipoorlet[torch]' "
                          "(a CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu); "
                          "--adaround and --gptq need no torch") from None
    return torch


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


_DTYPES = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.BOOL: "bool", onnx.TensorProto.INT16: "int16",
}

ACT_TYPES = {onnx.TensorProto.INT8: (-128, 127), onnx.TensorProto.UINT8: (0, 255),
             onnx.TensorProto.INT16: (-32768, 32767), onnx.TensorProto.UINT16: (0, 65535)}


BOUND = float(2**40)     # |x / s| bound before rounding: beyond any grid's levels, exact in float32


class FakeQuant:
    """One activation chain: DequantizeLinear(Clip?(QuantizeLinear(src)))."""

    def __init__(self, src, scale, zp, qmin, qmax, axis):
        self.src, self.scale, self.zp, self.qmin, self.qmax, self.axis = src, scale, zp, qmin, qmax, axis
        self.step = None      # a callable giving a learned scale in q mode (--lsq), else ``scale``


class TorchGraph:
    """The QDQ model's nodes as a list of steps that :meth:`run` executes over an environment
    (tensor name -> torch tensor). ``weights`` maps a weight DequantizeLinear's output to
    ``(float value, soft)``: ``float value`` is what ``f`` mode reads; ``soft`` (a callable
    returning the q-mode tensor, or None for the dequantized constant)."""

    def __init__(self, model: onnx.ModelProto, float_values: dict[str, np.ndarray], float_consts=None,
                 device="cpu"):
        torch = import_torch()
        self.torch = torch
        # every tensor the steps make or read lives here (``--recon_device``); arrays cross to
        # numpy only at the edges (an op run outside torch, the integers chosen)
        self.device = torch.device(device)
        graph = model.graph
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
        self.opset_imports = list(model.opset_import)
        self.ir_version = model.ir_version
        self.consts: dict[str, object] = {}
        for t in graph.initializer:
            self.consts[t.name] = numpy_helper.to_array(t)
        producers = {o: n for n in graph.node for o in n.output}
        consumers: dict[str, list] = {}
        for n in graph.node:
            for i in n.input:
                consumers.setdefault(i, []).append(n)
        self.inputs = [i.name for i in graph.input if i.name not in self.consts]
        self.outputs = [o.name for o in graph.output]
        self.float_values = float_values
        self.float_consts = dict(float_consts or {})   # constants whose float-model value differs
        # node name -> (weight DQ output, shift d, alpha): a layer reading a shifted tensor, whose
        # bias holds b - W_q d for the nearest-rounded W_q; q mode adds what other roundings change
        self.shift_corr: dict[str, tuple] = {}
        self.bias: dict[str, object] = {}       # bias name -> callable giving its q-mode value
        self.soft: dict[str, object] = {}     # weight DQ output -> callable giving its q-mode value
        self.chains: dict[str, FakeQuant] = {}
        skip = set()
        # activation chains: Q (-> Clip) -> DQ, the Q's and Clip's outputs read by nothing else
        for n in graph.node:
            if n.op_type != "DequantizeLinear" or n.input[0] in self.consts:
                continue
            p = producers.get(n.input[0])
            clip = None
            if p is not None and p.op_type == "Clip":
                clip, p = p, producers.get(p.input[0])
            if p is None or p.op_type != "QuantizeLinear":
                continue
            inner = [p] + ([clip] if clip is not None else [])
            if any(len(consumers.get(x.output[0], [])) != 1 for x in inner) or p.output[0] in self.outputs:
                continue
            zp_arr = self.consts.get(p.input[2]) if len(p.input) > 2 and p.input[2] else np.array(0, np.uint8)
            lo, hi = {np.dtype(np.int8): (-128, 127), np.dtype(np.uint8): (0, 255),
                      np.dtype(np.int16): (-32768, 32767), np.dtype(np.uint16): (0, 65535)}[zp_arr.dtype]
            if clip is not None:
                lo = max(lo, int(self.consts[clip.input[1]]))
                hi = min(hi, int(self.consts[clip.input[2]]))
            self.chains[n.output[0]] = FakeQuant(
                p.input[0], torch.from_numpy(np.array(self.consts[p.input[1]], np.float32)).to(self.device),
                torch.from_numpy(np.array(zp_arr, np.float32)).to(self.device), lo, hi, _attr(p, "axis", 1))
            skip.update(id(x) for x in inner)
        # weight DequantizeLinears and Constant nodes are constants, resolved where read
        self.wdq: dict[str, object] = {}
        for n in graph.node:
            if id(n) in skip:
                continue
            if n.op_type == "DequantizeLinear" and n.input[0] in self.consts and n.domain in ("", "ai.onnx"):
                self.wdq[n.output[0]] = n
                skip.add(id(n))
            elif n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                self.consts[n.output[0]] = _constant(self, n, []).cpu().numpy()
                skip.add(id(n))
        self.nodes = [n for n in graph.node if id(n) not in skip]
        self._torch_consts = {}
        self._int_readers = None      # weight DequantizeLinears per integer initializer (forget_const)
        self._ref = {}
        self.opaque = [not self._supported(n) for n in self.nodes]

    # ---- constants ----------------------------------------------------------------------
    def const(self, name):
        t = self._torch_consts.get(name)
        if t is None:
            arr = self.consts[name]
            t = self.torch.from_numpy(np.array(arr) if arr.dtype != np.uint16 else arr.astype(np.int32))
            t = self._torch_consts[name] = t.to(self.device)
        return t

    def forget_const(self, name) -> None:
        """Drop a constant no step still to run reads: its torch copies and arrays (a weight
        DequantizeLinear's: its integers too, where no other weight's DequantizeLinear reads
        them)."""
        for key in (name, ("f", name), ("dq", name)):
            self._torch_consts.pop(key, None)
        self.float_values.pop(name, None)
        self.float_consts.pop(name, None)
        n = self.wdq.get(name)
        if n is not None:
            if self._int_readers is None:
                self._int_readers = Counter(m.input[0] for m in self.wdq.values())
            if self._int_readers[n.input[0]] == 1:
                self.consts.pop(n.input[0], None)
                self._torch_consts.pop(n.input[0], None)
        elif name not in self.bias:
            self.consts.pop(name, None)

    def _supported(self, n) -> bool:
        """Whether the node runs through a torch mapping (with a gradient); otherwise it runs in
        onnxruntime (or onnx.reference) and is opaque to block reconstruction."""
        if n.op_type == "DequantizeLinear" and n.output[0] in self.chains:
            return True
        if n.domain not in ("", "ai.onnx") or n.op_type not in _OPS:
            return False
        op = n.op_type
        if op in ("Conv", "ConvTranspose", "AveragePool", "MaxPool") and \
                _attr(n, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
            return False
        if op == "Resize":
            mode = _attr(n, "mode", b"nearest")
            ctm = _attr(n, "coordinate_transformation_mode", b"half_pixel")
            nm = _attr(n, "nearest_mode", b"round_prefer_floor")
            if _attr(n, "axes") is not None or _attr(n, "antialias", 0) or self.opset < 11:
                return False
            if mode == b"nearest":
                return ctm == b"asymmetric" and nm == b"floor"
            return mode == b"linear" and ctm in (b"half_pixel", b"align_corners")
        if op in ("MaxPool", "LayerNormalization", "Dropout", "BatchNormalization") and \
                any(o for o in n.output[1:]):
            return False
        if op == "ConvTranspose" and _attr(n, "output_shape") is not None:
            return False
        if op in ("MaxPool", "AveragePool"):
            nd = len(_attr(n, "kernel_shape", []))
            pads = list(_attr(n, "pads", [0] * (2 * nd)))
            asym = pads[:nd] != pads[nd:]
            if asym and (_attr(n, "ceil_mode", 0) or (op == "AveragePool" and not _attr(n, "count_include_pad", 0))):
                return False
            if op == "AveragePool" and any(d != 1 for d in _attr(n, "dilations", [1] * nd)):
                return False
        if op == "Pad":
            mode = _attr(n, "mode", b"constant")
            if mode == b"constant":
                return True
            if mode not in (b"reflect", b"edge") or len(n.input) < 2 or n.input[1] not in self.consts:
                return False
            pads = [int(v) for v in np.asarray(self.consts[n.input[1]]).reshape(-1)]
            k = len(pads) // 2
            return len(n.input) < 4 and k >= 3 and not any(pads[:2] + pads[k:k + 2])
        if op == "Cast":
            return _attr(n, "to") in _DTYPES
        return True

    # ---- running ------------------------------------------------------------------------
    def value(self, name, env, mode, hard=True):
        if name == "":
            return None
        if name in env:
            return env[name]
        if mode == "q" and name in self.bias:
            return self.bias[name](hard)
        if name in self.consts:
            if mode == "f" and name in self.float_consts:
                return self._float_const(name, self.float_consts)
            return self.const(name)
        n = self.wdq.get(name)
        if n is not None:
            if mode == "f" and name in self.float_values:
                return self._float_const(name)
            if mode == "q" and name in self.soft:
                return self.soft[name](hard)
            return self._dq_const(n)
        raise KeyError(name)

    def reads(self, n) -> list[str]:
        """The tensors a step reads (an activation chain: its source; a node with subgraphs:
        the outer names its bodies use too)."""
        if n.op_type == "DequantizeLinear" and n.output[0] in self.chains:
            return [self.chains[n.output[0]].src]
        names = [i for i in n.input if i]
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                inner = {o for m in sub.node for o in m.output} | {i.name for i in sub.input} | \
                        {t.name for t in sub.initializer}
                names += [i for m in sub.node for i in m.input if i and i not in inner]
        return names

    def run(self, env: dict, start: int, end: int, mode: str, drop: float = 0.0, gen=None, hard: bool = True):
        """Execute nodes[start:end] over ``env`` (modified in place). ``drop``: in q mode, the
        probability with which each element of an activation chain's output keeps its float
        value (QDrop); ``gen`` a torch.Generator for it."""
        torch = self.torch
        for k in range(start, end):
            n = self.nodes[k]
            if n.op_type == "DequantizeLinear" and n.output[0] in self.chains:
                fq = self.chains[n.output[0]]
                x = self.value(fq.src, env, mode, hard)
                if mode == "q":
                    y = self._fake_quant(x, fq)
                    if drop > 0.0:
                        keep = torch.rand(y.shape, generator=gen, device=y.device) < drop
                        y = torch.where(keep, x, y)
                    env[n.output[0]] = y
                else:
                    env[n.output[0]] = x
                continue
            if self.opaque[k]:
                outs = self._reference(n, env, mode, hard)
            else:
                outs = _OPS[n.op_type](self, n, [self.value(i, env, mode, hard) for i in n.input])
            if not isinstance(outs, (list, tuple)):
                outs = [outs]
            if mode == "q" and n.name in self.shift_corr:
                outs = [outs[0] + self._shift_delta(n, hard)] + list(outs[1:])
            for name, v in zip(n.output, outs):
                if name:
                    env[name] = v
        return env

    def _float_const(self, out, source=None):
        t = self._torch_consts.get(("f", out))
        if t is None:
            src = self.float_values if source is None else source
            t = self.torch.from_numpy(np.array(src[out], np.float32)).to(self.device)
            self._torch_consts[("f", out)] = t
        return t

    def _shift_delta(self, n, hard):
        """(W_near - W_q) d through the layer, per output channel, shaped to add to its output."""
        wname, d, alpha = self.shift_corr[n.name]
        soft = self.soft.get(wname)
        if soft is None or soft.mode == "nearest":
            return 0.0
        diff = self._dq_const(self.wdq[wname]) - soft(hard)
        if n.op_type == "MatMul":
            return d * diff.sum(0)
        if n.op_type == "Gemm":
            return alpha * d * (diff.sum(1) if _attr(n, "transB", 0) else diff.sum(0))
        sums = diff.reshape(diff.shape[0], -1).sum(1)
        return d * sums.reshape([1, -1] + [1] * (diff.ndim - 2))

    def _dq_const(self, n):
        t = self._torch_consts.get(("dq", n.output[0]))
        if t is None:
            q = self.consts[n.input[0]].astype(np.float64)
            s = np.asarray(self.consts[n.input[1]], np.float64)
            z = np.asarray(self.consts[n.input[2]], np.float64) if len(n.input) > 2 and n.input[2] else 0.0
            axis = _attr(n, "axis", 1)
            if np.ndim(s) == 1 and q.ndim > 1:
                shape = [1] * q.ndim
                shape[axis] = -1
                s, z = s.reshape(shape), np.reshape(z, shape) if np.ndim(z) else z
            val = ((q - z) * s).astype(np.float32)
            t = self.torch.from_numpy(np.ascontiguousarray(val)).to(self.device)
            self._torch_consts[("dq", n.output[0])] = t
        return t

    def _fake_quant(self, x, fq: FakeQuant):
        torch = self.torch
        s, z = (fq.scale if fq.step is None else fq.step()), fq.zp
        if s.ndim == 1 and x.ndim > 1:
            shape = [1] * x.ndim
            shape[fq.axis] = -1
            s, z = s.reshape(shape), (z.reshape(shape) if z.ndim else z)
        if not s.requires_grad and x.is_floating_point():
            # a fixed grid: one autograd function, the same numbers as the chain below
            return _fused_fq(torch)(x, s, z, fq.qmin, fq.qmax)
        # x / s bounded first: a float32-lowest mask value on a Softmax input's floor grid
        # overflows to -inf, and -inf + (round(-inf) - -inf) is NaN, which the clamp keeps (every
        # block loss of a causal LM was NaN). Values that far out clamp to the grid's end anyway.
        v = torch.clamp(x / s, -BOUND, BOUND)
        r = torch.round(v)
        v = v + (r - v).detach()          # straight-through: the gradient of rounding is 1
        # (a learned scale then gets LSQ's gradient: round(x/s) - x/s inside the grid, the
        # clamp level outside it)
        q = torch.clamp(v + z, fq.qmin, fq.qmax)
        return (q - z) * s

    def _reference(self, n, env, mode, hard):
        """Run one node outside torch (no gradient): onnxruntime, else onnx.reference. Subgraph
        bodies (If, Loop) get the outer tensors they read."""
        return self._outside(n, {k: self.value(k, env, mode, hard) for k in dict.fromkeys(self.reads(n))})

    def _outside(self, n, values: dict):
        """Run node ``n`` outside torch on ``values`` (tensor name -> value); one session per node
        and input signature, reused for every sample."""
        feed = {k: (v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)) for k, v in values.items()}
        names = list(feed)
        key = (id(n), tuple((k, feed[k].dtype.str, feed[k].ndim) for k in names))
        runner = self._ref.get(key)
        if runner is None:
            runner = self._ref[key] = self._runner(n, names, feed)
        return [self.torch.from_numpy(np.array(o)).to(self.device) for o in runner(feed)]

    def _runner(self, n, names, feed):
        from onnx import helper

        ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(feed[k].dtype),
                                             [None] * feed[k].ndim) for k in names]
        outs = [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in n.output if o]
        m = helper.make_model(helper.make_graph([n], "one", ins, outs), opset_imports=self.opset_imports)
        m.ir_version = self.ir_version
        try:
            import onnxruntime as ort

            from dipoorlet.runtime import session_options

            typed = onnx.shape_inference.infer_shapes(m)
            for k, o in enumerate(typed.graph.output):   # a custom op's outputs: onnxruntime types them
                if not o.type.tensor_type.elem_type:
                    typed.graph.output[k].CopyFrom(onnx.ValueInfoProto(name=o.name))
            so = session_options()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            so.intra_op_num_threads = 1
            sess = ort.InferenceSession(typed.SerializeToString(), so, providers=["CPUExecutionProvider"])
            return lambda f: sess.run(None, f)
        except Exception:      # noqa: BLE001 - onnx.reference is the fallback, its error the one reported
            from onnx.reference import ReferenceEvaluator

            ev = ReferenceEvaluator(m)
            return lambda f: ev.run(None, f)


_FQ = {}


def _fused_fq(torch):
    """Fake quantization on a fixed grid as one autograd function: the forward pass computes the
    chain's values (x / s clamped to +-BOUND, rounded half to even, + z, clamped to the grid, - z,
    times s) in one buffer, and keeps one bool mask for the backward pass, which gives autograd's
    gradient of the chain, bit for bit: (grad * s) where the value was inside both clamps, else 0,
    divided by s. The chain of small ops had made 9 tensors per call and kept 2 full-size float
    ones for the backward pass; a step of --brecq runs hundreds of these."""
    if "fq" in _FQ:
        return _FQ["fq"]

    class FakeQuantFixed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, s, z, qmin, qmax):
            t = torch.div(x, s)
            keep = ctx.needs_input_grad[0]
            inside = ((t >= -BOUND) & (t <= BOUND)) if keep else None
            t.clamp_(-BOUND, BOUND).round_().add_(z)
            if keep:
                inside &= (t >= qmin) & (t <= qmax)
                ctx.save_for_backward(inside, s)
            return t.clamp_(qmin, qmax).sub_(z).mul_(s)

        @staticmethod
        def backward(ctx, grad):
            inside, s = ctx.saved_tensors
            g = torch.mul(grad, s).masked_fill_(~inside, 0.0)
            return g.div_(s), None, None, None, None

    _FQ["fq"] = FakeQuantFixed.apply
    return _FQ["fq"]


# ---- op mappings ---------------------------------------------------------------------------
def _ints(t):
    return [int(v) for v in (t.tolist() if hasattr(t, "tolist") else t)]


def _conv(self, n, ins):
    F = self.torch.nn.functional
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    nd = w.ndim - 2
    pads = _attr(n, "pads", [0] * (2 * nd))
    strides = _attr(n, "strides", [1] * nd)
    dil = _attr(n, "dilations", [1] * nd)
    group = _attr(n, "group", 1)
    if list(pads[:nd]) != list(pads[nd:]):
        pad = []
        for i in reversed(range(nd)):
            pad += [pads[i], pads[i + nd]]
        x = F.pad(x, pad)
        pads = [0] * (2 * nd)
    fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    return fn(x, w, b, strides, list(pads[:nd]), dil, group)


def _conv_transpose(self, n, ins):
    F = self.torch.nn.functional
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    nd = w.ndim - 2
    pads = list(_attr(n, "pads", [0] * (2 * nd)))
    strides = _attr(n, "strides", [1] * nd)
    dil = _attr(n, "dilations", [1] * nd)
    group = _attr(n, "group", 1)
    outpad = list(_attr(n, "output_padding", [0] * nd))
    if _attr(n, "output_shape") is not None or pads[:nd] != pads[nd:]:
        # asymmetric pads: run unpadded, then crop
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
        y = fn(x, w, b, strides, 0, outpad, group, dil)
        sl = [slice(None), slice(None)]
        for i in range(nd):
            sl.append(slice(pads[i], y.shape[2 + i] - pads[i + nd]))
        return y[tuple(sl)]
    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    return fn(x, w, b, strides, pads[:nd], outpad, group, dil)


def _gemm(self, n, ins):
    a, b = ins[0], ins[1]
    if _attr(n, "transA", 0):
        a = a.t()
    if _attr(n, "transB", 0):
        b = b.t()
    y = _attr(n, "alpha", 1.0) * (a @ b)
    if len(ins) > 2 and ins[2] is not None:
        y = y + _attr(n, "beta", 1.0) * ins[2]
    return y


def _clip(self, n, ins):
    torch = self.torch
    x = ins[0]
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else _attr(n, "min")
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else _attr(n, "max")
    if lo is not None:
        x = torch.maximum(x, torch.as_tensor(lo, dtype=x.dtype, device=x.device))
    if hi is not None:
        x = torch.minimum(x, torch.as_tensor(hi, dtype=x.dtype, device=x.device))
    return x


def _softmax(self, n, ins, log=False):
    torch = self.torch
    x = ins[0]
    axis = _attr(n, "axis", -1 if self.opset >= 13 else 1)
    f = torch.log_softmax if log else torch.softmax
    if self.opset >= 13:
        return f(x, axis)
    axis = axis % x.ndim
    shape = x.shape
    return f(x.reshape(int(np.prod(shape[:axis])), -1), 1).reshape(shape)


def _bn(self, n, ins):
    x, s, b, m, v = ins[:5]
    eps = _attr(n, "epsilon", 1e-5)
    shape = [1, -1] + [1] * (x.ndim - 2)
    return (x - m.reshape(shape)) / self.torch.sqrt(v.reshape(shape) + eps) * s.reshape(shape) + b.reshape(shape)


def _layernorm(self, n, ins):
    torch = self.torch
    x, s = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    axis = _attr(n, "axis", -1) % x.ndim
    dims = tuple(range(axis, x.ndim))
    mu = x.mean(dims, keepdim=True)
    var = ((x - mu) ** 2).mean(dims, keepdim=True)
    y = (x - mu) / torch.sqrt(var + _attr(n, "epsilon", 1e-5)) * s
    return y + b if b is not None else y


def _pool(self, n, ins, kind):
    F = self.torch.nn.functional
    x = ins[0]
    nd = x.ndim - 2
    k = _attr(n, "kernel_shape")
    pads = list(_attr(n, "pads", [0] * (2 * nd)))
    strides = _attr(n, "strides", [1] * nd)
    ceil = bool(_attr(n, "ceil_mode", 0))
    if pads[:nd] != pads[nd:] or any(p > kk // 2 for p, kk in zip(pads, list(k) * 2)):
        pad = []
        for i in reversed(range(nd)):
            pad += [pads[i], pads[i + nd]]
        if kind == "max":
            x = F.pad(x, pad, value=float("-inf"))
        elif _attr(n, "count_include_pad", 0):
            x = F.pad(x, pad)
        else:
            raise NotImplementedError("AveragePool with asymmetric pads")
        pads = [0] * (2 * nd)
    if kind == "max":
        fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
        return fn(x, k, strides, pads[:nd], _attr(n, "dilations", [1] * nd), ceil)
    fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[nd - 1]
    return fn(x, k, strides, pads[:nd], ceil, bool(_attr(n, "count_include_pad", 0)))


def _reshape(self, n, ins):
    x, shape = ins[0], _ints(ins[1])
    if not _attr(n, "allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return x.reshape(shape)


def _flatten(self, n, ins):
    x = ins[0]
    axis = _attr(n, "axis", 1)
    axis = axis + x.ndim if axis < 0 else axis
    return x.reshape(int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:])))


def _axes(self, n, ins, idx=1):
    if len(ins) > idx and ins[idx] is not None:
        return _ints(ins[idx])
    a = _attr(n, "axes")
    return list(a) if a is not None else None


def _squeeze(self, n, ins):
    x = ins[0]
    axes = _axes(self, n, ins)
    if axes is None:
        return x.squeeze()
    for a in sorted((a % x.ndim for a in axes), reverse=True):
        x = x.squeeze(a)
    return x


def _unsqueeze(self, n, ins):
    x = ins[0]
    axes = _axes(self, n, ins)
    r = x.ndim + len(axes)
    for a in sorted(a % r for a in axes):
        x = x.unsqueeze(a)
    return x


def _slice(self, n, ins):
    x = ins[0]
    if len(ins) > 1:
        starts, ends = _ints(ins[1]), _ints(ins[2])
        axes = _ints(ins[3]) if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
        steps = _ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    else:
        starts, ends = list(_attr(n, "starts")), list(_attr(n, "ends"))
        axes = list(_attr(n, "axes", range(len(starts))))
        steps = [1] * len(starts)
    sl = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        a %= x.ndim
        dim = x.shape[a]
        s = s + dim if s < 0 else s
        e = e + dim if e < 0 else e
        if st > 0:
            sl[a] = slice(min(max(s, 0), dim), min(max(e, 0), dim), st)
        else:       # clamped to [0, dim-1] and [-1, dim-1]; -1 means "through index 0"
            s, e = min(max(s, 0), dim - 1), min(max(e, -1), dim - 1)
            idx = np.arange(s, e, st, dtype=np.int64)
            x = x.index_select(a, self.torch.from_numpy(idx).to(x.device))
    return x[tuple(sl)]


def _concat(self, n, ins):
    axis = _attr(n, "axis")
    ins = [i for i in ins if i is not None and not (i.ndim == 1 and i.shape[0] == 0 and ins[0].ndim > 1)]
    return self.torch.cat(ins, axis)


def _split(self, n, ins):
    x = ins[0]
    axis = _attr(n, "axis", 0)
    if len(ins) > 1 and ins[1] is not None:
        sizes = _ints(ins[1])
    elif _attr(n, "split") is not None:
        sizes = list(_attr(n, "split"))
    else:
        k = len(n.output)
        dim = x.shape[axis]
        step = -(-dim // k)
        sizes = [min(step, dim - i * step) for i in range(k)]
    return list(self.torch.split(x, sizes, axis))


def _shape(self, n, ins):
    s = list(ins[0].shape)
    start, end = _attr(n, "start", 0), _attr(n, "end", None)
    return self.torch.tensor(s[start:end], dtype=self.torch.int64, device=ins[0].device)


def _gather(self, n, ins):
    x, idx = ins[0], ins[1].long()
    axis = _attr(n, "axis", 0) % x.ndim
    idx = self.torch.where(idx < 0, idx + x.shape[axis], idx)
    out = x.index_select(axis, idx.reshape(-1))
    return out.reshape(list(x.shape[:axis]) + list(idx.shape) + list(x.shape[axis + 1:]))


def _cast(self, n, ins):
    name = _DTYPES[_attr(n, "to")]
    return ins[0].to(getattr(self.torch, name))


def _reduce(self, n, ins, fn):
    x = ins[0]
    axes = _axes(self, n, ins) if self.opset >= 18 or n.op_type == "ReduceSum" and self.opset >= 13 else \
        (list(_attr(n, "axes")) if _attr(n, "axes") is not None else None)
    keep = bool(_attr(n, "keepdims", 1))
    if axes is None or len(axes) == 0:
        if _attr(n, "noop_with_empty_axes", 0):
            return x
        axes = list(range(x.ndim))
    axes = tuple(a % x.ndim for a in axes)
    if fn in ("amax", "amin"):
        return getattr(self.torch, fn)(x, axes, keepdim=keep)
    return getattr(x, fn)(axes, keepdim=keep)


def _resize(self, n, ins):
    F = self.torch.nn.functional
    x = ins[0]
    scales = ins[2] if len(ins) > 2 and ins[2] is not None and ins[2].numel() else None
    sizes = ins[3] if len(ins) > 3 and ins[3] is not None and ins[3].numel() else None
    lead = _ints(sizes)[:2] if sizes is not None else [float(v) for v in scales.tolist()[:2]]
    if x.ndim not in (3, 4, 5) or (lead != list(x.shape[:2]) if sizes is not None else lead != [1.0, 1.0]):
        return self._outside(n, {k: v for k, v in zip(n.input, ins) if k})   # N/C resized, or another rank
    if sizes is not None:
        size = _ints(sizes)[2:]
    else:
        size = [int(np.floor(d * float(s))) for d, s in zip(x.shape[2:], scales.tolist()[2:])]
    mode = _attr(n, "mode", b"nearest")
    if mode == b"nearest":
        if scales is not None:
            return F.interpolate(x, scale_factor=[float(s) for s in scales.tolist()[2:]], mode="nearest")
        return F.interpolate(x, size=size, mode="nearest")
    ctm = _attr(n, "coordinate_transformation_mode", b"half_pixel")
    m = {3: "linear", 4: "bilinear", 5: "trilinear"}[x.ndim]
    if ctm == b"align_corners":
        return F.interpolate(x, size=size, mode=m, align_corners=True)
    if scales is not None and ctm == b"half_pixel":
        return F.interpolate(x, scale_factor=[float(s) for s in scales.tolist()[2:]], mode=m, align_corners=False)
    return F.interpolate(x, size=size, mode=m, align_corners=False)


def _pad(self, n, ins):
    F = self.torch.nn.functional
    x = ins[0]
    pads = _ints(ins[1]) if len(ins) > 1 else list(_attr(n, "pads"))
    mode = _attr(n, "mode", b"constant").decode()
    value = float(ins[2]) if len(ins) > 2 and ins[2] is not None and ins[2].numel() else float(_attr(n, "value", 0.0))
    nd = x.ndim
    if len(ins) > 3 and ins[3] is not None:
        axes = [a % nd for a in _ints(ins[3])]
        full = [0] * (2 * nd)
        for i, a in enumerate(axes):
            full[a], full[a + nd] = pads[i], pads[i + len(axes)]
        pads = full
    tp = []
    for i in reversed(range(nd)):
        tp += [pads[i], pads[i + nd]]
    while len(tp) > 2 and tp[-1] == 0 and tp[-2] == 0:
        tp = tp[:-2]
    mode = {"edge": "replicate"}.get(mode, mode)
    return F.pad(x, tp, mode=mode, value=value) if mode == "constant" else F.pad(x, tp, mode=mode)


def _expand(self, n, ins):
    x, shape = ins[0], _ints(ins[1])
    out = np.broadcast_shapes(tuple(x.shape), tuple(shape))
    return x.expand(out)


def _const_of_shape(self, n, ins):
    v = _attr(n, "value")
    arr = numpy_helper.to_array(v) if v is not None else np.zeros(1, np.float32)
    return self.torch.full(_ints(ins[0]), arr.reshape(-1)[0].item(),
                           dtype=self.torch.from_numpy(arr).dtype, device=self.device)


def _constant(self, n, ins):
    for a in n.attribute:
        if a.name == "value":
            return self.torch.from_numpy(np.array(numpy_helper.to_array(a.t))).to(self.device)
        if a.name in ("value_float", "value_int"):
            return self.torch.tensor(a.f if a.name == "value_float" else a.i, device=self.device)
        if a.name in ("value_floats", "value_ints"):
            return self.torch.tensor(list(a.floats) if a.name == "value_floats" else list(a.ints), device=self.device)
    raise NotImplementedError("Constant without a value")


def _binary(fn):
    def op(self, n, ins):
        return fn(self.torch, ins[0], ins[1])
    return op


def _unary(fn):
    def op(self, n, ins):
        return fn(self.torch, ins[0])
    return op


def _div(self, n, ins):
    a, b = ins
    if not a.is_floating_point() and not b.is_floating_point():
        return self.torch.div(a, b, rounding_mode="trunc")
    return a / b


def _gelu(self, n, ins):
    approx = _attr(n, "approximate", b"none")
    return self.torch.nn.functional.gelu(ins[0], approximate="tanh" if approx == b"tanh" else "none")


def _range(self, n, ins):
    start, limit, delta = ins[0].item(), ins[1].item(), ins[2].item()
    count = max(int(np.ceil((limit - start) / delta)), 0)
    return start + delta * self.torch.arange(count, dtype=ins[0].dtype, device=ins[0].device)


_OPS = {
    "Conv": _conv, "ConvTranspose": _conv_transpose, "Gemm": _gemm,
    "MatMul": _binary(lambda t, a, b: a @ b),
    "Add": _binary(lambda t, a, b: a + b), "Sub": _binary(lambda t, a, b: a - b),
    "Mul": _binary(lambda t, a, b: a * b), "Div": _div,
    "Pow": _binary(lambda t, a, b: t.pow(a, b)),
    "Equal": _binary(lambda t, a, b: t.eq(a, b)), "Greater": _binary(lambda t, a, b: t.gt(a, b)),
    "Less": _binary(lambda t, a, b: t.lt(a, b)), "GreaterOrEqual": _binary(lambda t, a, b: t.ge(a, b)),
    "LessOrEqual": _binary(lambda t, a, b: t.le(a, b)),
    "And": _binary(lambda t, a, b: t.logical_and(a, b)), "Or": _binary(lambda t, a, b: t.logical_or(a, b)),
    "Not": _unary(lambda t, x: t.logical_not(x)),
    "Max": lambda self, n, ins: _fold(self.torch.maximum, ins),
    "Min": lambda self, n, ins: _fold(self.torch.minimum, ins),
    "Sum": lambda self, n, ins: _fold(lambda a, b: a + b, ins),
    "Where": lambda self, n, ins: self.torch.where(ins[0].bool(), ins[1], ins[2]),
    # at exact zeros (a magnitude of silence) sqrt's gradient is inf * 0 = NaN: clamped there
    "Sqrt": _unary(lambda t, x: t.sqrt(t.clamp(x, min=1e-30)) if x.is_floating_point() else t.sqrt(x)), "Neg": _unary(lambda t, x: -x), "Abs": _unary(lambda t, x: x.abs()),
    "Exp": _unary(lambda t, x: t.exp(x)), "Log": _unary(lambda t, x: t.log(x)),
    "Reciprocal": _unary(lambda t, x: 1.0 / x), "Floor": _unary(lambda t, x: t.floor(x)),
    "Ceil": _unary(lambda t, x: t.ceil(x)),
    "Relu": _unary(lambda t, x: t.relu(x)), "Sigmoid": _unary(lambda t, x: t.sigmoid(x)),
    "Tanh": _unary(lambda t, x: t.tanh(x)), "Erf": _unary(lambda t, x: t.erf(x)),
    "Softplus": _unary(lambda t, x: t.nn.functional.softplus(x)),
    "HardSwish": _unary(lambda t, x: x * t.clamp(x / 6.0 + 0.5, 0.0, 1.0)),
    "HardSigmoid": lambda self, n, ins: self.torch.clamp(_attr(n, "alpha", 0.2) * ins[0] + _attr(n, "beta", 0.5),
                                                         0.0, 1.0),
    "LeakyRelu": lambda self, n, ins: self.torch.nn.functional.leaky_relu(ins[0], _attr(n, "alpha", 0.01)),
    "PRelu": lambda self, n, ins: self.torch.where(ins[0] >= 0, ins[0], ins[0] * ins[1]),
    "Gelu": _gelu, "Clip": _clip,
    "Softmax": _softmax, "LogSoftmax": lambda self, n, ins: _softmax(self, n, ins, log=True),
    "BatchNormalization": _bn, "LayerNormalization": _layernorm,
    "GlobalAveragePool": _unary(lambda t, x: x.mean(tuple(range(2, x.ndim)), keepdim=True)),
    "GlobalMaxPool": _unary(lambda t, x: t.amax(x, tuple(range(2, x.ndim)), keepdim=True)),
    "AveragePool": lambda self, n, ins: _pool(self, n, ins, "avg"),
    "MaxPool": lambda self, n, ins: _pool(self, n, ins, "max"),
    "Flatten": _flatten, "Reshape": _reshape,
    "Transpose": lambda self, n, ins: ins[0].permute(*(_attr(n, "perm") or range(ins[0].ndim - 1, -1, -1))),
    "Concat": _concat, "Split": _split, "Slice": _slice, "Squeeze": _squeeze, "Unsqueeze": _unsqueeze,
    "Shape": _shape, "Gather": _gather, "Cast": _cast, "Identity": lambda self, n, ins: ins[0],
    "Dropout": lambda self, n, ins: ins[0],
    "ReduceMean": lambda self, n, ins: _reduce(self, n, ins, "mean"),
    "ReduceSum": lambda self, n, ins: _reduce(self, n, ins, "sum"),
    "ReduceMax": lambda self, n, ins: _reduce(self, n, ins, "amax"),
    "ReduceMin": lambda self, n, ins: _reduce(self, n, ins, "amin"),
    "Resize": _resize, "Pad": _pad, "Expand": _expand, "ConstantOfShape": _const_of_shape,
    "Constant": _constant, "Range": _range,
    "Tile": lambda self, n, ins: ins[0].repeat(*_ints(ins[1])),
}


def _fold(fn, ins):
    out = ins[0]
    for x in ins[1:]:
        out = fn(out, x)
    return out
