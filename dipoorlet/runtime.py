"""onnxruntime sessions that expose chosen tensors; the only module that imports onnxruntime.

A :class:`Runner` is built once per pass (never once per sample). It exposes the tensors a pass
needs as graph outputs and, for range passes, appends ``ReduceMin``/``ReduceMax`` nodes inside the
graph so that only two scalars per tensor leave onnxruntime instead of whole activations.

Float passes run with onnxruntime's full graph optimizations. Quantized (QDQ) models are run so
that Q/DQ execute as float arithmetic: that measures the quantization itself and not the
saturation quirks of CPU int8 kernels on processors without VNNI. ``optimize=False`` turns every
optimization off (the reference simulation); ``optimize="simulate"`` keeps onnxruntime's basic
level (constant folding, which dequantizes constant weights once and lets MatMul prepack them;
shape subgraphs folded; Transposes moved through per-tensor Q/DQ) with every Q/DQ fusion off, so
Q/DQ still run as float. The two agree up to float rounding (summation order, a Mul/Add folded
into a Conv's weights, LayerNormalization and Gelu fusions), whose last-bit differences flip an
occasional rounding at a later Q: on MiniLM-L6 the embedding cosine to the float model is
0.99683 with everything off and 0.99688 with "simulate", and its inference runs 4x faster (the
bias-correction pass as a whole 2x).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import time

import numpy as np
import onnx
from onnx import helper

from dipoorlet.errors import ModelError
from dipoorlet import graph as _graph
from dipoorlet.graph import opset_of, write_external

log = logging.getLogger(__name__)

MIN_SUFFIX, MAX_SUFFIX = "__dpl_min", "__dpl_max"
SIMULATE = "simulate"
# onnxruntime's transformers that turn Q/DQ into integer kernels or merge requantizations
# ("session.disable_quant_qdq" covers the selector-action fusions; these are named to be sure),
# and its TransposeOptimizer, which moves a Transpose past the Q/DQ after it: a layer output read
# through a Transpose (K before Q.K^T) was then fetched rounded, while every other layer's is
# fetched before its rounding (the profile said 38.5 dB where the written model's tensor is 41.2 dB)
QDQ_TRANSFORMERS = ["QDQSelectorActionTransformer", "QDQS8ToU8Transformer", "DoubleQDQPairsRemover",
                    "QDQFinalCleanupTransformer", "ClipQuantRewrite", "ReluQuantRewrite", "TransposeOptimizer"]


def _ort():
    import onnxruntime

    onnxruntime.set_default_logger_severity(4)     # its errors come back as exceptions
    return onnxruntime


def ort_message(exc: BaseException) -> str:
    """onnxruntime's error without its C++ file/function prefix, on one line."""
    msg = " ".join(str(exc).split())
    msg = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", msg)
    # "<path>.cc:97 <return type> onnxruntime::Class::Fn(<args>) const <message>": drop up to the
    # parenthesis that closes the signature's argument list (the message may hold parentheses too)
    loc = re.search(r"\.(?:cc|cpp|h):\d+ ", msg)
    if loc and "onnxruntime::" in msg[loc.end():]:
        start = msg.find("(", loc.end())
        depth, end = 0, -1
        for k in range(start, len(msg) if start >= 0 else 0):
            depth += {"(": 1, ")": -1}.get(msg[k], 0)
            if depth == 0:
                end = k
                break
        if end >= 0:
            rest = msg[end + 1:].lstrip()
            rest = rest[len("const"):].lstrip() if rest.startswith("const ") else rest
            head = msg[:msg.rfind(" ", 0, loc.start()) + 1]     # "... node. Name:'mm' Status Message: "
            msg = head + rest
    return msg[:300]


def available_providers() -> list[str]:
    return list(_ort().get_available_providers())


def choose_providers(device: str = "cpu") -> list[str]:
    have = available_providers()
    if device == "cuda":
        if "CUDAExecutionProvider" not in have:
            from dipoorlet.errors import ConfigError
            raise ConfigError("--device cuda asked for onnxruntime's CUDA provider, which this "
                              "onnxruntime lacks; pip install 'dipoorlet[gpu]' (onnxruntime-gpu)")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


NAN_GUARD = "__dpl_nan_guard"


def _exposed_model_bytes_or_path(model: onnx.ModelProto, outputs: list[str],
                                 reduce_minmax: list[str], types: dict, tmpdir: str, nan_safe: bool = False,
                                 guard: bool = False, initializers: onnx.GraphProto | None = None):
    """Serialize ``model`` with the requested outputs (and reductions) without copying it.
    ``guard``: plain reductions plus one scalar output :data:`NAN_GUARD`, the sum of every
    reduced tensor's sum: NaN where any of them holds a NaN (a NaN always propagates through a
    sum), so the caller redoes only those samples NaN-safe. ``initializers``: a graph whose
    initializers the model takes as well (a model :func:`~dipoorlet.graph.copy_model` left
    without them)."""
    g = model.graph
    saved_outputs = list(g.output)
    n_nodes = len(g.node)
    try:
        del g.output[:]
        by_name = {o.name: o for o in saved_outputs}
        for name in outputs:
            if name in by_name:
                g.output.append(by_name[name])
            else:
                elem = types.get(name, (onnx.TensorProto.FLOAT, None))[0]
                # UNDEFINED: no type at all, for onnxruntime to fill in (see resolve_types)
                g.output.append(helper.make_tensor_value_info(name, elem, None) if elem
                                else onnx.ValueInfoProto(name=name))
        if reduce_minmax and nan_safe:
            # NaN left out of the ranges: onnxruntime's ReduceMax over a NaN gives NaN or a value
            # below the true maximum depending on where the NaN sits (1.857 for a max of 2.0),
            # which clipped real values. NaN becomes +inf for the min and -inf for the max; a
            # tensor NaN everywhere comes out as the empty range (+inf, -inf)
            for value, cname in ((np.inf, "__dpl_pinf"), (-np.inf, "__dpl_ninf")):
                g.node.append(helper.make_node("Constant", [], [cname], name=cname,
                                               value=helper.make_tensor(cname, onnx.TensorProto.FLOAT, [], [value])))
        for name in reduce_minmax:
            nan = name + "__dpl_isnan"
            if nan_safe:
                g.node.append(helper.make_node("IsNaN", [name], [nan], name=nan))
            for op, suffix, fill in (("ReduceMin", MIN_SUFFIX, "__dpl_pinf"), ("ReduceMax", MAX_SUFFIX, "__dpl_ninf")):
                out = name + suffix
                src = name
                if nan_safe:
                    src = out + "__in"
                    g.node.append(helper.make_node("Where", [nan, fill, name], [src], name=src))
                g.node.append(helper.make_node(op, [src], [out], name=out, keepdims=0))
                g.output.append(helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, []))
        if reduce_minmax and guard:
            sums = []
            for name in reduce_minmax:
                s = name + "__dpl_sum"
                g.node.append(helper.make_node("ReduceSum", [name], [s], name=s, keepdims=0))
                g.node.append(helper.make_node("Cast", [s], [s + "_f"], name=s + "_f", to=onnx.TensorProto.FLOAT))
                sums.append(s + "_f")
            g.node.append(helper.make_node("Sum", sums, [NAN_GUARD], name=NAN_GUARD))
            g.output.append(helper.make_tensor_value_info(NAN_GUARD, onnx.TensorProto.FLOAT, []))
        # ByteSize() costs as much as serializing; the weights' own bytes decide all but the
        # borderline cases
        if initializers is not None:
            if _graph.weight_bytes(g) + _graph.weight_bytes(initializers) < 0.9 * _graph.EXTERNAL_THRESHOLD:
                return _graph.serialized_with(model.SerializeToString(), initializers.initializer)
        elif not _graph.over_threshold(model):
            return model.SerializeToString()
        path = os.path.join(tmpdir, "model.onnx")
        write_external(model, path, initializers)
        return path
    finally:
        del g.output[:]
        g.output.extend(saved_outputs)
        while len(g.node) > n_nodes:
            g.node.pop()


# --custom_op_lib: libraries every session of the run registers (set for one run by
# :func:`custom_op_libs`; the model's ops from their domains stay float)
_CUSTOM_OP_LIBS: list[str] = []
ORT_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc", "com.ms.internal.nhwc")


@contextlib.contextmanager
def custom_op_libs(paths):
    """Register ``paths`` in every session made inside the block."""
    saved = list(_CUSTOM_OP_LIBS)
    _CUSTOM_OP_LIBS[:] = [str(p) for p in paths]
    try:
        yield
    finally:
        _CUSTOM_OP_LIBS[:] = saved


def session_options():
    """onnxruntime SessionOptions with this run's custom-op libraries and logging off (its errors
    come back as exceptions)."""
    ort = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 4
    for lib in _CUSTOM_OP_LIBS:
        try:
            so.register_custom_ops_library(lib)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
            from dipoorlet.errors import ConfigError
            raise ConfigError(f"--custom_op_lib {lib}: onnxruntime cannot load it ({ort_message(exc)}); pass a "
                              f"custom-op library built for this onnxruntime ({ort.__version__})") from exc
    return so


def _custom_ops(model: onnx.ModelProto) -> list[str]:
    """The ops of domains onnxruntime does not have, subgraphs (If/Loop/Scan bodies) included."""
    found = set()

    def walk(graph):
        for n in graph.node:
            if n.domain not in ORT_DOMAINS:
                found.add(f"{n.op_type} ({n.domain})")
            for sub in _graph.subgraphs(n):
                walk(sub)

    walk(model.graph)
    return sorted(found)


_ORT_TYPES = {"tensor(float)": onnx.TensorProto.FLOAT, "tensor(double)": onnx.TensorProto.DOUBLE,
              "tensor(float16)": onnx.TensorProto.FLOAT16, "tensor(bfloat16)": onnx.TensorProto.BFLOAT16,
              "tensor(int64)": onnx.TensorProto.INT64, "tensor(int32)": onnx.TensorProto.INT32,
              "tensor(int16)": onnx.TensorProto.INT16, "tensor(int8)": onnx.TensorProto.INT8,
              "tensor(uint8)": onnx.TensorProto.UINT8, "tensor(bool)": onnx.TensorProto.BOOL}


def resolve_types(model: onnx.ModelProto, names: list[str]) -> dict[str, int]:
    """Element types onnxruntime resolves for tensors ONNX shape inference left untyped (the
    outputs of custom ops, whose schemas live in their --custom_op_lib): a session is built with
    them as typeless outputs, nothing is run. {} where onnxruntime cannot build it."""
    ort = _ort()
    outputs = [o.name for o in model.graph.output] + list(names)
    try:
        so = session_options()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        with tempfile.TemporaryDirectory(prefix="dipoorlet-") as tmp:
            src = _exposed_model_bytes_or_path(model, outputs, [], {n: (onnx.TensorProto.UNDEFINED, None)
                                                                   for n in names}, tmp)
            sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
        found = {o.name: _ORT_TYPES.get(o.type) for o in sess.get_outputs()}
        return {n: found[n] for n in names if found.get(n)}
    except Exception as exc:  # noqa: BLE001 - the later passes report a model onnxruntime cannot load
        log.debug("onnxruntime could not resolve the types of %d tensors: %s", len(names), ort_message(exc))
        return {}


_LIBC = None


def return_freed_memory() -> None:
    """Hand the heap memory freed since the last call back to the system (glibc ``malloc_trim``;
    elsewhere nothing). A freed onnxruntime session leaves its weights' blocks in glibc's heap,
    below its mmap threshold, where the next session's blocks of other sizes do not fit: each
    pass of a large model then added to the peak (302 MB MatMul stack: three float sessions in a
    row held 879, 943 and 960 MB; trimmed after each, 357 MB once freed). No ``gc.collect()``:
    the sessions go by reference counting, and it cost 40 ms a pass on the PP-OCR classifier for
    the same peak (1533 MB without it, 1567 MB with it, on that stack)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False       # not glibc (macOS, musl, Windows)
    if _LIBC:
        _LIBC.malloc_trim(0)


def release_model_bytes(session) -> None:
    """Let go of the serialized model an onnxruntime session built from bytes keeps.

    onnxruntime's Python ``InferenceSession`` holds the bytes it was built from for the session's
    lifetime (``_model_bytes``, kept only to rebuild the session when a run on another provider
    falls back to the CPU): one more copy of the whole model for every live session, next to the
    weights onnxruntime itself holds. On a 302 MB MatMul stack the profile's two sessions held
    0.4 GB of them. With the bytes gone that rebuild is impossible, so the fallback is turned off
    too: a CUDA failure is reported, not rerun on the CPU behind the user's back."""
    if getattr(session, "_model_bytes", None) is not None:
        session._model_bytes = None
        if hasattr(session, "disable_fallback"):
            session.disable_fallback()


class Runner:
    """One onnxruntime session for one pass, exposing ``outputs`` and per-tensor min/max."""

    def __init__(self, model: onnx.ModelProto, outputs: list[str], *, reduce_minmax=(),
                 types: dict | None = None, optimize: bool | str = True, device: str = "cpu",
                 threads: int = 0, spin: bool = False, nan_safe: bool | str = False,
                 initializers: onnx.GraphProto | None = None, quantized: bool = False):
        """``nan_safe``: the min/max reductions leave NaN out. ``True``: plain reductions plus a
        guard that flags a sample holding NaN, which a NaN-safe session (built on first need)
        measures again; ``"where"``: that NaN-safe session itself (IsNaN and two Where per tensor,
        full-size copies that cost as much as the reductions). A pass that fetches the tensors
        themselves finds NaN in them for less, see calibrate.histogram_pass. ``initializers``: a
        graph whose initializers the session takes as well (see _exposed_model_bytes_or_path)."""
        ort = _ort()
        self.outputs = list(outputs)
        self.reduced = list(reduce_minmax)
        self.quantized = quantized   # a model with dipoorlet's Q/DQ: its failure is not the sample's
        # the NaN-safe session is built from ``model`` on first need: the caller leaves the model
        # as it is while it runs this one
        self._guard = bool(nan_safe and self.reduced and nan_safe != "where")
        self._safe = None
        if self._guard:
            self._safe_args = (model, dict(types or {}), optimize, device, threads, spin, initializers)
        so = session_options()
        disabled = []
        if optimize == SIMULATE:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            so.add_session_config_entry("session.disable_quant_qdq", "1")
            so.add_session_config_entry("session.disable_double_qdq_remover", "1")
            disabled = QDQ_TRANSFORMERS
        else:
            so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                           else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        from dipoorlet.threads import session_threads

        threads = threads or session_threads()       # under MPI: this process's share of the cores
        if threads:
            so.intra_op_num_threads = threads
        if not spin:
            # No busy-waiting between ops unless the caller runs this session alone: calibration
            # bins histograms on a worker thread meanwhile, and the profile and sensitivity
            # passes alternate two sessions whose spinning threads would take each other's cores
            # (measured: profile pass 3x slower). A lone session spins (onnxruntime's default):
            # otherwise every op of a small network waits for its pool threads to wake up.
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = choose_providers(device)
        built = time.perf_counter()
        return_freed_memory()       # the previous pass's session, before this one takes its share
        with tempfile.TemporaryDirectory(prefix="dipoorlet-") as tmp:
            src = _exposed_model_bytes_or_path(model, self.outputs, self.reduced, types or {}, tmp,
                                               bool(nan_safe) and not self._guard, guard=self._guard,
                                               initializers=initializers)
            try:
                self.session = ort.InferenceSession(src, so, providers=providers, disabled_optimizers=disabled)
                release_model_bytes(self.session)
            except Exception as exc:
                msg = ort_message(exc)
                custom = _custom_ops(model)
                if custom and not _CUSTOM_OP_LIBS:
                    raise ModelError(f"onnxruntime cannot run the model's custom op(s) {', '.join(custom[:4])}: "
                                     f"{msg}; pass --custom_op_lib with the onnxruntime library that implements "
                                     f"them (they stay float)") from exc
                raise ModelError(f"onnxruntime cannot load the model (opset {opset_of(model)}): "
                                 f"{msg}; check that every op is a standard ONNX op"
                                 + (f" or one of --custom_op_lib's ({', '.join(custom[:4])} here)" if custom else
                                    "") ) from exc
        self.input_names = [i.name for i in self.session.get_inputs()]
        log.debug("session built in %.2f s: %d tensors fetched, %d reduced to min/max, optimization %s, %s "
                  "thread(s), %s", time.perf_counter() - built, len(self.outputs), len(self.reduced),
                  optimize if isinstance(optimize, str) else ("all" if optimize else "off"), threads or "default",
                  ", ".join(providers))

    def run(self, feed: dict[str, np.ndarray], tensors: bool = True, ranges: bool = True):
        """Run one batch; returns (exposed tensors by name, {tensor: (min, max)}).

        ``tensors=False`` / ``ranges=False`` skip fetching those outputs (their copies out of
        onnxruntime; it still runs every node of the graph, so a pass that needs fewer outputs
        on some samples is faster with a session of its own).
        """
        out_names = self.outputs if tensors else []
        red_names = self.reduced if ranges else []
        fetch = out_names + [n + s for n in red_names for s in (MIN_SUFFIX, MAX_SUFFIX)]
        guard = self._guard and bool(red_names)
        if guard:
            fetch = fetch + [NAN_GUARD]
        try:
            values = self.session.run(fetch, {k: feed[k] for k in self.input_names})
        except Exception as exc:
            msg = ort_message(exc)
            shapes = {k: tuple(v.shape() if callable(v.shape) else v.shape) for k, v in feed.items()}
            where = getattr(feed, "where", None)
            if self.quantized:
                # the float model ran these inputs: a Q/DQ moved a value an op reads as a size, a count
                # or an index (the message had sent the user to check a correct sample; found by a sweep)
                raise ModelError(f"onnxruntime failed to run the quantized model on inputs {shapes}"
                                 f"{' from ' + where if where else ''}, which the float model runs: {msg}; a Q/DQ "
                                 "changed a value an op reads as a size, count or index: keep the op onnxruntime "
                                 "names float with --skip_layers, and please report it (--debug shows where)") from exc
            raise ModelError(f"onnxruntime failed to run the model on inputs {shapes}"
                             f"{' from ' + where if where else ''}: {msg}; check that sample's shapes, dtypes "
                             "and values (e.g. token ids within the vocabulary)") from exc
        n = len(out_names)
        found = dict(zip(out_names, values[:n]))
        mm = {name: (float(values[n + 2 * i]), float(values[n + 2 * i + 1])) for i, name in enumerate(red_names)}
        if guard and np.isnan(values[-1]):
            mm = self._safe_ranges(feed)
        return found, mm

    def _safe_ranges(self, feed) -> dict:
        if self._safe is None:
            model, types, optimize, device, threads, spin, initializers = self._safe_args
            self._safe = Runner(model, [], reduce_minmax=self.reduced, types=types, optimize=optimize,
                                device=device, threads=threads, spin=spin, nan_safe="where",
                                initializers=initializers)
        return self._safe.run(feed, tensors=False)[1]
