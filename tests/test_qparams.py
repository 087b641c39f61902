"""dipoorlet.qparams: grids from clip ranges, and quantize_array against ONNX QuantizeLinear."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from conftest import make_model, ort_run, vi
from dipoorlet.platform import TensorRule
from dipoorlet.qparams import MIN_SCALE, QParams, levels, make_qparams, quantize_array

SYM = TensorRule(bits=8, symmetric=True)
SYM_NARROW = TensorRule(bits=8, symmetric=True, narrow_range=True)
ASYM_U8 = TensorRule(bits=8, symmetric=False, unsigned=True)
ASYM_S8 = TensorRule(bits=8, symmetric=False)


@pytest.mark.parametrize("rule, expected", [
    (SYM, (-128, 127)), (SYM_NARROW, (-127, 127)), (ASYM_U8, (0, 255)),
    (TensorRule(bits=4, symmetric=True, narrow_range=True), (-7, 7)),
    (TensorRule(bits=4, symmetric=False, unsigned=True), (0, 15)),
])
def test_levels(rule, expected):
    assert levels(rule) == expected


def test_symmetric_scale_is_amax_over_127_and_zero_point_zero():
    qp = make_qparams(-2.0, 3.0, SYM)
    assert qp.scale == np.float32(3.0 / 127)
    assert qp.zero_point == 0 and qp.zero_point.dtype == np.int8
    assert (qp.qmin, qp.qmax) == (-128, 127)


def test_symmetric_uses_the_larger_side():
    assert make_qparams(-5.0, 1.0, SYM).scale == np.float32(5.0 / 127)


def test_narrow_range_keeps_scale_and_drops_minus_128():
    qp = make_qparams(-2.0, 3.0, SYM_NARROW)
    assert qp.scale == np.float32(3.0 / 127)
    assert (qp.qmin, qp.qmax) == (-127, 127)


def test_asymmetric_unsigned_scale_and_zero_point():
    qp = make_qparams(-1.0, 3.0, ASYM_U8)
    assert qp.scale == pytest.approx(4.0 / 255, rel=1e-6)
    assert qp.zero_point == np.round(1.0 / (4.0 / 255)) and qp.zero_point.dtype == np.uint8


def test_asymmetric_signed_zero_point_is_shifted_by_qmin():
    qp = make_qparams(-1.0, 3.0, ASYM_S8)
    assert qp.zero_point == -128 + np.round(1.0 / (4.0 / 255))
    assert qp.zero_point.dtype == np.int8


def test_asymmetric_grid_represents_zero_exactly_and_covers_the_range():
    qp = make_qparams(-0.37, 2.9, ASYM_U8)
    s, z = float(qp.scale), int(qp.zero_point)
    assert qp.qmin <= z <= qp.qmax  # 0.0 maps to the integer z, so it is exact on the grid
    assert (qp.qmin - z) * s <= -0.37 + s / 2 and (qp.qmax - z) * s >= 2.9 - s / 2


@pytest.mark.parametrize("rule", [SYM, ASYM_U8])
def test_power_of_two_scale_rounds_up_to_a_power_of_two(rule):
    rule = TensorRule(**{**rule.__dict__, "power_of_two": True})
    qp = make_qparams(-1.0, 3.0, rule)
    exact = make_qparams(-1.0, 3.0, TensorRule(**{**rule.__dict__, "power_of_two": False})).scale
    log2 = np.log2(float(qp.scale))
    assert log2 == np.round(log2)
    assert exact <= qp.scale < 2 * exact


def test_range_is_widened_to_contain_zero():
    pos = make_qparams(0.5, 2.0, SYM)
    neg = make_qparams(-2.0, -0.5, SYM)
    assert (pos.lo, pos.hi) == (0.0, 2.0) and (neg.lo, neg.hi) == (-2.0, 0.0)
    assert make_qparams(0.5, 2.0, ASYM_U8).zero_point == 0


@pytest.mark.parametrize("rule", [SYM, ASYM_U8])
def test_empty_range_gets_a_positive_scale(rule):
    qp = make_qparams(0.0, 0.0, rule)
    assert np.isfinite(qp.scale) and qp.scale > 0
    assert np.all(np.isfinite(quantize_array(np.zeros(3, np.float32), qp)))


def test_per_channel_arrays():
    lo, hi = np.array([-1.0, -4.0, 0.0]), np.array([2.0, 1.0, 0.0])
    qp = make_qparams(lo, hi, SYM_NARROW, axis=0)
    np.testing.assert_allclose(qp.scale, np.array([2.0, 4.0, MIN_SCALE]) / 127, rtol=1e-6)
    assert qp.scale.shape == (3,) and qp.zero_point.shape == (3,) and qp.axis == 0


# ---- quantize_array vs ONNX QuantizeLinear --------------------------------------------------
def _qlinear_model(x_shape, scale: np.ndarray, zp: np.ndarray, axis=None):
    attrs = {"axis": axis} if axis is not None else {}
    elem = TensorProto.INT8 if zp.dtype == np.int8 else TensorProto.UINT8
    n = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **attrs)
    return make_model([n], [vi("x", list(x_shape))], [vi("q", list(x_shape), elem)],
                      {"s": scale.astype(np.float32), "z": zp})


def _tricky_values(scale: float, zp: int, qmin: int, qmax: int) -> np.ndarray:
    """Exact .5 ties (round half to even), values far outside the grid (saturation), random."""
    k = np.arange(qmin - zp - 5, qmax - zp + 5)
    ties = (k + 0.5) * scale
    r = np.random.default_rng(3).uniform((qmin - zp - 40) * scale, (qmax - zp + 40) * scale, 500)
    return np.concatenate([ties, -ties, r, [0.0, 1e9, -1e9]]).astype(np.float32)


@pytest.mark.parametrize("rule, lo, hi", [
    (SYM, -64.0, 64.0),          # scale 64/127: not a power of two
    (TensorRule(bits=8, symmetric=True), -63.5, 63.5),  # scale 0.5: exact ties
    (ASYM_U8, -1.0, 3.0),
    (ASYM_S8, -2.0, 6.0),
])
def test_quantize_array_equals_onnxruntime_quantizelinear(rule, lo, hi):
    qp = make_qparams(lo, hi, rule)
    x = _tricky_values(float(qp.scale), int(qp.zero_point), qp.qmin, qp.qmax)
    (expected,) = ort_run(_qlinear_model(x.shape, qp.scale, qp.zero_point), {"x": x})
    got = quantize_array(x, qp)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


def test_round_half_to_even_on_exact_ties():
    qp = make_qparams(-63.5, 63.5, SYM)  # scale 0.5
    x = np.array([0.25, 0.75, 1.25, -0.25, -0.75, -1.25], np.float32)  # x/scale = .5, 1.5, 2.5 ...
    np.testing.assert_array_equal(quantize_array(x, qp), [0, 2, 2, 0, -2, -2])


def test_saturation_to_narrow_range():
    qp = make_qparams(-1.0, 1.0, SYM_NARROW)
    np.testing.assert_array_equal(quantize_array(np.array([-5.0, 5.0], np.float32), qp), [-127, 127])


def test_per_channel_quantize_array_equals_reference_quantizelinear():
    w = np.random.default_rng(5).standard_normal((4, 3, 2, 2)).astype(np.float32) * [[[[1]]], [[[3]]], [[[0.1]]], [[[10]]]]
    w = w.astype(np.float32)
    moved = w.reshape(4, -1)
    qp = make_qparams(moved.min(1), moved.max(1), SYM_NARROW, axis=0)
    model = _qlinear_model(w.shape, qp.scale, qp.zero_point, axis=0)
    (expected,) = ReferenceEvaluator(model).run(None, {"x": w})
    np.testing.assert_array_equal(quantize_array(w, qp), expected)
    assert quantize_array(w, qp).min() >= -127


def test_per_channel_on_last_axis_equals_onnxruntime():
    w = np.random.default_rng(6).standard_normal((5, 3)).astype(np.float32) * np.array([0.1, 1, 7], np.float32)
    qp = make_qparams(w.min(0), w.max(0), SYM_NARROW, axis=1)
    (expected,) = ort_run(_qlinear_model(w.shape, qp.scale, qp.zero_point, axis=1), {"x": w})
    np.testing.assert_array_equal(quantize_array(w, qp), expected)


def test_qparams_amax():
    qp = QParams(np.float32(1), np.int8(0), 8, True, -128, 127, None, np.float32(-3), np.float32(2))
    assert qp.amax == 3.0


@pytest.mark.parametrize("deploy", ["qnn", "snpe", "trt", "imx"])
def test_a_bias_too_large_for_int32_on_a_tiny_input_scale_widens_the_weight_grid(tmp_path, deploy):
    """A near-constant state input (values around 1e-7) gives a tiny input scale; s_in * s_w then
    puts the bias far outside int32. Left float, onnxruntime's default optimizations quantize it
    themselves and it wraps to -2^31 (output cosine 0.59 on a Gemm like this one); saturated, it
    would change the layer. The weight grid is widened until the bias fits (per channel or per tensor), on every
    backend, whether the bias is written int32 (qnn, snpe) or float (trt, imx): the model then
    matches the float one in a default onnxruntime session as in the simulation."""
    from onnx import helper as oh, numpy_helper

    from conftest import make_model, ort_run, quantize_model, rand, vi

    nodes = [oh.make_node("Gemm", ["h", "w", "b"], ["g"], name="gemm", transB=1),
             oh.make_node("Add", ["g", "x"], ["y"], name="add")]
    b = np.array([0.35, 0.82, 0.33, -1.3], np.float32)
    model = make_model(nodes, [vi("x", [1, 4]), vi("h", [1, 4])], [vi("y", [1, 4])],
                       {"w": rand((4, 4), 1), "b": b})
    feeds = [{"x": rand((1, 4), i), "h": rand((1, 4), 10 + i, 1e-7)} for i in range(3)]
    _, qm = quantize_model(tmp_path, model, feeds=feeds, deploy=deploy, skip_prof_layer=True)
    inits = {t.name: numpy_helper.to_array(t) for t in qm.graph.initializer}
    dq = {n.output[0]: n for n in qm.graph.node if n.op_type == "DequantizeLinear"}
    gemm = next(n for n in qm.graph.node if n.name == "gemm")
    s_x = inits[dq[gemm.input[0]].input[1]].astype(np.float64)
    s_w = inits[dq[gemm.input[1]].input[1]].astype(np.float64)
    assert np.all(np.abs(b) / (s_x * s_w) <= 2 ** 31 - 1)
    if gemm.input[2] in dq:     # written int32: the values themselves, not saturated
        ints = inits[dq[gemm.input[2]].input[0]]
        assert ints.dtype == np.int32 and np.all(np.abs(ints) < 2 ** 31 - 1)
    for f in feeds:
        want = ort_run(model, f)[0]
        np.testing.assert_allclose(ort_run(qm, f)[0], want, atol=0.05)
        np.testing.assert_allclose(ort_run(qm, f, optimize=True)[0], want, atol=0.05)


def test_quantize_array_saturates_int32_without_wrapping():
    from dipoorlet.qparams import QParams, quantize_array

    qp = QParams(scale=np.float32(1e-9), zero_point=np.int32(0), bits=32, signed=True,
                 qmin=-2**31, qmax=2**31 - 1)
    q = quantize_array(np.array([5.0, -5.0, 1e-9], np.float32), qp)
    assert q.tolist() == [2**31 - 1, -2**31, 1]


@pytest.mark.parametrize("deploy", ["trt", "snpe"])
def test_an_activation_that_calibration_saw_all_zero_stays_float(tmp_path, caplog, deploy):
    """A state input that is 0 in every calibration sample sizes no grid: on one of +-1e-8 every
    other value at deployment would be clipped to about 0. It stays float (no Q/DQ), the log says
    why, and the written model follows a non-zero state as the float model does."""
    import logging

    from onnx import helper as oh

    from conftest import make_model, ort_run, quantize_model, rand, vi

    nodes = [oh.make_node("Gemm", ["x", "w1", "b1"], ["a"], name="fc_x"),
             oh.make_node("Gemm", ["state", "w2", "b2"], ["s"], name="fc_state"),
             oh.make_node("Add", ["a", "s"], ["y"], name="add")]
    model = make_model(nodes, [vi("x", [1, 8]), vi("state", [1, 8])], [vi("y", [1, 8])],
                       {"w1": rand((8, 8), 1, 0.3), "b1": rand((8,), 2, 0.3), "w2": rand((8, 8), 3, 0.3),
                        "b2": rand((8,), 4, 0.3) + 1})
    feeds = [{"x": rand((1, 8), i), "state": np.zeros((1, 8), np.float32)} for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        _, qm = quantize_model(tmp_path, model, feeds=feeds, deploy=deploy, skip_prof_layer=True)
    assert "state is 0 in every calibration sample, which sizes no grid: it stays float" in caplog.text
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == "state" for n in qm.graph.node)
    assert any(n.op_type == "QuantizeLinear" and n.input[0] == "x" for n in qm.graph.node)
    live = {"x": rand((1, 8), 9), "state": rand((1, 8), 10)}
    want = ort_run(model, live)[0]
    for optimize in (False, True):
        np.testing.assert_allclose(ort_run(qm, live, optimize=optimize)[0], want, atol=0.1)


def test_an_activation_empty_in_every_sample_is_named_as_empty(tmp_path, caplog):
    """Samples whose sequence length is 0 leave the tensors along it empty: the log says so (it
    said they reach inf), they stay float, and the model still runs."""
    import logging

    from onnx import TensorProto, helper as oh

    from conftest import make_model, ort_run, quantize_model, rand

    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             oh.make_node("Relu", ["h"], ["y"], name="relu")]
    model = make_model(nodes, [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 4])],
                       [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 3])], {"w": rand((4, 3), 1)})
    feeds = [{"x": np.zeros((1, 0, 4), np.float32)} for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        _, qm = quantize_model(tmp_path, model, feeds=feeds, skip_prof_layer=True)
    assert ("x is empty (a zero-length dimension) or NaN throughout in every calibration sample: it stays float"
            in caplog.text)
    assert "inf" not in caplog.text
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == "x" for n in qm.graph.node)
    x = rand((1, 5, 4), 2)     # only the weight's int8 rounding is left
    np.testing.assert_allclose(ort_run(qm, {"x": x})[0], ort_run(model, {"x": x})[0], atol=0.05)


@pytest.mark.parametrize("deploy", ["qnn", "ort"])
def test_a_fitted_bias_leaves_the_accumulator_room_for_the_products(tmp_path, deploy):
    """A bias fitted to 2^31 - 1 itself overflows once the layer's products are added to it: a
    16-input Gemm on a near-constant input flipped output signs in onnxruntime's integer kernels
    (worst cosine -0.57 on qnn). The fitted int32 bias leaves fan-in x |x_q| x |w_q| below the
    limit, and a default session follows the float model."""
    from onnx import helper as oh, numpy_helper

    from conftest import KERNEL_COS, make_model, ort_run, quantize_model, rand, vi

    model = make_model([oh.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", transB=1)],
                       [vi("x", [1, 16])], [vi("y", [1, 4])], {"w": rand((4, 16), 1), "b": rand((4,), 2, 1.0)})
    feeds = [{"x": rand((1, 16), 10 + i, 1e-7)} for i in range(4)]
    _, qm = quantize_model(tmp_path, model, feeds=feeds, deploy=deploy, skip_prof_layer=True)
    inits = {t.name: numpy_helper.to_array(t) for t in qm.graph.initializer}
    dq = {n.output[0]: n for n in qm.graph.node if n.op_type == "DequantizeLinear"}
    gemm = next(n for n in qm.graph.node if n.name == "gemm")
    ints = inits[dq[gemm.input[2]].input[0]].astype(np.int64)
    x_steps = 255 if inits[dq[gemm.input[0]].input[2]].dtype == np.uint8 else 256
    assert np.all(np.abs(ints) + 16 * x_steps * 127 < 2 ** 31)
    for i in range(10):
        f = {"x": rand((1, 16), 100 + i, 1e-7)}
        want = ort_run(model, f)[0].ravel().astype(np.float64)
        got = ort_run(qm, f, optimize=True)[0].ravel().astype(np.float64)
        assert want @ got / np.linalg.norm(want) / np.linalg.norm(got) > KERNEL_COS


@pytest.mark.parametrize("deploy", ["qnn", "ort"])
def test_a_shared_weight_widened_for_one_layers_bias_is_widened_for_all_and_measured(tmp_path, caplog, deploy):
    """W is read by gA (a normal input) and gB (an input near 1e-6): gB's bias fits int32 only on a
    much wider W grid. W gets it for both layers (one grid per weight), gA's int32 bias is planned
    again on it, and the log warns; the model then runs in a default onnxruntime session as the
    report's simulation measures it (left float, gB's bias was overflowed by onnxruntime: 0.46
    there while the simulation read 0.9999)."""
    import logging

    from onnx import helper as oh, numpy_helper

    from conftest import KERNEL_COS, make_model, ort_run, quantize_model, rand, vi

    nodes = [oh.make_node("Gemm", ["x", "w", "b1"], ["a"], name="gA", transB=1),
             oh.make_node("Gemm", ["h", "w", "b2"], ["s"], name="gB", transB=1),
             oh.make_node("Add", ["a", "s"], ["y"], name="add")]
    model = make_model(nodes, [vi("x", [1, 8]), vi("h", [1, 8])], [vi("y", [1, 8])],
                       {"w": rand((8, 8), 1, 0.5), "b1": rand((8,), 2, 0.3), "b2": rand((8,), 3, 1.0)})
    feeds = [{"x": rand((1, 8), i), "h": rand((1, 8), 20 + i, 1e-6)} for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        result, qm = quantize_model(tmp_path, model, feeds=feeds, deploy=deploy, skip_prof_layer=True)
    assert caplog.text.count("bias of gB does not fit int32") == 1 and "which other layers read too" in caplog.text
    inits = {t.name: numpy_helper.to_array(t) for t in qm.graph.initializer}
    dq = {n.output[0]: n for n in qm.graph.node if n.op_type == "DequantizeLinear"}
    node = {n.name: n for n in qm.graph.node}
    assert node["gA"].input[1] == node["gB"].input[1]                            # one grid
    s_w = inits[dq[node["gA"].input[1]].input[1]].astype(np.float64)
    for name in ("gA", "gB"):                                                    # int32 biases on s_in * s_w
        s_x = inits[dq[node[name].input[0]].input[1]].astype(np.float64)
        np.testing.assert_allclose(inits[dq[node[name].input[2]].input[1]], s_x * s_w, rtol=1e-6)
    sim, opt = [], []
    for f in feeds:
        want = ort_run(model, f)[0].ravel().astype(np.float64)
        for got, acc in ((ort_run(qm, f)[0], sim), (ort_run(qm, f, optimize=True)[0], opt)):
            got = got.ravel().astype(np.float64)
            acc.append(want @ got / np.linalg.norm(want) / np.linalg.norm(got))
    assert result.report["outputs"][0]["cosine"] == pytest.approx(np.mean(sim), abs=1e-5)   # the report measures it
    assert min(opt) > KERNEL_COS * min(sim)                                     # and the deployed model agrees


@pytest.mark.parametrize("deploy", ["snpe", "qnn"])
def test_an_all_zero_concat_input_keeps_the_grid_its_group_shares(tmp_path, deploy):
    """On backends that run Concat in integers its inputs share one grid: a state input that is 0
    in every sample still gets the group's grid (and its side-file entry), not float."""
    from onnx import helper as oh

    from conftest import make_model, quantize_model, rand, vi

    nodes = [oh.make_node("Concat", ["state", "x"], ["c"], name="cat", axis=1),
             oh.make_node("Gemm", ["c", "w", "b"], ["y"], name="fc", transB=1)]
    model = make_model(nodes, [vi("x", [1, 8]), vi("state", [1, 8])], [vi("y", [1, 4])],
                       {"w": rand((4, 16), 1, 0.3), "b": rand((4,), 2, 0.3)})
    feeds = [{"x": rand((1, 8), i), "state": np.zeros((1, 8), np.float32)} for i in range(4)]
    quantize_model(tmp_path, model, feeds=feeds, deploy=deploy, skip_prof_layer=True)
    acts = json.loads((tmp_path / "out" / "act_clip_val.json").read_text())
    assert acts["state"] == acts["x"] == acts["c"] and acts["x"][1] > 1


def test_an_activation_nan_in_every_sample_is_not_called_only_empty(tmp_path, caplog):
    """0 * inf inside the float model makes a tensor NaN throughout; NaN is left out of its range,
    so it read as empty and the log blamed a zero-length dimension (found by a bug hunt)."""
    import logging

    from onnx import TensorProto, helper as oh

    from conftest import make_model, quantize_model, rand

    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             oh.make_node("Mul", ["h", "zero"], ["z"], name="zero_it"),
             oh.make_node("Mul", ["z", "big"], ["n"], name="nan_it"),
             oh.make_node("MatMul", ["n", "w2"], ["y"], name="mm2")]
    model = make_model(nodes, [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                       [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
                       {"w": rand((4, 4), 1), "zero": np.float32(0), "big": np.float32(np.inf), "w2": rand((4, 3), 2)})
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        quantize_model(tmp_path, model, n=3, skip_prof_layer=True, act_quant="mse")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("n "))
    assert "or NaN throughout" in line and "NaN in the float model" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        quantize_model(tmp_path / "minmax", model, n=3, skip_prof_layer=True, act_quant="minmax")
    # -A minmax's one pass says the same since its per-channel ranges leave NaN out (session 38);
    # the input x, measured in the same pass, keeps its grid
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(("n ", "tensor n ")))
    assert "NaN throughout" in line and "x," not in line
