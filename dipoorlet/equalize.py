"""Activation equalization: give every channel of a per-tensor-quantized activation the same range.

A per-tensor int8 grid is as fine as the widest channel allows: in a narrow network (MobileNetV3,
PP-LCNet) a channel 30x narrower than its neighbour keeps only a few levels. When the activation
sits between two linear layers and everything between them commutes with a positive per-channel
scale, the scale can be moved into the weights without changing what the network computes
(cross-layer equalization, Nagel et al. ICCV 2019; Meller et al. ICML 2019):

    y = Conv_A(x) -> ReLU -> ... -> Conv_B      becomes
    y = Conv_A'(x) -> ReLU -> ... -> Conv_B'    with A' = A / s (per output channel, bias too)
                                                and  B' = B * s (per input channel)

We choose ``s_c = r_c / max(r)`` from each channel's calibrated range ``r_c``, so every channel of
the activation spans the full grid. The original DFQ balances *weight* ranges instead, for
per-tensor weights; with per-channel weights (TensorRT, QNN) the producer's weights are
unaffected by the scale, a depthwise consumer's too, so the activation is what to equalize. A
channel is amplified at most ``MAX_GAIN`` times, so dead channels do not blow the weights up.

Between A and B the walk accepts ops that commute with a positive per-channel scale along axis 1:
Relu, LeakyRelu, PRelu, MaxPool, AveragePool, GlobalAveragePool, zero Pad, Identity, and a Mul
by a per-channel gate computed from an already compensated branch (the squeeze-and-excitation
block: ``x * HardSigmoid(Conv(GAP(x)))``). Every path from A must end in a Conv that can absorb
the scale (its weight used by it alone); a path into anything else (an Add, a Concat, HardSwish,
a network output) leaves the pair untouched.

Used only where the platform quantizes weights per channel and activations per tensor; the
ranges come from one extra pass over the calibration samples (per-channel max of |x|, reduced
inside the graph, merged across MPI processes with an exact MAX).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from onnx import helper, numpy_helper

from dipoorlet.progress import progress
from dipoorlet.runtime import Runner

log = logging.getLogger(__name__)

MAX_GAIN = 100.0
PASS_THROUGH = {"Relu", "LeakyRelu", "PRelu", "MaxPool", "AveragePool", "GlobalAveragePool", "Identity"}
SUFFIX = "__dpl_chmax"


@dataclass
class Chain:
    producer: str                                   # Conv A
    measure: str                                    # tensor whose per-channel range sets s
    absorbers: list[str] = field(default_factory=list)   # Convs B
    scaled: list[str] = field(default_factory=list)      # tensors that carry x / s


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _pad_is_zero(g, node) -> bool:
    if (_attr(node, "mode", b"constant") or b"constant") not in (b"constant", "constant"):
        return False
    if len(node.input) > 2 and node.input[2]:
        return g.is_constant(node.input[2]) and float(np.asarray(g.weight(node.input[2])).ravel()[0]) == 0.0
    return float(_attr(node, "value", 0.0) or 0.0) == 0.0


def _absorbs(g, node, tensor: str, channels: int) -> bool:
    """Conv reading ``tensor`` as its data input, with a weight no other node reads."""
    if node.op_type != "Conv" or node.input[0] != tensor or not g.is_constant(node.input[1]):
        return False
    if len(g.consumers.get(node.input[1], [])) != 1 or node.input[1] in g.output_names:
        return False
    w_shape = g.weight(node.input[1]).shape
    return w_shape[1] * int(_attr(node, "group", 1)) == channels


def find_chains(g) -> list[Chain]:
    chains = []
    claimed: set[str] = set()
    for a in g.topological_nodes():
        if a.op_type != "Conv" or len(a.input) < 3 or not a.input[2]:
            continue
        if not (g.is_constant(a.input[1]) and g.is_constant(a.input[2])):
            continue
        if len(g.consumers.get(a.input[1], [])) != 1 or len(g.consumers.get(a.input[2], [])) != 1:
            continue
        channels = g.weight(a.input[1]).shape[0]
        chain = _walk(g, a, channels)
        # a Conv may absorb one chain's scale and produce the next one's (its input and output
        # channels are scaled independently), but never absorb two
        if chain is None or claimed & set(chain.absorbers):
            continue
        claimed.update(chain.absorbers)
        chains.append(chain)
    return chains


def _walk(g, a, channels: int) -> Chain | None:
    start = a.output[0]
    chain = Chain(a.name, start)
    scaled = {start}
    frontier = [start]
    measured = False
    while frontier:
        t = frontier.pop()
        if t in g.output_names:
            return None
        users = g.consumers.get(t, [])
        if not users:
            return None
        for node in users:
            op = node.op_type
            if _absorbs(g, node, t, channels):
                if node.name not in chain.absorbers:
                    chain.absorbers.append(node.name)
                continue
            if op in PASS_THROUGH or (op == "Pad" and _pad_is_zero(g, node)):
                if node.input[0] != t:
                    return None  # e.g. PRelu's slope or Pad's pads computed from the scaled tensor
                out = node.output[0]
            elif op == "Mul":
                other = [x for x in node.input if x != t]
                if len(other) != 1 or other[0] in scaled or not _gate_ok(g, other[0], channels):
                    return None
                out = node.output[0]
            else:
                return None
            if out not in scaled:
                scaled.add(out)
                frontier.append(out)
                if not measured and op in ("Relu", "LeakyRelu", "PRelu"):
                    chain.measure, measured = out, True
    if not chain.absorbers:
        return None
    chain.scaled = sorted(scaled)
    return chain


def _gate_ok(g, tensor: str, channels: int) -> bool:
    """A per-channel gate [N, C, 1, ...] (or a scalar) that is not itself scaled."""
    shape = g.shape(tensor)
    if shape is None or len(shape) < 2:
        return shape is not None and all(d == 1 for d in shape)
    return shape[1] in (channels, 1) and all(d == 1 for d in shape[2:])


def channel_ranges(g, chains: list[Chain], data, indices, comm, device="cpu") -> dict[str, np.ndarray]:
    """Per-channel max |x| of every chain's measured tensor over the calibration samples."""
    model = g.model
    added = []
    outputs = []
    n_nodes = len(model.graph.node)
    n_inits = len(model.graph.initializer)
    try:
        for ch in chains:
            t = ch.measure
            rank = len(g.weight(g.node_by_name[ch.producer].input[1]).shape)
            axes = [0] + list(range(2, rank))
            abs_out, out = t + SUFFIX + "_abs", t + SUFFIX
            model.graph.node.append(helper.make_node("Abs", [t], [abs_out], name=abs_out))
            if g.opset >= 18:
                ax = t + SUFFIX + "_axes"
                model.graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), ax))
                model.graph.node.append(helper.make_node("ReduceMax", [abs_out, ax], [out], name=out, keepdims=0))
            else:
                model.graph.node.append(helper.make_node("ReduceMax", [abs_out], [out], name=out, axes=axes,
                                                         keepdims=0))
            outputs.append(out)
            added.append(ch.measure)
        runner = Runner(model, outputs, types=g.types, device=device)
    finally:
        del model.graph.node[n_nodes:]
        del model.graph.initializer[n_inits:]
    acc = {t: None for t in added}
    for i in progress(indices, "equalization: channel ranges", comm):
        got, _ = runner.run(data.sample(i), ranges=False)
        for t, out in zip(added, outputs):
            v = np.asarray(got[out], dtype=np.float64)
            acc[t] = v if acc[t] is None else np.maximum(acc[t], v)
    names = [t for t in added]
    sizes = [len(g.weight(g.node_by_name[ch.producer].input[1])) for ch in chains]
    flat = np.concatenate([acc[t] if acc[t] is not None else np.zeros(n) for t, n in zip(names, sizes)])
    flat = comm.allreduce_max(flat)
    out, offset = {}, 0
    for t, n in zip(names, sizes):
        out[t] = flat[offset:offset + n]
        offset += n
    return out


def apply(g, chains: list[Chain], ranges: dict[str, np.ndarray]) -> list[dict]:
    """Rescale every chain in ``g`` (in place); returns one summary row per chain changed."""
    rows = []
    for ch in chains:
        r = ranges.get(ch.measure)
        if r is None or not np.all(np.isfinite(r)) or r.max() <= 0:
            continue
        s = _scales(g, ch, r)
        a = g.node_by_name[ch.producer]
        w, b = g.weight(a.input[1]).astype(np.float64), g.weight(a.input[2]).astype(np.float64)
        _set(g, a.input[1], w / s.reshape((-1,) + (1,) * (w.ndim - 1)))
        _set(g, a.input[2], b / s)
        for name in ch.absorbers:
            node = g.node_by_name[name]
            wb = g.weight(node.input[1]).astype(np.float64)
            group = int(_attr(node, "group", 1))
            cin_g = wb.shape[1]
            per_group = wb.shape[0] // group
            scaled = wb.copy()
            for gi in range(group):
                o = slice(gi * per_group, (gi + 1) * per_group)
                sg = s[gi * cin_g:(gi + 1) * cin_g]
                scaled[o] = wb[o] * sg.reshape((1, -1) + (1,) * (wb.ndim - 2))
            _set(g, node.input[1], scaled)
        rows.append({"producer": ch.producer, "absorbers": list(ch.absorbers), "tensor": ch.measure,
                     "range_spread_before": float(r.max() / max(float(np.min(r[r > 0])) if np.any(r > 0) else 1.0, 1e-30)),
                     "max_gain": float(1.0 / s.min())})
    if rows:
        g.refresh()
    return rows


ALPHA = 0.5


def _scales(g, ch: Chain, r: np.ndarray) -> np.ndarray:
    """Per-channel divisor ``s`` (largest 1, smallest 1/MAX_GAIN).

    A depthwise consumer holds one weight grid per channel, so scaling its input channels costs
    it nothing: ``s = r`` equalizes the activation fully. A dense consumer has one grid per
    *output* channel shared by all input channels; shrinking channel c's weights by ``s_c``
    moves the activation's range disparity into them. There ``s = r^a / w^(1-a)`` with ``w_c``
    the consumers' largest |weight| on input channel c balances the two (a = 0.5 gives the
    activation channel and its weight column the same relative range, as in SmoothQuant).
    """
    w = np.zeros_like(r)
    dense = False
    for name in ch.absorbers:
        node = g.node_by_name[name]
        wb = np.abs(g.weight(node.input[1]))
        group = int(_attr(node, "group", 1))
        if wb.shape[1] == 1 and group == r.size:
            continue  # depthwise
        dense = True
        cin_g = wb.shape[1]
        per_group = wb.shape[0] // group
        for gi in range(group):
            cols = wb[gi * per_group:(gi + 1) * per_group].reshape(per_group, cin_g, -1).max(axis=(0, 2))
            w[gi * cin_g:(gi + 1) * cin_g] = np.maximum(w[gi * cin_g:(gi + 1) * cin_g], cols)
    r = np.maximum(r, r.max() * 1e-12)
    if dense:
        s = r ** ALPHA / np.maximum(w, w.max() * 1e-6 + 1e-30) ** (1 - ALPHA)
    else:
        s = r
    return np.maximum(s / s.max(), 1.0 / MAX_GAIN)


def _set(g, name: str, value: np.ndarray) -> None:
    t = g.initializers[name]
    t.CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))


def equalize(g, data, indices, comm, device="cpu") -> list[dict]:
    """Find, measure and apply; returns the summary rows (empty when nothing qualifies)."""
    chains = [c for c in find_chains(g) if all(n in g.initializers for n in _weights(g, c))]
    if not chains:
        return []
    ranges = channel_ranges(g, chains, data, indices, comm, device)
    rows = apply(g, chains, ranges)
    log.info("equalization: %d Conv pairs rescaled (%s)", len(rows),
             ", ".join(f"{r['producer']} -> {'/'.join(r['absorbers'])} spread {r['range_spread_before']:.1f}x"
                       for r in rows[:5]) + (" ..." if len(rows) > 5 else ""))
    return rows


def _weights(g, chain: Chain) -> list[str]:
    a = g.node_by_name[chain.producer]
    return [a.input[1], a.input[2]] + [g.node_by_name[n].input[1] for n in chain.absorbers]
