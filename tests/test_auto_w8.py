"""--auto_w8: the most sensitive layers' narrow weights promoted to the backend's 8-bit grids.
Oracles: the written model's integers (numpy), onnxruntime scores of the written model (the
search's estimate must equal them), the plain W8 model."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import helper

from dipoorlet.errors import ConfigError

from conftest import make_model, quantize_model, rand, vi, weight_ints


def _chain(n=4, relu=True):
    """x -> Conv 1x1 -> (Relu) -> ... with biases: one reader per tensor (unpadded, so trt
    shifts the Relu outputs)."""
    inits = {}
    nodes = []
    src = "x"
    for i in range(n):
        inits[f"w{i}"] = rand((6, 6, 1, 1), i, 0.5)
        inits[f"b{i}"] = rand((6,), 10 + i, 0.1)
        nodes.append(helper.make_node("Conv", [src, f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}"))
        src = f"c{i}"
        if relu and i < n - 1:
            nodes.append(helper.make_node("Relu", [src], [f"r{i}"], name=f"relu{i}"))
            src = f"r{i}"
    return make_model(nodes, [vi("x", [1, 6, 8, 8])], [vi(src, [1, 6, 8, 8])], inits)


@pytest.mark.parametrize("shift,deploy", [(False, "trt"), (True, "trt"), (False, "snpe"), (False, "qnn")])
def test_search_estimate_is_the_written_model_and_the_chosen_weights_are_8_bit(tmp_path, shift, deploy):
    """On a chain (one reader per tensor) the search's final estimate equals what the written
    model measures on the same samples, with and without the activation shift (whose biases
    absorb the shift through W_q and must follow the new grids), and on backends with int32
    biases (planned again on s_in * s_w8 in the trial as in the written model); on trt the
    chosen layers' weights use 8-bit levels, the others stay within 4-bit ones."""
    model = _chain()
    res, q = quantize_model(tmp_path, model, n=8, w_bits=4, auto_w8="sqnr:60", shift=shift, sens_samples=6,
                            deploy=deploy)
    a = res.report["auto_w8"]
    assert a["w8_layers"] and a["steps"]
    assert a["after_measured"]["cosine"] == pytest.approx(a["after_estimated"]["cosine"], abs=1e-6)
    assert a["after_measured"]["sqnr_db"] == pytest.approx(a["after_estimated"]["sqnr_db"], abs=1e-3)
    if deploy == "trt":     # symmetric per-channel grids: the levels tell the width
        for i in range(4):
            ints = weight_ints(q, f"w{i}")
            if f"conv{i}" in a["w8_layers"]:
                assert np.abs(ints).max() == 127
            else:
                assert np.abs(ints).max() <= 7
    if shift:
        assert res.report.get("shift"), "the chain's Relu outputs should be shifted on trt"
    # the HTML page shows the search and the diagnosis as report.md does (it had neither)
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<h2>auto_w8: sqnr" in page and "most sensitive layers with 8-bit weights" in page
    assert ("<h2>What limits accuracy" in page) == bool(res.report.get("diagnosis"))


def test_all_layers_promoted_is_the_8_bit_model(tmp_path):
    """A target no 4-bit layer can meet promotes every layer: the written model then scores as
    the plain W8 model does."""
    model = _chain(3)
    res, _ = quantize_model(tmp_path / "a", model, n=6, w_bits=4, auto_w8="sqnr:200", sens_samples=4)
    ref, _ = quantize_model(tmp_path / "b", model, n=6, sens_samples=4, auto_skip="sqnr:0.0",
                            bias_correction=False)   # --auto_w8 turns the default bias correction off
    a = res.report["auto_w8"]
    assert sorted(a["w8_layers"]) == ["conv0", "conv1", "conv2"] and not a["met"]
    assert a["after_measured"]["sqnr_db"] == pytest.approx(ref.report["auto_skip"]["before"]["sqnr_db"], abs=1e-3)
    # the diagnosis rests on isolated scores of the 4-bit weights: it says so for promoted layers
    rows = res.report.get("diagnosis") or []
    assert rows and all("before --auto_w8 gave it 8-bit weights" in d["advice"] for d in rows)


def test_nothing_narrow_skips_the_search(tmp_path, caplog):
    res, _ = quantize_model(tmp_path, _chain(2), n=4, auto_w8="0.99", sens_samples=2)
    assert "auto_w8" not in res.report
    assert "no candidate layer" in caplog.text


@pytest.mark.parametrize("kw,text", [
    ({"auto_w8": "0.99", "sparse": "2:4"}, "--auto_w8 with --sparse/--bc"),
    ({"auto_w8": "0.99", "bias_correction": True}, "--auto_w8 with --sparse/--bc"),
    ({"auto_w8": "0.99", "auto_skip": "0.99"}, "--auto_w8 with --auto_skip/--auto_a16"),
    ({"auto_w8": "bad"}, "--auto_w8 'bad'"),
    ({"auto_w8": "0.99", "max_w8_layers": 0}, "--max_w8_layers must be a positive integer"),
])
def test_bad_settings(tmp_path, kw, text):
    with pytest.raises(ConfigError, match=text):
        quantize_model(tmp_path, _chain(2), n=2, w_bits=4, **kw)


def test_a_shared_weight_is_no_candidate(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    """Two Convs read one weight: one grid serves both in the written model, so neither is a
    candidate (a trial of one reader would score a model that is not written)."""
    inits = {"ws": rand((6, 6, 1, 1), 1, 0.5), "w2": rand((6, 6, 1, 1), 2, 0.5)}
    nodes = [helper.make_node("Conv", ["x", "ws"], ["a"], name="convA"),
             helper.make_node("Relu", ["a"], ["ra"], name="reluA"),
             helper.make_node("Conv", ["ra", "ws"], ["b"], name="convB"),
             helper.make_node("Conv", ["b", "w2"], ["y"], name="conv2")]
    model = make_model(nodes, [vi("x", [1, 6, 8, 8])], [vi("y", [1, 6, 8, 8])], inits)
    res, _ = quantize_model(tmp_path, model, n=6, w_bits=4, auto_w8="sqnr:200", sens_samples=4)
    a = res.report["auto_w8"]
    assert a["w8_layers"] == ["conv2"]
    assert "convA" in caplog.text and "not candidates" in caplog.text
    assert a["after_measured"]["sqnr_db"] == pytest.approx(a["after_estimated"]["sqnr_db"], abs=1e-3)


@pytest.mark.parametrize("rounding", ["adaround", "gptq"])
def test_rounding_is_fitted_after_the_search_on_its_grids(tmp_path, rounding):
    """--auto_w8 with --adaround/--gptq: the search runs on nearest rounding, the rounding is then
    fitted on the grids it leaves (8-bit weights for the chosen layers, 4-bit for the others),
    and the written model, rounding included, is what is measured: after_measured equals the SQNR
    onnxruntime gives quant_model.onnx on the sensitivity samples."""
    from conftest import input_feeds, ort_run

    model = _chain()
    extra = {"adaround": True, "ada_iters": 200} if rounding == "adaround" else {"gptq": True}
    res, q = quantize_model(tmp_path, model, n=8, w_bits=4, auto_w8="sqnr:60", sens_samples=6, **extra)
    a, r = res.report["auto_w8"], res.report[rounding]
    assert a["w8_layers"] and r["layers"] >= 1
    for i in range(4):
        ints = weight_ints(q, f"w{i}")
        assert np.abs(ints).max() == (127 if f"conv{i}" in a["w8_layers"] else 7)
    from dipoorlet.data import spread

    feeds = [input_feeds(model, 8)[i] for i in spread(6, 8, 0, 1)]   # the 6 sensitivity samples
    sig = err = 0.0
    for f in feeds:
        ref, got = ort_run(model, f)[0].astype(np.float64), ort_run(q, f)[0].astype(np.float64)
        sig += float(np.sum(ref ** 2))
        err += float(np.sum((ref - got) ** 2))
    assert a["after_measured"]["sqnr_db"] == pytest.approx(10 * np.log10(sig / err), abs=1e-3)


@pytest.mark.parametrize("deploy", ["snpe", "trt"])
def test_deferred_rounding_fits_what_the_plain_rounding_fits(tmp_path, deploy):
    """A target met with no layer promoted: --gptq fitted after the search must write the same
    weights and (int32 on snpe) biases as --gptq alone; before the fix, the deferred fit found
    the biases already planned as int32 and left them at nearest rounding."""
    from onnx import numpy_helper

    model = _chain()
    res, q = quantize_model(tmp_path / "a", model, n=8, w_bits=4, auto_w8="sqnr:-50", sens_samples=4,
                            gptq=True, deploy=deploy)
    assert res.report["auto_w8"]["w8_layers"] == [] and res.report["gptq"]["layers"] >= 1
    _, ref = quantize_model(tmp_path / "b", model, n=8, w_bits=4, gptq=True, deploy=deploy, sens_samples=4)
    got = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    want = {t.name: numpy_helper.to_array(t) for t in ref.graph.initializer}
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_deferred_rounding_diagnosis_names_the_fit_that_ran(tmp_path):
    """--gptq fitted after --auto_w8's search: a layer it re-rounded is not advised to try
    --gptq (the run used it); the advice says the fit chose its rounding."""
    model = _chain()
    res, _ = quantize_model(tmp_path, model, n=8, w_bits=4, auto_w8="sqnr:-50", sens_samples=4, gptq=True)
    fitted = {r["node"] for r in res.report["gptq"]["gain_db"]}
    rows = [d for d in res.report.get("diagnosis") or [] if d["node"] in fitted and d.get("cause") == "weights"]
    assert rows, "the 4-bit chain's fitted layers should be diagnosed as weight-limited"
    for d in rows:
        assert "fitted after --auto_w8's search" in d["advice"]
        assert "after --gptq chose its rounding" in d["advice"], d["advice"]
        assert "--gptq chooses the rounding" not in d["advice"], d["advice"]


@pytest.mark.parametrize("reader", ["conv0", "conv1"])
def test_layer_bits_on_either_reader_of_a_shared_weight_widens_it(tmp_path, caplog, reader):
    """Two Convs share one weight (one grid): --layer_bits READER=w8 on either of them gives it
    8-bit levels, with a warning that names both; only the first reader's width used to count,
    so naming the second did nothing (its weight stayed within -7..7)."""
    inits = {"w": rand((6, 6, 3, 3), 0, 0.3), "b": rand((6,), 1, 0.1)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("Conv", ["r0", "w", "b"], ["y"], name="conv1", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [vi("x", [1, 6, 8, 8])], [vi("y", [1, 6, 8, 8])], inits)
    with caplog.at_level(logging.WARNING):
        _, q = quantize_model(tmp_path, model, n=4, w_bits=4, layer_bits=[f"{reader}=w8"], deploy="qnn",
                              skip_prof_layer=True)
    assert np.abs(weight_ints(q, "w")).max() == 127
    assert "weight w is shared by conv0, conv1" in caplog.text and "8-bit for all of them" in caplog.text


def test_a_missed_target_names_the_weights_layer_bits_keeps_narrow(tmp_path, caplog):
    """--w_bits 4 --auto_w8 with conv2=w4 pinned: every candidate promoted, the loss left is the
    pinned layer's, and the warning sent the user to --auto_skip/--auto_a16 for activations
    (found by a flag-combination hunt)."""
    with caplog.at_level(logging.WARNING, logger="dipoorlet"):
        res, _ = quantize_model(tmp_path, _chain(3), n=6, w_bits=4, auto_w8="sqnr:200", sens_samples=4,
                                layer_bits=["conv2=w4"], deploy="qnn")
    said = [r.getMessage() for r in caplog.records if "auto_w8: target" in r.getMessage()]
    assert said and "the weights --layer_bits keeps narrow (conv2=w4)" in said[0], said
