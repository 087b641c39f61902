"""Asymmetric activation grids on symmetric backends: a shift that the next layer's bias absorbs.

TensorRT quantizes every activation on a grid symmetric around 0. A one-sided tensor (a ReLU,
HardSwish or GELU output: nearly all of its values on one side of 0) then uses half of the 256
levels. Where every consumer of such a tensor is an affine layer with a constant weight that
pads nothing (MatMul, Gemm, a Conv with zero padding), the tensor can be shifted instead:

    x' = x + d,   d = zp * s          (an Add by a constant, fused by TensorRT into x's producer)
    W x' + (b - W d) = W x + b        (the consumer's bias absorbs the shift: same function)

and ``x'`` quantized on the symmetric grid of scale ``s`` is exactly ``x`` on the asymmetric grid
``(s, zp)``: ``round(x'/s) = round(x/s) + zp`` (``zp`` is an integer). The asymmetric grid is the
one the range method gives for the tensor's own statistics on the levels -127..127 (254 steps,
as on an asymmetric backend, less the level -128 so that ``x'`` stays inside the +-127 s range
the side files state); so no new statistics pass is needed. The quantized consumers' biases are
``b - W_q d`` with ``W_q`` the dequantized weights, and so are transformed_model.onnx's (written
from the plan's values); the in-memory float graph keeps ``b - W d``.

A shift is applied where it shrinks the step by at least ``MIN_RATIO`` (here 1.2x, 1.6 dB of that
tensor's rounding noise); a ReLU output gains close to 2x (6 dB). Padded Convs are left alone: their
zero padding would become ``-d`` after the shift, which no bias can absorb.

What this changes for deployment: the graph gets an ``Add`` per shifted tensor and new biases
(both in ``transformed_model.onnx`` and in the Q/DQ model); the side files name the shifted
tensors (``<t>_shift``) with their symmetric ranges, which is what TensorRT must be told.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
from onnx import TensorProto, helper

from dipoorlet.graph import _subgraph_outer_refs, add_initializer, fresh_name, insert_before, node_attr
from dipoorlet.qparams import QParams, dequantize_array, levels, make_qparams, quantize_array
from dipoorlet.ranges import RangeParams

log = logging.getLogger(__name__)

MIN_RATIO = 1.2


def applicable(plat) -> bool:
    """Symmetric activations without power-of-two scales or shared grids, on a backend that runs
    an Add of a constant fused in float rather than quantizing it (TensorRT; not STPU, which
    would quantize the tensor again in front of the shift)."""
    a = plat.activation
    add_runs_float = "Add" not in plat.quantize_ops or bool(plat.residual_add_producers)
    return bool(a.symmetric and not a.power_of_two and not a.unsigned and not a.unsigned_nonnegative
                and not plat.share_scale and add_runs_float)


def _consumer_ok(g, node, tensor: str) -> bool:
    if node.input[0] != tensor or any(i == tensor for i in node.input[1:]):
        return False
    if len(node.input) < 2 or node.input[1] not in g.initializers:
        return False
    w_shape = g.shape(node.input[1])
    if node.op_type == "MatMul":
        if w_shape is None or len(w_shape) != 2:
            return False
        # without a bias Add one is inserted, whose output would replace a network output's
        # producer (and a platform that quantizes network outputs would lose that Q/DQ)
        return _bias_add(g, node) is not None or node.output[0] not in g.output_names
    if node.op_type == "Gemm":
        if node_attr(node, "transA", 0) or w_shape is None or len(w_shape) != 2:
            return False
        if float(node_attr(node, "beta", 1.0)) == 0.0:
            return False       # C is ignored: no bias to absorb the shift
        if len(node.input) < 3 or not node.input[2]:
            return True
        n = w_shape[0] if node_attr(node, "transB", 0) else w_shape[1]
        if node.input[2] not in g.initializers:
            return False
        c = g.weight(node.input[2])
        # one value per output column: [N], [1, N] or a scalar ([M, 1] or [M, N] vary per row)
        return c.size == 1 or (c.shape[-1] == n and c.size == n)
    if node.op_type == "Conv":
        pads = node_attr(node, "pads", None)
        auto = node_attr(node, "auto_pad", "NOTSET")
        auto = auto.decode() if isinstance(auto, bytes) else auto
        no_pad = (pads is None or not any(pads)) and auto in ("NOTSET", "VALID")
        return no_pad and (len(node.input) < 3 or not node.input[2] or node.input[2] in g.initializers)
    return False


def _bias_add(g, matmul):
    """The Add of a constant [N] vector that follows a MatMul as its only consumer, or None."""
    cons = g.consumers.get(matmul.output[0], [])
    if len(cons) != 1 or cons[0].op_type != "Add" or matmul.output[0] in g.output_names:
        return None
    add = cons[0]
    other = add.input[1] if add.input[0] == matmul.output[0] else add.input[0]
    if other not in g.initializers:
        return None
    n = g.shape(matmul.input[1])[1]
    b = g.weight(other)
    if b.size != n or (b.ndim and b.shape[-1] != n):
        return None
    return add, other


def targets(g, places, plan) -> dict[str, list]:
    """Quantized tensors whose every consumer can absorb a shift: {tensor: consumer nodes}."""
    out = {}
    for t, point in places.activations.items():
        if t not in plan.activations or point.output or t in g.output_names or not point.uses:
            continue
        if plan.activations[t].axis is not None:
            continue
        cons = g.consumers.get(t, [])
        if not cons or len({id(c) for c in cons}) != len(cons):
            continue
        used = {n for n, _ in point.uses}
        if not all(c.name in used and _consumer_ok(g, c, t) and c.input[1] in plan.weights for c in cons):
            continue
        out[t] = cons
    return out


def _weight_sums(node, w: np.ndarray) -> np.ndarray:
    """Per output channel, the sum of the weights one input value meets (every input is shifted
    by the same d): MatMul [K, N] over K; Gemm over K (transB: [N, K]); Conv over C/group x k."""
    if node.op_type == "MatMul":
        return w.sum(axis=0)
    if node.op_type == "Gemm":
        return w.sum(axis=1) if node_attr(node, "transB", 0) else w.sum(axis=0)
    return w.reshape(w.shape[0], -1).sum(axis=1)


def _shift_through(node, d: float, w: np.ndarray) -> np.ndarray:
    """What a shift ``d`` of every input adds to ``node``'s output through weight ``w``, per output
    channel, in the units of its bias (a Gemm computes alpha A B + beta C)."""
    delta = d * _weight_sums(node, np.asarray(w, np.float64))
    if node.op_type == "Gemm":
        delta = delta * float(node_attr(node, "alpha", 1.0)) / float(node_attr(node, "beta", 1.0))
    return delta


def _absorb(g, node, d: float, wq: np.ndarray) -> tuple[str, np.ndarray, str | None, str | None]:
    """Subtract W·d from ``node``'s bias (a new constant; created if the node has none).

    The float graph gets ``b - W d``, exactly its own function. The quantized layer must get
    ``b - W_q d``, ``W_q`` its dequantized weight: ``W_q x' + b - W d`` would leave
    ``(W_q - W) d`` behind, weight rounding times the shift, summed over every input (on MiniLM's
    FFN, cosine 0.05). Returns (bias name, quantized-model value) for ``plan.values``, the
    bias it replaced (None where there was none), and for a MatMul the output of the Add after
    it: the MatMul's own output now carries ``W d``, which that Add takes off, so the layer's
    output as the input model has it is the Add's (the error profile measures it there; it
    measured the offset product, 45.6 dB where the layer's output read 42.0)."""
    delta, delta_q = _shift_through(node, d, g.weight(node.input[1])), _shift_through(node, d, wq)
    if node.op_type == "MatMul":
        found = _bias_add(g, node)
        if found is not None:
            add, old = found
            b = g.weight(old).astype(np.float64)
            name = add_initializer(g, fresh_name(g, f"{old}_shift"), (b - delta.reshape(b.shape)).astype(np.float32))
            add.input[list(add.input).index(old)] = name
            return name, (b - delta_q.reshape(b.shape)).astype(np.float32), old, add.output[0]
        out = node.output[0]
        mid = fresh_name(g, f"{out}_noshift")
        name = add_initializer(g, fresh_name(g, f"{node.name}_shift_bias"), (-delta).astype(np.float32))
        node.output[0] = mid
        elem, shape = g.types.get(out, (TensorProto.FLOAT, None))      # profiled as a float tensor
        g.graph.value_info.append(helper.make_tensor_value_info(mid, elem, shape))
        add = helper.make_node("Add", [mid, name], [out], name=fresh_name(g, f"{node.name}_shift_Add"))
        g.graph.node.insert(list(g.graph.node).index(node) + 1, add)
        g.producer[mid] = node
        g.node_by_name[add.name] = add
        return name, (-delta_q).astype(np.float32), None, out
    old = node.input[2] if len(node.input) >= 3 and node.input[2] else None
    if old:
        b = g.weight(node.input[2]).astype(np.float64).reshape(-1)
        b = np.full(delta.shape, b[0]) if b.size == 1 else b    # a broadcast Gemm C: widened to [N]
        name = fresh_name(g, f"{node.input[2]}_shift")
    else:
        b = np.zeros(delta.shape)
        name = fresh_name(g, f"{node.name}_shift_bias")
        while len(node.input) < 3:
            node.input.append("")
    node.input[2] = add_initializer(g, name, (b - delta).astype(np.float32))
    return name, (b - delta_q).astype(np.float32), old, None


def rebased_biases(g, plan, rows, weights: dict) -> dict:
    """The quantized-model biases that absorb a shift (``b - W_q d``) for other weight grids:
    ``weights`` maps weight tensor -> QParams (--auto_w8's 8-bit grids). Returns bias name ->
    value for the consumers of ``rows`` (this module's report rows) whose weight has a new grid;
    the shift itself is unchanged."""
    old, new = {}, {}
    for r in rows:
        for name in r["consumers"]:
            wt = g.node_by_name[name].input[1]
            if wt in weights and wt in plan.weights and wt not in new:
                old[wt] = _nearest(g, wt, plan.weights[wt])
                new[wt] = _nearest(g, wt, weights[wt])
    return rebased_for_values(g, plan, rows, old, new)


def _nearest(g, wt: str, qp) -> np.ndarray:
    """Weight ``wt`` rounded to nearest on grid ``qp``, dequantized (float64)."""
    return dequantize_array(quantize_array(g.weight(wt), qp), qp).astype(np.float64)


def rebased_for_fitted(g, plan, rows, tensors) -> dict:
    """:func:`rebased_for_values` for weights whose values a fit replaced on their own grids
    (``plan.values``: --sparse's magnitude pruning), from the nearest rounding the shift was
    absorbed with."""
    old, new = {}, {}
    for wt in tensors:
        if wt in plan.values and wt in plan.weights:
            old[wt] = _nearest(g, wt, plan.weights[wt])
            new[wt] = np.asarray(plan.values[wt], np.float64)
    return rebased_for_values(g, plan, rows, old, new)


def rebased_for_values(g, plan, rows, old: dict, new: dict) -> dict:
    """The quantized-model biases that absorb a shift, rebased from the dequantized weights
    ``old`` onto ``new`` (weight tensor -> value: other grids, :func:`rebased_biases`, or another
    rounding on the same grid, --brecq): bias name -> the value that absorbs the shift through
    the new weights."""
    out = {}
    for r in rows:
        for name in r["consumers"]:
            node = g.node_by_name[name]
            wt = node.input[1]
            if wt not in new:
                continue
            owned = [k for k, o in plan.value_owners.items() if o == name and k != wt and k in plan.values]
            if len(owned) != 1:
                continue
            corr = _shift_through(node, r["shift"], old[wt]) - _shift_through(node, r["shift"], new[wt])
            b = np.asarray(plan.values[owned[0]])
            out[owned[0]] = (b.astype(np.float64) + corr.reshape(b.shape)).astype(b.dtype)
    return out


def _drop(g, names: set) -> None:
    """Remove the replaced biases no node reads any more, and their graph-input entries (old
    exporters list initializers as inputs), one by one: rebuilding the initializer list would
    copy every weight of the model."""
    used = {i for n in g.graph.node for i in [*n.input, *_subgraph_outer_refs(n)]}
    gone = set()
    for k in range(len(g.graph.initializer) - 1, -1, -1):
        name = g.graph.initializer[k].name
        if name in names and name not in used and name not in g.output_names:
            del g.graph.initializer[k]
            gone.add(name)
    for k in range(len(g.graph.input) - 1, -1, -1):
        if g.graph.input[k].name in gone:
            del g.graph.input[k]


def asymmetric_grid(st, method, rule, threshold: float, percentile: float) -> QParams:
    """The grid an asymmetric backend would give this tensor, on the levels -(2^(b-1)-1) ..
    2^(b-1)-1: never -2^(b-1), so the shifted tensor stays inside the symmetric clip range
    +-qmax*s that the side files state (TensorRT's implicit flow clips to it; one level of 255 is
    0.03 dB)."""
    asym = dataclasses.replace(rule, symmetric=False, narrow_range=True)
    qmin, qmax = levels(asym)
    lo, hi = method(st, RangeParams(qmax=qmax - qmin, threshold=threshold, percentile=percentile))
    return make_qparams(lo, hi, asym)


def apply(g, places, plan, stats, method, threshold: float, percentile: float) -> list[dict]:
    """Shift the tensors that gain; edits ``g`` and ``plan`` (the caller re-places). The weight
    grids must be planned (the quantized biases absorb the shift through them). Returns rows
    for the report: tensor, shift, consumers, step ratio (symmetric step / asymmetric step)."""
    rows, replaced = [], set()
    for t, cons in targets(g, places, plan).items():
        sym = plan.activations[t]
        rule = plan.rules.get(t)
        if rule is None or t not in stats or not rule.symmetric:
            continue
        mm = stats[t].minmax
        if not mm.hi > mm.lo:      # constant (e.g. always zero): nothing to gain, a degenerate grid
            continue
        asym = asymmetric_grid(stats[t], method, rule, threshold, percentile)
        ratio = float(sym.scale) / float(asym.scale)
        if ratio < MIN_RATIO or int(asym.zero_point) == 0:
            continue
        s = np.float32(asym.scale)
        d = float(np.float32(float(asym.zero_point) * float(s)))
        taps = {}
        for node in cons:
            qp = plan.weights[node.input[1]]
            wq = dequantize_array(quantize_array(g.weight(node.input[1]), qp), qp)
            name, value, old, tap = _absorb(g, node, d, wq)
            if tap:
                taps[node.name] = tap
            if old:
                replaced.add(old)
            plan.values[name] = value
            plan.value_owners[name] = node.name
        out = insert_before(g, "Add", t, np.array(d, np.float32), "shift", "value", cons)
        # the clip range a symmetric backend is told: +-qmax * s (TensorRT: amax = 127 s)
        amax = float(sym.qmax) * float(s)
        plan.activations[out] = QParams(scale=np.asarray(s, np.float32), zero_point=np.zeros((), sym.zero_point.dtype),
                                        bits=sym.bits, signed=sym.signed, qmin=sym.qmin, qmax=sym.qmax, axis=None,
                                        lo=np.asarray(-amax, np.float32), hi=np.asarray(amax, np.float32))
        plan.rules[out] = rule
        del plan.activations[t]
        plan.rules.pop(t, None)
        rows.append({"tensor": t, "shifted": out, "shift": d, "consumers": [c.name for c in cons], "taps": taps,
                     "clip": [float(asym.lo), float(asym.hi)],
                     "step_ratio": ratio, "noise_reduction_db": float(20 * np.log10(ratio))})
    if rows:
        _drop(g, replaced)
        g.refresh()
        log.info("shift: %d one-sided tensors moved onto the symmetric grid (%s)", len(rows),
                 ", ".join(f"{r['tensor']} {r['noise_reduction_db']:.1f} dB" for r in rows[:4])
                 + (" ..." if len(rows) > 4 else ""))
    return rows
