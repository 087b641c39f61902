"""--val_dir: the error profile on held-out samples, and the values beyond each calibrated grid."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from conftest import input_feeds, ort_run, save, tiny_cnn, write_samples


def _grid(qmodel: onnx.ModelProto, tensor: str):
    """(scale, zero point, qmin, qmax) of the Q that reads ``tensor``."""
    inits = {t.name: numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    for n in qmodel.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] == tensor:
            zp = inits[n.input[2]]
            info = np.iinfo(zp.dtype)
            return float(inits[n.input[1]]), float(zp), info.min, info.max
    raise AssertionError(f"no Q reads {tensor}")


def _cosine(a, b):
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


@pytest.fixture
def case(tmp_path):
    model = tiny_cnn()
    save(model, tmp_path / "m.onnx")
    calib = input_feeds(model, 6, seed=1)
    write_samples(tmp_path / "calib", calib)
    # held-out inputs three times as wide: the input's grid, fitted on calibration, saturates
    val = [{"x": f["x"] * 3.0} for f in input_feeds(model, 5, seed=2)]
    write_samples(tmp_path / "val", val)
    return tmp_path, model, val


def _cli(tmp, *args):
    return subprocess.run([sys.executable, "-m", "dipoorlet", "-M", str(tmp / "m.onnx"), "-I", str(tmp / "calib"),
                           "-N", "6", "-D", "trt", "-A", "minmax", *args], capture_output=True, text=True, timeout=120)


def test_the_profile_reads_the_held_out_samples_and_counts_what_saturates(case):
    tmp, model, val = case
    res = _cli(tmp, "-O", str(tmp / "out"), "--val_dir", str(tmp / "val"), "--no_bc")
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp / "out" / "report.json").read_text())
    assert rep["profile_samples"] == 5 and rep["profile_data"] == str(tmp / "val")
    qmodel = onnx.load(str(tmp / "out" / "quant_model.onnx"))

    # network output cosine: the float and the quantized model on the held-out samples (numpy/onnxruntime oracle)
    cos = [_cosine(ort_run(model, f)[0], ort_run(qmodel, f)[0]) for f in val]
    out = rep["outputs"][0]
    assert out["cosine"] == pytest.approx(np.mean(cos), abs=1e-5)
    assert out["min_cosine"] == pytest.approx(min(cos), abs=1e-5)

    # the input's saturation: counted in numpy from the Q's own grid
    scale, zp, qmin, qmax = _grid(qmodel, "x")
    lo, hi = (qmin - zp) * scale, (qmax - zp) * scale
    x = np.concatenate([f["x"].reshape(-1) for f in val]).astype(np.float64)
    beyond = x[(x > hi + scale / 2) | (x < lo - scale / 2)]
    assert beyond.size > 0
    row = {w["tensor"]: w for w in rep["clipped"]["worst"]}["x"]
    assert row["values"] == beyond.size
    assert row["fraction"] == pytest.approx(beyond.size / x.size)
    assert row["peak_over_range"] == pytest.approx(max(x.max() / hi, x.min() / lo), rel=1e-5)
    lost = float(np.sum((beyond - np.clip(beyond, lo, hi)) ** 2))
    assert row["saturation_over_rounding_noise"] == pytest.approx(lost / x.size / (scale ** 2 / 12), rel=1e-4)
    md = (tmp / "out" / "report.md").read_text()
    assert "5 held-out samples from --val_dir" in md and "Values beyond the calibrated ranges" in md
    assert "saturate on these samples" in res.stderr + res.stdout
    # the share as a percentage ("1 of its values" read as one value where all 152 were; a hunt)
    w = rep["clipped"]["worst"][0]
    assert f"{w['tensor']}: {100 * w['fraction']:.3g}% of its values" in res.stderr + res.stdout


def test_without_val_dir_the_profile_reads_calibration_samples_and_counts_nothing(case):
    tmp, model, _ = case
    res = _cli(tmp, "-O", str(tmp / "out"), "--no_bc")
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp / "out" / "report.json").read_text())
    assert "profile_data" not in rep and "clipped" not in rep and rep["profile_samples"] == 6
    assert "Values beyond" not in (tmp / "out" / "report.md").read_text()
    # the output cosine is the calibration samples' (oracle: onnxruntime on those files)
    qmodel = onnx.load(str(tmp / "out" / "quant_model.onnx"))
    feeds = [{"x": np.load(tmp / "calib" / "x" / f"{i}.npy")} for i in range(6)]
    cos = [_cosine(ort_run(model, f)[0], ort_run(qmodel, f)[0]) for f in feeds]
    assert rep["outputs"][0]["cosine"] == pytest.approx(np.mean(cos), abs=1e-5)


def test_minmax_grids_hold_the_calibration_inputs(case):
    """--val_dir pointing at the calibration samples themselves: minmax grids span the float
    model's values, so the input saturates nowhere; a tensor after quantized layers may overshoot
    its float range by their error, but only slightly."""
    tmp, _, _ = case
    res = _cli(tmp, "-O", str(tmp / "out"), "--no_bc", "--val_dir", str(tmp / "calib"))
    assert res.returncode == 0, res.stderr
    clipped = json.loads((tmp / "out" / "report.json").read_text())["clipped"]
    assert clipped["tensors"] == 5
    assert "x" not in {w["tensor"] for w in clipped["worst"]}
    assert all(1.0 < w["peak_over_range"] < 1.1 for w in clipped["worst"])


def test_val_num_reads_k_samples_spread_over_the_folder(case):
    tmp, model, val = case
    res = _cli(tmp, "-O", str(tmp / "out"), "--val_dir", str(tmp / "val"), "--val_num", "2", "--skip_prof_layer")
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp / "out" / "report.json").read_text())
    assert rep["profile_samples"] == 2
    qmodel = onnx.load(str(tmp / "out" / "quant_model.onnx"))
    picked = [val[0], val[2]]      # 2 of 5, spread: samples 0 and 2
    cos = [_cosine(ort_run(model, f)[0], ort_run(qmodel, f)[0]) for f in picked]
    assert rep["outputs"][0]["cosine"] == pytest.approx(np.mean(cos), abs=1e-5)


def test_a_quantized_network_output_is_counted_before_its_q(case):
    """snpe quantizes the network output itself: its producer writes logits_float, the DQ writes
    logits; what saturates is logits_float (oracle: onnxruntime exposing it, numpy counting)."""
    tmp, _, val = case
    res = _cli(tmp, "-O", str(tmp / "out"), "--val_dir", str(tmp / "val"), "--no_bc", "-D", "snpe")
    assert res.returncode == 0, res.stderr
    qmodel = onnx.load(str(tmp / "out" / "quant_model.onnx"))
    scale, zp, qmin, qmax = _grid(qmodel, "logits_float")
    exposed = onnx.load(str(tmp / "out" / "quant_model.onnx"))
    exposed.graph.output.append(onnx.helper.make_tensor_value_info("logits_float", onnx.TensorProto.FLOAT, None))
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(exposed.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.concatenate([sess.run(["logits_float"], f)[0].reshape(-1) for f in val]).astype(np.float64)
    lo, hi = (qmin - zp) * scale, (qmax - zp) * scale
    beyond = int(np.count_nonzero((x > hi + scale / 2) | (x < lo - scale / 2)))
    assert beyond > 0
    rows = {w["tensor"]: w for w in json.loads((tmp / "out" / "report.json").read_text())["clipped"]["worst"]}
    assert rows["logits"]["values"] == beyond


@pytest.mark.parametrize("op, value, what", [("Exp", 100.0, "inf"), ("Sqrt", -4.0, "nan")])
def test_non_finite_activations_do_not_break_the_run(tmp_path, op, value, what):
    """Exp(100) overflows float32 and Sqrt(-4) is NaN in the held-out data: the run still ends with
    its summary; an infinite saturation shows as inf, NaN values are counted apart."""
    from conftest import make_model, rand, vi
    from onnx import helper

    nodes = [helper.make_node(op, ["x"], ["e"], name="act"),
             helper.make_node("Conv", ["e", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])],
                       {"w": rand((4, 3, 3, 3), 0, 0.3), "b": rand((4,), 1, 0.1)})
    save(model, tmp_path / "m.onnx")
    write_samples(tmp_path / "calib", [{"x": np.abs(rand((1, 3, 8, 8), i))} for i in range(6)])
    held = np.abs(rand((1, 3, 8, 8), 9))
    held[0, 0, 0, 0] = value
    write_samples(tmp_path / "val", [{"x": held}])
    res = _cli(tmp_path, "-O", str(tmp_path / "out"), "--val_dir", str(tmp_path / "val"))
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    if what == "inf":
        assert rep["clipped"]["worst"][0]["tensor"] == "e"
        assert rep["clipped"]["worst"][0]["saturation_over_rounding_noise"] is None    # inf
        assert "inf" in res.stderr + res.stdout
    else:
        assert rep["clipped"]["nan_values"] == 1


def test_a_bad_held_out_sample_stops_the_run_before_any_pass(case):
    tmp, _, val = case
    bad = [dict(f) for f in val]
    bad[3] = {"x": np.zeros((1, 3, 8, 8), np.float32)}
    write_samples(tmp / "val_bad", bad)
    res = _cli(tmp, "-O", str(tmp / "out"), "--val_dir", str(tmp / "val_bad"))
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.startswith("dipoorlet: error:")]
    assert len(lines) == 1 and "3.npy" in lines[0] and "has shape" in lines[0]
    assert "get Q/DQ on" not in res.stderr      # placement, calibration: never reached


@pytest.mark.parametrize("args, words", [
    (["--val_dir", "{tmp}/nowhere"], ["validation data", "nowhere", "does not exist", "--val_dir"]),
    (["--val_dir", "{tmp}/val", "--val_num", "9"], ["--val_num is 9", "lower --val_num"]),
    (["--val_num", "3"], ["--val_num", "--val_dir"]),
    (["--val_dir", "{tmp}/val", "--val_num", "0"], ["--val_num must be a positive integer"]),
    (["--val_dir", "{tmp}/val", "--prof_samples", "3"], ["--prof_samples", "--val_num"]),
    (["--val_dir", "{tmp}/val", "--savefp"], ["--savefp", "--val_dir"]),
    (["--val_dir", "{tmp}/empty"], ["no folder for model input 'x'", "empty"]),
    (["--val_dir", "{tmp}/badshape"], ["has shape", "expects"]),
    (["--val_dir", "{tmp}/nan"], ["NaN/Inf", "validation data must be finite"]),
    # samples after a gap in the numbering went unread without a word
    (["--val_dir", "{tmp}/gap"], ["no sample 1.npy", "1 sample files numbered above it", "without gaps"]),
])
def test_bad_validation_data_is_one_line_and_nothing_is_written(case, args, words):
    tmp, _, _ = case
    (tmp / "empty").mkdir()
    write_samples(tmp / "badshape", [{"x": np.zeros((1, 3, 8, 8), np.float32)}])
    bad = np.zeros((1, 3, 16, 16), np.float32)
    bad[0, 0, 0, 0] = np.nan
    write_samples(tmp / "nan", [{"x": bad}])
    write_samples(tmp / "gap", [{"x": np.zeros((1, 3, 16, 16), np.float32)}] * 3)
    (tmp / "gap" / "x" / "1.npy").unlink()
    res = _cli(tmp, "-O", str(tmp / "out"), *[a.format(tmp=tmp) for a in args])
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("dipoorlet: error:")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert not (tmp / "out" / "quant_model.onnx").exists()


def test_sensitivity_and_auto_skip_score_on_the_held_out_samples(case):
    """With --val_dir the isolated analysis and --auto_skip's trials run on held-out samples:
    --auto_skip's starting score (every layer quantized) is the float-vs-quantized output cosine
    of the written model on those samples, computed here with onnxruntime; on the calibration
    samples it is another number."""
    tmp, model, val = case
    res = _cli(tmp, "-O", str(tmp / "out"), "--val_dir", str(tmp / "val"), "--no_bc", "--sens_samples", "5",
               "--auto_skip", "cosine:0.01")
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp / "out" / "report.json").read_text())
    assert rep["sensitivity_samples"] == 5 and rep["sensitivity_held_out"] is True
    assert rep["auto_skip"]["float_layers"] == []          # met before any trial: the model as written
    qmodel = onnx.load(str(tmp / "out" / "quant_model.onnx"))
    held_out = np.mean([_cosine(ort_run(model, f)[0], ort_run(qmodel, f)[0]) for f in val])
    calib = np.mean([_cosine(ort_run(model, f)[0], ort_run(qmodel, f)[0])
                     for f in input_feeds(model, 6, seed=1)[:5]])
    assert abs(held_out - calib) > 1e-3                    # the two sets tell apart
    assert rep["auto_skip"]["before"]["cosine"] == pytest.approx(held_out, abs=1e-5)
    assert "5 held-out samples from --val_dir" in (tmp / "out" / "report.md").read_text()
    assert "5 held-out samples from --val_dir" in (tmp / "out" / "report.html").read_text()

    # --val_num 3: the sensitivity reads 3 of the profile's 3 samples (0, 1, 3 of the 5), not 5
    res = _cli(tmp, "-O", str(tmp / "three"), "--val_dir", str(tmp / "val"), "--val_num", "3", "--no_bc",
               "--sens_samples", "8", "--auto_skip", "cosine:0.01")
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp / "three" / "report.json").read_text())
    assert rep["sensitivity_samples"] == 3 and rep["profile_samples"] == 3
    three = np.mean([_cosine(ort_run(model, val[i])[0], ort_run(qmodel, val[i])[0]) for i in (0, 1, 3)])
    assert rep["auto_skip"]["before"]["cosine"] == pytest.approx(three, abs=1e-5)

    # without --val_dir: the calibration samples, and the report says so
    res = _cli(tmp, "-O", str(tmp / "cal"), "--no_bc", "--sens_samples", "6", "--auto_skip", "cosine:0.01")
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp / "cal" / "report.json").read_text())
    assert rep["sensitivity_held_out"] is False
    qmodel = onnx.load(str(tmp / "cal" / "quant_model.onnx"))
    calib = np.mean([_cosine(ort_run(model, f)[0], ort_run(qmodel, f)[0]) for f in input_feeds(model, 6, seed=1)])
    assert rep["auto_skip"]["before"]["cosine"] == pytest.approx(calib, abs=1e-5)
