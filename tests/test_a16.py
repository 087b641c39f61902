"""16-bit activations (W8A16, QNN's HTP mode for transformers and detectors): --a_bits 16 and
--layer_bits NODE=a16 on backends whose spec allows them (max_bits = 16)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import dipoorlet
from conftest import input_feeds, ort_run, save, tiny_cnn, write_samples
from dipoorlet.errors import ConfigError
from dipoorlet.platform import load, parse, platforms_dir, tomllib


def _run(tmp_path, model, deploy="qnn", n=6, **kw):
    path = save(model, tmp_path / "m.onnx")
    feeds = input_feeds(model, n, seed=3)
    data = write_samples(tmp_path / "data", feeds)
    out = tmp_path / f"out-{deploy}"
    res = dipoorlet.quantize(model=path, input_dir=data, data_num=n, deploy=deploy, output_dir=out,
                             skip_prof_layer=True, act_quant="minmax", **kw)
    return res, out, onnx.load(str(out / "quant_model.onnx")), feeds


def _zero_points(qm):
    return {t.name[:-len("_zero_point")]: numpy_helper.to_array(t) for t in qm.graph.initializer
            if t.name.endswith("_zero_point")}


def _with_output(qm, tensor):
    m = onnx.ModelProto()
    m.CopyFrom(qm)
    m.graph.output.append(onnx.helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, None))
    return m


def _cos(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_a16_on_qnn_gives_uint16_grids_in_onnxruntime_domain_and_matches_numpy(tmp_path):
    model = tiny_cnn()
    _, out, qm, feeds = _run(tmp_path, model, a_bits=16)
    onnx.checker.check_model(qm)
    acts = [n for n in qm.graph.node if n.op_type == "QuantizeLinear"]
    assert acts and all(n.domain == "com.microsoft" for n in acts)
    assert any(i.domain == "com.microsoft" for i in qm.opset_import)
    zps = _zero_points(qm)
    assert zps["x"].dtype == np.uint16 and zps["r1"].dtype == np.uint16
    assert zps["w1"].dtype == np.int8                      # weights stay 8-bit, standard DequantizeLinear
    weight_dq = next(n for n in qm.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "w1_quantized")
    assert weight_dq.domain == ""
    # the grid, against numpy: x_dq = (clip(round(x / s) + zp, 0, 65535) - zp) * s
    s = float(numpy_helper.to_array(next(t for t in qm.graph.initializer if t.name == "x_scale")))
    zp = float(zps["x"])
    for f in feeds[:2]:
        got = ort_run(_with_output(qm, "x_dq"), f)[-1]
        want = (np.clip(np.round(f["x"].astype(np.float32) / np.float32(s)) + zp, 0, 65535) - zp) * s
        np.testing.assert_allclose(got, want, rtol=0, atol=s * 1e-3)
    # the encodings state the 16-bit grid
    enc = json.loads((out / "qnn_encodings.json").read_text())
    x = enc["activation_encodings"]["x"][0]
    assert x["bitwidth"] == 16 and x["offset"] == -int(zp)
    assert x["min"] == pytest.approx(-zp * s, rel=1e-6) and x["max"] == pytest.approx((65535 - zp) * s, rel=1e-6)
    assert enc["quantizer_args"]["activation_bitwidth"] == 16


def test_a16_rounding_error_is_256x_finer_than_a8(tmp_path):
    # no weights: every error is activation rounding (inputs, the Add's output on qnn's integer
    # output), whose step shrinks 257x from 8 to 16 bits: mean square error ~66,000x lower
    from conftest import make_model, vi
    from onnx import helper
    model = make_model([helper.make_node("Add", ["x", "y"], ["s"], name="add"),
                        helper.make_node("Relu", ["s"], ["out"], name="relu")],
                       [vi("x", [1, 4, 8, 8]), vi("y", [1, 4, 8, 8])], [vi("out", [1, 4, 8, 8])])
    feeds = input_feeds(model, 6, seed=3)
    floats = [ort_run(model, f)[0] for f in feeds]
    err = {}
    for bits in (8, 16):
        _, _, qm, _ = _run(tmp_path / f"a{bits}", model, a_bits=bits)
        err[bits] = np.mean([np.mean((ort_run(qm, f)[0] - y) ** 2) for f, y in zip(feeds, floats)])
    assert 0 < err[16] < err[8] / 10000


def test_opset_21_model_uses_the_standard_domain(tmp_path):
    model = tiny_cnn(opset=21)
    model.ir_version = 10
    _, _, qm, feeds = _run(tmp_path, model, a_bits=16)
    acts = [n for n in qm.graph.node if n.op_type == "QuantizeLinear"]
    assert acts and all(n.domain == "" for n in acts)
    assert not any(i.domain == "com.microsoft" for i in qm.opset_import)
    assert _zero_points(qm)["x"].dtype == np.uint16
    assert _cos(ort_run(qm, feeds[0])[0], ort_run(model, feeds[0])[0]) > 0.999


def test_layer_bits_a16_widens_only_that_layers_inputs(tmp_path):
    _, _, qm, _ = _run(tmp_path, tiny_cnn(), layer_bits={"conv2": (None, 16)})
    zps = _zero_points(qm)
    assert zps["p1"].dtype == np.uint16          # conv2's input (also the residual Add's: one grid)
    assert zps["x"].dtype == np.uint8 and zps["r2"].dtype == np.uint8


def test_gptq_leaves_a16_layers_alone_with_the_reason(tmp_path):
    res, _, _, _ = _run(tmp_path, tiny_cnn(), a_bits=16, gptq=True)
    text = json.dumps(res.report)
    assert "16-bit grid" in text


def test_qop_keeps_16_bit_layers_as_qdq(tmp_path, caplog):
    with caplog.at_level("INFO", logger="dipoorlet"):
        _, out, qm, feeds = _run(tmp_path, tiny_cnn(), deploy="ort", a_bits=16, quant_format="QOP")
    assert not {n.op_type for n in qm.graph.node} & {"QLinearConv", "QGemm", "QLinearAdd"}
    assert any("read or write 16-bit grids and stay QDQ" in r.getMessage() and "conv1" in r.getMessage()
               for r in caplog.records)
    qdq = onnx.load(str(out / "quant_model_qdq.onnx"))
    np.testing.assert_allclose(ort_run(qm, feeds[0])[0], ort_run(qdq, feeds[0])[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("plat", ["trt", "atlas", "rk", "ti"])
def test_backends_without_16_bit_activations_refuse_a16(tmp_path, plat):
    with pytest.raises(ConfigError, match=f"{plat} runs at most 8-bit activations"):
        _run(tmp_path, tiny_cnn(), deploy=plat, a_bits=16)


def test_only_qnn_snpe_and_ort_ship_16_bit_activations():
    wide = {p.stem for p in platforms_dir().glob("*.toml") if load(p.stem).activation.max_bits == 16}
    assert wide == {"qnn", "snpe", "ort"}


def _spec(name):
    return tomllib.loads((platforms_dir() / f"{name}.toml").read_text())


@pytest.mark.parametrize("spec, section, key, value, text", [
    ("qnn", "weight", "bits", 16, r"\[weight\]: bits must be 2..8"),
    ("qnn", "weight", "max_bits", 16, "max_bits applies to activations only"),
    ("trt", "activation", "max_bits", 16, "deploy format 'trt' holds 8-bit activation ranges"),
    ("qnn", "activation", "max_bits", 12, "max_bits must be 8 or 16"),
])
def test_spec_rejects_16_bit_weights_and_a16_with_an_8_bit_format(spec, section, key, value, text):
    d = _spec(spec)
    d[section][key] = value
    with pytest.raises(ConfigError, match=text):
        parse(d, "chip.toml")


def test_spec_may_default_to_16_bit_activations():
    d = _spec("qnn")
    d["activation"]["bits"] = 16
    assert parse(d, "a16.toml").activation.bits == 16


def test_diagnosis_names_a16_where_the_backend_runs_it():
    from dipoorlet.diagnose import _advice
    row = {"node": "fc", "cause": "activations",
           "activations": [{"tensor": "x", "amax": 3.0, "bits": 8, "equalization": "off"}]}
    assert "--layer_bits fc=a16" in _advice(row, "qnn", max_act_bits=16)
    assert "a16" not in _advice(row, "trt", max_act_bits=8)
    row["activations"][0]["bits"] = 16            # already 16-bit: nothing wider to suggest
    assert "a16" not in _advice(row, "qnn", max_act_bits=16)


def test_auto_a16_promotes_the_chosen_layers_inputs_and_replans_their_biases(tmp_path):
    model = tiny_cnn()
    res, out, qm, feeds = _run(tmp_path / "auto", model, auto_a16="1.0", max_a16_layers=2, sens_samples=4)
    rep = res.report["auto_a16"]
    assert 1 <= len(rep["a16_layers"]) <= 2 and not rep["met"]
    assert rep["after_estimated"]["cosine"] > rep["before"]["cosine"]
    zps, nodes = _zero_points(qm), {n.name: n for n in qm.graph.node}
    wide = {t for t, z in zps.items() if z.dtype == np.uint16}
    assert res.report["qdq_tensors_16bit"] == len(wide)
    assert wide and any(z.dtype == np.uint8 for t, z in zps.items() if not t.startswith(("w", "b")))
    for layer in rep["a16_layers"]:              # every activation input of a promoted layer is 16-bit
        for i in nodes[layer].input:
            if i.endswith("_dq") and not i.startswith(("w", "b")):
                assert i[:-3] in wide, (layer, i)
    # every trial is listed in report.md (as the README says) and report.html, with its figures
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    section = md.split("## auto_a16")[1].split("\n## ")[0]
    for i, step in enumerate(rep["steps"]):
        assert f"| {i + 1} " in section and str(round(step["cosine"], 6)) in section
        assert f"<tr><td>{i + 1}</td><td>{step['a16_layers']}</td><td>{round(step['cosine'], 6)}</td>" in page
    scales = {t.name[:-6]: numpy_helper.to_array(t) for t in qm.graph.initializer if t.name.endswith("_scale")}
    for conv, x, w, b in (("conv1", "x", "w1", "b1"), ("conv2", "p1", "w2", "b2")):
        if conv in rep["a16_layers"]:            # its int32 bias on the 16-bit input's scale
            np.testing.assert_allclose(scales[b], scales[x] * scales[w], rtol=1e-6)
            assert x in wide
    # the same model as naming those layers by hand (--layer_bits NODE=a16)
    # (--auto_a16 turns the default bias correction off, as it would re-plan the biases it corrected)
    _, _, qm_hand, _ = _run(tmp_path / "hand", model, layer_bits={n: (None, 16) for n in rep["a16_layers"]},
                            bias_correction=False)
    for f in feeds:
        np.testing.assert_array_equal(ort_run(qm, f)[0], ort_run(qm_hand, f)[0])
    md = (out / "report.md").read_text()
    assert "auto_a16" in md and rep["a16_layers"][0] in md


@pytest.mark.parametrize("kw, text", [
    ({"deploy": "trt", "auto_a16": "0.99"}, "--auto_a16 asks for 16-bit activations, but trt"),
    ({"auto_a16": "0.99", "auto_skip": "0.99"}, "use one"),
    ({"auto_a16": "cos:0.9"}, "--auto_a16 criterion 'cos'"),
    ({"auto_a16": "0.99", "max_a16_layers": 0}, "--max_a16_layers must be a positive integer"),
])
def test_auto_a16_bad_settings(tmp_path, kw, text):
    with pytest.raises(ConfigError, match=text.replace("(", r"\(").replace("'", "'")):
        _run(tmp_path, tiny_cnn(), **kw)


def test_auto_a16_search_finds_the_smallest_prefix_in_few_trials():
    from types import SimpleNamespace
    from dipoorlet.sensitivity import LayerSensitivity, OutputScore, auto_a16

    nodes = [f"n{i}" for i in range(40)]
    # n0 is the most sensitive; every layer's inputs at 16 bits add 0.001 to the output cosine
    sens = [LayerSensitivity(n, "Conv", OutputScore(0.9 + 0.001 * i, 20.0, 0.0)) for i, n in enumerate(nodes)]
    calls = []

    class Scorer:
        def board(self, places, plan):
            return SimpleNamespace(owners=set(nodes)), None

        def score_variant(self, places, plan, acts, weights):
            assert set(weights) == set(nodes)                 # weights always quantized
            wide = [n for n in nodes if n not in set(acts)]
            assert wide == nodes[:len(wide)]                  # always a prefix of the ranking
            calls.append(len(wide))
            return OutputScore(0.98 + 0.001 * len(wide), 20.0, 0.0)

    places = SimpleNamespace(quantized_nodes=nodes)
    res = auto_a16(None, places, None, Scorer(), sens, "cosine", 0.9985, None)
    assert res.met and res.float_layers == nodes[:19]           # 0.98 + 0.019 >= 0.9985 > 0.98 + 0.018
    assert len(calls) <= 2 * 6 + 1
    capped = auto_a16(None, places, None, Scorer(), sens, "cosine", 0.9985, 8)
    assert not capped.met and capped.float_layers == nodes[:8]
    # a layer with an explicit --layer_bits NODE=aM is no candidate: the prefixes skip it
    nodes.remove("n1")
    fixed = auto_a16(None, places, None, Scorer(), sens, "cosine", 0.9985, 8, fixed={"n1"})
    assert "n1" not in fixed.float_layers and fixed.float_layers == nodes[:8]


def test_layer_bits_a16_covers_the_layers_quantized_network_output(tmp_path):
    from conftest import conv_model
    _, _, qm, _ = _run(tmp_path, conv_model(), layer_bits={"conv": (None, 16)})
    zps = _zero_points(qm)
    assert zps["x"].dtype == np.uint16 and zps["y"].dtype == np.uint16   # qnn quantizes the output in place


def test_auto_a16_keeps_an_explicit_layer_bits_setting(tmp_path):
    res, _, qm, _ = _run(tmp_path, tiny_cnn(), auto_a16="1.0", sens_samples=2, layer_bits={"conv1": (None, 4)})
    chosen = res.report["auto_a16"]["a16_layers"]
    assert chosen and "conv1" not in chosen    # an unreachable target: every layer chosen but the fixed one
    zps = _zero_points(qm)
    assert zps["x"].dtype == np.uint8                          # conv1's input stays on its 4-bit grid
    assert zps["r2"].dtype == np.uint16


def test_auto_a16_does_not_count_a_skipped_layers_layer_bits_as_kept(tmp_path, caplog):
    """--skip_layers conv1 --layer_bits conv1=a16: the log said the setting does nothing, then
    that 1 layer with an explicit activation width was not a candidate (found by a hunt)."""
    import logging

    with caplog.at_level(logging.INFO, logger="dipoorlet"):
        res, _, _, _ = _run(tmp_path, tiny_cnn(), auto_a16="1.0", max_a16_layers=1, sens_samples=2,
                            skip_layers=["conv1"], layer_bits={"conv1": (None, 16)})
    assert res.report["auto_a16"]["met"] is False
    missed = [r.getMessage() for r in caplog.records if "auto_a16: target" in r.getMessage()]
    assert missed and not any("explicit --layer_bits" in m for m in missed)


def test_16_bit_grids_keep_the_full_range_and_entropy_the_whole_range():
    from dipoorlet.platform import TensorRule
    from dipoorlet.qparams import levels
    from dipoorlet.ranges import RANGE_METHODS, RangeParams
    from conftest import stats_from
    assert levels(TensorRule(bits=16, symmetric=True, narrow_range=True)) == (-32768, 32767)
    assert levels(TensorRule(bits=8, symmetric=True, narrow_range=True)) == (-127, 127)
    x = np.random.default_rng(0).standard_t(2, 200_000).astype(np.float32)
    st = stats_from(x)
    lo, hi = RANGE_METHODS["entropy"](st, RangeParams(qmax=65535, quant_bins=2048))
    assert (lo, hi) == (st.minmax.lo, st.minmax.hi)


@pytest.mark.parametrize("kw, text", [
    ({"auto_a16": "0.99", "gptq": True}, "--auto_a16 with --gptq/--adaround/--brecq"),
    ({"auto_a16": "0.99", "sparse": "2:4"}, "--auto_a16 with --gptq/--adaround/--brecq"),
    ({"auto_a16": "0.99", "adaround": True}, "--auto_a16 with --gptq/--adaround/--brecq"),
    ({"auto_a16": "0.99", "bias_correction": True}, "--auto_a16 with --gptq/--adaround/--brecq"),
    # block reconstruction fits them too (--lsq the activation scales): it was let through
    ({"auto_a16": "0.99", "brecq": True}, "--auto_a16 with --gptq/--adaround/--brecq"),
    ({"auto_a16": "0.99", "drop": True}, "--auto_a16 with --gptq/--adaround/--brecq"),
    ({"auto_a16": "0.99", "lsq": True}, "--auto_a16 with --gptq/--adaround/--brecq"),
    ({"auto_a16": "sqnr:nan"}, "finite"),
])
def test_auto_a16_refused_combinations(tmp_path, kw, text):
    with pytest.raises(ConfigError, match=text):
        _run(tmp_path, tiny_cnn(), **kw)


def test_auto_a16_with_a_bits_16_skips_the_search(tmp_path, caplog):
    res, _, _, _ = _run(tmp_path, tiny_cnn(), auto_a16="0.99", a_bits=16, sens_samples=2)
    assert "auto_a16" not in res.report and "nothing to choose" in caplog.text


def test_auto_a16_on_a_shifting_backend_asks_for_no_shift(tmp_path):
    spec = (platforms_dir() / "trt.toml").read_text().replace('deploy = ["trt", "reference"]', 'deploy = ["reference"]')
    at = spec.index("[activation]") + len("[activation]")
    path = tmp_path / "sym16.toml"
    path.write_text(spec[:at] + "\nmax_bits = 16" + spec[at:])
    with pytest.raises(ConfigError, match="--no_shift"):
        _run(tmp_path, tiny_cnn(), deploy=str(path), auto_a16="0.99")
    res, _, qm, _ = _run(tmp_path / "ok", tiny_cnn(), deploy=str(path), auto_a16="1.0", shift=False, sens_samples=2)
    assert res.report["auto_a16"]["a16_layers"]
    assert any(z.dtype == np.int16 for z in _zero_points(qm).values())     # symmetric 16-bit grids


def test_a_narrower_width_lost_to_a_shared_grid_is_warned(tmp_path, caplog):
    """tiny_cnn's MaxPool shares one grid between its input and output on qnn: conv2=a8 under
    --a_bits 16 cannot hold for the pooled tensor alone, and the log says so."""
    with caplog.at_level("WARNING", logger="dipoorlet"):
        _, _, qm, _ = _run(tmp_path, tiny_cnn(), a_bits=16, layer_bits={"conv2": (None, 8)})
    assert _zero_points(qm)["p1"].dtype == np.uint16
    # p1's other reader, the residual Add, asked nothing, that is --a_bits' 16
    assert any("p1 is read by layers asking different activation widths" in r.getMessage()
               and "conv2: 8" in r.getMessage() and "(asked nothing)" in r.getMessage()
               and "16 bits" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="dipoorlet"):   # a16 asked for one member: no request lost
        _run(tmp_path / "b", tiny_cnn(), layer_bits={"conv2": (None, 16)})
    assert not any("share one grid" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("a_bits,asked,want", [(16, 8, np.uint16), (None, 4, np.uint8)])
def test_a_reader_that_asks_no_width_counts_at_the_default(tmp_path, caplog, a_bits, asked, want):
    """A tensor read by conv2 (which asks a width) and by the residual Add (which asks none):
    the Add asks for --a_bits or the backend's width. --a_bits 16 with conv2=a8 put both on 8
    bits without a word; conv2=a4 narrows the Add's input to 4 bits, and the log now says so."""
    kw = {"a_bits": a_bits} if a_bits else {}
    with caplog.at_level("WARNING", logger="dipoorlet"):
        _, _, qm, _ = _run(tmp_path, tiny_cnn(), layer_bits={"conv2": (None, asked)}, **kw)
    assert _zero_points(qm)["p1"].dtype == want
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("p1 is read by layers asking")]
    assert len(msgs) == 1 and f"conv2: {asked}" in msgs[0] and f"{a_bits or 8} (asked nothing)" in msgs[0]
    assert msgs[0].endswith(f"{16 if a_bits else asked} bits")
    if not a_bits:      # the MaxPool's input r1 shares p1's grid: narrowed below its own 8 bits
        shared = [r.getMessage() for r in caplog.records if "share one grid" in r.getMessage()]
        assert len(shared) == 1 and shared[0].startswith("--layer_bits: r1 share") and "not the 8 asked or their own" in shared[0]


def _two_layers(op):
    from onnx import helper
    from conftest import make_model, rand, vi
    if op == "Gemm":
        inits = {"w": rand((32, 16), 1, 0.3), "b": rand((32,), 2, 0.1), "w2": rand((8, 32), 3, 0.3)}
        first = helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc1", transB=1)
        second = helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc2", transB=1)
    elif op == "Gemm_alpha":       # untransposed but scaled: onnxruntime 1.32 does not fuse it
        inits = {"w": rand((16, 32), 1, 0.3), "b": rand((32,), 2, 0.1), "w2": rand((32, 8), 3, 0.3)}
        first = helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc1", alpha=0.5)
        second = helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc2", alpha=0.5)
    elif op == "Gemm_bias_1xN":    # a (1, N) bias: onnxruntime 1.32 leaves fc1 a Gemm, fuses fc2
        inits = {"w": rand((16, 32), 1, 0.3), "b": rand((1, 32), 2, 0.1), "w2": rand((32, 8), 3, 0.3)}
        first = helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc1")
        second = helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc2")
    elif op == "Gemm_transB0":     # W stored [K, N], as a MatMul's: onnxruntime fuses this one
        inits = {"w": rand((16, 32), 1, 0.3), "b": rand((32,), 2, 0.1), "w2": rand((32, 8), 3, 0.3)}
        first = helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc1")
        second = helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc2", transB=0)
    else:
        inits = {"w": rand((16, 32), 1, 0.3), "w2": rand((32, 8), 3, 0.3)}
        first = helper.make_node("MatMul", ["x", "w"], ["h"], name="fc1")
        second = helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")
    nodes = [first, helper.make_node("Relu", ["h"], ["r"], name="relu"), second]
    return make_model(nodes, [vi("x", [4, 16])], [vi("y", [4, 8])], inits, opset=17)


@pytest.mark.parametrize("op, deploy, warned", [("MatMul", "ort", True), ("Gemm", "ort", False),
                                                 ("Gemm_transB0", "ort", True), ("Gemm_alpha", "ort", False),
                                                 ("Gemm_bias_1xN", "ort", True),
                                                 ("MatMul", "qnn", False)])
def test_ort_warns_that_its_default_session_requantizes_16_bit_matmul_inputs(tmp_path, caplog, op, deploy, warned):
    import onnxruntime as ort

    with caplog.at_level("WARNING", logger="dipoorlet"):
        _run(tmp_path, _two_layers(op), deploy=deploy, a_bits=16)
    hits = [r.getMessage() for r in caplog.records if "MatMulNBits" in r.getMessage()]
    assert bool(hits) == warned
    if deploy == "ort":       # the oracle: what onnxruntime's default optimizations make of the model
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(str(tmp_path / "out-ort" / "quant_model.onnx"), so, providers=["CPUExecutionProvider"])
        fused = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node].count("MatMulNBits")
        assert fused == (int(hits[0].split()[0]) if hits else 0)     # "N MatMul/Gemm with 16-bit inputs"
    if warned:
        assert ("(fc2)" if op == "Gemm_bias_1xN" else "fc1, fc2") in hits[0]
        assert "session.qdq_matmulnbits_accuracy_level" in hits[0]


def test_an_explicit_width_lost_to_another_reader_is_warned(tmp_path, caplog):
    """p1 feeds conv2 and add2: asked a16 by one and a4 by the other, one grid serves both
    (16 bits) and the log names both requests."""
    with caplog.at_level("WARNING", logger="dipoorlet"):
        _, _, qm, _ = _run(tmp_path, tiny_cnn(), layer_bits={"conv2": (None, 16), "add2": (None, 4)})
    assert _zero_points(qm)["p1"].dtype == np.uint16
    msg = [r.getMessage() for r in caplog.records if "one grid serves" in r.getMessage()]
    assert msg and "conv2: 16" in msg[0] and "add2: 4" in msg[0] and msg[0].startswith("p1 ")


def test_auto_a16_missing_target_with_every_candidate_taken_points_at_the_weights(tmp_path, caplog):
    """All candidates but the explicitly set layer were taken: the advice is the weights', not a
    larger --max_a16_layers, and it says the fixed layer was no candidate."""
    with caplog.at_level("WARNING", logger="dipoorlet"):
        res, _, _, _ = _run(tmp_path, tiny_cnn(), auto_a16="1.0", sens_samples=2, layer_bits={"conv1": (None, 8)})
    text = "\n".join(r.getMessage() for r in caplog.records if "auto_a16: target" in r.getMessage())
    assert "not met" in text and "weights' rounding" in text and "max_a16_layers" not in text
    assert "1 layers with an explicit --layer_bits activation width were not candidates" in text
    # bias correction, off during the search, runs when the chosen layers are given as --layer_bits
    assert "bias correction, which the search turns off, runs by default" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="dipoorlet"):
        _run(tmp_path / "nobc", tiny_cnn(), auto_a16="1.0", sens_samples=2, layer_bits={"conv1": (None, 8)},
             no_bc=True)
    text = "\n".join(r.getMessage() for r in caplog.records if "auto_a16: target" in r.getMessage())
    assert "weights' rounding" in text and "bias correction" not in text


def test_auto_a16_measures_the_model_as_written(tmp_path, caplog, monkeypatch):
    """The search scores the chosen layers' inputs float; the written 16-bit grids are measured
    again on the same samples, and a target the written model misses is reported as not met."""
    from dipoorlet import sensitivity
    real = sensitivity.auto_a16

    def claims_met(*args, **kw):
        res = real(*args, **kw)
        res.float_layers, res.met = ["conv2"], True     # as if the estimate had met the target
        res.after = sensitivity.OutputScore(1.0, float("inf"), 0.0)
        return res
    monkeypatch.setattr(sensitivity, "auto_a16", claims_met)
    with caplog.at_level("WARNING", logger="dipoorlet"):
        res, _, qm, _ = _run(tmp_path, tiny_cnn(), auto_a16="1.0", sens_samples=2)
    rep = res.report["auto_a16"]
    assert rep["met"] is False and rep["after_measured"]["cosine"] < 1.0
    assert any("the model as written reads" in r.getMessage() for r in caplog.records)
    assert _zero_points(qm)["p1"].dtype == np.uint16     # conv2's input was still promoted


def test_auto_skip_missing_its_target_is_warned(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="dipoorlet"):
        res, _, _, _ = _run(tmp_path, tiny_cnn(), deploy="trt", auto_skip="1.0", max_float_layers=1, sens_samples=2)
    assert res.report["auto_skip"]["met"] is False
    assert any("auto_skip: target cosine 1.0 not met" in r.getMessage() for r in caplog.records)


def test_auto_a16_trials_run_the_16_bit_grids_the_written_model_has(tmp_path):
    """A trial switches the chosen layers' inputs onto their 16-bit grids (not float): on a chain
    whose every input has one reader and float biases, the search's final estimate is what the
    written model measures on the same samples."""
    from onnx import helper

    from conftest import make_model, rand, vi
    spec = (platforms_dir() / "trt.toml").read_text().replace('deploy = ["trt", "reference"]', 'deploy = ["reference"]')
    at = spec.index("[activation]") + len("[activation]")
    path = tmp_path / "sym16.toml"
    path.write_text(spec[:at] + "\nmax_bits = 16" + spec[at:])
    inits = {f"w{i}": rand((4, 4, 3, 3), i, 0.4) for i in range(3)}
    nodes = []
    src = "x"
    for i in range(3):
        nodes += [helper.make_node("Conv", [src, f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        src = f"r{i}"
    model = make_model(nodes, [vi("x", [1, 4, 8, 8])], [vi("r2", [1, 4, 8, 8])], inits)
    res, _, qm, _ = _run(tmp_path / "run", model, deploy=str(path), auto_a16="cosine:0.99999", shift=False,
                         sens_samples=6)
    a = res.report["auto_a16"]
    assert a["a16_layers"] and a["steps"]
    assert a["after_measured"]["cosine"] == pytest.approx(a["after_estimated"]["cosine"], abs=1e-6)
    assert a["after_measured"]["sqnr_db"] == pytest.approx(a["after_estimated"]["sqnr_db"], abs=1e-3)


def test_auto_a16_met_is_decided_by_the_written_model_both_ways(tmp_path, monkeypatch):
    """One grid serves every reader in the written model, so it can also score above the search's
    trials: a target the search missed but the written model meets is reported as met."""
    from dipoorlet import sensitivity
    real = sensitivity.auto_a16

    def claims_missed(*args, **kw):
        res = real(*args, **kw)
        res.float_layers, res.met = ["conv1", "conv2"], False
        res.after = sensitivity.OutputScore(0.0, float("-inf"), 1.0)
        return res
    monkeypatch.setattr(sensitivity, "auto_a16", claims_missed)
    res, _, _, _ = _run(tmp_path, tiny_cnn(), auto_a16="0.5", sens_samples=2)
    rep = res.report["auto_a16"]
    assert rep["after_measured"]["cosine"] >= 0.5 and rep["met"] is True


@pytest.mark.parametrize("flags", [{"gptq": True}, {"adaround": True}, {"gptq": True, "no_bc": True}])
def test_a_fitted_rounding_with_no_layer_to_fit_leaves_bias_correction_on(tmp_path, caplog, flags):
    # every input on a 16-bit grid: --gptq/--adaround fit nothing, and they had silently turned
    # bias correction off (W4A16 on qnn: 39.5 dB with it, 33.6 dB without)
    with caplog.at_level("WARNING", logger="dipoorlet"):
        res, _, _, _ = _run(tmp_path, tiny_cnn(), a_bits=16, w_bits=4, **flags)
    method = "adaround" if "adaround" in flags else "gptq"
    assert res.report[method]["layers"] == 0
    assert any(r.getMessage().startswith(f"{method}: no layer can be fitted") for r in caplog.records)
    if "no_bc" in flags:
        assert "bias_correction" not in res.report
    else:
        assert res.report["bias_correction"]["layers"] > 0


def test_a_width_on_a_layer_owning_no_activation_is_named_and_no_search_candidate(tmp_path, caplog):
    # qnn fuses relu1 into conv1: relu1 is quantized but owns no grid. Its a-width did nothing
    # without a word, and --auto_a16 spent trials on such layers and counted them as 16-bit
    caplog.set_level("WARNING", logger="dipoorlet")
    _, _, qm, _ = _run(tmp_path / "bits", tiny_cnn(), layer_bits={"relu1": (None, 4)})
    assert "--layer_bits relu1: owns no quantized activation" in caplog.text
    res, _, _, _ = _run(tmp_path / "search", tiny_cnn(), auto_a16="sqnr:200", sens_samples=4)
    a = res.report["auto_a16"]
    owners = {"conv1", "conv2", "add2", "gap", "fc", "pool1"}
    assert "relu1" not in a["a16_layers"] and "relu2" not in a["a16_layers"]
    assert set(a["a16_layers"]) <= owners | {"flatten"}


def test_auto_a16_missing_target_through_clipping_says_so(tmp_path, caplog):
    """Every candidate on 16 bits, the target still missed because the sensitivity samples
    (--val_dir, 4x the calibration data) reach beyond the calibrated ranges: the advice had
    named the weights' rounding (--gptq cannot help); it now weighs the weights alone and names
    the clipping (found by a bug hunt)."""
    model = tiny_cnn()
    path = save(model, tmp_path / "m.onnx")
    feeds = input_feeds(model, 6, seed=3)
    data = write_samples(tmp_path / "data", feeds)
    val = write_samples(tmp_path / "val", [{k: v * 4 for k, v in f.items()} for f in feeds])
    with caplog.at_level("WARNING", logger="dipoorlet"):
        res = dipoorlet.quantize(model=path, input_dir=data, data_num=6, deploy="qnn", output_dir=tmp_path / "out",
                                 skip_prof_layer=True, act_quant="minmax", auto_a16="sqnr:25", val_dir=val,
                                 sens_samples=6)
    assert not res.report["auto_a16"]["met"]
    text = "\n".join(r.getMessage() for r in caplog.records if "auto_a16: target" in r.getMessage())
    # every layer tried, none kept (they scored below none): not "a larger --max_a16_layers"
    assert "activations' clipping, not the weights" in text and "--gptq" not in text, text
    assert "max_a16_layers" not in text


def test_auto_a16_report_gives_the_written_models_figure_with_its_verdict(tmp_path, monkeypatch):
    """report.md/html said "met, estimated by the search" beside the search's figure, while the
    verdict is the written model's (the hunt's case: 31.86 dB estimated, 32.19 measured, target
    32): they now show the written model's figure, and the estimate beside it."""
    from dipoorlet import sensitivity
    real = sensitivity.auto_a16

    def claims(*args, **kw):
        res = real(*args, **kw)
        res.float_layers, res.met = ["conv2"], True
        res.after = sensitivity.OutputScore(0.5, 3.0, 1.0)      # an estimate unlike the measurement
        return res
    monkeypatch.setattr(sensitivity, "auto_a16", claims)
    res, out, _, _ = _run(tmp_path, tiny_cnn(), auto_a16="0.5", sens_samples=2)
    a = res.report["auto_a16"]
    assert a["met"] and a["after_measured"]["sqnr_db"] != a["after_estimated"]["sqnr_db"]
    md = (out / "report.md").read_text()
    assert "(met, as written)" in md
    assert f"{a['before']['sqnr_db']} → {a['after_measured']['sqnr_db']} dB" in md
    assert f"the search estimated {a['after_estimated']['cosine']} / {a['after_estimated']['sqnr_db']} dB" in md
    html = (out / "report.html").read_text()
    assert "(as written)" in html and f"the search estimated {a['after_estimated']['cosine']}" in html


def test_auto_a16_whose_target_the_8_bit_model_meets_reports_it_as_written(tmp_path):
    """No layer kept: the written model is the baseline the search measured; report.md and
    report.html called its figure "estimated by the search" (found by a bug hunt)."""
    res, out, _, _ = _run(tmp_path, tiny_cnn(), auto_a16="0.5", sens_samples=4)
    rep = res.report["auto_a16"]
    assert rep["a16_layers"] == [] and rep["met"]
    assert rep["after_measured"] == rep["before"]
    assert ", as written" in (out / "report.md").read_text().split("## auto_a16")[1].split("\n## ")[0]
    assert "(as written)" in (out / "report.html").read_text()


def test_qop_does_not_list_a_float_layer_among_the_16_bit_ones(tmp_path, caplog):
    """--skip_layers keeps conv2 float; its output's 16-bit grid had put it among the ops that
    "read or write 16-bit grids and stay QDQ", which it is not: it reads no Q/DQ, and no QLinear op
    would replace it (nor relu1, which writes a grid but reads conv1's float output; found by a hunt)."""
    with caplog.at_level("INFO", logger="dipoorlet"):
        _run(tmp_path, tiny_cnn(), deploy="qnn", a_bits=16, quant_format="QOP", skip_layers=["conv2"])
    said = [r.getMessage() for r in caplog.records if "read or write 16-bit grids and stay QDQ" in r.getMessage()]
    assert len(said) == 1 and "conv1" in said[0], said
    assert "conv2" not in said[0] and "relu1" not in said[0], said
