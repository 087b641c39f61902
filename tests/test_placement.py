"""Q/DQ placement on tiny graphs: the structure of quant_model.onnx, checked node by node."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from conftest import (attr, consumers, initializer, input_feeds, is_dequantized, make_model, node, ort_run,
                      producer, quantize_model, quantized_tensors, rand, tiny_cnn, vi)
from dipoorlet.graph import Graph
from dipoorlet.placement import place
from dipoorlet import platform as platform_mod, prepare


# ---- tiny graphs ------------------------------------------------------------------------------
def m_conv():
    return make_model([helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])],
                      [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])],
                      {"w": rand((4, 3, 3, 3), 1, 0.3), "b": rand((4,), 2, 0.1)})


def m_conv_transpose():
    return make_model([helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="deconv", strides=[2, 2])],
                      [vi("x", [1, 3, 4, 4])], [vi("y", [1, 5, 9, 9])],
                      {"w": rand((3, 5, 3, 3), 1, 0.3), "b": rand((5,), 2, 0.1)})


def m_gemm(trans_b: int):
    w = rand((4, 6), 1) if trans_b else rand((6, 4), 1)
    return make_model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", transB=trans_b)],
                      [vi("x", [2, 6])], [vi("y", [2, 4])], {"w": w, "b": rand((4,), 2)})


def m_matmul(rank: int):
    if rank == 2:
        return make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")],
                          [vi("x", [2, 6])], [vi("y", [2, 4])], {"w": rand((6, 4), 1)})
    return make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")],
                      [vi("x", [2, 3, 6])], [vi("y", [2, 3, 4])], {"w": rand((2, 6, 4), 1)})


def m_pool(op: str):
    attrs = {"kernel_shape": [2, 2]} if op != "GlobalAveragePool" else {}
    out = [1, 3, 7, 7] if op != "GlobalAveragePool" else [1, 3, 1, 1]
    return make_model([helper.make_node(op, ["x"], ["y"], name="pool", **attrs)],
                      [vi("x", [1, 3, 8, 8])], [vi("y", out)])


def m_two_convs():
    """x -> conv1 -> c1 -> relu -> r -> conv2 -> y"""
    return make_model([
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ], [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])],
        {"w1": rand((4, 3, 3, 3), 1, 0.3), "b1": rand((4,), 2, 0.1),
         "w2": rand((4, 4, 3, 3), 3, 0.3), "b2": rand((4,), 4, 0.1)})


def m_residual(swap: bool = False, c2_is_output: bool = False):
    """x -> conv1 -> relu -> r;  r -> conv2 -> c2;  y = Add(c2, r)"""
    add_in = ["r", "c2"] if swap else ["c2", "r"]
    outputs = [vi("y", [1, 4, 8, 8])] + ([vi("c2", [1, 4, 8, 8])] if c2_is_output else [])
    return make_model([
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", add_in, ["y"], name="add"),
    ], [vi("x", [1, 3, 8, 8])], outputs,
        {"w1": rand((4, 3, 3, 3), 1, 0.3), "b1": rand((4,), 2, 0.1),
         "w2": rand((4, 4, 3, 3), 3, 0.3), "b2": rand((4,), 4, 0.1)})


def m_add_const():
    return make_model([
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "k"], ["y"], name="add"),
    ], [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])],
        # a constant per pixel: a per-channel one would be folded into the Conv's bias
        {"w": rand((4, 3, 3, 3), 1, 0.3), "b": rand((4,), 2, 0.1), "k": rand((1, 1, 8, 8), 3)})


def m_pad_conv():
    return make_model([
        helper.make_node("Pad", ["x", "pads"], ["p"], name="pad"),
        helper.make_node("Conv", ["p", "w", "b"], ["y"], name="conv"),
    ], [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])],
        {"pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "w": rand((4, 3, 3, 3), 1, 0.3),
         "b": rand((4,), 2, 0.1)})


def m_shared_input():
    """x feeds a quantized Conv and a float Sigmoid."""
    return make_model([
        helper.make_node("Conv", ["x", "w", "b"], ["y1"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["x"], ["y2"], name="sigmoid"),
    ], [vi("x", [1, 3, 8, 8])], [vi("y1", [1, 4, 8, 8]), vi("y2", [1, 3, 8, 8])],
        {"w": rand((4, 3, 3, 3), 1, 0.3), "b": rand((4,), 2, 0.1)})


BUILDERS = {
    "conv": m_conv, "conv_transpose": m_conv_transpose,
    "gemm_transB1": lambda: m_gemm(1), "gemm_transB0": lambda: m_gemm(0),
    "matmul_2d": lambda: m_matmul(2), "matmul_3d": lambda: m_matmul(3),
    "maxpool": lambda: m_pool("MaxPool"), "avgpool": lambda: m_pool("AveragePool"),
    "gap": lambda: m_pool("GlobalAveragePool"),
    "two_convs": m_two_convs, "residual": m_residual, "residual_swapped": lambda: m_residual(swap=True),
    "residual_c2_output": lambda: m_residual(c2_is_output=True),
    "add_const": m_add_const, "pad_conv": m_pad_conv, "shared_input": m_shared_input,
}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """name -> (float model, quant model, output folder); each graph quantized once per module."""
    cache = {}

    def get(name, **kwargs):
        # placement rules on the graph as given: no activation shift (tests/test_shift.py) and
        # no bias correction (tests/test_transforms.py), which change biases
        kwargs.setdefault("shift", False)
        kwargs.setdefault("bias_correction", False)
        key = (name, tuple(sorted(kwargs.items())))
        if key not in cache:
            tmp = tmp_path_factory.mktemp(name)
            model = BUILDERS[name]()
            _, qm = quantize_model(tmp, model, n=3, **kwargs)
            cache[key] = (model, qm, tmp / "out")
        return cache[key]
    return get


# ---- activations ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, op_node", [
    ("conv", "conv"), ("gemm_transB1", "gemm"), ("matmul_2d", "matmul"),
    ("maxpool", "pool"), ("avgpool", "pool"), ("gap", "pool"),
])
def test_activation_input_of_quantized_op_gets_qdq(quantized, name, op_node):
    _, qm, _ = quantized(name)
    assert node(qm, op_node).input[0] == "x_dq"
    assert is_dequantized(qm, "x_dq")


def test_qdq_is_per_tensor_int8_with_zero_point_zero(quantized):
    _, qm, _ = quantized("conv")
    q = producer(qm, "x_q")
    assert attr(q, "axis") is None or initializer(qm, q.input[1]).ndim == 0
    assert initializer(qm, "x_scale").shape == () and initializer(qm, "x_scale").dtype == np.float32
    zp = initializer(qm, "x_zero_point")
    assert zp.dtype == np.int8 and zp == 0


# ---- weights -------------------------------------------------------------------------------
@pytest.mark.parametrize("name, op_node, axis", [
    ("conv", "conv", 0), ("conv_transpose", "deconv", 1),
    ("gemm_transB1", "gemm", 0), ("gemm_transB0", "gemm", 1),
    ("matmul_2d", "matmul", 1), ("matmul_3d", "matmul", 2),
])
def test_weight_stored_int8_with_per_channel_dequantize_axis(quantized, name, op_node, axis):
    model, qm, _ = quantized(name)
    w = initializer(model, "w")
    n = node(qm, op_node)
    assert n.input[1] == "w_dq"
    dq = producer(qm, "w_dq")
    assert dq.op_type == "DequantizeLinear" and dq.input[0] == "w_quantized"
    assert attr(dq, "axis") == axis
    wq = initializer(qm, "w_quantized")
    assert wq.dtype == np.int8 and wq.shape == w.shape
    assert initializer(qm, "w_scale").shape == (w.shape[axis],)
    assert initializer(qm, "w") is None  # the float copy is gone


@pytest.mark.parametrize("name, axis", [("conv", 0), ("conv_transpose", 1), ("gemm_transB0", 1), ("matmul_3d", 2)])
def test_weight_dequantizes_to_within_half_a_step_per_channel(quantized, name, axis):
    model, qm, _ = quantized(name)
    w = initializer(model, "w").astype(np.float64)
    wq = initializer(qm, "w_quantized").astype(np.float64)
    shape = [1] * w.ndim
    shape[axis] = -1
    scale = initializer(qm, "w_scale").astype(np.float64).reshape(shape)
    amax = np.abs(np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)).max(1).reshape(shape)
    np.testing.assert_allclose(scale, amax / 127, rtol=1e-6)          # narrow range, symmetric
    assert np.all(np.abs(wq * scale - w) <= scale / 2 + 1e-7)
    assert wq.min() >= -127


@pytest.mark.parametrize("name, op_node", [("conv", "conv"), ("conv_transpose", "deconv"), ("gemm_transB1", "gemm")])
def test_bias_stays_float(quantized, name, op_node):
    model, qm, _ = quantized(name)
    n = node(qm, op_node)
    assert n.input[2] == "b"
    np.testing.assert_array_equal(initializer(qm, "b"), initializer(model, "b"))
    assert "b" not in quantized_tensors(qm)


# ---- fusion rules --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["residual", "residual_swapped"])
def test_residual_add_keeps_conv_input_float_and_quantizes_the_other(quantized, name):
    _, qm, _ = quantized(name)
    add = node(qm, "add")
    assert sorted(add.input) == ["c2", "r_dq"]
    assert "c2" not in quantized_tensors(qm)
    assert is_dequantized(qm, "r_dq")


def test_add_whose_conv_input_is_used_elsewhere_is_not_fused_and_runs_float(quantized):
    _, qm, _ = quantized("residual_c2_output")
    assert sorted(node(qm, "add").input) == ["c2", "r"]


def test_matmul_bias_add_residual_add_is_seen_through(tmp_path):
    """Transformer block: MatMul -> Add(bias) -> Add(residual): the bias path stays float."""
    model = make_model([
        helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
        helper.make_node("Add", ["m", "bias"], ["mb"], name="bias_add"),
        helper.make_node("Add", ["mb", "x"], ["y"], name="residual_add"),
    ], [vi("x", [2, 8])], [vi("y", [2, 8])], {"w": rand((8, 8), 1, 0.3), "bias": rand((8,), 2, 0.1)})
    _, qm = quantize_model(tmp_path, model, n=2)
    assert list(node(qm, "bias_add").input) == ["m", "bias"]
    assert list(node(qm, "residual_add").input) == ["mb", "x_dq"]
    assert node(qm, "matmul").input[0] == "x_dq"
    assert not {"m", "mb"} & quantized_tensors(qm)


@pytest.mark.parametrize("decomposed", [False, True])
def test_residual_add_into_layernorm_stays_float(tmp_path, decomposed):
    """MatMul -> Add(bias) -> Add(residual) -> LayerNorm: TensorRT fuses the residual Add with the
    LayerNorm in float, so the residual stream gets no Q/DQ; the MatMul's input still does. The
    same holds when the exporter decomposed LayerNorm (ReduceMean and Sub read the Add)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
        helper.make_node("Add", ["m", "bias"], ["mb"], name="bias_add"),
        helper.make_node("Add", ["mb", "x"], ["r"], name="residual_add"),
    ]
    if decomposed:
        nodes += [helper.make_node("ReduceMean", ["r"], ["mu"], axes=[-1], name="mean"),
                  helper.make_node("Sub", ["r", "mu"], ["y"], name="sub")]
        opset = 13
    else:
        nodes += [helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["y"], axis=-1, name="ln")]
        opset = 17
    model = make_model(nodes, [vi("x", [2, 8])], [vi("y", [2, 8])],
                       {"w": rand((8, 8), 1, 0.3), "bias": rand((8,), 2, 0.1),
                        "gamma": np.ones(8, np.float32), "beta": np.zeros(8, np.float32)}, opset=opset)
    _, qm = quantize_model(tmp_path, model, n=2)
    assert list(node(qm, "residual_add").input) == ["mb", "x"]
    assert node(qm, "matmul").input[0] == "x_dq"
    g = Graph(model)
    prepare.prepare(g)
    decision = {d.node: d for d in place(g, platform_mod.load("trt")).decisions}["residual_add"]
    assert not decision.quantized and "LayerNorm" in decision.reason


def test_add_with_a_constant_gets_no_qdq(quantized):
    _, qm, _ = quantized("add_const")
    assert list(node(qm, "add").input) == ["c", "k"]
    assert "c" not in quantized_tensors(qm)


def test_pad_then_conv_puts_qdq_in_front_of_the_pad(quantized):
    _, qm, _ = quantized("pad_conv")
    assert node(qm, "pad").input[0] == "x_dq" and is_dequantized(qm, "x_dq")
    assert node(qm, "conv").input[0] == "p"
    assert "p" not in quantized_tensors(qm)


def test_relu_after_conv_gets_qdq_after_the_relu_only(quantized):
    _, qm, _ = quantized("two_convs")
    assert list(node(qm, "relu").input) == ["c1"]
    assert "c1" not in quantized_tensors(qm)
    assert node(qm, "conv2").input[0] == "r_dq" and is_dequantized(qm, "r_dq")


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_network_outputs_are_not_quantized(quantized, name):
    model, qm, _ = quantized(name)
    outs = [o.name for o in model.graph.output]
    assert [o.name for o in qm.graph.output] == outs
    for o in outs:
        assert producer(qm, o).op_type == producer(model, o).op_type  # still the float op's result
        if not consumers(model, o):  # an output nothing else reads gets no Q/DQ at all
            assert o not in quantized_tensors(qm)


def test_skip_layers_keeps_node_and_its_weight_float(quantized):
    _, qm, _ = quantized("two_convs", skip_layers=("conv2",))
    conv2 = node(qm, "conv2")
    assert list(conv2.input) == ["r", "w2", "b2"]
    assert initializer(qm, "w2").dtype == np.float32
    assert initializer(qm, "w2_quantized") is None
    assert node(qm, "conv1").input[1] == "w1_dq"  # the other conv is still quantized


def test_tensor_feeding_quantized_and_float_op_keeps_float_edge(quantized):
    _, qm, _ = quantized("shared_input")
    assert node(qm, "conv").input[0] == "x_dq"
    assert list(node(qm, "sigmoid").input) == ["x"]


def test_matmul_of_two_activations_quantizes_both_inputs(tmp_path):
    model = make_model([helper.make_node("MatMul", ["a", "b"], ["y"], name="matmul")],
                       [vi("a", [2, 3]), vi("b", [3, 4])], [vi("y", [2, 4])])
    _, qm = quantize_model(tmp_path, model, n=2)
    assert list(node(qm, "matmul").input) == ["a_dq", "b_dq"]
    assert not any(t.name.endswith("_quantized") for t in qm.graph.initializer)


@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
@pytest.mark.parametrize("deploy", ["trt", "qnn"])
def test_matmul_with_its_weight_on_the_left_quantizes_that_weight(tmp_path, deploy, op):
    # MatMul(W, x), as torch.matmul(W, x) exports, and Gemm(W, x) (torch.addmm(b, W, x)): the
    # weight was left float while the report counted the layer as quantized
    w = rand((8, 16), 1, 0.3)
    if op == "MatMul":
        model = make_model([helper.make_node("MatMul", ["w", "x"], ["y"], name="mm")],
                           [vi("x", [2, 16, 10])], [vi("y", [2, 8, 10])], {"w": w})
    else:
        model = make_model([helper.make_node("Gemm", ["w", "x"], ["y"], name="mm", transB=1)],
                           [vi("x", [10, 16])], [vi("y", [8, 10])], {"w": w})
    _, qm = quantize_model(tmp_path, model, n=4, deploy=deploy)
    mm = node(qm, "mm")
    assert mm.input[0] == "w_dq" and is_dequantized(qm, mm.input[1])
    dq = producer(qm, "w_dq")
    stored = initializer(qm, dq.input[0])
    assert stored.dtype == np.int8
    scale = initializer(qm, dq.input[1])
    assert scale.size == 1                     # one grid: W's rows lie on no per-channel axis
    assert np.abs(stored.astype(np.float32) * scale - w).max() <= scale * 0.5 + 1e-7
    if deploy == "qnn":
        enc = json.loads((tmp_path / "out" / "qnn_encodings.json").read_text())
        assert "w" in enc["param_encodings"]


def test_weight_shared_by_two_nodes_is_stored_once(tmp_path):
    w = rand((4, 4, 3, 3), 1, 0.3)
    model = make_model([
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c", "w"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ], [vi("x", [1, 4, 8, 8])], [vi("y", [1, 4, 8, 8])], {"w": w})
    _, qm = quantize_model(tmp_path, model, n=2)
    assert node(qm, "conv1").input[1] == node(qm, "conv2").input[1] == "w_dq"
    assert sum(n.op_type == "DequantizeLinear" and n.input[0] == "w_quantized" for n in qm.graph.node) == 1


@pytest.mark.parametrize("naming", ["unnamed", "named"])
def test_quantized_ops_read_dequantized_inputs_whatever_the_node_names(tmp_path, naming):
    model = tiny_cnn()
    for i, n in enumerate(model.graph.node):
        n.name = "" if naming == "unnamed" else f"n{i}"
    _, qm = quantize_model(tmp_path, model, n=2)
    by_output = {n.output[0]: n for n in qm.graph.node}
    for out, weight in (("c1", "w1"), ("c2", "w2"), ("logits", "wf")):
        op = by_output[out]
        assert is_dequantized(qm, op.input[0]) and op.input[1] == weight + "_dq"
    for out in ("p1", "g"):  # MaxPool, GlobalAveragePool
        assert is_dequantized(qm, by_output[out].input[0])


# ---- validity ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_quant_model_passes_checker_and_runs_close_to_float(quantized, name):
    model, qm, out = quantized(name)
    onnx.checker.check_model(qm, full_check=True)
    feed = input_feeds(model, 1, seed=99)[0]
    ref = ort_run(model, feed)
    got = ort_run(out / "quant_model.onnx", feed)
    for r, g in zip(ref, got):
        cos = float((r * g).sum() / np.sqrt((r * r).sum() * (g * g).sum()))
        assert cos > 0.99


def test_model_with_initializers_listed_as_inputs_quantizes(tmp_path):
    model = m_conv()
    model.graph.input.extend([vi("w", [4, 3, 3, 3]), vi("b", [4])])
    onnx.checker.check_model(model)
    _, qm = quantize_model(tmp_path, model, n=2)
    assert [i.name for i in qm.graph.input if i.name not in {t.name for t in qm.graph.initializer}] == ["x"]


# ---- placement decisions (Python API) --------------------------------------------------------
def test_every_node_gets_a_decision_with_a_reason():
    g = Graph(m_two_convs())
    plan = place(g, platform_mod.load("trt"), skip_layers=("conv2",))
    decisions = {d.node: d for d in plan.decisions}
    assert set(decisions) == {"conv1", "relu", "conv2"}
    assert decisions["conv1"].quantized and not decisions["relu"].quantized
    assert decisions["conv2"].reason == "skipped by --skip_layers"


# ---- numbers: an independent fake-quant oracle ------------------------------------------------
def test_one_conv_output_equals_hand_fake_quant_with_the_plans_scales(tmp_path):
    model = m_conv()
    feeds = input_feeds(model, 4, seed=5)
    quantize_model(tmp_path, model, feeds=feeds, act_quant="minmax", bias_correction=False)
    out = tmp_path / "out"
    acts = json.loads((out / "act_clip_val.json").read_text())
    weights = json.loads((out / "weight_clip_val.json").read_text())
    assert set(acts) == {"x"} and set(weights) == {"w"}

    # act: symmetric int8, scale = amax / 127; minmax clip = the data's range
    xs = np.stack([f["x"] for f in feeds])
    assert acts["x"] == pytest.approx([float(xs.min()), float(xs.max())], rel=1e-6)
    s_x = np.float32(max(-acts["x"][0], acts["x"][1]) / 127)
    # weight: per output channel, narrow range [-127, 127]
    lo, hi = (np.array(v) for v in weights["w"])
    s_w = (np.maximum(-lo, hi) / 127).astype(np.float32).reshape(-1, 1, 1, 1)
    w = initializer(model, "w")
    w_fq = np.clip(np.rint(w / s_w), -127, 127) * s_w

    conv = ReferenceEvaluator(make_model([helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])],
                                         [vi("x", [1, 3, 8, 8]), vi("w", [4, 3, 3, 3]), vi("b", [4])],
                                         [vi("y", [1, 4, 8, 8])]))
    for feed in input_feeds(model, 3, seed=11):
        x = feed["x"]
        x_fq = (np.clip(np.rint(x / s_x), -128, 127) * s_x).astype(np.float32)
        (expected,) = conv.run(None, {"x": x_fq, "w": w_fq.astype(np.float32), "b": initializer(model, "b")})
        (got,) = ort_run(out / "quant_model.onnx", feed)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_grouped_conv_transpose_weights_get_one_grid(tmp_path):
    """[C_in, C_out/group, k, k]: a per-channel grid on axis 1 would cover one group's channels
    only, which no backend format can express; a grouped ConvTranspose gets a per-tensor grid."""
    from conftest import quantize_model, rand

    w = rand((4, 3, 2, 2), 1, 0.5)
    nodes = [helper.make_node("ConvTranspose", ["x", "wt", "bt"], ["y"], name="ct", group=2, strides=[2, 2])]
    model = make_model(nodes, [vi("x", [1, 4, 3, 3])], [vi("y", [1, 6, 6, 6])],
                       {"wt": w, "bt": rand((6,), 2, 0.1)})
    feeds = input_feeds(model, 3)
    _, qm = quantize_model(tmp_path, model, feeds=feeds)
    dq = next(n for n in qm.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "wt_dq")
    scale = next(t for t in qm.graph.initializer if t.name == dq.input[1])
    assert list(scale.dims) == [] and not any(a.name == "axis" for a in dq.attribute)
    got, want = ort_run(qm, feeds[0])[0], ort_run(model, feeds[0])[0]
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    weights = json.loads((tmp_path / "out" / "weight_clip_val.json").read_text())
    assert len(np.ravel(weights["wt"][0])) == 1


def test_inserted_names_never_collide_with_the_models_own(tmp_path):
    """A model that already has tensors called x_scale and w_dq: the Q/DQ names move aside
    (x_1_scale ...) instead of clashing, and the model still computes the same."""
    from conftest import quantize_model, rand

    nodes = [helper.make_node("Mul", ["x", "x_scale"], ["xs"], name="pre"),
             helper.make_node("Conv", ["xs", "w"], ["c"], name="conv"),
             helper.make_node("Add", ["c", "w_dq"], ["y"], name="post")]
    model = make_model(nodes, [vi("x", [1, 3, 4, 4])], [vi("y", [1, 2, 4, 4])],
                       {"x_scale": rand((1, 3, 1, 1), 1), "w": rand((2, 3, 1, 1), 2),
                        "w_dq": rand((1, 1, 4, 4), 3)})   # per pixel: not a bias to fold
    feeds = input_feeds(model, 3)
    _, qm = quantize_model(tmp_path, model, feeds=feeds, skip_prof_layer=True)
    onnx.checker.check_model(qm)
    names = [t.name for t in qm.graph.initializer]
    assert len(names) == len(set(names)) and "w_1_dq" in {o for n in qm.graph.node for o in n.output}
    np.testing.assert_allclose(ort_run(qm, feeds[0])[0], ort_run(model, feeds[0])[0], atol=0.1)


@pytest.mark.parametrize("deploy", ["ort", "trt", "qnn"])
def test_a_weight_shared_along_different_output_axes_gets_one_per_tensor_grid(tmp_path, deploy):
    """MatMul(x, W) has its output channels on W's axis 1, Gemm(a, W, transB=1) on axis 0: one
    DequantizeLinear serves both, so its grid is per tensor (per-channel scales along axis 1 were
    the Gemm's reduction axis: 0.949 output cosine in onnxruntime's integer kernels). The
    integer kernels then agree with the float model."""
    from onnx import numpy_helper

    from conftest import KERNEL_COS, input_feeds, ort_run, quantize_model

    w = rand((16, 16), 1, 0.3) * np.linspace(0.05, 3, 16, dtype=np.float32)   # columns of unequal range
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Gemm", ["a", "w"], ["g"], name="gemm", transB=1),
             helper.make_node("Add", ["m", "g"], ["y"], name="add")]
    model = make_model(nodes, [vi("x", [1, 16]), vi("a", [1, 16])], [vi("y", [1, 16])], {"w": w})
    _, qm = quantize_model(tmp_path, model, feeds=input_feeds(model, 8), deploy=deploy, skip_prof_layer=True)
    dqs = [n for n in qm.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("w")]
    assert len(dqs) == 1
    inits = {t.name: numpy_helper.to_array(t) for t in qm.graph.initializer}
    assert inits[dqs[0].input[1]].size == 1     # one scale: per tensor
    for feed in input_feeds(model, 3, seed=7):
        want = ort_run(model, feed)[0].ravel().astype(np.float64)
        got = ort_run(qm, feed, optimize=True)[0].ravel().astype(np.float64)
        assert want @ got / np.linalg.norm(want) / np.linalg.norm(got) > KERNEL_COS


def _rotary(position_input: bool):
    """x [1, L, 8] -> MatMul -> rotate by angles inv_freq * position: positions from a Range
    over the length (as HF's Llama export computes them) or from an int64 position_ids input."""
    from onnx import TensorProto

    d = 8
    inv_freq = (1.0 / (10000 ** (np.arange(0, d, 2) / d))).astype(np.float32).reshape(1, d // 2, 1)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj")]
    inits = {"w": rand((d, d), 0, 0.4), "inv_freq": inv_freq, "one": np.array(1, np.int64),
             "zero": np.array(0, np.int64), "ax": np.array([0], np.int64), "ax1": np.array([1], np.int64)}
    inputs = [vi("x", [1, "L", d])]
    if position_input:
        inputs.append(vi("position_ids", [1, "L"], TensorProto.INT64))
        pos = "position_ids"
    else:
        nodes += [helper.make_node("Shape", ["x"], ["shp"], name="shape", start=1, end=2),
                  helper.make_node("Squeeze", ["shp", "ax"], ["len"], name="sq"),
                  helper.make_node("Range", ["zero", "len", "one"], ["r"], name="range"),
                  helper.make_node("Unsqueeze", ["r", "ax"], ["pos_ids"], name="unsq")]
        pos = "pos_ids"
    nodes += [helper.make_node("Unsqueeze", [pos, "ax1"], ["p3"], name="unsq_p"),
              helper.make_node("Cast", ["p3"], ["pf"], to=TensorProto.FLOAT, name="cast_p"),
              helper.make_node("MatMul", ["inv_freq", "pf"], ["freqs"], name="rope_matmul"),
              helper.make_node("Transpose", ["freqs"], ["ang"], perm=[0, 2, 1], name="rope_t"),
              helper.make_node("Concat", ["ang", "ang"], ["emb"], axis=-1, name="rope_cat"),
              helper.make_node("Cos", ["emb"], ["cos"], name="cos"),
              helper.make_node("Mul", ["h", "cos"], ["y"], name="rot")]
    return make_model(nodes, inputs, [vi("y", [1, "L", d])], inits, opset=17)


@pytest.mark.parametrize("position_input", [False, True])
@pytest.mark.parametrize("deploy", ["trt", "qnn"])
def test_rotary_positions_stay_float_past_the_calibrated_length(tmp_path, position_input, deploy):
    """Llama's rotary embedding, inv_freq @ positions, was quantized as an ordinary MatMul: the
    positions' grid stopped at the longest calibrated one and inv_freq's smallest values rounded
    to 0; tokens past the calibrated length read cosine 0.58 (found by a bug hunt)."""
    model = _rotary(position_input)
    feed = lambda L, s: {"x": rand((1, L, 8), s), **({"position_ids": np.arange(L, dtype=np.int64)[None]}
                                                      if position_input else {})}
    res, qm = quantize_model(tmp_path, model, feeds=[feed(6 + i % 4, 10 + i) for i in range(6)], deploy=deploy,
                             skip_prof_layer=True)
    decisions = {d["node"]: d for d in res.report["decisions"]}
    assert not decisions["rope_matmul"]["quantized"] and "positions" in decisions["rope_matmul"]["reason"]
    gridded = {n.input[0] for n in qm.graph.node if n.op_type == "QuantizeLinear"}
    assert not gridded & {"pf", "freqs", "ang", "emb", "inv_freq"}, gridded
    f = feed(64, 99)
    ref, got = ort_run(model, f)[0][0], ort_run(qm, f)[0][0]
    cos = [a @ b / np.linalg.norm(a) / np.linalg.norm(b) for a, b in zip(ref[20:], got[20:])]
    assert min(cos) > 0.99, min(cos)


@pytest.mark.parametrize("deploy", ["snpe", "ti"])
def test_float_size_arithmetic_before_a_resize_stays_float(tmp_path, deploy):
    """interpolate(scale_factor=2, recompute_scale_factor=True) as torch exports it: the output
    size computed in float from Shape (Cast, Mul 2.0, Floor, Cast back). Mul and Concat are
    quantized on these backends: the sizes got grids, snpe's run failed and ti's model broke at
    another H/W (64 -> 63; found by a CNN-export hunt)."""
    from onnx import TensorProto

    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Shape", ["c"], ["shp"], name="shape"),
             helper.make_node("Slice", ["shp", "s0", "s1"], ["hw"], name="slice"),
             helper.make_node("Cast", ["hw"], ["hwf"], to=TensorProto.FLOAT, name="cast_f"),
             helper.make_node("Mul", ["hwf", "two"], ["hw2"], name="times2"),
             helper.make_node("Floor", ["hw2"], ["hw2f"], name="floor"),
             helper.make_node("Cast", ["hw2f"], ["hwi"], to=TensorProto.INT64, name="cast_i"),
             helper.make_node("Concat", ["nc", "hwi"], ["sizes"], axis=0, name="cat"),
             helper.make_node("Resize", ["c", "", "", "sizes"], ["y"], name="up", mode="nearest")]
    model = make_model(nodes, [vi("x", [1, 3, "H", "W"])], [vi("y", [1, 4, "H2", "W2"])],
                       {"w": rand((4, 3, 3, 3), 0, 0.3), "s0": np.array([2], np.int64), "s1": np.array([4], np.int64),
                        "two": np.array(2.0, np.float32), "nc": np.array([1, 4], np.int64)})
    res, qm = quantize_model(tmp_path, model, feeds=[{"x": rand((1, 3, 16, 16), i)} for i in range(4)], deploy=deploy,
                             skip_prof_layer=True)
    gridded = {n.input[0] for n in qm.graph.node if n.op_type == "QuantizeLinear"}
    assert not gridded & {"hwf", "hw2", "hw2f"}, gridded
    big = {"x": rand((1, 3, 40, 24), 9)}
    assert ort_run(qm, big)[0].shape == ort_run(model, big)[0].shape == (1, 4, 80, 48)


def test_alibi_positions_stay_float_and_the_scores_they_join_keep_their_grid():
    """Token embeddings come from a Gather of a constant table by the ids: they are data, so the
    scores plus ALiBi's slope * positions are no positions (they keep a grid on qnn), while the
    slope * positions term gets none."""
    from onnx import TensorProto

    from dipoorlet.graph import Graph
    from dipoorlet.platform import load

    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
             helper.make_node("MatMul", ["emb", "wq"], ["q"], name="mq"),
             helper.make_node("Transpose", ["emb"], ["et"], perm=[0, 2, 1], name="et"),
             helper.make_node("MatMul", ["q", "et"], ["s"], name="scores"),
             helper.make_node("Shape", ["ids"], ["shp"], name="shape", start=1, end=2),
             helper.make_node("Squeeze", ["shp", "ax0"], ["len"], name="sq"),
             helper.make_node("Range", ["zero", "len", "one"], ["r"], name="range"),
             helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Mul", ["rf", "slope"], ["alibi"], name="alibi"),
             helper.make_node("Add", ["s", "alibi"], ["sm"], name="add_alibi"),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1, name="softmax")]
    model = make_model(nodes, [vi("ids", [1, "L"], TensorProto.INT64)], [vi("p", [1, "L", "L"])],
                       {"table": rand((20, 8), 0), "wq": rand((8, 8), 1, 0.3), "ax0": np.array([0], np.int64),
                        "zero": np.array(0, np.int64), "one": np.array(1, np.int64),
                        "slope": np.array(-0.5, np.float32)}, opset=17)
    g = Graph(onnx.shape_inference.infer_shapes(model))
    from dipoorlet.placement import position_tensors

    positions, nodes_ = position_tensors(g)
    assert {"rf", "alibi"} <= positions and not {"emb", "q", "s", "sm"} & positions
    places = place(g, load("qnn"))
    assert "sm" in places.activations and "alibi" not in places.activations and "s" in places.activations


def test_positions_added_to_data_are_named_with_the_flags_that_keep_them_float(tmp_path, caplog):
    """A YOLO head decodes boxes as anchors (a Range over the feature map's width) plus predicted
    offsets, times the stride: on qnn those sums got grids sized on the calibration images, and a
    640 px image's boxes stopped at 323 px, calibrated at 320, without a word (found by a hunt on
    untuned models). The run names them and the --skip_layers that keeps them float; with it, the
    boxes follow a wider input."""
    import logging
    import re

    from onnx import TensorProto

    nodes = [helper.make_node("Conv", ["x", "w"], ["d"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Shape", ["x"], ["shp"], name="shape", start=3, end=4),
             helper.make_node("Squeeze", ["shp", "ax0"], ["wlen"], name="sq"),
             helper.make_node("Range", ["zero", "wlen", "one"], ["r"], name="range"),
             helper.make_node("Cast", ["r"], ["anchor"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Add", ["d", "anchor"], ["xy"], name="decode"),
             helper.make_node("Mul", ["xy", "stride"], ["y"], name="to_pixels")]
    model = make_model(nodes, [vi("x", [1, 2, 4, "W"])], [vi("y", [1, 2, 4, "W"])],
                       {"w": rand((2, 2, 3, 3), 0, 0.2), "ax0": np.array([0], np.int64), "zero": np.array(0, np.int64),
                        "one": np.array(1, np.int64), "stride": np.array(8.0, np.float32)}, opset=17)
    feeds = [{"x": rand((1, 2, 4, 16), i)} for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        quantize_model(tmp_path / "a", model, feeds=feeds, deploy="qnn", skip_prof_layer=True)
    said = [r.getMessage() for r in caplog.records if "hold positions or sizes" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    skip = re.search(r"--skip_layers (.*)$", said[0]).group(1).split()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        _, qm = quantize_model(tmp_path / "b", model, feeds=feeds, deploy="qnn", skip_prof_layer=True,
                               skip_layers=skip)
    assert not [r for r in caplog.records if "hold positions or sizes" in r.getMessage()]
    wide = {"x": rand((1, 2, 4, 64), 9)}
    ref, got = ort_run(model, wide)[0], ort_run(qm, wide)[0]
    assert abs(got.max() - ref.max()) < 0.05 * ref.max()        # the far boxes reach 500 px, not 128


def test_a_size_that_scales_data_by_a_fixed_amount_is_no_growing_position():
    """q / sqrt(head size) taken from a Shape, a sum over H*W, var's N/(N-1): one number, which
    scales the data; the position warning named such layers for --skip_layers (found by a review)."""
    from onnx import TensorProto

    from dipoorlet.graph import Graph
    from dipoorlet.placement import position_mixed, position_tensors

    nodes = [helper.make_node("MatMul", ["x", "w"], ["q"], name="mq"),
             helper.make_node("Shape", ["q"], ["shp"], name="shape", start=2, end=3),
             helper.make_node("Cast", ["shp"], ["d"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Sqrt", ["d"], ["sd"], name="sqrt"),
             helper.make_node("Div", ["q", "sd"], ["qs"], name="scale"),
             helper.make_node("MatMul", ["qs", "w2"], ["y"], name="out")]
    model = make_model(nodes, [vi("x", [1, "L", 8])], [vi("y", [1, "L", 8])],
                       {"w": rand((8, 8), 0, 0.3), "w2": rand((8, 8), 1, 0.3)}, opset=17)
    g = Graph(onnx.shape_inference.infer_shapes(model))
    positions, _ = position_tensors(g)
    assert "sd" in positions and position_mixed(g, positions) == []


def _rmsnorm_model():
    """x -> RMSNorm (Pow, ReduceMean, Add eps, Sqrt, Div(1, .), Mul x, Mul gamma) -> MatMul, beside
    a squeeze-and-excitation-like pooled vector (ReduceMean -> MatMul) that is no statistic."""
    n = helper.make_node
    nodes = [n("Pow", ["x", "two"], ["sq"], name="pow"),
             n("ReduceMean", ["sq"], ["ms"], name="mean", axes=[-1], keepdims=1),
             n("Add", ["ms", "eps"], ["mse"], name="add_eps"),
             n("Sqrt", ["mse"], ["rms"], name="sqrt"),
             n("Div", ["one", "rms"], ["inv"], name="inv"),
             n("Mul", ["x", "inv"], ["xn"], name="apply"),
             n("Mul", ["xn", "gamma"], ["xg"], name="gamma"),
             n("MatMul", ["xg", "w"], ["h"], name="proj"),
             n("ReduceMean", ["x"], ["pooled"], name="pool", axes=[1], keepdims=1),
             n("MatMul", ["pooled", "w"], ["p"], name="pool_proj"),
             n("Add", ["h", "p"], ["y"], name="out")]
    inits = {"two": np.float32(2.0), "eps": np.float32(1e-6), "one": np.float32(1.0),
             "gamma": (1 + rand((16,), 1, 0.1)).astype(np.float32), "w": rand((16, 16), 2, 0.25)}
    return make_model(nodes, [vi("x", [1, 8, 16])], [vi("y", [1, 8, 16])], inits)


def test_norm_statistics_are_the_rmsnorm_chain_not_a_pooled_vector():
    from dipoorlet.placement import norm_statistics

    g = Graph(onnx.shape_inference.infer_shapes(_rmsnorm_model()))
    tensors, nodes = norm_statistics(g)
    assert nodes == {"mean", "add_eps", "sqrt", "inv"}
    assert tensors == {"ms", "mse", "rms", "inv"}


def test_rmsnorm_statistics_stay_float_so_a_row_of_smaller_rms_is_not_clipped(tmp_path):
    """Llama's RMSNorm on qnn: 1/rms had a calibrated grid; rows of a smaller rms at deployment
    (attention over a longer context shrinks the residual) were clipped to the calibrated 1/rms
    (worst decode step cosine 0.9625, trt 0.9973; found by a KV-cache hunt). The statistics now
    stay float, as in a fused LayerNorm; the normalized rows keep their grids."""
    model = _rmsnorm_model()
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 8, 16)).astype(np.float32)} for _ in range(8)]
    _, qm = quantize_model(tmp_path, model, feeds=feeds, deploy="qnn", skip_prof_layer=True)
    dq_src = {n.output[0]: n.input[0] for n in qm.graph.node if n.op_type == "DequantizeLinear"}
    q_src = {n.output[0]: n.input[0] for n in qm.graph.node if n.op_type == "QuantizeLinear"}
    gridded = {q_src.get(t) for t in dq_src.values()}
    assert not gridded & {"ms", "mse", "rms", "inv"}
    assert {"x", "xn"} <= gridded
    x = rng.standard_normal((1, 8, 16)).astype(np.float32)
    x[:, 4:] *= 0.2                                   # rows of rms 0.2: 1/rms 5x the calibrated
    want, got = ort_run(model, {"x": x})[0], ort_run(qm, {"x": x})[0]
    err = float(np.linalg.norm(got[:, 4:] - want[:, 4:]) / np.linalg.norm(want[:, 4:]))
    assert err < 0.1, err


def test_a_mean_gating_another_branch_is_no_normalization_statistic():
    """ReduceMean(a) multiplying b (a gate over a sibling branch) shared an ancestor with b and
    was taken for a statistic kept float (found by a review): only the data it was reduced from
    (or its square, or it less a mean) counts."""
    from dipoorlet.placement import norm_statistics

    n = helper.make_node
    nodes = [n("Conv", ["x", "wa"], ["a"], name="conva"),
             n("Conv", ["x", "wb"], ["b"], name="convb"),
             n("ReduceMean", ["a"], ["ma"], name="gap", axes=[2, 3], keepdims=1),
             n("Mul", ["b", "ma"], ["y"], name="gate")]
    model = make_model(nodes, [vi("x", [1, 4, 6, 6])], [vi("y", [1, 4, 6, 6])],
                       {"wa": rand((4, 4, 1, 1), 1), "wb": rand((4, 4, 1, 1), 2)})
    assert norm_statistics(Graph(onnx.shape_inference.infer_shapes(model))) == (set(), set())
