"""Models with custom ops (onnxruntime-extensions' NegPos, domain ai.onnx.contrib): with
--custom_op_lib every pass runs them, they stay float and the layers around them are quantized;
without it, one line that names the op and the flag."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import rand, save, vi, write_samples
from dipoorlet.cli import main

ox = pytest.importorskip("onnxruntime_extensions")


def custom_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("NegPos", ["c1"], ["neg", "pos"], name="negpos", domain="ai.onnx.contrib"),
             helper.make_node("Sub", ["pos", "neg"], ["a"], name="abs"),
             helper.make_node("Conv", ["a", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "g", [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])],
                              initializer=[onnx.numpy_helper.from_array(rand((6, 3, 3, 3), 0, 0.3), "w1"),
                                           onnx.numpy_helper.from_array(rand((4, 6, 3, 3), 1, 0.2), "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("ai.onnx.contrib", 1)])


def _session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(ox.get_library_path())
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def _feeds(n):
    r = np.random.default_rng(5)
    return [{"x": r.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(n)]


@pytest.mark.parametrize("deploy, extra", [("trt", []), ("snpe", []), ("trt", ["--gptq"])])
def test_custom_op_stays_float_and_its_neighbours_are_quantized(tmp_path, capsys, deploy, extra):
    model = custom_model()
    path = save(model, tmp_path / "m.onnx")
    feeds = _feeds(6)
    data = write_samples(tmp_path / "data", feeds)
    out = tmp_path / "out"
    rc = main(["-M", str(path), "-I", str(data), "-N", "6", "-D", deploy, "-O", str(out), "-A", "minmax",
               "--custom_op_lib", ox.get_library_path(), *extra])
    assert rc == 0, capsys.readouterr().err
    qm = onnx.load(str(out / "quant_model.onnx"))
    node = {n.name: n for n in qm.graph.node}
    assert node["negpos"].domain == "ai.onnx.contrib"
    # conv2 reads the custom op's (typed by onnxruntime) output through Q/DQ
    assert node["conv2"].input[0] != "a" and any(n.op_type == "DequantizeLinear" and n.output[0] == node["conv2"].input[0]
                                                  for n in qm.graph.node)
    f, q = _session(model), _session(qm)
    for x in feeds:
        a, b = f.run(None, x)[0].ravel(), q.run(None, x)[0].ravel()
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


def test_custom_op_without_its_library_is_one_line_naming_the_flag(tmp_path, capsys):
    path = save(custom_model(), tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", _feeds(2))
    rc = main(["-M", str(path), "-I", str(data), "-N", "2", "-D", "trt", "-O", str(tmp_path / "out")])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("dipoorlet: error:")]
    assert rc == 2 and len(err) == 1
    assert "NegPos (ai.onnx.contrib)" in err[0] and "--custom_op_lib" in err[0]


def test_custom_op_lib_that_is_not_a_file_is_one_line(tmp_path, capsys):
    path = save(custom_model(), tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", _feeds(2))
    rc = main(["-M", str(path), "-I", str(data), "-N", "2", "-D", "trt", "-O", str(tmp_path / "out"),
               "--custom_op_lib", str(tmp_path / "nope.so")])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("dipoorlet: error:")]
    assert rc == 2 and len(err) == 1 and "nope.so" in err[0] and "not a file" in err[0]


def test_custom_op_lib_that_onnxruntime_cannot_load_is_one_line(tmp_path, capsys):
    path = save(custom_model(), tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", _feeds(2))
    bogus = tmp_path / "bogus.so"
    bogus.write_bytes(b"not a shared library")
    rc = main(["-M", str(path), "-I", str(data), "-N", "2", "-D", "trt", "-O", str(tmp_path / "out"),
               "--custom_op_lib", str(bogus)])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("dipoorlet: error:")]
    assert rc == 2 and len(err) == 1 and "bogus.so" in err[0] and "cannot load" in err[0]
