"""Empirical bias correction: undo the mean shift each quantized layer adds to its own output.

Quantizing a layer's weights and its input moves the mean of its output: rounding a depthwise
kernel of nine weights rarely sums to zero, clipping an input's tail lowers its mean, and a
per-tensor grid can round a narrow channel's values to one side. The next layers see that shift
as a wrong bias, and it adds up through the network (Nagel et al., "Data-Free Quantization
Through Weight Equalization and Bias Correction", ICCV 2019; AIMET's empirical variant).

For every Conv, Gemm, and MatMul followed by a bias Add whose weight is quantized, one pass of
the quantized model over the calibration samples measures the per-channel mean of the layer's
input before its Q/DQ (``x``) and after (``x̂``). The layer's own shift is then

    delta[o] = sum_c  Wq_sum[o, c] * mean(x̂_c)  -  W_sum[o, c] * mean(x_c)

where ``W_sum`` sums the kernel over its spatial taps (Conv) and ``Wq`` is the dequantized
weight; the bias becomes ``b - delta``. The shift is measured on each layer's real quantized
input, so correcting all layers at once does not double count an upstream shift. Spatial means
ignore the zero padding at the borders, which both terms share.

The means are averaged per sample and summed as fixed-point integers, so the result is the same
for any number of MPI processes and any sample order. The means are taken inside the graph
(Cast to float64, ReduceMean: float32 sums moved the recognizer's exact match by 0.017), so one
vector per sample leaves onnxruntime instead of every corrected layer's input twice (peak RSS
on the PP-OCRv4 detector 309 -> 258 MB).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx

from dipoorlet.data import sample_name
from dipoorlet.graph import add_initializer, fresh_name, node_attr
from dipoorlet.layer_errors import warn_left_out
from dipoorlet.progress import progress
from dipoorlet.qdq import append_watch, dq_source, insert_qdq, nan_free
from dipoorlet.qparams import quantize_array
from dipoorlet.runtime import SIMULATE, Runner

log = logging.getLogger(__name__)

BC_SAMPLES = 256       # default cap on the samples the pass reads (--bc_samples): per-channel means settle
#                        long before that, and at -N 1000 the pass would cost as much as calibration
FIXED = float(2**24)   # fixed-point scale of the per-sample means (exact, order-free sums)
SPLIT = float(2**44)   # each fixed-point mean is summed as two int64 parts, above and below 2^44
LIMIT = float(2**62)   # |mean| beyond this is clipped (float32 reaches 3e38); exact below
CARRY = 4096           # samples between carries of the low sums into the high ones


@dataclass
class Site:
    node: str
    op_type: str
    weight: str          # weight tensor name
    bias: str            # bias tensor name (a Conv/Gemm input, or the constant of a MatMul's bias Add)
    x: str               # layer input before Q/DQ in the quantized model
    xq: str              # layer input as the layer reads it (the DQ output, or x itself)
    channel_axis: int    # axis of input channels in x


def give_biases(g, skip=(), matmul_note: bool = True) -> dict:
    """Give every layer bias correction could correct a bias of its own, before the transforms
    (the float function is unchanged): a Conv or Gemm without one gets a zero bias, and a bias
    constant that several nodes read is copied for each layer reading it as its bias. ``skip``:
    layers kept float (--skip_layers), left as they are. ``matmul_note``: log the MatMuls left
    without a bias (bias correction runs).

    Torch's dynamo exporter drops all-zero Conv biases and merges equal constants (one zero vector
    served 15 of a random-init BERT's bias Adds and LayerNorms), and ``bias=False`` layers have
    none: :func:`find_sites` passed them all by without a word, and equalization took no such Conv
    as a pair's producer (a depthwise/pointwise stack on snpe kept 2.3x the error of the same model
    exported with its zero biases; found by a hunt). A
    MatMul without a bias Add is still left alone: an Add inserted after it would be one more
    quantized output on backends that quantize every op's output. Returns the counts."""
    added, copied, bare = [], [], 0
    skip = set(skip)
    for node in list(g.graph.node):
        if node.name in skip or len(node.input) < 2 or node.input[1] not in g.initializers:
            continue
        w = g.initializers[node.input[1]]
        if w.data_type != onnx.TensorProto.FLOAT:
            continue
        holder, index = node, 2
        if node.op_type == "Conv":
            n = w.dims[0] if len(w.dims) >= 3 else None
        elif node.op_type == "Gemm" and len(w.dims) == 2 and not node_attr(node, "transA", 0) \
                and float(node_attr(node, "beta", 1.0)) != 0.0:
            n = w.dims[0] if node_attr(node, "transB", 0) else w.dims[1]
        elif node.op_type == "MatMul" and len(w.dims) == 2:
            users = g.consumers.get(node.output[0], [])
            others = [t for t in users[0].input if t != node.output[0]] if len(users) == 1 else []
            if len(users) != 1 or users[0].op_type != "Add" or len(others) != 1 or others[0] not in g.initializers:
                bare += 1
                continue
            holder, index, n = users[0], list(users[0].input).index(others[0]), None
        else:
            continue
        if n is None and holder is node:
            continue
        bias = holder.input[index] if len(holder.input) > index else ""
        if not bias:
            name = add_initializer(g, fresh_name(g, f"{node.name or node.output[0]}.bias"), np.zeros(int(n), np.float32))
            while len(holder.input) <= index:
                holder.input.append("")
            holder.input[index] = name
            added.append(node.name)
            continue
        t = g.initializers.get(bias)
        if t is None or t.data_type != onnx.TensorProto.FLOAT or len(t.dims) != 1:
            continue
        readers = [c for c in g.consumers.get(bias, []) if c is not holder]
        if readers or bias in g.output_names:
            name = add_initializer(g, fresh_name(g, f"{bias}.{node.name or node.output[0]}"), g.weight(bias))
            holder.input[index] = name
            copied.append(node.name)
            g.consumers[bias] = readers
    if added or copied:
        g.refresh()
        log.info("biases: %s", "; ".join(part for part in (
            f"{len(added)} Conv/Gemm layers without a bias given a zero one ({', '.join(added[:4])}"
            f"{' ...' if len(added) > 4 else ''})" if added else "",
            f"{len(copied)} biases other nodes read too copied for their layer ({', '.join(copied[:4])}"
            f"{' ...' if len(copied) > 4 else ''})" if copied else "") if part))
    if bare and matmul_note:
        log.info("bias correction: %d MatMul layers without a bias Add are not corrected (an Add there would be "
                 "one more quantized output on some backends)", bare)
    return {"zero_biases": len(added), "copied_biases": len(copied), "matmuls_without_bias": bare}


def find_sites(g, places, plan, qmodel) -> list[Site]:
    producers = {o: n for n in qmodel.graph.node for o in n.output}
    qnodes = {n.name: n for n in qmodel.graph.node}
    sites = []
    for (name, index), wp in places.weights.items():
        if index != 1 or wp.tensor not in plan.weights:
            continue
        node = g.node_by_name[name]
        op = node.op_type
        bias = None
        if op in ("Gemm", "MatMul") and g.weight(wp.tensor).ndim != 2:
            continue
        if op in ("Conv", "Gemm") and len(node.input) > 2 and node.input[2] and g.is_constant(node.input[2]):
            if op == "Gemm" and (node_attr(node, "transA", 0) or node_attr(node, "beta", 1.0) == 0.0):
                continue
            bias = node.input[2]
        elif op == "MatMul":
            users = g.consumers.get(node.output[0], [])
            if len(users) == 1 and users[0].op_type == "Add":
                other = [t for t in users[0].input if t != node.output[0]]
                if len(other) == 1 and g.is_constant(other[0]):
                    bias = other[0]
        if bias is None or bias in plan.weights or g.weight(bias).ndim != 1:
            continue
        if len(g.consumers.get(bias, [])) != 1 or bias in g.output_names:
            continue  # a bias shared by two layers cannot take two corrections; a network output keeps its value
        qnode = qnodes.get(name)
        if qnode is None:
            continue
        xq = qnode.input[0]
        x = dq_source(producers, xq)
        pad = producers.get(xq)
        from dipoorlet.equalize import spatial_zero_pad

        if (x is None and op == "Conv" and pad is not None and pad.op_type == "Pad"
                and spatial_zero_pad(g, pad, g.weight(wp.tensor).ndim)):
            # Q/DQ -> Pad -> Conv (the Q/DQ goes before a Pad the backend folds into the Conv):
            # the means are taken before the Pad, unpadded, as they are for the Conv's own padding
            x = dq_source(producers, pad.input[0])
            if x is not None:
                xq = pad.input[0]
        if x is None:
            if xq != node.input[0]:
                continue  # the layer reads its Q/DQ through another node: the input mean is not comparable
            x = xq
        axis = 1 if op == "Conv" else -1
        sites.append(Site(name, op, wp.tensor, bias, x, xq, axis))
    return sites


def _append_channel_means(model, keys, sizes, types) -> tuple[str, dict]:
    """Append to ``model`` the per-channel float64 means of each ``(tensor, channel axis)`` in
    ``keys`` (axis 1, or -1: the last) over every other axis, concatenated into one output."""
    from onnx import TensorProto, helper, numpy_helper

    from dipoorlet.graph import opset_of

    opset = opset_of(model)
    graph = model.graph

    def const(name, value):
        graph.initializer.append(numpy_helper.from_array(np.asarray(value, np.int64), name))
        return name

    parts = []
    for k, ((t, axis), n) in enumerate(zip(keys, sizes)):
        base = f"__dipoorlet_bc_{k}"
        # [-1, n] (channels last) or [N, n, -1] (channels on axis 1), then the mean over the rest
        shape, axes = ([-1, n], [0]) if axis == -1 else ([0, n, -1], [0, 2])
        graph.node.append(helper.make_node("Cast", [t], [base + "_d"], name=base + "_d", to=TensorProto.DOUBLE))
        graph.node.append(helper.make_node("Reshape", [base + "_d", const(base + "_shape", shape)], [base + "_r"],
                                           name=base + "_r"))
        if opset >= 18:
            graph.node.append(helper.make_node("ReduceMean", [base + "_r", const(base + "_axes", axes)],
                                               [base + "_m"], name=base + "_m", keepdims=0))
        else:
            graph.node.append(helper.make_node("ReduceMean", [base + "_r"], [base + "_m"], name=base + "_m",
                                               axes=axes, keepdims=0))
        parts.append(base + "_m")
    out = "__dipoorlet_bc_means"
    graph.node.append(helper.make_node("Concat", parts, [out], name=out, axis=0))
    types = dict(types)
    types[out] = (TensorProto.DOUBLE, [sum(sizes)])
    return out, types


def _in_channels(g, site: Site) -> int:
    node = g.node_by_name[site.node]
    w = g.weight(site.weight)
    if site.op_type == "Conv":
        return w.shape[1] * int(node_attr(node, "group", 1))
    if site.op_type == "Gemm":
        return w.shape[1] if node_attr(node, "transB", 0) else w.shape[0]
    return w.shape[0]


def _weight_sums(w: np.ndarray, op: str, node) -> np.ndarray:
    """W_sum[o, c_local] in the layer's output x input-channel layout."""
    if op == "Conv":
        return w.reshape(w.shape[0], w.shape[1], -1).sum(axis=2)
    if op == "Gemm":
        return w if node_attr(node, "transB", 0) else w.T
    return w.T  # MatMul: x[..., K] @ W[K, N]


def _shift(sums_q: np.ndarray, sums: np.ndarray, mq: np.ndarray, m: np.ndarray, group: int) -> np.ndarray:
    out_ch, cin_g = sums.shape
    if group == 1:
        return sums_q @ mq - sums @ m
    per_group = out_ch // group
    delta = np.empty(out_ch)
    for gi in range(group):
        o = slice(gi * per_group, (gi + 1) * per_group)
        c = slice(gi * cin_g, (gi + 1) * cin_g)
        delta[o] = sums_q[o] @ mq[c] - sums[o] @ m[c]
    return delta


def _mean_pass(model, keys, types, data, indices, comm, device, what: str,
               initializers=None) -> tuple[dict, int]:
    """Per-channel means of each ``(tensor, channel axis)`` in ``keys`` over the samples
    ``indices`` (every process's together), and how many samples they came from; a sample on
    which a quantized activation or a mean is NaN is left out and named. ``initializers``: a
    graph whose initializers ``model`` (a lean copy) runs with."""
    sizes = [n for _, n in keys]
    keys = [k for k, _ in keys]
    out, types = _append_channel_means(model, keys, sizes, types)
    watch, types = append_watch(model, types, () if initializers is None else
                                {t.name for t in initializers.initializer})
    runner = Runner(model, [out] + ([watch] if watch else []), types=types, optimize=SIMULATE, device=device,
                    spin=True, initializers=initializers)
    # every rank allocates every sum, so the collective below lines up even on a rank with no
    # samples of its own
    acc = np.zeros(2 * sum(sizes), dtype=np.int64)     # high parts, then low parts
    n = sum(sizes)
    count, bad = 0, []
    for i in progress(indices, what, comm):
        feed = data.sample(i)
        got, _ = runner.run(feed, ranges=False)
        means = np.asarray(got[out], dtype=np.float64).reshape(-1)
        if means.size != n:
            raise ValueError(f"{what}: {means.size} channel means, expected {n}")
        if not (np.isfinite(means).all() and nan_free(got, watch)):
            # a NaN mean cast to int64 became -2^63 and swamped every other sample's sum (one fully
            # padded sequence in a torch TransformerEncoder moved a bias by 0.115 instead of 0.002)
            bad.append((i, sample_name(feed, i)))
            continue
        acc += _fixed_parts(means)
        count += 1
        if count % CARRY == 0:
            _carry(acc)
    acc = comm.allreduce_sum(acc)      # one collective for every sum
    warn_left_out(comm, bad, what, "a quantized activation is NaN on them")
    total = int(comm.allreduce_sum(np.array([count], dtype=np.int64))[0])
    if total == 0:
        return {}, 0
    sums = np.array([float(int(hi) * int(SPLIT) + int(lo)) for hi, lo in zip(acc[:n], acc[n:])], np.float64)
    return {k: part / (FIXED * total) for k, part in zip(keys, np.split(sums, np.cumsum(sizes)[:-1]))}, total


def _fixed_parts(means: np.ndarray) -> np.ndarray:
    """The means in fixed point (``rint(mean * FIXED)``, exact in float64 at any size) as two
    int64 parts, ``high * SPLIT + low`` with ``|low| <= SPLIT / 2``: summed apart (with a
    :func:`_carry` every CARRY samples), both stay exact: the low sums for any number of samples,
    the high ones (at most 2^42 a sample, for means of 2^62) for 2^21 samples at that size. One
    int64 sum wrapped around once a mean passed 2^39 / N (a mel power spectrum of 16-bit audio
    reaches 1e12: a corrected bias of garbage that undid the activation shift on trt; found by a
    hunt)."""
    q = np.rint(np.clip(means, -LIMIT, LIMIT) * FIXED)
    high = np.rint(q / SPLIT)
    low = q - high * SPLIT          # exact: both are multiples of q's ulp, |difference| <= 2^43
    return np.concatenate([high, low]).astype(np.int64)


def _carry(acc: np.ndarray) -> None:
    """Move whole multiples of SPLIT from the low sums (second half of ``acc``) into the high
    ones, exactly, so that the low sums stay below 2^44 * CARRY whatever the number of samples."""
    n = acc.size // 2
    c = (acc[n:] + (1 << 43)) >> 44
    acc[n:] -= c << 44
    acc[:n] += c


def _weight_terms(g, plan, s: Site):
    """(W_sum, Wq_sum, group, scale of the shift onto the bias) of a site, in float64."""
    node = g.node_by_name[s.node]
    w = g.weight(s.weight).astype(np.float64)
    qp = plan.weights[s.weight]
    wq = (quantize_array(w, qp).astype(np.float64) - _bcast(qp.zero_point, qp.axis, w.ndim)) \
        * _bcast(qp.scale, qp.axis, w.ndim)
    group = int(node_attr(node, "group", 1)) if s.op_type == "Conv" else 1
    # Gemm: y = alpha A B + beta C: the shift is alpha delta, C moves y by beta
    gain = node_attr(node, "alpha", 1.0) / node_attr(node, "beta", 1.0) if s.op_type == "Gemm" else 1.0
    return _weight_sums(w, s.op_type, node), _weight_sums(wq, s.op_type, node), group, gain


def correct(g, places, plan, data, indices, comm, device="cpu", alone: bool = False) -> dict:
    """Store corrected biases in ``plan.values``; returns a summary for the log and report.
    ``alone``: also store in ``plan.isolated`` each corrected layer's values where it is
    quantized alone (:func:`isolated`, one more pass), for the sensitivity analysis."""
    qmodel = insert_qdq(g, places, plan)
    sites = find_sites(g, places, plan, qmodel)
    plan.isolated = {}
    if not sites:
        return {"layers": 0}
    # keyed by (tensor, channel axis): one tensor may feed a Conv (channels on axis 1) and a
    # MatMul (channels last)
    keys = {}
    for s in sites:
        for t in (s.x, s.xq):
            keys[(t, s.channel_axis)] = _in_channels(g, s)
    means, total = _mean_pass(qmodel, sorted(keys.items()), g.types, data, indices, comm, device,
                              "bias correction")
    del qmodel      # not held through the pass below
    if total == 0:
        return {"layers": 0}
    shifts = []
    for s in sites:
        sums, sums_q, group, gain = _weight_terms(g, plan, s)
        m, mq = means[(s.x, s.channel_axis)], means[(s.xq, s.channel_axis)]
        if sums.shape[1] * group != m.size:
            continue
        delta = _shift(sums_q, sums, mq, m, group) * gain
        # from the float model's bias: delta is the whole mean shift W_q E[x_q] - W E[x], including
        # what an earlier compensation in plan.values (an activation shift) already covers
        bias = g.weight(s.bias).astype(np.float64)
        if bias.shape != delta.shape:
            continue
        plan.values[s.bias] = (bias - delta).astype(np.float32)
        plan.value_owners[s.bias] = s.node
        rms = float(np.sqrt(np.mean(bias ** 2)))
        peak = float(np.abs(delta).max())
        shifts.append((s.node, peak, peak / rms if rms > 0 else None))   # None: an all-zero bias
    shifts.sort(key=lambda r: -(r[2] if r[2] is not None else r[1]))
    # ordered by the shift relative to the bias it moves, which is what the figures show
    log.info("bias correction: %d layers corrected over %d samples; largest shifts (max |shift| / bias rms): %s",
             len(shifts), total, ", ".join(f"{n} {d:.3g}/{d / r:.3g}" if r else f"{n} {d:.3g} (zero bias)"
                                           for n, d, r in shifts[:5]))
    if alone:
        plan.isolated = isolated(g, plan, sites, data, indices, comm, device)
        log.info("bias correction: %d of those layers' corrections measured alone too, for the sensitivity "
                 "analysis", len(plan.isolated))
    return {"layers": len(shifts), "samples": total,
            "largest": [{"node": n, "max_abs_shift": d, "relative_to_bias_rms": r} for n, d, r in shifts[:10]]}


@dataclass
class Isolated:
    """The corrected bias of one layer quantized alone (every other layer float), as a run
    quantizing it alone would correct it; one per part of the layer quantized."""
    node: str
    both: np.ndarray      # its weight and its input quantized
    weight: np.ndarray    # its weight only
    act: np.ndarray       # its input only


def isolated(g, plan, sites: list[Site], data, indices, comm, device="cpu") -> dict:
    """Per bias of ``sites`` that :func:`correct` corrected, its :class:`Isolated` values, from
    one pass of the float model with each corrected layer's input Q/DQ on a side branch.

    :func:`correct` measures each layer's shift on the quantized model, where upstream errors
    push more of a layer's input past its grid's ends; that clipping shift is part of the
    correction. A sensitivity variant that quantizes one layer alone feeds it float inputs, and
    the whole-model correction then shifts its output by the difference (on the PP-OCRv4
    recognizer, p2o.Conv.2 alone read 10.1 dB at the logits where a run quantizing it alone
    reads 17.4 dB)."""
    from onnx import helper

    from dipoorlet.graph import copy_model
    from dipoorlet.qdq import act_chain, qdq_domain

    sites = [s for s in sites if plan.value_owners.get(s.bias) == s.node]
    # the float model without its initializers, which the session takes from g.model's own: a
    # whole copy had been the run's peak on a 302 MB MatMul stack (1.86 GB)
    model = copy_model(g.model, {t.name for t in g.model.graph.initializer})
    produced = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    keys, chain_of, read, chains = {}, {}, {}, []   # read: site node -> the key of its input as it reads it
    source = {}     # site node -> its input's name in the float model
    for s in sites:
        if s.x in produced:
            x = s.x
        elif s.xq in produced and s.xq in plan.activations:
            x = s.xq    # a network output quantized in place: its producer writes <t>_float in the Q/DQ model
        else:
            continue
        source[s.node] = x
        n = _in_channels(g, s)
        keys[(x, s.channel_axis)] = n
        if s.xq == s.x:
            read[s.node] = (x, s.channel_axis)
            continue
        if x not in chain_of:
            qp = plan.activations[x]
            q, extra, dq = act_chain(model.graph, x, f"__dipoorlet_iso_{len(chain_of)}", qp, qdq_domain(model, qp))
            chains += [q, *extra, dq]
            chain_of[x] = dq.output[0]
        read[s.node] = (chain_of[x], s.channel_axis)
        keys[read[s.node]] = n
    if not read:
        return {}
    model.graph.node.extend(chains)
    domains = {n.domain for n in chains} - {i.domain for i in model.opset_import} - {""}
    for d in domains:       # a Q/DQ domain the float model does not import (com.microsoft's 16-bit Q/DQ)
        model.opset_import.append(helper.make_opsetid(d, 1))
    means, total = _mean_pass(model, sorted(keys.items()), g.types, data, indices, comm, device,
                              "bias correction: layers alone", initializers=g.model.graph)
    out = {}
    if total == 0:
        return out
    for s in sites:
        if s.node not in read:
            continue
        sums, sums_q, group, gain = _weight_terms(g, plan, s)
        m, mq = means[(source[s.node], s.channel_axis)], means[read[s.node]]
        bias = g.weight(s.bias).astype(np.float64)
        if sums.shape[1] * group != m.size or bias.shape[0] != sums.shape[0]:
            continue
        value = lambda a, b: (bias - (_shift(a, sums, b, m, group) * gain)).astype(np.float32)
        out[s.bias] = Isolated(s.node, value(sums_q, mq), value(sums_q, m), value(sums, mq))
    return out


def _bcast(v: np.ndarray, axis: int | None, ndim: int) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    if axis is None or v.ndim == 0:
        return v
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)
