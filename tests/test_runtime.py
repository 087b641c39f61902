"""The "simulate" optimization level for quantized passes: constant folding on, Q/DQ still float."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from dipoorlet.runtime import SIMULATE, Runner


def _qdq(name, x, scale, nodes, inits):
    s, z = name + "_s", name + "_z"
    inits += [numpy_helper.from_array(np.array(scale, np.float32), s),
              numpy_helper.from_array(np.array(0, np.int8), z)]
    nodes += [helper.make_node("QuantizeLinear", [x, s, z], [name + "_q"], name=name + "_Q"),
              helper.make_node("DequantizeLinear", [name + "_q", s, z], [name + "_dq"], name=name + "_DQ")]
    return name + "_dq"


def _model():
    """x -> Q/DQ (0.05) -> Q/DQ (0.13): two requantizations onnxruntime's DoubleQDQPairsRemover
    would merge into one -> MatMul with a Q/DQ int8 weight (folded as a constant) -> Relu."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    a = _qdq("a", "x", 0.05, nodes, inits)
    b = _qdq("b", a, 0.13, nodes, inits)
    w = rng.normal(size=(16, 8)).astype(np.float32)
    ws = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    inits += [numpy_helper.from_array(np.clip(np.rint(w / ws), -127, 127).astype(np.int8), "w_q"),
              numpy_helper.from_array(ws, "w_s"), numpy_helper.from_array(np.zeros(8, np.int8), "w_z")]
    nodes += [helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w_dq"], name="w_DQ", axis=1),
              helper.make_node("MatMul", [b, "w_dq"], ["m"], name="mm"),
              helper.make_node("Relu", ["m"], ["y"], name="relu")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def test_simulate_keeps_every_requantization_and_matches_the_reference_evaluator():
    model = _model()
    x = np.random.default_rng(1).normal(scale=3.0, size=(4, 16)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    off = Runner(model, ["y", "b_dq"], optimize=False).run({"x": x}, ranges=False)[0]
    sim = Runner(model, ["y", "b_dq"], optimize=SIMULATE).run({"x": x}, ranges=False)[0]
    np.testing.assert_allclose(off["y"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sim["y"], want, rtol=1e-5, atol=1e-5)
    # the second Q/DQ's grid, applied to the first's output: a merged pair would give x on 0.13's grid
    twice = np.clip(np.rint(np.clip(np.rint(x / 0.05), -128, 127) * 0.05 / 0.13), -128, 127) * 0.13
    np.testing.assert_allclose(sim["b_dq"], twice.astype(np.float32), atol=1e-6)


def test_simulate_folds_the_constant_weights():
    model = _model()
    runner = Runner(model, ["y"], optimize=SIMULATE)
    import onnxruntime as ort

    assert runner.session.get_session_options().graph_optimization_level == \
        ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert runner.session.get_session_options().get_session_config_entry("session.disable_quant_qdq") == "1"


def test_progress_bars_follow_the_terminal_unless_dipoorlet_progress_says(monkeypatch):
    from dipoorlet.dist import SingleProcess
    from dipoorlet.progress import progress

    class Rank1(SingleProcess):
        rank = 1

    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    for env, rank0_shown in (("", False), ("1", True), ("0", False), ("yes", False)):
        monkeypatch.setenv("DIPOORLET_PROGRESS", env)
        assert progress([], "x").disable is not rank0_shown
        assert progress([], "x", Rank1()).disable           # other ranks never show bars


@pytest.mark.parametrize("raw, want", [
    # the C++ signature holds parentheses, and so does the message after it
    ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running MatMulIntegerToFloat node. "
     "Name:'mm' Status Message: /src/onnxruntime/contrib_ops/cpu/quantization/dynamic_quantize_matmul.cc:97 "
     "onnxruntime::common::Status onnxruntime::contrib::Base::ComputeCommon(onnxruntime::OpKernelContext*, "
     "const uint8_t*, float) const IsBQuantParamSupported(b->Shape(), c) was false. b zero point is not valid",
     "Non-zero status code returned while running MatMulIntegerToFloat node. Name:'mm' Status Message: "
     "IsBQuantParamSupported(b->Shape(), c) was false. b zero point is not valid"),
    # a message with ") " in it and no C++ location: kept whole (it used to lose "Graph output (anchors")
    ("[ONNXRuntimeError] : 10 : INVALID_GRAPH : This is an invalid model. Graph output (anchors) does not exist "
     "in the graph.", "This is an invalid model. Graph output (anchors) does not exist in the graph."),
    ("[ONNXRuntimeError] : 1 : FAIL : /src/onnxruntime/core/graph/graph.cc:12 void onnxruntime::Graph::F(int) "
     "Graph output (anchors) does not exist in the graph.", "Graph output (anchors) does not exist in the graph."),
])
def test_ort_message_drops_only_the_cpp_location_and_signature(raw, want):
    from dipoorlet.runtime import ort_message

    assert ort_message(RuntimeError(raw)) == want


def test_nan_safe_ranges_measure_again_only_the_samples_that_hold_nan():
    """Plain reductions plus a NaN guard: a sample without NaN keeps the plain session's ranges,
    and one whose tensor holds NaN is measured again NaN-safe (numpy oracle: nanmin/nanmax); the
    NaN-safe session is built on the first such sample only."""
    nodes = [helper.make_node("Sqrt", ["x"], ["s"], name="sqrt"), helper.make_node("Relu", ["x"], ["r"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 4]),
                               helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    runner = Runner(model, [], reduce_minmax=["s", "r"], nan_safe=True)
    clean = np.array([[1.0, 4.0, 9.0, 0.25]] * 2, np.float32)
    _, mm = runner.run({"x": clean}, tensors=False)
    assert mm == {"s": (0.5, 3.0), "r": (0.25, 9.0)} and runner._safe is None
    dirty = np.array([[4.0, -1.0, 2.25, 16.0], [1.0, 1.0, 1.0, 1.0]], np.float32)   # sqrt(-1) is NaN
    _, mm = runner.run({"x": dirty}, tensors=False)
    with np.errstate(invalid="ignore"):
        s = np.sqrt(dirty)
    assert mm["s"] == (float(np.nanmin(s)), float(np.nanmax(s))) == (1.0, 4.0)
    assert mm["r"] == (0.0, 16.0) and runner._safe is not None
