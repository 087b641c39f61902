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


def test_custom_op_lib_given_as_a_bare_relative_name_loads(tmp_path, capsys, monkeypatch):
    # onnxruntime's loader searches the library path for a bare name, not the working folder
    import shutil
    shutil.copy(ox.get_library_path(), tmp_path / "ext.so")
    monkeypatch.chdir(tmp_path)
    path = save(custom_model(), tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", _feeds(2))
    rc = main(["-M", str(path), "-I", str(data), "-N", "2", "-D", "trt", "-O", str(tmp_path / "out"),
               "-A", "minmax", "--custom_op_lib", "ext.so"])
    assert rc == 0, capsys.readouterr().err


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


def test_custom_op_outputs_as_untyped_network_outputs(tmp_path, capsys):
    """Exporters of custom ops often declare their outputs without a type: onnxruntime's types
    go onto the graph outputs, and the written model passes onnx.checker."""
    model = custom_model()
    del model.graph.node[2:]
    del model.graph.output[:]
    model.graph.output.extend([onnx.ValueInfoProto(name="neg"), onnx.ValueInfoProto(name="pos")])
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", _feeds(4))
    out = tmp_path / "out"
    rc = main(["-M", str(path), "-I", str(data), "-N", "4", "-D", "trt", "-O", str(out), "-A", "minmax",
               "--custom_op_lib", ox.get_library_path()])
    assert rc == 0, capsys.readouterr().err
    qm = onnx.load(str(out / "quant_model.onnx"))
    assert {o.name: o.type.tensor_type.elem_type for o in qm.graph.output} == {"neg": 1, "pos": 1}


def test_custom_op_inside_an_if_without_its_library_names_the_op_and_the_flag(tmp_path, capsys):
    inner = helper.make_graph([helper.make_node("NegPos", ["c1"], ["n", "p"], name="negpos", domain="ai.onnx.contrib"),
                               helper.make_node("Sub", ["p", "n"], ["a_then"], name="abs")],
                              "then", [], [vi("a_then", [1, 6, 8, 8])])
    other = helper.make_graph([helper.make_node("Identity", ["c1"], ["a_else"], name="same")],
                              "else", [], [vi("a_else", [1, 6, 8, 8])])
    base = custom_model()
    nodes = [base.graph.node[0],
             helper.make_node("ReduceMean", ["c1"], ["m"], name="mean", keepdims=0),
             helper.make_node("Greater", ["m", "zero"], ["flag"], name="gt"),
             helper.make_node("If", ["flag"], ["a"], name="if", then_branch=inner, else_branch=other),
             base.graph.node[3]]
    graph = helper.make_graph(nodes, "g", list(base.graph.input), list(base.graph.output),
                              initializer=list(base.graph.initializer)
                              + [onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    model = helper.make_model(graph, opset_imports=list(base.opset_import))
    path = save(model, tmp_path / "m.onnx")
    data = write_samples(tmp_path / "data", _feeds(2))
    rc = main(["-M", str(path), "-I", str(data), "-N", "2", "-D", "trt", "-O", str(tmp_path / "out")])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("dipoorlet: error:")]
    assert rc == 2 and len(err) == 1
    assert "NegPos (ai.onnx.contrib)" in err[0] and "--custom_op_lib" in err[0]
