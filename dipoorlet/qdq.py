"""Insert QuantizeLinear/DequantizeLinear pairs from a placement and a plan, in one rewrite.

Activations: ``t -> QuantizeLinear -> t_q -> DequantizeLinear -> t_dq``; exactly the node inputs
the placement names are rewired to ``t_dq`` (others keep reading ``t``). Grids narrower than 8
bits get a ``Clip`` on the integers between Q and DQ, so onnxruntime simulates them exactly.
Weights are stored already quantized (``w_quantized``, int8) and read through one
DequantizeLinear (per-channel with ``axis``): a quarter of the float size, the layout TensorRT,
QNN and onnxruntime all accept. Biases stay float unless the platform asks for int32 biases
(scale = input scale x weight scale). Names follow the reference tool (``<t>_scale``,
``<t>_zero_point``, ``<t>_QuantizeLinear``…) so side files and reports line up.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dipoorlet.graph import (Graph, _subgraph_outer_refs, copy_model, drop_unused_initializers, opset_of,
                             restore_initializers, subgraphs)
from dipoorlet.placement import Placement
from dipoorlet.qparams import QParams, QuantPlan, dequantize_array, quantize_array


def _const(g: onnx.GraphProto, name: str, value: np.ndarray) -> str:
    g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return name


def _int_clip(graph, src: str, qp: QParams, name: str) -> str:
    full_min, full_max = (-128, 127) if qp.signed else (0, 255)
    if qp.bits > 8 or (qp.qmin <= full_min and qp.qmax >= full_max):
        return src
    dtype = qp.zero_point.dtype
    lo = _const(graph, name + "_clip_min", np.array(qp.qmin, dtype=dtype))
    hi = _const(graph, name + "_clip_max", np.array(qp.qmax, dtype=dtype))
    out = name + "_clipped"
    graph.node.append(helper.make_node("Clip", [src, lo, hi], [out], name=name + "_Clip"))
    return out


ACT_SUFFIXES = ("_scale", "_zero_point", "_q", "_dq", "_QuantizeLinear", "_DequantizeLinear", "_clip_min",
                "_clip_max", "_clipped", "_Clip", "_float")
WEIGHT_SUFFIXES = ("_quantized", "_scale", "_zero_point", "_dq", "_DequantizeLinear")


def _all_names(model: onnx.ModelProto) -> set[str]:
    """Every node, tensor and value name of the model, subgraphs (If/Loop/Scan bodies) included:
    a new name must not shadow one a body defines."""
    names: set[str] = set()

    def walk(g: onnx.GraphProto) -> None:
        names.update(n.name for n in g.node)
        names.update(o for n in g.node for o in n.output)
        names.update(i for n in g.node for i in n.input)
        names.update(t.name for t in g.initializer)
        names.update(v.name for v in [*g.input, *g.output, *g.value_info])
        for n in g.node:
            for sub in subgraphs(n):
                walk(sub)

    walk(model.graph)
    return names


def _base(tensor: str, taken: set[str], suffixes) -> str:
    """``tensor`` itself when none of ``tensor + suffix`` is taken (the reference tool's names),
    else the first ``tensor_<i>`` that is free; its derived names are then reserved."""
    base, i = tensor, 0
    while any(base + sfx in taken for sfx in suffixes):
        i += 1
        base = f"{tensor}_{i}"
    taken.update(base + sfx for sfx in suffixes)
    return base


def _read_only_at(g: Graph, tensor: str, slots) -> bool:
    """Whether every read of ``tensor`` is one of ``slots`` ((node, input index) pairs): no other
    input, no graph output, no If/Loop body reading it."""
    if tensor in g.output_names:
        return False
    for node in g.consumers.get(tensor, []):
        if tensor not in node.input or tensor in _subgraph_outer_refs(node):
            return False
        if any(x == tensor and (node.name, i) not in slots for i, x in enumerate(node.input)):
            return False
    return True


def _replaced_weights(g: Graph, placement: Placement, plan: QuantPlan) -> set[str]:
    """The quantized weights no float reader keeps: a copy of the model leaves them out (a weight
    another layer reads float stays where it was, and the written model as it always was)."""
    slots = {use for use, wp in placement.weights.items() if wp.tensor in plan.weights}
    return {wp.tensor for wp in placement.weights.values()
            if wp.tensor in plan.weights and _read_only_at(g, wp.tensor, slots)}


def insert_qdq(g: Graph, placement: Placement, plan: QuantPlan) -> onnx.ModelProto:
    """A new model with Q/DQ inserted; ``g`` is not modified."""
    replaced = _replaced_weights(g, placement, plan)
    model = copy_model(g.model, replaced)
    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    new_nodes: dict[str, list] = {}   # producer tensor -> nodes to insert after its producer
    taken = _all_names(model)

    for tensor, point in placement.activations.items():
        qp = plan.activations.get(tensor)
        if qp is None or not (point.uses or point.output):
            continue
        base = _base(tensor, taken, ACT_SUFFIXES)
        q, extra, dq = act_chain(graph, tensor, base, qp, qdq_domain(model, qp))
        new_nodes[tensor] = [q, *extra, dq]
        for node_name, index in point.uses:
            nodes[node_name].input[index] = base + "_dq"
        if point.output:
            _quantize_output(graph, tensor, base, q, dq, nodes, new_nodes)

    # transformed constants (plan.values), each only while the layer it belongs to is quantized
    quantized_nodes = {wp.node for wp in placement.weights.values() if wp.tensor in plan.weights}
    values = {k: v for k, v in plan.values.items()
              if k not in plan.value_owners or plan.value_owners[k] in quantized_nodes}
    weight_names_used = {}
    for (node_name, index), wp in placement.weights.items():
        qp = plan.weights.get(wp.tensor)
        if qp is None:
            continue
        node = nodes[node_name]
        key = wp.tensor
        if key not in weight_names_used:
            value = values[wp.tensor] if wp.tensor in values else g.weight(wp.tensor)
            base = _base(wp.tensor, taken, WEIGHT_SUFFIXES)
            qname = base + "_quantized"
            _const(graph, qname, quantize_array(value, qp))
            s = _const(graph, base + "_scale", qp.scale)
            z = _const(graph, base + "_zero_point", qp.zero_point)
            attrs = {"axis": qp.axis} if qp.axis is not None else {}
            dq = helper.make_node("DequantizeLinear", [qname, s, z], [base + "_dq"],
                                  name=base + "_DequantizeLinear", **attrs)
            new_nodes.setdefault("", []).append(dq)
            weight_names_used[key] = base + "_dq"
        node.input[index] = weight_names_used[key]

    _replace_values(graph, values, set(weight_names_used))
    _rebuild(graph, new_nodes)
    restore_initializers(graph, g.model.graph, replaced)
    drop_unused_initializers(graph)
    return model


MS_DOMAIN = "com.microsoft"


def qdq_domain(model: onnx.ModelProto, qp: QParams) -> str:
    """The domain of a grid's Q/DQ: the standard one, except a 16-bit grid below opset 21 (where
    QuantizeLinear takes int8/uint8 only), which gets onnxruntime's com.microsoft Q/DQ, as its
    own quantizer writes them for 16-bit activations (the model then imports that domain)."""
    if qp.bits <= 8 or opset_of(model) >= 21:
        return ""
    if not any(imp.domain == MS_DOMAIN for imp in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return MS_DOMAIN


def act_chain(graph, tensor: str, base: str, qp: QParams, domain: str = ""):
    """QuantizeLinear (-> integer Clip) -> DequantizeLinear for ``tensor``, output ``<base>_dq``;
    the scale/zero-point constants go into ``graph``, the nodes are returned, not inserted."""
    s = _const(graph, base + "_scale", qp.scale)
    z = _const(graph, base + "_zero_point", qp.zero_point)
    q_out = base + "_q"
    q = helper.make_node("QuantizeLinear", [tensor, s, z], [q_out], name=base + "_QuantizeLinear", domain=domain)
    before = len(graph.node)
    q_src = _int_clip(graph, q_out, qp, base)
    extra = [graph.node.pop() for _ in range(len(graph.node) - before)][::-1]
    dq = helper.make_node("DequantizeLinear", [q_src, s, z], [base + "_dq"], name=base + "_DequantizeLinear",
                          domain=domain)
    return q, extra, dq


def _replace_values(graph: onnx.GraphProto, values: dict, quantized: set) -> None:
    """Float constants changed by a weight transform (plan.values) replace the model's own."""
    todo = {k: v for k, v in values.items() if k not in quantized}
    if not todo:
        return
    for t in graph.initializer:
        if t.name in todo:
            t.CopyFrom(numpy_helper.from_array(np.asarray(todo.pop(t.name), dtype=np.float32), t.name))
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] in todo:
            name = n.output[0]
            del n.attribute[:]
            n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(
                np.asarray(todo.pop(name), dtype=np.float32), name)))


def _quantize_output(graph, tensor: str, base: str, q, dq, nodes: dict, new_nodes: dict) -> None:
    """Make network output ``tensor`` the dequantized value, keeping its name.

    The producer now writes ``<t>_float``; Q reads it and DQ writes ``<t>``, so every consumer
    and the graph output see what the chip outputs, under the name users already know.
    """
    src = base + "_float"
    for node in graph.node:
        for i, out in enumerate(node.output):
            if out == tensor:
                node.output[i] = src
    for node in nodes.values():
        for i, name in enumerate(node.input):
            if name == base + "_dq":
                node.input[i] = tensor
    q.input[0] = src
    dq.output[0] = tensor
    new_nodes[src] = new_nodes.pop(tensor)


def _rebuild(graph: onnx.GraphProto, new_nodes: dict[str, list]) -> None:
    """Put inserted nodes right after their producers, keeping topological order."""
    order = list(new_nodes.pop("", []))
    produced = {o for n in graph.node for o in n.output}
    for name in list(new_nodes):
        if name not in produced:
            order.extend(new_nodes.pop(name))
    for node in graph.node:
        order.append(node)
        for out in node.output:
            order.extend(new_nodes.pop(out, []))
    del graph.node[:]
    graph.node.extend(order)


def _branch_copy(chain: list, out: str, branch_out: str, taken: set[str]) -> list:
    """A private copy of a Q/DQ ``chain`` (its inner tensors renamed, so sibling branches share
    no names) whose last output is ``branch_out``."""
    rename = {}
    body = []
    for node in chain:
        c = onnx.NodeProto()
        c.CopyFrom(node)
        c.name = _base(f"{out}/{node.name}", taken, ("",))
        for i, x in enumerate(c.input):
            c.input[i] = rename.get(x, x)
        for i, y in enumerate(c.output):
            rename[y] = _base(f"{out}/{y}", taken, ("",))
            c.output[i] = rename[y]
        body.append(c)
    body[-1].output[0] = branch_out
    return body


def _switch(mask: str, src: str, chain: list, out: str, elem: int, taken: set[str],
            passthrough: str | None = None, off_chain: list | None = None) -> onnx.NodeProto:
    """``out = If(mask) then chain(src) else passthrough``: a private copy of the Q/DQ ``chain``
    as the then-branch; ``src``, ``passthrough`` (default ``src``) and the scale/zero-point
    constants are read from the outer graph. With ``off_chain`` (another grid's Q/DQ of ``src``)
    the else-branch is that chain instead of the pass-through."""
    then_out, else_out = _base(out + "_then", taken, ("",)), _base(out + "_else", taken, ("",))
    then_g = helper.make_graph(_branch_copy(chain, out, then_out, taken), then_out, [],
                               [helper.make_tensor_value_info(then_out, elem, None)])
    else_body = (_branch_copy(off_chain, out, else_out, taken) if off_chain is not None else
                 [helper.make_node("Identity", [passthrough or src], [else_out], name=else_out)])
    else_g = helper.make_graph(else_body, else_out, [],
                               [helper.make_tensor_value_info(else_out, elem, None)])
    return helper.make_node("If", [mask], [out], name=_base(out + "_If", taken, ("",)),
                            then_branch=then_g, else_branch=else_g)


class Switchboard:
    """One model that holds every quantization of a placement, each switched on or off per run.

    Built for the sensitivity analysis, which scores dozens of variants of one placement (each
    layer alone, its weight alone, its activations alone, the whole model less the float layers
    of ``--auto_skip``). Building, serializing and loading one onnxruntime session per variant
    cost three times the inference itself (measured on MiniLM: 24 s of 35 s); with this, one
    session serves them all and a variant costs only its runs.

    - Activations: each quantized node reads a quantized tensor ``t`` through
      ``If(on_<node>)``, ``on_<node>`` a boolean scalar input: its then-branch is t's Q/DQ, its
      else-branch passes ``t`` through. A network output quantized in place becomes such an
      ``If`` under its name. Only the branch taken runs: a variant costs about the float model
      plus its own Q/DQ. (The first design computed every Q/DQ on every run and selected with
      ``Where``: on the 800x608 PP-PicoDet layout model, 95 quantized tensors, a run cost 2x
      the float model's and the sensitivity analysis 195 s of a 213 s run.) A tensor read by
      several switched-on owners is quantized once per owner, which only the all-on variants
      of ``--auto_skip`` pay for.
    - Weights and the constants of weight transforms (``plan.values``) become graph inputs, one
      per quantized use, fed the float or the fake-quantized (dequantized) array per run: no
      per-run Q/DQ of weights, no copies (onnxruntime reads numpy inputs in place on CPU; for a
      GPU session :meth:`place_on` keeps them resident on the device). The arrays are cached: a
      float and a fake-quantized copy of each quantized weight while the analysis runs.

    :meth:`feed` gives the inputs of the variant in which the nodes in ``acts`` have their
    activations quantized and those in ``weights`` their weights, exactly what
    ``insert_qdq(g, placement.restrict(...), plan)`` computes (a dequantized int32 bias may
    differ in the last float32 bit), but for a layer scored by itself (``feed(..., alone=True)``):
    its bias takes the correction measured alone (:meth:`_alone`), where ``insert_qdq`` would
    give it the whole model's.
    """

    def __init__(self, g: Graph, placement: Placement, plan: QuantPlan, off_plan: QuantPlan | None = None):
        """``off_plan``: switched off, an activation goes through its grid in ``off_plan`` (where
        it has one: --auto_a16's 16-bit grids) instead of staying float, and so does a weight
        (--auto_w8's 8-bit grids)."""
        self.g, self.plan, self.off_plan, self.placement = g, plan, off_plan, placement
        self._cache: dict = {}
        # the weights fed as inputs that nothing else reads (a transformed constant's every read
        # in the main graph is fed)
        fed = _replaced_weights(g, placement, plan) | {
            t for t in plan.values if _read_only_at(g, t, {(n.name, i) for n in g.consumers.get(t, [])
                                                          for i, x in enumerate(n.input) if x == t})}
        model = copy_model(g.model, fed)
        graph = model.graph
        nodes = {n.name: n for n in graph.node}
        taken = _all_names(model)
        new_nodes: dict[str, list] = {}
        self.masks: dict[str, str] = {}            # owner node -> boolean input
        self.act_owners: set[str] = set()

        def mask(owner: str) -> str:
            if owner not in self.masks:
                name = _base(f"on_{owner}", taken, ("",))
                graph.input.append(helper.make_tensor_value_info(name, onnx.TensorProto.BOOL, []))
                self.masks[owner] = name
            return self.masks[owner]

        for tensor, point in placement.activations.items():
            qp = plan.activations.get(tensor)
            if qp is None or not (point.uses or point.output):
                continue
            base = _base(tensor, taken, ACT_SUFFIXES + ("_sw",))
            src = tensor
            chain = []
            if point.output:
                owner = placement.output_owners[tensor]
                src = base + "_float"
                for node in graph.node:
                    for i, out in enumerate(node.output):
                        if out == tensor:
                            node.output[i] = src
                self.act_owners.add(owner)
            q, extra, dq = act_chain(graph, src, base, qp, qdq_domain(model, qp))
            off = None
            if off_plan is not None and tensor in off_plan.activations:
                oq, oextra, odq = act_chain(graph, src, _base(base + "_off", taken, ACT_SUFFIXES),
                                             off_plan.activations[tensor],
                                             qdq_domain(model, off_plan.activations[tensor]))
                off = [oq, *oextra, odq]
            elem = self._elem_type(tensor)
            if point.output:
                chain.append(_switch(mask(owner), src, [q, *extra, dq], tensor, elem, taken, off_chain=off))
            wired: dict[str, str] = {}
            for (node_name, index), owner in zip(point.uses, point.owners):
                if owner not in wired:
                    out = _base(f"{base}_sw_{len(wired)}", taken, ("",))
                    # switched off, a consumer reads the tensor as its producer's switch left it
                    # (a quantized network output stays quantized for its other readers)
                    chain.append(_switch(mask(owner), src, [q, *extra, dq], out, elem, taken, passthrough=tensor,
                                         off_chain=off))
                    wired[owner] = out
                    self.act_owners.add(owner)
                nodes[node_name].input[index] = wired[owner]
            new_nodes[src] = chain

        # weights and transformed constants: graph inputs, one per quantized use
        self.weight_inputs: list[tuple[str, str, str]] = []   # (input, node, tensor)
        self.value_inputs: list[tuple[str, str]] = []         # (input, tensor): float uses of a transformed constant
        self.weight_nodes = {wp.node for wp in placement.weights.values() if wp.tensor in plan.weights}
        inputs: list[tuple[str, str]] = []
        for (node_name, index), wp in placement.weights.items():
            if wp.tensor not in plan.weights:
                continue
            name = _base(f"{wp.tensor}_sw_{node_name}_{index}", taken, ("",))
            nodes[node_name].input[index] = name
            self.weight_inputs.append((name, node_name, wp.tensor))
            inputs.append((name, wp.tensor))
        for tensor in plan.values:
            name = _base(f"{tensor}_sw_value", taken, ("",))
            used = False
            for node in graph.node:
                for i, x in enumerate(node.input):
                    if x == tensor:
                        node.input[i] = name
                        used = True
            if used:
                self.value_inputs.append((name, tensor))
                inputs.append((name, tensor))
        for name, tensor in inputs:
            w = self._weight(tensor)
            graph.input.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(w.dtype), list(w.shape)))
        _rebuild(graph, new_nodes)
        restore_initializers(graph, g.model.graph, fed)
        drop_unused_initializers(graph)
        self.model = model

    def _elem_type(self, tensor: str) -> int:
        t = self.g.types.get(tensor)
        return t[0] if t and t[0] else onnx.TensorProto.FLOAT

    def _weight(self, tensor: str) -> np.ndarray:
        key = ("float", tensor)
        if key not in self._cache:
            self._cache[key] = np.ascontiguousarray(self.g.weight(tensor))
        return self._cache[key]

    def _value(self, tensor: str, weights_on: set, alone: dict | None = None) -> tuple[str, np.ndarray]:
        """The float value a variant holds for ``tensor`` (transformed or the model's own;
        ``alone``: the variant's values from :meth:`_alone`)."""
        if alone and tensor in alone:
            return alone[tensor]
        plan = self.plan
        owner = plan.value_owners.get(tensor)
        if tensor in plan.values and (owner is None or owner in weights_on):
            key = ("value", tensor)
            if key not in self._cache:
                dtype = self._weight(tensor).dtype
                self._cache[key] = np.ascontiguousarray(np.asarray(plan.values[tensor], dtype=dtype))
            return "value", self._cache[key]
        return "float", self._weight(tensor)

    def _off_value(self, tensor: str) -> np.ndarray:
        """``off_plan``'s value for ``tensor`` (a bias rebased on its grids), cached."""
        key = ("value_off", tensor)
        if key not in self._cache:
            self._cache[key] = np.ascontiguousarray(
                np.asarray(self.off_plan.values[tensor], dtype=self._weight(tensor).dtype))
        return self._cache[key]

    def _fake_quant(self, tensor: str, which: str, value: np.ndarray, off: bool = False) -> np.ndarray:
        key = ("fq_off" if off else "fq", which, tensor)
        if key not in self._cache:
            qp = (self.off_plan if off else self.plan).weights[tensor]
            self._cache[key] = dequantize_array(quantize_array(value, qp), qp).astype(value.dtype)
        return self._cache[key]

    @property
    def owners(self) -> set[str]:
        """Every node some switch belongs to (all of them on = the full placement)."""
        return set(self.act_owners) | set(self.weight_nodes)

    def place_on(self, device: str) -> None:
        """Feed weights as onnxruntime values resident on ``device`` ("cuda"), each copied there
        once, instead of numpy arrays that a GPU session would copy on every run."""
        self._device = device
        self._resident: dict[int, object] = {}

    def _resident_value(self, arr: np.ndarray):
        device = getattr(self, "_device", None)
        if device is None:
            return arr
        key = id(arr)      # every array fed is held in self._cache, so its id stays its own
        if key not in self._resident:
            from dipoorlet.runtime import _ort

            self._resident[key] = _ort().OrtValue.ortvalue_from_numpy(arr, device, 0)
        return self._resident[key]

    def _input_owner(self, node: str) -> str | None:
        """The owner of the switch on ``node``'s first input (None: that input is not quantized);
        behind a Pad the backend folds into it, the switch sits on the Pad's input (placement
        moves the use there, owned by ``node``), as bias correction reads it."""
        key = ("input_owner", node)
        if key not in self._cache:
            n = self.g.node_by_name.get(node)
            pad = self.g.producer.get(n.input[0]) if n is not None and n.input else None
            moved = (pad.name, 0) if pad is not None and pad.op_type == "Pad" else None
            self._cache[key] = next((o for p in self.placement.activations.values()
                                     for u, o in zip(p.uses, p.owners)
                                     if u == (node, 0) or (u == moved and o == node)), None)
        return self._cache[key]

    def _alone(self, acts: set, weights: set) -> dict:
        """In a variant that scores one layer by itself, its corrected bias (``plan.isolated``):
        the correction a run quantizing that layer alone would measure, not the whole model's
        (which also makes up for clipping that upstream errors cause). Every other variant
        keeps the whole model's corrections, as the model --auto_skip writes does (also a
        trial that leaves one layer on). Not with an ``off_plan``: its layers switched off are
        quantized too."""
        on = acts | weights
        if not self.plan.isolated or self.off_plan is not None or len(on) != 1:
            return {}
        (node,) = on
        found = next(((t, iso) for t, iso in self.plan.isolated.items() if iso.node == node), None)
        w_on, a_on = node in weights, self._input_owner(node) in acts
        if found is None or not (w_on or a_on):
            return {}
        tensor, iso = found
        which = "both" if w_on and a_on else "weight" if w_on else "act"
        key = ("alone", which, tensor)
        if key not in self._cache:
            self._cache[key] = np.ascontiguousarray(getattr(iso, which).astype(self._weight(tensor).dtype))
        return {tensor: (key[0] + "_" + which, self._cache[key])}

    def feed(self, acts=(), weights=(), alone: bool = False) -> dict:
        """``alone``: the variant scores one layer by itself (the isolated analysis and its
        splits): a corrected layer takes its correction measured alone (:meth:`_alone`)."""
        acts, weights = set(acts), set(weights) & self.weight_nodes
        alone = self._alone(acts, weights) if alone else {}
        feed = {name: np.array(owner in acts) for owner, name in self.masks.items()}
        for name, node, tensor in self.weight_inputs:
            if node not in weights and self.off_plan is not None and tensor in self.off_plan.weights:
                # switched off: its off_plan grid, and the off_plan's value where it has one (a
                # bias rebased on the off grid's W_q)
                if tensor in self.off_plan.values:
                    which, value = "value_off", self._off_value(tensor)
                else:
                    which, value = self._value(tensor, weights | {node})
                feed[name] = self._resident_value(self._fake_quant(tensor, which, value, off=True))
                continue
            which, value = self._value(tensor, weights, alone)
            feed[name] = self._resident_value(self._fake_quant(tensor, which, value) if node in weights else value)
        for name, tensor in self.value_inputs:
            owner = self.plan.value_owners.get(tensor)
            if (self.off_plan is not None and tensor in self.off_plan.values and owner in self.weight_nodes
                    and owner not in weights):     # its layer's weight is switched to the off_plan grid
                feed[name] = self._resident_value(self._off_value(tensor))
                continue
            feed[name] = self._resident_value(self._value(tensor, weights, alone)[1])
        return feed


def append_watch(model, types, consts=()) -> tuple[str | None, dict]:
    """Add to a Q/DQ model one float32 scalar output, > 0 where an activation its QuantizeLinear
    nodes read holds a NaN, else 0 (None: no such Q). A NaN of the float model (a fully padded
    sequence's softmax) becomes finite after a Q/DQ, so the inputs of the layers downstream do not
    show it; the passes that accumulate statistics of the quantized model leave such samples out.

    Per activation ``t``: ``s = ReduceSum(t)``, NaN where ``t`` holds one (and where it holds both
    +Inf and -Inf, which no activation on a grid does); an attention mask's -Inf or float32 lowest
    sums to -Inf, not NaN (a first design flagged the sum's Inf too: every sample of a masked
    model). The Q then reads its scale as ``scale + 0 * IsNaN(s)``, exactly its scale: that
    dependency makes the check run before the Q, so ``t`` is freed when it would be without it.
    Checks that nothing depended on ran after the last layer in onnxruntime and held every Q input
    for the whole run (peak RSS 129 -> 664 MB on a review's 30-Conv model). ``consts``: more
    constant names (the initializers a lean model runs with)."""
    consts = {t.name for t in model.graph.initializer} | set(consts)
    base = "__dipoorlet_watch"
    zero = base + "_zero"
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), zero))
    checked: dict[str, str] = {}     # activation -> its check's zero
    flags, out = [], []
    for n in list(model.graph.node):
        t = n.input[0] if n.op_type == "QuantizeLinear" and len(n.input) > 1 else None
        if t is not None and t not in consts:
            if t not in checked:
                k = len(flags)
                p = f"{base}_{k}"
                out += [helper.make_node("ReduceSum", [t], [p + "_s"], name=p + "_s", keepdims=0),
                        helper.make_node("IsNaN", [p + "_s"], [p + "_n"], name=p + "_n"),
                        helper.make_node("Cast", [p + "_n"], [p], name=p, to=onnx.TensorProto.FLOAT),
                        helper.make_node("Mul", [p, zero], [p + "_z"], name=p + "_z")]
                flags.append(p)
                checked[t] = p + "_z"
            # the Q's scale + 0: a scalar Add (a full copy of t cost the detector's pass 7%)
            gated = f"{base}_scale_{len(out)}"
            out.append(helper.make_node("Add", [n.input[1], checked[t]], [gated], name=gated))
            n.input[1] = gated
        out.append(n)
    if not flags:
        model.graph.initializer.pop()
        return None, types
    del model.graph.node[:]
    model.graph.node.extend(out)
    model.graph.node.append(helper.make_node("Sum", flags, [base], name=base))
    types = dict(types)
    types[base] = (onnx.TensorProto.FLOAT, [])
    return base, types


def nan_free(got: dict, name: str | None) -> bool:
    """No NaN among the activations :func:`append_watch` checks (True without a check)."""
    return name is None or not float(np.asarray(got[name]).sum()) > 0


def dq_source(model_nodes: dict, tensor: str) -> str | None:
    """The float tensor a DequantizeLinear output came from (through its Q and integer Clip)."""
    node = model_nodes.get(tensor)
    if node is None or node.op_type != "DequantizeLinear":
        return None
    src = node.input[0]
    while src in model_nodes and model_nodes[src].op_type != "QuantizeLinear":
        prev = model_nodes[src]
        if prev.op_type != "Clip":
            return None
        src = prev.input[0]
    q = model_nodes.get(src)
    return q.input[0] if q is not None and q.op_type == "QuantizeLinear" else None
