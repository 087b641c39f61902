"""--sparse: pruning as the weights are rounded (SparseGPT on the --gptq statistics). Oracles:
numpy (the pattern, magnitude pruning's error), onnxruntime runs of the float and quantized
models."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import dipoorlet
from dipoorlet.config import parse_sparse
from dipoorlet.errors import ConfigError
from dipoorlet.reconstruct import gptq

from conftest import make_model, ort_run, save, vi, weight_ints, write_samples


def _problem(seed, R=16, K=64, P=3000):
    r = np.random.default_rng(seed)
    X = (r.standard_normal((K, K)) @ r.standard_normal((K, P))) * r.uniform(0.2, 3, (K, 1))
    W = r.standard_normal((R, K))
    return W, X, np.abs(W).max(axis=1) / 127


def _magnitude(W, s, n, m):
    """Oracle: the smallest |w| of every m consecutive columns zeroed, the rest rounded."""
    R, K = W.shape
    g = np.abs(W).reshape(R, K // m, m)
    mask = np.zeros(g.shape, bool)
    np.put_along_axis(mask, np.argsort(g, axis=2)[:, :, :m - n], True, axis=2)
    return np.where(mask.reshape(R, K), 0.0, np.rint(W / s[:, None]) * s[:, None])


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8)])
def test_nm_pattern_holds_and_beats_magnitude_pruning(n, m):
    W, X, s = _problem(n * 10 + m)
    Q, Qi = gptq(W[None], (X @ X.T)[None], s[None], 0.0, -127, 127, sparse=(n, m), order=np.arange(W.shape[1]))
    Q = Q[0]
    nonzero = (Qi[0] != 0).reshape(W.shape[0], -1, m).sum(axis=2)
    assert nonzero.max() <= n
    np.testing.assert_allclose(Q, Qi[0] * s[:, None], atol=1e-12)
    err = lambda q: float(np.sum(((W - q) @ X) ** 2))
    assert err(Q) < 0.6 * err(_magnitude(W, s, n, m))


def test_nm_groups_follow_the_given_order():
    """A Conv's groups are m consecutive input channels of one tap: the order puts them next to
    each other, and the pattern must hold there, not on the stored column order."""
    W, X, s = _problem(3, K=8 * 9)
    order = np.arange(8 * 9).reshape(8, 9).T.reshape(-1)        # (channel, tap) -> tap-major
    _, Qi = gptq(W[None], (X @ X.T)[None], s[None], 0.0, -127, 127, sparse=(2, 4), order=order)
    per_tap = Qi[0].reshape(W.shape[0], 8, 9)                     # [R, channel, tap]
    assert ((per_tap.reshape(W.shape[0], 2, 4, 9) != 0).sum(axis=2) <= 2).all()


def test_rate_zeroes_that_share_of_every_row():
    W, X, s = _problem(7, K=100)
    _, Qi = gptq(W[None], (X @ X.T)[None], s[None], 0.0, -127, 127, sparse=0.3)
    zeros = (Qi[0] == 0).sum(axis=1)
    assert (zeros >= 30).all() and zeros.mean() < 33     # 30 pruned per row, a few more round to 0


@pytest.mark.parametrize("text,want", [("2:4", (2, 4)), (" 1 : 8 ", (1, 8)), ("0.5", 0.5), (0.25, 0.25)])
def test_parse_sparse(text, want):
    assert parse_sparse(text) == want


@pytest.mark.parametrize("bad", ["4:4", "0:4", "1.5", "0", "a:b", "2:4:8", True])
def test_parse_sparse_refuses(bad):
    with pytest.raises(ConfigError, match="--sparse"):
        parse_sparse(bad)


def _conv(tmp_path, cin=8, seed=0):
    r = np.random.default_rng(seed)
    inits = {"w": (r.standard_normal((6, cin, 3, 3)) * 0.2).astype(np.float32),
             "b": (r.standard_normal(6) * 0.1).astype(np.float32)}
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])
    model = make_model([node], [vi("x", [1, cin, 8, 8])], [vi("y", [1, 6, 8, 8])], inits)
    mix = r.standard_normal((cin, cin))
    feeds = [{"x": np.einsum("ij,njhw->nihw", mix, r.standard_normal((1, cin, 8, 8))).astype(np.float32) + 0.5}
             for _ in range(16)]
    return save(model, tmp_path / "m.onnx"), write_samples(tmp_path / "data", feeds), model, feeds


def test_sparse_conv_from_the_api_keeps_2_of_4_input_channels_per_tap(tmp_path):
    """End to end: every (output channel, tap) has at most 2 non-zero integers in each group of
    4 input channels; the reported error equals the one onnxruntime measures; pruning with
    compensation loses less than magnitude pruning of the same weights (the float model with
    magnitude-pruned weights, quantized the same way)."""
    path, data, model, feeds = _conv(tmp_path)
    runs = {}
    for how in ("dense", "sparse"):
        out = tmp_path / how
        dipoorlet.quantize(model=path, input_dir=data, data_num=len(feeds), deploy="trt", output_dir=out,
                           act_quant="minmax", equalize=False, shift=False, skip_prof_layer=True,
                           sparse="2:4" if how == "sparse" else None)
        q = onnx.load(str(out / "quant_model.onnx"))
        err = sum(float(np.sum((ort_run(model, f)[0].astype(np.float64) - ort_run(q, f)[0].astype(np.float64)) ** 2))
                  for f in feeds)
        runs[how] = (q, err, json.loads((out / "report.json").read_text()))
    q, err, rep = runs["sparse"]
    ints = weight_ints(q, "w")
    assert ints.shape == (6, 8, 3, 3)
    assert ((ints.reshape(6, 2, 4, 3, 3) != 0).sum(axis=2) <= 2).all()
    assert rep["sparse"]["pattern"] == "2:4" and rep["sparse"]["layers"] == 1
    assert rep["sparse"]["zero_fraction"] >= 0.5
    db = rep["sparse"]["gain_db"][0]["db"]
    assert db == pytest.approx(10 * np.log10(runs["dense"][1] / err), abs=0.05)
    # magnitude pruning of the same weights, quantized the same way
    w = numpy_helper.to_array([t for t in model.graph.initializer if t.name == "w"][0])
    g = np.abs(w).reshape(6, 2, 4, 3, 3)
    keep = np.argsort(g, axis=2)[:, :, 2:]
    mask = np.zeros(g.shape, bool)
    np.put_along_axis(mask, keep, True, axis=2)
    pruned = np.where(mask.reshape(w.shape), w, 0).astype(np.float32)
    mm = onnx.ModelProto()
    mm.CopyFrom(model)
    for t in mm.graph.initializer:
        if t.name == "w":
            t.CopyFrom(numpy_helper.from_array(pruned, "w"))
    mpath = save(mm, tmp_path / "mag.onnx")
    dipoorlet.quantize(model=mpath, input_dir=data, data_num=len(feeds), deploy="trt", output_dir=tmp_path / "mag",
                       act_quant="minmax", equalize=False, shift=False, skip_prof_layer=True)
    qm = onnx.load(str(tmp_path / "mag" / "quant_model.onnx"))
    err_mag = sum(float(np.sum((ort_run(model, f)[0].astype(np.float64) - ort_run(qm, f)[0].astype(np.float64)) ** 2))
                  for f in feeds)
    assert err < 0.7 * err_mag
    assert "sparse 2:4" in (tmp_path / "sparse" / "report.md").read_text()


def test_channels_not_in_groups_of_m_stay_dense_with_the_reason(tmp_path, caplog):
    path, data, model, feeds = _conv(tmp_path, cin=6)
    res = dipoorlet.quantize(model=path, input_dir=data, data_num=len(feeds), deploy="trt",
                             output_dir=tmp_path / "o", act_quant="minmax", skip_prof_layer=True, sparse="2:4")
    sp = res.report["sparse"]
    assert sp["layers"] == 0 and "not a multiple of 4" in sp["skipped"]["conv"]
    assert "no layer could be pruned" in caplog.text


def test_too_few_rows_are_pruned_by_magnitude(tmp_path):
    """A Gemm after global pooling sees one row per sample: not fitted, pruned by |w| alone."""
    r = np.random.default_rng(4)
    inits = {"w": (r.standard_normal((5, 16)) * 0.3).astype(np.float32),
             "b": np.zeros(5, np.float32)}
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "w", "b"], ["y"], name="fc", transB=1)]
    model = make_model(nodes, [vi("x", [1, 16, 4, 4])], [vi("y", [1, 5])], inits)
    feeds = [{"x": r.standard_normal((1, 16, 4, 4)).astype(np.float32)} for _ in range(6)]
    path, data = save(model, tmp_path / "m.onnx"), write_samples(tmp_path / "data", feeds)
    res = dipoorlet.quantize(model=path, input_dir=data, data_num=6, deploy="trt", output_dir=tmp_path / "o",
                             act_quant="minmax", skip_prof_layer=True, sparse="2:4")
    assert res.report["sparse"]["magnitude"] == ["fc"]
    q = onnx.load(str(tmp_path / "o" / "quant_model.onnx"))
    ints = weight_ints(q, "w")
    w = inits["w"]
    assert ((ints.reshape(5, 4, 4) != 0).sum(axis=2) <= 2).all()
    # the two largest |w| of each group survive
    top = np.argsort(np.abs(w).reshape(5, 4, 4), axis=2)[:, :, 2:]
    assert (np.take_along_axis(ints.reshape(5, 4, 4), top, axis=2) != 0).mean() > 0.9


@pytest.mark.parametrize("sparse", ["2:4", "0.5"])
def test_a_layer_pruned_by_magnitude_after_a_shifted_input_keeps_its_mean(tmp_path, sparse):
    """trt shifts g2's Relu input onto the asymmetric grid, and g2's bias absorbs the shift as
    b - W_q d. Pruned by magnitude alone (8 rows: too few to fit), the bias kept the dense W_q:
    the output's channel means moved by up to 1.2 (output std 2.4; 13.8 dB against the float
    model holding the same pruned weights). Oracle: numpy with the written weights."""
    r = np.random.default_rng(4)
    inits = {"w1": (r.normal(size=(16, 16)) * 0.3).astype(np.float32),
             "b1": (r.normal(size=16) * 0.3 + 1.0).astype(np.float32),
             "w2": (r.normal(size=(8, 16)) * 0.3).astype(np.float32),
             "b2": (r.normal(size=8) * 0.3).astype(np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["a"], name="g1", transB=1),
             helper.make_node("Relu", ["a"], ["ra"], name="relu"),
             helper.make_node("Gemm", ["ra", "w2", "b2"], ["y"], name="g2", transB=1)]
    model = make_model(nodes, [vi("x", [1, 16])], [vi("y", [1, 8])], inits)
    X = r.normal(size=(8, 1, 16)).astype(np.float32)
    path, data = save(model, tmp_path / "m.onnx"), write_samples(tmp_path / "data", [{"x": x} for x in X])
    res = dipoorlet.quantize(model=path, input_dir=data, data_num=8, deploy="trt", output_dir=tmp_path / "o",
                             skip_prof_layer=True, sparse=sparse)
    assert res.report["shift"] and "g2" in res.report["sparse"]["magnitude"]
    q = onnx.load(str(tmp_path / "o" / "quant_model.onnx"))
    inits_q = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in q.graph.initializer}
    prod = {o: n for n in q.graph.node for o in n.output}

    def dequantized(node_name):
        dq = prod[next(n for n in q.graph.node if n.name == node_name).input[1]]
        return inits_q[dq.input[0]] * inits_q[dq.input[1]][:, None]

    W1, W2 = dequantized("g1"), dequantized("g2")
    assert (W2 == 0).mean() >= 0.5
    want = np.array([np.maximum(x @ W1.T + inits["b1"], 0) @ W2.T + inits["b2"] for x in X])
    got = np.array([ort_run(q, {"x": x})[0] for x in X])
    sqnr = 10 * np.log10((want ** 2).sum() / ((got - want) ** 2).sum())
    assert sqnr > 30, sqnr
    assert np.abs((got - want).mean(axis=(0, 1))).max() < 0.2 * want.std()


def test_one_survivor_per_group_keeps_the_end_that_sets_the_grid():
    """1:4 with both of a row's grid ends in one group: the larger |w| survives, so the row's
    max |w| (what TensorRT derives the channel's scale from) is unchanged."""
    r = np.random.default_rng(0)
    R, K = 4, 8
    X = r.standard_normal((K, K)) @ r.standard_normal((K, 2000))
    W = r.standard_normal((R, K)) * 0.3
    W[0, 0], W[0, 1] = -2.0, 1.0            # row 0's min (largest |w|) and max share a group
    s = np.abs(W).max(axis=1) / 127
    ri = np.clip(np.rint(W / s[:, None]), -127, 127)
    mask = np.zeros((1, R, K), bool)
    for ends in (W.argmax(1), W.argmin(1)):
        mask[0, np.arange(R), ends] = True
    Q, Qi = gptq(W[None], (X @ X.T)[None], s[None], 0.0, -127, 127, pin=(mask, ri[None]), sparse=(1, 4),
                 order=np.arange(K))
    assert ((Qi[0] != 0).reshape(R, 2, 4).sum(axis=2) <= 1).all()
    np.testing.assert_allclose(np.abs(Q[0]).max(axis=1), np.abs(W).max(axis=1), rtol=1e-12)


def test_a_rate_never_prunes_a_grid_end():
    r = np.random.default_rng(1)
    X = r.standard_normal((9, 500))
    W = r.standard_normal((3, 9))
    s = np.abs(W).max(axis=1) / 127
    mask = np.zeros((1, 3, 9), bool)
    for ends in (W.argmax(1), W.argmin(1)):
        mask[0, np.arange(3), ends] = True
    ri = np.clip(np.rint(W / s[:, None]), -127, 127)
    Q, Qi = gptq(W[None], (X @ X.T)[None], s[None], 0.0, -127, 127, pin=(mask, ri[None]), sparse=0.95)
    np.testing.assert_array_equal(Qi[0][mask[0]], ri[mask[0]])
    assert ((Qi[0] == 0).sum(axis=1) == 7).all()


def test_sparse_with_16_bit_activations_is_refused(tmp_path):
    path, data, model, feeds = _conv(tmp_path)
    with pytest.raises(ConfigError, match="--sparse with --a_bits 16"):
        dipoorlet.quantize(model=path, input_dir=data, data_num=4, deploy="qnn", output_dir=tmp_path / "o",
                           a_bits=16, sparse="2:4")


def test_diagnosis_blames_the_pruning(tmp_path):
    path, data, model, feeds = _conv(tmp_path)
    res = dipoorlet.quantize(model=path, input_dir=data, data_num=len(feeds), deploy="trt",
                             output_dir=tmp_path / "o", act_quant="minmax", sparse="1:4", sens_samples=4)
    rows = {d["node"]: d for d in res.report["diagnosis"]}
    assert "--sparse 1:4 pruned this layer" in rows["conv"]["advice"]
    assert "--gptq chooses" not in rows["conv"]["advice"]


def test_weight_clip_val_rebuilds_the_grid_of_a_pruned_asymmetric_weight(tmp_path):
    # magicmind: asymmetric per-channel weights; pruning took some channels' extreme values, and
    # the pruned values' min/max rebuilt grids up to 25% finer than quant_model.onnx's
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((8, 16)) * 0.2).astype(np.float32)
    model = make_model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc")], [vi("x", [1, 8])],
                       [vi("y", [1, 16])], {"w": w, "b": (rng.standard_normal(16) * 0.1).astype(np.float32)})
    data = write_samples(tmp_path / "d", [{"x": rng.standard_normal((1, 8)).astype(np.float32)} for _ in range(8)])
    out = tmp_path / "out"
    dipoorlet.quantize(model=save(model, tmp_path / "m.onnx"), input_dir=data, data_num=8, deploy="magicmind",
                       output_dir=out, sparse="2:4", skip_prof_layer=True)
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out / "quant_model.onnx")).graph.initializer}
    scale, zp = inits["w_scale"].astype(np.float64), inits["w_zero_point"].astype(np.int64)
    assert scale.size == 16 and zp.dtype == np.int64 and np.any(zp != 0)     # per channel, asymmetric
    lo, hi = (np.array(v, np.float64) for v in json.loads((out / "weight_clip_val.json").read_text())["w"])
    lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    rebuilt = (hi - lo) / 255
    np.testing.assert_allclose(rebuilt, scale, rtol=1e-5)
    np.testing.assert_array_equal(np.clip(np.round(-128 - lo / rebuilt), -128, 127), zp)


def test_a_rate_on_a_layer_of_two_inputs_per_output_is_reported_dense(tmp_path):
    """A 1x1 Conv with 2 input channels: both weights of each row are its grid's ends, which a
    rate never prunes, so the layer keeps no zero; it was listed as pruned (and counted in
    sparse.layers) with no reason."""
    r = np.random.default_rng(2)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="narrow"),
             helper.make_node("Conv", ["a", "w2"], ["y"], name="wide", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [vi("x", [1, 2, 8, 8])], [vi("y", [1, 6, 8, 8])],
                       {"w1": (r.standard_normal((8, 2, 1, 1)) * 0.3).astype(np.float32),
                        "w2": (r.standard_normal((6, 8, 3, 3)) * 0.2).astype(np.float32)})
    feeds = [{"x": r.standard_normal((1, 2, 8, 8)).astype(np.float32)} for _ in range(16)]
    res = dipoorlet.quantize(model=save(model, tmp_path / "m.onnx"), input_dir=write_samples(tmp_path / "d", feeds),
                             data_num=16, deploy="trt", output_dir=tmp_path / "o", act_quant="minmax",
                             skip_prof_layer=True, sparse="0.5")
    sp = res.report["sparse"]
    qm = onnx.load(str(tmp_path / "o" / "quant_model.onnx"))
    assert not np.any(weight_ints(qm, "w1") == 0) and np.mean(weight_ints(qm, "w2") == 0) > 0.4
    assert "narrow" in sp["skipped"] and "never prunes" in sp["skipped"]["narrow"]
    assert sp["layers"] == 1 and {g["node"] for g in sp["gain_db"]} == {"wide"}


def test_of_two_pinned_ends_the_one_setting_the_grid_is_pruned_last():
    """A 1:M group holding both pinned ends of a row keeps the one whose level sets the symmetric
    grid; it was chosen by the weights as error spreading had updated them, which had moved the
    other end above it (TensorRT then rebuilt another grid; found by a bug hunt)."""
    from dipoorlet.reconstruct import _saliency

    W1 = np.array([[[0.41, -0.40, 0.01, 0.02]]])          # updated values: the +end now looks larger
    U1 = np.eye(4)[None]
    pmask = np.array([[[True, True, False, False]]])
    pmag = np.array([[[114.0, 127.0, 3.0, 5.0]]])          # but the -end holds level -127
    sal = _saliency(W1, U1, 0, 4, pmask, pmag)
    assert np.argsort(sal, axis=2)[0, 0, -1] == 1          # pruned last: the grid's end
    assert list(np.argsort(sal, axis=2)[0, 0, :2]) == [2, 3]


def test_layers_a_rate_cannot_reach_are_named_with_their_share(tmp_path, caplog):
    """A rate never prunes a row's grid ends, so a Gemm of 4 inputs at --sparse 0.75 zeroes 2 of
    4 per row: the report gave only the pooled share (found by a bug hunt). Such layers are named
    with the share they reached (numpy count on the written weights)."""
    from conftest import make_model, rand, save, vi, write_samples

    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2", transB=1)]
    model = make_model(nodes, [vi("x", [1, 4])], [vi("y", [1, 64])],
                       {"w1": rand((64, 4), 1), "b1": rand((64,), 2, 0.1), "w2": rand((64, 64), 3, 0.2),
                        "b2": rand((64,), 4, 0.1)})
    feeds = [{"x": rand((1, 4), 10 + i)} for i in range(48)]
    caplog.set_level("INFO", logger="dipoorlet")
    res = dipoorlet.quantize(model=save(model, tmp_path / "m.onnx"), input_dir=write_samples(tmp_path / "d", feeds),
                             data_num=48, deploy="trt", output_dir=tmp_path / "o", sparse="0.75", skip_prof_layer=True)
    info = res.report["sparse"]
    assert "fc1" in info["below_rate"] and "fc2" not in info["below_rate"]
    ints = numpy_helper.to_array(next(t for t in onnx.load(str(tmp_path / "o" / "quant_model.onnx")).graph.initializer
                                      if t.name.startswith("w1") and t.data_type == onnx.TensorProto.INT8))
    assert info["below_rate"]["fc1"] == pytest.approx(float(np.mean(ints == 0)), abs=1e-4)
    assert any("reach less than the rate" in r.getMessage() and "fc1" in r.getMessage() for r in caplog.records)


def test_the_sparse_summary_names_no_error_when_every_layer_was_pruned_by_magnitude(tmp_path, caplog):
    """Too few rows to fit any layer: the summary line had ended in "...rounding): " and nothing
    (found by a hunt); it ends at the zero share now, and the pruning still happened."""
    import logging

    r = np.random.default_rng(5)
    model = make_model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="g", transB=1)],
                       [vi("x", [1, 16])], [vi("y", [1, 8])],
                       {"w": (r.normal(size=(8, 16)) * 0.3).astype(np.float32),
                        "b": (r.normal(size=8) * 0.3).astype(np.float32)})
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", [{"x": x} for x in r.normal(size=(4, 1, 16)).astype(np.float32)])
    with caplog.at_level(logging.INFO, logger="dipoorlet"):
        res = dipoorlet.quantize(model=path, input_dir=data, data_num=4, deploy="trt", output_dir=tmp_path / "o",
                                 skip_prof_layer=True, sparse="2:4")
    assert res.report["sparse"]["magnitude"] == ["g"]
    (line,) = [m for m in (rec.getMessage() for rec in caplog.records) if m.startswith("sparse 2:4: ")]
    assert line.endswith("of their weights zero") and "largest output error" not in line, line
