"""The model as a graph: load, inspect, edit, save.

A thin facade over the ONNX protobuf. We keep the protobuf as the single source of truth and
derive the producer/consumer maps from it on demand (``refresh()``), rather than using a second
IR: the passes here are few and simple, and protobuf is what every other tool reads. Weights are
numpy arrays whether they live in initializers or in ``Constant`` nodes (paddle2onnx stores them
that way); :func:`dipoorlet.prepare.constants_to_initializers` turns the latter into the former.

Models over 2 GB (protobuf's limit) are loaded with their external data and saved back with
external data; shape inference then goes through a file.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from dipoorlet.errors import ModelError
from dipoorlet.util import atomic_path

log = logging.getLogger(__name__)

PROTOBUF_LIMIT = 2**31 - 1
# Leave headroom for the Q/DQ nodes and exposed outputs we add before serializing.
EXTERNAL_THRESHOLD = int(1.8 * 2**30)
FLOAT_TYPES = {onnx.TensorProto.FLOAT}
INTEGER_TYPES = {onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16,
                 onnx.TensorProto.INT32, onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
                 onnx.TensorProto.BOOL}
MIN_OPSET, MAX_OPSET, QDQ_OPSET = 11, 21, 13


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_model_path(path: str | os.PathLike) -> Path:
    """The model path exists, is a file and is readable; else a one-line ModelError."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"model file {p} does not exist; pass the path of an .onnx file with -M")
    if p.is_dir():
        raise ModelError(f"model path {p} is a folder; pass the path of an .onnx file with -M")
    if not os.access(p, os.R_OK):
        raise ModelError(f"model file {p} is not readable; check its permissions")
    return p


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Read an ONNX file (with its external data) or raise a one-line ModelError."""
    p = check_model_path(path)
    try:
        model = onnx.load(str(p), load_external_data=True)
    except Exception as exc:  # protobuf DecodeError, missing external data, ...
        model = _load_through_links(p)
        if model is None:
            raise ModelError(f"{p} is not a readable ONNX model ({_first_line(exc)}); "
                             "export it again or check the file is complete") from exc
    if not model.graph.node:
        raise ModelError(f"{p} is not an ONNX model with a graph (no nodes found); "
                         "check that -M names the .onnx file")
    _check_structure(model, p)
    _densify_sparse_initializers(model)
    return model


def _load_through_links(p: Path) -> onnx.ModelProto | None:
    """A model whose external data files are symbolic links (a Hugging Face cache's snapshot
    folder links each file to its blob), or a linked -M whose data lies beside the link's
    target: onnx refuses to follow such links, and the model was called unreadable (found by a
    hunt). Its data is read here from the files the links name, relative locations only (no
    absolute path, no '..'), from the model's folder, else the folder of the file it links to.
    None where this does not read it either (onnx's own error is then the one reported)."""
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception:  # noqa: BLE001
        return None
    from onnx.external_data_helper import _get_all_tensors

    tensors = [t for t in _get_all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL]
    if not tensors:
        return None
    infos = [{e.key: e.value for e in t.external_data} for t in tensors]
    locations = [info.get("location", "") for info in infos]
    if any(not loc or os.path.isabs(loc) or ".." in Path(loc).parts for loc in locations):
        return None
    bases = list(dict.fromkeys([p.parent, Path(os.path.realpath(p)).parent]))
    # only where a link is what onnx refused: another failure keeps onnx's own message
    if not p.is_symlink() and not any((p.parent / loc).is_symlink() for loc in locations):
        return None
    for base in bases:
        try:
            for t, info, loc in zip(tensors, infos, locations):
                path = base / loc
                if not path.is_file():          # a regular file (after the links): not a device or a pipe
                    raise OSError(f"{path} is not a file")
                size = path.stat().st_size
                offset = int(info.get("offset", 0) or 0)
                length = int(info["length"]) if info.get("length") else size - offset
                if offset < 0 or length < 0 or offset + length > size:
                    raise OSError(f"{loc} holds {size} bytes, not {offset} + {length}")
                with open(path, "rb") as f:
                    f.seek(offset)
                    t.raw_data = f.read(length)
            break
        except (OSError, ValueError):
            continue
    else:
        return None
    for t in tensors:
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
    log.info("%s: its external data read from %s, through symbolic links (which onnx does not follow)", p, base)
    return model


_T = onnx.TensorProto
_BYTES = {_T.FLOAT: 4, _T.DOUBLE: 8, _T.FLOAT16: 2, _T.BFLOAT16: 2, _T.INT8: 1, _T.UINT8: 1, _T.INT16: 2,
          _T.UINT16: 2, _T.INT32: 4, _T.UINT32: 4, _T.INT64: 8, _T.UINT64: 8, _T.BOOL: 1, _T.COMPLEX64: 8,
          _T.COMPLEX128: 16}


def _check_structure(model: onnx.ModelProto, p) -> None:
    """Malformed graphs onnxruntime may still run but the tool cannot write back: one line each
    (found by a bug hunt: a duplicate initializer name failed onnx.checker after the whole run,
    a graph output no node produces likewise, an initializer shorter than its dims was a numpy
    traceback)."""
    g = model.graph
    seen = set()
    for t in g.initializer:
        if t.name in seen:
            raise ModelError(f"{p}: initializer {t.name!r} appears twice in the graph; export the model again, or "
                             "remove the duplicate (onnx.checker names it)")
        seen.add(t.name)
        if t.HasField("raw_data") and t.data_location != onnx.TensorProto.EXTERNAL:
            # whole-byte types only (sub-byte ones, INT4/INT2/FLOAT4E2M1..., pack several per byte)
            size = _BYTES.get(t.data_type)
            if size is not None:
                want = int(np.prod(t.dims, dtype=np.int64)) * size
                if len(t.raw_data) != want:
                    raise ModelError(f"{p}: initializer {t.name!r} of shape {list(t.dims)} holds {len(t.raw_data)} bytes "
                                     f"where its shape and type need {want}; the file is damaged: export it again")
    made = {o for n in g.node for o in n.output} | {i.name for i in g.input} | seen | {
        s.values.name for s in g.sparse_initializer}
    for o in g.output:
        if o.name not in made:
            raise ModelError(f"{p}: graph output {o.name!r} is produced by no node, input or initializer; export the "
                             "model again, or remove that output")


def _densify_sparse_initializers(model: onnx.ModelProto) -> None:
    """Sparse initializers become dense ones (the maps, folding and quantization read dense
    tensors; a weight held sparse read as an undefined tensor)."""
    g = model.graph
    if not len(g.sparse_initializer):
        return
    for sp in list(g.sparse_initializer):
        values = numpy_helper.to_array(sp.values)
        idx = numpy_helper.to_array(sp.indices).astype(np.int64)
        dims = tuple(int(d) for d in sp.dims)
        dense = np.zeros(int(np.prod(dims, dtype=np.int64)), dtype=values.dtype)
        if values.size:
            flat = idx if idx.ndim == 1 else np.ravel_multi_index(tuple(idx.T), dims)
            dense[flat] = values.reshape(-1)
        g.initializer.append(numpy_helper.from_array(dense.reshape(dims), sp.values.name))
    del g.sparse_initializer[:]


def model_files(path: str | os.PathLike) -> list[Path]:
    """The model file and the external-data files its tensors name (read without the data): a
    run must never remove or replace any of them (an -M inside -O whose weights sit beside it)."""
    p = Path(path)
    files = [p]
    try:
        from onnx.external_data_helper import _get_all_tensors

        m = onnx.load(str(p), load_external_data=False)
        for t in _get_all_tensors(m):
            if t.data_location == onnx.TensorProto.EXTERNAL:
                loc = next((e.value for e in t.external_data if e.key == "location"), "")
                if loc and p.parent / loc not in files:
                    files.append(p.parent / loc)
    except Exception:  # noqa: BLE001 - the model itself was read before; keep what is known
        pass
    return files


# Ops of an already quantized model: ONNX's (any QLinear* too) and onnxruntime's contrib ops
QUANTIZED_OPS = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "ConvInteger", "MatMulInteger"}
ORT_QUANTIZED_OPS = {"QGemm", "QAttention", "QEmbedLayerNormalization", "DynamicQuantizeLSTM",
                     "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulNBits", "MatMulBnb4",
                     "GatherBlockQuantized", "QMoE", "QuantizeWithOrder", "DequantizeWithOrder", "DequantizeBFP",
                     "QuantizeBFP", "QOrderedMatMul", "QOrderedAttention", "QOrderedLayerNormalization",
                     "QOrderedGelu", "QOrderedLongformerAttention"}


def _all_nodes(model: onnx.ModelProto):
    """Every node of the graph, of the subgraphs its If/Loop/Scan nodes hold, and of the model's
    local functions."""
    def walk(nodes):
        for node in nodes:
            yield node
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    yield from walk(sub.node)
    yield from walk(model.graph.node)
    for fn in model.functions:
        yield from walk(fn.node)


def _quantized_op(node) -> bool:
    domain = node.domain or "ai.onnx"
    if domain in ("ai.onnx", "com.microsoft") and (node.op_type in QUANTIZED_OPS
                                                     or node.op_type.startswith("QLinear")):
        return True
    return domain == "com.microsoft" and node.op_type in ORT_QUANTIZED_OPS


def check_float(model: onnx.ModelProto, path) -> None:
    """A ModelError naming the quantized ops when ``model`` is already quantized (a QDQ or QOp
    model, e.g. a quant_model.onnx passed back as -M, one from another quantizer or a QAT
    export): quantizing it again would put a second grid over the first one and calibrate on
    values the first one already rounded. A DequantizeLinear that reads a graph input (an
    integer image turned into float at the model's entrance), or a QuantizeLinear that writes a
    graph output (a uint8 map at its exit), is not quantization of the model."""
    inputs = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    found: dict[str, int] = {}
    first = None
    for node in _all_nodes(model):
        if not _quantized_op(node) or (node.op_type == "DequantizeLinear" and node.input and node.input[0] in inputs):
            continue
        if node.op_type == "QuantizeLinear" and node.domain in ("", "ai.onnx") and node in model.graph.node \
                and all(o in outputs for o in node.output if o):
            continue     # the mirror case: a float result turned into integers at the model's exit
        found[node.op_type] = found.get(node.op_type, 0) + 1
        first = first or node.name or next((o for o in node.output if o), node.op_type)
    if found:
        ops = ", ".join(f"{n} {op}" for op, n in sorted(found.items(), key=lambda kv: -kv[1]))
        raise ModelError(f"{path} is already quantized ({ops}; first: {first}); dipoorlet quantizes float "
                         "models: pass the float model it was made from with -M (a quantization-aware-"
                         "training export carries its own scales: give it to the backend's tools as it is)")


def opset_of(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 0


def _stuck(rest: list, ready: set) -> str:
    """Why the nodes in ``rest`` cannot be ordered: the tensors they read that nothing makes
    (each with a node reading it), or else a cycle. Naming every input not yet ready named the
    nodes downstream of a break, sorted, and often not the missing tensor (found by a hunt)."""
    made = {o for n in rest for o in n.output}
    undefined: dict[str, str] = {}
    for n in rest:
        for i in [i for i in n.input if i] + _subgraph_outer_refs(n):
            if i not in ready and i not in made:
                undefined.setdefault(i, n.name or n.op_type)
    if undefined:
        named = ", ".join(f"'{t}' (read by {r})" for t, r in list(undefined.items())[:3])
        more = f" and {len(undefined) - 3} more" if len(undefined) > 3 else ""
        return (f"the graph reads tensors that no node, graph input or initializer makes: {named}{more}; "
                "check the model with onnx.checker")
    # peel off the nodes no other stuck node reads (those downstream of a cycle): what is left
    # is on a cycle or between two (a review found the message naming the first nodes in file order)
    cycle = list(rest)
    while True:
        read = {i for n in cycle for i in list(n.input) + _subgraph_outer_refs(n)}
        kept = [n for n in cycle if any(o in read for o in n.output)]
        if len(kept) == len(cycle) or not kept:
            break
        cycle = kept
    names = [n.name or n.op_type for n in cycle[:3]]
    return (f"the graph has a cycle through nodes {names}{' ...' if len(cycle) > 3 else ''}; "
            "check the model with onnx.checker")


class Graph:
    """An ONNX model with use-def maps and numpy access to its weights."""

    def __init__(self, model: onnx.ModelProto, path: Path | None = None):
        self.model = model
        self.path = path
        self.file_dtypes: dict = {}    # input -> dtype its raw .bin files hold, where the model's was widened
        self.refresh()

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> "Graph":
        return cls(load_model(path), Path(path))

    @property
    def graph(self) -> onnx.GraphProto:
        return self.model.graph

    @property
    def opset(self) -> int:
        return opset_of(self.model)

    def refresh(self) -> None:
        """Rebuild the producer/consumer/initializer maps after an edit."""
        g = self.model.graph
        self.initializers = {t.name: t for t in g.initializer}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        self.node_by_name: dict[str, onnx.NodeProto] = {}
        for node in g.node:
            self.node_by_name.setdefault(node.name, node)
            for out in node.output:
                if out:
                    self.producer[out] = node
            for inp in node.input:
                if inp:
                    self.consumers[inp].append(node)
            for name in _subgraph_outer_refs(node):
                self.consumers[name].append(node)
        self.graph_inputs = [i for i in g.input if i.name not in self.initializers]
        self.output_names = [o.name for o in g.output]
        self.types: dict[str, tuple[int, list | None]] = {}
        for vi in list(g.input) + list(g.value_info) + list(g.output):
            tt = vi.type.tensor_type
            if vi.type.HasField("tensor_type") and tt.elem_type:
                shape = None
                if tt.HasField("shape"):
                    shape = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
                self.types[vi.name] = (tt.elem_type, shape)
        for t in g.initializer:
            self.types[t.name] = (t.data_type, list(t.dims))
        self._value_dependent: set | None = None

    # ---- queries --------------------------------------------------------------------------
    def value_dependent(self) -> set:
        """Tensors whose values depend on the network inputs' values (a Shape or Size reads only
        a shape; token embeddings do, though a Gather makes them from a constant table), computed
        once per :meth:`refresh`."""
        if self._value_dependent is None:
            dep = {i.name for i in self.graph_inputs}
            for node in self.topological_nodes():
                if node.op_type not in ("Shape", "Size") and any(x in dep for x in node.input if x):
                    dep.update(o for o in node.output if o)
            self._value_dependent = dep
        return self._value_dependent

    def is_constant(self, name: str) -> bool:
        if name in self.initializers:
            return True
        node = self.producer.get(name)
        return node is not None and node.op_type == "Constant"

    def weight(self, name: str) -> np.ndarray:
        """The value of an initializer or a Constant node's output as numpy."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name], base_dir=str(self._base_dir()))
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            return constant_value(node)
        raise KeyError(name)

    def elem_type(self, name: str) -> int | None:
        info = self.types.get(name)
        return info[0] if info else None

    def shape(self, name: str) -> list | None:
        info = self.types.get(name)
        return info[1] if info else None

    def is_float(self, name: str) -> bool:
        return self.elem_type(name) in FLOAT_TYPES

    def topological_nodes(self) -> list[onnx.NodeProto]:
        """Nodes in an order where every producer comes before its consumers."""
        g = self.model.graph
        ready = {i.name for i in g.input} | set(self.initializers) | {""}
        pending = list(g.node)
        order: list[onnx.NodeProto] = []
        while pending:
            rest = []
            for node in pending:
                needs = [i for i in node.input if i] + _subgraph_outer_refs(node)
                if all(i in ready for i in needs):
                    order.append(node)
                    ready.update(node.output)
                else:
                    rest.append(node)
            if len(rest) == len(pending):
                raise ModelError(_stuck(rest, ready))
            pending = rest
        return order

    def _base_dir(self) -> Path:
        return self.path.parent if self.path else Path(".")

    def byte_size(self) -> int:
        return model_bytes(self.model)


def constant_value(node: onnx.NodeProto) -> np.ndarray:
    """The value a Constant node produces, whichever attribute holds it."""
    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), dtype=np.float32)
        if attr.name == "value_int":
            return np.array(attr.i, dtype=np.int64)
        if attr.name == "value_ints":
            return np.array(list(attr.ints), dtype=np.int64)
    raise ModelError(f"Constant node {node.name!r} has no value this tool can read "
                     "(sparse or string constants); export the model with dense constants")


def node_attr(node: onnx.NodeProto, name: str, default=None):
    """An attribute's Python value (int, float, list, bytes…), or ``default`` when absent."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def add_initializer(g: "Graph", name: str, value: np.ndarray) -> str:
    """Append a constant to the graph and to ``g.initializers``; returns ``name``."""
    g.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    g.initializers[name] = g.graph.initializer[-1]
    return name


def insert_before(g: "Graph", op: str, x: str, value: np.ndarray, tag: str, const_tag: str, consumers) -> str:
    """Put ``op(x, value)`` (``value`` a new constant ``<x>_<tag>_<const_tag>``) in front of
    ``consumers``, which then read its output ``<x>_<tag>`` at input 0; returns that name.

    The output is declared with ``x``'s type and shape, so shape inference and placement see a
    float tensor; ``g.producer``/``g.node_by_name`` are updated for :func:`fresh_name`, the
    consumer maps are not (call ``g.refresh()`` after a batch of edits)."""
    const = add_initializer(g, fresh_name(g, f"{x}_{tag}_{const_tag}"), value)
    out = fresh_name(g, f"{x}_{tag}")
    node = helper.make_node(op, [x, const], [out], name=fresh_name(g, f"{x}_{tag}_{op}"))
    g.graph.node.insert(min(list(g.graph.node).index(c) for c in consumers), node)
    for c in consumers:
        c.input[0] = out
    elem, shape = g.types.get(x, (onnx.TensorProto.FLOAT, None))
    g.graph.value_info.append(helper.make_tensor_value_info(out, elem, shape))
    g.producer[out] = node
    g.node_by_name[node.name] = node
    return out


def fresh_name(g: "Graph", name: str) -> str:
    """``name``, or ``name_1``, ``name_2``… if a tensor, node or graph input already has it."""
    taken = set(g.initializers) | set(g.producer) | set(g.node_by_name) | {i.name for i in g.graph.input}
    out, k = name, 1
    while out in taken:
        out, k = f"{name}_{k}", k + 1
    return out


def _copy_fields(dst, src, leave: str) -> None:
    """Copy every set field of protobuf message ``src`` into ``dst`` except ``leave``."""
    for fd, value in src.ListFields():
        if fd.name == leave:
            continue
        # protobuf's upb descriptors have is_repeated and no label; older ones only label
        if fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED:
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def copy_model(model: onnx.ModelProto, skip=frozenset()) -> onnx.ModelProto:
    """A copy of ``model`` without the initializers named in ``skip`` (the weights a caller
    replaces: quantized ones, or ones it feeds as inputs); :func:`restore_initializers` puts back
    those the copy still reads.

    Copying the whole model and then removing them costs their memory until the copy is freed:
    protobuf's upb backend (the default) keeps a message's removed elements in its arena. A Q/DQ
    model built that way held every float weight it had replaced for the rest of the run (302 MB
    MatMul stack: 614 MB where the model's tensors are 76 MB)."""
    out = onnx.ModelProto()
    if not skip:
        out.CopyFrom(model)
        return out
    _copy_fields(out, model, "graph")
    out.graph.SetInParent()
    _copy_fields(out.graph, model.graph, "initializer")
    out.graph.initializer.extend(t for t in model.graph.initializer if t.name not in skip)
    return out


def _read_names(graph: onnx.GraphProto) -> set[str]:
    """Names a graph's nodes (their subgraphs included) and outputs read."""
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for n in graph.node:
        used.update(_subgraph_outer_refs(n))
    return used


def restore_initializers(graph: onnx.GraphProto, source: onnx.GraphProto, skipped) -> None:
    """After :func:`copy_model`: the initializers of ``skipped`` that ``graph`` still reads come
    back from ``source`` (e.g. a weight also read by a layer left float); the graph-input
    entries (old IR versions list initializers there) of the others go."""
    skipped = set(skipped) - {t.name for t in graph.initializer}
    if not skipped:
        return
    used = _read_names(graph)
    graph.initializer.extend(t for t in source.initializer if t.name in skipped and t.name in used)
    gone = skipped - used
    if any(i.name in gone for i in graph.input):
        keep = [i for i in graph.input if i.name not in gone]
        del graph.input[:]
        graph.input.extend(keep)


def drop_unused_initializers(graph: onnx.GraphProto) -> int:
    """Remove initializers no node, subgraph or graph output reads (and their graph-input entries,
    which old IR versions list); returns how many went."""
    used = _read_names(graph)
    dropped = {t.name for t in graph.initializer if t.name not in used}
    if not dropped:
        return 0
    keep = [t for t in graph.initializer if t.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    keep_inputs = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(keep_inputs)
    return len(dropped)


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """A node's subgraphs (If branches, Loop/Scan bodies)."""
    out = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            out.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            out.extend(attr.graphs)
    return out


def _subgraph_outer_refs(node: onnx.NodeProto) -> list[str]:
    """Names a node's subgraphs (If/Loop/Scan bodies) read from the enclosing scope."""
    refs: list[str] = []
    for sub in subgraphs(node):
        local = {i.name for i in sub.input} | {t.name for t in sub.initializer}
        for n in sub.node:
            local.update(n.output)
        for n in sub.node:
            refs.extend(i for i in n.input if i and i not in local)
            refs.extend(r for r in _subgraph_outer_refs(n) if r not in local)
        refs.extend(o.name for o in sub.output if o.name not in local)
    return refs


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _replaced(t: onnx.TensorProto, replace: dict | None) -> onnx.TensorProto:
    """``t``, or a new tensor of its name and type holding ``replace[t.name]``."""
    if not replace or t.name not in replace:
        return t
    dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    return numpy_helper.from_array(np.asarray(replace[t.name]).astype(dtype), t.name)


def serialized_with(serialized: bytes, tensors) -> bytes:
    """``serialized`` (a ModelProto) with ``tensors`` appended to its graph's initializers,
    without a protobuf copy of them: protobuf merges an embedded message field that occurs
    twice, and concatenates its repeated fields, so the bytes of ``ModelProto{graph:
    GraphProto{initializer: [...]}}`` appended are the model with those initializers added."""
    pieces = [serialized]
    for t in tensors:
        b = t.SerializeToString()
        pieces += [b"\x2a", _varint(len(b)), b]           # GraphProto.initializer = 5, length-delimited
    size = sum(len(p) for p in pieces[1:])
    pieces[1:1] = [b"\x3a", _varint(size)]                 # ModelProto.graph = 7
    return b"".join(pieces)


def _add_external_ref(graph: onnx.GraphProto, t: onnx.TensorProto, **entries: str) -> None:
    """Append to ``graph`` an initializer of ``t``'s name, type and dims whose data lies in an
    external file (``entries``: location, offset, length)."""
    ref = graph.initializer.add()
    ref.name, ref.data_type = t.name, t.data_type
    ref.dims.extend(t.dims)
    ref.data_location = onnx.TensorProto.EXTERNAL
    for key, value in entries.items():
        entry = ref.external_data.add()
        entry.key, entry.value = key, value


def write_external(model: onnx.ModelProto, path: str, initializers: onnx.GraphProto | None = None,
                   replace: dict | None = None) -> None:
    """Write ``model`` (with ``initializers``' initializers too, see :func:`copy_model`) to
    ``path``, its initializers of 1 KB and more in ``<path>.data`` beside it, for a session or
    shape inference to read; the model in memory is not touched.

    ``onnx.save_model(..., save_as_external_data=True)`` rewrites the model's tensors into
    references and reading the data back restores them: the tensors come back as new copies, and
    protobuf's upb backend keeps the old ones' memory until the model is freed, so every session
    of a model over 1.8 GB grew the run by the model's size (a 2.15 GB model: 18.9 GB).
    ``replace``: initializer name -> the value written for it (its type kept)."""
    folder, base = os.path.split(str(path))
    data_name = base + ".data"
    stub = copy_model(model, {t.name for t in model.graph.initializer})
    sources = list(model.graph.initializer) + (list(initializers.initializer) if initializers is not None else [])
    offset = 0
    with open(os.path.join(folder, data_name), "wb") as fh:
        for t in sources:
            t = _replaced(t, replace)
            if t.data_location == onnx.TensorProto.EXTERNAL or t.ByteSize() < 1024:
                stub.graph.initializer.append(t)
                continue
            data = t.raw_data if t.HasField("raw_data") else numpy_helper.to_array(t).tobytes()
            pad = (-offset) % 4096            # page-aligned, as onnx writes them
            fh.write(b"\0" * pad)
            offset += pad
            fh.write(data)
            _add_external_ref(stub.graph, t, location=data_name, offset=str(offset), length=str(len(data)))
            offset += len(data)
            del data
    try:
        serialized = stub.SerializeToString()
    except Exception:  # noqa: BLE001 - upb's EncodeError, ValueError: past 2 GiB
        # tensors this leaves inline (Constant nodes, If/Loop bodies' initializers) are past the
        # limit themselves: onnx's writer moves every tensor out, on a copy
        del stub
        os.remove(os.path.join(folder, data_name))
        m = onnx.ModelProto()
        m.CopyFrom(model)
        if initializers is not None:
            m.graph.initializer.extend(initializers.initializer)
        for t in m.graph.initializer:
            if replace and t.name in replace:
                t.CopyFrom(_replaced(t, replace))
        onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name, size_threshold=1024, convert_attribute=True)
        return
    with open(str(path), "wb") as fh:
        fh.write(serialized)


def _weight_bytes(model: onnx.ModelProto) -> int:
    return weight_bytes(model.graph)


def weight_bytes(graph: onnx.GraphProto) -> int:
    """Bytes a graph's initializers and Constant nodes hold in memory, plus a generous allowance
    for the graph: cheap, where ``ByteSize()`` costs as much as serializing."""
    total = 0
    tensors = list(graph.initializer) + [a.t for n in graph.node if n.op_type == "Constant"
                                         for a in n.attribute if a.HasField("t")]
    for t in tensors:
        # raw_data from its shape and type: len(t.raw_data) makes a copy of the bytes (0.35 s over
        # a MiniLM run's calls; found by a profile); a type without a fixed size is measured
        size = _BYTES.get(t.data_type) if t.HasField("raw_data") else None
        if size is not None:
            total += size * int(np.prod(t.dims, dtype=np.int64))
        else:
            total += len(t.raw_data)
        total += 4 * (len(t.float_data) + len(t.int32_data)) \
            + 8 * (len(t.int64_data) + len(t.double_data)) + sum(len(x) for x in t.string_data)
    return total + 1_000_000


def model_bytes(model: onnx.ModelProto) -> int:
    """``model.ByteSize()``, or at least 2 GiB where a model is past protobuf's limit: protobuf's
    upb backend (the default since 4.21) raises EncodeError from ``ByteSize()`` there instead of
    answering, which had ended every run on a model over 2 GiB in a traceback (found by a hunt)."""
    weights = _weight_bytes(model)
    if weights > PROTOBUF_LIMIT:
        return weights
    try:
        return model.ByteSize()
    except Exception:  # noqa: BLE001 - EncodeError (upb), ValueError: past the limit either way
        return max(weights, PROTOBUF_LIMIT + 1)


def over_threshold(model: onnx.ModelProto) -> bool:
    """Whether the model is too big to serialize as one protobuf (EXTERNAL_THRESHOLD). Exact
    ``ByteSize()`` only when the weights alone come within 10% of it."""
    if _weight_bytes(model) < 0.9 * EXTERNAL_THRESHOLD:
        return False
    return model_bytes(model) >= EXTERNAL_THRESHOLD


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference with data propagation; through a file for models over 2 GB.

    The model's own value_info is inferred afresh, not kept: ONNX's inference keeps and spreads
    it, and a model shape-inferred at batch 1 whose inputs were then made dynamic by hand still
    declared [1, ...] inside (onnxruntime runs such a model at batch 2, but the quantized one's
    If switches checked their outputs against the stale shapes and failed). Entries inference
    cannot redo (a custom op's outputs: ONNX's inference does not know the op) stay in for the
    inference, so that the ops after them get their types and ranks (a decomposed LayerNorm after
    a com.microsoft Gelu was no longer fused)."""
    saved = list(model.graph.value_info)
    standard = {o for n in model.graph.node if n.domain in ("", "ai.onnx") for o in n.output}
    del model.graph.value_info[:]
    model.graph.value_info.extend(v for v in saved if v.name not in standard)
    try:
        if not over_threshold(model):
            try:
                # on the model without its float weights' data (their types and dims kept): the
                # whole model through onnx's inference (serialized, parsed, inferred, serialized
                # and parsed back) cost 3.8x the weights at load, the peak of a -D qnn run on a
                # 302 MB model (found by a hunt)
                inferred = _with_weights(shape_inference.infer_shapes(_shape_stub(model), data_prop=True), model)
            except Exception:  # noqa: BLE001 - a model the stub does not serve: the whole model
                inferred = shape_inference.infer_shapes(model, data_prop=True)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                src, dst = os.path.join(tmp, "in.onnx"), os.path.join(tmp, "out.onnx")
                write_external(model, src)
                shape_inference.infer_shapes_path(src, dst, data_prop=True)
                inferred = _with_value_info(model, onnx.load(dst, load_external_data=False))  # our tensors stay
    except Exception as exc:  # inference is an aid, never a reason to stop
        del model.graph.value_info[:]
        model.graph.value_info.extend(saved)
        log.warning("shape inference failed (%s); tensors without a known float type will not be "
                    "quantized (see the report's decisions)", _first_line(exc))
        return model
    have = {v.name for v in inferred.graph.value_info if v.type.tensor_type.elem_type}
    inferred.graph.value_info.extend(v for v in saved if v.name not in have)
    if inferred is not model:
        del model.graph.value_info[:]
        model.graph.value_info.extend(saved)     # the caller's model as it came
    return inferred


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


_NOT_READ = "__dipoorlet_not_read__"


def _shape_stub(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose float initializers of 1 KB and more hold no data (references to
    external data nothing reads; type and dims kept; in their places), for shape inference: the
    integer constants data propagation reads (shapes, axes) stay."""
    stub = copy_model(model, {t.name for t in model.graph.initializer})
    for t in model.graph.initializer:
        if t.data_type in _FLOATS and t.ByteSize() >= 1024:
            _add_external_ref(stub.graph, t, location=_NOT_READ)
        else:
            stub.graph.initializer.append(t)
    return stub


def _with_weights(inferred: onnx.ModelProto, model: onnx.ModelProto) -> onnx.ModelProto:
    """The inferred stub (:func:`_shape_stub`) with ``model``'s weights in their places: the model
    onnx's inference of the whole model gives (its outputs' and If/Loop bodies' types too), for a
    copy of the weights instead of four."""
    stubs = inferred.graph.initializer
    if len(stubs) != len(model.graph.initializer):
        raise ValueError("the inferred model's initializers do not line up with the model's")
    for k, t in enumerate(model.graph.initializer):
        s = stubs[k]
        if s.name != t.name:
            raise ValueError(f"initializer {k}: {s.name} where {t.name} was")
        if s.data_location == onnx.TensorProto.EXTERNAL and any(e.value == _NOT_READ for e in s.external_data):
            s.CopyFrom(t)
    return inferred


def _with_value_info(model: onnx.ModelProto, inferred: onnx.ModelProto) -> onnx.ModelProto:
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    return model


def save_model(model: onnx.ModelProto, path: str | os.PathLike, external: bool | None = None,
               replace: dict | None = None) -> Path:
    """Save atomically; models over ~1.8 GB (or when asked) go out with external data.
    ``replace``: initializer name -> the value written for it (the model in memory keeps its own;
    writing them into it had kept both copies in protobuf's arena for the rest of the run)."""
    path = Path(path)
    if external is None:
        external = over_threshold(model)
    if not external:
        if replace:
            stub = copy_model(model, {t.name for t in model.graph.initializer})
            data = serialized_with(stub.SerializeToString(), (_replaced(t, replace) for t in model.graph.initializer))
            del stub
        else:
            data = model.SerializeToString()
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
        return path
    data_name = path.name + ".data"
    with atomic_path(path.parent / data_name) as tmp_data, atomic_path(path) as tmp_model:
        # onnx writes the data file next to the model under the location name; write both
        # into a private folder and move them into place together. Tensors under 1 KB stay in
        # the model: onnxruntime's shape inference cannot read a Reshape's shape or an
        # Unsqueeze's axes from external data (size_threshold=0 wrote models it refused to load)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            # not onnx's save with external data, which rewrites the tensors it is given (a
            # copy of the model had been made for it: 2 GB more at the end of a 2.15 GB run)
            write_external(model, os.path.join(tmp, path.name), replace=replace)
            os.replace(os.path.join(tmp, path.name), tmp_model)
            if os.path.exists(os.path.join(tmp, data_name)):
                os.replace(os.path.join(tmp, data_name), tmp_data)
            else:  # no tensor at all: an empty data file keeps the pair consistent
                open(tmp_data, "wb").close()
            # the files onnx made replaced the ones atomic_path gave the umask's mode (onnx's data
            # file came out 0600): both get the mode any new file gets here, as every output does
            from dipoorlet.util import _umask

            for f in (tmp_model, tmp_data):
                os.chmod(f, 0o666 & ~_umask())
    return path
