"""Activation shift (dipoorlet.shift): asymmetric grids on a symmetric backend, exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import helper, numpy_helper

from conftest import make_model, ort_run, quantize_model, rand, stats_from, vi
from dipoorlet import placement, platform, shift
from dipoorlet.graph import Graph, infer_shapes
from dipoorlet.qparams import QuantPlan, make_qparams
from dipoorlet.ranges import RANGE_METHODS


def _relu_matmul(k=16, n=8):
    inits = {"w": rand((k, n), 1, 0.3), "b": rand((n,), 2, 0.1)}
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["y"], name="bias")]
    return make_model(nodes, [vi("x", [4, k])], [vi("y", [4, n])], inits)


def _fq_asym(x, s, zp, qmin=-127, qmax=127):
    return (np.clip(np.rint(x / s) + zp, qmin, qmax) - zp) * s


def test_shifted_model_is_the_asymmetric_quantization_of_the_input(tmp_path):
    """ReLU -> MatMul + bias on trt: the quantized model computes W_q · fq_asym(r) + b, with the
    asymmetric int8 grid of r's calibration range (numpy oracle), not the symmetric one."""
    model = _relu_matmul()
    feeds = [{"x": rand((4, 16), 10 + i)} for i in range(6)]
    res, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="minmax", equalize=False,
                             skip_prof_layer=True, bias_correction=False)
    assert [r["tensor"] for r in res.report["shift"]] == ["r"]
    r_all = np.concatenate([np.maximum(f["x"], 0) for f in feeds])
    lo, hi = 0.0, float(r_all.max())
    s = np.float32((hi - lo) / 254)      # the asymmetric grid on levels -127..127 (never -128)
    zp = float(np.clip(np.round(-127 - lo / s), -127, 127))
    w_f, b = (numpy_helper.to_array(t) for t in model.graph.initializer)
    sw = np.abs(w_f).max(axis=0) / 127                           # per output column (MatMul axis 1)
    w_q = np.clip(np.rint(w_f / sw), -127, 127) * sw
    for i in range(3):
        x = rand((4, 16), 100 + i, 1.3)                          # beyond the calibration range too
        oracle = _fq_asym(np.maximum(x, 0), s, zp) @ w_q + b
        got = ort_run(qm, {"x": x})[0]
        np.testing.assert_allclose(got, oracle, rtol=1e-4, atol=2e-5)
    # the symmetric grid wastes the negative half: its error is larger
    _, qm_sym = quantize_model(tmp_path / "sym", model, feeds=feeds, act_quant="minmax", equalize=False,
                               skip_prof_layer=True, shift=False, bias_correction=False)
    xs = [np.clip(rand((4, 16), 200 + k), -hi, 0.95 * hi) for k in range(40)]   # inside the range: rounding only
    refs = [ort_run(model, {"x": x})[0] for x in xs]
    err = lambda q: sum(float(np.mean((ort_run(q, {"x": x})[0] - r) ** 2)) for x, r in zip(xs, refs))  # noqa: E731
    assert err(qm) < 0.7 * err(qm_sym)   # the weights' share of the error is the same in both
    # side files describe the shifted tensor on the symmetric grid TensorRT is told about
    blob = json.loads((tmp_path / "out" / "trt_clip_val.json").read_text())["blob_range"]
    assert "r" not in blob and blob["r_shift"] == pytest.approx(127 * s, rel=1e-6)


def _zoo():
    """Every consumer kind the shift handles, and three it must leave alone."""
    i = {}
    nodes, inputs, outputs = [], [], []

    def relu(name, shape):
        inputs.append(vi(name, shape))
        nodes.append(helper.make_node("Relu", [name], [name + "_r"], name=name + "_relu"))
        return name + "_r"

    a = relu("xa", [4, 16])                                  # MatMul without a bias
    i["wa"] = rand((16, 8), 1, 0.3)
    nodes.append(helper.make_node("MatMul", [a, "wa"], ["ma"], name="mm_a"))
    nodes.append(helper.make_node("Sigmoid", ["ma"], ["ya"], name="sig_a"))
    b = relu("xb", [4, 16])                                  # Gemm transB with a [N] C
    i["wb"], i["cb"] = rand((8, 16), 2, 0.3), rand((8,), 3, 0.1)
    nodes.append(helper.make_node("Gemm", [b, "wb", "cb"], ["yb"], name="gemm_b", transB=1, alpha=0.5, beta=2.0))
    c = relu("xc", [4, 16])                                  # Gemm with a broadcast scalar C
    i["wc"], i["cc"] = rand((16, 8), 4, 0.3), np.array([0.25], np.float32)
    nodes.append(helper.make_node("Gemm", [c, "wc", "cc"], ["yc"], name="gemm_c"))
    d = relu("xd", [1, 8, 5, 5])                             # two 1x1 Convs: biased, grouped unbiased
    i["wd"], i["bd"], i["we"] = rand((6, 8, 1, 1), 5, 0.3), rand((6,), 6, 0.1), rand((4, 4, 1, 1), 7, 0.3)
    nodes.append(helper.make_node("Conv", [d, "wd", "bd"], ["yd"], name="conv_d"))
    nodes.append(helper.make_node("Conv", [d, "we"], ["ye"], name="conv_e", group=2, strides=[2, 2]))
    f = relu("xf", [1, 8, 5, 5])                             # padded Conv: left alone
    i["wf"] = rand((4, 8, 3, 3), 8, 0.3)
    nodes.append(helper.make_node("Conv", [f, "wf"], ["yf"], name="conv_f", pads=[1, 1, 1, 1]))
    g = relu("xg", [4, 16])                                  # also read by a float op: left alone
    i["wg"] = rand((16, 8), 9, 0.3)
    nodes.append(helper.make_node("MatMul", [g, "wg"], ["yg"], name="mm_g"))
    nodes.append(helper.make_node("Sigmoid", [g], ["sg"], name="sig_g"))
    i_ = relu("xi", [4, 16])                                 # Gemm with a per-row C [M, 1]: left alone
    i["wi"], i["ci"] = rand((16, 4), 11, 0.3), rand((4, 1), 12, 0.1)
    nodes.append(helper.make_node("Gemm", [i_, "wi", "ci"], ["yi"], name="gemm_i"))
    j = relu("xj", [4, 16])                                  # Gemm with beta = 0: no bias, left alone
    i["wj"] = rand((16, 8), 13, 0.3)
    nodes.append(helper.make_node("Gemm", [j, "wj"], ["yj"], name="gemm_j", beta=0.0))
    inputs.append(vi("xh", [4, 16]))                         # symmetric: nothing to gain
    i["wh"] = rand((16, 8), 10, 0.3)
    nodes.append(helper.make_node("MatMul", ["xh", "wh"], ["yh"], name="mm_h"))
    for name, shape in [("ya", [4, 8]), ("yb", [4, 8]), ("yc", [4, 8]), ("yd", [1, 6, 5, 5]),
                        ("ye", [1, 4, 3, 3]), ("yf", [1, 4, 5, 5]), ("yg", [4, 8]), ("sg", [4, 16]),
                        ("yh", [4, 8]), ("yi", [4, 4]), ("yj", [4, 8])]:
        outputs.append(vi(name, shape))
    return make_model(nodes, inputs, outputs, i)


def _feed(model, seed):
    return {v.name: rand([d.dim_value for d in v.type.tensor_type.shape.dim], seed + k)
            for k, v in enumerate(model.graph.input)}


def test_shift_keeps_the_float_function_and_biases_absorb_it_through_quantized_weights():
    model = _zoo()
    g = Graph(infer_shapes(model))
    plat = platform.load("trt")
    places = placement.place(g, plat)
    feeds = [_feed(model, 20 + 10 * k) for k in range(4)]
    values = {}
    for f in feeds:
        for name, x in f.items():
            values.setdefault(name, []).append(x)
            values.setdefault(name + "_r", []).append(np.maximum(x, 0))
    stats, plan = {}, QuantPlan()
    for t in places.activations:
        x = np.concatenate([v.ravel() for v in values[t]])
        stats[t] = stats_from(x)
        plan.activations[t] = make_qparams(*RANGE_METHODS["minmax"](stats[t], None), plat.activation)
        plan.rules[t] = plat.activation
    for wp in places.weights.values():
        w = g.weight(wp.tensor)
        moved = np.moveaxis(w, wp.axis, 0).reshape(w.shape[wp.axis], -1)
        plan.weights[wp.tensor] = make_qparams(moved.min(1), moved.max(1), plat.weight, axis=wp.axis)
    weights_before = {n: g.weight(n) for n in ("wa", "wb", "wc", "wd", "we")}
    biases_before = {"cb": g.weight("cb"), "cc": g.weight("cc"), "bd": g.weight("bd")}

    rows = shift.apply(g, places, plan, stats, RANGE_METHODS["minmax"], 0.99999, 99.999)

    assert {r["tensor"] for r in rows} == {"xa_r", "xb_r", "xc_r", "xd_r"}
    assert not {"cb", "cc", "bd"} & {t.name for t in g.graph.initializer}   # replaced, dropped
    for r in rows:                                           # ReLU outputs: twice the levels
        assert r["step_ratio"] == pytest.approx(2.0, rel=0.02)
    for k in range(3):                                       # the float graph: the same function
        f = _feed(model, 200 + 10 * k)
        for got, want in zip(ort_run(g.model, f), ort_run(model, f)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the quantized model's biases: b - W_q d, W_q the dequantized weights
    by_node = {c: (r["shift"], r) for r in rows for c in r["consumers"]}
    bias_of = {n.name: n.input[2] if n.op_type != "MatMul" else None for n in g.graph.node
               if n.name in by_node}

    def wq(name):
        qp = plan.weights[name]
        w = weights_before[name]
        s = qp.scale.reshape([-1 if a == qp.axis else 1 for a in range(w.ndim)])
        return np.clip(np.rint(w / s), qp.qmin, qp.qmax) * s

    d = {n: by_node[n][0] for n in by_node}
    expect = {
        "gemm_b": biases_before["cb"] - 0.5 / 2.0 * d["gemm_b"] * wq("wb").sum(axis=1),
        "gemm_c": biases_before["cc"][0] - d["gemm_c"] * wq("wc").sum(axis=0),
        "conv_d": biases_before["bd"] - d["conv_d"] * wq("wd").reshape(6, -1).sum(axis=1),
        "conv_e": -d["conv_e"] * wq("we").reshape(4, -1).sum(axis=1),
    }
    for node, want in expect.items():
        name = bias_of[node]
        assert plan.value_owners[name] == node
        np.testing.assert_allclose(plan.values[name], want, rtol=1e-5, atol=1e-6)
    add = next(n for n in g.graph.node if n.op_type == "Add" and n.name.startswith("mm_a"))
    np.testing.assert_allclose(plan.values[add.input[1]], -d["mm_a"] * wq("wa").sum(axis=0), rtol=1e-5, atol=1e-6)
    # the shifted tensors' grids: symmetric, zero point 0, the asymmetric step
    for r in rows:
        qp = plan.activations[r["shifted"]]
        assert int(qp.zero_point) == 0 and r["tensor"] not in plan.activations
        assert float(qp.hi) == pytest.approx(127 * float(qp.scale), rel=1e-6)


def test_no_shift_where_the_platform_is_asymmetric_or_the_flag_is_off(tmp_path):
    assert shift.applicable(platform.load("trt"))
    for name in ("snpe", "qnn", "rk", "ort", "imx", "ti", "stpu", "atlas", "magicmind"):
        assert not shift.applicable(platform.load(name))
    model = _relu_matmul()
    res, _ = quantize_model(tmp_path, model, n=3, act_quant="minmax", skip_prof_layer=True, shift=False)
    assert "shift" not in res.report
    res, _ = quantize_model(tmp_path / "snpe", model, n=3, act_quant="minmax", skip_prof_layer=True,
                            deploy="snpe")
    assert "shift" not in res.report


def test_cli_no_shift_flag(tmp_path):
    from conftest import input_feeds, save, write_samples
    from dipoorlet.cli import main

    model = _relu_matmul()
    m = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "d", input_feeds(model, 3))
    for flag, expect in (([], True), (["--no_shift"], False)):
        out = tmp_path / f"o{len(flag)}"
        assert main(["-M", str(m), "-I", str(data), "-N", "3", "-D", "trt", "-O", str(out), "-A", "minmax",
                     "--skip_prof_layer", *flag]) == 0
        assert ("shift" in json.loads((out / "report.json").read_text())) is expect


def test_report_shows_a_shifted_tensor_histogram_in_shifted_units(tmp_path):
    model = _relu_matmul()
    feeds = [{"x": rand((4, 16), 30 + i)} for i in range(4)]
    res, _ = quantize_model(tmp_path, model, feeds=feeds, act_quant="hist", equalize=False, sens_samples=2)
    (row,) = res.report["shift"]
    h = res.report["activation_histograms"][row["shifted"]]
    r_max = max(float(np.maximum(f["x"], 0).max()) for f in feeds)
    assert h["min"] == pytest.approx(row["shift"], abs=1e-6)            # ReLU's 0, moved by d
    assert h["max"] == pytest.approx(r_max + row["shift"], rel=1e-5)
    assert h["edges"][0] <= h["min"] and h["clip"][0] < 0 < h["clip"][1]


def test_initializers_listed_as_graph_inputs_and_a_bias_free_matmul(tmp_path):
    """Old exporters list initializers as graph inputs: a replaced bias must leave both lists. A
    MatMul without a bias gets an Add, and its output is still profiled as a layer."""
    model = _relu_matmul()
    model.graph.input.extend([vi("w", [16, 8]), vi("b", [8])])
    res, qm = quantize_model(tmp_path, model, n=4, act_quant="minmax", equalize=False, sens_samples=2)
    assert [r["tensor"] for r in res.report["shift"]] == ["r"]
    assert "b" not in {i.name for i in qm.graph.input}
    x = rand((4, 16), 5)
    np.testing.assert_allclose(ort_run(qm, {"x": x})[0], ort_run(model, {"x": x})[0], atol=0.05)

    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w"], ["m"], name="mm"),
             helper.make_node("Relu", ["m"], ["r2"], name="relu2"),
             helper.make_node("MatMul", ["r2", "w2"], ["m2"], name="mm2"),
             helper.make_node("Sigmoid", ["m2"], ["y"], name="sig")]
    model = make_model(nodes, [vi("x", [4, 16])], [vi("y", [4, 4])],
                       {"w": rand((16, 8), 1, 0.3), "w2": rand((8, 4), 2, 0.3)})
    res, _ = quantize_model(tmp_path / "nb", model, n=4, act_quant="minmax", equalize=False, sens_samples=2)
    assert {r["tensor"] for r in res.report["shift"]} == {"r", "r2"}
    assert {l["node"] for l in res.report["layers"]} == {"mm", "mm2"}


def test_diagnosis_describes_a_shifted_input_by_its_source():
    from dipoorlet.diagnose import _advice

    row = {"node": "mm", "cause": "activations",
           "activations": [{"tensor": "r_shift", "amax": 11.3, "shifted_from": "r", "clip": [0.0, 22.5],
                            "channel_max": 22.5, "channel_spread": 34.1, "equalization": "off"}]}
    text = _advice(row)
    assert "input r clipped to [0, 22.5]" in text and "r_shift" not in text


def test_report_md_lists_the_transforms(tmp_path):
    res, _ = quantize_model(tmp_path, _relu_matmul(), n=4, act_quant="minmax", skip_prof_layer=True,
                            bias_correction=True)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Transforms applied" in md
    assert "activation shift onto the asymmetric grid: 1 tensor (r 2.00x finer" in md
    assert f"bias correction: {res.report['bias_correction']['layers']} layers" in md
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<h2>Transforms applied</h2>" in page and "r 2.00x finer" in page


def test_report_md_when_bias_correction_finds_nothing(tmp_path):
    """A bias-free MatMul: bias correction has no site and returns only a zero count."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Sigmoid", ["m"], ["y"], name="sig")]
    model = make_model(nodes, [vi("x", [4, 16])], [vi("y", [4, 8])], {"w": rand((16, 8), 1, 0.3)})
    res, _ = quantize_model(tmp_path, model, n=3, act_quant="minmax", skip_prof_layer=True,
                            bias_correction=True, shift=False)
    assert res.report["bias_correction"]["layers"] == 0
    assert "bias correction" not in (tmp_path / "out" / "report.md").read_text()


def test_shift_option_must_be_a_bool(tmp_path):
    from dipoorlet.errors import ConfigError

    with pytest.raises(ConfigError, match="shift must be True or False, got 'no'"):
        quantize_model(tmp_path, _relu_matmul(), n=2, shift="no")
    assert not (tmp_path / "out").exists()
