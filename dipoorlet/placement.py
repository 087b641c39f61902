"""Where Q/DQ go: the platform's rules applied to the graph, with a reason for each decision.

Op handlers only *mark* what to quantize (as onnxruntime's quantizer does); :mod:`dipoorlet.qdq`
inserts everything in one place. Each activation point is a tensor plus the exact node inputs
that will read its dequantized copy, so a tensor that also feeds a float op keeps its float
edge there. Every node of the graph gets a :class:`Decision` whose reason the report shows
("Relu: not a quantized op on trt", "skipped by --skip_layers").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import onnx

from dipoorlet.graph import INTEGER_TYPES, Graph, node_attr
from dipoorlet.platform import Platform

log = logging.getLogger(__name__)


@dataclass
class ActPoint:
    tensor: str
    uses: list[tuple[str, int]] = field(default_factory=list)  # (node name, input index)
    output: bool = False  # a network output quantized in place (the chip's output is integer)
    owners: list[str] = field(default_factory=list)  # the quantized node each use serves


@dataclass
class WeightPoint:
    tensor: str
    node: str
    index: int
    axis: int | None


@dataclass
class Decision:
    node: str
    op_type: str
    quantized: bool
    reason: str


@dataclass
class Placement:
    activations: dict[str, ActPoint] = field(default_factory=dict)
    weights: dict[tuple[str, int], WeightPoint] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    output_owners: dict[str, str] = field(default_factory=dict)  # quantized output -> producer
    positions: set = field(default_factory=set)     # float tensors computed from positions or sizes

    @property
    def quantized_nodes(self) -> list[str]:
        return [d.node for d in self.decisions if d.quantized]

    def add_act(self, tensor: str, node: str, index: int, owner: str | None = None) -> None:
        point = self.activations.setdefault(tensor, ActPoint(tensor))
        point.uses.append((node, index))
        point.owners.append(owner or node)

    def restrict(self, keep, acts: bool = True, weights: bool = True) -> "Placement":
        """The same placement with only the nodes in ``keep`` quantized (others float)."""
        keep = set(keep)
        out = Placement(decisions=[d if not d.quantized or d.node in keep else
                                   Decision(d.node, d.op_type, False, "kept in float (mixed precision)")
                                   for d in self.decisions])
        if acts:
            for t, p in self.activations.items():
                pairs = [(u, o) for u, o in zip(p.uses, p.owners) if o in keep]
                as_output = p.output and self.output_owners.get(t) in keep
                if pairs or as_output:
                    out.activations[t] = ActPoint(t, [u for u, _ in pairs], as_output, [o for _, o in pairs])
        out.output_owners = dict(self.output_owners)
        out.positions = self.positions
        if weights:
            out.weights = {k: w for k, w in self.weights.items() if w.node in keep}
        return out


# ops that move a tensor's values without changing any: a grid after them is the grid before them
PASS_THROUGH = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


def pass_through_chain(g: Graph, tensor: str) -> list[str]:
    """``tensor`` and the tensors it flows into through single-reader :data:`PASS_THROUGH` ops
    (Conv -> PRelu -> Transpose -> Flatten -> MatMul: the PRelu's output, the Transpose's, the
    Flatten's), stopping at a network output. A Shape reading a tensor reads no values (torch's
    ``x.view(x.size(0), -1)``) and does not count as a reader."""
    chain = [tensor]
    while True:
        readers = [n for n in g.consumers.get(chain[-1], []) if n.op_type != "Shape"]
        if chain[-1] in g.output_names or len(readers) != 1 or readers[0].op_type not in PASS_THROUGH \
                or not readers[0].output or readers[0].input[0] != chain[-1]:
            return chain
        chain.append(readers[0].output[0])


def weight_axis(g: Graph, node, index: int, per_channel: bool, batched: bool = True) -> int | None:
    """The output-channel axis of a weight, or None for per-tensor (``batched=False``: also for
    a MatMul weight of rank > 2)."""
    if not per_channel:
        return None
    shape = g.shape(node.input[index]) or []
    rank = len(shape)
    if node.op_type == "Conv":
        return 0 if rank >= 2 else None
    if node.op_type == "ConvTranspose":
        # [C_in, C_out/group, k...]: axis 1 holds one group's output channels only, so a grouped
        # one gets a per-tensor grid (a per-channel one would have C_out/group scales, which no
        # backend's per-output-channel format can express)
        return 1 if rank >= 2 and int(node_attr(node, "group", 1) or 1) == 1 else None
    if node.op_type == "Gemm" and index == 1:
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    if node.op_type == "MatMul" and index == 1:
        return rank - 1 if rank == 2 or (rank > 2 and batched) else None
    # MatMul(W, x) or Gemm(W, x), the weight on the left (torch.matmul(W, x) exports): its output
    # channels are W's rows, which lie along the per-channel axis of no backend's MatMul or
    # FullyConnected format, so it gets one per-tensor grid
    return None


def _fusable_producer(g: Graph, tensor: str, platform: Platform, depth: int = 0) -> bool:
    """Whether ``tensor`` comes (only) from an op the backend fuses an Add into.

    A bias ``Add`` with a constant after a MatMul counts as part of that MatMul (Gemm = MatMul
    + bias), so the transformer pattern MatMul → Add(bias) → Add(residual) is seen through.
    """
    prod = g.producer.get(tensor)
    if prod is None or len(g.consumers[tensor]) != 1 or tensor in g.output_names:
        return False
    if prod.op_type in platform.residual_add_producers:
        return True
    if prod.op_type == "Add" and depth == 0:
        consts = [i for i in prod.input if g.is_constant(i)]
        others = [i for i in prod.input if not g.is_constant(i)]
        return len(consts) == 1 and len(others) == 1 and _fusable_producer(g, others[0], platform, 1)
    return False


def _feeds_layernorm(g: Graph, node, platform: Platform) -> bool:
    """Whether an Add's output goes into an op of ``residual_add_float_before`` (LayerNorm),
    counting a LayerNorm the exporter decomposed: ReduceMean and Sub both reading the Add."""
    before = platform.residual_add_float_before
    if not before:
        return False
    ops = {c.op_type for c in g.consumers.get(node.output[0], [])}
    if ops & before:
        return True
    return "LayerNormalization" in before and {"ReduceMean", "Sub"} <= ops


def _fused_input(g: Graph, node, act_inputs: list[int], platform: Platform) -> int | None:
    """Index of an Add input that TensorRT-like backends fuse into its producer, if any."""
    if node.op_type != "Add" or len(act_inputs) < 2 or not platform.residual_add_producers:
        return None
    for i in act_inputs:
        if _fusable_producer(g, node.input[i], platform):
            return i
    return None


def _through_pad(g: Graph, node, index: int, platform: Platform) -> tuple[str, int, str] | None:
    """(tensor, index, node name) of the Pad input to quantize instead of a Pad→Conv edge."""
    if node.op_type not in platform.pad_into:
        return None
    prod = g.producer.get(node.input[index])
    if prod is None or prod.op_type != "Pad" or len(g.consumers[node.input[index]]) != 1:
        return None
    return prod.input[0], 0, prod.name


def _fused_activation_input(g: Graph, node, index: int, platform: Platform) -> bool:
    """An activation (Relu, Clip…) reading a Conv/Gemm/Add output that the backend fuses with it:
    the tensor between them never exists on the chip, so it gets no Q/DQ."""
    if node.op_type not in platform.fused_activations or index != 0:
        return False
    tensor = node.input[0]
    prod = g.producer.get(tensor)
    return (prod is not None and prod.op_type in platform.activation_producers
            and len(g.consumers[tensor]) == 1 and tensor not in g.output_names)


def _one_axis_per_weight(plan: Placement) -> None:
    """A weight tensor gets one grid: where the layers that share it read their output channels
    along different axes (MatMul(x, W) on axis 1, Gemm(a, W, transB=1) on axis 0), that grid is
    per tensor, or one of them would get per-channel scales along its reduction axis."""
    axes: dict[str, set] = {}
    for wp in plan.weights.values():
        axes.setdefault(wp.tensor, set()).add(wp.axis)
    mixed = sorted(t for t, a in axes.items() if len(a) > 1)
    for key, wp in plan.weights.items():
        if wp.tensor in mixed:
            plan.weights[key] = WeightPoint(wp.tensor, wp.node, wp.index, None)
    if mixed:
        log.debug("weight %s: shared by layers whose output channels lie on different axes; one per-tensor "
                  "grid serves them", ", ".join(mixed[:4]) + (" ..." if len(mixed) > 4 else ""))


def left_weight(g: Graph, node, index: int) -> bool:
    """A constant first input of a MatMul or Gemm whose second input is not constant: MatMul(W,
    x) or Gemm(W, x), the weight on the left (``torch.matmul(W, x)``, ``torch.addmm(b, W, x)``).
    It is quantized as a weight; left out, the layer read as quantized in the report while its
    weight stayed float in the model."""
    return (node.op_type in ("MatMul", "Gemm") and index == 0 and len(node.input) > 1
            and not g.is_constant(node.input[1]))


# ops whose output is bounded whatever their input (a calibrated grid holds it at any length)
_BOUNDED = frozenset({"Sin", "Cos", "Tanh", "Sigmoid", "HardSigmoid", "Softmax", "LogSoftmax", "Erf", "Softsign",
                      "Sign", "Atan", "Not", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "IsNaN",
                      "IsInf"})
_INTS = frozenset(INTEGER_TYPES - {onnx.TensorProto.BOOL})     # a comparison's bool is no position
# the inputs that carry values into an op's output (the others give a shape, axes, indices)
_VALUE_INPUTS = {"Expand": 1, "Reshape": 1, "Tile": 1, "Slice": 1, "Unsqueeze": 1, "Squeeze": 1, "Resize": 1,
                 "Upsample": 1, "Pad": 1, "Gather": 1, "GatherElements": 1, "GatherND": 1, "ConstantOfShape": 0,
                 "TopK": 1, "ReduceMax": 1, "ReduceMin": 1, "ReduceSum": 1, "ReduceMean": 1}


# ops whose inputs from this index on are sizes or coordinates, never quantized: a runtime Resize
# scale of 1.0 read 0.9965 off a uint8 grid and the output's batch became 0 (qnn, ort; found by a
# sweep of ONNX's node tests)
_SIZE_INPUTS = {"Resize": 1, "Upsample": 1}


def position_tensors(g: Graph) -> tuple[set, set]:
    """(float tensors computed from positions or sizes, the nodes computing them). Positions and
    sizes are integers a Range, a CumSum, a Shape or a Size makes (``arange`` of the length; a
    mask's running count; a feature map's height), a float Range, or an int graph input named like
    ``position_ids``; with what integer arithmetic, a Cast to float and float arithmetic with
    constants (or tensors computed from constants alone, an ``inv_freq`` Expanded to the batch)
    make of them, up to a bounded op (the rotary embedding's Cos/Sin). Their values grow with the
    input's length or size, past any grid the calibration inputs size: Llama's rotary ``inv_freq @
    positions`` clipped every position from 16 on to 15 and its tokens there read cosine 0.58;
    ``interpolate(scale_factor=2)``'s output size, computed in float, was clipped at the calibrated
    size, and the model failed at another (both found by bug hunts). A mask (a Cast of
    attention_mask) is not a position."""
    ints, floats, consts, nodes = set(), set(), set(), set()
    data = g.value_dependent()
    for i in g.graph_inputs:
        if "position" in i.name.lower() and g.elem_type(i.name) in _INTS:
            ints.add(i.name)
    for node in g.topological_nodes():
        outs = [o for o in node.output if o]
        if not outs or node.op_type == "Constant":
            continue
        op = node.op_type
        values = node.input[:_VALUE_INPUTS[op]] if op in _VALUE_INPUTS else node.input
        live = [x for x in values if x and not g.is_constant(x)]
        out_float = all(g.is_float(o) for o in outs)
        if op in ("Range", "CumSum", "Shape", "Size") and all(g.elem_type(o) in _INTS for o in outs):
            ints.update(outs)
            continue
        if op == "Range" and out_float:
            floats.update(outs)
            nodes.add(node.name)
            continue
        if op in _BOUNDED:
            continue
        if op in ("Cast", "CastLike") and out_float and live and live[0] in ints:
            floats.update(outs)
            nodes.add(node.name)
            continue
        if out_float:
            if any(x in floats for x in live) and all(x in floats or x in consts or g.elem_type(x) in _INTS
                                                      for x in live):
                floats.update(outs)
                nodes.add(node.name)
            elif all(x in consts for x in live) and not any(o in data for o in outs):
                consts.update(outs)      # from constants alone (an Expand of a constant to a shape)
        elif all(g.elem_type(o) in _INTS for o in outs) and any(x in ints for x in live):
            ints.update(outs)
    return floats, nodes


_STAT_REDUCE = frozenset({"ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2"})
_STAT_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Sqrt", "Reciprocal", "Pow", "Reshape", "Expand",
                       "Unsqueeze", "Squeeze", "Cast", "Identity", "Clip", "Neg", "Abs"})
_APPLY = frozenset({"Mul", "Div", "Sub"})


def norm_statistics(g: Graph) -> tuple[set, set]:
    """(float tensors that are a normalization's per-row statistics, the nodes computing them):
    a reduction of the data (ReduceMean/ReduceSum/ReduceL2: a mean, a sum of squares, a norm) and
    what elementwise ops with constants make of it (variance, + eps, Sqrt, Reciprocal, times
    gamma), where every such tensor ends in a Mul/Div/Sub applying it to the data it was reduced
    from (x - mean, x * 1/rms, x / ||x||; a decomposed softmax's exp / sum). These are what a
    fused LayerNorm computes inside, in float: on backends that quantize every op a grid rounded
    JAX's sum of squares (magika's LayerNorm, isolated cosine 0.67 on qnn) and clipped Llama's
    RMSNorm 1/rms at lengths past calibration (both found by hunts). A reduction read by anything
    else (a squeeze-and-excitation block's pooled vector into a Conv) is no statistic."""
    floats = lambda n: [x for x in n.input if x and not g.is_constant(x) and g.is_float(x)]    # noqa: E731
    consts: set = set()          # float tensors computed from constants and shapes alone (gamma reshaped)
    stats: dict[str, set] = {}   # statistic -> the tensors its reductions read
    nodes_of: dict[str, str] = {}
    data = g.value_dependent()
    for node in g.topological_nodes():
        outs = [o for o in node.output if o]
        if not outs or not all(g.is_float(o) for o in outs):
            continue
        live = [x for x in floats(node) if x not in consts]
        if not any(o in data for o in outs):
            consts.update(outs)
            continue
        if not live:
            continue
        if node.op_type in _STAT_REDUCE and len(outs) == 1:
            stats[outs[0]] = {live[0]}
        elif node.op_type in _STAT_OPS and len(outs) == 1 and all(x in stats for x in live):
            stats[outs[0]] = set().union(*(stats[x] for x in live))
        else:
            continue
        nodes_of[outs[0]] = node.name

    def applies(node, t: str) -> bool:
        """``node`` applies statistic ``t`` to the data it was reduced from: that very tensor
        (x - mean, exp / sum), the one whose square or magnitude was reduced (x * 1/rms), or
        that tensor less a statistic (JAX's (x - mean) * rstd). A mean gating another branch
        is no normalization (found by a review)."""
        if node.op_type not in _APPLY:
            return False
        data = [x for x in floats(node) if x not in stats and x not in consts]
        if len(data) != 1:
            return False
        d = data[0]
        pd = g.producer.get(d)
        for r in stats[t]:
            pr = g.producer.get(r)
            if d == r or (pr is not None and pr.op_type in ("Pow", "Mul", "Abs")
                          and {x for x in floats(pr) if x not in consts} == {d}):
                return True
            if pd is not None and pd.op_type == "Sub" and pd.input[0] == r and pd.input[1] in stats:
                return True
        return False

    outputs = set(g.output_names)
    valid: set = set()
    for node in reversed(g.topological_nodes()):
        for t in node.output:
            if t not in stats:
                continue
            users = g.consumers.get(t, [])
            if t not in outputs and users and all(
                    applies(u, t) or (u.output and u.output[0] in valid) for u in users):
                valid.add(t)
    return valid, {nodes_of[t] for t in valid}


_CARRY = frozenset({"Add", "Sub", "Mul", "Div", "Concat", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze",
                    "Slice", "Split", "Identity", "Expand", "Gather", "Max", "Min", "Clip", "Relu"})


def _elements(shape) -> int | None:
    """How many values a tensor of ``shape`` holds (None where a dim, or the rank, is unknown)."""
    if shape is None or any(d is None for d in shape):
        return None
    n = 1
    for d in shape:
        n *= int(d)
    return n


def position_mixed(g: Graph, positions: set) -> list[str]:
    """Float tensors that hold positions or sizes added to, scaled with or put beside data (a
    YOLO head's anchor + predicted distance, times its stride, concatenated with the scores), as
    far as ops that carry values reach: their range grows with the input's size like the
    positions', so a grid sized on the calibration inputs clips them at a larger size (a 640 px
    image's boxes stopped at 323 px, calibrated at 320; found by a hunt on untuned models)."""
    mixed: list[str] = []
    # a position that is one number (a head size, a mean's count, var's N/(N-1)) scales data by a
    # fixed amount, it does not grow across it: only vectors of positions are (a review found the
    # scaled-dot-product scale, a mean and a variance named)
    seen = {t for t in positions if _elements(g.shape(t)) != 1}
    for node in g.topological_nodes():
        if node.op_type not in _CARRY:
            continue
        values = node.input[:_VALUE_INPUTS[node.op_type]] if node.op_type in _VALUE_INPUTS else node.input
        if any(x in seen for x in values if x):
            for o in node.output:
                if o and o not in seen and g.is_float(o):
                    seen.add(o)
                    mixed.append(o)
    return mixed


def place(g: Graph, platform: Platform, skip_layers=(), weight_only=(), warn: bool = True) -> Placement:
    """Where Q/DQ go on ``platform``; ``warn``: log what the spec leaves float by mistake (once a run)."""
    positions, position_nodes = position_tensors(g)
    stats, stat_nodes = norm_statistics(g)
    plan = Placement(positions=positions)
    skip = set(skip_layers)
    stray: dict[str, tuple[str, int, int]] = {}
    for node in g.topological_nodes():
        op = node.op_type
        if node.name in skip:
            plan.decisions.append(Decision(node.name, op, False, "skipped by --skip_layers"))
            continue
        if node.name in position_nodes and op in platform.quantize_ops:
            plan.decisions.append(Decision(node.name, op, False, "computes on positions or sizes (a Range, a Shape), "
                                           "which grow with the input past any calibrated grid: float"))
            continue
        if op not in platform.quantize_ops or node.domain not in ("", "ai.onnx"):
            plan.decisions.append(Decision(node.name, op, False, f"{op} is not quantized on {platform.name}"))
            continue
        if node.name in stat_nodes:
            plan.decisions.append(Decision(node.name, op, False, "computes a normalization's statistics (a mean, "
                                           "a variance, 1/rms, a norm), which a fused LayerNorm keeps in float: "
                                           "float"))
            continue
        w_index = platform.weight_inputs.get(op)
        act_inputs, weights = [], []
        for i, name in enumerate(node.input):
            if not name:
                continue
            if op in _SIZE_INPUTS and i >= _SIZE_INPUTS[op]:
                continue   # a size, not values: Resize's roi/scales rounded on a grid changed the output's shape
            if (i == w_index or left_weight(g, node, i)) and g.is_constant(name) and g.is_float(name):
                weights.append(i)
            elif op in ("Conv", "ConvTranspose", "Gemm") and i == 2:
                continue  # bias: platform.quantize_bias handles it in qdq
            elif not g.is_constant(name) and g.is_float(name) and name not in positions and name not in stats:
                act_inputs.append(i)
            elif i == 1 and w_index not in (None, 1) and g.is_float(name) \
                    and op in ("Conv", "ConvTranspose", "Gemm", "MatMul"):
                # the spec names another input as the weight (a custom .toml's Conv = 0): this
                # constant would stay float unnoticed
                stray.setdefault(op, (node.name, i, w_index))
        if not act_inputs and not weights:
            plan.decisions.append(Decision(node.name, op, False, "no float activation or weight input"))
            continue
        if op == "Add" and len(act_inputs) < 2 and platform.residual_add_producers:
            plan.decisions.append(Decision(node.name, op, False, "Add with a constant is fused, not quantized"))
            continue
        if op == "Add" and _feeds_layernorm(g, node, platform):
            plan.decisions.append(Decision(node.name, op, False, "residual Add fused with the LayerNorm it "
                                           "feeds: runs in float"))
            continue
        fused = _fused_input(g, node, act_inputs, platform)
        if op == "Add" and platform.residual_add_producers and fused is None:
            plan.decisions.append(Decision(node.name, op, False, "Add with no input to fuse into a "
                                           f"{'/'.join(sorted(platform.residual_add_producers))}: "
                                           "runs in float"))
            continue
        for i in act_inputs:
            if i == fused or _fused_activation_input(g, node, i, platform):
                continue
            moved = _through_pad(g, node, i, platform)
            if moved is not None:
                plan.add_act(moved[0], moved[2], moved[1], owner=node.name)
            else:
                plan.add_act(node.input[i], node.name, i)
        for i in weights:
            axis = weight_axis(g, node, i, platform.weight.per_channel, platform.weight.per_channel_batched)
            plan.weights[(node.name, i)] = WeightPoint(node.input[i], node.name, i, axis)
        reason = "quantized"
        if fused is not None:
            reason += f"; input {node.input[fused]!r} fused into its producer, kept float"
        plan.decisions.append(Decision(node.name, op, True, reason))
    for op, (name, i, w_index) in stray.items() if warn else ():
        log.warning("platform %s: its [ops] weights give %s input %d as the weight, but %s reads an activation "
                    "there and a constant at input %d, which stays float; set weights = { %s = %d } in the spec",
                    platform.name, op, w_index, name, i, op, i)
    _one_axis_per_weight(plan)
    if platform.quantize_network_output:
        quantized = set(plan.quantized_nodes)
        for name in g.output_names:
            prod = g.producer.get(name)
            # through pass-through ops to the quantized node whose values they carry: a Gemm ->
            # Reshape -> output (captcha OCR) or Concat -> Transpose -> output (a detector), which
            # the backend runs quantized, had kept the output float and out of its encodings
            # (found by a hunt)
            while prod is not None and prod.name not in quantized and prod.name not in skip \
                    and prod.op_type in PASS_THROUGH and prod.input \
                    and prod.input[0] not in g.output_names \
                    and len([n for n in g.consumers.get(prod.input[0], []) if n.op_type != "Shape"]) == 1:
                prod = g.producer.get(prod.input[0])
            if g.is_float(name) and prod is not None and prod.name in quantized:
                plan.activations.setdefault(name, ActPoint(name)).output = True
                plan.output_owners[name] = prod.name
    return plan
