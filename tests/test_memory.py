"""Calibration memory does not grow with -N: the range and histogram passes stream samples.

tracemalloc traces numpy's allocations (and onnxruntime's output arrays, which numpy owns), so
a pass that kept every sample or activation alive would show a peak growing with N.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from conftest import conv_model, rand, save, write_samples
from dipoorlet import calibrate, platform as platform_mod
from dipoorlet.data import DataSource, input_specs
from dipoorlet.dist import SingleProcess
from dipoorlet.graph import Graph
from dipoorlet.placement import place
from dipoorlet.prepare import prepare

HW = 64  # a sample is 48 KiB, each activation 128 KiB


def _calibration_peak(tmp_path, n: int, layout: str) -> int:
    model_path = save(conv_model(cin=3, cout=8, hw=HW), tmp_path / "model.onnx")
    feeds = [{"x": rand((1, 3, HW, HW), i)} for i in range(n)]
    if layout == "npz":
        data = tmp_path / "calib.npz"
        np.savez(data, x=np.concatenate([f["x"] for f in feeds]))
    else:
        data = write_samples(tmp_path / "data", feeds)
    g = Graph.load(model_path)
    prepare(g)
    targets = list(place(g, platform_mod.load("trt")).activations)
    source = DataSource(data, input_specs(g), n)
    comm = SingleProcess()
    tracemalloc.start()
    try:
        stats = calibrate.collect(g, source, range(n), targets, comm, histograms=True, bins=2048)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stats["x"].hist.counts.sum() == n * 3 * HW * HW  # the passes really saw every sample
    return peak


def _assert_flat(small: int, large: int):
    # 56 more samples would add 2.7 MiB of input alone if any were kept
    assert large - small < max(0.15 * small, 1 << 20), (small, large)


def test_calibration_peak_memory_does_not_grow_with_n(tmp_path):
    small = _calibration_peak(tmp_path / "8", 8, "folder")
    large = _calibration_peak(tmp_path / "64", 64, "folder")
    _assert_flat(small, large)


def test_calibration_peak_memory_does_not_grow_with_n_for_npz(tmp_path):
    small = _calibration_peak(tmp_path / "8", 8, "npz")
    large = _calibration_peak(tmp_path / "64", 64, "npz")
    _assert_flat(small, large)


def test_sessions_let_go_of_the_serialized_model():
    """onnxruntime's Python session keeps the bytes it was built from (``_model_bytes``): one
    more copy of the whole model per live session (302 MB MatMul stack: the profile's two
    sessions held 0.4 GB of them)."""
    from dipoorlet.runtime import Runner

    runner = Runner(conv_model(), ["y"])
    assert getattr(runner.session, "_model_bytes", None) is None
    x = rand((1, 3, 8, 8), 1)
    assert runner.run({"x": x})[0]["y"].shape == (1, 4, 8, 8)


def _shared_weight_model(ir_version=None):
    """mm1 and mm2 read one weight; returns the model and a feed."""
    from onnx import helper

    from conftest import make_model, vi

    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm1"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w"], ["b"], name="mm2"),
             helper.make_node("MatMul", ["b", "w2"], ["y"], name="mm3")]
    model = make_model(nodes, [vi("x", [2, 8])], [vi("y", [2, 8])], {"w": rand((8, 8), 2, 0.4),
                                                                      "w2": rand((8, 8), 3, 0.4)})
    if ir_version is not None:
        # torch's keep_initializers_as_inputs=True (and IR 3 models) list them among the inputs too
        model.ir_version = ir_version
        model.graph.input.extend(helper.make_tensor_value_info(t.name, 1, list(t.dims))
                                 for t in model.graph.initializer)
    return model


@pytest.mark.parametrize("ir_version", [None, 7])
def test_quantized_model_built_without_replaced_weights_keeps_a_shared_one(tmp_path, ir_version):
    """insert_qdq copies the model without the weights it quantizes (copy_model): a weight another
    layer reads float (mm2 skipped) comes back; a replaced one leaves no graph input behind."""
    import onnx

    from conftest import input_feeds, ort_run, quantize_model

    model = _shared_weight_model(ir_version)
    _, qm = quantize_model(tmp_path, model, n=3, skip_layers=["mm2"], skip_prof_layer=True)
    inits = {t.name for t in qm.graph.initializer}
    assert "w" in inits and "w2" not in inits
    assert qm.graph.initializer[0].name == "w"       # where it was: the written model as before
    assert next(n for n in qm.graph.node if n.name == "mm2").input[1] == "w"
    assert {i.name for i in qm.graph.input} - inits == {"x"}
    onnx.checker.check_model(qm)
    feed = input_feeds(model, 1, seed=5)[0]
    ref = ort_run(model, feed)[0]
    got = ort_run(qm, feed)[0]
    assert np.corrcoef(ref.ravel(), got.ravel())[0, 1] > 0.99


def test_model_with_initializers_appended_as_bytes_runs_as_the_whole_model():
    """A lean copy (no initializers) plus the source's initializers appended as serialized bytes
    is the model itself: same outputs as the whole model's session."""
    import onnx

    from dipoorlet.graph import copy_model
    from dipoorlet.runtime import Runner

    model = _shared_weight_model()
    lean = copy_model(model, {t.name for t in model.graph.initializer})
    assert not lean.graph.initializer and len(lean.graph.node) == len(model.graph.node)
    feed = {"x": rand((2, 8), 4)}
    whole = Runner(model, ["y", "a"]).run(feed)[0]
    joined = Runner(lean, ["y", "a"], initializers=model.graph).run(feed)[0]
    for k in ("y", "a"):
        np.testing.assert_array_equal(joined[k], whole[k])
    assert not lean.graph.initializer and len(lean.graph.output) == 1      # left as it was
    with pytest.raises(Exception):
        Runner(lean, ["y"])          # the oracle: without them it is no model
    onnx.checker.check_model(model)
