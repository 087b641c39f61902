"""--gptq: output-aware weight rounding from input statistics (dipoorlet.reconstruct)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import dipoorlet
from dipoorlet.reconstruct import Layer, gptq, n_positions, patches, weight_matrix

from conftest import initializer, input_feeds, make_model, ort_run, rand, save, tiny_cnn, vi, write_samples


@pytest.mark.parametrize("cin,cout,kernel,strides,pads,dil,group", [
    (4, 6, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    (6, 6, (3, 3), (2, 2), (0, 1, 1, 0), (1, 1), 6),        # depthwise, asymmetric pads
    (4, 8, (2, 3), (2, 1), (1, 0, 0, 2), (2, 1), 2),        # grouped, dilated
    (4, 4, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),        # the 1x1 fast path
    (3, 5, (3,), (2,), (1, 2), (2,), 1),                    # 1-D
])
@pytest.mark.parametrize("picked", [False, True])
def test_patches_times_weights_is_the_convolution(cin, cout, kernel, strides, pads, dil, group, picked):
    """Oracle: onnx.reference's Conv. Every output position equals W_group @ its patch column."""
    r = np.random.default_rng(3)
    nd = len(kernel)
    x = r.standard_normal((2, cin) + ((9,) if nd == 1 else (9, 11))).astype(np.float32)
    w = r.standard_normal((cout, cin // group) + kernel).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=strides, pads=pads, dilations=dil, group=group)
    model = helper.make_model(helper.make_graph([node], "g", [vi("x", None)], [vi("y", None)],
                                                [numpy_helper.from_array(w, "w")]))
    y = ReferenceEvaluator(model).run(None, {"x": x})[0]
    lay = Layer("c", "Conv", "w", None, "x", "x", 1.0, 0.0, group=group, kernel=kernel, strides=strides,
                pads=pads, dilations=dil)
    n = n_positions(x, lay)
    assert n == y.shape[0] * int(np.prod(y.shape[2:]))
    pick = np.sort(r.choice(n, min(n, 17), replace=False)) if picked else None
    cols = patches(x.astype(np.float64), lay, pick)
    got = (weight_matrix(w.astype(np.float64), lay) @ cols).reshape(cout, -1)
    ref = np.moveaxis(y, 1, 0).reshape(cout, -1)
    np.testing.assert_allclose(got, ref if pick is None else ref[:, pick], atol=1e-4)


def test_matmul_rows_are_the_last_axis():
    x = rand((2, 5, 7), 1).astype(np.float64)
    lay = Layer("m", "MatMul", "w", None, "x", "x", 1.0, 0.0)
    w = rand((7, 3), 2).astype(np.float64)
    assert n_positions(x, lay) == 10
    got = weight_matrix(w, lay)[0] @ patches(x, lay)[0]
    np.testing.assert_allclose(got.T, (x @ w).reshape(-1, 3))


def _problem(seed, R=16, K=40, P=3000, bits=4):
    r = np.random.default_rng(seed)
    X = (r.standard_normal((K, K)) @ r.standard_normal((K, P))) * r.uniform(0.2, 3, (K, 1))
    W = r.standard_normal((R, K))
    qmax = 2 ** (bits - 1) - 1
    s = np.abs(W).max(axis=1) / qmax
    return W, X, s, qmax


@pytest.mark.parametrize("seed", range(4))
def test_gptq_rounds_onto_the_grid_and_beats_nearest_rounding(seed):
    W, X, s, qmax = _problem(seed)
    Q, Qi = gptq(W[None], (X @ X.T)[None], s[None], np.zeros((1, len(s))), -qmax, qmax)
    Q, Qi = Q[0], Qi[0]
    assert Qi.min() >= -qmax and Qi.max() <= qmax
    np.testing.assert_allclose(Q, Qi * s[:, None], rtol=0, atol=1e-12)
    rtn = np.clip(np.rint(W / s[:, None]), -qmax, qmax) * s[:, None]
    err = lambda wq: float(np.sum(((W - wq) @ X) ** 2))
    assert err(Q) < 0.7 * err(rtn)      # correlated inputs: GPTQ spreads each rounding error


def test_gptq_with_uncorrelated_inputs_is_nearest_rounding():
    """A diagonal H has nothing to spread an error onto: every weight rounds to nearest."""
    W, _, s, qmax = _problem(5)
    H = np.diag(np.random.default_rng(1).uniform(0.5, 2, W.shape[1]))
    Q, _ = gptq(W[None], H[None], s[None], 0.0, -qmax, qmax)
    rtn = np.clip(np.rint(W / s[:, None]), -qmax, qmax) * s[:, None]
    np.testing.assert_allclose(Q[0], rtn, atol=1e-12)


def test_gptq_bias_column_is_never_rounded_and_absorbs_the_mean():
    W, X, s, qmax = _problem(7)
    X = X + 5.0                                      # inputs with a large mean
    b = np.random.default_rng(2).standard_normal((W.shape[0], 1))
    Xa, Wa = np.vstack([X, np.ones((1, X.shape[1]))]), np.hstack([W, b])
    Q, _ = gptq(Wa[None], (Xa @ Xa.T)[None], s[None], 0.0, -qmax, qmax, fixed_last=True)
    Q = Q[0]
    on_grid = Q[:, :-1] / s[:, None]
    np.testing.assert_allclose(on_grid, np.rint(on_grid), atol=1e-9)
    assert not np.allclose(Q[:, -1], b[:, 0])        # the bias moved
    Qn, _ = gptq(W[None], (X @ X.T)[None], s[None], 0.0, -qmax, qmax)
    err_bias = np.sum(((Wa - Q) @ Xa) ** 2)
    err_nobias = np.sum(((W - Qn[0]) @ X) ** 2)
    assert err_bias < err_nobias


def _single_conv(tmp_path, seed=0):
    """x -> Conv(3x3, pad 1, bias) -> y; its error at y is exactly the layer objective."""
    r = np.random.default_rng(seed)
    inits = {"w": (r.standard_normal((8, 6, 3, 3)) * 0.2).astype(np.float32),
             "b": (r.standard_normal(8) * 0.1).astype(np.float32)}
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])
    model = make_model([node], [vi("x", [1, 6, 8, 8])], [vi("y", [1, 8, 8, 8])], inits)
    mix = r.standard_normal((6, 6))
    feeds = [{"x": np.einsum("ij,njhw->nihw", mix, r.standard_normal((1, 6, 8, 8))).astype(np.float32) + 0.5}
             for _ in range(12)]
    return save(model, tmp_path / "m.onnx"), write_samples(tmp_path / "data", feeds), model, feeds


def test_gptq_lowers_the_measured_layer_error_by_the_reported_amount(tmp_path):
    """Oracle: onnxruntime runs of the float and both quantized models. With one layer the
    network's output error is the layer objective, so the gain the statistics predict (report)
    must be the one measured, and the grids (scales) must not change."""
    path, data, model, feeds = _single_conv(tmp_path)
    errs, models = {}, {}
    for on in (False, True):
        out = tmp_path / f"out{on}"
        dipoorlet.quantize(model=path, input_dir=data, data_num=len(feeds), deploy="trt", output_dir=out,
                           act_quant="minmax", equalize=False, shift=False, gptq=on, skip_prof_layer=True)
        q = onnx.load(str(out / "quant_model.onnx"))
        models[on] = q
        errs[on] = sum(float(np.sum((ort_run(model, f)[0].astype(np.float64)
                                      - ort_run(q, f)[0].astype(np.float64)) ** 2)) for f in feeds)
        if on:
            rep = json.loads((out / "report.json").read_text())
    assert errs[True] < errs[False] * 0.9
    gain = rep["gptq"]["gain_db"][0]
    assert gain["node"] == "conv" and rep["gptq"]["layers"] == 1
    assert gain["db"] == pytest.approx(10 * np.log10(errs[False] / errs[True]), abs=0.05)
    scale = [t for t in models[False].graph.initializer if t.name.endswith("_scale")]
    for t in scale:
        np.testing.assert_array_equal(numpy_helper.to_array(t), initializer(models[True], t.name))
    assert "gptq" in (tmp_path / "outTrue" / "report.md").read_text()


def test_positions_per_sample_follow_the_rows_needed():
    from dipoorlet import reconstruct as r

    assert r.MIN_POSITIONS < r.MAX_POSITIONS
    assert r.positions(100, 1) == r.MAX_POSITIONS                  # one sample: all it may give
    assert r.positions(600, 100) == -(-r.ROWS_PER_INPUT * 600 // 100)   # rows per input decide
    assert r.positions(100, 10_000_000) == r.MIN_POSITIONS         # never fewer than this
    assert r.positions(3000, 32) == r.MAX_POSITIONS


def test_statistics_are_exact_sums_in_any_order(tmp_path):
    """The MPI merge claim: statistics over samples 0..11 equal, bit for bit, the sum of those
    over two disjoint halves (float64 sums of exactly representable multiples)."""
    from dipoorlet import placement as placement_mod, platform as platform_mod, reconstruct
    from dipoorlet.calibrate import collect
    from dipoorlet.config import QuantConfig
    from dipoorlet.data import DataSource, input_specs
    from dipoorlet.dist import SingleProcess
    from dipoorlet.pipeline import load_graph, plan_activations, plan_weights
    from dipoorlet.qdq import insert_qdq

    model = tiny_cnn(seed=4)
    path = save(model, tmp_path / "m.onnx")
    feeds = input_feeds(model, 12, seed=3)
    data_dir = write_samples(tmp_path / "data", feeds)
    cfg = QuantConfig(model=path, input_dir=data_dir, data_num=12, act_quant="minmax", output_dir=tmp_path / "o")
    g, cfg = load_graph(cfg)
    plat = platform_mod.load("trt")
    data = DataSource(data_dir, input_specs(g), 12, {})
    places = placement_mod.place(g, plat, ())
    stats = collect(g, data, list(range(12)), list(places.activations), SingleProcess(), False, 2048, "cpu")
    plan = plan_activations(stats, cfg, plat, places)
    plan_weights(g, places, plan, plat, cfg)
    qmodel = insert_qdq(g, places, plan)
    layers, skipped = reconstruct.find_layers(g, places, plan, qmodel)
    assert {lay.node for lay in layers} == {"conv1", "conv2", "fc"} and not skipped
    full, _, rows, n = reconstruct.statistics(g, qmodel, layers, data, list(range(12)), SingleProcess(), "cpu",
                                                samples=12)
    a, _, _, _ = reconstruct.statistics(g, qmodel, layers, data, [7, 3, 11, 0, 5, 9], SingleProcess(), "cpu",
                                           samples=12)
    b, _, _, _ = reconstruct.statistics(g, qmodel, layers, data, [1, 2, 4, 6, 8, 10], SingleProcess(), "cpu",
                                           samples=12)
    assert n == 12
    for lay in layers:
        assert np.array_equal(full[lay.node], a[lay.node] + b[lay.node]), lay.node
    # and they are the layer's input moments: H's bias corner counts the positions
    conv1 = full["conv1"]
    w1 = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "w1")
    per_sample = min(16 * 16, reconstruct.positions(int(np.prod(w1.shape[1:])) + 1, 12))
    assert conv1[0][0, -1, -1] == 12 * per_sample == rows["conv1"]
    assert rows["fc"] == 12


def test_gptq_leaves_skipped_layers_and_runs_from_the_cli(tmp_path):
    model = tiny_cnn(seed=1)
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, 6, seed=2))
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "dipoorlet", "-M", str(path), "-I", str(data), "-N", "6",
                          "-D", "trt", "-O", str(out), "--gptq", "--gptq_samples", "4", "--skip_layers", "conv2"],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["gptq"]["samples"] == 4
    assert {r["node"] for r in rep["gptq"]["gain_db"]} <= {"conv1", "fc"}
    q = onnx.load(str(out / "quant_model.onnx"))
    np.testing.assert_array_equal(initializer(q, "w2"), numpy_helper.to_array(
        [t for t in model.graph.initializer if t.name == "w2"][0]))
    assert "gptq" in res.stderr   # the closing summary names its time
    bad = subprocess.run([sys.executable, "-m", "dipoorlet", "-M", str(path), "-I", str(data), "-N", "6",
                          "-D", "trt", "-O", str(tmp_path / "bad"), "--gptq", "--gptq_samples", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--gptq_samples must be a positive integer" in bad.stderr
    assert "Traceback" not in bad.stderr


def _conv_case(tmp_path, feeds, w_shape=(8, 4, 3, 3), seed=1):
    r = np.random.default_rng(seed)
    inits = {"w": (r.standard_normal(w_shape) * 0.3).astype(np.float32),
             "b": r.standard_normal(w_shape[0]).astype(np.float32)}
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])
    shape = list(feeds[0]["x"].shape)
    model = make_model([node], [vi("x", shape)], [vi("y", [shape[0], w_shape[0]] + shape[2:])], inits)
    return model, save(model, tmp_path / "m.onnx"), write_samples(tmp_path / "data", feeds)


def test_clipped_outliers_do_not_decide_the_weights(tmp_path):
    """A clip range that cuts off one huge value per sample: the layer compensates its input's
    rounding, not the clipping, so its weights stay near nearest rounding and fresh data does not
    get worse (review finding: SQNR 19.9 -> -26.6 dB when the clipped tail was the target)."""
    r = np.random.default_rng(1)
    feeds = []
    for i in range(8):
        x = r.standard_normal((1, 4, 32, 32)).astype(np.float32)
        x[0, i % 4, 5 + i, 7] = 1e5
        feeds.append({"x": x})
    model, path, data = _conv_case(tmp_path, feeds)
    fresh = [{"x": r.standard_normal((1, 4, 32, 32)).astype(np.float32)} for _ in range(4)]
    err, ints = {}, {}
    for on in (False, True):
        out = tmp_path / f"o{on}"
        dipoorlet.quantize(model=path, input_dir=data, data_num=8, deploy="trt", output_dir=out,
                           act_quant="percentile", percentile=99.9, gptq=on, skip_prof_layer=True)
        q = onnx.load(str(out / "quant_model.onnx"))
        ints[on] = next(numpy_helper.to_array(t) for t in q.graph.initializer if t.name.endswith("_quantized"))
        err[on] = sum(float(np.sum((ort_run(model, f)[0] - ort_run(q, f)[0]).astype(np.float64) ** 2)) for f in fresh)
    # a few steps of compensation (3 with the draws since session 25), not the tail's tens
    assert np.abs(ints[True].astype(int) - ints[False]).max() <= 4
    assert err[True] <= err[False] * 1.05


def test_each_channel_keeps_its_grid_ends(tmp_path):
    """Backends that take the float weights of transformed_model.onnx and derive their own
    per-channel scale (TensorRT: max |w| / 127) must find the grid and integers of quant_model."""
    r = np.random.default_rng(4)
    feeds = [{"x": (r.standard_normal((1, 6, 16, 16)) + 1.0).astype(np.float32)} for _ in range(8)]
    model, path, data = _conv_case(tmp_path, feeds, w_shape=(16, 6, 3, 3))
    out = tmp_path / "o"
    dipoorlet.quantize(model=path, input_dir=data, data_num=8, deploy="trt", output_dir=out, act_quant="mse",
                       w_bits=4, gptq=True, skip_prof_layer=True, equalize=False)
    rep = json.loads((out / "report.json").read_text())
    assert rep["gptq"]["layers"] == 1
    t = onnx.load(str(out / "transformed_model.onnx"))
    w = next(numpy_helper.to_array(x) for x in t.graph.initializer if x.name == "w").astype(np.float64)
    q = onnx.load(str(out / "quant_model.onnx"))
    scale = next(numpy_helper.to_array(x) for x in q.graph.initializer if x.name.startswith("w") and x.name.endswith("_scale"))
    ints = next(numpy_helper.to_array(x) for x in q.graph.initializer if x.name.endswith("_quantized"))
    derived = np.abs(w).reshape(16, -1).max(axis=1) / 7
    np.testing.assert_allclose(derived, scale, rtol=1e-6)
    np.testing.assert_array_equal(np.rint(w / derived[:, None, None, None]), ints)
    orig = next(numpy_helper.to_array(x) for x in model.graph.initializer if x.name == "w")
    assert not np.array_equal(np.rint(orig / derived[:, None, None, None]), ints)   # rounding did change


def test_one_grid_per_tensor_keeps_the_tensor_ends_only(tmp_path):
    """snpe (one asymmetric weight grid per tensor): the tensor's min and max keep their levels,
    so min/max of transformed_model's weights give back the grid; other channel ends may move."""
    r = np.random.default_rng(4)
    feeds = [{"x": (r.standard_normal((1, 6, 16, 16)) + 1.0).astype(np.float32)} for _ in range(8)]
    model, path, data = _conv_case(tmp_path, feeds, w_shape=(16, 6, 3, 3))
    # channel 0 spans 4x the others: their ends sit inside the grid, free to move
    w0 = next(x for x in model.graph.initializer if x.name == "w")
    arr = numpy_helper.to_array(w0).copy()
    arr[0] *= 4.0
    w0.CopyFrom(numpy_helper.from_array(arr, "w"))
    path = save(model, tmp_path / "m.onnx")
    out = tmp_path / "o"
    dipoorlet.quantize(model=path, input_dir=data, data_num=8, deploy="snpe", output_dir=out, act_quant="mse",
                       gptq=True, skip_prof_layer=True, equalize=False)
    assert json.loads((out / "report.json").read_text())["gptq"]["layers"] == 1
    t = onnx.load(str(out / "transformed_model.onnx"))
    w = next(numpy_helper.to_array(x) for x in t.graph.initializer if x.name == "w").astype(np.float64)
    orig = next(numpy_helper.to_array(x) for x in model.graph.initializer if x.name == "w").astype(np.float64)
    q = onnx.load(str(out / "quant_model.onnx"))
    scale = float(next(numpy_helper.to_array(x) for x in q.graph.initializer
                       if x.name.startswith("w") and x.name.endswith("_scale")))
    zp = float(next(numpy_helper.to_array(x) for x in q.graph.initializer
                    if x.name.startswith("w") and x.name.endswith("_zero_point")))
    lv = lambda v: np.rint(v / scale + zp)
    assert lv(w.max()) == lv(orig.max()) and lv(w.min()) == lv(orig.min())
    assert lv(w).max() == lv(orig).max() and lv(w).min() == lv(orig).min()
    moved = [c for c in range(16) if lv(w[c]).max() != lv(orig[c]).max() or lv(w[c]).min() != lv(orig[c]).min()]
    assert moved      # per-channel ends were free to move


def test_weight_shared_with_a_float_node_is_left_alone(tmp_path):
    """Two Convs read one weight, one is kept float: re-rounding the weight for the other would
    change the float one in transformed_model.onnx (review finding)."""
    r = np.random.default_rng(5)
    inits = {"w": (r.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w"], ["b"], name="conv_b", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    model = make_model(nodes, [vi("x", [1, 4, 8, 8])], [vi("y", [1, 4, 8, 8])], inits)
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", [{"x": rand((1, 4, 8, 8), i)} for i in range(6)])
    out = tmp_path / "o"
    dipoorlet.quantize(model=path, input_dir=data, data_num=6, deploy="trt", output_dir=out, gptq=True,
                       skip_layers=("conv_a",), skip_prof_layer=True, equalize=False)
    rep = json.loads((out / "report.json").read_text())
    assert rep["gptq"]["layers"] == 0 and "shared" in rep["gptq"]["skipped"]["conv_b"]


def test_too_few_rows_for_the_inputs_is_not_fitted(tmp_path, caplog):
    """A Gemm after global pooling sees one row per sample: with fewer rows than 4x its inputs
    the fit would learn the samples, so the layer keeps nearest rounding and says why, and the
    log says how many samples would fit it."""
    model = tiny_cnn(seed=2)
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, 6, seed=1))
    out = tmp_path / "o"
    caplog.set_level("INFO")
    dipoorlet.quantize(model=path, input_dir=data, data_num=6, deploy="trt", output_dir=out, gptq=True,
                       skip_prof_layer=True)
    rep = json.loads((out / "report.json").read_text())
    assert "too few to fit" in rep["gptq"]["skipped"]["fc"]
    assert "fc" not in {r["node"] for r in rep["gptq"]["gain_db"]}
    node = next(n for n in model.graph.node if n.name == "fc")
    w = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == node.input[1])
    k = w.shape[1] if any(a.name == "transB" and a.i for a in node.attribute) else w.shape[0]
    inputs = k + (len(node.input) > 2)
    assert f"about {4 * inputs} samples would fit them all" in caplog.text     # one row per sample


def test_pinned_weights_keep_their_levels_and_the_others_compensate():
    """Pinning inside the GPTQ loop (each channel's extreme weights at their nearest levels, for
    backends that derive the grid from the weights) spreads the pinned weights' error like any
    other: on a 4-bit problem it beats pinning them after an unpinned GPTQ."""
    W, X, s, _ = _problem(11)
    qmax = 7
    s = np.abs(W).max(axis=1) / qmax
    H = (X @ X.T)[None]
    ri = np.clip(np.rint(W / s[:, None]), -qmax, qmax)
    mask = np.zeros(W.shape, bool)
    for ends in (np.argmax(W, axis=1), np.argmin(W, axis=1)):
        mask[np.arange(W.shape[0]), ends] = True
    Q, Qi = gptq(W[None], H, s[None], 0.0, -qmax, qmax, pin=(mask[None], ri[None]))
    assert np.array_equal(Qi[0][mask], ri[mask].astype(np.int64))
    assert np.array_equal(np.abs(Qi[0]).max(axis=1), np.abs(ri).max(axis=1).astype(np.int64))
    Qa, Qia = gptq(W[None], H, s[None], 0.0, -qmax, qmax)
    after = Qia[0].astype(np.float64)
    after[mask] = ri[mask]
    err = lambda wq: float(np.sum(((W - wq) @ X) ** 2))
    assert err(Q[0]) < err(after * s[:, None])
    assert err(Q[0]) < err(ri * s[:, None])


def test_memory_budget_leaves_drawn_positions_and_so_the_rounding_unchanged(tmp_path):
    """Two 3x3 Convs on 32x32 inputs: 1,024 output positions per sample, more than the cap at 16
    samples, so positions are drawn. One generator per sample shared by a pass's layers made the
    second layer's draw (299 of its 2,304 4-bit weights) depend on whether the first shared its
    pass."""
    from onnx import helper

    rng = np.random.default_rng(5)
    w = lambda *shape, s=0.3: (rng.standard_normal(shape) * s).astype(np.float32)
    model = make_model([helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
                        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
                        helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1])],
                       [vi("x", [1, 8, 32, 32])], [vi("y", [1, 16, 32, 32])],
                       {"w1": w(16, 8, 3, 3), "b1": w(16), "w2": w(16, 16, 3, 3, s=0.15), "b2": w(16)})
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", [{"x": w(1, 8, 32, 32, s=1.0)} for _ in range(16)])
    got = {}
    for mb in (256.0, 1e-3):
        out = tmp_path / f"o{mb}"
        res = dipoorlet.quantize(model=path, input_dir=data, data_num=16, deploy="trt", output_dir=out,
                                 gptq=True, w_bits=4, gptq_memory=mb, skip_prof_layer=True)
        got[mb] = (res.report["gptq"]["passes"], (out / "quant_model.onnx").read_bytes())
    assert got[256.0][0] == 1 and got[1e-3][0] == 2
    assert got[256.0][1] == got[1e-3][1]


def test_memory_budget_splits_the_pass_without_changing_the_result(tmp_path):
    """--gptq_memory below every layer's statistics: one pass per layer over the same
    nearest-rounded model, and the same quantized model, byte for byte, as one pass."""
    from dipoorlet import reconstruct

    model = tiny_cnn(seed=6)
    path = save(model, tmp_path / "m.onnx")
    feeds = input_feeds(model, 8, seed=5)
    data = write_samples(tmp_path / "data", feeds)
    reps = {}
    for mb in (256.0, 1e-4):
        out = tmp_path / f"o{mb}"
        res = dipoorlet.quantize(model=path, input_dir=data, data_num=8, deploy="trt", output_dir=out,
                                 gptq=True, gptq_memory=mb, skip_prof_layer=True)
        reps[mb] = (res.report["gptq"], (out / "quant_model.onnx").read_bytes())
    assert reps[256.0][0]["passes"] == 1
    assert reps[1e-4][0]["passes"] == reps[1e-4][0]["candidates"] == 3
    assert reps[256.0][0]["gain_db"] and reps[256.0][0]["gain_db"] == reps[1e-4][0]["gain_db"]
    assert reps[256.0][1] == reps[1e-4][1]
    # the split itself: graph order, a budget of two layers' statistics holds two
    from types import SimpleNamespace
    fake = SimpleNamespace(weight=lambda name: np.zeros((4, 3, 3, 3)))
    lays = [reconstruct.Layer(f"c{i}", "Conv", f"w{i}", None, "x", "xq", 1.0, 0.0) for i in range(5)]
    size = reconstruct.stat_bytes(fake, lays[0])
    assert size == 2 * 27 * 27 * 8
    split = reconstruct.passes(fake, lays, 2 * size)
    assert [[lay.node for lay in p] for p in split] == [["c0", "c1"], ["c2", "c3"], ["c4"]]
    assert len(reconstruct.passes(fake, lays, 1)) == 5


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "big"])
def test_gptq_memory_must_be_a_positive_number(tmp_path, bad):
    from dipoorlet.config import QuantConfig
    from dipoorlet.errors import ConfigError

    with pytest.raises(ConfigError, match="--gptq_memory"):
        QuantConfig(model=tmp_path / "m.onnx", input_dir=tmp_path, data_num=1, gptq=True,
                    gptq_memory=bad, output_dir=tmp_path / "o")


def test_default_gptq_samples_are_capped(tmp_path, monkeypatch):
    """Without --gptq_samples the statistics read N samples, at most DEFAULT_SAMPLES."""
    from dipoorlet import reconstruct

    monkeypatch.setattr(reconstruct, "DEFAULT_SAMPLES", 4)
    model = tiny_cnn(seed=1)
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, 6, seed=2))
    for n, given, expect in ((6, None, 4), (3, None, 3), (6, 5, 5)):
        res = dipoorlet.quantize(model=path, input_dir=data, data_num=n, deploy="trt", output_dir=tmp_path / f"o{n}{given}",
                                 gptq=True, gptq_samples=given, skip_prof_layer=True)
        assert res.report["gptq"]["samples"] == expect


@pytest.mark.parametrize("kernel", [(2, 2), (3,), (2, 3)])
@pytest.mark.parametrize("picked", [False, True])
def test_deconv_with_kernel_equal_to_stride_is_a_product_per_input_pixel(kernel, picked):
    """Oracle: onnx.reference's ConvTranspose. Row (channel, tap) of the weight matrix times
    input pixel p is the output pixel that tap writes from p; from_matrix inverts weight_matrix."""
    from dipoorlet.reconstruct import from_matrix

    r = np.random.default_rng(5)
    cin, cout = 4, 3
    spatial = (5,) if len(kernel) == 1 else (5, 4)
    x = r.standard_normal((2, cin) + spatial).astype(np.float32)
    w = r.standard_normal((cin, cout) + kernel).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=list(kernel))
    model = helper.make_model(helper.make_graph([node], "g", [vi("x", None)], [vi("y", None)],
                                                [numpy_helper.from_array(w, "w")]))
    y = ReferenceEvaluator(model).run(None, {"x": x})[0]
    lay = Layer("d", "ConvTranspose", "w", None, "x", "x", 1.0, 0.0, kernel=kernel)
    n = n_positions(x, lay)
    assert n == 2 * int(np.prod(spatial))
    m = weight_matrix(w.astype(np.float64), lay)
    np.testing.assert_array_equal(from_matrix(m, lay, w.shape), w)
    pick = np.sort(r.choice(n, 7, replace=False)) if picked else None
    got = (m @ patches(x.astype(np.float64), lay, pick))[0]          # [cout * taps, pixels]
    # the oracle: output pixel (i * k + tap) of input pixel i, per channel and tap
    taps = list(np.ndindex(*kernel))
    ref = np.empty((cout, len(taps), 2) + spatial)
    for t, off in enumerate(taps):
        sl = tuple(slice(o, None, k) for o, k in zip(off, kernel))
        ref[:, t] = np.moveaxis(y[(slice(None), slice(None)) + sl], 1, 0)
    ref = ref.reshape(cout * len(taps), -1)
    np.testing.assert_allclose(got, ref if pick is None else ref[:, pick], atol=1e-4)


def _single_deconv(tmp_path, strides=(2, 2), kernel=(2, 2), seed=0):
    r = np.random.default_rng(seed)
    inits = {"w": (r.standard_normal((12, 3) + kernel) * 0.2).astype(np.float32),
             "b": (r.standard_normal(3) * 0.1).astype(np.float32)}
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="deconv", strides=list(strides))
    out_hw = [(6 - 1) * s + k for s, k in zip(strides, kernel)]
    model = make_model([node], [vi("x", [1, 12, 6, 6])], [vi("y", [1, 3] + out_hw)], inits)
    mix = r.standard_normal((12, 12))
    feeds = [{"x": np.einsum("ij,njhw->nihw", mix, r.standard_normal((1, 12, 6, 6))).astype(np.float32) + 0.5}
             for _ in range(12)]
    return save(model, tmp_path / "m.onnx"), write_samples(tmp_path / "data", feeds), model, feeds


def test_gptq_fits_a_deconv_and_keeps_its_grid(tmp_path):
    """A DB head's 2x2 stride-2 ConvTranspose: re-rounded, the output error onnxruntime measures
    falls by the reported gain, and TensorRT's per-channel scale (max |w| over each output
    channel, axis 1) derived from transformed_model.onnx is the quantized model's."""
    path, data, model, feeds = _single_deconv(tmp_path)
    errs = {}
    for on in (False, True):
        out = tmp_path / f"out{on}"
        dipoorlet.quantize(model=path, input_dir=data, data_num=len(feeds), deploy="trt", output_dir=out,
                           act_quant="minmax", equalize=False, shift=False, gptq=on, w_bits=4,
                           skip_prof_layer=True)
        q = onnx.load(str(out / "quant_model.onnx"))
        errs[on] = sum(float(np.sum((ort_run(model, f)[0].astype(np.float64)
                                      - ort_run(q, f)[0].astype(np.float64)) ** 2)) for f in feeds)
    rep = json.loads((tmp_path / "outTrue" / "report.json").read_text())
    assert rep["gptq"]["layers"] == 1 and rep["gptq"]["gain_db"][0]["node"] == "deconv"
    assert errs[True] < errs[False] * 0.9
    assert rep["gptq"]["gain_db"][0]["db"] == pytest.approx(10 * np.log10(errs[False] / errs[True]), abs=0.05)
    t = onnx.load(str(tmp_path / "outTrue" / "transformed_model.onnx"))
    w = next(numpy_helper.to_array(x) for x in t.graph.initializer if x.name == "w").astype(np.float64)
    q = onnx.load(str(tmp_path / "outTrue" / "quant_model.onnx"))
    scale = next(numpy_helper.to_array(x) for x in q.graph.initializer if x.name == "w_scale")
    ints = next(numpy_helper.to_array(x) for x in q.graph.initializer if x.name == "w_quantized")
    derived = np.abs(np.moveaxis(w, 1, 0)).reshape(3, -1).max(axis=1) / 7
    np.testing.assert_allclose(derived, scale, rtol=1e-6)
    np.testing.assert_array_equal(np.rint(w / derived[None, :, None, None]), ints)


def test_overlapping_deconv_is_left_alone_with_the_reason(tmp_path):
    path, data, _, feeds = _single_deconv(tmp_path, strides=(2, 2), kernel=(3, 3))
    out = tmp_path / "o"
    dipoorlet.quantize(model=path, input_dir=data, data_num=len(feeds), deploy="trt", output_dir=out,
                       gptq=True, skip_prof_layer=True)
    rep = json.loads((out / "report.json").read_text())
    assert rep["gptq"]["layers"] == 0
    assert "overlap" in rep["gptq"]["skipped"]["deconv"]


def test_diagnosis_names_gptq_only_for_layers_it_can_fit(tmp_path):
    """A padded 4x4 stride-2 ConvTranspose whose input rounding dominates: --gptq would skip it
    (taps overlap), so the advice does not suggest it (review finding)."""
    r = np.random.default_rng(0)
    nodes = [helper.make_node("ConvTranspose", ["x", "wt", "b"], ["y"], name="deconv", strides=[2, 2],
                              pads=[1, 1, 1, 1])]
    model = make_model(nodes, [vi("x", [1, 8, 6, 6])], [vi("y", [1, 4, 12, 12])],
                       {"wt": rand((8, 4, 4, 4), 3, 0.3), "b": rand((4,), 2, 0.1)})
    feeds = []
    for _ in range(6):
        x = r.standard_normal((1, 8, 6, 6)).astype(np.float32)
        x[0, 0] *= 60.0          # one wide channel: input rounding dominates
        feeds.append({"x": x})
    path, data = save(model, tmp_path / "m.onnx"), write_samples(tmp_path / "data", feeds)
    res = dipoorlet.quantize(model=path, input_dir=data, data_num=len(feeds), deploy="trt", output_dir=tmp_path / "o",
                             equalize=False, act_quant="minmax", sens_samples=4)
    rows = {d["node"]: d for d in res.report["diagnosis"]}
    assert rows["deconv"]["cause"] == "activations"
    assert "--gptq" not in rows["deconv"]["advice"]
