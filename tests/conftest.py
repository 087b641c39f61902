"""Shared tiny-model builders and helpers for the dipoorlet test suite.

Every model is built in memory with ``onnx.helper``; every file is written under ``tmp_path``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import settings
from onnx import TensorProto, helper, numpy_helper

import dipoorlet
from dipoorlet.stats import Histogram, TensorStats

# no example database in the working tree, no timing-based failures on a loaded CI machine
settings.register_profile("dipoorlet", database=None, deadline=None)
settings.load_profile("dipoorlet")

FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
IR_VERSION = 8  # accepted by every onnxruntime >= 1.17 for opsets 11..17


# ---- model construction -------------------------------------------------------------------
def vi(name: str, shape, elem=FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def make_model(nodes, inputs, outputs, inits: dict | None = None, opset: int = 13,
               extra_opsets=(), check: bool = True) -> onnx.ModelProto:
    """A model from nodes, graph inputs/outputs (ValueInfos) and {name: ndarray} initializers."""
    initializers = [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()]
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), initializer=initializers)
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in extra_opsets]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = IR_VERSION
    if check:
        onnx.checker.check_model(model)
    return model


def rand(shape, seed=0, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def conv_model(cin=3, cout=4, hw=8, k=3, bias=True, opset=13, seed=0, dynamic_hw=False) -> onnx.ModelProto:
    """x[1,cin,hw,hw] -> Conv(k x k, same padding) -> y."""
    pad = k // 2
    inits = {"w": rand((cout, cin, k, k), seed, 0.3)}
    ins = ["x", "w"]
    if bias:
        inits["b"] = rand((cout,), seed + 1, 0.1)
        ins.append("b")
    node = helper.make_node("Conv", ins, ["y"], name="conv", pads=[pad] * 4)
    shape = [1, cin, "H", "W"] if dynamic_hw else [1, cin, hw, hw]
    out_shape = [1, cout, "H", "W"] if dynamic_hw else [1, cout, hw, hw]
    return make_model([node], [vi("x", shape)], [vi("y", out_shape)], inits, opset=opset)


def tiny_cnn(seed=0, opset=13) -> onnx.ModelProto:
    """A sensible small CNN: Conv-Relu-MaxPool-Conv-Relu + residual Add-GAP-Flatten-Gemm."""
    r = np.random.default_rng(seed)
    he = lambda shape, fan_in: (r.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)
    inits = {
        "w1": he((8, 3, 3, 3), 27), "b1": (r.standard_normal(8) * 0.1).astype(np.float32),
        "w2": he((8, 8, 3, 3), 72), "b2": (r.standard_normal(8) * 0.1).astype(np.float32),
        "wf": he((10, 8), 8), "bf": (r.standard_normal(10) * 0.1).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "p1"], ["a2"], name="add2"),
        helper.make_node("Relu", ["a2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], name="fc", transB=1),
    ]
    return make_model(nodes, [vi("x", [1, 3, 16, 16])], [vi("logits", [1, 10])], inits, opset=opset)


# ---- calibration data ---------------------------------------------------------------------
def input_feeds(model: onnx.ModelProto, n: int, seed: int = 0, int_high: int = 10) -> list[dict]:
    """n random feeds matching the model's (static) input shapes: floats N(0,1), ints in [0, int_high)."""
    r = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = [{} for _ in range(n)]
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        for f in feeds:
            if tt.elem_type == FLOAT:
                f[inp.name] = r.standard_normal(shape).astype(np.float32)
            else:
                dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
                f[inp.name] = r.integers(0, int_high, size=shape).astype(dtype)
    return feeds


def write_samples(folder: Path, feeds: list[dict], fmt: str = "npy") -> Path:
    """The reference layout: folder/<input name>/<i>.npy (or raw .bin)."""
    for i, feed in enumerate(feeds):
        for name, arr in feed.items():
            d = Path(folder) / name
            d.mkdir(parents=True, exist_ok=True)
            if fmt == "npy":
                np.save(d / f"{i}.npy", arr)
            else:
                np.ascontiguousarray(arr).tofile(d / f"{i}.bin")
    return Path(folder)


def save(model: onnx.ModelProto, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    return path


def quantize_model(tmp_path: Path, model: onnx.ModelProto, n: int = 4, feeds=None, act_quant="minmax",
                   deploy="trt", **kwargs):
    """Save ``model``, write ``n`` samples, run dipoorlet.quantize; returns (result, quant model)."""
    model_path = save(model, tmp_path / "model.onnx")
    feeds = feeds if feeds is not None else input_feeds(model, n)
    data = write_samples(tmp_path / "data", feeds)
    out = tmp_path / "out"
    result = dipoorlet.quantize(model=model_path, input_dir=data, data_num=len(feeds), deploy=deploy,
                                output_dir=out, act_quant=act_quant, **kwargs)
    return result, onnx.load(str(out / "quant_model.onnx"))


# ---- onnxruntime ----------------------------------------------------------------------------
def ort_session(model, optimize: bool = False) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.log_severity_level = 3
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def _int8_kernels_saturate() -> bool:
    """onnxruntime's x86 integer kernels without VNNI multiply u8 x s8 pairs into 16 bits with
    saturation (MLAS on AVX2): an optimized run of a quantized model then differs from the
    simulated one by more than rounding. VNNI (avx512_vnni, avx_vnni) and ARM's dot products do not."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:      # no way to tell (macOS): assume the kernels may saturate
        return True
    return not any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


# cosine between onnxruntime's integer kernels and the simulated (Q/DQ as float) model: tight
# where the kernels are exact, looser where they saturate (measured 0.985 on an AVX2-only EPYC)
KERNEL_COS = 0.95 if _int8_kernels_saturate() else 0.99


def ort_run(model, feed: dict, optimize: bool = False) -> list[np.ndarray]:
    return ort_session(model, optimize).run(None, feed)


# ---- graph inspection -----------------------------------------------------------------------
def producer(model: onnx.ModelProto, tensor: str):
    return next((n for n in model.graph.node if tensor in n.output), None)


def consumers(model: onnx.ModelProto, tensor: str) -> list:
    return [n for n in model.graph.node if tensor in n.input]


def node(model: onnx.ModelProto, name: str):
    found = [n for n in model.graph.node if n.name == name]
    assert len(found) == 1, f"expected one node named {name!r}, found {len(found)}"
    return found[0]


def initializer(model: onnx.ModelProto, name: str):
    t = next((t for t in model.graph.initializer if t.name == name), None)
    return None if t is None else numpy_helper.to_array(t)


def is_dequantized(model: onnx.ModelProto, tensor: str) -> bool:
    """True when ``tensor`` is the output of a DequantizeLinear fed by a QuantizeLinear."""
    dq = producer(model, tensor)
    if dq is None or dq.op_type != "DequantizeLinear":
        return False
    q = producer(model, dq.input[0])
    return q is not None and q.op_type == "QuantizeLinear"


def quantized_tensors(model: onnx.ModelProto) -> set[str]:
    """Float tensors read by some QuantizeLinear."""
    return {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}


def attr(n, name, default=None):
    a = next((a for a in n.attribute if a.name == name), None)
    return default if a is None else helper.get_attribute_value(a)


# ---- statistics -----------------------------------------------------------------------------
def stats_from(x: np.ndarray, bins: int = 2048) -> TensorStats:
    """TensorStats of raw data, as the two calibration passes build them."""
    st = TensorStats()
    st.minmax.update(float(x.min()), float(x.max()))
    st.hist = Histogram(st.minmax.lo, st.minmax.hi, bins)
    st.hist.update(x)
    return st


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def weight_ints(q: onnx.ModelProto, name: str) -> np.ndarray:
    """The integers the quantized model's weight DequantizeLinear reads for float weight ``name``."""
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    for node in q.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits and inits[node.input[0]].dtype == np.int8:
            if name in node.input[0] or name in node.output[0]:
                return inits[node.input[0]]
    # weights stored float with a Q/DQ pair on them: quantize as the model would
    for node in q.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] == name:
            scale = inits[node.input[1]]
            return np.rint(inits[name] / scale.reshape(-1, *[1] * (inits[name].ndim - 1))).astype(np.int64)
    raise AssertionError(f"no quantized weight for {name}")


def zero_input_add_model():
    """Relu(x) -> Add(a, C) -> Reshape -> MatMul, and feeds on which the Relu's output is 0 in every
    sample (the Add's input grid is dropped): (model, feeds)."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Add", ["a", "C"], ["r"], name="add"),
             helper.make_node("Reshape", ["r", "shape"], ["r2"], name="reshape"),
             helper.make_node("MatMul", ["r2", "M"], ["y"], name="fc")]
    model = make_model(nodes, [vi("x", [1, 4, 2])], [vi("y", [1, 3])],
                       {"C": rand((1, 4, 2), 0), "shape": np.array([1, 8], np.int64), "M": rand((8, 3), 1)})
    feeds = [{"x": -np.abs(np.random.default_rng(k).normal(size=(1, 4, 2))).astype(np.float32) - 0.1} for k in range(4)]
    return model, feeds
