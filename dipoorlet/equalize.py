"""Activation equalization: give every channel of a per-tensor-quantized activation the same range.

A per-tensor int8 grid is as fine as the widest channel allows: in a narrow network (MobileNetV3,
PP-LCNet) a channel 30x narrower than its neighbour keeps only a few levels. When the activation
sits between two linear layers and everything between them commutes with a positive per-channel
scale, the scale can be moved into the weights without changing what the network computes
(cross-layer equalization, Nagel et al. ICCV 2019; Meller et al. ICML 2019):

    y = Conv_A(x) -> ReLU -> ... -> Conv_B      becomes
    y = Conv_A'(x) -> ReLU -> ... -> Conv_B'    with A' = A / s (per output channel, bias too)
                                                and  B' = B * s (per input channel)

How much to move is chosen per pair (:func:`choose_scales`): a SmoothQuant-style balance
``s = r^a / w^(1-a)`` (r the channel ranges, w the consumers' weights), a in ``ALPHAS``, whichever
minimizes the estimated rounding noise at the consumers' outputs. With per-channel weights
(TensorRT, QNN) the producer's weights are unaffected by the scale and so is a depthwise
consumer; a dense consumer's per-output-channel grid pays for shrinking some input channels.
Full equalization (a = 1) is not a candidate: the estimate sizes the activation grid by the full
range, while the range methods clip below it, so it overrates the activation's noise and picked
a = 1 where it cost the weights more than it saved (measured on the PP-OCRv4 detector's images
with text: weight-only int8 probability-map cosine 0.985 with a = 1 allowed, 0.994 without;
W8A8 0.976 -> 0.986 and mask IoU 0.940 -> 0.970; recognizer CER 0.186 -> 0.172, classifier
agreement 95.8% -> 96.0%). The original DFQ equalizes weight ranges
only, which is what per-tensor weights need. A pair is
changed only when the estimate at least halves the noise, and no channel is amplified more than
``MAX_GAIN`` times, so dead channels do not blow the weights up; a channel that never fired on the
samples keeps its scale (it may fire at deployment).

A may also be an elementwise affine pair instead of a Conv, ``Mul`` by a constant optionally followed
by ``Add`` of a constant (scalar or per channel; PP-LCNetV3's learnable affine block after each
HardSwish): both constants become per-channel vectors divided by ``s``. Only where the platform
leaves such a Mul float (trt, atlas, magicmind), as for MatMul smoothing.

Between A and B the walk accepts ops that commute with a positive per-channel scale along axis 1:
Relu, LeakyRelu, PRelu, MaxPool, AveragePool, GlobalAveragePool, zero Pad, Identity, and a Mul
by a per-channel gate computed from an already compensated branch (the squeeze-and-excitation
block: ``x * HardSigmoid(Conv(GAP(x)))``). Every path from A must end in a Conv that can absorb
the scale (its weight used by it alone); a path into anything else (an Add, a Concat, HardSwish,
a network output) leaves the pair untouched.

Where the platform quantizes weights per tensor (snpe, rv, stpu, ti), the same pairs are rescaled
by :func:`equalize_weights` instead: the weights' own channel ranges, data-free, as DFQ does.

Used where the platform quantizes weights per channel; the ranges come from one extra pass over
:func:`default_samples` (or ``--eq_samples``) calibration samples spread evenly over the N (per-channel max of
|x| and mean of x^2, reduced inside the graph, merged across MPI processes with an exact MAX).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from dipoorlet.graph import add_initializer, drop_unused_initializers, fresh_name, insert_before, node_attr
from dipoorlet.data import sample_name
from dipoorlet.layer_errors import warn_left_out
from dipoorlet.progress import progress
from dipoorlet.runtime import Runner

log = logging.getLogger(__name__)

MAX_GAIN = 100.0
DEAD = 1e-4     # equalize_weights: a channel whose weight range is below this share of the layer's is left alone
MAX_SAMPLES = 64         # the statistics pass reads at most this many samples by default


def default_samples(n: int) -> int:
    """Samples the statistics pass reads by default: all N up to ``MAX_SAMPLES``.

    Fewer were tried (session 3, N = 32) and cost accuracy where scales meet outliers: with 16
    samples MiniLM's embedding cosine fell from 0.995 to 0.985 under ``-A minmax`` and the VAD's
    agreement from 98.1% to 96.6% under ``-A hist``, for 0.2-0.5 float passes saved.
    ``--eq_samples`` trades the other way where time matters more."""
    return min(n, MAX_SAMPLES)
MIN_GAIN = 10 ** 0.3   # 3 dB
PASS_THROUGH = {"Relu", "LeakyRelu", "PRelu", "MaxPool", "AveragePool", "GlobalAveragePool", "Identity"}
SUFFIX = "__dpl_chmax"


@dataclass
class Chain:
    producer: str                                   # Conv A (or the last node of an affine pair)
    measure: str                                    # tensor whose per-channel range sets s
    absorbers: list[str] = field(default_factory=list)   # Convs B
    # an elementwise affine producer instead of a Conv: [Mul by a constant, optional Add of a
    # constant] (PP-LCNetV3's learnable affine block after HardSwish); both constants take 1/s
    affine: list[str] = field(default_factory=list)
    channels: int = 0
    scaled: list[str] = field(default_factory=list)   # tensors the rescaling divides by s on axis 1
    scale: np.ndarray | None = None                   # s, once applied


def _fp32(g, *names: str) -> bool:
    return all(n in g.initializers and g.initializers[n].data_type == TensorProto.FLOAT for n in names)


def _pad_is_zero(g, node) -> bool:
    if (node_attr(node, "mode", b"constant") or b"constant") not in (b"constant", "constant"):
        return False
    if len(node.input) > 2 and node.input[2]:
        return g.is_constant(node.input[2]) and float(np.asarray(g.weight(node.input[2])).ravel()[0]) == 0.0
    return float(node_attr(node, "value", 0.0) or 0.0) == 0.0


def spatial_zero_pad(g, pad, rank: int | None = None) -> bool:
    """A Pad of zeros on the spatial axes only (constant mode; constant pads, axes and value):
    it commutes with a per-channel scale. A Pad on the channel axis moves channels (pads
    [0, 1, ...] with [0, -1, ...] shifts channel c to c + 1), on the batch axis adds samples."""
    if not _pad_is_zero(g, pad) or len(pad.input) < 2 or not g.is_constant(pad.input[1]):
        return False
    pads = np.asarray(g.weight(pad.input[1])).reshape(-1)
    if len(pad.input) > 3 and pad.input[3]:
        if not g.is_constant(pad.input[3]):
            return False
        axes = [int(a) for a in np.asarray(g.weight(pad.input[3])).reshape(-1)]
        if any(a < 0 for a in axes):
            if rank is None:
                return False
            axes = [a % rank for a in axes]
    else:
        axes = list(range(pads.size // 2))
    if pads.size != 2 * len(axes):
        return False
    return all(a >= 2 or (pads[k] == 0 and pads[k + len(axes)] == 0) for k, a in enumerate(axes))


def _absorbs(g, node, tensor: str, channels: int) -> bool:
    """Conv reading ``tensor`` as its data input, with a weight no other node reads."""
    if node.op_type != "Conv" or node.input[0] != tensor or not g.is_constant(node.input[1]):
        return False
    if len(g.consumers.get(node.input[1], [])) != 1 or node.input[1] in g.output_names or not _fp32(g, node.input[1]):
        return False
    w_shape = g.weight(node.input[1]).shape
    return w_shape[1] * int(node_attr(node, "group", 1)) == channels


def find_chains(g, affine: bool = False) -> list[Chain]:
    """Conv pairs (and, with ``affine``, Mul/Add-by-constant -> Conv pairs) that can be rescaled."""
    chains = []
    claimed: set[str] = set()
    for a in g.topological_nodes():
        if affine and a.op_type == "Mul":
            chain = _affine_chain(g, a)
            if chain is not None and not claimed & set(chain.absorbers):
                claimed.update(chain.absorbers)
                chains.append(chain)
            continue
        if a.op_type != "Conv" or len(a.input) < 3 or not a.input[2]:
            continue
        if not (g.is_constant(a.input[1]) and g.is_constant(a.input[2])) or not _fp32(g, a.input[1], a.input[2]):
            continue  # float32 only: a Conv's input has its weight's type
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


def _affine_const(g, node, channels: int, rank: int):
    """(constant input, data input) of a Mul/Add whose constant is a float32 scalar or one value
    per channel along axis 1 of a rank-``rank`` tensor, else None."""
    if len(node.input) != 2:
        return None
    consts = [i for i in node.input if g.is_constant(i)]
    if len(consts) != 1 or consts[0] not in g.initializers or not _fp32(g, consts[0]):
        return None
    c = consts[0]
    data = node.input[1] if node.input[0] == c else node.input[0]
    shape = tuple(g.weight(c).shape)
    if len(shape) > rank:
        return None
    padded = (1,) * (rank - len(shape)) + shape
    size = int(np.prod(shape)) if shape else 1
    if size == 1 or (size == channels and padded[1] == channels):
        return c, data
    return None


def _affine_chain(g, mul) -> Chain | None:
    """Mul(x, a) [-> Add(., b)] -> ops that commute with a channel scale -> Convs: the constants
    take 1/s as a per-channel vector, so the scale needs no Conv producer."""
    out = mul.output[0]
    shape = g.shape(out)
    if shape is None or len(shape) < 3 or not isinstance(shape[1], int) or shape[1] <= 1:
        return None
    channels, rank = shape[1], len(shape)
    m = _affine_const(g, mul, channels, rank)
    if m is None or g.is_constant(m[1]) or not g.is_float(m[1]):
        return None
    nodes = [mul]
    users = g.consumers.get(out, [])
    if len(users) == 1 and users[0].op_type == "Add" and out not in g.output_names:
        add = users[0]
        b = _affine_const(g, add, channels, rank)
        if b is not None and b[1] == out:
            nodes.append(add)
    last = nodes[-1]
    chain = _walk(g, last, channels)
    if chain is None:
        return None
    chain.affine = [n.name for n in nodes]
    chain.channels = channels
    if len(nodes) > 1:
        chain.scaled = sorted(set(chain.scaled) | {mul.output[0]})   # between the Mul and the Add
    return chain


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
            if op in PASS_THROUGH or (op == "Pad" and spatial_zero_pad(g, node, len(g.shape(t) or []) or None)):
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


def channel_stats(g, items: list[tuple[str, list[int] | None, int]], data, indices, comm, device="cpu",
                  label="equalization: channel ranges", tensors=(), extra: dict | None = None,
                  ranges_only=(), subset: set | None = None) -> dict[str, tuple]:
    """Per-channel ``(max |x|, peak per-sample mean of x^2)`` of each ``(tensor, reduced axes,
    channels)`` over the calibration samples, reduced inside the graph; both merge across
    processes with an exact MAX. ``axes=None``: the channels are the last axis, whatever the rank.

    With ``extra`` (a dict), the same pass also fills ``extra["channel_minmax"][t] = (lo, hi)``
    per channel of every item and ``extra["tensors"][t]`` (a :class:`~dipoorlet.stats.TensorStats`
    range, merged across processes) for every tensor in ``tensors``: calibration ranges, for the
    one-pass ``-A minmax`` (:func:`equalize_and_calibrate`). Items in ``ranges_only`` get no
    mean square (0). ``subset``: only the samples in it feed the returned ``(max |x|, mean
    square)``; the signed ranges and ``tensors`` see every sample.

    The per-channel vectors of all items leave onnxruntime concatenated, four outputs whatever
    the number of items, so a sample costs a few numpy operations, not a few per item (on a
    small network with ~65 items that loop cost as much as the inference)."""
    from dipoorlet.stats import TensorStats

    model = g.model
    types = dict(g.types)
    n_nodes = len(model.graph.node)
    n_inits = len(model.graph.initializer)
    ranges_only = set(ranges_only)
    parts: dict[str, list[str]] = {"hi": [], "lo": [], "ss": [], "size": []}
    outs = {k: f"{SUFFIX}_all_{k}" for k in parts}

    def const(name, value):
        model.graph.initializer.append(numpy_helper.from_array(value, name))
        return name

    def node(op, inputs, out, **attrs):
        model.graph.node.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def build(full: bool):
        """The pass's session; ``full=False``: the signed per-channel ranges only (no mean
        squares, no sizes), for the samples outside ``subset``, which feed nothing else
        (onnxruntime runs every node of a graph whatever is fetched, so they get their own)."""
        for k in parts:
            parts[k] = []
        try:
            for t, axes, n in items:
                src = t
                if axes is None:  # channels on the last axis, rank unknown: view as [-1, n]
                    src = node("Reshape", [t, const(f"{t}{SUFFIX}_2d_shape", np.array([-1, n], np.int64))],
                               f"{t}{SUFFIX}_2d")
                    axes = [0]
                as_float = (types.get(t) or (TensorProto.FLOAT,))[0] not in (TensorProto.FLOAT, 0)

                def reduce(kind, op):
                    out = f"{t}{SUFFIX}_{kind}"
                    if g.opset >= 18:
                        node(op, [src, const(f"{out}_axes", np.array(axes, np.int64))], out, keepdims=0)
                    else:
                        node(op, [src], out, axes=axes, keepdims=0)
                    return node("Cast", [out], out + "_f32", to=TensorProto.FLOAT) if as_float else out

                zeros = np.zeros(n, np.float32)
                parts["hi"].append(reduce("hi", "ReduceMax"))
                # reductions straight from the tensor: no full-size |x| or x*x temporaries. A Relu
                # output's minimum is 0 (most measured tensors are one): no ReduceMin for it.
                producer = g.producer.get(t)
                nonneg = producer is not None and producer.op_type == "Relu"
                parts["lo"].append(const(f"{t}{SUFFIX}_lo0", zeros) if nonneg else reduce("lo", "ReduceMin"))
                if not full:
                    continue
                if t in ranges_only:
                    parts["ss"].append(const(f"{t}{SUFFIX}_ss0", zeros))
                    parts["size"].append(const(f"{t}{SUFFIX}_size0", np.array([n], np.int64)))
                else:
                    parts["ss"].append(reduce("ss", "ReduceSumSquare"))
                    # measured per sample: a shape the model declares may be stale
                    size = node("Size", [src], f"{t}{SUFFIX}_size")
                    parts["size"].append(node("Reshape", [size, const(f"{t}{SUFFIX}_one", np.array([1], np.int64))],
                                              f"{t}{SUFFIX}_size1"))
            fetched = [k for k in parts if parts[k]]
            if items:
                for k in fetched:
                    node("Concat", parts[k], outs[k], axis=0)
                if full:
                    types[outs["size"]] = (TensorProto.INT64, [len(items)])
            return Runner(model, [outs[k] for k in fetched] if items else [], reduce_minmax=list(tensors),
                          types=types, device=device, spin=True, nan_safe=True)
        finally:
            del model.graph.node[n_nodes:]
            del model.graph.initializer[n_inits:]

    # the mean squares serve the samples in ``subset`` alone (64 of -N's samples by default with
    # -A minmax's one pass): the others run without them
    # (every statistic is a max or a min: the order of the samples does not matter, so the two
    # groups run one after the other, one session at a time)
    rest = [i for i in indices if subset is not None and i not in subset] if items else []
    groups = [(list(indices) if not rest else [i for i in indices if i in subset], True), (rest, False)]
    ns = np.array([n for _, _, n in items], np.int64)
    total = int(ns.sum())
    r_acc, ms_acc = np.zeros(total), np.zeros(total)
    hi_acc, nlo_acc = np.full(total, -np.inf), np.full(total, -np.inf)
    per_tensor = {t: TensorStats() for t in tensors}

    def run_all():
        for group, full in groups:
            if not group:
                continue
            runner = build(full)
            for i in group:
                feed = data.sample(i)
                yield i, sample_name(feed, i), runner.run(feed, tensors=bool(items), ranges=bool(per_tensor))
            del runner

    passes = run_all()
    bad = []
    for _ in progress(indices, label, comm):
        i, name, (got, ranges) = next(passes)
        for t, (lo, hi) in ranges.items():
            per_tensor[t].minmax.update(lo, hi)
        if not items:
            continue
        hi, lo = (np.asarray(got[outs[k]], np.float64).reshape(-1) for k in ("hi", "lo"))
        # np.fmax: a channel a NaN (a fully masked softmax row, Sqrt of a negative) made NaN on
        # this sample is left out of its statistics for this sample. np.maximum had made it NaN
        # for good: equalization and smoothing then passed the layer over without a word, and
        # under MPI only where rank 0 held the sample (MPI's MAX drops another rank's NaN)
        nan = np.isnan(hi).any() or np.isnan(lo).any()
        if subset is None or i in subset:
            ss = np.asarray(got[outs["ss"]], np.float64).reshape(-1)
            size = np.asarray(got[outs["size"]], np.float64).reshape(-1)
            per_channel = np.maximum(np.repeat(size / ns, ns), 1.0)
            r_acc = np.fmax(r_acc, np.fmax(hi, -lo))
            ms_acc = np.fmax(ms_acc, ss / per_channel)
            nan = nan or np.isnan(ss).any()
        hi_acc, nlo_acc = np.fmax(hi_acc, hi), np.fmax(nlo_acc, -lo)
        if nan:
            bad.append((i, name))
    if items:
        warn_left_out(comm, bad, label, "", left="sample(s) hold NaN in measured activations; those channels' NaN "
                                               "are left out of the statistics")
    signed = [hi_acc, nlo_acc] if extra is not None else []
    flat = comm.allreduce_max(np.concatenate([r_acc, ms_acc] + signed)) if items else np.zeros(0)
    result, offset = {}, 0
    if extra is not None:
        extra["channel_minmax"] = {}
        extra["tensors"] = comm.merge_stats(per_tensor) if per_tensor else {}
    for t, _, n in items:
        result[t] = (flat[offset:offset + n], flat[total + offset:total + offset + n])
        if extra is not None:
            extra["channel_minmax"][t] = (-flat[3 * total + offset:3 * total + offset + n],
                                          flat[2 * total + offset:2 * total + offset + n])
        offset += n
    return result


def _chain_items(g, chains: list[Chain]) -> list[tuple[str, list[int], int]]:
    items = []
    for ch in chains:
        if ch.affine:
            rank = len(g.shape(ch.measure) or g.shape(g.node_by_name[ch.affine[0]].output[0]))
            items.append((ch.measure, [0] + list(range(2, rank)), ch.channels))
            continue
        w = g.weight(g.node_by_name[ch.producer].input[1])
        items.append((ch.measure, [0] + list(range(2, w.ndim)), w.shape[0]))
    return items


def _smooth_items(g, targets: dict[str, list[str]]) -> list[tuple[str, list[int] | None, int]]:
    """channel_stats items of smoothing targets: a MatMul input's channels are its last axis,
    a Conv input's axis 1."""
    items = []
    for x, names in targets.items():
        node = g.node_by_name[names[0]]
        w = g.weight(node.input[1])
        if node.op_type in ("MatMul", "Gemm"):
            items.append((x, None, w.shape[in_axis(g, node)]))
        else:
            rank = len(g.shape(x))
            items.append((x, [0] + list(range(2, rank)), w.shape[1] * int(node_attr(node, "group", 1))))
    return items


def apply(g, chains: list[Chain], stats: dict[str, tuple]) -> list[dict]:
    """Rescale every chain in ``g`` (in place); returns one summary row per chain changed."""
    rows = []
    for ch in chains:
        if ch.measure not in stats:
            continue
        r, ms = stats[ch.measure]
        if not (np.all(np.isfinite(r)) and np.all(np.isfinite(ms))) or r.max() <= 0:
            continue
        s, alpha, gain = choose_scales(g, ch, r, ms)
        if s is None:
            continue
        ch.scale = s
        if ch.affine:
            _scale_affine(g, ch, s)
        else:
            a = g.node_by_name[ch.producer]
            w, b = g.weight(a.input[1]).astype(np.float64), g.weight(a.input[2]).astype(np.float64)
            _set(g, a.input[1], w / s.reshape((-1,) + (1,) * (w.ndim - 1)))
            _set(g, a.input[2], b / s)
        for name in ch.absorbers:
            node = g.node_by_name[name]
            _set(g, node.input[1], _scale_inputs(g.weight(node.input[1]).astype(np.float64), node, s))
        positive = r[r > 0]
        rows.append({"producer": ch.producer, "absorbers": list(ch.absorbers), "tensor": ch.measure,
                     "range_spread_before": float(r.max() / positive.min()) if positive.size else 1.0,
                     "alpha": alpha, "max_gain": float(1.0 / s.min()),
                     "estimated_noise_reduction_db": gain})
    if rows:
        drop_unused_initializers(g.graph)
        g.refresh()
    return rows


def _scale_affine(g, ch: Chain, s: np.ndarray) -> None:
    """Divide the constants of an affine producer by ``s`` along axis 1: each becomes a fresh
    per-channel initializer (the old one may be shared)."""
    rank = len(g.shape(g.node_by_name[ch.affine[0]].output[0]))
    for name in ch.affine:
        node = g.node_by_name[name]
        i = next(k for k, x in enumerate(node.input) if g.is_constant(x))
        v = np.asarray(g.weight(node.input[i]), np.float64).reshape(-1)
        per_channel = (v if v.size == s.size else np.full(s.size, v[0])) / s
        node.input[i] = add_initializer(g, fresh_name(g, f"{node.input[i]}_equalized"),
                                        per_channel.astype(np.float32).reshape((-1,) + (1,) * (rank - 2)))


def _scale_inputs(w: np.ndarray, node, s: np.ndarray) -> np.ndarray:
    """A Conv weight [O, C/group, k...] with input channel c multiplied by s[c]."""
    return _scale_weight(w, int(node_attr(node, "group", 1)), s)


def _scale_weight(w: np.ndarray, group: int, s: np.ndarray) -> np.ndarray:
    cin_g, per_group = w.shape[1], w.shape[0] // group
    out = w.copy()
    for gi in range(group):
        o = slice(gi * per_group, (gi + 1) * per_group)
        out[o] = w[o] * s[gi * cin_g:(gi + 1) * cin_g].reshape((1, -1) + (1,) * (w.ndim - 2))
    return out


ALPHAS = (0.75, 0.5, 0.25)    # no 1.0: see the module docstring


def choose_scales(g, ch: Chain, r: np.ndarray, ms: np.ndarray):
    """The per-channel divisor ``s`` (largest 1, none below 1/MAX_GAIN) that minimizes the
    estimated quantization noise at the consumers' outputs, or None when no candidate beats
    leaving the chain alone.

    Candidates: ``s = r^a / w^(1-a)`` for a in ALPHAS (``r_c`` the channel's range, ``w_c`` the
    consumers' largest |weight| on input channel c; a = 0.5 balances activation and weight
    column as SmoothQuant does, larger a leans to the activation). Estimate, under the usual
    uniform-noise model with the grid spanning the range: the activation's rounding noise
    ``(max_c r_c/s_c / qmax)^2 / 12`` reaches each output through the scaled weights, so it costs
    ``sum_c ||W[:, c]||^2 s_c^2`` times that; each output channel's weight grid is set by its
    largest scaled weight and its noise meets the scaled input's power ``E[x_c^2] / s_c^2``. A
    depthwise consumer's weight grid is per channel, so only the first term depends on s there.
    """
    layers = [(g.weight(g.node_by_name[n].input[1]).astype(np.float64), int(node_attr(g.node_by_name[n], "group", 1)))
              for n in ch.absorbers]
    return choose_layer_scales(layers, r, ms)


def choose_layer_scales(layers: list[tuple[np.ndarray, int]], r: np.ndarray, ms: np.ndarray):
    """:func:`choose_scales` for consumers given as (weight in Conv layout [O, C/group, taps...],
    group)."""
    w_in = np.zeros_like(r)   # largest |weight| on each input channel, over dense consumers
    for w, group in layers:
        if not (w.shape[1] == 1 and group == r.size):   # depthwise: a grid per channel, unaffected by s
            w_in = np.maximum(w_in, _input_ranges(w, group, r.size))
    # A channel calibration never saw fire (all zero after a Relu, or so small that even MAX_GAIN
    # times its range stays under half an int8 step of the largest channel's range: it rounds to
    # zero either way) keeps its scale: the floor of 1/MAX_GAIN multiplied it by 100, and where it
    # fired at deployment it ran 40x past the grid (openwakeword's "alexa" head on trt: both
    # held-out positives missed, 0.998 -> 0.020; found by a hunt; a range of 1e-10 instead of 0,
    # a review). Its column's weights stay as they are and the estimate counts them.
    dead = r * (2 * 127 * MAX_GAIN) < r.max()
    r = np.maximum(r, r.max() * 1e-12)
    ms = np.maximum(ms, 0.0)

    # Per layer and group, precomputed once: M[o, c] = max over taps |w[o, c, :]| and the column
    # energies sum over o and taps of w[o, c, :]^2; scaling input channel c by s_c scales both.
    parts = []
    col2 = np.zeros_like(r)
    for w, group in layers:
        cin_g, per_group = w.shape[1], w.shape[0] // group
        w3 = w.reshape(w.shape[0], cin_g, -1)
        for gi in range(group):
            block = w3[gi * per_group:(gi + 1) * per_group]
            sl = slice(gi * cin_g, (gi + 1) * cin_g)
            col2[sl] += (block ** 2).sum(axis=(0, 2))
            parts.append((np.abs(block).max(axis=2), sl, block.shape[2]))

    def noise(s):
        act_step = float(np.max(r / s)) / 127.0
        total = act_step ** 2 / 12.0 * float((col2 * s ** 2).sum())
        for m, sl, taps in parts:
            w_step = (m * s[sl]).max(axis=1) / 127.0
            total += float((w_step ** 2 / 12.0).sum() * (ms[sl] / s[sl] ** 2).sum() * taps)
        return total

    base = noise(np.ones_like(r))
    best, best_alpha, best_noise = None, None, base
    w_floor = np.maximum(w_in, w_in.max() * 1e-6 + 1e-30)
    for alpha in ALPHAS:
        s = r ** alpha / (w_floor ** (1 - alpha) if w_in.max() > 0 else 1.0)
        s = np.maximum(s / s.max(), 1.0 / MAX_GAIN)
        s[dead] = 1.0
        n = noise(s)
        if n < best_noise:
            best, best_alpha, best_noise = s, alpha, n
    # The estimate ignores clipping and how layers interact; act only on a clear gain (the
    # activation noise at least halved), not on a marginal one.
    if best is not None and best_noise > base / MIN_GAIN:
        best = None
    if best is None:
        return None, None, 0.0
    return best, best_alpha, float(10 * np.log10(base / best_noise)) if best_noise > 0 else 0.0


def _set(g, name: str, value: np.ndarray) -> None:
    t = g.initializers[name]
    t.CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))


def _plan(g, smooth: bool, skip, fold: bool = False) -> tuple[list[Chain], dict[str, list[str]], list]:
    """The pairs, the smoothing targets and the channel_stats items measuring them. ``fold``
    (with ``smooth`` off): the MatMul/Gemm inputs whose scale can go into the op that makes them
    (:func:`fold_producer`) are smoothing targets still."""
    found = find_chains(g, affine=smooth)
    chains = [c for c in found if all(n in g.initializers for n in _weights(g, c))]
    # Conv inputs equalization cannot reach (a HardSwish, an Add, a Concat in between) are
    # smoothed instead; a Conv a pair already serves is left to the pair.
    absorbing = {n for c in found for n in c.absorbers}
    if smooth:
        targets = smooth_targets(g, exclude=absorbing | set(skip))
    elif fold:
        targets = {x: names for x, names in matmul_targets(g).items()
                   if not set(names) & set(skip) and fold_producer(g, x, names) is not None}
    else:
        targets = {}
    chain_items = _chain_items(g, chains)
    measured = {t for t, _, _ in chain_items}
    targets = {x: m for x, m in targets.items() if x not in measured}
    return chains, targets, chain_items + _smooth_items(g, targets)


def _apply_all(g, chains, targets, stats, data, indices, comm, device, folding: bool = False) -> list[dict]:
    rows = apply(g, chains, stats) if chains else []
    if rows:
        log.info("equalization: %d Conv pairs rescaled (%s)", len(rows),
                 ", ".join(f"{r['producer']} -> {'/'.join(r['absorbers'])} spread {r['range_spread_before']:.1f}x"
                           for r in rows[:5]) + (" ..." if len(rows) > 5 else ""))
    if targets:
        rows += smooth_inputs(g, data, indices, comm, device, targets=targets, stats=stats, folding=folding)
    return rows


def equalize(g, data, indices, comm, device="cpu", smooth: bool = True, skip=(), fold: bool = False) -> list[dict]:
    """Find, measure and apply; returns the summary rows (empty when nothing qualifies).
    ``smooth``: also rescale MatMul inputs, which inserts a Mul (for backends that do not
    quantize a Mul's own inputs, where it runs fused in float).

    One statistics pass serves both: a pair's scaled tensors reach no MatMul and no Conv but its
    own absorbers (the walk refuses the pair otherwise, and absorbers are never smoothed), so
    rescaling the pairs leaves every smoothing target's statistics as measured."""
    fold = fold and not smooth
    chains, targets, items = _plan(g, smooth, skip, fold=fold)
    if not items:
        return []
    stats = channel_stats(g, items, data, indices, comm, device)
    return _apply_all(g, chains, targets, stats, data, indices, comm, device, folding=fold)


def equalize_and_calibrate(g, data, indices, comm, device="cpu", smooth: bool = True, skip=(),
                           candidates=(), eq_subset: set | None = None) -> tuple[list[dict], dict]:
    """:func:`equalize` and the min/max calibration in one pass over ``indices`` (all N samples);
    the equalization statistics read the samples in ``eq_subset`` (None: all), the ones
    :func:`equalize` would read.

    ``candidates``: tensors the platform may quantize, as placed on the graph before the
    transforms. The pass measures every equalization item per channel (signed range too), every
    candidate a pair rescales per channel, and every other candidate per tensor. After the
    transforms, a rescaled tensor ``t / s`` (a pair's, along axis 1) or a smoothed copy ``x * f``
    (the Mul smoothing inserts) has the range ``[min_c lo_c / s_c, max_c hi_c / s_c]``: exact, as
    ``s > 0`` per channel. Returns the rows and ``{tensor: TensorStats}`` for the transformed
    graph: every candidate, rescaled or not, and every smoothed copy. A tensor a later placement
    needs that is not among them is measured by the caller.

    Saves the calibration pass for ``-A minmax`` (the histogram methods need each channel's
    distribution, which per-tensor histograms of the untransformed tensor do not give). The
    equalization statistics come from the same samples as with two passes, so both give the
    same transforms.
    """
    from dipoorlet.stats import TensorStats

    chains, targets, items = _plan(g, smooth, skip)
    itemized = {t for t, _, _ in items}
    candidates = [t for t in dict.fromkeys(candidates)]
    on_chain = {t: ch for ch in chains for t in ch.scaled}
    extra_items, per_tensor = [], []
    for t in candidates:
        if t in itemized:
            continue
        ch = on_chain.get(t)
        shape = g.shape(t)
        if ch is not None and shape is not None and len(shape) >= 2:
            extra_items.append((t, [0] + list(range(2, len(shape))), ch.channels or _chain_items(g, [ch])[0][2]))
        else:
            per_tensor.append(t)
    if not items and not extra_items and not per_tensor:
        return [], {}
    extra: dict = {}
    stats = channel_stats(g, items + extra_items, data, indices, comm, device,
                          label="equalization and calibration (one pass)", tensors=per_tensor, extra=extra,
                          ranges_only={t for t, _, _ in extra_items},
                          subset=eq_subset)
    eq_stats = {t: stats[t] for t, _, _ in items}
    before = {n.output[0] for n in g.graph.node if n.op_type == "Mul"}
    rows = _apply_all(g, chains, targets, eq_stats, data, indices, comm, device) if items else []
    ch_minmax = extra["channel_minmax"]
    # a rescaled tensor measured only per tensor (rank unknown) is left to the caller
    out = {t: st for t, st in extra["tensors"].items()
           if t not in on_chain or on_chain[t].scale is None}
    n = int(comm.allreduce_sum(np.array([float(len(indices))]))[0])

    def ranged(lo, hi) -> TensorStats:
        st = TensorStats()
        st.minmax.update(float(np.min(lo)), float(np.max(hi)), n)
        return st

    for t in candidates:
        if t in ch_minmax:
            lo, hi = ch_minmax[t]
            ch = on_chain.get(t)
            if ch is not None and ch.scale is not None:
                lo, hi = lo / ch.scale, hi / ch.scale
            out[t] = ranged(lo, hi)
    # the Muls smoothing inserted: x_smooth = x * f, per channel (f > 0)
    for node in g.graph.node:
        if node.op_type != "Mul" or node.output[0] in before or node.input[0] not in ch_minmax:
            continue
        f = np.asarray(g.weight(node.input[1]), np.float32).reshape(-1)
        lo, hi = (np.asarray(v, np.float32) for v in ch_minmax[node.input[0]])
        out[node.output[0]] = ranged(lo * f, hi * f)
    return rows, out


def _input_ranges(w: np.ndarray, group: int, channels: int) -> np.ndarray:
    """max |w| over everything that meets each input channel of a Conv weight [O, C/group, k...]."""
    cin_g, per_group = w.shape[1], w.shape[0] // group
    out = np.zeros(channels)
    for gi in range(group):
        block = np.abs(w[gi * per_group:(gi + 1) * per_group]).reshape(per_group, cin_g, -1)
        out[gi * cin_g:(gi + 1) * cin_g] = block.max(axis=(0, 2))
    return out


WEIGHT_ITERATIONS = 20


def equalize_weights(g) -> list[dict]:
    """Data-free cross-layer equalization of weight ranges (Nagel et al., "Data-Free Quantization
    Through Weight Equalization and Bias Correction", ICCV 2019), for backends that quantize
    weights per tensor (snpe, rv, stpu, ti).

    One grid per weight tensor serves every channel: where a Conv's output channels (or the next
    Conv's input channels, a depthwise Conv's above all) span ranges 100x apart, most channels
    keep a few levels. For each Conv pair (the same walk as :func:`find_chains`: ReLU, pooling,
    zero Pad and SE gates in between) the scale ``s_c = sqrt(r1_c / r2_c)``, ``r1_c`` the
    producer's range on output channel c and ``r2_c`` the consumers' on input channel c, gives
    both the range ``sqrt(r1_c r2_c)``: the product of the two layers' precisions is the best one
    scale can do. A Conv that closes one pair and opens the next (MobileNet's depthwise) takes
    part in both, so the pairs are equalized in turns until the scales settle (at most
    ``WEIGHT_ITERATIONS`` sweeps). Scales stay within [1/MAX_GAIN, MAX_GAIN]. No data: the
    calibration that follows measures the rescaled activations.

    A pair with a member kept float (``--skip_layers``) is rescaled all the same: the float layer
    computes the same function on rescaled weights, and its quantized partner keeps the gain
    (leaving such pairs alone made skipping a layer lower the output: 0.99987 -> 0.99977 on a
    two-Conv ti model)."""
    chains = [c for c in find_chains(g, affine=False)
              if all(n in g.initializers for n in _weights(g, c))]
    if not chains:
        return []
    total = {id(c): None for c in chains}
    spread0 = {}
    for _ in range(WEIGHT_ITERATIONS):
        moved = 0.0
        for ch in chains:
            a = g.node_by_name[ch.producer]
            wa = g.weight(a.input[1]).astype(np.float64)
            r1 = np.abs(wa).reshape(wa.shape[0], -1).max(axis=1)
            r2 = np.zeros_like(r1)
            for name in ch.absorbers:
                node = g.node_by_name[name]
                r2 = np.maximum(r2, _input_ranges(g.weight(node.input[1]).astype(np.float64),
                                                  int(node_attr(node, "group", 1)), r1.size))
            if id(ch) not in spread0:
                prod = r1 * r2
                spread0[id(ch)] = float(prod.max() / prod[prod > 0].min()) if (prod > 0).any() else 1.0
            b = g.weight(a.input[2]).astype(np.float64)
            s = np.ones_like(r1)
            # a dead or pruned channel (weights all but 0 beside the layer's others) is left alone:
            # sqrt(r1 / r2) would multiply its bias, all the channel carries, by up to MAX_GAIN each
            # sweep into the one activation grid (1e-8 weights: output cosine 0 on snpe)
            ok = (r1 > DEAD * r1.max()) & (r2 > DEAD * r2.max())
            s[ok] = np.sqrt(r1[ok] / r2[ok])
            # the gain over all sweeps stays within [1/MAX_GAIN, MAX_GAIN] (each sweep's alone did:
            # 20 sweeps could take a channel 100^20 away)
            done = np.ones_like(r1) if total[id(ch)] is None else total[id(ch)]
            s = np.clip(s * done, 1.0 / MAX_GAIN, MAX_GAIN) / done
            if np.allclose(s, 1.0, rtol=1e-4):
                continue
            moved = max(moved, float(np.abs(np.log(s)).max()))
            _set(g, a.input[1], wa / s.reshape((-1,) + (1,) * (wa.ndim - 1)))
            _set(g, a.input[2], b / s)
            for name in ch.absorbers:
                node = g.node_by_name[name]
                _set(g, node.input[1], _scale_inputs(g.weight(node.input[1]).astype(np.float64), node, s))
            total[id(ch)] = s if total[id(ch)] is None else total[id(ch)] * s
        if moved < 1e-3:
            break
    rows = []
    for ch in chains:
        s = total[id(ch)]
        if s is None:
            continue
        rows.append({"producer": ch.producer, "absorbers": list(ch.absorbers), "tensor": ch.measure,
                     "method": "weight ranges (data-free)", "range_spread_before": spread0[id(ch)],
                     "max_gain": float(max(s.max(), 1.0 / s.min()))})
    if rows:
        drop_unused_initializers(g.graph)
        g.refresh()
        log.info("weight equalization: %d Conv pairs rescaled (%s)", len(rows),
                 ", ".join(f"{r['producer']} -> {'/'.join(r['absorbers'])}" for r in rows[:5])
                 + (" ..." if len(rows) > 5 else ""))
    return rows


def _weights(g, chain: Chain) -> list[str]:
    absorbers = [g.node_by_name[n].input[1] for n in chain.absorbers]
    if chain.affine:
        return [x for n in chain.affine for x in g.node_by_name[n].input if g.is_constant(x)] + absorbers
    a = g.node_by_name[chain.producer]
    return [a.input[1], a.input[2]] + absorbers


# ----------------------------------------------------------------------------------- MatMul inputs
def in_axis(g, node) -> int:
    """The input-channel axis of a MatMul's or Gemm's 2-D weight: 0, or 1 for a Gemm with transB."""
    return 1 if node.op_type == "Gemm" and node_attr(node, "transB", 0) else 0


def matmul_targets(g) -> dict[str, list[str]]:
    """Activation tensor -> the MatMuls that read it as input 0 with a constant 2-D weight of
    their own (transformer projections), and the Gemms that do without transA (``nn.Linear`` on
    a 2-D input, GPT-2's Conv1D as torch's dynamo exporter writes them: a Gemm had been left
    unsmoothed, 6.6x the error of the same block exported as MatMul and Add; found by a hunt);
    both put the input's channels on its last axis."""
    out: dict[str, list[str]] = {}
    for node in g.topological_nodes():
        if node.op_type == "MatMul" and len(node.input) == 2:
            x, w = node.input
        elif node.op_type == "Gemm" and len(node.input) >= 2 and not node_attr(node, "transA", 0):
            x, w = node.input[0], node.input[1]
        else:
            continue
        if not g.is_constant(w) or g.is_constant(x) or not g.is_float(x) or w not in g.initializers:
            continue
        if len(g.consumers.get(w, [])) != 1 or w in g.output_names or not _fp32(g, w):
            continue
        shape = g.shape(x)
        wshape = g.weight(w).shape
        if len(wshape) != 2 or (shape is not None and (len(shape) < 2 or
                                                       shape[-1] not in (None, wshape[in_axis(g, node)]))):
            continue
        out.setdefault(x, []).append(node.name)
    return out


def conv_targets(g, exclude=()) -> dict[str, list[str]]:
    """Activation tensor -> the Convs (not in ``exclude``) that read it as input 0 with a
    constant fp32 weight of their own; channels on axis 1, rank known."""
    out: dict[str, list[str]] = {}
    for node in g.topological_nodes():
        if node.op_type != "Conv" or node.name in exclude or len(node.input) < 2:
            continue
        x, w = node.input[0], node.input[1]
        if not g.is_constant(w) or g.is_constant(x) or not g.is_float(x) or w not in g.initializers:
            continue
        if len(g.consumers.get(w, [])) != 1 or w in g.output_names or not _fp32(g, w):
            continue
        if x in g.producer and g.producer[x].op_type == "Pad":
            continue   # a Mul between Pad and Conv would break the backend's Pad-into-Conv fusion
        shape, wshape = g.shape(x), g.weight(w).shape
        channels = wshape[1] * int(node_attr(node, "group", 1))
        if shape is None or len(shape) != len(wshape) or shape[1] not in (None, channels):
            continue
        out.setdefault(x, []).append(node.name)
    return out


def smooth_targets(g, exclude=()) -> dict[str, list[str]]:
    """MatMul and Conv inputs that smoothing may rescale (a tensor read by both kinds keeps to
    its MatMuls)."""
    out = matmul_targets(g)
    for x, names in conv_targets(g, exclude).items():
        out.setdefault(x, names)
    return out


def fold_producer(g, x: str, names) -> tuple | None:
    """Where smoothing's scale on MatMul/Gemm input ``x`` can go into the op that makes it
    instead of a Mul inserted before the layers: ``(node, [constants to divide by s])`` for a Mul
    by a per-channel constant vector (an RMSNorm's gamma) or a LayerNormalization over the last
    axis (its scale and bias), whose constants nothing else reads and whose output only the
    layers ``names`` read; None otherwise. For backends with per-channel weights that quantize a
    Mul's inputs (qnn, ort), where an inserted Mul would be one more quantized tensor and smoothing was off, so a
    pre-norm transformer's outlier channels (gamma) kept their per-tensor grids (a Llama on qnn:
    held-out cosine 0.985; folded by hand 0.991; found by a hunt)."""
    node = g.producer.get(x)
    # a Shape (torch's exports read the normed tensor's shape for the attention's reshapes) or a
    # Size reads no value
    readers = {c.name for c in g.consumers.get(x, []) if c.op_type not in ("Shape", "Size")}
    if node is None or x in g.output_names or readers != set(names):
        return None
    k = g.weight(g.node_by_name[names[0]].input[1]).shape[in_axis(g, g.node_by_name[names[0]])]
    if node.op_type == "Mul" and len(node.input) == 2:
        consts = [i for i in node.input if g.is_constant(i)]
        if len(consts) != 1 or node.input[0] == node.input[1]:
            return None
        c = consts[0]
        # a scalar or a tensor of another layout is not one value per channel
        return (node, [c]) if _own_vector(g, c, k) else None
    if node.op_type == "LayerNormalization" and not any(node.output[1:]):
        if int(node_attr(node, "axis", -1)) not in (-1, len(g.shape(x) or []) - 1):
            return None
        consts = [i for i in node.input[1:3] if i]
        return (node, consts) if consts and all(_own_vector(g, c, k) for c in consts) else None
    return None


def _own_vector(g, c: str, k: int) -> bool:
    """``c`` is a float32 initializer of k values ([k], or [1, ..., k]) that only one node reads."""
    if c not in g.initializers or not _fp32(g, c) or len(g.consumers.get(c, [])) != 1 or c in g.output_names:
        return False
    shape = g.weight(c).shape
    return bool(shape) and shape[-1] == k and int(np.prod(shape)) == k


def smooth_matmuls(g, data, indices, comm, device="cpu", targets=None, stats=None) -> list[dict]:
    """:func:`smooth_inputs` over the MatMul inputs only."""
    return smooth_inputs(g, data, indices, comm, device, matmul_targets(g) if targets is None else targets, stats)


def smooth_inputs(g, data, indices, comm, device="cpu", targets=None, stats=None, folding: bool = False) -> list[dict]:
    """SmoothQuant-style scaling of MatMul inputs (Xiao et al., ICML 2023), as TensorRT Model
    Optimizer's ``pre_quant_scale``: ``X @ W == (X / s) @ (s W)``. The division is a Mul by a
    constant vector inserted before the MatMuls (TensorRT fuses it with the quantize step); the
    MatMuls' weights take ``s`` on their rows. Transformer activations carry a few outlier
    channels (LayerNorm outputs, GELU outputs) that set a per-tensor grid far too coarse for the
    rest; the weights, quantized per output column, absorb the scale at a smaller cost.
    ``s`` is chosen as for Conv pairs (:func:`choose_layer_scales`), only where it at least halves
    the estimated noise.

    The same holds for a Conv input that equalization cannot reach because the op that makes it
    does not commute with a channel scale (HardSwish in MobileNetV3 and PP-LCNet, a residual Add,
    a Concat): ``conv(x, W) == conv(x / s, W * s)`` along W's input channels, with the Mul by a
    ``[C, 1, 1]`` constant. For a depthwise Conv the weight grid is per channel, so only the
    activation side of the estimate counts."""
    targets = smooth_targets(g) if targets is None else targets
    if not targets:
        return []
    if stats is None:
        stats = channel_stats(g, _smooth_items(g, targets), data, indices, comm, device)
    rows = []
    for x, names in targets.items():
        if x not in stats:
            continue
        r, ms = stats[x]
        if not (np.all(np.isfinite(r)) and np.all(np.isfinite(ms))) or r.max() <= 0:
            continue
        nodes = [g.node_by_name[n] for n in names]
        weights = [g.weight(n.input[1]).astype(np.float64) for n in nodes]
        conv = nodes[0].op_type == "Conv"
        if conv:
            layers = [(w, int(node_attr(n, "group", 1))) for n, w in zip(nodes, weights)]
        else:       # [N, K, 1]: Conv layout (a Gemm with transB holds its weight as [N, K])
            layers = [((w if in_axis(g, n) else w.T)[:, :, None], 1) for n, w in zip(nodes, weights)]
        s, alpha, gain = choose_layer_scales(layers, r, ms)
        if s is None:
            continue
        for (w, group), n, w0 in zip(layers, nodes, weights):
            _set(g, n.input[1], _scale_weight(w0, group, s) if conv else w0 * np.expand_dims(s, 1 - in_axis(g, n)))
        fold = fold_producer(g, x, names) if folding and not conv else None
        if fold is not None:
            for c in fold[1]:
                v = g.weight(c).astype(np.float64)
                _set(g, c, (v / s.reshape(v.shape)))
        else:
            factor = (1.0 / s).astype(np.float32)
            if conv:
                factor = factor.reshape((-1,) + (1,) * (len(weights[0].shape) - 2))
            insert_before(g, "Mul", x, factor, "smooth", "factor", nodes)   # one refresh() after the loop
        positive = r[r > 0]
        rows.append({"tensor": x, "matmuls" if not conv else "convs": list(names), "alpha": alpha,
                     **({"folded_into": fold[0].name} if fold is not None else {}),
                     "max_gain": float(1.0 / s.min()),
                     "range_spread_before": float(r.max() / positive.min()) if positive.size else 1.0,
                     "estimated_noise_reduction_db": gain})
    if rows:
        g.refresh()
        log.info("smoothing: %d MatMul/Conv inputs rescaled (%s)", len(rows),
                 ", ".join(f"{r['tensor']} alpha {r['alpha']}" for r in rows[:4]) + (" ..." if len(rows) > 4 else ""))
    return rows
