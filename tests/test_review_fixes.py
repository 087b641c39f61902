"""Regression tests for defects found in review: subgraphs, bias shapes, NaN inside the model,
grid sharing across chains, node-name collisions."""
from __future__ import annotations

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


def test_nan_inside_the_model_leaves_that_tensor_float(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Sqrt", ["c"], ["s"], name="sqrt"),      # NaN where c < 0
        helper.make_node("Conv", ["s", "w2"], ["y"], name="conv2"),
    ]
    inits = {"w": rand((4, 3, 3, 3), 0, 0.3), "w2": rand((4, 4, 1, 1), 1, 0.3)}
    model = make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", [1, 4, 6, 6])], inits)
    _, qm = quantize_model(tmp_path, model, n=2, act_quant="mse", skip_prof_layer=True)
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == "s" for n in qm.graph.node)


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
