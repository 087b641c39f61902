"""Every shipped platform end to end, the rules each one imposes, QOperator output, user specs."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from conftest import KERNEL_COS, input_feeds, ort_run, save, tiny_cnn, write_samples
import dipoorlet
from dipoorlet import platform as platforms
from dipoorlet.cli import main
from dipoorlet.errors import ConfigError

SIDE_FILES = {
    "trt": ["trt_clip_val.json", "trt_calib.cache"], "snpe": ["snpe_encodings.json"],
    "qnn": ["qnn_encodings.json"], "rv": ["rv_quantized_param.yaml", "rv_quantized_param.json"],
    "rk": ["rk_quantized_param.yaml", "rk_quantized_param.json"], "atlas": ["atlas_quant_param.json"],
    "ti": ["ti_blob_range.txt", "ti_blob_range.json"], "imx": ["imx_scale.json"],
    "magicmind": ["magicmind_quant_param.json"], "stpu": ["stpu_minmax.json"], "ort": [],
}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("plat")
    model = save(tiny_cnn(), root / "m.onnx")
    feeds = input_feeds(tiny_cnn(), 6, seed=2)
    data = write_samples(root / "data", feeds)
    return root, model, data, feeds


def run(case, plat, **kw):
    root, model, data, _ = case
    out = root / f"out-{plat}-{'-'.join(f'{k}{v}' for k, v in kw.items())}"
    res = dipoorlet.quantize(model=model, input_dir=data, data_num=6, deploy=plat, output_dir=out,
                             skip_prof_layer=True, **kw)
    return res, out, onnx.load(str(out / "quant_model.onnx"))


def scales(qm):
    return {t.name[:-6]: numpy_helper.to_array(t) for t in qm.graph.initializer if t.name.endswith("_scale")}


def test_every_shipped_platform_is_listed():
    assert set(platforms.available()) == set(SIDE_FILES)


@pytest.mark.parametrize("plat", sorted(SIDE_FILES))
def test_platform_runs_writes_its_files_and_keeps_the_output(case, plat):
    res, out, qm = run(case, plat)
    onnx.checker.check_model(qm)
    for f in SIDE_FILES[plat] + ["quant_model.onnx", "act_clip_val.json", "report.json"]:
        assert (out / f).is_file(), f
    assert res.report["outputs"][0]["cosine"] > 0.99
    # the quantized model runs in onnxruntime with the float model's output names
    assert [o.name for o in qm.graph.output] == ["logits"]


@pytest.mark.parametrize("plat", ["ti", "imx"])
def test_power_of_two_platforms_use_power_of_two_scales(case, plat):
    _, _, qm = run(case, plat)
    acts = [v for k, v in scales(qm).items() if not k.startswith(("w", "b"))]
    assert acts
    for s in acts:
        assert np.allclose(np.log2(s), np.round(np.log2(s)))


@pytest.mark.parametrize("plat, method, step", [("imx", "mse", 2.0 ** -5), ("ti", "mse", 2.0 ** -5),
                                                  ("imx", "minmax", 2.0 ** -4), ("imx", "hist", 2.0 ** -4)])
def test_power_of_two_step_of_mse_is_the_best_power_of_two(tmp_path, plat, method, step):
    """A Conv input of normal values with three at +-4.5: -A mse's own clip (~4.46) needs a step
    just over 2^-5, and rounding it up (the earlier rule) gives 2^-4; the step with the least
    error on the data is 2^-5 (clipping the three to 3.97; numpy oracle below), which -A mse now
    takes. minmax and hist keep their clip covered (2^-4)."""
    from conftest import conv_model, stats_from
    from dipoorlet.ranges import RangeParams, mse

    x = np.random.default_rng(4).standard_normal((8, 1, 3, 16, 16)).astype(np.float32)
    x.reshape(-1)[[5, 700, 3000]] = [4.5, -4.5, 4.5]
    top = 2.0 ** np.ceil(np.log2(np.abs(x).max() / 127))
    err = {s: np.mean((x - np.clip(np.rint(x / s), -127, 127) * s) ** 2) for s in (top, top / 2, top / 4)}
    assert top == 2.0 ** -4 and min(err, key=err.get) == 2.0 ** -5
    lo, hi = mse(stats_from(x), RangeParams(qmax=127))
    assert max(-lo, hi) > 127 * 2.0 ** -5                 # rounded up to a power of two: 2^-4
    data = write_samples(tmp_path / "data", [{"x": v} for v in x])
    out = tmp_path / "out"
    dipoorlet.quantize(model=save(conv_model(hw=16), tmp_path / "m.onnx"), input_dir=data, data_num=8,
                       deploy=plat, output_dir=out, act_quant=method, skip_prof_layer=True, bias_correction=False)
    assert float(scales(onnx.load(str(out / "quant_model.onnx")))["x"]) == step


def test_ti_uses_the_unsigned_grid_for_non_negative_tensors(case):
    _, _, qm = run(case, "ti")
    zps = {t.name[:-11]: numpy_helper.to_array(t) for t in qm.graph.initializer if t.name.endswith("_zero_point")}
    assert zps["p1"].dtype == np.uint8 and int(zps["p1"]) == 0     # MaxPool of a ReLU: never negative
    assert zps["x"].dtype == np.int8                                 # the network input is signed


@pytest.mark.parametrize("plat", ["snpe", "rv", "qnn", "imx", "rk"])
def test_platforms_with_integer_outputs_quantize_the_network_output(case, plat):
    _, _, qm = run(case, plat)
    last = next(n for n in qm.graph.node if "logits" in n.output)
    assert last.op_type == "DequantizeLinear"


@pytest.mark.parametrize("plat", ["snpe", "rv"])
def test_asymmetric_uint8_platforms(case, plat):
    _, _, qm = run(case, plat)
    zp = numpy_helper.to_array(next(t for t in qm.graph.initializer if t.name == "x_zero_point"))
    assert zp.dtype == np.uint8 and 0 < int(zp) < 255


def test_int32_biases_where_the_platform_asks(case):
    _, _, qm = run(case, "qnn")
    b1 = numpy_helper.to_array(next(t for t in qm.graph.initializer if t.name == "b1_quantized"))
    assert b1.dtype == np.int32
    s = scales(qm)
    assert np.allclose(s["b1"], s["x"] * s["w1"], rtol=1e-6)


def test_maxpool_shares_its_input_grid(case):
    _, _, qm = run(case, "snpe")
    s = scales(qm)
    assert "r1" in s and "p1" in s and np.array_equal(s["r1"], s["p1"])


def test_qop_model_runs_is_smaller_and_agrees_with_qdq(case):
    root, model, data, feeds = case
    out = root / "qop"
    dipoorlet.quantize(model=model, input_dir=data, data_num=6, deploy="ort", output_dir=out,
                       quant_format="QOP", skip_prof_layer=True)
    qop, qdq = onnx.load(str(out / "quant_model.onnx")), onnx.load(str(out / "quant_model_qdq.onnx"))
    ops = {n.op_type for n in qop.graph.node}
    assert {"QLinearConv", "QGemm"} & ops, ops
    assert os.path.getsize(out / "quant_model.onnx") < os.path.getsize(out / "quant_model_qdq.onnx")
    for f in feeds:
        # the oracle is onnxruntime running the QDQ model in its own integer kernels (it fuses
        # Q/DQ pairs into QLinearConv/QGemm): the same arithmetic on any CPU. Against the
        # simulated QDQ model the integer kernels differ by more than rounding on processors
        # without VNNI (u8 x s8 pairs saturate at 16 bits; 7% of the output on an AVX2-only EPYC)
        a, b = ort_run(qop, f, optimize=True)[0], ort_run(qdq, f, optimize=True)[0]
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max())
        assert _cos(a, ort_run(qdq, f)[0]) > KERNEL_COS       # and near the simulated model


def _cos(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("plat", ["trt", "imx", "stpu", "ti", "qnn", "snpe", "rk", "atlas"])
def test_qop_model_runs_and_agrees_with_qdq_on_every_integer_layout(case, plat):
    # int8 symmetric grids (trt/imx/stpu): a Relu must not be folded into a QLinear op whose
    # output grid has zero mid-range; ti mixes int8 and uint8 grids, which no kernel takes
    root, model, data, feeds = case
    out = root / f"qop-{plat}"
    dipoorlet.quantize(model=model, input_dir=data, data_num=6, deploy=plat, output_dir=out,
                       quant_format="QOP", skip_prof_layer=True)
    qop, qdq = onnx.load(str(out / "quant_model.onnx")), onnx.load(str(out / "quant_model_qdq.onnx"))
    for f in feeds:
        b = ort_run(qdq, f)[0]
        for optimize in (False, True):
            assert _cos(ort_run(qop, f, optimize=optimize)[0], b) > 0.99


def _gemm_model(alpha, beta, matmul_rank=2):
    from conftest import make_model, rand, vi
    from onnx import helper

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Flatten", ["r1"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["h"], name="fc", transB=1, alpha=alpha, beta=beta),
             helper.make_node("Relu", ["h"], ["hr"], name="relu2"),
             helper.make_node("MatMul", ["hr" if matmul_rank == 2 else "h3", "wm"], ["y"], name="mm")]
    if matmul_rank > 2:
        nodes.insert(-1, helper.make_node("Reshape", ["hr", "shape"], ["h3"], name="reshape"))
    wm_shape = (1,) * (matmul_rank - 2) + (16, 8)
    inits = {"w1": rand((4, 3, 3, 3), 1, 0.3), "b1": rand((4,), 2, 0.1), "wf": rand((16, 64), 3, 0.1),
             "bf": rand((16,), 4, 0.1), "wm": rand(wm_shape, 5, 0.3)}
    if matmul_rank > 2:
        inits["shape"] = np.array([1] * (matmul_rank - 1) + [16], np.int64)
    out_shape = [1] * (matmul_rank - 1) + [8]
    return make_model(nodes, [vi("x", [1, 3, 4, 4])], [vi("y", out_shape)], inits)


@pytest.mark.parametrize("plat", ["ort", "qnn", "trt"])
@pytest.mark.parametrize("alpha, beta, rank", [(1.0, 1.0, 2), (0.5, 2.0, 2), (1.0, 1.0, 3)])
def test_qop_with_gemm_alpha_beta_and_batched_matmul_weights(tmp_path, plat, alpha, beta, rank):
    # torch exports nn.Linear as Gemm(alpha=1, beta=1, transB=1); QGemm has no beta; onnxruntime's
    # QLinearMatMul takes grids of a 2-D weight only
    model = _gemm_model(alpha, beta, rank)
    feeds = input_feeds(model, 6, seed=3)
    data = write_samples(tmp_path / "data", feeds)
    out = tmp_path / "out"
    dipoorlet.quantize(model=save(model, tmp_path / "m.onnx"), input_dir=data, data_num=6, deploy=plat,
                       output_dir=out, quant_format="QOP", skip_prof_layer=True)
    qop, qdq = onnx.load(str(out / "quant_model.onnx")), onnx.load(str(out / "quant_model_qdq.onnx"))
    ops = {n.op_type for n in qop.graph.node}
    if plat == "ort" and rank == 2:   # a plain Gemm is converted; one with alpha or beta stays QDQ
        assert ("QGemm" in ops) == (alpha == beta == 1.0), ops
    for f in feeds:
        ref = ort_run(model, f)[0]
        b = ort_run(qdq, f)[0]
        assert _cos(b, ref) > 0.99
        # both files run in onnxruntime with its optimizations too (its QDQ fusions), except a
        # per-column grid on a batched MatMul weight, which only -D ort avoids for that reason
        fused = plat == "ort" or rank == 2
        if fused:
            assert _cos(ort_run(qdq, f, optimize=True)[0], b) > KERNEL_COS
        for optimize in (False, True) if fused else (False,):
            assert _cos(ort_run(qop, f, optimize=optimize)[0], b) > KERNEL_COS


@pytest.mark.parametrize("batched", [True, False])
def test_batched_matmul_weight_a_default_session_rejects_is_named(tmp_path, caplog, batched):
    # trt keeps per-column grids on a rank-3 MatMul weight; onnxruntime's optimizer fuses that
    # MatMul into MatMulIntegerToFloat, whose kernel rejects them at run time: the log says how to
    # run the file, and the spec key it names gives one grid per weight, which a default session runs
    model = _gemm_model(1.0, 1.0, 3)
    feeds = input_feeds(model, 4, seed=5)
    data = write_samples(tmp_path / "data", feeds)
    spec = "trt"
    if not batched:
        spec = tmp_path / "trt_flat.toml"
        spec.write_text((platforms.platforms_dir() / "trt.toml").read_text()
                        .replace("[weight]\n", "[weight]\nper_channel_batched = false\n", 1))
    caplog.set_level("WARNING", logger="dipoorlet")
    out = tmp_path / "out"
    dipoorlet.quantize(model=save(model, tmp_path / "m.onnx"), input_dir=data, data_num=4, deploy=str(spec),
                       output_dir=out, skip_prof_layer=True)
    warned = "MatMul mm: its weight of rank > 2 has per-column grids" in caplog.text
    qdq = onnx.load(str(out / "quant_model.onnx"))
    try:
        ort_run(qdq, feeds[0], optimize=True)
        default_runs = True
    except Exception:  # noqa: BLE001 - onnxruntime's own error types
        default_runs = False
    assert warned == (not default_runs) == batched, (warned, default_runs)
    assert "per_channel_batched = false" in caplog.text or not batched
    ref = ort_run(model, feeds[0])[0]
    assert _cos(ort_run(qdq, feeds[0])[0], ref) > 0.99


def test_user_spec_from_a_path(case, tmp_path):
    src = (platforms.platforms_dir() / "trt.toml").read_text().replace('name = "trt"', 'name = "mychip"')
    spec = tmp_path / "mychip.toml"
    spec.write_text(src)
    res, _, _ = run(case, str(spec))
    assert res.report["platform"] == "mychip"


@pytest.mark.parametrize("edit,needle", [
    (lambda s: s.replace("bits = 8\nsymmetric = true\nunsigned", "bitz = 8\nsymmetric = true\nunsigned", 1), "bitz"),
    (lambda s: s.replace("bits = 8", "bits = 0", 1), "bits must be 2..8"),
    (lambda s: s.replace('deploy = ["trt", "reference"]', 'deploy = ["nope"]'), "deploy format 'nope'"),
    (lambda s: s.replace("[bias]\nquantize = false", "[bias]\nquantize = \"no\""), "'quantize' must be bool"),
    (lambda s: s.replace('name = "trt"\n', ""), "missing key 'name'"),
    (lambda s: s + "\n[extra]\n", "unknown key(s) ['extra']"),
    (lambda s: s.replace("quantize_network_output = false", 'quantize_network_output = "false"'),
     "'quantize_network_output' must be bool"),
    (lambda s: s.replace("[weight]\n", "[weight]\nquantize_network_output = true\n"), "belongs in [activation]"),
    (lambda s: s.replace("[activation]\n", "[activation]\nper_channel = true\n"), "per_channel applies to weights"),
    (lambda s: s.replace('deploy = ["trt", "reference"]', 'deploy = [["trt"]]'), "deploy format ['trt']"),
    (lambda s: s.replace("weights = { Conv = 1,", "weights = { Conv = 3,"), "weights Conv = 3, but Conv has inputs 0..2"),
    (lambda s: s.replace("weights = { Conv = 1,", "weights = { Cnv = 1,"), "'Cnv' is not an ONNX op type"),
    (lambda s: s.replace("weights = { Conv = 1,", "weights = { LinearRegressor = 0, Conv = 1,"),
     "LinearRegressor: not an op of the default ONNX domain"),
    (lambda s: s.replace("weights = { Conv = 1,", "weights = { Conv = 2,"), "weights Conv = 2 names its bias"),
    # op names in the fusion lists and share_scale: a typo silently moved Q/DQ (found by a bug hunt)
    (lambda s: s.replace('pad_into = ["Conv"', 'pad_into = ["conv"'),
     "[fusion] pad_into: 'conv' (did you mean 'Conv'?)"),
    (lambda s: s.replace('residual_add_producers = ["Conv"', 'residual_add_producers = ["conv"'),
     "[fusion] residual_add_producers: 'conv' (did you mean 'Conv'?)"),
    (lambda s: s.replace('residual_add_float_before = ["LayerNormalization"]', 'residual_add_float_before = ["LayerNorm"]'),
     "[fusion] residual_add_float_before: 'LayerNorm' is not an ONNX op type"),
    (lambda s: s.replace("[fusion]", 'share_scale = ["Maxpool"]\n\n[fusion]'),
     "[ops] share_scale: 'Maxpool' (did you mean 'MaxPool'?)"),
])
def test_bad_user_spec_names_the_key(tmp_path, edit, needle):
    spec = tmp_path / "bad.toml"
    spec.write_text(edit((platforms.platforms_dir() / "trt.toml").read_text()))
    with pytest.raises(ConfigError) as exc:
        platforms.load(str(spec))
    assert needle in str(exc.value) and "bad.toml" in str(exc.value)


def test_user_spec_naming_an_activation_as_conv_weight_says_so(case, tmp_path, caplog):
    src = (platforms.platforms_dir() / "trt.toml").read_text().replace("weights = { Conv = 1,", "weights = { Conv = 0,")
    spec = tmp_path / "mychip.toml"
    spec.write_text(src.replace('name = "trt"', 'name = "mychip"'))
    caplog.set_level("WARNING", logger="dipoorlet")
    res, _, _ = run(case, str(spec))
    assert caplog.text.count("give Conv input 0 as the weight") == 1 and "weights = { Conv = 1 }" in caplog.text
    caplog.clear()
    run(case, "trt")
    assert "as the weight" not in caplog.text


def test_unknown_platform_lists_the_valid_names(case, capsys):
    root, model, data, _ = case
    rc = main(["-M", str(model), "-I", str(data), "-N", "2", "-D", "tpu9000", "-O", str(root / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "tpu9000" in err and "snpe" in err and "rk" in err


def test_ops_a_platform_cannot_quantize_stay_float_with_a_reason(case):
    res, _, _ = run(case, "atlas")  # atlas quantizes Conv/Gemm/AveragePool only
    reasons = {d["node"]: d for d in res.report["decisions"]}
    assert not reasons["pool1"]["quantized"] and "not quantized on atlas" in reasons["pool1"]["reason"]
    assert reasons["conv1"]["quantized"]


def test_narrow_range_8_bit_activations_never_reach_minus_128(case, tmp_path):
    """An 8-bit activation grid of [-127, 127] (narrow_range) needs the Clip between Q and DQ as
    lower bit widths do; QuantizeLinear alone would produce -128."""
    src = (platforms.platforms_dir() / "trt.toml").read_text()
    act, rest = src.split("[weight]", 1)
    spec = tmp_path / "narrow.toml"
    spec.write_text(act.replace("unsigned = false", "unsigned = false\nnarrow_range = true", 1) + "[weight]" + rest)
    res, out, qm = run(case, str(spec))
    clips = [n for n in qm.graph.node if n.op_type == "Clip" and n.input[0].endswith("_q")]
    assert clips
    lo = next(t for t in qm.graph.initializer if t.name == clips[0].input[1])
    assert int(numpy_helper.to_array(lo)) == -127


def test_qop_op_that_onnxruntime_rejects_stays_qdq(case, monkeypatch):
    # the conversion is checked in onnxruntime: a converted op it cannot load is left QDQ
    from onnx import helper

    from dipoorlet import qop

    root, model, data, feeds = case
    qdq = onnx.load(str(run(case, "ort")[1] / "quant_model.onnx"))
    real = qop.convert

    def broken(m, exclude=(), origin=None):
        out, n = real(m, exclude, origin)
        for node in out.graph.node:
            if node.name == "conv2_quant":
                node.attribute.append(helper.make_attribute("bogus", 1))
        return out, n

    monkeypatch.setattr(qop, "convert", broken)
    out, converted, excluded, cos, fused_error = qop.convert_checked(qdq, feeds[0])
    assert excluded == ["conv2"] and converted >= 1 and cos > 0.99 and fused_error is None
    assert "conv2_quant" not in {n.name for n in out.graph.node}
    assert {"QLinearConv", "QGemm"} & {n.op_type for n in out.graph.node}


def test_qop_check_compares_float_outputs_only(monkeypatch):
    # an int64 output (class ids) is not a signal to score by cosine
    from onnx import TensorProto, helper

    from dipoorlet import qop

    def model(k):
        nodes = [helper.make_node("Identity", ["x"], ["y"], name="id"),
                 helper.make_node("Constant", [], ["cls"], name="c",
                                  value=numpy_helper.from_array(np.array([k], np.int64)))]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4]),
                               helper.make_tensor_value_info("cls", TensorProto.INT64, [1])])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
        m.ir_version = 8
        return m

    monkeypatch.setattr(qop, "convert", lambda m, exclude=(), origin=None: (model(0), 0))
    _, _, _, cos, fused_error = qop.convert_checked(model(1), {"x": np.ones((1, 4), np.float32)})
    assert cos == 1.0 and fused_error is None


def test_qop_that_cannot_run_at_all_leaves_the_qdq_model(case, monkeypatch, caplog):
    from dipoorlet import qop

    def fail(model, feed, max_tries=50):
        raise RuntimeError("the QOP model does not run in onnxruntime: no kernel")

    monkeypatch.setattr(qop, "convert_checked", fail)
    root, model, data, feeds = case
    out = root / "qop-fallback"
    dipoorlet.quantize(model=model, input_dir=data, data_num=6, deploy="ort", output_dir=out,
                       quant_format="QOP", skip_prof_layer=True)
    a, b = onnx.load(str(out / "quant_model.onnx")), onnx.load(str(out / "quant_model_qdq.onnx"))
    assert a.SerializeToString() == b.SerializeToString()
    assert "quant_model.onnx is the QDQ model" in caplog.text


def _layer_dequantizers(out, node_name):
    """quant_model.onnx in ``out``: (model, initializers as arrays, the DequantizeLinear nodes
    feeding the layer's input, weight and bias)."""
    qm = onnx.load(str(out / "quant_model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in qm.graph.initializer}
    layer = next(n for n in qm.graph.node if n.name == node_name)
    dqs = tuple(next(n for n in qm.graph.node if n.output[0] == layer.input[i]) for i in range(3))
    return qm, inits, dqs


def test_conv_transpose_bias_is_int32_on_its_per_channel_weight_scales(tmp_path):
    """A ConvTranspose's weight grids are per output channel (axis 1, group 1): its bias is held
    as int32 on s_in * s_w[c], channel by channel, as for a Conv."""
    from conftest import make_model, rand, vi
    from onnx import helper

    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="deconv", strides=[2, 2]),
             helper.make_node("Relu", ["y"], ["out"], name="relu")]
    model = make_model(nodes, [vi("x", [1, 3, 4, 4])], [vi("out", [1, 5, 8, 8])],
                       {"w": rand((3, 5, 2, 2), 1, 0.3), "b": rand((5,), 2, 0.1)})
    feeds = input_feeds(model, 4, seed=3)
    data = write_samples(tmp_path / "data", feeds)
    out = tmp_path / "out"
    dipoorlet.quantize(model=save(model, tmp_path / "m.onnx"), input_dir=data, data_num=4, deploy="qnn",
                       output_dir=out, skip_prof_layer=True)
    qm, inits, (input_dq, weight_dq, bias_dq) = _layer_dequantizers(out, "deconv")
    assert inits[bias_dq.input[0]].dtype == np.int32
    s_w, s_x = inits[weight_dq.input[1]], inits[input_dq.input[1]]
    assert s_w.shape == (5,)
    np.testing.assert_allclose(inits[bias_dq.input[1]], s_x * s_w, rtol=1e-6)
    b = inits[bias_dq.input[0]] * inits[bias_dq.input[1]].astype(np.float64)
    np.testing.assert_allclose(b, rand((5,), 2, 0.1), atol=float(np.max(s_x * s_w)))


@pytest.mark.parametrize("plat", ["qnn", "rk"])
def test_a_dead_channels_bias_fits_int32_on_a_widened_weight_grid(tmp_path, plat):
    """One output channel whose weights are all but zero (1e-12) and whose bias is 0.5: on
    s_in * s_w the bias would need far more than int32. That channel's weight grid is widened
    (still far finer than any live channel's) and the bias goes int32 like the others; the
    other channels keep their grids, and the model still computes the float output. (An
    all-zero input, where every channel overflows: test_qparams.)"""
    from conftest import make_model, rand, vi
    from onnx import helper

    w = rand((4, 3, 3, 3), 1, 0.3)
    w[2] = 1e-12
    b = rand((4,), 2, 0.1)
    b[2] = 0.5
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1] * 4),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    model = make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", [1, 4, 6, 6])], {"w": w, "b": b})
    feeds = input_feeds(model, 4, seed=5)
    data = write_samples(tmp_path / "data", feeds)
    out = tmp_path / "out"
    dipoorlet.quantize(model=save(model, tmp_path / "m.onnx"), input_dir=data, data_num=4, deploy=plat,
                       output_dir=out, skip_prof_layer=True, bias_correction=False)
    qm, inits, (_, weight_dq, bias_dq) = _layer_dequantizers(out, "conv")
    ints = inits[bias_dq.input[0]]
    assert ints.dtype == np.int32
    step = inits[bias_dq.input[1]].astype(np.float64)
    # on the grid, rounded as QuantizeLinear does (the division in float32: an int beyond 2^24 is
    # off by float32's rounding of the quotient), with room left below 2^31 for the products
    assert np.all(np.abs(ints * step - b) <= step / 2 + np.abs(b) * 2.0 ** -23)
    assert np.all(np.abs(ints.astype(np.int64)) + 27 * 255 * 127 < 2 ** 31)
    s_w = inits[weight_dq.input[1]]
    live = np.abs(w.reshape(4, -1)).max(1)
    zp = inits[weight_dq.input[2]].astype(np.float64)
    span = (255.0 if zp.dtype == np.uint8 or np.any(zp > 0) else 254.0)
    for c in (0, 1, 3):      # live channels keep the grid their range gives
        assert s_w[c] == pytest.approx(2 * live[c] / span, rel=0.02)
    assert s_w[2] > 1000 * 1e-12 / 127 and s_w[2] < 1e-4 * s_w.max()   # widened, still far finer than the rest
    # weight_clip_val.json gives the widened channel its grid's range (its values' would rebuild
    # the narrow grid), the others their values' range as the reference tool writes them
    lo, hi = (np.array(v) for v in json.loads((out / "weight_clip_val.json").read_text())["w"])
    assert max(-lo[2], hi[2]) / 127 == pytest.approx(float(s_w[2]), rel=1e-5)   # rebuilds the written scale
    flat = w.reshape(4, -1)
    np.testing.assert_allclose(lo[[0, 1, 3]], flat.min(1)[[0, 1, 3]], rtol=1e-6)
    np.testing.assert_allclose(hi[[0, 1, 3]], flat.max(1)[[0, 1, 3]], rtol=1e-6)
    np.testing.assert_allclose(ort_run(qm, feeds[0])[0], ort_run(model, feeds[0])[0], atol=0.05)


def test_qop_names_why_layers_feeding_a_float_op_stay_qdq(tmp_path, caplog):
    """A Conv whose reader the backend leaves float (PRelu on ort) gets no output grid, so it
    cannot become a QLinearConv: the log says so and names the reader (MTCNN's nets are all
    Conv -> PRelu; the log said only "0 ops converted")."""
    from onnx import helper
    from conftest import make_model, quantize_model, rand, vi
    from dipoorlet import qop

    inits = {"w1": rand((4, 3, 3, 3), 1, 0.3), "b1": rand((4,), 2, 0.1), "a": np.full((4, 1, 1), 0.25, np.float32),
             "w2": rand((2, 4, 1, 1), 3, 0.3), "b2": rand((2,), 4, 0.1)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
             helper.make_node("PRelu", ["c1", "a"], ["p1"], name="prelu"),
             helper.make_node("Conv", ["p1", "w2", "b2"], ["y"], name="conv2")]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 2, 8, 8])], inits, opset=13)
    with caplog.at_level("INFO", logger="dipoorlet"):
        quantize_model(tmp_path, model, deploy="ort", quant_format="QOP")
    qdq = onnx.load(str(tmp_path / "out" / "quant_model_qdq.onnx"))
    assert qop.unquantized_outputs(qdq) == {"PRelu": 1, "network output": 1}   # ort leaves outputs float
    assert any("stay QDQ because this backend leaves their output float" in r.getMessage()
               and "PRelu x1" in r.getMessage() for r in caplog.records)


def test_qop_keeps_the_float_tensors_an_if_body_reads(tmp_path):
    """An If branch reads conv1's output from the outer scope: conv1 stays QDQ (its float output
    must exist), the rest is converted, and the QOP model runs and agrees with the QDQ one."""
    from onnx import helper

    from conftest import rand, vi

    then = helper.make_graph([helper.make_node("Relu", ["c1"], ["t"], name="then_relu")], "then", [],
                             [vi("t", [1, 4, 8, 8])])
    other = helper.make_graph([helper.make_node("Neg", ["c1"], ["e"], name="else_neg")], "else", [],
                              [vi("e", [1, 4, 8, 8])])
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMean", ["x"], ["m"], name="mean", keepdims=0),
             helper.make_node("Greater", ["m", "zero"], ["flag"], name="gt"),
             helper.make_node("If", ["flag"], ["a"], name="if", then_branch=then, else_branch=other),
             helper.make_node("Conv", ["a", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    inits = [numpy_helper.from_array(rand((4, 3, 3, 3), 0, 0.3), "w1"), numpy_helper.from_array(rand((4,), 1, 0.1), "b1"),
             numpy_helper.from_array(rand((4, 4, 3, 3), 2, 0.3), "w2"), numpy_helper.from_array(rand((4,), 3, 0.1), "b2"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    graph = helper.make_graph(nodes, "g", [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = save(model, tmp_path / "m.onnx")
    r = np.random.default_rng(0)
    feeds = [{"x": (r.standard_normal((1, 3, 8, 8)) + (0.5 if i % 2 else -0.5)).astype(np.float32)} for i in range(6)]
    data = write_samples(tmp_path / "data", feeds)
    out = tmp_path / "out"
    dipoorlet.quantize(model=path, input_dir=data, data_num=6, deploy="snpe", output_dir=out,
                       quant_format="QOP", skip_prof_layer=True)
    qop, qdq = onnx.load(str(out / "quant_model.onnx")), onnx.load(str(out / "quant_model_qdq.onnx"))
    names = {n.name for n in qop.graph.node}
    assert "conv1" in names and "conv2_quant" in names, names
    onnx.checker.check_model(qop)
    for f in feeds:
        assert _cos(ort_run(qop, f)[0], ort_run(qdq, f)[0]) > KERNEL_COS


def test_platform_name_is_case_insensitive_but_not_guessed():
    """-D TRT loads trt; a vendor's name is not taken for a backend (qualcomm: snpe or qnn?), it
    is suggested in the error."""
    from dipoorlet.errors import ConfigError

    assert platforms.load("TRT").name == "trt"
    assert platforms.load("Snpe").name == "snpe"
    with pytest.raises(ConfigError, match="did you mean snpe or qnn"):
        platforms.load("qualcomm")
