"""Quantization parameters and the plan that holds them.

A :class:`QParams` is a grid: ``q = clamp(round(x / scale) + zero_point, qmin, qmax)``. The plan
maps every activation tensor and weight that gets Q/DQ to its grid, plus the clip range it came
from (for deploy files and reports). Bit widths other than 8 are carried through: weights of
fewer bits are stored in int8 with values inside their narrower range; activations of fewer bits
get a Clip between Q and DQ so onnxruntime simulates the narrower grid exactly.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np

from dipoorlet.platform import TensorRule

MIN_SCALE = 1e-8


@dataclass
class QParams:
    scale: np.ndarray            # float32, () or [C]
    zero_point: np.ndarray       # int, same shape as scale
    bits: int
    signed: bool
    qmin: int
    qmax: int
    axis: int | None = None      # per-channel axis, None for per-tensor
    lo: np.ndarray = None        # the clip range the grid was made from
    hi: np.ndarray = None

    @property
    def amax(self) -> np.ndarray:
        return np.maximum(np.abs(self.lo), np.abs(self.hi))


def levels(rule: TensorRule) -> tuple[int, int]:
    """(qmin, qmax) of the integer grid for a rule."""
    b = rule.bits
    if rule.unsigned:
        return 0, 2**b - 1
    if rule.narrow_range and b <= 8:
        # a 16-bit grid keeps its full range: between Q and DQ the narrower one would need an
        # integer Clip, which onnxruntime has no int16 kernel for (one level of 65,536)
        return -(2 ** (b - 1) - 1), 2 ** (b - 1) - 1
    return -(2 ** (b - 1)), 2 ** (b - 1) - 1


def make_qparams(lo, hi, rule: TensorRule, axis: int | None = None) -> QParams:
    """The grid a rule gives to the clip range [lo, hi] (scalars or per-channel arrays).

    Power-of-two scales round *up* (``2^ceil(log2 s)``) so the grid still covers the clip range;
    the reference tool rounds to the nearest power, which can clip up to sqrt(2) of the range.
    """
    lo = np.minimum(np.asarray(lo, dtype=np.float64), 0.0)
    hi = np.maximum(np.asarray(hi, dtype=np.float64), 0.0)
    if rule.unsigned_nonnegative and rule.symmetric and np.all(lo >= 0):
        # TI-style: a tensor that is never negative uses the unsigned grid [0, 2^b - 1] with
        # zero point 0, one more bit of resolution than the signed symmetric grid.
        rule = dataclasses.replace(rule, symmetric=False, unsigned=True, unsigned_nonnegative=False)
    qmin, qmax = levels(rule)
    if rule.symmetric:
        amax = np.maximum(np.maximum(-lo, hi), MIN_SCALE)
        scale = amax / qmax  # the positive side: 127 levels for int8
        if rule.power_of_two:
            scale = 2.0 ** np.ceil(np.log2(scale))
        zp = np.zeros_like(scale)
    else:
        span = np.maximum(hi - lo, MIN_SCALE)
        scale = span / (qmax - qmin)
        if rule.power_of_two:
            scale = 2.0 ** np.ceil(np.log2(scale))
        # zero must be exactly representable (padding, ReLU zeros): integer zero point in range
        zp = np.clip(np.round(qmin - lo / scale), qmin, qmax)
    dtype = np.uint8 if not rule_signed(rule) else np.int8
    if rule.bits > 8:
        dtype = np.uint16 if not rule_signed(rule) else np.int16
    return QParams(scale=scale.astype(np.float32), zero_point=zp.astype(dtype), bits=rule.bits,
                   signed=rule_signed(rule), qmin=qmin, qmax=qmax, axis=axis,
                   lo=lo.astype(np.float32), hi=hi.astype(np.float32))


def rule_signed(rule: TensorRule) -> bool:
    return not rule.unsigned


def dequantize_array(q: np.ndarray, qp: QParams) -> np.ndarray:
    """Float64 values of integers ``q`` on ``qp``'s grid (as DequantizeLinear, in float64)."""
    scale, zp = np.asarray(qp.scale, np.float64), np.asarray(qp.zero_point, np.float64)
    if qp.axis is not None:
        shape = [1] * q.ndim
        shape[qp.axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return (q.astype(np.float64) - zp) * scale


def quantize_array(x: np.ndarray, qp: QParams) -> np.ndarray:
    """Integer values of ``x`` on ``qp``'s grid (round half to even, as ONNX QuantizeLinear)."""
    scale, zp = qp.scale.astype(np.float32), qp.zero_point.astype(np.float32)
    if qp.axis is not None:
        shape = [1] * x.ndim
        shape[qp.axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    # the division in float32 (as QuantizeLinear), the clip in float64: float32 cannot hold
    # 2^31 - 1, and its nearest value 2^31 would wrap to -2^31 in an int32 bias
    q = np.rint(x.astype(np.float32) / scale).astype(np.float64) + zp.astype(np.float64)
    return np.clip(q, qp.qmin, qp.qmax).astype(qp.zero_point.dtype)


@dataclass
class QuantPlan:
    """Every grid the quantized model will use, keyed by tensor name."""

    activations: dict[str, QParams] = field(default_factory=dict)
    weights: dict[str, QParams] = field(default_factory=dict)
    rules: dict = field(default_factory=dict)  # tensor -> the TensorRule its grid came from
    # Float constants the quantized model holds instead of the float model's (weight transforms
    # such as bias correction); the float model itself is never edited.
    values: dict = field(default_factory=dict)
    # constant -> the node whose quantization it compensates; applied only while that node's
    # weight is quantized (a layer kept float by --skip_layers/auto_skip keeps its own bias)
    value_owners: dict = field(default_factory=dict)
    # bias -> bias_correction.Isolated: its corrected values where its layer is quantized alone
    # (the isolated sensitivity analysis), where bias correction measured them
    isolated: dict = field(default_factory=dict)
    # activation -> the width --layer_bits asked for it (absent: the backend's or --a_bits)
    asked_bits: dict = field(default_factory=dict)
    # activation -> how many tensors share its grid (pass-through ops on backends that keep their
    # input's grid: share_scales), for the diagnosis
    shared: dict = field(default_factory=dict)
    # weight -> the channels (bool mask, or one bool per tensor) whose grid was widened so that an
    # int32 bias fits (pipeline.fit_biases): their grid is wider than their values
    widened: dict = field(default_factory=dict)
    # activation -> how a shared grid far wider than its own values leaves it (share_scales):
    # {"own": [lo, hi], "grid": [lo, hi], "steps": its span in the grid's steps, "tied_by": [nodes]}
    shared_losses: dict = field(default_factory=dict)
    # layers whose bias widened a weight other layers share (warned once)
    shared_widened: set = field(default_factory=set)

    def restricted(self, placement) -> "QuantPlan":
        """The grids ``placement`` still uses (after ``--auto_skip`` kept layers float), so side
        files never list a tensor the quantized model leaves float."""
        kept = {wp.tensor for wp in placement.weights.values()}
        nodes = {wp.node for wp in placement.weights.values()}
        values = {k: v for k, v in self.values.items()
                  if k not in self.value_owners or self.value_owners[k] in nodes}
        return QuantPlan(activations={t: q for t, q in self.activations.items() if t in placement.activations},
                         weights={t: q for t, q in self.weights.items() if t in kept},
                         rules=dict(self.rules), values=values,
                         value_owners={k: o for k, o in self.value_owners.items() if k in values},
                         widened={t: m for t, m in self.widened.items() if t in kept})


def bias_qparams(s_in: QParams, s_w: QParams) -> QParams:
    """int32 bias grid of a Conv/Gemm: scale = input scale x weight scale (per channel), zp 0."""
    scale = (s_in.scale.astype(np.float64) * s_w.scale.astype(np.float64)).astype(np.float32)
    scale = np.maximum(scale, np.float32(1e-30))
    zp = np.zeros(scale.shape, dtype=np.int32)
    lim = 2**31 - 1
    return QParams(scale=scale, zero_point=zp, bits=32, signed=True, qmin=-lim, qmax=lim,
                   axis=0 if scale.ndim else None, lo=-scale * lim, hi=scale * lim)


class UnionFind:
    """Disjoint sets over hashable keys: ``find`` a key's root, ``union`` two keys' sets;
    ``parent`` holds every key ever joined."""

    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        parent = self.parent
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])      # path halving
            x = parent[x]
        return x

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


SHARED_MIN_STEPS = 16   # a tensor whose values span fewer of its shared grid's steps is reported (plan.shared_losses)


def share_scales(graph, plan: QuantPlan, ops, quantized=None) -> int:
    """Give ops that only move values (MaxPool, Reshape, Concat…) one grid for input and output.

    Backends that run these ops in integers need that. Tensors tied together (a pass-through op's
    data input and output; a Concat's inputs and output) form groups (union-find, so chains and a
    tensor feeding two Concats end up in one group, whatever the node order); each group gets one
    grid covering the union of its members' ranges. Returns the number of groups formed.
    """
    from dipoorlet.placement import pass_through_chain

    uf = UnionFind()
    parent, find, union = uf.parent, uf.find, uf.union
    tying = []
    for node in graph.graph.node:
        if node.op_type not in ops or not node.output:
            continue
        out = node.output[0]
        if out not in plan.activations:
            # its output reaches a grid through ops that only move values (a detector's Concat ->
            # Transpose -> network output): the backend ties the Concat to that grid as well (its
            # inputs had kept their own grids and no loss was seen; found by a review)
            out = next((t for t in pass_through_chain(graph, out)[1:] if t in plan.activations), None)
            if out is None:
                continue
        ins = node.input if node.op_type == "Concat" else node.input[:1]
        joined = False
        for t in ins:
            if t in plan.activations:
                union(t, out)
                joined = True
        if joined:
            tying.append((node.name, out))
    groups: dict[str, list[str]] = {}
    for t in sorted(set(parent) | set(parent.values())):  # a group's root is only a value
        groups.setdefault(find(t), []).append(t)
    # the ops that tie each group, those the backend quantizes first (a Concat: --skip_layers on it
    # unties the group, on a Reshape it changes nothing; found by a review)
    group_nodes: dict[str, list[str]] = {}
    for name, out in tying:
        group_nodes.setdefault(find(out), []).append(name)
    if quantized is not None:
        quantized = set(quantized)
        group_nodes = {root: [n for n in names if n in quantized] or names for root, names in group_nodes.items()}
    for members in groups.values():
        rules = [plan.rules[t] for t in members if t in plan.rules]
        if len(members) < 2 or not rules:
            continue
        lo = min(float(np.min(plan.activations[t].lo)) for t in members)
        hi = max(float(np.max(plan.activations[t].hi)) for t in members)
        # mixed widths: a 16-bit member (--layer_bits NODE=a16) widens its group, else the
        # narrowest wins (a4 asked for one member holds for the grid they share)
        wide = [r for r in rules if r.bits > 8]
        rule = max(wide, key=lambda r: r.bits) if wide else min(rules, key=lambda r: r.bits)
        # members whose --layer_bits width does not stand, and members nobody asked for that the
        # group narrows below their own width (one widened to 16 bits is what a16 asks)
        lost = {t: plan.asked_bits[t] if t in plan.asked_bits else plan.rules[t].bits for t in members
                if t in plan.rules and (plan.asked_bits[t] != rule.bits if t in plan.asked_bits
                                        else plan.rules[t].bits > rule.bits)}
        if lost:
            named = sorted(lost)
            logging.getLogger("dipoorlet").warning(
                "--layer_bits: %s share one grid with %d other tensor(s) (pass-through ops keep their "
                "input's grid on this backend) and take its %d bits, not the %s %s; give every "
                "reader of the group the same width to change it",
                ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else ""),
                len(members) - len(lost), rule.bits, "/".join(str(b) for b in sorted(set(lost.values()))),
                "asked" if all(t in plan.asked_bits for t in lost) else "asked or their own")
        shared = make_qparams(lo, hi, rule)
        step = float(np.max(shared.scale))
        for t in members:
            # a member whose own values span few of the shared grid's steps keeps little of them:
            # a detector's Sigmoid scores (0..1) concatenated with its boxes (0..317) into one output
            # rounded to 0 on qnn, while the output's cosine read 0.9994 (found by a hunt)
            own_lo, own_hi = float(np.min(plan.activations[t].lo)), float(np.max(plan.activations[t].hi))
            span = own_hi - own_lo
            if 0 < span < SHARED_MIN_STEPS * step:
                plan.shared_losses[t] = {"own": [own_lo, own_hi], "grid": [lo, hi], "steps": span / step,
                                         "bits": int(rule.bits), "members": len(members),
                                         "tied_by": list(dict.fromkeys(group_nodes.get(find(t), [])))}
            plan.activations[t] = shared
            plan.rules[t] = rule
            plan.shared[t] = len(members)
    return sum(1 for m in groups.values() if len(m) > 1)
