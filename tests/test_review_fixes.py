"""Regression tests for defects found in review: subgraphs, bias shapes, NaN inside the model,
grid sharing across chains, node-name collisions."""
from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import input_feeds, make_model, ort_run, quantize_model, rand, vi
from dipoorlet.graph import Graph
from dipoorlet.prepare import name_nodes


def test_identity_read_by_an_if_branch_is_kept(tmp_path):
    branch = lambda name: helper.make_graph(
        [helper.make_node("Relu", ["c_id"], [name + "_o"])], name, [], [vi(name + "_o", [1, 4, 6, 6])])
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Identity", ["c"], ["c_id"], name="id"),
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch("t"), else_branch=branch("e")),
    ]
    inits = {"w": rand((4, 3, 3, 3), 0, 0.3), "cond": np.array(True)}
    model = make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", [1, 4, 6, 6])], inits)
    result, qm = quantize_model(tmp_path, model, n=2, skip_prof_layer=True)
    feed = input_feeds(model, 1)[0]
    assert np.abs(ort_run(qm, feed)[0] - ort_run(model, feed)[0]).max() < 0.2


@pytest.mark.parametrize("plat", ["ort", "qnn"])
def test_gemm_bias_of_shape_1_by_n_stays_float_and_runs(tmp_path, plat):
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=1)]
    inits = {"w": rand((3, 5), 0), "b": rand((1, 3), 1)}
    model = make_model(nodes, [vi("x", [1, 5])], [vi("y", [1, 3])], inits)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    from conftest import write_samples
    import dipoorlet
    data = write_samples(tmp_path / "d", input_feeds(model, 3))
    res = dipoorlet.quantize(model=path, input_dir=data, data_num=3, deploy=plat, output_dir=tmp_path / "o",
                             skip_prof_layer=True)
    qm = onnx.load(str(tmp_path / "o" / "quant_model.onnx"))
    assert next(n for n in qm.graph.node if n.name == "fc").input[2] == "b"
    assert res.report["outputs"][0]["cosine"] > 0.99


@pytest.mark.parametrize("method", ["minmax", "mse"])
def test_nan_inside_the_model_is_left_out_of_the_range(tmp_path, method):
    """Sqrt of a Conv output is NaN where the Conv is negative. The range is the other values':
    onnxruntime's ReduceMax gave NaN (the tensor stayed float) or a value below the true maximum
    (real values clipped), depending on where the first NaN sat. Oracle: numpy nanmax."""
    import json

    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Sqrt", ["c"], ["s"], name="sqrt"),      # NaN where c < 0
        helper.make_node("Conv", ["s", "w2"], ["y"], name="conv2"),
    ]
    inits = {"w": rand((4, 3, 3, 3), 0, 0.3), "w2": rand((4, 4, 1, 1), 1, 0.3)}
    model = make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", [1, 4, 6, 6])], inits)
    feeds = input_feeds(model, 3)
    quantize_model(tmp_path, model, feeds=feeds, act_quant=method, skip_prof_layer=True, equalize=False, shift=False,
                   bias_correction=False)
    probe = copy.deepcopy(model)
    probe.graph.output.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, None))
    s = np.concatenate([ort_run(probe, f)[1].ravel() for f in feeds])
    assert np.isnan(s).any()
    lo, hi = json.loads((tmp_path / "out" / "act_clip_val.json").read_text())["s"]
    if method == "minmax":
        assert hi == pytest.approx(float(np.nanmax(s)), rel=1e-6)
    else:
        assert 0.5 * float(np.nanmax(s)) < hi <= float(np.nanmax(s)) * (1 + 1e-6)


def test_shared_grids_follow_chains_whatever_the_node_order(tmp_path):
    # a -> MaxPool -> p ; Concat(p, b) -> c ; listed with the Concat first
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Mul", ["x", "k"], ["b"], name="mul"),
        helper.make_node("MaxPool", ["a"], ["p"], name="pool", kernel_shape=[1, 1]),
        helper.make_node("Concat", ["p", "b"], ["c"], name="cat", axis=1),
        helper.make_node("Conv", ["c", "w"], ["y"], name="conv"),
    ]
    inits = {"k": np.array(5.0, np.float32), "w": rand((2, 6, 1, 1), 0)}
    model = make_model(nodes, [vi("x", [1, 3, 4, 4])], [vi("y", [1, 2, 4, 4])], inits)
    model.graph.node.insert(0, model.graph.node.pop(3))  # Concat before its producers
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    from conftest import write_samples
    import dipoorlet
    data = write_samples(tmp_path / "d", input_feeds(model, 3))
    dipoorlet.quantize(model=path, input_dir=data, data_num=3, deploy="snpe", output_dir=tmp_path / "o",
                       skip_prof_layer=True)
    qm = onnx.load(str(tmp_path / "o" / "quant_model.onnx"))
    scales = {t.name[:-6]: numpy_helper.to_array(t) for t in qm.graph.initializer if t.name.endswith("_scale")}
    assert scales["a"] == scales["p"] == scales["b"] == scales["c"]


def test_generated_names_never_take_a_users_node_name():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["y"], name="Relu_0")]
    g = Graph(make_model(nodes, [vi("x", [1, 2])], [vi("y", [1, 2])]))
    name_nodes(g)
    assert [n.name for n in g.graph.node] == ["Relu_0_1", "Relu_0"]


def _masked_softmax_model():
    """Softmax over x where mask is 1 (-inf elsewhere), then two MatMul + bias layers: a sample whose mask row is all -inf
    gives a NaN row in the float model, which the Q/DQ of the softmax output turns finite."""
    nodes = [
        helper.make_node("Cast", ["mask"], ["keep"], name="cast", to=TensorProto.BOOL),
        helper.make_node("Where", ["keep", "x", "ninf"], ["s"], name="where"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "w1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias1"),
        helper.make_node("Relu", ["h1"], ["h"], name="relu"),
        helper.make_node("MatMul", ["h", "w2"], ["y0"], name="mm2"),
        helper.make_node("Add", ["y0", "b2"], ["y"], name="bias2"),
    ]
    inits = {"w1": rand((8, 16), 1, 2.0), "b1": rand((16,), 2, 0.5), "w2": rand((16, 8), 3, 0.5),
             "b2": rand((8,), 4, 0.1), "ninf": np.array(-np.inf, np.float32)}
    return make_model(nodes, [vi("x", [1, 4, 8]), vi("mask", [1, 4, 8])], [vi("y", [1, 4, 8])], inits)


@pytest.mark.parametrize("extra", [[], ["--gptq"]])
def test_a_sample_that_makes_the_float_model_nan_is_left_out_and_named(tmp_path, extra, caplog):
    # a fully padded sequence (all -inf mask row) spoiled the bias correction's sums: NaN means
    # turned into -2^63, and downstream of the softmax's Q/DQ the garbage was finite
    import logging

    import dipoorlet

    model = _masked_softmax_model()
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 4, 8)).astype(np.float32) * 3,
              "mask": np.ones((1, 4, 8), np.float32)} for _ in range(7)]
    bad = {"x": feeds[3]["x"], "mask": feeds[3]["mask"].copy()}
    bad["mask"][0, 1] = 0.0
    from conftest import write_samples
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    kwargs = {"gptq": True} if extra else {}

    def run(name, samples):
        data = write_samples(tmp_path / f"d_{name}", samples)
        dipoorlet.quantize(model=path, input_dir=data, data_num=len(samples), deploy="trt",
                           output_dir=tmp_path / name, **kwargs)
        return onnx.load(str(tmp_path / name / "quant_model.onnx"))

    with caplog.at_level(logging.WARNING):
        q_bad = run("bad", feeds[:3] + [bad] + feeds[4:])
    q_ref = run("ref", feeds[:3] + feeds[4:] + [feeds[0]])
    left_out = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    what = "gptq statistics" if extra else "bias correction"
    assert any(m.startswith(what) and "3.npy" in m for m in left_out), left_out
    assert any(m.startswith("error profile") and "3.npy" in m for m in left_out), left_out
    # on the good samples the model calibrated with the NaN sample is as close to float as the other
    # (98,683x the error before, with bias correction)
    good = feeds[:3] + feeds[4:]
    err = lambda q: sum(float(np.sum((ort_run(q, f)[0] - ort_run(model, f)[0]) ** 2)) for f in good)
    assert err(q_bad) < 2 * err(q_ref)


def _all_bad_held_out(tmp_path):
    """The masked-softmax model saved, 4 clean calibration samples and 2 held-out ones whose mask
    is all zero (the float output is NaN on both): (model path, calibration dir, held-out dir)."""
    from conftest import write_samples

    path = tmp_path / "m.onnx"
    onnx.save(_masked_softmax_model(), path)
    rng = np.random.default_rng(0)
    good = [{"x": rng.standard_normal((1, 4, 8)).astype(np.float32), "mask": np.ones((1, 4, 8), np.float32)}
            for _ in range(4)]
    bad = [{"x": f["x"], "mask": np.zeros((1, 4, 8), np.float32)} for f in good[:2]]
    return path, write_samples(tmp_path / "d", good), write_samples(tmp_path / "v", bad)


def test_fail_below_fails_an_output_that_no_profile_sample_scored(tmp_path, capsys):
    # every held-out sample makes the float output NaN: they are left out of the profile, so the
    # output has no row in the report, and the gate passed with nothing judged
    from dipoorlet.cli import below_bar, main

    path, calib, held_out = _all_bad_held_out(tmp_path)
    argv = ["-M", str(path), "-I", str(calib), "-N", "4", "-D", "trt",
            "-O", str(tmp_path / "o"), "--val_dir", str(held_out), "--skip_prof_layer"]
    assert main(argv + ["--fail_below", "0.5"]) == 3
    assert "y: no profile sample scored it" in capsys.readouterr().err
    rep = {"network_outputs": ["y"], "outputs": [{"tensor": "y", "cosine": 0.99, "sqnr_db": 30.0}]}
    assert below_bar(rep, "0.5") == ""


def test_an_attention_mask_of_float32_lowest_is_not_taken_for_nan(tmp_path, caplog):
    # HuggingFace-style masks hold finfo(float32).min on padded positions; trt quantizes the mask
    # input, and a first NaN check summed the quantized activations into -inf: every sample was
    # left out of bias correction
    import logging

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["s0"], name="mm1"),
             helper.make_node("Add", ["s0", "b"], ["s1"], name="bias1"),
             helper.make_node("Add", ["s1", "mask"], ["s2"], name="addmask"),
             helper.make_node("Softmax", ["s2"], ["p"], name="sm", axis=-1),
             helper.make_node("MatMul", ["p", "w2"], ["o0"], name="mm2"),
             helper.make_node("Add", ["o0", "b2"], ["y"], name="bias2")]
    inits = {"w": rand((32, 16), 1, 0.2), "b": rand((16,), 2), "w2": rand((16, 32), 3, 0.3), "b2": rand((32,), 4)}
    model = make_model(nodes, [vi("x", [1, 8, 32]), vi("mask", [1, 1, 16])], [vi("y", [1, 8, 32])], inits)
    feeds = []
    for i in range(8):
        mask = np.zeros((1, 1, 16), np.float32)
        mask[..., 14 - i % 3:] = np.finfo(np.float32).min
        feeds.append({"x": rng.standard_normal((1, 8, 32)).astype(np.float32), "mask": mask})
    with caplog.at_level(logging.INFO):
        res, _ = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse", skip_prof_layer=True)
    assert not [r for r in caplog.records if "left out" in r.getMessage()]
    assert res.report["bias_correction"]["samples"] == 8


def _attention_scores():
    """q, k, v = x Wq, x Wk, x Wv and the scores s = q k^T."""
    return [helper.make_node("MatMul", ["x", "wq"], ["q"], name="mq"),
            helper.make_node("MatMul", ["x", "wk"], ["k"], name="mk"),
            helper.make_node("MatMul", ["x", "wv"], ["v"], name="mv"),
            helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="tr"),
            helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk")]


def _masked_attention(opset: int, extra_reader: bool = False, length: int = 16, dim: int = 32,
                      two_sided: bool = False):
    """q k^T + additive -1e4 mask -> Softmax -> p v, the masked positions differing per sample."""
    rng = np.random.default_rng(0)
    nodes = _attention_scores() + [
             helper.make_node("Add", ["s", "mask"], ["sm"], name="addmask"),
             helper.make_node("Softmax", ["sm"], ["p"], name="softmax", axis=2 if opset < 13 else -1),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    outputs = [vi("y", [1, length, dim])]
    if extra_reader:      # sm also read by something that is not a Softmax: no floor
        nodes.append(helper.make_node("ReduceMean", ["sm"], ["side"], name="side", keepdims=0))
        outputs.append(vi("side", []))
    inits = {k: rand((dim, dim), i, 1.5 / np.sqrt(dim)) for i, k in enumerate(("wq", "wk", "wv"))}
    mshape = [1, length, length] if two_sided else [1, 1, length]
    model = make_model(nodes, [vi("x", [1, length, dim]), vi("mask", mshape)], outputs, inits, opset=opset)
    feeds = []
    for i in range(12):
        n = int(rng.integers(3, length))
        x = rng.standard_normal((1, length, dim)).astype(np.float32)
        x[:, n:] = 0
        mask = np.zeros(mshape, np.float32)
        mask[..., n:] = -1e4
        if two_sided:
            mask[:, n:, :] = -1e4
        feeds.append({"x": x, "mask": mask})
    return model, feeds


def _lowest_rowmax(model, feeds, tensor="sm") -> float:
    """The lowest row maximum of ``tensor`` over ``feeds``, from the float model with it exposed."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.append(vi(tensor, None))
    return min(float(ort_run(exposed, f)[-1].max(axis=-1).min()) for f in feeds)


def _grid_of(model, tensor):
    """(lowest value, step) of the integer grid a QuantizeLinear of ``tensor`` puts on it."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    scale, zp = float(inits[q.input[1]]), inits[q.input[2]]
    low = int(np.iinfo(zp.dtype).min)
    return (low - int(zp)) * scale, scale


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_a_softmax_input_grid_stops_short_of_an_additive_mask(tmp_path, opset, caplog):
    """qnn quantizes the Softmax input; a -1e4 mask stretched its uint8 grid to steps of 39 and
    the block's output cosine fell to 0.75. The grid now starts at the lowest row maximum of the
    calibration data less 20 (numpy oracle): a value that far below its row's maximum weighs
    under 2e-9 in the Softmax."""
    import logging

    from dipoorlet.calibrate import SOFTMAX_MARGIN

    model, feeds = _masked_attention(opset)
    with caplog.at_level(logging.INFO):
        _, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse", deploy="qnn", skip_prof_layer=True)
    # oracle: the row maxima of sm, from the float model with sm exposed
    rowmax = _lowest_rowmax(model, feeds)
    lowest, step = _grid_of(qm, "sm")
    assert abs(lowest - (rowmax - SOFTMAX_MARGIN)) <= step, (lowest, rowmax)
    assert step < 1.0        # 39 with the grid over the mask
    assert any("Softmax inputs: 1 grids start" in r.getMessage() for r in caplog.records)
    err = sig = 0.0
    for f in feeds:
        want, got = ort_run(model, f)[0], ort_run(qm, f)[0]
        err += float(((want - got) ** 2).sum())
        sig += float((want ** 2).sum())
    assert 10 * np.log10(sig / err) > 20, 10 * np.log10(sig / err)     # 6 dB before


def test_rows_masked_out_as_a_whole_do_not_set_the_softmax_floor(tmp_path):
    """A two-sided mask also masks the padded queries' rows as a whole: their maximum sits near
    -1e4, and taken as the lowest row maximum it sank the floor to the mask (a grid from -1e4
    again, steps of 39). Such rows are left out of it (numpy oracle: the live rows' maxima)."""
    from dipoorlet.calibrate import SOFTMAX_MARGIN

    model, feeds = _masked_attention(13, two_sided=True)
    _, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse", deploy="qnn", skip_prof_layer=True)
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.append(vi("sm", None))
    live = []
    for f in feeds:
        rows = ort_run(exposed, f)[-1].max(axis=-1).reshape(-1)
        live.append(rows[rows > -1000].min())
    lowest, step = _grid_of(qm, "sm")
    assert abs(lowest - (min(live) - SOFTMAX_MARGIN)) <= step, (lowest, min(live))
    assert step < 1.0


def test_a_calibration_sample_of_all_padding_does_not_set_the_softmax_floor(tmp_path, caplog):
    """One calibration sample whose every query is masked (all padding: every row maximum near
    -1e4) sank the floor to the mask on qnn (a Llama's held-out cosine 0.985 -> 0.413; found by a
    hunt): a sample whose every row maximum lies below -1000 where a mask is added is left out
    (numpy oracle: the live rows of the other samples), and the log says so."""
    import logging

    from dipoorlet.calibrate import SOFTMAX_MARGIN

    model, feeds = _masked_attention(13, two_sided=True)
    feeds[2]["mask"][:] = -1e4                         # every position of sample 2 masked
    with caplog.at_level(logging.INFO):
        _, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse", deploy="qnn", skip_prof_layer=True)
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.append(vi("sm", None))
    live = []
    for i, f in enumerate(feeds):
        rows = ort_run(exposed, f)[-1].max(axis=-1).reshape(-1)
        if i != 2:
            live.append(rows[rows > -1000].min())
    lowest, step = _grid_of(qm, "sm")
    assert abs(lowest - (min(live) - SOFTMAX_MARGIN)) <= step, (lowest, min(live))
    assert step < 1.0
    assert any("every row maximum lies below -1000, where a mask is added" in r.getMessage() for r in caplog.records)


def test_a_sample_whose_scores_lie_lower_without_a_mask_keeps_its_floor(tmp_path):
    """Without a mask, a sample's Softmax inputs may lie far below another's by themselves (an
    added prior of -160 moves no probability): leaving it out of the floor clipped it (a review:
    its output cosine 1.0 -> 0.35). The floor reaches its rows (numpy oracle)."""
    from dipoorlet.calibrate import SOFTMAX_MASK_MARGIN

    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
             helper.make_node("Add", ["a", "prior"], ["s"], name="add_prior"),
             helper.make_node("Softmax", ["s"], ["y"], axis=-1, name="softmax")]
    model = make_model(nodes, [vi("x", [1, 4, 8]), vi("prior", [1, 1, 1])], [vi("y", [1, 4, 8])],
                       {"w": rand((8, 8), 0, 0.3)})
    feeds = [{"x": rand((1, 4, 8), 10 + i), "prior": np.zeros((1, 1, 1), np.float32)} for i in range(6)]
    feeds[3]["prior"][:] = -160.0
    # -A minmax: the grid is the floor's or the data's (-A mse clips such a sample by itself)
    _, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="minmax", deploy="qnn", skip_prof_layer=True)
    lowest, step = _grid_of(qm, "s")
    assert lowest <= _lowest_rowmax(model, feeds, "s") - SOFTMAX_MASK_MARGIN + step     # sample 3's rows inside
    got = ort_run(qm, feeds[3])[0]
    want = ort_run(model, feeds[3])[0]
    assert float((got * want).sum() / np.sqrt((got * got).sum() * (want * want).sum())) > 0.99


@pytest.mark.parametrize("style", ["add", "where", "add_reshape", "gather", "scatter", "castlike"])
def test_a_masked_softmax_calibrated_without_padding_still_hides_padding(tmp_path, style):
    """An int64 attention_mask turned into (1 - m) * -1e4 and added to the scores (or a Where
    choosing -1e4 by it), calibrated on unpadded samples: qnn's Softmax-input grid ended at the
    scores' own minimum (about -1.5), so a padded batch at deployment clipped the mask there and
    attended to padding. The grid now reaches 12 below the lowest row maximum; the real
    positions of a padded sample give the padding no attention (onnxruntime oracle)."""
    length, dim = 12, 16
    nodes = _attention_scores() + [helper.make_node("Unsqueeze", ["attention_mask", "ax"], ["m3"], name="unsq")]
    if style == "add":
        nodes += [helper.make_node("Cast", ["m3"], ["mf"], to=TensorProto.FLOAT, name="cast"),
                  helper.make_node("Sub", ["one", "mf"], ["inv"], name="inv"),
                  helper.make_node("Mul", ["inv", "big"], ["bias"], name="scale"),
                  helper.make_node("Add", ["s", "bias"], ["sm"], name="addmask")]
    elif style == "add_reshape":       # BART: view to [B, H, L, L], + mask, view back
        nodes += [helper.make_node("Cast", ["m3"], ["mf"], to=TensorProto.FLOAT, name="cast"),
                  helper.make_node("Sub", ["one", "mf"], ["inv"], name="inv"),
                  helper.make_node("Mul", ["inv", "big"], ["bias3"], name="scale"),
                  helper.make_node("Unsqueeze", ["bias3", "ax"], ["bias"], name="unsq2"),
                  helper.make_node("Reshape", ["s", "shape4"], ["s4"], name="view4"),
                  helper.make_node("Add", ["s4", "bias"], ["sm4"], name="addmask"),
                  helper.make_node("Reshape", ["sm4", "shape3"], ["sm"], name="view3")]
    elif style == "castlike":          # mask.type_as(scores), as torch's dynamo exporter writes it
        nodes += [helper.make_node("CastLike", ["m3", "s"], ["mf"], name="cast"),
                  helper.make_node("Sub", ["one", "mf"], ["inv"], name="inv"),
                  helper.make_node("Mul", ["inv", "big"], ["bias"], name="scale"),
                  helper.make_node("Add", ["s", "bias"], ["sm"], name="addmask")]
    elif style == "gather":            # transformers 4.57 indexes the padding mask: mask[b, kv]
        nodes += [helper.make_node("Cast", ["m3"], ["mf"], to=TensorProto.FLOAT, name="cast"),
                  helper.make_node("Gather", ["mf", "kv"], ["mg"], name="index", axis=2),
                  helper.make_node("Sub", ["one", "mg"], ["inv"], name="inv"),
                  helper.make_node("Mul", ["inv", "big"], ["bias"], name="scale"),
                  helper.make_node("Add", ["s", "bias"], ["sm"], name="addmask")]
    elif style == "scatter":           # transformers 4.44 slice-assigns the padding into the causal mask
        nodes += [helper.make_node("Cast", ["m3"], ["mf"], to=TensorProto.FLOAT, name="cast"),
                  helper.make_node("Sub", ["one", "mf"], ["inv"], name="inv"),
                  helper.make_node("Mul", ["inv", "big"], ["bias"], name="scale"),
                  helper.make_node("Expand", ["bias", "shape3"], ["upd"], name="expand"),
                  helper.make_node("ScatterND", ["causal", "at0", "upd"], ["full"], name="assign"),
                  helper.make_node("Add", ["s", "full"], ["sm"], name="addmask")]
    else:
        nodes += [helper.make_node("Cast", ["m3"], ["mb"], to=TensorProto.BOOL, name="cast"),
                  helper.make_node("Where", ["mb", "s", "big"], ["sm"], name="wheremask")]
    nodes += [helper.make_node("Softmax", ["sm"], ["p"], name="softmax", axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    inits = {k: rand((dim, dim), i, 0.3 / np.sqrt(dim)) for i, k in enumerate(("wq", "wk", "wv"))}
    inits.update({"ax": np.array([1], np.int64), "one": np.float32(1.0), "big": np.float32(-1e4),
                  "shape4": np.array([1, 1, length, length], np.int64), "shape3": np.array([1, length, length], np.int64),
                  "kv": np.arange(length, dtype=np.int64), "causal": np.zeros((1, length, length), np.float32),
                  "at0": np.zeros((1, 1), np.int64)})
    model = make_model(nodes, [vi("x", [1, length, dim]), vi("attention_mask", [1, length], TensorProto.INT64)],
                       [vi("y", [1, length, dim])], inits, opset=15 if style == "castlike" else 13)
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, length, dim)).astype(np.float32),
              "attention_mask": np.ones((1, length), np.int64)} for _ in range(8)]
    _, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse", deploy="qnn", skip_prof_layer=True)
    lowest, _ = _grid_of(qm, "sm")
    assert lowest < -10, lowest       # the scores' own minimum, about -2, before
    # deployment: the first 3 positions real, the rest padding holding other values; the
    # attention the real positions give the padded ones (the Softmax output, exposed)
    exposed = onnx.ModelProto()
    exposed.CopyFrom(qm)
    exposed.graph.output.append(vi("p", None))
    leak, worst = 0.0, 1.0
    for f in feeds:
        padded = {"x": f["x"].copy(), "attention_mask": f["attention_mask"].copy()}
        padded["x"][:, 3:] = rng.standard_normal((1, length - 3, dim)) * 3
        padded["attention_mask"][:, 3:] = 0
        want = ort_run(model, padded)[0][:, :3]
        got, p = ort_run(exposed, padded)
        leak = max(leak, float(p[:, :3, 3:].sum(axis=-1).max()))
        worst = min(worst, float((want * got[:, :3]).sum() / np.linalg.norm(want) / np.linalg.norm(got[:, :3])))
    assert leak < 1e-4, leak          # 0.51 with the grid ending at the scores' own minimum
    assert worst > 0.9, worst         # 0.49 so (0.92 with float Softmax inputs: 3 positions are few)


def test_a_softmax_input_read_by_another_op_keeps_its_whole_range(tmp_path):
    """The floor holds only where every reader is a Softmax: a ReduceMean of the same tensor
    needs the masked values as they are."""
    model, feeds = _masked_attention(13, extra_reader=True)
    _, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="minmax", deploy="qnn", skip_prof_layer=True)
    lowest, _ = _grid_of(qm, "sm")
    assert lowest < -9000


def test_a_nan_in_an_unscored_output_leaves_the_scored_one_judged(tmp_path, capsys):
    # the profile dropped whole samples when any output was NaN: --score_outputs y then had no
    # row and --fail_below failed a clean output
    from conftest import write_samples
    from dipoorlet.cli import main

    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sqrt", ["x"], ["aux"], name="sqrt")]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8]), vi("aux", [1, 3, 8, 8])],
                       {"w": rand((4, 3, 3, 3), 0, 0.3), "b": rand((4,), 1, 0.1)})
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    data = write_samples(tmp_path / "d", [{"x": rand((1, 3, 8, 8), i)} for i in range(4)])   # some x < 0
    argv = ["-M", str(path), "-I", str(data), "-N", "4", "-D", "trt", "-O", str(tmp_path / "o"),
            "--skip_prof_layer", "--score_outputs", "y", "--fail_below", "0.99"]
    assert main(argv) == 0, capsys.readouterr().err
    import json
    rows = {o["tensor"]: o for o in json.loads((tmp_path / "o" / "report.json").read_text())["outputs"]}
    assert rows["y"]["cosine"] > 0.99 and "aux" not in rows


def test_sensitivity_with_every_sample_left_out_says_so_instead_of_scoring_zero(tmp_path, caplog):
    import logging

    import dipoorlet

    path, calib, held_out = _all_bad_held_out(tmp_path)
    with caplog.at_level(logging.WARNING):
        res = dipoorlet.quantize(model=path, input_dir=calib, data_num=4, deploy="trt", output_dir=tmp_path / "o",
                                 val_dir=held_out, auto_skip="cosine:0.99")
    assert any(r.getMessage().startswith("sensitivity: no sample left to score") for r in caplog.records)
    assert not res.report.get("sensitivity") and not res.report.get("auto_skip")


def test_the_nan_check_flags_nan_only_and_runs_before_each_q(tmp_path):
    # an Inf is an ordinary mask value; a check nothing depended on ran after the last layer in
    # onnxruntime and held every Q input for the whole run (129 -> 664 MB on a 30-Conv model)
    from dipoorlet.qdq import append_watch

    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q1"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq1"),
             helper.make_node("Relu", ["xd"], ["r"], name="relu"),
             helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"], name="q2"),
             helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"], name="dq2")]
    model = make_model(nodes, [vi("x", [1, 8])], [vi("y", [1, 8])],
                       {"s": np.array(0.05, np.float32), "z": np.array(0, np.int8)})
    watched = onnx.ModelProto()
    watched.CopyFrom(model)
    name, _ = append_watch(watched, {})
    producers = {o: n for n in watched.graph.node for o in n.output}
    for q in (n for n in watched.graph.node if n.op_type == "QuantizeLinear"):
        gate = producers[q.input[1]]       # the Q reads its scale + 0 * IsNaN(ReduceSum(t))
        assert gate.op_type == "Add" and producers[gate.input[1]].op_type == "Mul"
        assert producers[producers[producers[producers[gate.input[1]].input[0]].input[0]].input[0]].input[0] \
            == q.input[0]
    watched.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, []))
    onnx.checker.check_model(watched)
    x = np.linspace(-3, 3, 8, dtype=np.float32).reshape(1, 8)
    for value, flagged in ((None, False), (-np.inf, False), (np.finfo(np.float32).min, False), (np.nan, True)):
        feed = x.copy()
        if value is not None:
            feed[0, :4] = value
        y, flag = ort_run(watched, {"x": feed})
        (ref,) = ort_run(model, {"x": feed})
        np.testing.assert_array_equal(y, ref)
        assert (float(flag) > 0) == flagged


def test_a_nan_inside_the_model_that_the_output_hides_is_named(tmp_path, caplog):
    """A fully padded sequence makes the float MatMul after the softmax NaN, and a Where(IsNaN)
    hides it from the output: the profile leaves that sample out of mm1's row, and says so
    (it dropped the row silently when no sample was left), while the output's row keeps every
    sample."""
    import logging

    model = _masked_softmax_model()
    g = model.graph
    g.node.insert(4, helper.make_node("IsNaN", ["h0"], ["isnan"], name="isnan"))
    g.node.insert(5, helper.make_node("Where", ["isnan", "zero", "h0"], ["h0c"], name="hide"))
    next(n for n in g.node if n.name == "bias1").input[0] = "h0c"
    g.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 4, 8)).astype(np.float32), "mask": np.ones((1, 4, 8), np.float32)}
             for _ in range(4)]
    feeds[2]["mask"][0, 1] = 0.0
    assert np.isfinite(ort_run(model, feeds[2])[0]).all()
    with caplog.at_level(logging.WARNING):
        res, _ = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("error profile: 1 layer")]
    assert len(said) == 1 and "(mm1, 1 of 4 samples)" in said[0], said
    assert any(r["node"] == "mm1" for r in res.report["layers"]) and res.report["outputs"][0]["cosine"] > 0.9
    # without the Where the output shows the NaN: the sample is named as left out, and not as hidden
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        quantize_model(tmp_path / "shown", _masked_softmax_model(), feeds=feeds, act_quant="mse")
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("error profile of y") and "left out" in m for m in said), said
    assert not any("outputs do not show" in m for m in said), said


def test_sqnr_of_a_tensor_whose_quantized_copy_overflows_is_minus_inf():
    import math

    from dipoorlet.util import sqnr_db

    assert sqnr_db(1e80, math.inf) == -math.inf        # log10(0) raised a ValueError
    assert sqnr_db(1.0, 0.0) == math.inf and math.isnan(sqnr_db(math.nan, 1.0))
    assert math.isnan(sqnr_db(math.inf, math.inf)) and sqnr_db(0.0, 1.0) == -math.inf
    assert sqnr_db(0.0, 1.0, no_signal=None) is None
    assert sqnr_db(100.0, 1.0) == pytest.approx(20.0)


@pytest.mark.parametrize("flags", [{"deploy": "trt"}, {"deploy": "qnn", "a_bits": 16}, {"deploy": "qnn"},
                                   {"deploy": "ti"}])
def test_attention_mask_of_float32_lowest_stays_float(tmp_path, flags, caplog):
    """HF's (1 - mask) * float32.min: a grid over +-3.4e38 has steps of 1e36 (the real scores
    collapsed: output cosine 0.56 on qnn) and its end levels dequantize to inf (a 'math domain
    error' in the report, an inf range in ti_blob_range.txt). Such tensors stay float, named."""
    import logging

    nodes = [helper.make_node("MatMul", ["x", "w"], ["s"], name="mm"),
             helper.make_node("Sub", ["one", "mask"], ["inv"], name="sub"),
             helper.make_node("Mul", ["inv", "lowest"], ["neg"], name="mul"),
             helper.make_node("Add", ["s", "neg"], ["a"], name="madd"),
             helper.make_node("Softmax", ["a"], ["y"], name="softmax", axis=-1)]
    model = make_model(nodes, [vi("x", [1, 8]), vi("mask", [1, 8])], [vi("y", [1, 8])],
                       {"w": rand((8, 8), 1), "one": np.float32(1), "lowest": np.float32(np.finfo(np.float32).min)})
    mask = np.ones((1, 8), np.float32)
    mask[0, 6:] = 0
    feeds = [{"x": rand((1, 8), i + 3), "mask": mask} for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        result, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="minmax", **flags)
    assert "tensor neg reaches -3.403e+38" in caplog.text
    f = feeds[0]
    got, want = ort_run(qm, f)[0], ort_run(model, f)[0]
    assert np.all(got[0, 6:] == 0) and np.isfinite(got).all()
    assert result.report["outputs"][0]["cosine"] > 0.999 and np.abs(got - want).max() < 0.05
    for path in [*(tmp_path / "out").glob("*.json"), *(tmp_path / "out").glob("*.txt")]:
        text = path.read_text()
        assert "Infinity" not in text and "inf" not in text.lower().replace("info", ""), path.name
        if path.name != "report.json":      # the report describes the tensor's range, the side files no grid
            assert "e+38" not in text, path.name


@pytest.mark.parametrize("deploy", ["atlas", "stpu"])
def test_layer_keyed_side_files_name_nodes_of_a_model_that_ships(tmp_path, deploy):
    """An input model with unnamed nodes: the names the tool gives them key atlas_record.json /
    stpu_minmax.json, so transformed_model.onnx (which holds them) is written even where no
    weight transform ran (--no_bc --no_equalize)."""
    import json

    from conftest import tiny_cnn

    model = tiny_cnn()
    for n in model.graph.node:
        n.name = ""
    quantize_model(tmp_path, model, n=3, deploy=deploy, bias_correction=False, equalize=False, skip_prof_layer=True)
    out = tmp_path / "out"
    names = {n.name for n in onnx.load(str(out / "transformed_model.onnx")).graph.node}
    if deploy == "atlas":
        keys = set(json.loads((out / "atlas_record.json").read_text()))
    else:
        keys = {k.rsplit("_", 1)[0] for k in json.loads((out / "stpu_minmax.json").read_text())
                if k.endswith(("_weights", "_bias"))}
    assert keys and keys <= names


def test_weight_clip_val_of_a_dead_channel_rebuilds_its_floored_grid(tmp_path):
    """A channel of ~1e-30 weights gets a grid built on MIN_SCALE; weight_clip_val.json gives that
    range (max |.| / 127 is the model's scale), not the values' own (a step 10^22 times too fine)."""
    import json

    from conftest import conv_model, initializer

    model = conv_model(cin=3, cout=4, bias=False)
    w = numpy_helper.to_array(model.graph.initializer[0]).copy()
    w[1] = 1e-30
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w"))
    quantize_model(tmp_path, model, n=3, skip_prof_layer=True)
    lo, hi = json.loads((tmp_path / "out" / "weight_clip_val.json").read_text())["w"]
    scale = initializer(onnx.load(str(tmp_path / "out" / "quant_model.onnx")), "w_scale")
    rebuilt = np.maximum(np.abs(lo), np.abs(hi)) / 127
    np.testing.assert_allclose(rebuilt, scale, rtol=1e-6)


def test_json_outputs_hold_no_infinity_or_nan(tmp_path):
    import json

    from dipoorlet.util import write_json

    path = write_json(tmp_path / "r.json", {"spread": float("inf"), "x": [1.0, float("nan"), -float("inf")], "k": 2})
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(c)) == \
        {"spread": None, "x": [1.0, None, None], "k": 2}


def test_savefp_gives_outputs_differing_by_slash_and_underscore_their_own_folders(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w"], ["feat/out"], name="c1", pads=[1] * 4),
             helper.make_node("Relu", ["feat/out"], ["feat_out"], name="r")]
    model = make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi("feat/out", [1, 4, 6, 6]), vi("feat_out", [1, 4, 6, 6])],
                       {"w": rand((4, 3, 3, 3), 0, 0.3)})
    feeds = input_feeds(model, 2)
    quantize_model(tmp_path, model, feeds=feeds, savefp=True, skip_prof_layer=True)
    out = tmp_path / "out" / "output"
    conv = np.fromfile(out / "feat_out" / "onnx-output-0.bin", np.float32)
    relu = np.fromfile(out / "feat_out_1" / "onnx-output-0.bin", np.float32)
    want = ort_run(model, feeds[0])
    np.testing.assert_allclose(conv, want[0].ravel(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(relu, want[1].ravel(), rtol=1e-5, atol=1e-6)


def test_savefp_keeps_outputs_named_dot_and_dot_dot_inside_their_folder(tmp_path):
    """Outputs named '.' and '..' sent their samples to output/ itself and to -O (found by a hunt)."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["."], name="c1", pads=[1] * 4),
             helper.make_node("Relu", ["."], [".."], name="r")]
    model = make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi(".", [1, 4, 6, 6]), vi("..", [1, 4, 6, 6])],
                       {"w": rand((4, 3, 3, 3), 0, 0.3)})
    feeds = input_feeds(model, 2)
    quantize_model(tmp_path, model, feeds=feeds, savefp=True, skip_prof_layer=True)
    out = tmp_path / "out"
    want = ort_run(model, feeds[1])
    np.testing.assert_allclose(np.fromfile(out / "output" / "_" / "onnx-output-1.bin", np.float32),
                               want[0].ravel(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.fromfile(out / "output" / "__" / "onnx-output-1.bin", np.float32),
                               want[1].ravel(), rtol=1e-5, atol=1e-6)
    assert not list(out.glob("onnx-output-*")) and not list((out / "output").glob("onnx-output-*"))


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_savefp_on_a_full_disk_raises_an_oserror_with_its_errno(tmp_path):
    """ndarray.tofile raised OSError('... requested and ... written') without an errno, which the
    CLI's full-disk line (exit 2) did not recognise: a traceback, exit 1."""
    import errno

    from dipoorlet.pipeline import _fp_saver

    folder = tmp_path / "output" / "y"
    folder.mkdir(parents=True)
    (folder / "onnx-output-0.bin").symlink_to("/dev/full")      # every write: ENOSPC
    save = _fp_saver(tmp_path, ["y"])
    with pytest.raises(OSError) as exc:
        save(0, {"y": np.ones((64, 1024), np.float32)})
    assert exc.value.errno == errno.ENOSPC


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_a_log_file_on_a_full_disk_goes_quiet(capsys):
    import logging

    from dipoorlet.util import QuietFileHandler

    h = QuietFileHandler("/dev/full", mode="w", encoding="utf-8")
    logger = logging.getLogger("dipoorlet_test_full")     # (no parent handlers an earlier test left)
    logger.propagate = False
    logger.addHandler(h)
    try:
        for _ in range(3):
            logger.error("x" * 10000)
    finally:
        logger.removeHandler(h)
        h.close()                      # the flush fails too: no exception
    assert "Logging error" not in capsys.readouterr().err


def test_a_model_with_stale_inner_shapes_runs_at_another_batch(tmp_path):
    """A model shape-inferred at batch 1 whose input and output were then made dynamic by hand
    keeps [1, ...] for its inner tensors; onnxruntime runs it at batch 2, and so must the run
    (the quantized model's If switches checked their outputs against the stale shapes: exit 2,
    blaming the sample)."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], pads=[1, 1, 1, 1], name="conv2")]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 8, 8, 8])],
                       {"w1": rand((8, 3, 3, 3), 0, 0.3), "b1": rand((8,), 1, 0.3), "w2": rand((8, 8, 3, 3), 2, 0.3)})
    model = onnx.shape_inference.infer_shapes(model)
    assert {v.name for v in model.graph.value_info} == {"c1", "r1"}
    for v in (model.graph.input[0], model.graph.output[0]):
        d = v.type.tensor_type.shape.dim[0]
        d.Clear()
        d.dim_param = "N"
    feeds = [{"x": rand((2, 3, 8, 8), 10 + i)} for i in range(6)]
    res, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse")
    assert res.report["outputs"][0]["cosine"] > 0.999
    got = ort_run(qm, feeds[0])[0]
    assert got.shape == (2, 8, 8, 8)
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in qm.graph.value_info}
    assert all(s[0] != 1 for s in shapes.values()), shapes


@pytest.mark.parametrize("all_inside", [False, True])
def test_layers_inside_local_functions_are_quantized(tmp_path, all_inside):
    """torch.onnx.export(..., export_modules_as_functions=True) wraps modules in local functions:
    their Convs stayed float without a word, and a model with every layer inside one was refused
    as having nothing to quantize. They are inlined and quantized (onnxruntime oracle)."""
    fn = helper.make_function("local", "Block", ["a", "w", "b"], ["o"],
                              [helper.make_node("Conv", ["a", "w", "b"], ["t"], pads=[1, 1, 1, 1]),
                               helper.make_node("Relu", ["t"], ["o"])], [helper.make_opsetid("", 13)])
    nodes = [helper.make_node("Block", ["x", "w1", "b1"], ["r1"], domain="local", name="block1"),
             helper.make_node("Block", ["r1", "w2", "b2"], ["y" if all_inside else "r2"], domain="local", name="block2")]
    inits = {"w1": rand((8, 3, 3, 3), 0, 0.3), "b1": rand((8,), 1, 0.3), "w2": rand((8, 8, 3, 3), 2, 0.3),
             "b2": rand((8,), 3, 0.3)}
    if not all_inside:
        nodes.append(helper.make_node("Conv", ["r2", "w3"], ["y"], name="head"))
        inits["w3"] = rand((2, 8, 1, 1), 4, 0.3)
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", None)], inits,
                       extra_opsets=[("local", 1)], check=False)
    model.functions.append(fn)
    feeds = [{"x": rand((1, 3, 8, 8), 10 + i)} for i in range(6)]
    res, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse", skip_prof_layer=True)
    convs = [n for n in qm.graph.node if n.op_type == "Conv"]
    assert len(convs) == (2 if all_inside else 3) and not qm.functions
    assert all(quantized for quantized in (n.input[1] in {o for m in qm.graph.node if m.op_type == "DequantizeLinear"
                                                          for o in m.output} for n in convs))
    assert sum(d["node"].startswith("Block/Conv") and d["quantized"] for d in res.report["decisions"]) == 2
    want, got = ort_run(model, feeds[0])[0], ort_run(qm, feeds[0])[0]
    assert float((want * got).sum() / np.linalg.norm(want) / np.linalg.norm(got)) > 0.999


def test_an_op_onnx_now_calls_deprecated_is_kept_with_a_warning(tmp_path, caplog):
    """GroupNormalization-18, which onnxruntime runs and newer onnx.checker refuses as
    deprecated: the run did all its work, then crashed with a traceback in its final check and
    wrote nothing. The quantized model keeps the input's op, with a warning where onnx refuses it."""
    import logging

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("GroupNormalization", ["c", "g", "b"], ["gn"], num_groups=4, epsilon=1e-5, name="gn"),
             helper.make_node("Relu", ["gn"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2")]
    inits = {"w1": rand((8, 3, 3, 3), 0, 0.3), "b1": rand((8,), 1, 0.3), "w2": rand((4, 8, 1, 1), 2, 0.3),
             "g": np.ones(4, np.float32), "b": np.zeros(4, np.float32)}
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])], inits, opset=18, check=False)
    try:
        onnx.checker.check_model(model)
        refused = False
    except onnx.checker.ValidationError:
        refused = True
    feeds = [{"x": rand((1, 3, 8, 8), 10 + i)} for i in range(6)]
    with caplog.at_level(logging.WARNING):
        res, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse", skip_prof_layer=True)
    assert any(n.op_type == "GroupNormalization" for n in qm.graph.node)
    assert res.report["outputs"][0]["cosine"] > 0.99
    assert refused == any("refuses as deprecated" in r.getMessage() for r in caplog.records)


def test_a_custom_ops_declared_output_shape_reaches_the_ops_after_it():
    """Shape inference redoes the model's own shapes, but keeps a custom op's declared output
    (ONNX's inference does not know com.microsoft Gelu) while it runs: without it the Add after
    the Gelu had no rank, and the decomposed LayerNorm after it (positive axes) was not fused."""
    from dipoorlet import prepare

    L, D = 8, 16
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Gelu", ["h"], ["g"], name="gelu", domain="com.microsoft"),
             helper.make_node("Add", ["g", "b0"], ["g2"], name="addb0"),
             helper.make_node("ReduceMean", ["g2"], ["mu"], axes=[2], name="rm1"),
             helper.make_node("Sub", ["g2", "mu"], ["d"], name="sub"),
             helper.make_node("Mul", ["d", "d"], ["d2"], name="sq"),
             helper.make_node("ReduceMean", ["d2"], ["var"], axes=[2], name="rm2"),
             helper.make_node("Add", ["var", "eps"], ["ve"], name="addeps"),
             helper.make_node("Sqrt", ["ve"], ["sd"], name="sqrt"),
             helper.make_node("Div", ["d", "sd"], ["n"], name="div"),
             helper.make_node("Mul", ["n", "gamma"], ["ng"], name="mulg"),
             helper.make_node("Add", ["ng", "beta"], ["ln"], name="addb"),
             helper.make_node("MatMul", ["ln", "w2"], ["y"], name="mm2")]
    inits = {"w1": rand((D, D), 0, 0.25), "w2": rand((D, D), 1, 0.25), "eps": np.float32(1e-5),
             "b0": rand((D,), 4, 0.5), "gamma": 1 + rand((D,), 2, 0.1), "beta": rand((D,), 3, 0.1)}
    model = make_model(nodes, [vi("x", [1, L, D])], [vi("y", [1, L, D])], inits,
                       extra_opsets=[("com.microsoft", 1)], check=False)
    model.graph.value_info.append(vi("g", [1, L, D]))
    g = Graph(model)
    done = prepare.prepare(g)
    assert done["layernorms_fused"] == 1
    assert any(n.op_type == "LayerNormalization" for n in g.graph.node)


def test_a_node_whose_every_grid_was_dropped_is_reported_float(tmp_path):
    """A stateful cell calibrated with a zero state: the state's grids are dropped (0 in every
    sample), and the Add reading the state product and a fused input had no Q/DQ left, yet
    report.json counted it as quantized."""
    I, H = 6, 8
    nodes = [helper.make_node("MatMul", ["x", "Wx"], ["a"], name="mx"),
             helper.make_node("MatMul", ["h_in", "Wh"], ["bh"], name="mh"),
             helper.make_node("Add", ["a", "bh"], ["s"], name="add1"),
             helper.make_node("Add", ["s", "b"], ["s2"], name="add2"),
             helper.make_node("Tanh", ["s2"], ["h_out"], name="tanh"),
             helper.make_node("MatMul", ["h_out", "Wo"], ["y"], name="mo")]
    model = make_model(nodes, [vi("x", [1, I]), vi("h_in", [1, H])], [vi("y", [1, 4]), vi("h_out", [1, H])],
                       {"Wx": rand((I, H), 0, 0.4), "Wh": rand((H, H), 1, 0.3), "b": rand((H,), 2, 0.1),
                        "Wo": rand((H, 4), 3, 0.3)})
    feeds = [{"x": rand((1, I), 10 + i), "h_in": np.zeros((1, H), np.float32)} for i in range(8)]
    res, qm = quantize_model(tmp_path, model, feeds=feeds, skip_prof_layer=True)
    add1 = next(n for n in qm.graph.node if n.name == "add1")
    producers = {o: n.op_type for n in qm.graph.node for o in n.output}
    assert all(producers.get(x) != "DequantizeLinear" for x in add1.input)     # float in the written model
    decision = {d["node"]: d for d in res.report["decisions"]}["add1"]
    assert not decision["quantized"] and "0 in every calibration sample" in decision["reason"]
    assert res.report["quantized_nodes"] == sum(d["quantized"] for d in res.report["decisions"])


def test_the_diagnosis_reads_the_output_grid_a_layer_owns(tmp_path):
    """qnn quantizes a network output in place, on a grid its producer owns: a state output that
    held-out samples take 5x past its clip was told as its input's rounding, with 16-bit advice
    that changed nothing. The output's grid is now in the diagnosis, as clipping."""
    from conftest import write_samples

    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
             helper.make_node("Add", ["a", "state"], ["y"], name="add_state")]
    model = make_model(nodes, [vi("x", [1, 16]), vi("state", [1, 16])], [vi("y", [1, 16])],
                       {"w": rand((16, 16), 0, 0.25)})
    calib = [{"x": rand((1, 16), 10 + i), "state": np.zeros((1, 16), np.float32)} for i in range(8)]
    held = [{"x": rand((1, 16), 30 + i), "state": rand((1, 16), 50 + i, 5.0)} for i in range(8)]
    res, _ = quantize_model(tmp_path, model, feeds=calib, deploy="qnn",
                            val_dir=write_samples(tmp_path / "val", held))
    rows = {d["node"]: d for d in res.report["diagnosis"]}
    assert "add_state" in rows, rows
    text = rows["add_state"]["advice"]
    assert "output y clipped" in text and "activation clipping dominates" in text, text
    assert "=a16" not in text


def test_log_gives_the_quantized_count_again_when_placed_nodes_lose_their_grid(tmp_path, caplog):
    """A node placed as quantized whose grids the plan drops (its input 0 in every calibration
    sample) computes in float: the log's placement line had said one more node quantized than the
    summary and report.json (found by a README walkthrough). The log now says which placed nodes
    compute in float and the new count. (Session 43: a Relu fused into an Add whose output reaches
    the Gemm's grid through a Flatten counts as quantized, so the case is a dropped grid now.)"""
    import json

    from conftest import zero_input_add_model

    model, feeds = zero_input_add_model()
    caplog.set_level("INFO", logger="dipoorlet")
    quantize_model(tmp_path, model, feeds=feeds, deploy="qnn", skip_prof_layer=True)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    gone = [d["node"] for d in rep["decisions"] if d["reason"].startswith("kept float: no grid left")]
    assert gone
    lines = [r.getMessage() for r in caplog.records if "compute in float, no grid of theirs left" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(f"; {rep['quantized_nodes']} nodes quantized")
    assert all(n in lines[0] for n in gone)


def _lowest_mask_attention():
    """Attention scores + (1 - mask) * float32's lowest, a Softmax and softmax·V; 8 samples padded
    to random lengths: (model, feeds)."""
    length, dim = 12, 16
    nodes = _attention_scores() + [
             helper.make_node("Sub", ["one", "mask"], ["inv"], name="sub"),
             helper.make_node("Mul", ["inv", "lowest"], ["neg"], name="mul"),
             helper.make_node("Add", ["s", "neg"], ["sm"], name="addmask"),
             helper.make_node("Softmax", ["sm"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    inits = {k: rand((dim, dim), i, 1.5 / np.sqrt(dim)) for i, k in enumerate(("wq", "wk", "wv"))}
    inits.update({"one": np.float32(1), "lowest": np.float32(np.finfo(np.float32).min)})
    model = make_model(nodes, [vi("x", [1, length, dim]), vi("mask", [1, 1, length])], [vi("y", [1, length, dim])],
                       inits)
    rng = np.random.default_rng(5)
    feeds = []
    for i in range(8):
        n = int(rng.integers(4, length))
        mask = np.zeros((1, 1, length), np.float32)
        mask[..., :n] = 1
        feeds.append({"x": rng.standard_normal((1, length, dim)).astype(np.float32), "mask": mask})
    return model, feeds


@pytest.mark.parametrize("a_bits", [None, 16])
def test_softmax_input_behind_a_float32_lowest_mask_gets_its_floor_grid(tmp_path, a_bits, caplog):
    """HF's (1 - mask) * float32.min added to the scores, calibrated on padded samples: the log
    said the Softmax input's grid starts at its floor (the lowest row maximum less 20), and the
    next line dropped the grid because the tensor's raw minimum is -3.4e38 (found by a bug hunt:
    MiniLM on qnn, 6 of 6 Softmax inputs left float). The floor decides the reach now: the grid
    starts there (numpy oracle) and the padding still gets no attention."""
    import logging

    from dipoorlet.calibrate import SOFTMAX_MARGIN

    model, feeds = _lowest_mask_attention()
    with caplog.at_level(logging.INFO, logger="dipoorlet"):
        _, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse", deploy="qnn", a_bits=a_bits,
                               skip_prof_layer=True)
    assert not [r for r in caplog.records if "tensor sm reaches" in r.getMessage()]
    rowmax = _lowest_rowmax(model, feeds)
    lowest, step = _grid_of(qm, "sm")
    assert abs(lowest - (rowmax - SOFTMAX_MARGIN)) <= step, (lowest, rowmax)
    p_out = onnx.ModelProto()
    p_out.CopyFrom(qm)
    p_out.graph.output.append(vi("p", None))
    for f in feeds:
        p = ort_run(p_out, f)[-1]
        assert float(p[..., f["mask"][0, 0] == 0].max(initial=0)) < 1e-6


@pytest.mark.parametrize("fill", [-np.inf, np.finfo(np.float32).min])
def test_a_masked_softmax_input_keeps_its_row_in_the_report(tmp_path, fill):
    """The error profile compares a Softmax input with a floor at the values the float model has at
    or above the floor: a mask of -inf or float32's lowest had made every sample's sums non-finite,
    and the attention scores' row vanished from the report (GPT-2 on qnn; found by a hunt). Oracle:
    numpy over those values of the float model and the quantized one."""
    model = _fill_masked_attention(fill)
    feeds = []
    for i in range(6):
        mask = np.ones((2, 6), np.int64)
        mask[0, -1 - i % 2:] = 0
        feeds.append({"x": rand((2, 6, 8), 20 + i), "mask": mask})
    res, qm = quantize_model(tmp_path, model, feeds=feeds, deploy="qnn", sens_samples=6)
    row = next((l for l in res.report["layers"] if l["tensor"] == "sm"), None)
    assert row is not None and np.isfinite(row["cosine"]), res.report["layers"]
    # oracle: the live values (the float model's, finite and far above the mask) of both models
    exposed = [onnx.ModelProto(), onnx.ModelProto()]
    for e, m in zip(exposed, (model, qm)):
        e.CopyFrom(m)
        e.graph.output.append(vi("sm", None))
    fs, qs = [], []
    for f in feeds:
        a, b = ort_run(exposed[0], f)[-1], ort_run(exposed[1], f)[-1]
        live = np.isfinite(a) & (a > -1e30)
        fs.append(a[live].astype(np.float64))
        qs.append(b[live].astype(np.float64))
    cos = np.mean([x @ y / np.sqrt((x @ x) * (y @ y)) for x, y in zip(fs, qs)])
    assert row["cosine"] == pytest.approx(cos, abs=1e-5)


def test_a_mask_below_a_softmax_floor_is_not_counted_as_saturation(tmp_path):
    """Calibrated unpadded, profiled on padded samples (--val_dir): the Softmax input's grid
    starts at its floor on purpose, and the -1e4 mask below it weighs nothing; it was the
    saturation table's worst tensor at ~1e80x its rounding noise (found by a bug hunt). A value
    above the grid still counts."""
    import dipoorlet
    from conftest import save, write_samples

    model, padded = _masked_attention(13)
    unpadded = [{"x": f["x"], "mask": np.zeros_like(f["mask"])} for f in padded]
    data = write_samples(tmp_path / "data", unpadded)
    val = write_samples(tmp_path / "val", padded)
    res = dipoorlet.quantize(model=save(model, tmp_path / "m.onnx"), input_dir=data, data_num=len(unpadded),
                             deploy="qnn", output_dir=tmp_path / "out", val_dir=val, skip_prof_layer=True)
    worst = {w["tensor"]: w for w in res.report["clipped"]["worst"]}
    assert "sm" not in worst, worst["sm"]
    assert res.report["clipped"]["tensors"] >= 3


@pytest.mark.parametrize("deploy", ["atlas", "trt", "snpe", "qnn"])
def test_a_layer_whose_input_is_0_in_every_sample_keeps_its_weights_float(tmp_path, deploy):
    """conv2 reads a Relu that is 0 on every calibration sample: its input gets no grid, but its
    weights kept an int8 grid, report.json called it quantized and atlas_record.json left it out
    (found by a bug hunt). It is float, weights included, and says why."""
    import json

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1] * 4),
             helper.make_node("Conv", ["x", "w3", "b3"], ["c3"], name="conv3", pads=[1] * 4),
             helper.make_node("Add", ["c2", "c3"], ["y"], name="add")]
    inits = {"w1": rand((4, 3, 3, 3), 1, 0.1), "b1": np.full(4, -100, np.float32), "w2": rand((4, 4, 3, 3), 2, 0.3),
             "b2": rand((4,), 3), "w3": rand((4, 3, 3, 3), 4, 0.3), "b3": rand((4,), 5)}
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])], inits)
    res, qm = quantize_model(tmp_path, model, n=4, deploy=deploy, skip_prof_layer=True)
    conv2 = next(n for n in qm.graph.node if n.name == "conv2")
    assert conv2.input[1] == "w2"                      # no DequantizeLinear: the float weight
    dec = next(d for d in res.report["decisions"] if d["node"] == "conv2")
    assert not dec["quantized"] and "r1 0 in every calibration sample" in dec["reason"]
    if deploy == "atlas":
        assert "conv2" not in json.loads((tmp_path / "out" / "atlas_record.json").read_text())
    feed = input_feeds(model, 1)[0]
    np.testing.assert_allclose(ort_run(qm, feed)[0], ort_run(model, feed)[0], atol=0.2)


@pytest.mark.parametrize("flags", [{}, {"gptq": True}])
def test_a_bias_that_is_also_a_network_output_keeps_its_value(tmp_path, flags):
    """A Conv bias listed among the graph outputs: bias correction (on by default) and --gptq
    rewrote it in place, so the quantized model's output of that name changed (found by a bug
    hunt: max 0.0082). It is left as it is; the layer's other transforms still run."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2", pads=[1] * 4)]
    inits = {"w1": rand((8, 3, 3, 3), 1, 0.2), "b1": rand((8,), 2, 0.2), "w2": rand((8, 8, 3, 3), 3, 0.2),
             "b2": rand((8,), 4, 0.2)}
    model = make_model(nodes, [vi("x", [1, 3, 16, 16])], [vi("y", [1, 8, 16, 16]), vi("b2", [8])], inits)
    _, qm = quantize_model(tmp_path, model, n=8, act_quant="mse", skip_prof_layer=True, **flags)
    feed = input_feeds(model, 1)[0]
    np.testing.assert_array_equal(ort_run(qm, feed)[1], inits["b2"])


def _layer_figures(float_model, quant_model, feeds, tensor):
    """Mean cosine and pooled SQNR of ``tensor`` between the two models, both run unoptimized."""
    def fetch(model):
        m = copy.deepcopy(model)
        m.graph.output.append(helper.make_tensor_value_info(tensor, TensorProto.FLOAT, None))
        return [ort_run(m, f)[-1].astype(np.float64) for f in feeds]

    ref, got = fetch(float_model), fetch(quant_model)
    cos = np.mean([a.ravel() @ b.ravel() / np.linalg.norm(a) / np.linalg.norm(b) for a, b in zip(ref, got)])
    sqnr = 10 * np.log10(sum((a ** 2).sum() for a in ref) / sum(((a - b) ** 2).sum() for a, b in zip(ref, got)))
    return cos, sqnr


def test_a_layer_read_through_a_transpose_is_profiled_before_its_rounding(tmp_path):
    """K = x Wk read as K^T by Q.K^T: its grid sits after the Transpose. The profile session
    (basic optimizations) let onnxruntime's TransposeOptimizer move the Transpose past that Q/DQ,
    so the row for K measured the rounded tensor: 38.5 dB where the written model's K reads
    41.2 dB, while the twin layer Q was measured before its rounding (found by a bug hunt)."""
    E = 16
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="mmq"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="mmk"),
             helper.make_node("Transpose", ["k"], ["kt"], name="tr", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk")]
    model = make_model(nodes, [vi("x", [1, "S", E])], [vi("s", [1, "S", "S"])],
                       {"wq": rand((E, E), 1, 0.3), "wk": rand((E, E), 2, 0.3)}, opset=17)
    feeds = [{"x": rand((1, 6 + i % 4, E), 10 + i)} for i in range(12)]
    res, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse")
    rows = {r["tensor"]: r for r in res.report["layers"]}
    for t in ("q", "k"):
        cos, sqnr = _layer_figures(model, qm, feeds, t)
        assert rows[t]["cosine"] == pytest.approx(cos, abs=2e-6), t
        assert rows[t]["sqnr_db"] == pytest.approx(sqnr, abs=2e-3), t


@pytest.mark.parametrize("bias", [False, True])
def test_a_matmul_reading_a_shifted_input_is_profiled_at_its_own_output(tmp_path, bias):
    """trt's activation shift moves a MatMul's input by d, so the MatMul's own output carries
    W d, which an Add after it takes off (its bias Add, or one the shift inserts). The profile
    measured that offset product: mm2 read 45.6 dB where its output, and the network output it
    alone gives, read 42.0 dB (found by a bug hunt). The row now measures the layer's output as
    the input model has it."""
    r = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
             helper.make_node("Add", ["h1", "b1"], ["h1b"], name="add1"),
             helper.make_node("Relu", ["h1b"], ["r1"], name="relu1"),
             helper.make_node("MatMul", ["r1", "w2"], ["h2"], name="mm2")]
    inits = {"w1": (r.standard_normal((16, 64)) * 0.3).astype(np.float32), "b1": np.full(64, 0.5, np.float32),
             "w2": (r.standard_normal((64, 32)) * 0.3 + 0.05).astype(np.float32)}
    if bias:
        nodes.append(helper.make_node("Add", ["h2", "b2"], ["h2b"], name="add2"))
        inits["b2"] = rand((32,), 3, 0.1)
    last = "h2b" if bias else "h2"
    nodes.append(helper.make_node("Neg", [last], ["y"], name="neg"))
    model = make_model(nodes, [vi("x", ["B", 16])], [vi("y", ["B", 32])], inits, opset=17)
    feeds = [{"x": rand((1, 16), 20 + i)} for i in range(16)]
    res, qm = quantize_model(tmp_path, model, feeds=feeds, act_quant="mse")
    assert [s["consumers"] for s in res.report["shift"]] == [["mm2"]]
    row = {r["node"]: r for r in res.report["layers"]}["mm2"]
    assert row["tensor"] == last
    cos, sqnr = _layer_figures(model, qm, feeds, last)
    assert row["cosine"] == pytest.approx(cos, abs=2e-6)
    assert row["sqnr_db"] == pytest.approx(sqnr, abs=2e-3)
    out = res.report["outputs"][0]             # y = -(the layer's output): the same figures
    assert (out["cosine"], out["sqnr_db"]) == pytest.approx((row["cosine"], row["sqnr_db"]), abs=1e-6)


def test_integer_ops_in_a_loop_body_are_not_counted_as_layers_left_float(tmp_path, caplog):
    """A Loop's iteration counter Add and an index Mul (int64, as torch exports them) were
    counted as ops left float, and a model with nothing else quantizable was refused with advice
    to export the branch as the graph (found by a bug hunt). Only the float Add is counted."""
    import logging

    C = 8
    one, two = (numpy_helper.from_array(np.array(v, np.int64), n) for v, n in ((1, "one"), (2, "two")))
    body = helper.make_graph(
        [helper.make_node("Add", ["cnt_in", "one"], ["c1"], name="counter_add"),
         helper.make_node("Identity", ["c1"], ["cnt_out"], name="counter_id"),
         helper.make_node("Mul", ["cnt_out", "two"], ["dbl"], name="index_mul"),
         helper.make_node("Add", ["acc_in", "acc_in"], ["acc_out"], name="float_add"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="cond_id")],
        "body", [vi("it", [], TensorProto.INT64), vi("cond_in", [], TensorProto.BOOL),
                 vi("cnt_in", [], TensorProto.INT64), vi("acc_in", [2, C])],
        [vi("cond_out", [], TensorProto.BOOL), vi("cnt_out", [], TensorProto.INT64), vi("acc_out", [2, C]),
         vi("dbl", [], TensorProto.INT64)], [one, two])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Loop", ["trip", "", "c0", "h"], ["cnt", "yl", "dbls"], name="loop", body=body),
             helper.make_node("Relu", ["yl"], ["y"], name="relu")]
    model = make_model(nodes, [vi("x", [2, C])], [vi("y", [2, C])],
                       {"w": rand((C, C), 0, 0.3), "trip": np.array(3, np.int64), "c0": np.array(0, np.int64)},
                       opset=17)
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        quantize_model(tmp_path, model, feeds=[{"x": rand((2, C), 5 + i)} for i in range(4)], deploy="snpe",
                       skip_prof_layer=True)
    said = [r.getMessage() for r in caplog.records if "If/Loop/Scan bodies" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("1 ops inside") and "(Add x1)" in said[0], said


def _if_with_a_conv_in_a_branch():
    branch = lambda name: helper.make_graph(
        [helper.make_node("Conv", ["c", "w2"], [name + "_o"], name=name + "_conv", pads=[1, 1, 1, 1])],
        name, [], [vi(name + "_o", [1, 4, 6, 6])])
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch("then"),
                              else_branch=branch("else"))]
    inits = {"w": rand((4, 3, 3, 3), 0, 0.3), "w2": rand((4, 4, 3, 3), 1, 0.3), "cond": np.array(True)}
    return make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", [1, 4, 6, 6])], inits)


def test_skip_layers_naming_a_node_inside_an_if_branch_is_said_and_run(tmp_path, caplog):
    """It was refused as "not nodes of the model ... use node names, not tensor names" (found by
    a bug hunt): the node exists, inside a body that stays float anyway."""
    import logging

    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        res, qm = quantize_model(tmp_path, _if_with_a_conv_in_a_branch(), n=2, skip_prof_layer=True,
                                 skip_layers=["then_conv"])
    assert any("--skip_layers then_conv: inside If/Loop/Scan bodies" in r.getMessage() for r in caplog.records)
    assert res.report["quantized_nodes"] == 1


def test_layer_bits_naming_a_node_inside_an_if_branch_says_where_it_is(tmp_path):
    from dipoorlet.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--layer_bits names \['else_conv'\], which sit inside If/Loop/Scan"):
        quantize_model(tmp_path, _if_with_a_conv_in_a_branch(), n=2, skip_prof_layer=True,
                       layer_bits=["else_conv=w4"])


def test_qop_names_an_if_as_the_reader_of_a_layer_output_a_branch_reads(tmp_path):
    """A Conv whose output only an If branch reads stays QDQ; the log's reader list named it ""
    (found by a bug hunt)."""
    from dipoorlet import qop

    res, _ = quantize_model(tmp_path, _if_with_a_conv_in_a_branch(), n=2, deploy="ort", quant_format="QOP",
                            skip_prof_layer=True)
    qdq = onnx.load(str(tmp_path / "out" / "quant_model_qdq.onnx"))
    assert qop.unquantized_outputs(qdq) == {"If": 1}


@pytest.mark.parametrize("deploy", ["trt", "snpe"])
def test_a_layer_whose_weight_holds_inf_stays_float(tmp_path, deploy, caplog):
    """One Inf in one channel of a Conv weight: on a per-tensor backend the scale became inf and
    every output channel of the quantized model non-finite, where the float model has one; the
    run said nothing (found by a bug hunt). The layer stays float, with a warning; the next one
    is quantized."""
    import logging

    w = rand((4, 3, 3, 3), 0, 0.3)
    w[2, 0, 1, 1] = np.inf
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", [1, 4, 6, 6])], {"w": w, "w2": rand((4, 4, 3, 3), 1, 0.3)})
    feeds = [{"x": np.abs(rand((1, 3, 6, 6), 10 + i))} for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        res, qm = quantize_model(tmp_path, model, feeds=feeds, deploy=deploy, skip_prof_layer=True)
    assert any("conv's w holds 1 NaN/Inf value" in r.getMessage() for r in caplog.records)
    decisions = {d["node"]: d["quantized"] for d in res.report["decisions"]}
    assert decisions["conv"] is False
    for f in feeds:
        ref, got = ort_run(model, f)[0], ort_run(qm, f)[0]
        assert np.array_equal(np.isfinite(ref), np.isfinite(got))     # the same channels non-finite


def test_a_layer_left_float_by_a_mask_input_gives_that_reason(tmp_path):
    """A Mul reading a float32-lowest mask on qnn is left float for the mask's range; its decision
    said "madd 0 in every calibration sample" (found by a bug hunt)."""
    lowest = np.finfo(np.float32).min
    nodes = [helper.make_node("MatMul", ["x", "w"], ["s"], name="mm"),
             helper.make_node("Cast", ["mask"], ["mb"], to=TensorProto.BOOL, name="cast"),
             helper.make_node("Where", ["mb", "zero", "fill"], ["madd"], name="where"),
             helper.make_node("Mul", ["madd", "half"], ["madd2"], name="scale_mask"),
             helper.make_node("Add", ["s", "madd2"], ["y"], name="add_mask")]
    model = make_model(nodes, [vi("x", ["B", 8]), vi("mask", ["B", 8], TensorProto.INT64)], [vi("y", ["B", 8])],
                       {"w": rand((8, 8), 0, 0.3), "zero": np.array(0, np.float32),
                        "fill": np.array(lowest, np.float32), "half": np.array(0.5, np.float32)}, opset=17)
    feeds = [{"x": rand((2, 8), 3 + i), "mask": np.array([[1] * 8, [1] * 6 + [0] * 2], np.int64)} for i in range(4)]
    res, _ = quantize_model(tmp_path, model, feeds=feeds, deploy="qnn", skip_prof_layer=True)
    reason = {d["node"]: d["reason"] for d in res.report["decisions"]}["scale_mask"]
    assert "madd reaches -3.403e+38..0, beyond any integer grid" in reason and "0 in every" not in reason, reason


def _fill_masked_attention(fill):
    """x Wq (x)^T + Where(mask, 0, fill) -> Softmax -> p x, dynamic batch and length."""
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="mq"),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1], name="xt"),
             helper.make_node("MatMul", ["q", "xt"], ["s"], name="scores"),
             helper.make_node("Cast", ["mask"], ["mb"], to=TensorProto.BOOL, name="cast"),
             helper.make_node("Unsqueeze", ["mb", "ax1"], ["mb3"], name="unsq"),
             helper.make_node("Where", ["mb3", "zero", "fill"], ["madd"], name="where"),
             helper.make_node("Add", ["s", "madd"], ["sm"], name="add_mask"),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["p", "x"], ["y"], name="ctx")]
    return make_model(nodes, [vi("x", ["B", "L", 8]), vi("mask", ["B", "L"], TensorProto.INT64)],
                      [vi("y", ["B", "L", 8])],
                      {"wq": rand((8, 8), 0, 0.3), "zero": np.array(0, np.float32),
                       "fill": np.array(fill, np.float32), "ax1": np.array([1], np.int64)}, opset=17)


@pytest.mark.parametrize("fill", [-np.inf, np.finfo(np.float32).min])
def test_a_softmax_input_behind_a_minus_inf_mask_gets_its_floor_grid(tmp_path, fill):
    """A mask of -inf (or two float32-lowest masks summed, GPT-2's causal and padding masks) left
    the Softmax input float ("reaches -inf"), every GPT-2 Softmax on qnn; float32's lowest gave
    it its floor grid (found by a bug hunt). Both now quantize it, and padding stays hidden."""
    model = _fill_masked_attention(fill)
    feeds = []
    for i in range(8):
        mask = np.ones((2, 6 + i % 3), np.int64)
        mask[0, -1 - i % 2:] = 0
        feeds.append({"x": rand((2, 6 + i % 3, 8), 20 + i), "mask": mask})
    _, qm = quantize_model(tmp_path, model, feeds=feeds, deploy="qnn", skip_prof_layer=True)
    assert "sm" in {n.input[0] for n in qm.graph.node if n.op_type == "QuantizeLinear"}
    f = dict(feeds[0])
    other = dict(f, x=f["x"].copy())
    other["x"][0, -1] += 5.0                       # a padded position's input: no real output moves
    got, moved = ort_run(qm, f)[0], ort_run(qm, other)[0]
    np.testing.assert_array_equal(got[0, :-2], moved[0, :-2])
    assert np.corrcoef(ort_run(model, f)[0][0, :-2].ravel(), got[0, :-2].ravel())[0, 1] > 0.99


@pytest.mark.parametrize("deploy, kw, said", [
    ("trt", {"skip_prof_layer": True, "sens_samples": 3}, "--sens_samples applies to the sensitivity analysis"),
    ("qnn", {"skip_prof_layer": True, "criterion": "maxabs"}, "--criterion applies to the sensitivity analysis"),
    ("trt", {"gptq_memory": 1.0}, "--gptq_memory applies with --gptq, --adaround or --sparse only; ignored"),
    ("qnn", {"trt_version": "8500"}, "--trt_version applies to -D trt only"),
    ("qnn", {"shift": False}, "--no_shift: qnn shifts no activation"),
])
def test_a_flag_this_run_does_not_use_is_said_ignored(tmp_path, deploy, kw, said, caplog):
    """As --gptq_samples, --ada_iters, --bins... were; these were silent (found by a flag hunt)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        quantize_model(tmp_path, make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                                            [vi("x", [1, 8])], [vi("y", [1, 8])], {"w": rand((8, 8), 0, 0.3)}),
                       deploy=deploy, **kw)
    assert any(said in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_flag_given_at_its_default_value_is_still_said_ignored(tmp_path, caplog):
    """``-D qnn --trt_version 8601`` (the default) was silent: the check compared the value with the
    default. The CLI's flags (abbreviated too) and the API's keywords are now known as given."""
    import logging

    from conftest import save, write_samples
    from dipoorlet.cli import main
    from dipoorlet.config import config_from_kwargs
    from dipoorlet.errors import ConfigError

    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", [1, 8])],
                       [vi("y", [1, 8])], {"w": rand((8, 8), 0, 0.3)})
    said = "--trt_version applies to -D trt only"
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        quantize_model(tmp_path / "api", model, deploy="qnn", trt_version="8601", ada_iters=1000)
    assert any(said in r.getMessage() for r in caplog.records)
    assert any("--ada_iters applies with --adaround" in r.getMessage() for r in caplog.records)
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, 2))
    for flag in ("--trt_version", "--trt_vers", None):
        out = tmp_path / (flag or "--none")[2:]
        assert main(["-M", str(path), "-I", str(data), "-N", "2", "-D", "qnn", "-O", str(out), "--skip_prof_layer"]
                    + ([flag, "8601"] if flag else [])) == 0
        assert (said in (out / "dipoorlet.log").read_text()) == bool(flag), flag
    # what is given is not a setting: the same run either way, and no keyword of the API
    cfg = config_from_kwargs(model=path, input_dir=data, data_num=2, trt_version="8601")
    assert cfg.given == {"model", "input_dir", "data_num", "trt_version"}
    assert cfg == config_from_kwargs(model=path, input_dir=data, data_num=2)
    with pytest.raises(ConfigError, match="unknown keyword 'given'"):
        config_from_kwargs(model=path, input_dir=data, data_num=2, given={"bins"})


def test_adaround_with_16_bit_inputs_names_adaround_and_auto_a16_on_trt_names_no_width(tmp_path, caplog):
    import logging

    from dipoorlet.errors import ConfigError

    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", [1, 8])],
                       [vi("y", [1, 8])], {"w": rand((8, 8), 0, 0.3)})
    pytest.importorskip("torch")
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        quantize_model(tmp_path / "a", model, deploy="qnn", a_bits=16, adaround=True, ada_iters=5)
    said = [r.getMessage() for r in caplog.records if "no layer can be fitted" in r.getMessage()]
    assert said and "(adaround fits layers" in said[0] and "gptq" not in said[0], said
    with pytest.raises(ConfigError) as err:
        quantize_model(tmp_path / "b", model, deploy="trt", auto_a16="0.999")
    assert "use 2..8" not in str(err.value) and "use a backend with 16-bit activations" in str(err.value)


@pytest.mark.parametrize("deploy", ["trt", "qnn"])
def test_a_mask_added_to_another_term_before_the_scores_is_never_clipped(tmp_path, deploy):
    """T5 adds the padding mask to its position bias, then that sum to the scores. Calibrated on
    unpadded sentences the sum got the bias's grid (+-0.32) and the mask was clipped there at
    deployment: padded tokens were attended to, a padded sentence's own tokens read cosine 0.75
    (found by a transformer-export hunt). The sum stays float; padding stays hidden."""
    lowest = np.finfo(np.float32).min
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="mq"),
             helper.make_node("MatMul", ["x", "wb"], ["qb"], name="mb"),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1], name="xt"),
             helper.make_node("MatMul", ["q", "xt"], ["s"], name="scores"),
             helper.make_node("MatMul", ["qb", "xt"], ["bias"], name="bias"),
             helper.make_node("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Sub", ["one", "mf"], ["inv"], name="inv"),
             helper.make_node("Mul", ["inv", "low"], ["mterm"], name="mterm"),
             helper.make_node("Unsqueeze", ["mterm", "ax1"], ["m3"], name="unsq"),
             helper.make_node("Add", ["bias", "m3"], ["bias_m"], name="add_bias_mask"),
             helper.make_node("Add", ["s", "bias_m"], ["sm"], name="add_scores"),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["p", "x"], ["y"], name="ctx")]
    model = make_model(nodes, [vi("x", ["B", "L", 8]), vi("mask", ["B", "L"], TensorProto.INT64)],
                       [vi("y", ["B", "L", 8])],
                       {"wq": rand((8, 8), 0, 0.3), "wb": rand((8, 8), 1, 0.05), "one": np.array(1, np.float32),
                        "low": np.array(lowest, np.float32), "ax1": np.array([1], np.int64)}, opset=17)
    feeds = [{"x": rand((1, 6 + i % 3, 8), 30 + i), "mask": np.ones((1, 6 + i % 3), np.int64)} for i in range(8)]
    _, qm = quantize_model(tmp_path, model, feeds=feeds, deploy=deploy, skip_prof_layer=True)
    assert "bias_m" not in {n.input[0] for n in qm.graph.node if n.op_type == "QuantizeLinear"}
    mask = np.ones((2, 10), np.int64)
    mask[0, 6:] = 0
    f = {"x": rand((2, 10, 8), 77), "mask": mask}
    g = {"x": f["x"].copy(), "mask": mask}
    g["x"][0, 6:] += 3.0                           # only padded positions change
    a, b = ort_run(qm, f)[0], ort_run(qm, g)[0]
    np.testing.assert_array_equal(a[0, :6], b[0, :6])


def test_a_float_input_added_before_a_softmax_is_no_mask(tmp_path):
    """z = x W + prior (a float input: a state, previous logits), then s = z + x W2 -> Softmax: z
    lost its grid as "an attention mask added short of a Softmax" (a bug of this session's change,
    found by a review). A mask comes from an integer or boolean input."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
             helper.make_node("Add", ["a", "prior"], ["z"], name="add_prior"),
             helper.make_node("MatMul", ["x", "w2"], ["b"], name="mm2"),
             helper.make_node("Add", ["z", "b"], ["s"], name="add2"),
             helper.make_node("Softmax", ["s"], ["y"], axis=-1, name="softmax")]
    model = make_model(nodes, [vi("x", [1, 8]), vi("prior", [1, 8])], [vi("y", [1, 8])],
                       {"w": rand((8, 8), 0, 0.3), "w2": rand((8, 8), 1, 0.3)})
    feeds = [{"x": rand((1, 8), 10 + i), "prior": rand((1, 8), 20 + i)} for i in range(6)]
    _, qm = quantize_model(tmp_path, model, feeds=feeds, deploy="qnn", skip_prof_layer=True)
    assert "z" in {n.input[0] for n in qm.graph.node if n.op_type == "QuantizeLinear"}


def test_an_embedding_lookup_of_token_ids_is_no_mask_term():
    """Masks are followed through a Gather's data (mask[b, kv]), not its indices: a table looked
    up by an integer input (token embeddings, a relative position bias) is no mask term."""
    from dipoorlet.calibrate import _from_input

    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], name="lookup"),
             helper.make_node("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Gather", ["mf", "kv"], ["mg"], name="index", axis=1),
             helper.make_node("Add", ["emb", "mg"], ["y"], name="add")]
    g = Graph(make_model(nodes, [vi("ids", [1, 4], TensorProto.INT64), vi("mask", [1, 4], TensorProto.INT64)],
                         [vi("y", [1, 4, 4])], {"table": rand((10, 4), 1), "kv": np.arange(4, dtype=np.int64)}))
    assert not _from_input(g, "emb", integer=True)
    assert _from_input(g, "mg", integer=True)


def test_a_line_break_in_a_name_keeps_its_markdown_table_row_whole():
    """ONNX allows a line break in a node name; report.md's tables split that row in two."""
    from dipoorlet.report import table

    lines = table(["node", "cos"], [["conv\nline|x", 0.5], ["b\r\nc", None]]).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| conv\\nline\\|x ") and lines[3].startswith("| b\\r\\nc ")
    assert all(l.count("|") - l.count("\\|") == 3 for l in lines)


def test_skip_layers_naming_a_name_two_nodes_share_keeps_both_float(tmp_path, caplog):
    """Two Convs named "blk" (ONNX does not forbid it): the second is renamed blk_1, and
    --skip_layers blk had kept the first alone float, without a word (found by a hunt)."""
    import logging

    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="blk", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["b"], name="blk", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["b", "w3"], ["y"], name="other", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])],
                       {"w1": rand((4, 3, 3, 3), 1, 0.3), "w2": rand((4, 4, 3, 3), 2, 0.3),
                        "w3": rand((4, 4, 3, 3), 3, 0.3)})
    with caplog.at_level(logging.WARNING):
        _, qm = quantize_model(tmp_path, model, deploy="trt", skip_layers=("blk",), skip_prof_layer=True)
    convs = {n.name: n for n in qm.graph.node if n.op_type == "Conv"}
    assert sorted(convs) == ["blk", "blk_1", "other"]
    dq = {o for n in qm.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    assert not any(i in dq for k in ("blk", "blk_1") for i in convs[k].input)
    assert all(i in dq for i in convs["other"].input[:2])
    assert any("2 nodes of the model are named blk (now blk, blk_1)" in r.getMessage() for r in caplog.records)


def test_a_mask_added_to_scores_plus_alibi_from_the_mask_is_still_a_mask():
    """BLOOM: scores + ALiBi (made from cumsum(attention_mask) * attention_mask), then + the padding
    mask. The ALiBi side had counted as coming from the input too, so both operands of the last
    Add looked alike and the mask was missed (found by a review of the Gather/ScatterND change)."""
    from dipoorlet.calibrate import _mask_fed

    n = helper.make_node
    nodes = [n("MatMul", ["x", "xt"], ["s"], name="scores"),
             n("CumSum", ["mask", "ax0"], ["pos"], name="cumsum"),
             n("Cast", ["pos"], ["posf"], to=TensorProto.FLOAT, name="cast_pos"),
             n("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT, name="cast_mask"),
             n("Mul", ["posf", "mf"], ["alibi"], name="alibi"),
             n("Add", ["s", "alibi"], ["sb"], name="add_alibi"),
             n("Sub", ["one", "mf"], ["inv"], name="inv"),
             n("Mul", ["inv", "big"], ["bias"], name="scale"),
             n("Add", ["sb", "bias"], ["sm"], name="add_mask"),
             n("Softmax", ["sm"], ["y"], name="softmax", axis=-1)]
    g = Graph(onnx.shape_inference.infer_shapes(make_model(
        nodes, [vi("x", [1, 4, 4]), vi("xt", [1, 4, 4]), vi("mask", [1, 4], TensorProto.INT64)], [vi("y", [1, 4, 4])],
        {"ax0": np.array(1, np.int64), "one": np.float32(1.0), "big": np.float32(-1e4)})))
    assert _mask_fed(g, "sm", integer=True) and _mask_fed(g, "sm")
    assert not _mask_fed(g, "sb", integer=True)


def test_the_diagnosis_of_a_masked_softmax_names_its_floor_not_the_masks_channel_max(tmp_path):
    """The diagnosis of a Softmax input behind a float32-lowest mask read "clipped at 20.69;
    largest channel max over 8 samples 3.403e+38": the mask, kept below the floor on purpose
    (found by a KV-cache hunt). It names the floor grid now."""
    model, feeds = _lowest_mask_attention()
    quantize_model(tmp_path, model, feeds=feeds, act_quant="mse", deploy="qnn")
    import json

    diag = json.loads((tmp_path / "out" / "report.json").read_text())["diagnosis"]
    soft = [d for d in diag if d["node"] == "softmax"]
    assert soft, [d["node"] for d in diag]
    assert "e+38" not in soft[0]["advice"] and "from the Softmax's floor" in soft[0]["advice"], soft[0]["advice"]


def test_a_shared_name_of_which_preparation_removed_one_node_still_skips_the_other(tmp_path):
    """A Conv and an Identity both named "n": --skip_layers n expanded to n_1, the Identity that
    preparation removes, and the run stopped on a name the user never typed (found by a review)."""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="n", pads=[1, 1, 1, 1]),
             helper.make_node("Identity", ["a"], ["b"], name="n"),
             helper.make_node("Conv", ["b", "w2"], ["y"], name="other", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])],
                       {"w1": rand((4, 3, 3, 3), 1, 0.3), "w2": rand((4, 4, 3, 3), 2, 0.3)})
    _, qm = quantize_model(tmp_path, model, deploy="trt", skip_layers=("n",), skip_prof_layer=True)
    convs = {c.name: c for c in qm.graph.node if c.op_type == "Conv"}
    dq = {o for c in qm.graph.node if c.op_type == "DequantizeLinear" for o in c.output}
    assert not any(i in dq for i in convs["n"].input) and convs["other"].input[1] in dq


def _attention(seq):
    """x [1, S, 8] -> scores x W x^T -> Softmax over the keys -> probabilities . x; S is ``seq``
    (a number, or a name: a dynamic length)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("Transpose", ["x"], ["xt"], name="t", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["h", "xt"], ["s"], name="qk"),
             helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "x"], ["y"], name="pv")]
    return make_model(nodes, [vi("x", [1, seq, 8])], [vi("y", [1, seq, 8])], {"w": rand((8, 8), 3, 0.15)})


@pytest.mark.parametrize("seq", ["S", 16])
def test_softmax_output_over_rows_of_no_fixed_length_reaches_one(tmp_path, seq):
    """A row's largest probability grows as the row gets shorter, to 1 for a row of one (a KV-cache
    decoder's first token): calibrated on 16-long rows, the grid of p ended near their largest
    probability and a shorter row's was clipped (a hunt's Llama decoder: prefill cosine 0.73).
    Rows of a fixed length keep the calibrated grid. Oracle: the float model on a row of one."""
    import json

    model = _attention(seq)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 16, 8)).astype(np.float32)} for _ in range(4)]
    quantize_model(tmp_path, model, feeds=feeds, skip_prof_layer=True)
    amax = max(abs(v) for v in json.loads((tmp_path / "out" / "act_clip_val.json").read_text())["p"])
    if seq == 16:
        assert amax < 0.95
        return
    assert amax >= 1.0
    qm = onnx.load(str(tmp_path / "out" / "quant_model.onnx"))
    one = {"x": rng.standard_normal((1, 1, 8)).astype(np.float32)}
    ref, got = ort_run(model, one)[0], ort_run(qm, one)[0]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def _float_mask_attention():
    """x [1, S, 8], an additive float mask [1, 1, S]: Softmax(x W x^T + mask) . x."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("Transpose", ["x"], ["xt"], name="t", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["h", "xt"], ["s"], name="qk"),
             helper.make_node("Add", ["s", "mask"], ["sm"], name="add_mask"),
             helper.make_node("Softmax", ["sm"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "x"], ["y"], name="pv")]
    return make_model(nodes, [vi("x", [1, "S", 8]), vi("mask", [1, 1, "S"])], [vi("y", [1, "S", 8])],
                      {"w": rand((8, 8), 3, 0.15)})


def test_minus_inf_in_an_additive_mask_input_is_data_not_an_error(tmp_path):
    """A float attention-mask input holding -inf (positions left out) was refused as NaN/Inf in
    the data (found by a hunt); it is an additive mask's own value. NaN or +inf there, and -inf
    in any other input, are still refused. Oracle: the float model on a masked sample."""
    import dipoorlet
    from conftest import write_samples
    from dipoorlet.errors import DataError

    model = _float_mask_attention()
    rng = np.random.default_rng(0)
    feeds = []
    for i in range(6):
        n = 6 + i
        mask = np.zeros((1, 1, n), np.float32)
        mask[0, 0, n - 2:] = -np.inf if i % 2 == 0 else 0
        feeds.append({"x": rng.standard_normal((1, n, 8)).astype(np.float32), "mask": mask})
    _, qm = quantize_model(tmp_path, model, feeds=feeds, skip_prof_layer=True)
    f = feeds[0]
    ref, got = ort_run(model, f)[0].ravel(), ort_run(qm, f)[0].ravel()
    assert np.isfinite(got).all() and ref @ got / np.linalg.norm(ref) / np.linalg.norm(got) > 0.99
    path = tmp_path / "model.onnx"
    for name, value in (("mask", np.nan), ("mask", np.inf), ("x", -np.inf)):
        bad = [dict(f) for f in feeds]
        bad[1] = {k: v.copy() for k, v in bad[1].items()}
        bad[1][name].flat[0] = value
        data = write_samples(tmp_path / f"bad_{name}_{value}", bad)
        with pytest.raises(DataError, match="NaN/Inf"):
            dipoorlet.quantize(model=path, input_dir=data, data_num=6, deploy="trt",
                               output_dir=tmp_path / f"o_{name}_{value}", skip_prof_layer=True)


def test_brecq_fits_samples_whose_mask_input_holds_minus_inf(tmp_path):
    """-inf in an additive mask input is data; --brecq had dropped every such sample as not
    finite (with all of them masked it fitted nothing, without a word but "check those inputs";
    found by a review)."""
    pytest.importorskip("torch")
    model = _float_mask_attention()
    rng = np.random.default_rng(0)
    feeds = []
    for i in range(6):
        mask = np.zeros((1, 1, 8), np.float32)
        mask[0, 0, 6:] = -np.inf
        feeds.append({"x": rng.standard_normal((1, 8, 8)).astype(np.float32), "mask": mask})
    res, _ = quantize_model(tmp_path, model, feeds=feeds, skip_prof_layer=True, brecq=True, ada_iters=20)
    assert res.report["brecq"]["samples"] == 6


def test_a_set_of_names_is_the_same_settings_in_every_process():
    """skip_layers given as a set kept the set's order, which follows each process's hash seed:
    MPI ranks given the same set were refused as given different settings (a review)."""
    from dipoorlet.config import QuantConfig

    names = [f"layer_{c}" for c in "qwertyuiopas"]      # 12: a set's order is all but never sorted
    cfg = QuantConfig(model="m.onnx", input_dir="d", data_num=4, deploy="trt",
                      skip_layers=set(names), score_outputs=frozenset(names))
    assert cfg.skip_layers == tuple(sorted(names)) and cfg.score_outputs == tuple(sorted(names))


def test_a_concat_that_ties_scores_to_boxes_is_reported(tmp_path, caplog):
    """YOLOv8 (NudeNet) concatenates its boxes (0..317) and Sigmoid scores (0..1) into one output;
    qnn gives a Concat's inputs and output one grid, the scores rounded to 0 and the output read
    cosine 0.9994 without a word (found by a hunt). The log, report.json and report.md name the
    tensor, the steps its values span (numpy oracle) and the Concat to keep float."""
    import json
    import logging

    inits = {"wb": rand((8, 4), 1, 40.0), "ws": rand((8, 2), 2, 0.5)}
    nodes = [helper.make_node("MatMul", ["x", "wb"], ["box"], name="boxes"),
             helper.make_node("MatMul", ["x", "ws"], ["logit"], name="cls"),
             helper.make_node("Sigmoid", ["logit"], ["score"], name="sig"),
             helper.make_node("Concat", ["box", "score"], ["y"], name="cat", axis=1)]
    model = make_model(nodes, [vi("x", [1, 8])], [vi("y", [1, 6])], inits)
    feeds = input_feeds(model, 4)
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        result, qm = quantize_model(tmp_path / "q", model, feeds=feeds, deploy="qnn", skip_prof_layer=True)
    losses = result.report["shared_grid_losses"]
    assert list(losses) == ["score"] and losses["score"]["tied_by"] == ["cat"]
    ranges = json.loads((tmp_path / "q" / "out" / "act_clip_val.json").read_text())
    scores = 1 / (1 + np.exp(-np.array([f["x"] @ inits["ws"] for f in feeds], np.float64)))
    y_all = np.concatenate([np.array([f["x"] @ inits["wb"] for f in feeds]).ravel(), scores.ravel()])
    step = (max(y_all.max(), 0) - min(y_all.min(), 0)) / 255
    # a grid holds 0: the scores' own grid is 0..max
    assert losses["score"]["steps"] == pytest.approx((scores.max() - min(scores.min(), 0)) / step, rel=0.05)
    assert any("tied by cat" in r.getMessage() and "--skip_layers cat" in r.getMessage() for r in caplog.records)
    assert "Shared grids far wider than their tensors' values: score" in (tmp_path / "q" / "out" / "report.md").read_text()
    assert ranges  # the side file was written as usual
    # without the tie (trt keeps no shared grids; qnn with the Concat float) nothing is said
    result, _ = quantize_model(tmp_path / "t", model, feeds=feeds, deploy="trt", skip_prof_layer=True)
    assert "shared_grid_losses" not in result.report
    result, _ = quantize_model(tmp_path / "s", model, feeds=feeds, deploy="qnn", skip_prof_layer=True,
                               skip_layers=["cat"])
    assert "shared_grid_losses" not in result.report


@pytest.mark.parametrize("deploy", ["qnn", "ort"])
def test_a_network_output_behind_a_reshape_of_a_quantized_gemm_is_quantized_where_outputs_are(tmp_path, deploy):
    """Gemm -> Reshape -> output (a captcha OCR's head): qnn quantizes network outputs and runs the
    Reshape on the Gemm's grid, but the output had stayed float and out of qnn_encodings.json, as
    only an output a quantized node writes itself got one (found by a hunt). ort leaves outputs float."""
    import json

    inits = {"w": rand((8, 6), 1, 0.5), "b": rand((6,), 2, 0.1), "shape": np.array([1, 2, 3], np.int64)}
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], name="fc"),
             helper.make_node("Reshape", ["g", "shape"], ["y"], name="rs")]
    model = make_model(nodes, [vi("x", [1, 8])], [vi("y", [1, 2, 3])], inits)
    feeds = input_feeds(model, 4)
    _, qm = quantize_model(tmp_path, model, feeds=feeds, deploy=deploy, skip_prof_layer=True)
    dq_of_y = [n for n in qm.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "y"]
    if deploy == "ort":
        assert not dq_of_y
        return
    assert dq_of_y
    (enc,) = json.loads((tmp_path / "out" / "qnn_encodings.json").read_text())["activation_encodings"]["y"]
    want = np.array([ort_run(model, f)[0] for f in feeds])
    # the output's grid covers its values to a step (a minmax grid holding 0 exactly), and the outputs are on it
    assert enc["min"] <= min(want.min(), 0) + enc["scale"] and enc["max"] >= want.max() - enc["scale"]
    got = np.array([ort_run(qm, f)[0] for f in feeds])
    steps = (got - enc["min"]) / enc["scale"]
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    np.testing.assert_allclose(got, want, atol=enc["scale"] * 2)


def _boxes_and_scores(tail=None):
    """x -> boxes (0..~300) and Sigmoid scores -> Concat cat [-> tail op] -> y."""
    inits = {"wb": rand((8, 4), 1, 40.0), "ws": rand((8, 2), 2, 0.5)}
    nodes = [helper.make_node("MatMul", ["x", "wb"], ["box"], name="boxes"),
             helper.make_node("MatMul", ["x", "ws"], ["logit"], name="cls"),
             helper.make_node("Sigmoid", ["logit"], ["score"], name="sig"),
             helper.make_node("Concat", ["box", "score"], ["c" if tail else "y"], name="cat", axis=1)]
    if tail == "Transpose":
        nodes.append(helper.make_node("Transpose", ["c"], ["y"], name="tr", perm=[1, 0]))
    return make_model(nodes, [vi("x", [1, 8])], [vi("y", [6, 1] if tail else [1, 6])], inits)


def test_shared_grid_losses_follow_the_plan_as_written_and_the_backend(tmp_path, caplog):
    """Found by a review of the shared-grid report: (a) --auto_a16 moving the group to 16 bits left
    the 8-bit entry in the report; (b) rk, which has no 16-bit activations, was told to use a16;
    (c) a Concat whose output reaches the network output through a Transpose tied nothing, and its
    scores kept their own grid while qnn gives them the output's."""
    import logging

    model = _boxes_and_scores()
    feeds = input_feeds(model, 4)
    res, _ = quantize_model(tmp_path / "a16", model, feeds=feeds, deploy="qnn", auto_a16="sqnr:80", sens_samples=2)
    assert "cat" in res.report["auto_a16"]["a16_layers"] and "shared_grid_losses" not in res.report
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        res, _ = quantize_model(tmp_path / "rk", model, feeds=feeds, deploy="rk", skip_prof_layer=True)
    (line,) = [r.getMessage() for r in caplog.records if "far wider than" in r.getMessage()]
    assert "--skip_layers cat" in line and "a16" not in line, line
    res, qm = quantize_model(tmp_path / "tr", _boxes_and_scores("Transpose"), feeds=feeds, deploy="qnn",
                             skip_prof_layer=True)
    assert res.report["shared_grid_losses"]["score"]["tied_by"] == ["cat"]
    zp = {t.name: t for t in qm.graph.initializer}
    assert numpy_helper.to_array(zp["score_scale"]) == numpy_helper.to_array(zp["y_scale"])


def test_a_reshape_before_a_concat_is_not_named_and_a_skipped_reshape_keeps_the_output_float(tmp_path):
    """Found by a review: the note named a Reshape that ties a tensor into a Concat's group, which
    --skip_layers does not untie (only the Concat does); and --skip_layers on the Reshape between a
    quantized Gemm and a network output still quantized that output."""
    inits = {"wa": rand((8, 4), 1, 0.5), "wb": rand((8, 4), 2, 40.0), "shape": np.array([1, 4], np.int64),
             "w": rand((8, 6), 3, 0.5), "b": rand((6,), 4, 0.1), "shape2": np.array([1, 2, 3], np.int64)}
    nodes = [helper.make_node("MatMul", ["x", "wa"], ["a"], name="ma"),
             helper.make_node("Reshape", ["a", "shape"], ["ar"], name="rs"),
             helper.make_node("MatMul", ["x", "wb"], ["b4"], name="mb"),
             helper.make_node("Concat", ["ar", "b4"], ["y"], name="cat", axis=1),
             helper.make_node("Gemm", ["x", "w", "b"], ["g"], name="fc"),
             helper.make_node("Reshape", ["g", "shape2"], ["z"], name="rs2")]
    model = make_model(nodes, [vi("x", [1, 8])], [vi("y", [1, 8]), vi("z", [1, 2, 3])], inits)
    res, qm = quantize_model(tmp_path / "a", model, deploy="qnn", skip_prof_layer=True)
    assert all(v["tied_by"] == ["cat"] for v in res.report["shared_grid_losses"].values())
    assert any(n.op_type == "DequantizeLinear" and n.output[0] == "z" for n in qm.graph.node)
    _, qm = quantize_model(tmp_path / "b", model, deploy="qnn", skip_prof_layer=True, skip_layers=["rs2"])
    assert not any(n.op_type == "DequantizeLinear" and n.output[0] == "z" for n in qm.graph.node)


@pytest.mark.parametrize("deploy", ["qnn", "ort"])
def test_a_runtime_resize_scale_stays_float(tmp_path, deploy):
    """ONNX's node test resize_upsample_scales_nearest with scales fed at runtime: qnn and ort
    quantized the scales like values, 1.0 read 0.9965 off the grid and the output's batch became
    0 (found by a sweep of the node tests). Only the data input is quantized; the outputs match
    the float model's shape and values to a step of X's grid."""
    nodes = [helper.make_node("Resize", ["X", "", "scales"], ["Y"], name="rs", mode="nearest")]
    model = make_model(nodes, [vi("X", [1, 1, 4, 4]), vi("scales", [4])], [vi("Y", ["n", "c", "h", "w"])], {})
    r = np.random.default_rng(0)
    feeds = [{"X": r.random((1, 1, 4, 4)).astype(np.float32),
              "scales": np.array([1, 1, k, k], np.float32)} for k in (2, 2.5, 3, 3.3)]
    _, qm = quantize_model(tmp_path, model, feeds=feeds, deploy=deploy, skip_prof_layer=True)
    assert "scales" not in {n.input[0] for n in qm.graph.node if n.op_type == "QuantizeLinear"}
    for f in feeds:
        want, got = ort_run(model, f)[0], ort_run(qm, f)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1 / 255 + 1e-6)


def test_a_failure_of_the_quantized_model_does_not_blame_the_sample():
    """The message had said "check that sample's shapes, dtypes and values" for a sample the float
    model runs (found by the same sweep)."""
    from dipoorlet.errors import ModelError
    from dipoorlet.runtime import Runner

    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="rs")]
    model = make_model(nodes, [vi("x", [2, 3]), vi("shape", [2], onnx.TensorProto.INT64)], [vi("y", ["a", "b"])], {})
    feed = {"x": np.zeros((2, 3), np.float32), "shape": np.array([4, 4], np.int64)}
    for quantized, said in ((False, "check that sample's shapes"), (True, "which the float model runs")):
        with pytest.raises(ModelError) as err:
            Runner(model, ["y"], quantized=quantized).run(feed)
        assert said in str(err.value)


def test_a_model_of_ai_onnx_ml_only_is_told_so(tmp_path):
    """ONNX's node test ai_onnx_ml_binarizer: "model opset 0 is outside ..." (found by a sweep)."""
    from dipoorlet.errors import ModelError

    node = helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml", threshold=0.5)
    model = helper.make_model(helper.make_graph([node], "g", [vi("x", [2, 3])], [vi("y", [2, 3])]),
                              opset_imports=[helper.make_opsetid("ai.onnx.ml", 1)])
    with pytest.raises(ModelError, match="imports no ONNX operator set .ai.onnx., only ai.onnx.ml"):
        quantize_model(tmp_path, model, feeds=[{"x": np.ones((2, 3), np.float32)}], skip_prof_layer=True)
