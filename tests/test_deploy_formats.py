"""Deploy side-file exporters: goldens, parse-back of the plan's numbers, range consistency.

Two hand-built contexts on one tiny model (x -> Conv(2 channels, 3x3) -> Relu -> r), with numbers
exact in binary so the goldens are readable:

- ``asym``: unsigned asymmetric activations (x: scale 1/4, zp 128 -> [-32, 31.75]; r: scale 1/8,
  zp 0 -> [0, 31.875]), a per-tensor unsigned weight (scale 2^-7, zp 128 -> [-1, 0.9921875]),
  int32 bias derived as s_in * s_w = 2^-9;
- ``sym``: a signed symmetric x (scale 1/4 -> [-32, 31.75]), the same unsigned r, per-channel
  narrow symmetric int8 weights (scales 2^-7, 2^-8), the int32 bias grid held in the plan.

Goldens: ``DIPOORLET_UPDATE_GOLDEN=1`` rewrites them (then check the diff by hand).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import yaml
from onnx import helper

from conftest import initializer, input_feeds, make_model, save, tiny_cnn, vi, write_samples
import dipoorlet
from dipoorlet.deploy import DeployContext, FORMATS
from dipoorlet.deploy import atlas, imx, magicmind, rockchip, snpe, stpu, ti  # noqa: F401 (registration)
from dipoorlet.graph import Graph
from dipoorlet.placement import ActPoint, Decision, Placement, WeightPoint
from dipoorlet.platform import platforms_dir
from dipoorlet.qparams import QParams

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("DIPOORLET_UPDATE_GOLDEN") == "1"

W = np.array([[[[1.0, 0.0, -1.0], [0.5, 0.0, -0.5], [0.25, 0.0, -0.25]]],
              [[[0.5, 0.25, 0.0], [0.0, -0.5, 0.0], [0.0, 0.0, 0.125]]]], dtype=np.float32)
B = np.array([0.5, -0.25], dtype=np.float32)


# ---- contexts -------------------------------------------------------------------------------
def tiny_graph() -> Graph:
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu")]
    model = make_model(nodes, [vi("x", [1, 1, 4, 4])], [vi("r", [1, 2, 4, 4])], {"w": W, "b": B})
    return Graph(model)


def qp(scale, zp, signed, qmin, qmax, bits=8, axis=None, dtype=None):
    scale = np.asarray(scale, dtype=np.float32)
    dtype = dtype or (np.int8 if signed else np.uint8)
    zp = np.broadcast_to(np.asarray(zp), scale.shape).astype(dtype)
    lo, hi = scale * (qmin - zp.astype(np.int64)), scale * (qmax - zp.astype(np.int64))
    return QParams(scale=scale, zero_point=zp, bits=bits, signed=signed, qmin=qmin, qmax=qmax,
                   axis=axis, lo=lo.astype(np.float32), hi=hi.astype(np.float32))


def placement(axis) -> Placement:
    p = Placement()
    p.activations = {"x": ActPoint("x", [("conv", 0)]), "r": ActPoint("r", [])}
    p.weights = {("conv", 1): WeightPoint("w", "conv", 1, axis)}
    p.decisions = [Decision("conv", "Conv", True, "quantized"),
                   Decision("relu", "Relu", False, "Relu is not quantized on test")]
    return p


def make_ctx(kind: str, graph: Graph | None = None, stpu_wg: bool = False) -> DeployContext:
    graph = graph or tiny_graph()
    platform = SimpleNamespace(name="test", quantize_bias=True, deploy=())
    config = SimpleNamespace(stpu_wg=stpu_wg)
    if kind == "asym":
        plan = SimpleNamespace(
            activations={"x": qp(0.25, 128, False, 0, 255), "r": qp(0.125, 0, False, 0, 255)},
            weights={"w": qp(2.0**-7, 128, False, 0, 255)})
        return DeployContext(graph, plan, placement(None), platform, config)
    plan = SimpleNamespace(
        activations={"x": qp(0.25, 0, True, -128, 127), "r": qp(0.125, 0, False, 0, 255)},
        weights={"w": qp([2.0**-7, 2.0**-8], 0, True, -127, 127, axis=0),
                 "b": qp([2.0**-9, 2.0**-10], 0, True, -2**31, 2**31 - 1, bits=32, axis=0,
                         dtype=np.int32)})
    return DeployContext(graph, plan, placement(0), platform, config)


def export(fmt: str, ctx, folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = FORMATS[fmt](ctx, folder)
    assert all(p.parent == folder and p.is_file() for p in files)
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], "temporary file left behind"
    return {p.name: p for p in files}


def grid(q):
    """(min, max) of a QParams' grid, computed independently of the exporters."""
    s = q.scale.astype(np.float64)
    z = q.zero_point.astype(np.int64)
    return (s * (q.qmin - z)).reshape(-1), (s * (q.qmax - z)).reshape(-1)


def signed_offset(q):
    return (q.zero_point.astype(np.int64) - (-(2 ** (q.bits - 1)) if q.signed else 0)).reshape(-1)


CONTEXTS = ["asym", "sym"]


# ---- goldens --------------------------------------------------------------------------------
GOLDENS = [  # (format, context, stpu_wg, files)
    ("snpe", "asym", False, ["snpe_encodings.json"]),
    ("rockchip_rv", "asym", False, ["rv_quantized_param.yaml", "rv_quantized_param.json"]),
    ("rockchip_rk", "sym", False, ["rk_quantized_param.yaml", "rk_quantized_param.json"]),
    ("atlas", "asym", False, ["atlas_quant_param.json", "atlas_record.json", "atlas_record.txt"]),
    ("ti", "sym", False, ["ti_blob_range.txt", "ti_blob_range.json"]),
    ("imx", "sym", False, ["imx_scale.json"]),
    ("magicmind", "asym", False, ["magicmind_quant_param.json"]),
    ("stpu", "sym", False, ["stpu_minmax.json"]),
    ("stpu", "sym", True, ["stpu_minmax.json"]),
]


GOLDEN_IDS = [f"{g[0]}-{g[1]}{'-wg' if g[2] else ''}" for g in GOLDENS]


@pytest.mark.parametrize("fmt,kind,wg,names", GOLDENS, ids=GOLDEN_IDS)
def test_golden(tmp_path, fmt, kind, wg, names):
    files = export(fmt, make_ctx(kind, stpu_wg=wg), tmp_path)
    assert sorted(files) == sorted(names)
    for name in names:
        golden = GOLDEN / (f"{Path(name).stem}_wg{Path(name).suffix}" if wg else name)
        text = files[name].read_text()
        if UPDATE:
            golden.parent.mkdir(exist_ok=True)
            golden.write_text(text)
        assert text == golden.read_text(), f"{name} differs from {golden}"


def test_qnn_writes_the_snpe_content(tmp_path):
    ctx = make_ctx("sym")
    a = export("snpe", ctx, tmp_path / "a")["snpe_encodings.json"]
    b = export("qnn", ctx, tmp_path / "b")["qnn_encodings.json"]
    assert json.loads(a.read_text()) == json.loads(b.read_text())


# ---- SNPE / QNN (AIMET 0.6.1) ---------------------------------------------------------------
def check_aimet(enc: dict, q):
    lo, hi = grid(q)
    assert len(enc) == q.scale.size
    for i, e in enumerate(enc):
        assert set(e) == {"bitwidth", "dtype", "is_symmetric", "max", "min", "offset", "scale"}
        assert e["bitwidth"] == q.bits and e["dtype"] == "int" and isinstance(e["offset"], int)
        assert e["is_symmetric"] in ("True", "False")
        assert e["scale"] == pytest.approx(float(q.scale.reshape(-1)[i]), abs=1e-12)
        full_qmin = -(2 ** (q.bits - 1)) if q.signed else 0
        assert full_qmin - e["offset"] == int(q.zero_point.reshape(-1)[i])  # offset = full_qmin - zp
        # the AIMET identities, and the plan's grid inside the encoded range
        assert e["min"] == pytest.approx(e["offset"] * e["scale"], rel=1e-12)
        assert e["max"] == pytest.approx(e["min"] + (2 ** e["bitwidth"] - 1) * e["scale"], rel=1e-12)
        assert e["min"] <= 0 <= e["max"]
        assert e["min"] <= lo[i] + 1e-12 and hi[i] <= e["max"] + 1e-12
        assert hi[i] == pytest.approx(e["max"], rel=1e-12)  # the positive end is the plan's
        if q.qmin == -(2 ** (q.bits - 1)) or not q.signed:  # full-range grid: both ends
            assert lo[i] == pytest.approx(e["min"], rel=1e-12)


@pytest.mark.parametrize("kind", CONTEXTS)
def test_snpe_parse_back(tmp_path, kind):
    ctx = make_ctx(kind)
    doc = json.loads(export("snpe", ctx, tmp_path)["snpe_encodings.json"].read_text())
    assert doc["version"] == "0.6.1"
    assert set(doc["activation_encodings"]) == {"x", "r"}
    for t, q in ctx.plan.activations.items():
        check_aimet(doc["activation_encodings"][t], q)
    check_aimet(doc["param_encodings"]["w"], ctx.plan.weights["w"])
    if "b" not in ctx.plan.weights:
        # the model keeps this bias float: no encoding may claim it is int32
        assert "b" not in doc["param_encodings"]
    else:
        bias = doc["param_encodings"]["b"]
        s_in, s_w = ctx.plan.activations["x"].scale, ctx.plan.weights["w"].scale.reshape(-1)
        assert [e["scale"] for e in bias] == pytest.approx(list(s_in * s_w), rel=1e-7)
        assert all(e["bitwidth"] == 32 and e["offset"] == -2**31 and e["is_symmetric"] == "True" for e in bias)
    args = doc["quantizer_args"]
    assert args["per_channel_quantization"] is (kind == "sym")
    assert args["is_symmetric"] is (kind == "sym")
    assert args["activation_bitwidth"] == 8 and args["param_bitwidth"] == 8


def test_snpe_symmetric_uses_aimet_convention(tmp_path):
    doc = json.loads(export("snpe", make_ctx("sym"), tmp_path)["snpe_encodings.json"].read_text())
    x = doc["activation_encodings"]["x"][0]
    assert (x["offset"], x["min"], x["max"], x["is_symmetric"]) == (-128, -32.0, 31.75, "True")
    r = doc["activation_encodings"]["r"][0]  # unsigned, never negative: min == 0, not > 0
    assert (r["offset"], r["min"], r["max"], r["is_symmetric"]) == (0, 0.0, 31.875, "False")


def test_snpe_no_bias_encodings_without_bias_quantization(tmp_path):
    ctx = make_ctx("asym")
    ctx.platform.quantize_bias = False
    doc = json.loads(export("snpe", ctx, tmp_path)["snpe_encodings.json"].read_text())
    assert set(doc["param_encodings"]) == {"w"}


# ---- Rockchip -------------------------------------------------------------------------------
def load_pair(files: dict, stem: str):
    text = files[f"{stem}.yaml"].read_text()
    assert "&id" not in text and "*id" not in text, "YAML anchors/aliases written"
    doc = yaml.safe_load(text)
    assert doc == json.loads(files[f"{stem}.json"].read_text())
    return doc


@pytest.mark.parametrize("kind", CONTEXTS)
def test_rv_parse_back(tmp_path, kind):
    ctx = make_ctx(kind)
    doc = load_pair(export("rockchip_rv", ctx, tmp_path), "rv_quantized_param")
    assert doc["customized_quantize_layers"] == {}
    params = doc["quantize_parameters"]
    keys = {"@x:out0": "x", "@relu:out0": "r", "@conv:out0": "r"}  # conv's output: fused Relu's range
    for key, t in keys.items():
        e, q = params[key], ctx.plan.activations[t]
        lo, hi = grid(q)
        assert e["dtype"] == "asymmetric_affine" and e["qtype"] == "u8" and e["method"] == "layer"
        assert e["scale"] == pytest.approx(list(q.scale.reshape(-1)), abs=1e-12)
        assert e["zero_point"] == list(signed_offset(q))
        assert e["min_value"] == pytest.approx(list(lo)) and e["max_value"] == pytest.approx(list(hi))
        assert e["min_value"][0] <= 0 <= e["max_value"][0]
        # the toolkit's own derivation recovers the plan's grid
        step = (e["max_value"][0] - e["min_value"][0]) / 255
        assert step == pytest.approx(e["scale"][0], rel=1e-7)
        assert round(-e["min_value"][0] / step) == e["zero_point"][0]
    assert params["@conv:out0"] is not params["@relu:out0"]
    w = params["@conv:weight"]
    assert w["scale"] == pytest.approx(list(ctx.plan.weights["w"].scale.reshape(-1)), abs=1e-12)
    bias = params["@conv:bias"]
    assert bias["qtype"] == "i32" and bias["zero_point"] == [0] and bias["max_value"] == []
    s_w = ctx.plan.weights["w"].scale.reshape(-1)
    assert bias["scale"] == pytest.approx(list(0.25 * s_w), rel=1e-7)


@pytest.mark.parametrize("kind", CONTEXTS)
def test_rk_parse_back(tmp_path, kind):
    ctx = make_ctx(kind)
    params = load_pair(export("rockchip_rk", ctx, tmp_path), "rk_quantized_param")["quantize_parameters"]
    for t, src in {"x": "x", "r": "r", "c": "r"}.items():
        lo, hi = grid(ctx.plan.activations[src])
        assert params[t]["min"] == pytest.approx(list(lo)) and params[t]["max"] == pytest.approx(list(hi))
        assert params[t]["min"][0] <= 0 <= params[t]["max"][0]
    wq = ctx.plan.weights["w"]
    wr = params["conv_W"]
    if kind == "sym":  # symmetric weights: ±qmax*scale, one per channel
        assert wr["max"] == pytest.approx(list(wq.scale * 127)) and wr["min"] == [-v for v in wr["max"]]
    else:
        lo, hi = grid(wq)
        assert wr["min"] == pytest.approx(list(lo)) and wr["max"] == pytest.approx(list(hi))
    assert params["conv_b"] == {"max": [0.5], "min": [-0.5]}


def test_relu_fill_in_never_overrides_a_plan_grid(tmp_path):
    ctx = make_ctx("asym")
    ctx.plan.activations["c"] = qp(0.5, 64, False, 0, 255)
    ctx.placement.activations["c"] = ActPoint("c", [("relu", 0)])
    params = load_pair(export("rockchip_rv", ctx, tmp_path), "rv_quantized_param")["quantize_parameters"]
    assert params["@conv:out0"]["scale"] == [0.5] and params["@conv:out0"]["zero_point"] == [64]


def test_relu_fill_in_matches_whole_names_and_survives_relu_on_input(tmp_path):
    # x -> Relu(relu0) -> Conv(conv1) -> Relu(relu1) -> Conv(conv10) -> Relu(relu10) -> y
    w = np.ones((1, 1, 1, 1), np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu0"),
             helper.make_node("Conv", ["a", "w1"], ["c1"], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w10"], ["c10"], name="conv10"),
             helper.make_node("Relu", ["c10"], ["y"], name="relu10")]
    g = Graph(make_model(nodes, [vi("x", [1, 1, 2, 2])], [vi("y", [1, 1, 2, 2])], {"w1": w, "w10": w}))
    p = Placement()
    p.activations = {"a": ActPoint("a", [("conv1", 0)]), "r1": ActPoint("r1", [("conv10", 0)]),
                     "y": ActPoint("y", [])}
    plan = SimpleNamespace(activations={"a": qp(0.25, 0, False, 0, 255), "r1": qp(0.5, 0, False, 0, 255),
                                        "y": qp(1.0, 0, False, 0, 255)}, weights={})
    ctx = DeployContext(g, plan, p, SimpleNamespace(quantize_bias=False), SimpleNamespace())
    assert snpe.relu_fill_ins(ctx) == {"c1": "r1", "c10": "y"}
    params = load_pair(export("rockchip_rv", ctx, tmp_path), "rv_quantized_param")["quantize_parameters"]
    assert params["@conv1:out0"]["scale"] == [0.5] and params["@conv10:out0"]["scale"] == [1.0]
    assert params["@relu0:out0"]["scale"] == [0.25] and "@x:out0" not in params


def test_rv_a_node_named_like_the_input_keeps_the_inputs_entry_and_warns(tmp_path, caplog):
    """The format keys an input @NAME:out0 as a node of its name: a node named like the input
    (x) got the same key, and its grid replaced the input's without a word (found by a hunt)."""
    import logging

    w = np.ones((1, 1, 1, 1), np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="x"),
             helper.make_node("Relu", ["c1"], ["y"], name="relu")]
    g = Graph(make_model(nodes, [vi("x", [1, 1, 2, 2])], [vi("y", [1, 1, 2, 2])], {"w1": w}))
    p = Placement()
    p.activations = {"x": ActPoint("x", [("x", 0)]), "c1": ActPoint("c1", [])}
    plan = SimpleNamespace(activations={"x": qp(0.25, 0, False, 0, 255), "c1": qp(0.5, 3, False, 0, 255)}, weights={})
    ctx = DeployContext(g, plan, p, SimpleNamespace(quantize_bias=False), SimpleNamespace())
    with caplog.at_level(logging.WARNING):
        params = load_pair(export("rockchip_rv", ctx, tmp_path), "rv_quantized_param")["quantize_parameters"]
    assert params["@x:out0"]["scale"] == [0.25]
    assert any("both keyed @x:out0" in r.getMessage() for r in caplog.records)


# ---- Atlas ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", CONTEXTS)
def test_atlas_parse_back(tmp_path, kind):
    ctx = make_ctx(kind)
    files = export("atlas", ctx, tmp_path)
    flat = json.loads(files["atlas_quant_param.json"].read_text())
    assert set(flat) == set(ctx.plan.activations)
    for t, q in ctx.plan.activations.items():
        assert flat[t]["scale"] == pytest.approx(float(q.scale), abs=1e-12)
        assert -128 <= flat[t]["offset"] <= 127
        assert flat[t]["offset"] + 128 == signed_offset(q)[0]  # unsigned zero point - 128
    rec = json.loads(files["atlas_record.json"].read_text())
    assert list(rec) == ["conv"]
    x, w = ctx.plan.activations["x"], ctx.plan.weights["w"]
    assert rec["conv"]["scale_d"] == flat["x"]["scale"] and rec["conv"]["offset_d"] == flat["x"]["offset"]
    assert rec["conv"]["scale_w"] == pytest.approx(list(w.scale.reshape(-1)), abs=1e-12)
    assert rec["conv"]["offset_w"] == [0] * w.scale.size  # symmetric int8 weights in AMCT's form
    # the protobuf text record carries the same numbers
    txt = files["atlas_record.txt"].read_text()
    assert re.findall(r'key: "(.*)"', txt) == ["conv"]
    fields = {}
    for name, value in re.findall(r"^    (\w+): (\S+)$", txt, re.M):
        fields.setdefault(name, []).append(float(value))
    assert fields == {"scale_d": [rec["conv"]["scale_d"]], "offset_d": [rec["conv"]["offset_d"]],
                      "scale_w": rec["conv"]["scale_w"], "offset_w": rec["conv"]["offset_w"]}
    assert x.scale == rec["conv"]["scale_d"]


def test_atlas_offset_of_a_narrow_unsigned_grid_is_its_signed_form(tmp_path):
    """A 6-bit unsigned activation grid [0, 63] is written in its signed form q in [-32, 31]:
    offset = zp - 32, so scale * (q - offset) over that range is the grid (the docstring once
    said zp - 128 for every width; found by a side-file hunt)."""
    ctx = make_ctx("asym")
    ctx.plan.activations["x"] = qp(0.25, 20, False, 0, 63, bits=6)
    flat = json.loads(export("atlas", ctx, tmp_path)["atlas_quant_param.json"].read_text())
    assert flat["x"]["offset"] == 20 - 32
    signed_q = np.arange(-32, 32)
    unsigned_q = np.arange(0, 64)
    np.testing.assert_array_equal(flat["x"]["scale"] * (signed_q - flat["x"]["offset"]), 0.25 * (unsigned_q - 20))


# ---- TI, i.MX, MagicMind --------------------------------------------------------------------
@pytest.mark.parametrize("kind", CONTEXTS)
def test_ti_parse_back(tmp_path, kind):
    ctx = make_ctx(kind)
    files = export("ti", ctx, tmp_path)
    rows = [line.split() for line in files["ti_blob_range.txt"].read_text().splitlines()]
    txt = {t: [float(lo), float(hi)] for t, lo, hi in rows}
    assert txt == json.loads(files["ti_blob_range.json"].read_text())["blob_range"]
    assert list(txt) == list(ctx.plan.activations)
    for t, q in ctx.plan.activations.items():
        lo, hi = grid(q)
        if q.signed and not np.any(q.zero_point):
            # symmetric: [-127 s, 127 s], so a reader's max(|min|, |max|) / 127 is the plan's scale
            assert txt[t] == [-hi[0], hi[0]] and max(-txt[t][0], txt[t][1]) / 127 == float(q.scale)
        else:
            assert txt[t] == [lo[0], hi[0]]  # exact: repr round-trips
        assert txt[t][0] <= 0 <= txt[t][1]
    assert txt["r"] == [0.0, 255 * 0.125]  # non-negative tensor: the unsigned grid


@pytest.mark.parametrize("kind", CONTEXTS)
def test_imx_parse_back(tmp_path, kind):
    ctx = make_ctx(kind)
    table = json.loads(export("imx", ctx, tmp_path)["imx_scale.json"].read_text())["blob_range"]
    assert set(table) == {"x", "r", "w"}
    for t, q in list(ctx.plan.activations.items()) + [("w", ctx.plan.weights["w"])]:
        assert table[t] == pytest.approx(list(q.scale.reshape(-1)), abs=1e-12)
    assert len(table["w"]) == (2 if kind == "sym" else 1)


def test_imx_warns_on_a_scale_that_is_not_a_power_of_two(tmp_path, caplog):
    ctx = make_ctx("sym")
    ctx.plan.activations["x"] = qp(0.3, 0, True, -128, 127)
    export("imx", ctx, tmp_path)
    assert "not powers of two" in caplog.text


@pytest.mark.parametrize("kind", CONTEXTS)
def test_magicmind_parse_back(tmp_path, kind):
    ctx = make_ctx(kind)
    path = export("magicmind", ctx, tmp_path)["magicmind_quant_param.json"]
    table = json.loads(path.read_text())["blob_range"]
    assert set(table) == set(ctx.plan.activations)
    for t, q in ctx.plan.activations.items():
        lo, hi = grid(q)
        assert table[t] == {"min": lo[0], "max": hi[0]} and lo[0] <= 0 <= hi[0]
        if not q.signed:  # an asymmetric quantizer's own (max-min)/255 and zero point give ours back
            step = (table[t]["max"] - table[t]["min"]) / 255
            assert step == pytest.approx(float(q.scale)) and round(-table[t]["min"] / step) == q.zero_point


# ---- STPU -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", CONTEXTS)
def test_stpu_parse_back(tmp_path, kind):
    ctx = make_ctx(kind)
    p = json.loads(export("stpu", ctx, tmp_path)["stpu_minmax.json"].read_text())
    assert set(p) == {"conv_weights", "x", "r", "c", "conv_bias"}
    for key, entry in p.items():
        if "min" in entry:
            assert entry["min"] == -entry["max"] and entry["max"] >= 0
    x, w = ctx.plan.activations["x"], ctx.plan.weights["w"]
    if kind == "sym":  # symmetric grids: A / qmax is the plan's scale
        assert p["x"]["max"] / 127 == pytest.approx(float(x.scale))
        assert p["conv_weights"]["max"] / 127 == pytest.approx(float(w.scale.max()))
    else:  # an asymmetric grid: A covers it
        lo, hi = grid(x)
        assert p["x"]["max"] == max(-lo[0], hi[0])
    assert p["c"] == p["r"]  # fused Relu
    alpha = p["conv_bias"]["alpha"]
    s = list(x.scale * w.scale.reshape(-1))
    assert (alpha if isinstance(alpha, list) else [alpha]) == pytest.approx(s, rel=1e-7)
    assert p["conv_bias"]["zero_point"] == 0


def winograd_loop(w, g):
    out = []
    for o in range(w.shape[0]):
        for i in range(w.shape[1]):
            out.append(np.abs(g @ w[o, i].astype(np.float64) @ g.T).max())
    return max(out)


def test_stpu_winograd(tmp_path):
    p = json.loads(export("stpu", make_ctx("sym", stpu_wg=True), tmp_path)["stpu_minmax.json"].read_text())
    g = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
    a = winograd_loop(W, g)
    assert p["layer_conv"] == {"wg": True}
    assert p["conv_weights"] == {"min": -a, "max": a}
    assert winograd_loop(W, 2 * g) == 4 * a  # the reference's 2G: four times larger
    assert p["conv_bias"]["alpha"] == pytest.approx(a / 127 * 0.25, rel=1e-7)
    # not eligible: stride 2, group != 1 (through the attribute)
    assert stpu.winograd_eligible(helper.make_node("Conv", ["x", "w"], ["y"], strides=[2, 2]), W) is False
    assert stpu.winograd_eligible(helper.make_node("Conv", ["x", "w"], ["y"], group=2), W) is False
    assert stpu.winograd_eligible(helper.make_node("Conv", ["x", "w"], ["y"], dilations=[2, 2]), W) is False
    assert stpu.winograd_eligible(helper.make_node("Conv", ["x", "w"], ["y"]), W) is True
    assert stpu.winograd_eligible(helper.make_node("Conv", ["x", "w"], ["y"]), W[:, :, :2, :2]) is False


def test_stpu_winograd_off_by_default(tmp_path):
    ctx = make_ctx("sym")
    ctx.config = SimpleNamespace()
    p = json.loads(export("stpu", ctx, tmp_path)["stpu_minmax.json"].read_text())
    assert "layer_conv" not in p


# ---- a real run: the files agree with quant_model.onnx ---------------------------------------
ALL = ["snpe", "qnn", "rockchip_rv", "rockchip_rk", "atlas", "ti", "imx", "magicmind", "stpu"]


def test_end_to_end_files_match_the_simulated_model(tmp_path):
    spec = (platforms_dir() / "trt.toml").read_text()
    spec = re.sub(r"(?m)^name = .*$", 'name = "alldeploy"', spec)
    spec = re.sub(r"(?m)^deploy = .*$", "deploy = " + json.dumps(ALL), spec)
    toml = tmp_path / "alldeploy.toml"
    toml.write_text(spec)
    model = tiny_cnn()
    model_path = save(model, tmp_path / "model.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, 4))
    out = tmp_path / "out"
    dipoorlet.quantize(model=model_path, input_dir=data, data_num=4, deploy=str(toml), output_dir=out,
                       act_quant="minmax")
    qm = onnx.load(str(out / "quant_model.onnx"))
    qdq = {n.input[0] for n in qm.graph.node if n.op_type == "QuantizeLinear"}
    enc = json.loads((out / "snpe_encodings.json").read_text())
    assert json.loads((out / "qnn_encodings.json").read_text()) == enc
    assert set(enc["activation_encodings"]) == qdq and qdq
    for t, (e,) in enc["activation_encodings"].items():
        s, z = float(initializer(qm, t + "_scale")), initializer(qm, t + "_zero_point")
        full = -128 if z.dtype == np.int8 else 0
        assert e["scale"] == pytest.approx(s, rel=1e-7) and e["offset"] == full - int(z)
        assert e["min"] <= 0 <= e["max"]
    for w, encs in enc["param_encodings"].items():
        s = initializer(qm, w + "_scale").reshape(-1)
        assert [e["scale"] for e in encs] == pytest.approx(list(s), rel=1e-7)
    ti_json = json.loads((out / "ti_blob_range.json").read_text())["blob_range"]
    mm = json.loads((out / "magicmind_quant_param.json").read_text())["blob_range"]
    rk = yaml.safe_load((out / "rk_quantized_param.yaml").read_text())["quantize_parameters"]
    for t in qdq:
        s = float(initializer(qm, t + "_scale"))
        lo, hi = ti_json[t]
        # TI: [-127 s, 127 s] (a symmetric reader divides by 127); MagicMind and RK: the grid
        assert hi == pytest.approx(127 * s, rel=1e-6) and lo == pytest.approx(-127 * s, rel=1e-6)
        assert mm[t] == {"min": -128 * s, "max": hi} and rk[t] == {"min": [-128 * s], "max": [hi]}
    for name in ["rv_quantized_param.yaml", "rv_quantized_param.json", "atlas_quant_param.json",
                 "atlas_record.json", "atlas_record.txt", "imx_scale.json", "stpu_minmax.json"]:
        assert (out / name).stat().st_size > 0


def test_a_bias_listed_among_the_placement_weights_is_not_a_layer_weight(tmp_path):
    ctx = make_ctx("sym")
    ctx.placement.weights[("conv", 2)] = WeightPoint("b", "conv", 2, 0)
    layers = snpe.weighted_layers(ctx)
    assert [(l.node.name, l.weight, l.bias) for l in layers] == [("conv", "w", "b")]
    rk = load_pair(export("rockchip_rk", ctx, tmp_path / "rk"), "rk_quantized_param")["quantize_parameters"]
    assert rk["conv_W"]["max"] == pytest.approx([127 * 2.0**-7, 127 * 2.0**-8])
    imx_table = json.loads(export("imx", ctx, tmp_path / "imx")["imx_scale.json"].read_text())["blob_range"]
    assert "b" not in imx_table
    enc = json.loads(export("snpe", ctx, tmp_path / "snpe")["snpe_encodings.json"].read_text())
    assert [e["scale"] for e in enc["param_encodings"]["b"]] == [2.0**-9, 2.0**-10]
    assert enc["quantizer_args"]["param_bitwidth"] == 8


def test_pad_between_qdq_and_conv(tmp_path):
    """The placement moves a Conv's Q/DQ in front of a Pad feeding it: the layer still finds it."""
    nodes = [helper.make_node("Pad", ["x", "pads"], ["xp"], name="pad"),
             helper.make_node("Conv", ["xp", "w", "b"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu")]
    g = Graph(make_model(nodes, [vi("x", [1, 1, 4, 4])], [vi("r", [1, 2, 4, 4])],
                         {"w": W, "b": B, "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)}))
    ctx = make_ctx("asym", graph=g)
    ctx.placement.activations["x"] = ActPoint("x", [("pad", 0)])
    (layer,) = snpe.weighted_layers(ctx)
    assert layer.data == "x" and layer.dqp is ctx.plan.activations["x"]
    assert float(layer.bqp.scale) == 0.25 * 2.0**-7
    rec = json.loads(export("atlas", ctx, tmp_path)["atlas_record.json"].read_text())
    assert rec["conv"]["scale_d"] == 0.25


def test_trt_files_agree_for_an_always_zero_tensor(tmp_path):
    """A ReLU that never fires is 0 in every sample: it sizes no grid and stays float (a grid of
    +-1e-8 would clip any other value), so neither the clip file nor the cache lists it, and the
    two still describe the same grids (amax = scale * 127) for the rest, never a range of 0."""
    import struct

    from conftest import input_feeds, quantize_model, rand

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="c1"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="c2")]
    model = make_model(nodes, [vi("x", [1, 2, 4, 4])], [vi("y", [1, 2, 4, 4])],
                       {"w1": rand((2, 2, 1, 1), 1, 0.1), "b1": np.full(2, -100.0, np.float32),
                        "w2": rand((2, 2, 1, 1), 2)})
    quantize_model(tmp_path, model, feeds=input_feeds(model, 2), skip_prof_layer=True)
    blob = json.loads((tmp_path / "out" / "trt_clip_val.json").read_text())["blob_range"]
    cache = dict(line.rsplit(": ", 1) for line in
                 (tmp_path / "out" / "trt_calib.cache").read_text().splitlines()[1:])
    assert set(blob) == set(cache) and "x" in blob and "r" not in blob
    for t, hexed in cache.items():
        scale = struct.unpack(">f", bytes.fromhex(hexed))[0]
        assert scale > 0 and blob[t] == pytest.approx(127 * scale, rel=1e-6)


def test_trt_cache_lines_of_tensor_names_with_a_colon_or_a_line_break(tmp_path, caplog):
    """The cache has no escape: a name with a line break is left out (it would split its line and
    the next reader's parse), one with ':' is kept and named in a warning; the json has both."""
    from conftest import input_feeds, quantize_model, rand

    nodes = [helper.make_node("Conv", ["x", "w1"], ["a: b"], name="c1"),
             helper.make_node("Conv", ["a: b", "w2"], ["c\nd"], name="c2"),
             helper.make_node("Conv", ["c\nd", "w3"], ["y"], name="c3")]
    model = make_model(nodes, [vi("x", [1, 2, 4, 4])], [vi("y", [1, 2, 4, 4])],
                       {f"w{i}": rand((2, 2, 1, 1), i) for i in (1, 2, 3)})
    caplog.set_level("WARNING", logger="dipoorlet")
    quantize_model(tmp_path, model, feeds=input_feeds(model, 2), skip_prof_layer=True)
    blob = json.loads((tmp_path / "out" / "trt_clip_val.json").read_text())["blob_range"]
    lines = (tmp_path / "out" / "trt_calib.cache").read_text().splitlines()[1:]
    assert {"x", "a: b", "c\nd"} <= set(blob)
    assert sorted(line.rsplit(": ", 1)[0] for line in lines) == ["a: b", "x"]
    assert "1 tensor names hold a line break" in caplog.text and "1 tensor names hold ':'" in caplog.text


def test_atlas_and_ti_text_files_with_a_line_break_in_a_name(tmp_path, caplog):
    """A node or tensor name holding a line break left atlas_record.txt unparsable (a raw break
    inside a quoted string) and split a line of ti_blob_range.txt, so a reader gave that range to
    a tensor named after the break. The record escapes it (parsed back by protobuf's text
    format); the TI text file leaves the name out with a warning, its JSON keeps it."""
    from conftest import input_feeds, quantize_model, rand

    nodes = [helper.make_node("Conv", ["x", "w1"], ["a\nb"], name="conv\none"),
             helper.make_node("Relu", ["a\nb"], ["r\ns"], name="relu"),
             helper.make_node("Conv", ["r\ns", "w2"], ["y"], name="c2")]
    model = make_model(nodes, [vi("x", [1, 2, 4, 4])], [vi("y", [1, 2, 4, 4])],
                       {f"w{i}": rand((2, 2, 1, 1), i) for i in (1, 2)})
    quantize_model(tmp_path / "atlas", model, feeds=input_feeds(model, 2), deploy="atlas", skip_prof_layer=True)
    text = (tmp_path / "atlas" / "out" / "atlas_record.txt").read_text()
    keys = [line.split("key: ", 1)[1] for line in text.splitlines() if line.strip().startswith("key: ")]
    assert keys and all(k.startswith('"') and k.endswith('"') for k in keys), keys
    assert '"conv\\none"' in keys
    caplog.set_level("WARNING", logger="dipoorlet")
    quantize_model(tmp_path / "ti", model, feeds=input_feeds(model, 2), deploy="ti", skip_prof_layer=True)
    blob = json.loads((tmp_path / "ti" / "out" / "ti_blob_range.json").read_text())["blob_range"]
    lines = (tmp_path / "ti" / "out" / "ti_blob_range.txt").read_text().splitlines()
    assert all(len(line.split()) == 3 for line in lines), lines
    assert {line.split()[0] for line in lines} == set(blob) - {t for t in blob if "\n" in t}
    assert any("\n" in t for t in blob) and "1 tensor names hold a line break" in caplog.text


def _four_convs(inits: dict, out_channels: int):
    """x -> conv1 -> relu1 -> conv2 -> relu2 -> conv3 -> relu3 -> conv4 -> y, 1x1 Convs."""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3"], ["c3"], name="conv3"),
             helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
             helper.make_node("Conv", ["r3", "w4"], ["y"], name="conv4")]
    return make_model(nodes, [vi("x", [1, 2, 4, 4])], [vi("y", [1, out_channels, 4, 4])], inits)


@pytest.mark.parametrize("deploy", ["rv", "rk", "stpu"])
def test_a_skipped_conv_before_a_relu_gets_no_filled_in_range(tmp_path, deploy):
    """Formats that give a fused Conv's output its ReLU's range left that range on a Conv that
    --skip_layers keeps float (quant_model.onnx has no grid there); the quantized one keeps it."""
    from conftest import input_feeds, quantize_model, rand

    model = _four_convs({f"w{i}": rand((2, 2, 1, 1), i) for i in (1, 2, 3, 4)}, 2)
    _, qm = quantize_model(tmp_path, model, feeds=input_feeds(model, 2), deploy=deploy, skip_prof_layer=True,
                           skip_layers=["conv3"])
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == "c3" for n in qm.graph.node)
    name = {"rv": "rv_quantized_param.json", "rk": "rk_quantized_param.json", "stpu": "stpu_minmax.json"}[deploy]
    doc = json.loads((tmp_path / "out" / name).read_text())
    keys = set(doc.get("quantize_parameters", doc))
    fill = {"rv": ("@conv1:out0", "@conv3:out0"), "rk": ("c1", "c3"), "stpu": ("c1", "c3")}[deploy]
    assert fill[0] in keys and fill[1] not in keys, sorted(keys)


@pytest.mark.parametrize("deploy", ["rv", "stpu"])
def test_a_conv_auto_skip_keeps_float_gets_no_filled_in_range(tmp_path, deploy):
    """As with --skip_layers, a Conv that --auto_skip keeps float (an outlier weight its
    per-tensor grid cannot hold) gets no ReLU range for its output."""
    from conftest import quantize_model, rand

    inits = {f"w{i}": rand((4, 4, 1, 1), i) for i in (2, 3, 4)}
    inits["w1"] = rand((4, 2, 1, 1), 1)
    inits["w3"][0, 0] = 200.0
    model = _four_convs(inits, 4)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 2, 4, 4)).astype(np.float32)} for _ in range(8)]
    res, qm = quantize_model(tmp_path, model, feeds=feeds, deploy=deploy, equalize=False, auto_skip="0.99999",
                             max_float_layers=1)
    assert res.report["auto_skip"]["float_layers"] == ["conv3"]
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == "c3" for n in qm.graph.node)
    name = {"rv": "rv_quantized_param.json", "stpu": "stpu_minmax.json"}[deploy]
    doc = json.loads((tmp_path / "out" / name).read_text())
    keys = set(doc.get("quantize_parameters", doc))
    fill = {"rv": ("@conv1:out0", "@conv3:out0"), "stpu": ("c1", "c3")}[deploy]
    assert fill[0] in keys and fill[1] not in keys, sorted(keys)


def test_rockchip_fills_in_every_fused_activation_and_the_corrected_bias(tmp_path):
    """RKNN fuses Conv+Clip (ReLU6) as it fuses Conv+Relu: the Conv output gets the Clip output's
    range. With --bc the bias entry describes the corrected bias the model holds."""
    import yaml

    from conftest import input_feeds, quantize_model, rand

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="c1"),
             helper.make_node("Clip", ["c", "lo", "hi"], ["r"], name="relu6"),
             helper.make_node("Conv", ["r", "w2", "b2"], ["y"], name="c2")]
    model = make_model(nodes, [vi("x", [1, 2, 4, 4])], [vi("y", [1, 2, 4, 4])],
                       {"w1": rand((2, 2, 1, 1), 1), "b1": rand((2,), 2, 0.1), "lo": np.float32(0),
                        "hi": np.float32(6), "w2": rand((2, 2, 1, 1), 3), "b2": rand((2,), 4, 0.1)})
    _, qm = quantize_model(tmp_path, model, feeds=input_feeds(model, 4), deploy="rk", bias_correction=True,
                           skip_prof_layer=True)
    params = yaml.safe_load((tmp_path / "out" / "rk_quantized_param.yaml").read_text())["quantize_parameters"]
    assert params["c"] == params["r"]
    # the bias the model holds: int32 through a DequantizeLinear (rk quantizes biases)
    from onnx import numpy_helper
    inits = {t.name: numpy_helper.to_array(t) for t in qm.graph.initializer}
    c2 = next(n for n in qm.graph.node if n.name == "c2")
    dq = next(n for n in qm.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == c2.input[2])
    q, scale = inits[dq.input[0]].astype(np.float64), inits[dq.input[1]].astype(np.float64)
    held = q * scale
    float_bias = inits.get("b2", numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "b2")))
    assert not np.allclose(held, float_bias, atol=scale.max())  # the correction moved it
    assert params["c2_b"]["max"][0] == pytest.approx(float(np.abs(held).max()), abs=float(scale.max()))


@pytest.mark.parametrize("deploy, warned", [("rk", True), ("stpu", True), ("ti", True), ("magicmind", True),
                                            ("atlas", True), ("imx", True),
                                            ("snpe", False)])
@pytest.mark.parametrize("bits", [{"w_bits": 4}, {"a_bits": 6}, {}])
def test_range_only_formats_warn_that_narrow_grids_deploy_as_8_bits(tmp_path, caplog, deploy, warned, bits):
    # a range without a bit width rebuilds an 8-bit grid: 4x finer than a 6-bit activation grid
    # (18x for a 4-bit weight) than what quant_model.onnx simulates; snpe's encodings carry bitwidth
    from conftest import input_feeds, quantize_model

    model = tiny_cnn()
    with caplog.at_level("WARNING", logger="dipoorlet"):
        quantize_model(tmp_path, model, feeds=input_feeds(model, 4), deploy=deploy, skip_prof_layer=True, **bits)
    hits = [r.getMessage() for r in caplog.records if "narrower than 8 bits" in r.getMessage()]
    assert bool(hits) == (warned and bool(bits)), hits
    if hits:
        assert hits[0].startswith(f"{deploy}: ") and f"{list(bits.values())[0]} bits" in hits[0]


@pytest.mark.parametrize("flags", [{}, {"w_bits": 4}, {"a_bits": 6}, {"w_bits": 4, "stpu_wg": True}])
def test_stpu_bias_alpha_is_the_product_of_the_steps_its_ranges_give(tmp_path, flags):
    """STPU builds its int8 grids from the written ranges (A / 127); a grid narrower than 8 bits
    is written as its range, but the bias alpha was the product of the narrow steps (127/7 = 18x
    too large with 4-bit weights, 4.1x with 6-bit activations; found by a bug hunt)."""
    model = tiny_cnn()
    model_path = save(model, tmp_path / "model.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, 4))
    dipoorlet.quantize(model=model_path, input_dir=data, data_num=4, deploy="stpu", output_dir=tmp_path / "out",
                       act_quant="minmax", skip_prof_layer=True, **flags)
    p = json.loads((tmp_path / "out" / "stpu_minmax.json").read_text())
    inputs = {"conv1": "x", "conv2": "p1", "fc": "f"}
    checked = 0
    for layer, src in inputs.items():
        if f"{layer}_bias" not in p or src not in p:
            continue
        want = p[src]["max"] / 127 * p[f"{layer}_weights"]["max"] / 127
        assert p[f"{layer}_bias"]["alpha"] == pytest.approx(want, rel=1e-6), layer
        checked += 1
    assert checked >= 2


def test_atlas_record_of_a_matmul_of_two_activations_warns(tmp_path, caplog):
    """AMCT's record holds one data grid per layer: Q·Kᵀ's second input had no entry there and
    nothing said so (found by a hunt); the record keeps the first input's grid and a warning names
    the layer."""
    import logging

    from conftest import quantize_model, rand

    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="proj_q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="proj_k"),
             helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["y"], name="scores")]
    model = make_model(nodes, [vi("x", [1, 6, 8])], [vi("y", [1, 6, 6])], {"wq": rand((8, 8), 1), "wk": rand((8, 8), 2)})
    with caplog.at_level(logging.WARNING):
        quantize_model(tmp_path, model, deploy="atlas", skip_prof_layer=True)
    rec = json.loads((tmp_path / "out" / "atlas_record.json").read_text())
    flat = json.loads((tmp_path / "out" / "atlas_quant_param.json").read_text())
    assert "scores" in rec and "q" in flat and ("kt" in flat or "k" in flat)
    assert any(r.getMessage().startswith("atlas_record: 1 layers read two activations (scores)")
               for r in caplog.records)


def _shared_bias_convs():
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["ya"], name="conv_a", pads=[1] * 4),
             helper.make_node("Conv", ["ya", "w", "b"], ["yb"], name="conv_b", pads=[1] * 4)]
    return make_model(nodes, [vi("x", [1, 4, 8, 8])], [vi("yb", [1, 4, 8, 8])],
                      {"w": rng.normal(0, .3, (4, 4, 3, 3)).astype(np.float32),
                       "b": rng.normal(0, .5, 4).astype(np.float32)}, opset=17)


def _dq_scale(qm, tensor_prefix: str) -> np.ndarray:
    """The scale of the DequantizeLinear whose output is ``<tensor_prefix>_dq``."""
    dq = next(n for n in qm.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == f"{tensor_prefix}_dq")
    return np.asarray(initializer(qm, dq.input[1]))


def test_a_bias_two_layers_share_gets_each_layers_own_scale(tmp_path, caplog):
    """conv_a and conv_b share weight and bias; conv_b reads the bias float in quant_model.onnx.
    rv_quantized_param had given @conv_b:bias conv_a's scale (a hunt: 6.3x too small on a CNN);
    each is its layer's s_in * s_w (numpy, from the model's own Q/DQ)."""
    import logging

    model = _shared_bias_convs()
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "d", input_feeds(model, 8))
    dipoorlet.quantize(model=path, input_dir=data, data_num=8, deploy="rv", output_dir=tmp_path / "rv",
                       skip_prof_layer=True)
    qm = onnx.load(str(tmp_path / "rv" / "quant_model.onnx"))
    params = json.loads((tmp_path / "rv" / "rv_quantized_param.json").read_text())["quantize_parameters"]
    sw = _dq_scale(qm, "w").reshape(-1)
    for node, act in (("conv_a", "x"), ("conv_b", "ya")):
        want = (np.float32(_dq_scale(qm, act).reshape(-1)[0]) * sw).astype(np.float32)
        np.testing.assert_allclose(params[f"@{node}:bias"]["scale"], want, rtol=1e-6)
    with caplog.at_level(logging.WARNING):
        dipoorlet.quantize(model=path, input_dir=data, data_num=8, deploy="qnn", output_dir=tmp_path / "qnn",
                           skip_prof_layer=True)
    # since session 41 each layer reads a copy of the shared bias (bias_correction.give_biases), so
    # each has its own grid, and the encodings' one-grid-per-tensor warning has nothing to say
    assert "is read by conv_a, conv_b" not in caplog.text
    qm = onnx.load(str(tmp_path / "qnn" / "quant_model.onnx"))
    biases = {n.name: n.input[2] for n in qm.graph.node if n.op_type == "Conv"}
    assert len(set(biases.values())) == 2


def test_rv_says_that_toolkit_1_takes_8_bit_grids_only(tmp_path, caplog):
    """--w_bits 4 on -D rv wrote qtype u4 without a word; RKNN-Toolkit 1's asymmetric_affine
    quantization is u8 only (found by a hunt)."""
    import logging

    with caplog.at_level(logging.WARNING):
        _, _ = quantize_rv(tmp_path, w_bits=4)
    assert "RKNN-Toolkit 1's asymmetric_affine quantization takes u8 only" in caplog.text


def quantize_rv(tmp_path, **kw):
    model = tiny_cnn()
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "d", input_feeds(model, 4))
    res = dipoorlet.quantize(model=path, input_dir=data, data_num=4, deploy="rv", output_dir=tmp_path / "o",
                             skip_prof_layer=True, **kw)
    return res, onnx.load(str(tmp_path / "o" / "quant_model.onnx"))


def test_the_zero_biases_stpu_names_ship_in_transformed_model(tmp_path):
    """stpu's side file names every Conv's bias; a Conv without one gets a zero bias
    (bias_correction.give_biases), so transformed_model.onnx, which holds it, must be written even
    with --no_bc and --no_equalize (a review found stpu_minmax.json naming a bias no shipped graph
    had)."""
    from conftest import input_feeds, quantize_model, rand

    model = _four_convs({f"w{i}": rand((2, 2, 1, 1), i) for i in (1, 2, 3, 4)}, 2)
    quantize_model(tmp_path, model, feeds=input_feeds(model, 2), deploy="stpu", skip_prof_layer=True,
                   bias_correction=False, equalize=False)
    doc = json.loads((tmp_path / "out" / "stpu_minmax.json").read_text())
    shipped = onnx.load(str(tmp_path / "out" / "transformed_model.onnx"))
    convs = {n.name: n for n in shipped.graph.node if n.op_type == "Conv"}
    named = [k[:-len("_bias")] for k in doc if k.endswith("_bias")]     # <layer>_bias
    assert sorted(named) == sorted(convs) and all(len(convs[n].input) == 3 and convs[n].input[2] for n in named)


# deploy -> (side file, where its activation table sits, the key of a tensor in it)
_TABLES = {"qnn": ("qnn_encodings.json", ["activation_encodings"], str),
           "snpe": ("snpe_encodings.json", ["activation_encodings"], str),
           "rk": ("rk_quantized_param.json", ["quantize_parameters"], str),
           "rv": ("rv_quantized_param.json", ["quantize_parameters"], str),
           "stpu": ("stpu_minmax.json", [], str),
           "ti": ("ti_blob_range.json", ["blob_range"], str),
           "imx": ("imx_scale.json", ["blob_range"], str)}


@pytest.mark.parametrize("shape_reader", [False, True])
@pytest.mark.parametrize("deploy", sorted(_TABLES))
def test_a_fused_activation_reaching_its_grid_through_a_transpose_and_flatten(tmp_path, deploy, shape_reader):
    """Conv -> PRelu -> Transpose -> Flatten -> MatMul on qnn: the grid sits on the Flatten's output
    (what the MatMul reads), which the PRelu's output reaches unchanged. The report called the PRelu
    "kept float: no grid left" with no reason, and the encodings had nothing for its output
    (found by a hunt on MTCNN's ONet). A Shape reading the Transpose's output (torch's
    ``x.view(x.size(0), -1)``) reads no values and does not end the chain."""
    from conftest import quantize_model, rand

    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("PRelu", ["c", "S"], ["p"], name="prelu"),
             helper.make_node("Transpose", ["p"], ["t"], name="tr", perm=[0, 2, 3, 1]),
             helper.make_node("Flatten", ["t"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "M"], ["y"], name="fc")]
    outputs = [vi("y", [1, 5])]
    if shape_reader:
        nodes.append(helper.make_node("Shape", ["t"], ["ts"], name="shape"))
        outputs.append(helper.make_tensor_value_info("ts", onnx.TensorProto.INT64, [4]))
    model = make_model(nodes, [vi("x", [1, 3, 4, 4])], outputs,
                       {"W": rand((8, 3, 3, 3), 0), "B": rand((8,), 1), "S": np.full((8, 1, 1), 0.25, np.float32),
                        "M": rand((128, 5), 2)})
    res, _ = quantize_model(tmp_path, model, n=8, deploy=deploy)
    decision = {d["node"]: d for d in res.report["decisions"]}["prelu"]
    assert decision["quantized"], decision
    name, path, key = _TABLES[deploy]
    table = json.loads((tmp_path / "out" / name).read_text())
    for part in path:
        table = table[part]
    if deploy == "rv":          # keyed by the producing node: @prelu:out0, @tr:out0, @flat:out0
        assert table["@prelu:out0"] == table["@tr:out0"] == table["@flat:out0"]
    else:
        assert table[key("p")] == table[key("t")] == table[key("f")]


def test_a_node_whose_own_input_grid_was_dropped_stays_float_past_a_reshape(tmp_path):
    """Add(a, C) -> Reshape -> MatMul on snpe with a 0 in every calibration sample: the Add keeps its
    "kept float: no grid left (a 0 in every calibration sample)" decision (a review found the
    pass-through rule calling it quantized)."""
    from conftest import quantize_model, zero_input_add_model

    model, feeds = zero_input_add_model()
    res, _ = quantize_model(tmp_path, model, feeds=feeds, deploy="snpe")
    decision = {d["node"]: d for d in res.report["decisions"]}["add"]
    assert not decision["quantized"] and "0 in every calibration sample" in decision["reason"], decision
