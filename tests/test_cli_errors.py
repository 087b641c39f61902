"""Every bad input through the CLI: exit code 2, one line naming the thing, nothing half-written."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import conv_model, input_feeds, make_model, rand, save, vi, write_samples
from dipoorlet.cli import main
from dipoorlet.errors import DipoorletError
from dipoorlet.platform import platforms_dir


@pytest.fixture(autouse=True)
def _close_log_handlers():
    yield
    root = logging.getLogger("dipoorlet")
    for h in list(root.handlers):
        h.close()
        root.removeHandler(h)


class Case:
    """A valid run (conv model, 2 .npy samples) that each test breaks in one way."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.model = save(conv_model(), tmp / "model.onnx")
        self.data = write_samples(tmp / "data", input_feeds(conv_model(), 2))
        self.out = tmp / "out"
        self.args = {"-M": str(self.model), "-I": str(self.data), "-N": "2", "-D": "trt", "-O": str(self.out),
                     "-A": "minmax"}
        self.extra: list[str] = []

    def argv(self) -> list[str]:
        return [a for kv in self.args.items() for a in kv] + self.extra


def run_cli(case: Case, capsys):
    blocked = getattr(case, "block_torch", False)
    saved = sys.modules.get("torch", "absent")
    if blocked:
        sys.modules["torch"] = None         # import torch now raises ImportError, as without the extra
    try:
        rc = main(case.argv())
    finally:
        if blocked:
            if saved == "absent":
                del sys.modules["torch"]
            else:
                sys.modules["torch"] = saved
    err = capsys.readouterr().err
    return rc, err


def error_lines(stderr: str) -> list[str]:
    return [l for l in stderr.splitlines() if l.startswith("dipoorlet: error:")]


def assert_nothing_written(case: Case):
    leftovers = [p for pat in ("quant_model.onnx", ".dipoorlet-staging-*", "*.tmp", "*.json", "*.cache", "report.md", "report.html")
                 for p in case.tmp.rglob(pat)]
    assert leftovers == []
    if case.out.is_file():
        assert case.out.read_text() == "not a folder"
    elif case.out.is_dir():
        assert {p.name for p in case.out.iterdir()} <= {"dipoorlet.log"}


# ---- the bad inputs ---------------------------------------------------------------------------
def missing_model(c):
    c.args["-M"] = str(c.tmp / "nope" / "model.onnx")
    return ["nope/model.onnx", "does not exist"]


def model_is_a_folder(c):
    (c.tmp / "adir").mkdir()
    c.args["-M"] = str(c.tmp / "adir")
    return ["adir", "folder"]


def not_onnx(c):
    p = c.tmp / "junk.onnx"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    c.args["-M"] = str(p)
    return ["junk.onnx"]


def external_data_missing(c):
    path = c.tmp / "ext" / "model.onnx"
    path.parent.mkdir()
    onnx.save_model(conv_model(cin=8, cout=16), str(path), save_as_external_data=True,
                    location="model.onnx.data", size_threshold=1024)
    (path.parent / "model.onnx.data").unlink()
    c.args["-M"] = str(path)
    return ["ext/model.onnx", "model.onnx.data"]


def custom_op(c):
    model = make_model([
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Bar", ["c"], ["y"], name="bar", domain="com.foo"),
    ], [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])], {"w": rand((4, 3, 3, 3))},
        extra_opsets=[("com.foo", 1)], check=False)
    c.args["-M"] = str(save(model, c.tmp / "custom.onnx"))
    return ["onnxruntime", "Bar"]


def input_dir_missing(c):
    c.args["-I"] = str(c.tmp / "no_data")
    return ["no_data", "does not exist"]


def input_folder_missing(c):
    (c.tmp / "other").mkdir()
    (c.tmp / "other" / "y").mkdir()
    c.args["-I"] = str(c.tmp / "other")
    return ["'x'", "other"]


def too_few_files(c):
    c.args["-N"] = "5"
    return ["2.bin or 2.npy", "lower -N to 2 (samples 0..1 are there)"]


def sample_named_with_a_non_ascii_digit(c):
    # '\u00b2'.isdigit() is True but int('\u00b2') raises: a stray file so named is not a sample
    np.save(c.data / "x" / "\u00b2.npy", np.zeros((1, 3, 8, 8), np.float32))
    c.args["-N"] = "3"
    return ["2.bin or 2.npy", "lower -N to 2"]


def far_too_many_files(c):
    # found from the folder's names: a loop over every index up to -N never ended
    c.args["-N"] = str(10**12)
    return ["2.bin or 2.npy", "lower -N to 2"]


def npy_without_batch_axis_channels_last(c):
    d = c.tmp / "hwc" / "x"
    d.mkdir(parents=True)
    for i in range(2):
        np.save(d / f"{i}.npy", np.zeros((8, 8, 3), np.float32))     # the model takes [1, 3, 8, 8]
    c.args["-I"] = str(c.tmp / "hwc")
    return ["0.npy has shape [8,8,3] (read as [1,8,8,3], a batch axis added)", "channels last?"]


def bin_wrong_size(c):
    d = c.tmp / "bins" / "x"
    d.mkdir(parents=True)
    for i in range(2):
        rand((1, 3, 8, 7), i).tofile(d / f"{i}.bin")
    c.args["-I"] = str(c.tmp / "bins")
    return ["0.bin", "[1,3,8,8]"]


def nan_in_sample(c):
    d = c.tmp / "nan" / "x"
    d.mkdir(parents=True)
    for i in range(2):
        x = rand((1, 3, 8, 8), i)
        if i == 1:
            x[0, 1, 2, 3] = np.nan
        x.tofile(d / f"{i}.bin")
    c.args["-I"] = str(c.tmp / "nan")
    return [str(d / "1.bin"), "NaN"]


def inf_in_npy(c):
    x = rand((1, 3, 8, 8), 1)
    x[0, 0, 0, 0] = np.inf
    np.save(c.data / "x" / "1.npy", x)
    return [str(c.data / "x" / "1.npy"), "Inf"]


def images_instead_of_samples(c):
    """Image files where the preprocessed tensors belong: the line says what the data must be."""
    d = c.tmp / "imgs" / "x"
    d.mkdir(parents=True)
    for i in range(2):
        (d / f"photo{i}.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    c.args["-I"] = str(c.tmp / "imgs")
    return [str(d), "2 image files", "photo0.jpg", "after its preprocessing", "not images"]


def images_in_input_dir(c):
    d = c.tmp / "imgs_flat"
    d.mkdir()
    (d / "a.png").write_bytes(b"png")
    c.args["-I"] = str(d)
    return ["no folder for model input 'x'", "1 image file such as a.png", "not images"]


def _samples_named(c, folder: str, names: list[str]) -> None:
    d = c.tmp / folder / "x"
    d.mkdir(parents=True)
    for i, name in enumerate(names):
        np.save(d / name, rand((1, 3, 8, 8), i))
    c.args["-I"] = str(c.tmp / folder)


def samples_named_otherwise(c):
    _samples_named(c, "named", ["img_000.npy", "img_001.npy"])
    return ["no sample 0.bin or 0.npy", "img_000.npy, img_001.npy", "name the samples 0.npy, 1.npy"]


def samples_zero_padded(c):
    _samples_named(c, "padded", ["0001.npy", "0002.npy"])
    return ["no sample 0.bin or 0.npy", "numbered 0001.npy ... 0002.npy", "without leading zeros, from 0"]


def too_few_files_beside_a_stray_file(c):
    """Samples 0..1 are there: a stray preview image is not what the line blames."""
    (c.data / "x" / "preview.png").write_bytes(b"png")
    np.save(c.data / "x" / "mean.npy", rand((1, 3, 8, 8), 9))
    c.args["-N"] = "3"
    return ["no sample 2.bin or 2.npy", "lower -N to 2 (samples 0..1 are there)"]


def samples_outside_input_folder(c):
    d = c.tmp / "flat"
    d.mkdir()
    for i in range(2):
        np.save(d / f"{i}.npy", rand((1, 3, 8, 8), i))
    c.args["-I"] = str(d)
    return ["no folder for model input 'x'", "2 sample files such as 0.npy", f"move them into {d / 'x'}"]


def input_folder_misnamed(c):
    (c.data / "x").rename(c.data / "images")
    return ["no folder for model input 'x'", "its folders are images", "name each after a model input ('x')"]


def channels_last_sample(c):
    np.save(c.data / "x" / "1.npy", rand((1, 8, 8, 3), 1))
    return [str(c.data / "x" / "1.npy"), "[1,8,8,3]", "[1,3,8,8]", "channels last", "transpose"]


def channels_last_sample_dynamic_batch(c):
    """Most exported models have a dynamic batch: the hint still applies."""
    model = conv_model()
    for v in (*model.graph.input, *model.graph.output):
        v.type.tensor_type.shape.dim[0].dim_param = "N"
    c.args["-M"] = str(save(model, c.tmp / "dyn_batch.onnx"))
    np.save(c.data / "x" / "1.npy", rand((1, 8, 8, 3), 1))
    return [str(c.data / "x" / "1.npy"), "[1,8,8,3]", "channels last", "transpose"]


def unknown_method(c):
    c.args["-A"] = "kmeans"
    return ["kmeans", "entropy", "minmax", "mse"]


def method_by_other_tools_name(c):
    c.args["-A"] = "kl"
    return ["'kl'", "did you mean entropy?"]


def unknown_platform(c):
    c.args["-D"] = "tpu9000"
    return ["tpu9000", "trt"]


def platform_by_vendor_name(c):
    c.args["-D"] = "tensorrt"
    return ["'tensorrt'", "did you mean trt?", "valid: atlas"]


def platform_misspelt(c):
    c.args["-D"] = "snep"
    return ["'snep'", "did you mean snpe?"]


def platform_folder(c):
    (c.tmp / "specs").mkdir()
    (c.tmp / "specs" / "mine.toml").write_text("")
    c.args["-D"] = str(c.tmp / "specs")
    return ["specs is a folder", "one .toml spec", "mine.toml"]


def output_not_writable(c):
    (c.tmp / "afile").write_text("x")
    c.out = c.tmp / "afile" / "out"
    c.args["-O"] = str(c.out)
    return ["afile/out", "not writable"]


def output_is_a_file(c):
    c.out = c.tmp / "out.txt"
    c.out.write_text("not a folder")
    c.args["-O"] = str(c.out)
    return ["out.txt", "not a folder"]


def nothing_quantizable(c):
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                       [vi("x", [1, 3, 8, 8])], [vi("y", [1, 3, 8, 8])])
    c.args["-M"] = str(save(model, c.tmp / "relu.onnx"))
    return ["relu.onnx", "quantizable"]


def float64_model(c):
    """A model that computes in double: nothing to quantize, and the line says why."""
    from onnx import TensorProto, numpy_helper

    w, b = conv_model().graph.initializer[:2]
    inits = [numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name) for t in (w, b)]
    graph = helper.make_graph([helper.make_node("Conv", ["x", w.name, b.name], ["y"], name="conv", pads=[1] * 4)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1, 4, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    c.args["-M"] = str(save(model, c.tmp / "double.onnx"))
    c.args["-I"] = str(write_samples(c.tmp / "d64", [{"x": np.ones((1, 3, 8, 8))} for _ in range(2)]))
    return ["double.onnx", "float64 (double)", "convert the model to float32"]


def already_quantized_qdq(c):
    """A QDQ model passed as -M (e.g. a quant_model.onnx given back): refused, not quantized twice."""
    w = conv_model().graph.initializer
    inits = {"s": np.float32(0.02), "z": np.int8(0)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="x_q"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="x_dq"),
             helper.make_node("Conv", ["xd", "w", "b"], ["y"], name="conv", pads=[1] * 4)]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])],
                       {**{t.name: onnx.numpy_helper.to_array(t) for t in w}, **inits})
    c.args["-M"] = str(save(model, c.tmp / "qdq.onnx"))
    return ["qdq.onnx", "already quantized", "1 QuantizeLinear", "1 DequantizeLinear", "float model"]


def already_quantized_integer_ops(c):
    """onnxruntime's dynamic quantization (DynamicQuantizeLinear -> ConvInteger) is refused too."""
    inits = {"w": np.ones((4, 3, 3, 3), np.uint8), "wz": np.uint8(0)}
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dq"),
             helper.make_node("ConvInteger", ["xq", "w", "xz", "wz"], ["yi"], name="convint", pads=[1] * 4),
             helper.make_node("Cast", ["yi"], ["y"], name="cast", to=onnx.TensorProto.FLOAT)]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])], inits)
    c.args["-M"] = str(save(model, c.tmp / "dyn.onnx"))
    return ["dyn.onnx", "already quantized", "ConvInteger", "DynamicQuantizeLinear"]


def skip_layer_unknown(c):
    c.extra = ["--skip_layers", "no_such_node"]
    return ["no_such_node", "--skip_layers"]


def score_output_unknown(c):
    c.extra = ["--score_outputs", "no_such_output"]
    return ["no_such_output", "--score_outputs", "not outputs of the model"]


def input_shape_malformed(c):
    c.extra = ["--input_shape", "x:1,3,a"]
    return ["x:1,3,a", "--input_shape"]


def input_shape_static_conflict(c):
    c.extra = ["--input_shape", "x:1,3,4,4"]      # the model's x is [1,3,8,8]
    return ["x:1,3,4,4", "does not fit", "[1,3,8,8]"]


def input_shape_not_the_datas(c):
    """.npy samples of another shape than --input_shape gives a dynamic input: the line says the
    shape came from --input_shape (it said "pass --input_shape")."""
    c.args["-M"] = str(save(conv_model(dynamic_hw=True), c.tmp / "dyn.onnx"))
    c.extra = ["--input_shape", "x:1,3,16,16"]
    return ["[1,3,8,8]", "expects [1,3,16,16] (from --input_shape)", "give --input_shape the data's shape"]


def input_shape_twice(c):
    c.extra = ["--input_shape", "x:1,3,8,8", "x:1,3,8,8"]
    return ["'x'", "twice"]


def input_shape_zero(c):
    c.extra = ["--input_shape", "x:1,3,0,8"]
    return ["x:1,3,0,8", "positive"]


def sample_beyond_float32(c):
    np.save(c.data / "x" / "1.npy", np.full((1, 3, 8, 8), 1e39, np.float64))
    return ["1.npy", "float32's range"]


def platform_op_typo(c):
    text = (platforms_dir() / "trt.toml").read_text(encoding="utf-8")
    assert '"MatMul"' in text
    spec = c.tmp / "typo.toml"
    spec.write_text(text.replace('"MatMul"', '"Matmul"', 1), encoding="utf-8")
    c.args["-D"] = str(spec)
    return ["'Matmul'", "'MatMul'", "not an ONNX op type"]


def model_without_inputs(c):
    node = helper.make_node("Constant", [], ["y"], name="k",
                            value=onnx.numpy_helper.from_array(np.ones((2,), np.float32)))
    save(make_model([node], [], [vi("y", [2])]), c.model)
    return ["no input", "has no inputs"]


def inputs_all_initializers(c):
    m = conv_model()
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((1, 3, 8, 8), np.float32), "x"))
    save(m, c.model)
    return ["no input", "['x']", "initializers"]


def input_shape_unknown_name(c):
    c.extra = ["--input_shape", "image:1,3,8,8"]
    return ["image", "--input_shape"]


def zero_samples(c):
    c.args["-N"] = "0"
    return ["-N"]


def weight_bits_above_8(c):
    c.extra = ["--w_bits", "12"]
    return ["--w_bits", "2..8", "12"]


def activation_bits_12(c):
    c.extra = ["--a_bits", "12"]
    return ["--a_bits", "2..8", "16"]


def activation_bits_16_on_trt(c):
    c.extra = ["--a_bits", "16"]
    return ["--a_bits", "16-bit activations", "trt runs at most 8-bit"]


def layer_bits_a16_on_trt(c):
    c.extra = ["--layer_bits", "conv=a16"]
    return ["--layer_bits conv", "trt runs at most 8-bit"]


def npz_scalar(c):
    np.savez(c.tmp / "d.npz", x=np.float32(1))
    c.args["-I"] = str(c.tmp / "d.npz")
    c.args["-N"] = "1"
    return ["d.npz", "[N, ...] array"]


def bins_too_many(c):
    # a million bins made the mse search ask for 202 GiB and die with a traceback
    c.args["-A"] = "mse"
    c.extra = ["--bins", "1000000"]
    return ["--bins", "16384", "2048"]


def npz_header_claims_more_rows(c):
    # the member's header says 5 samples, the file stores 2: a truncated or doctored .npz
    path = c.tmp / "d.npz"
    np.savez(path, x=np.stack([rand((1, 3, 8, 8), i) for i in range(2)]))
    import zipfile
    with zipfile.ZipFile(path) as z:
        raw = z.read("x.npy")
    raw = raw.replace(b"(2, 1, 3, 8, 8)", b"(5, 1, 3, 8, 8)")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.npy", raw)
    c.args["-I"] = str(path)
    c.args["-N"] = "4"
    return ["d.npz", "truncated", "numpy.savez"]


def platform_not_utf8(c):
    spec = c.tmp / "chip.toml"
    src = (platforms_dir() / "trt.toml").read_text()
    spec.write_bytes(("# caf\xe9\n" + src).encode("latin-1"))
    c.args["-D"] = str(spec)
    return ["chip.toml", "UTF-8"]


def platform_bits_16(c):
    spec = c.tmp / "chip16.toml"
    src = (platforms_dir() / "trt.toml").read_text()
    spec.write_text(src.replace("bits = 8", "bits = 16", 1))
    c.args["-D"] = str(spec)
    return ["chip16.toml", "deploy format 'trt' holds 8-bit activation ranges"]


def platform_weight_bits_16(c):
    spec = c.tmp / "w16.toml"
    src = (platforms_dir() / "trt.toml").read_text()
    at = src.index("[weight]")
    spec.write_text(src[:at] + src[at:].replace("bits = 8", "bits = 16", 1))
    c.args["-D"] = str(spec)
    return ["w16.toml", "[weight]: bits must be 2..8"]


def trt_version_not_digits(c):
    c.extra = ["--trt_version", "8.6.1"]
    return ["--trt_version", "8601"]


def two_npz_files(c):
    d = c.tmp / "npzs"
    d.mkdir()
    for k in range(2):
        np.savez(d / f"part{k}.npz", x=rand((2, 3, 8, 8), k))
    c.args["-I"] = str(d)
    return ["2 .npz files", "one .npz"]


def prof_samples_zero(c):
    c.extra = ["--prof_samples", "0"]
    return ["--prof_samples", "positive integer"]


def gptq_and_adaround(c):
    c.extra = ["--gptq", "--adaround"]
    return ["--gptq and --adaround", "use one"]


def ada_iters_zero(c):
    c.extra = ["--adaround", "--ada_iters", "0"]
    return ["--ada_iters", "positive integer"]


def sparse_malformed(c):
    c.extra = ["--sparse", "half"]
    return ["--sparse", "N:M", "'half'"]


def sparse_n_not_below_m(c):
    c.extra = ["--sparse", "4:4"]
    return ["--sparse N:M", "4:4"]


def sparse_with_adaround(c):
    c.extra = ["--sparse", "2:4", "--adaround"]
    return ["--sparse with --adaround", "drop --adaround"]


def auto_w8_malformed(c):
    c.extra = ["--w_bits", "4", "--auto_w8", "most"]
    return ["--auto_w8 'most'", "e.g. 0.999"]


def brecq_with_gptq(c):
    c.extra = ["--brecq", "--gptq"]
    return ["--brecq/--drop/--lsq with --gptq", "use one"]


def drop_with_sparse(c):
    c.extra = ["--drop", "--sparse", "2:4"]
    return ["--brecq/--drop/--lsq with", "--sparse", "use one"]


def ada_bs_zero(c):
    c.extra = ["--brecq", "--ada_bs", "0"]
    return ["--ada_bs", "positive integer", "0"]


def brecq_without_torch(c):
    c.extra = ["--brecq"]
    c.block_torch = True
    return ["--brecq, --drop and --lsq need PyTorch", "pip install", "--adaround"]


def lsq_without_torch(c):
    c.extra = ["--lsq"]
    c.block_torch = True
    return ["--lsq need PyTorch", "pip install"]


def lsq_with_adaround(c):
    c.extra = ["--lsq", "--adaround"]
    return ["--brecq/--drop/--lsq with --gptq/--adaround", "use one"]


def fail_below_unknown_criterion(c):
    c.extra = ["--fail_below", "psnr:30"]
    return ["--fail_below criterion 'psnr'", "cosine or sqnr"]


def fail_below_cosine_above_1(c):
    c.extra = ["--fail_below", "1.5"]
    return ["--fail_below cosine bar must be in [-1, 1]", "1.5"]


def fail_below_not_a_number(c):
    c.extra = ["--fail_below", "sqnr:high"]
    return ["--fail_below 'sqnr:high'", "sqnr:30"]


def prof_samples_with_savefp(c):
    c.extra = ["--savefp", "--prof_samples", "1"]
    return ["--prof_samples with --savefp", "all N", "drop one"]


def reference_update_bn(c):
    c.extra = ["--update_bn"]
    return ["--update_bn", "folded", "--bc"]


def output_dir_empty(c):
    # an unset shell variable (-O "$OUT"): it used to write into <model dir>/results
    c.args["-O"] = ""
    return ["-O is an empty path", "leave -O out"]


def input_dir_empty(c):
    c.args["-I"] = ""
    return ["-I is an empty path", "calibration data folder"]


def custom_op_lib_empty(c):
    # it had read "--custom_op_lib /the/working/folder is not a file" (found by a bug hunt)
    c.extra = ["--custom_op_lib", ""]
    return ["--custom_op_lib is an empty path", "leave the flag out"]


CASES = [output_dir_empty, input_dir_empty, custom_op_lib_empty, sample_named_with_a_non_ascii_digit, far_too_many_files, npy_without_batch_axis_channels_last, missing_model, model_is_a_folder, not_onnx, external_data_missing, custom_op, input_dir_missing, input_folder_missing,
         too_few_files, bin_wrong_size, nan_in_sample, inf_in_npy, images_instead_of_samples,
         images_in_input_dir, samples_named_otherwise, samples_outside_input_folder, channels_last_sample,
         channels_last_sample_dynamic_batch, samples_zero_padded, too_few_files_beside_a_stray_file,
         input_folder_misnamed, unknown_method, method_by_other_tools_name, unknown_platform, platform_by_vendor_name,
         platform_misspelt, platform_folder,
         output_not_writable, output_is_a_file, nothing_quantizable, float64_model, already_quantized_qdq,
         already_quantized_integer_ops, skip_layer_unknown, score_output_unknown,
         input_shape_malformed, input_shape_unknown_name, input_shape_static_conflict, input_shape_not_the_datas,
         input_shape_twice,
         input_shape_zero, sample_beyond_float32, platform_op_typo, model_without_inputs, inputs_all_initializers,
         zero_samples,
         weight_bits_above_8, activation_bits_12, activation_bits_16_on_trt, layer_bits_a16_on_trt, npz_scalar, bins_too_many, npz_header_claims_more_rows,
         platform_not_utf8, platform_bits_16, platform_weight_bits_16, trt_version_not_digits,
         two_npz_files, prof_samples_zero, gptq_and_adaround, ada_iters_zero,
         sparse_malformed, sparse_n_not_below_m, sparse_with_adaround, auto_w8_malformed,
         brecq_with_gptq, drop_with_sparse, ada_bs_zero, brecq_without_torch,
         lsq_without_torch, lsq_with_adaround, fail_below_unknown_criterion, fail_below_cosine_above_1,
         fail_below_not_a_number, prof_samples_with_savefp, reference_update_bn]


@pytest.mark.parametrize("breaker", CASES, ids=[f.__name__ for f in CASES])
def test_bad_input_exits_2(tmp_path, capsys, breaker):
    case = Case(tmp_path)
    breaker(case)
    rc, _ = run_cli(case, capsys)
    assert rc == 2


@pytest.mark.parametrize("breaker", CASES, ids=[f.__name__ for f in CASES])
def test_bad_input_message_is_one_line_naming_the_thing(tmp_path, capsys, breaker):
    case = Case(tmp_path)
    expected = breaker(case)
    _, err = run_cli(case, capsys)
    lines = error_lines(err)
    assert len(lines) == 1, err
    for text in expected:
        assert text in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("breaker", CASES, ids=[f.__name__ for f in CASES])
def test_bad_input_leaves_no_output_files(tmp_path, capsys, breaker):
    case = Case(tmp_path)
    breaker(case)
    run_cli(case, capsys)
    assert_nothing_written(case)


def test_missing_model_without_output_dir_creates_no_folder(tmp_path, capsys):
    case = Case(tmp_path)
    missing_model(case)
    del case.args["-O"]
    rc, _ = run_cli(case, capsys)
    assert rc == 2
    assert not (tmp_path / "nope").exists()


@pytest.mark.skipif("CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers(),
                    reason="this onnxruntime has CUDA")
def test_device_cuda_without_cuda_provider_blames_the_device_not_the_model(tmp_path, capsys):
    case = Case(tmp_path)
    case.extra = ["--device", "cuda"]
    rc, err = run_cli(case, capsys)
    assert rc == 2
    (line,) = error_lines(err)
    assert "--device cuda" in line and "cannot load the model" not in line


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "cuda1"])
def test_recon_device_that_is_no_device(tmp_path, capsys, value):
    case = Case(tmp_path)
    case.extra = ["--brecq", "--recon_device", value]
    rc, err = run_cli(case, capsys)
    assert rc == 2
    (line,) = error_lines(err)
    assert f"--recon_device must be cpu, cuda or cuda:N (a GPU's index), got '{value}'" in line
    assert_nothing_written(case)


def test_recon_device_cuda_where_torch_sees_no_gpu(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA GPU here")
    case = Case(tmp_path)
    case.extra = ["--brecq", "--recon_device", "cuda"]
    rc, err = run_cli(case, capsys)
    assert rc == 2
    (line,) = error_lines(err)
    assert "--recon_device cuda: this torch" in line and "sees no CUDA GPU" in line and "--recon_device cpu" in line
    assert "Traceback" not in err
    assert_nothing_written(case)


def test_debug_prints_the_traceback_and_keeps_exit_code_2(tmp_path, capsys):
    case = Case(tmp_path)
    missing_model(case)
    case.extra = ["--debug"]
    rc, err = run_cli(case, capsys)
    assert rc == 2
    assert "Traceback" in err and "does not exist" in err


def test_debug_prints_the_error_line_once_on_stderr_and_in_the_log(tmp_path, capsys):
    """With --debug the console handler printed the error's debug record too: the line twice on
    stderr and twice in dipoorlet.log (found by a hunt)."""
    case = Case(tmp_path)
    case.extra = ["--skip_layers", "no_such_node", "--debug"]
    rc, err = run_cli(case, capsys)
    assert rc == 2
    lines = [l for l in err.splitlines() if "no_such_node" in l]
    assert sum(l.startswith(("dipoorlet: error", "error:")) for l in lines) == 1, lines
    logs = list(case.out.glob("dipoorlet*.log"))
    assert logs and sum(l.read_text().count("error: ") for l in logs) == 1


def test_model_inside_output_folder_is_never_overwritten(tmp_path, capsys):
    """-M is an earlier run's quant_model.onnx (or any model saved under that name) in -O."""
    case = Case(tmp_path)
    case.out.mkdir()
    target = case.out / "quant_model.onnx"
    target.write_bytes(case.model.read_bytes())
    before = target.read_bytes()
    case.args["-M"] = str(target)
    rc, err = run_cli(case, capsys)
    assert rc == 2
    (line,) = error_lines(err)
    assert "quant_model.onnx" in line and "overwritten" in line
    assert target.read_bytes() == before
    assert {p.name for p in case.out.iterdir()} <= {"quant_model.onnx", "dipoorlet.log"}


def _outputs(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.name.startswith("dipoorlet")}


def test_folder_in_the_way_of_an_output_leaves_the_earlier_outputs(tmp_path, capsys):
    case = Case(tmp_path)
    assert run_cli(case, capsys)[0] == 0
    (case.out / "report.html").unlink()
    (case.out / "report.html").mkdir()
    before = _outputs(case.out)
    case.args["-A"] = "hist"            # a different quant_model.onnx if it were written
    rc, err = run_cli(case, capsys)
    assert rc == 2
    (line,) = error_lines(err)
    assert "report.html" in line and "folder" in line
    assert _outputs(case.out) == before
    assert not list(case.out.glob(".dipoorlet-staging-*"))


def _on_moves_into(monkeypatch, case, act, nested=False):
    """Patch the renames that publish the outputs: ``act(calls)`` runs before each new output moves
    into -O (after the earlier ones moved aside), ``calls`` holding the destinations so far, this
    one last; ``nested``: also the moves into -O's sub-folders (--savefp's output/<name>/)."""
    import os as _os

    from dipoorlet import pipeline

    real, calls = _os.replace, []

    def replace(src, dst):
        into = Path(dst).parent == case.out or (nested and case.out in Path(dst).parents)
        if ".dipoorlet-staging-" in str(src) and ".replaced" not in str(src) and into:
            calls.append(dst)
            act(calls)
        return real(src, dst)

    monkeypatch.setattr(pipeline.os, "replace", replace)
    return calls


def _no_space(calls):
    raise OSError(28, "No space left on device", str(calls[-1]))


def test_failed_move_puts_every_earlier_output_back(tmp_path, capsys, monkeypatch):
    """The outputs go into -O all or nothing: a rename that fails halfway (a full or read-only
    disk) undoes the ones before it."""
    case = Case(tmp_path)
    assert run_cli(case, capsys)[0] == 0
    before = _outputs(case.out)
    calls = _on_moves_into(monkeypatch, case, lambda c: _no_space(c) if len(c) == 3 else None)
    case.args["-A"] = "hist"
    rc, err = run_cli(case, capsys)
    assert len(calls) == 3
    assert rc == 2
    (line,) = error_lines(err)
    assert "No space left on device" in line and "as they were" in line and "free space there" in line
    assert _outputs(case.out) == before
    assert not list(case.out.glob(".dipoorlet-staging-*"))
    # a permission error is not told to free space (found by a bug hunt)
    calls.clear()
    monkeypatch.undo()
    calls = _on_moves_into(monkeypatch, case, lambda c: _raise(PermissionError(13, "Permission denied", str(c[-1])))
                           if len(c) == 2 else None)
    rc, err = run_cli(case, capsys)
    (line,) = error_lines(err)
    assert rc == 2 and "Permission denied" in line and "make it writable" in line and "free space" not in line
    assert _outputs(case.out) == before
    # nor a rename across file systems (-O/output a link to another disk; found by a hunt)
    calls.clear()
    monkeypatch.undo()
    calls = _on_moves_into(monkeypatch, case, lambda c: _raise(OSError(18, "Invalid cross-device link", str(c[-1])))
                           if len(c) == 2 else None)
    rc, err = run_cli(case, capsys)
    (line,) = error_lines(err)
    assert rc == 2 and "Invalid cross-device link" in line and "another file system" in line
    assert "free space" not in line and _outputs(case.out) == before


def _raise(exc):
    raise exc


def test_failed_move_removes_the_folders_it_made(tmp_path, capsys, monkeypatch):
    """--savefp's output/<name>/ folders, new in -O, go again when the publishing is undone."""
    case = Case(tmp_path)
    assert run_cli(case, capsys)[0] == 0
    before = _outputs(case.out)
    calls = _on_moves_into(monkeypatch, case, nested=True, act=lambda c: _no_space(c) if any(
        "output" in Path(d).relative_to(case.out).parts[:1] for d in c) else None)
    case.extra = ["--savefp"]
    rc, err = run_cli(case, capsys)
    assert rc == 2 and any("output" in Path(c).parts for c in calls)
    assert _outputs(case.out) == before
    assert not (case.out / "output").exists()


def test_outputs_get_the_umask_mode_not_a_private_one(tmp_path, capsys):
    import os as _os

    case = Case(tmp_path)
    old = _os.umask(0o022)
    try:
        assert run_cli(case, capsys)[0] == 0
    finally:
        _os.umask(old)
    for name in ("quant_model.onnx", "report.json", "trt_calib.cache"):
        assert (case.out / name).stat().st_mode & 0o777 == 0o644, name


def test_sigterm_unwinds_like_ctrl_c(tmp_path, capsys, monkeypatch):
    import os as _os
    import signal
    import time

    from dipoorlet import pipeline

    def killed(cfg, comm=None):
        _os.kill(_os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(pipeline, "quantize", killed)
    case = Case(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    rc, err = run_cli(case, capsys)
    assert rc == 143
    assert "terminated (SIGTERM)" in err
    assert signal.getsignal(signal.SIGTERM) == before        # the handler is the caller's again
    assert_nothing_written(case)
    # the log says so too (it had stopped on an ordinary line; found by a bug hunt)
    log = (case.out / "dipoorlet.log").read_text().splitlines()
    assert log[-1] == "dipoorlet: terminated (SIGTERM); no output was written"


def _fresh_python(code: str, timeout: int = 120) -> str:
    """What ``code`` prints (stdout, then stderr) in a fresh interpreter, which has loaded none of
    the native modules and set no signal handler."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    return res.stdout + res.stderr


def test_the_sigterm_handler_is_set_after_the_native_modules_load(tmp_path):
    """A SIGTERM while onnx or onnxruntime initialize raised Terminated inside their native start-up:
    exit 134 (a C++ abort) or 1 (an ImportError traceback) instead of 143. The handler now goes in
    after they are loaded (a fresh interpreter, which has loaded neither)."""
    code = ("import signal, sys\n"
            "real, seen = signal.signal, []\n"
            "def spy(sig, handler):\n"
            "    if sig == signal.SIGTERM and not seen:\n"
            "        seen.append(all(m in sys.modules for m in ('numpy', 'onnx', 'onnxruntime')))\n"
            "    return real(sig, handler)\n"
            "signal.signal = spy\n"
            "from dipoorlet.cli import main\n"
            f"rc = main(['-M', {str(tmp_path / 'missing.onnx')!r}, '-I', {str(tmp_path)!r}, '-N', '1', '-D', 'trt'])\n"
            "print('handler after native modules:', seen, rc)\n")
    out = _fresh_python(code)
    assert "handler after native modules: [True] 2" in out, out


def test_sigterm_during_the_renames_waits_for_them_and_says_the_outputs_are_written(tmp_path, capsys, monkeypatch):
    """SIGTERM arriving between two renames into -O is held until the last one: -O then holds the
    whole new run, and the message says so rather than 'no output was written'."""
    import os as _os
    import signal

    case = Case(tmp_path)
    calls = _on_moves_into(monkeypatch, case,
                           lambda c: _os.kill(_os.getpid(), signal.SIGTERM) if len(c) == 2 else None)
    rc, err = run_cli(case, capsys)
    assert rc == 143 and len(calls) > 2
    assert "terminated (SIGTERM); after the outputs were written" in err
    for name in ("quant_model.onnx", "trt_calib.cache", "report.json"):
        assert (case.out / name).is_file()


@pytest.mark.parametrize("caller", ["own handler", "default"])
def test_a_signal_as_the_run_closes_its_log_waits_for_the_log_and_the_lock(tmp_path, capsys, monkeypatch, caller):
    """SIGTERM landing while a finished run renames its log and drops its lock: both are done
    first (the earlier run's log had stayed dipoorlet.log, the lock stayed, and the line said "no
    output was written", exit 130). Then a caller's own handler gets the signal; under the default
    action it is Terminated, as during the run (python -m dipoorlet says it and exits 143; re-raised
    as the signal, mpich had reported exit code 15)."""
    import os as _os
    import signal

    from dipoorlet import cli

    case = Case(tmp_path)
    assert run_cli(case, capsys)[0] == 0
    real, got = cli.finish_log, []

    def finish(out_dir, ok):
        _os.kill(_os.getpid(), signal.SIGTERM)
        real(out_dir, ok)

    monkeypatch.setattr(cli, "finish_log", finish)
    before = signal.signal(signal.SIGTERM, (lambda *a: got.append(a[0])) if caller == "own handler" else signal.SIG_DFL)
    try:
        case.args["-A"] = "hist"
        if caller == "own handler":
            assert run_cli(case, capsys)[0] == 0 and got == [signal.SIGTERM]
        else:
            with pytest.raises(cli.Terminated):
                run_cli(case, capsys)
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
    assert "-A hist" in (case.out / "dipoorlet.log").read_text()
    assert not (case.out / ".dipoorlet.lock").exists() and not (case.out / ".dipoorlet-run.log").exists()


@pytest.mark.parametrize("kind", ["int", "term"])
def test_a_signal_met_outside_the_runs_handler_says_what_o_holds(tmp_path, capsys, monkeypatch, kind):
    """`python -m dipoorlet`: a Ctrl-C or SIGTERM that reaches the module's own handler after the
    outputs were written says so, with the signal's exit code (it had said "interrupted; no
    output was written", exit 130, in both cases)."""
    import runpy

    from dipoorlet import cli, pipeline

    def stopped(argv=None):
        pipeline.PUBLISHED.append(str(tmp_path / "out"))
        raise cli.Terminated() if kind == "term" else KeyboardInterrupt()

    monkeypatch.setattr(cli, "main", stopped)
    monkeypatch.setattr(pipeline, "PUBLISHED", [])
    with pytest.raises(SystemExit) as ex:
        runpy.run_module("dipoorlet", run_name="__main__")
    err = capsys.readouterr().err
    assert ex.value.code == (143 if kind == "term" else 130)
    what = "terminated (SIGTERM)" if kind == "term" else "interrupted"
    assert f"dipoorlet: {what}; after the outputs were written into {tmp_path / 'out'}" in err


def test_interrupt_while_publishing_puts_every_earlier_output_back(tmp_path, capsys, monkeypatch):
    """Ctrl-C (or SIGTERM) between two renames into -O: the earlier run's files are all there
    afterwards, none of the new ones."""
    def interrupt(calls):
        if len(calls) == 2:
            raise KeyboardInterrupt

    case = Case(tmp_path)
    assert run_cli(case, capsys)[0] == 0
    before = _outputs(case.out)
    calls = _on_moves_into(monkeypatch, case, interrupt)
    case.args["-A"] = "hist"
    rc, err = run_cli(case, capsys)
    assert rc == 130 and len(calls) == 2
    assert _outputs(case.out) == before
    assert not list(case.out.glob(".dipoorlet-staging-*"))
    # the stopped run's log (beside the earlier run's outputs) ends on why it stopped
    assert (case.out / "dipoorlet.failed.log").read_text().splitlines()[-1] == "dipoorlet: interrupted; no output was written"


def test_runtime_failure_names_the_sample_file(tmp_path, capfd):
    """A token id outside the embedding table: onnxruntime fails on that sample, and the one line
    names its file (and onnxruntime's own error log stays off stderr)."""
    table = rand((10, 4), 0, 1.0)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
             helper.make_node("MatMul", ["e", "w"], ["y"], name="mm")]
    model = make_model(nodes, [vi("ids", [1, 3], onnx.TensorProto.INT64)], [vi("y", [1, 3, 2])],
                       {"table": table, "w": rand((4, 2), 1, 0.5)})
    case = Case(tmp_path)
    save(model, case.model)
    data = tmp_path / "ids_data"
    (data / "ids").mkdir(parents=True)
    np.save(data / "ids" / "0.npy", np.array([[1, 2, 3]], np.int64))
    np.save(data / "ids" / "1.npy", np.array([[1, 50, 3]], np.int64))
    case.args["-I"] = str(data)
    rc, err = run_cli(case, capfd)        # capfd: onnxruntime writes its log to file descriptor 2
    assert rc == 2
    (line,) = error_lines(err)
    assert str(data / "ids" / "1.npy") in line and "token ids" in line
    assert "onnxruntime" not in err.replace(line, "")


def test_integer_samples_for_a_float_input_are_cast_with_a_warning(tmp_path, capsys):
    case = Case(tmp_path)
    for i in range(2):
        np.save(case.data / "x" / f"{i}.npy", np.random.default_rng(i).integers(0, 255, (1, 3, 8, 8), np.uint8))
    rc, err = run_cli(case, capsys)
    assert rc == 0
    warned = [line for line in err.splitlines() if "normalize" in line]
    assert len(warned) == 1 and "uint8" in warned[0]


def test_argparse_errors_are_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["-M", "m.onnx"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "required" in err


def test_failure_during_profile_leaves_no_staging_folder(tmp_path, capsys, monkeypatch):
    """A run that fails after the staging folder exists removes it."""
    from dipoorlet import layer_errors as profile

    def boom(*a, **k):
        raise DipoorletError("injected failure in the error profile")
    monkeypatch.setattr(profile, "collect_errors", boom)
    case = Case(tmp_path)
    rc, err = run_cli(case, capsys)
    assert rc == 2 and "injected failure" in err
    assert_nothing_written(case)


def test_failure_after_savefp_samples_leaves_no_partial_outputs(tmp_path, capsys, monkeypatch):
    from dipoorlet import layer_errors as profile

    real, calls = profile.sample_sums, []

    def fail_on_second_sample(f, q):
        calls.append(1)
        if len(calls) > 1:
            raise DipoorletError("injected failure after the first sample")
        return real(f, q)
    monkeypatch.setattr(profile, "sample_sums", fail_on_second_sample)
    case = Case(tmp_path)
    case.extra = ["--savefp", "--skip_prof_layer"]
    rc, _ = run_cli(case, capsys)
    assert rc == 2 and len(calls) == 2
    assert not (case.out / "output").exists()


def _run_cli(case, cwd):
    """``python -m dipoorlet`` on the case's arguments in a fresh process."""
    return subprocess.run([sys.executable, "-m", "dipoorlet", *case.argv()], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_subprocess_exit_code_and_one_line_stderr(tmp_path):
    case = Case(tmp_path)
    missing_model(case)
    proc = _run_cli(case, tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "does not exist" in lines[0]
    assert proc.stderr.strip().splitlines()[-1] == lines[0]
    assert proc.stdout == ""


def test_subprocess_error_before_logging_is_exactly_one_line(tmp_path):
    case = Case(tmp_path)
    unknown_method(case)
    proc = _run_cli(case, tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("dipoorlet: error:")


def test_ctrl_c_while_the_cli_loads_is_one_line(tmp_path):
    """Ctrl-C in the first few tenths of a second (argparse and the CLI's imports, before the run's
    own handler) is one line and exit 130, not a KeyboardInterrupt traceback."""
    import subprocess

    code = ("import runpy, dipoorlet.cli as c\n"
            "def stop(*a, **k):\n    raise KeyboardInterrupt\n"
            "c.build_parser = stop\n"
            "runpy.run_module('dipoorlet', run_name='__main__')\n")
    res = subprocess.run([sys.executable, "-c", code, "-M", "m.onnx"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert res.returncode == 130
    assert res.stderr.strip() == "dipoorlet: interrupted; no output was written"


def test_a_sigterm_while_python_compiles_a_module_is_not_lost():
    """CPython 3.11's compile() drops a plain BaseException a signal handler raises while it
    compiles (a lazy import from source: PYTHONDONTWRITEBYTECODE): a SIGTERM then went unnoticed
    and the run finished with exit 0. Terminated is a KeyboardInterrupt, which it keeps (found by
    a bug hunt: 13 of 20 lost before)."""
    code = ("import signal, time\n"
            "from dipoorlet.cli import Terminated\n"
            "import dipoorlet.pipeline as p\n"
            "src = open(p.__file__).read().replace('from __future__ import annotations', '')\n"
            "src = 'def f0():\\n' + '\\n'.join('    ' + l for l in src.splitlines())\n"
            "big = '\\n'.join(src.replace('def f0', f'def f{k}') for k in range(4))\n"
            "t = time.perf_counter(); compile(big, 'x', 'exec', dont_inherit=True); T = time.perf_counter() - t\n"
            "hit = []\n"
            "def h(s, f):\n"
            "    hit.append(1); raise Terminated()\n"
            "signal.signal(signal.SIGALRM, h)\n"
            "lost = 0\n"
            "for i in range(10):\n"
            "    hit.clear(); signal.setitimer(signal.ITIMER_REAL, T * (0.1 + 0.08 * i) + 1e-4)\n"
            "    try:\n"
            "        compile(big, 'x', 'exec', dont_inherit=True); time.sleep(0.05); lost += bool(hit)\n"
            "    except Terminated:\n"
            "        pass\n"
            "print('lost', lost)\n")
    out = _fresh_python(code, timeout=300)
    assert "lost 0" in out, out


def test_ctrl_c_is_held_back_while_the_native_modules_load():
    """A Ctrl-C landing in onnxruntime's initialization came back as ImportError('initialization
    failed'), which the start-up swallowed (the run went on, exit 0), and one in onnx's aborted
    the process: SIGINT is blocked while they load and delivered right after."""
    code = ("import builtins, signal, sys\n"
            "real, seen = builtins.__import__, []\n"
            "def spy(name, *a, **k):\n"
            "    if name in ('onnx', 'onnxruntime') and name not in sys.modules:\n"
            "        seen.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = spy\n"
            "from dipoorlet.cli import _load_native_modules\n"
            "_load_native_modules()\n"
            "builtins.__import__ = real\n"
            "print('blocked while loading:', seen, 'after:', signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n")
    out = _fresh_python(code)
    assert "blocked while loading: [True, True] after: False" in out, out


def test_a_path_that_is_not_utf8_reaches_the_report_escaped(tmp_path):
    # -M mod\xe9l.onnx: the byte arrives as a lone surrogate, which strict UTF-8 refused (the run
    # died writing report.md, exit 1)
    from dipoorlet.util import write_text

    write_text(tmp_path / "r.md", "model mod\udce9l.onnx")
    assert (tmp_path / "r.md").read_text(encoding="utf-8") == "model mod\\udce9l.onnx"


def test_savefp_with_an_output_name_longer_than_a_file_name(tmp_path):
    # a 305-character output name made --savefp's folder ENAMETOOLONG mid-run (a traceback)
    from onnx import helper

    from conftest import make_model, quantize_model, rand, vi

    name = "y" * 305
    model = make_model([helper.make_node("Conv", ["x", "w"], [name], name="conv")], [vi("x", [1, 3, 6, 6])],
                       [vi(name, [1, 4, 4, 4])], {"w": rand((4, 3, 3, 3), 1, 0.3)})
    quantize_model(tmp_path, model, n=2, savefp=True, skip_prof_layer=True)
    folders = list((tmp_path / "out" / "output").iterdir())
    assert len(folders) == 1 and len(folders[0].name) < 200 and folders[0].name.startswith("y" * 100)
    assert len(list(folders[0].glob("onnx-output-*.bin"))) == 2


def test_debug_logs_every_grid_and_session(tmp_path, capsys):
    """--debug said "debug logs" and gave one line ("done in"); it now logs each session a pass
    builds and every grid the model gets, which the side files must agree with."""
    import json

    case = Case(tmp_path)
    case.extra = ["--debug"]
    rc, _ = run_cli(case, capsys)
    assert rc == 0
    log = (case.out / "dipoorlet.log").read_text()
    assert "session built in" in log
    clips = json.loads((case.out / "act_clip_val.json").read_text())
    for t in clips:
        assert f"grid activation {t}: 8-bit signed, per-tensor" in log
    assert "grid weight w: 8-bit signed, axis 0, 4 channels" in log
    plain = tmp_path / "plain"
    case.args["-O"], case.extra = str(plain), []
    assert run_cli(case, capsys)[0] == 0
    assert "grid activation" not in (plain / "dipoorlet.log").read_text()


def test_api_unknown_keyword_names_the_cli_flags_it_does_not_take(tmp_path):
    import dipoorlet
    from dipoorlet.errors import DipoorletError

    case = Case(tmp_path)
    with pytest.raises(DipoorletError, match=r"--log_all_ranks and the reference tool's --we, "
                                                        r"--ada_epoch and --update_bn"):
        dipoorlet.quantize(model=str(case.model), input_dir=str(case.data), data_num=2, deploy="trt",
                           output_dir=str(case.out), we=True)


def test_a_model_weights_file_named_like_the_runs_log_is_not_overwritten(tmp_path, capsys):
    """-O is the model's folder and its external-data file is called dipoorlet.log: the log
    overwrote the weights, exit 0 (found by a bug hunt). One line, exit 2, the file untouched."""
    import onnx

    case = Case(tmp_path)
    m = onnx.load(str(case.model))
    folder = tmp_path / "both"
    folder.mkdir()
    onnx.save_model(m, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="dipoorlet.log", size_threshold=0)
    before = (folder / "dipoorlet.log").read_bytes()
    case.args["-M"], case.args["-O"] = str(folder / "model.onnx"), str(folder)
    rc, err = run_cli(case, capsys)
    assert rc == 2
    (line,) = error_lines(err)
    assert "dipoorlet.log is a file of the model -M" in line
    assert (folder / "dipoorlet.log").read_bytes() == before


def test_a_sample_count_above_n_is_said(tmp_path, capsys):
    """--prof_samples 100 with -N 2 read the 2 there are without a word (found by a README
    walkthrough; --val_num beyond --val_dir is refused)."""
    case = Case(tmp_path)
    case.extra = ["--prof_samples", "100", "--eq_samples", "50"]
    rc, _ = run_cli(case, capsys)
    assert rc == 0
    assert ("--eq_samples 50, --prof_samples 100: more than the 2 calibration samples (-N); all 2 are read"
            in (case.out / "dipoorlet.log").read_text())


def test_a_list_flag_given_twice_keeps_both_occurrences():
    """`--skip_layers a --skip_layers b` had kept b only (argparse's default store action), so a
    layer the user named stayed quantized without a word; `--layer_bits fc=w4 --layer_bits fc=w8`
    ran where `--layer_bits fc=w4 fc=w8` is refused (found by a bug hunt)."""
    from dipoorlet.cli import build_parser
    from dipoorlet.data import parse_input_shapes
    from dipoorlet.config import parse_layer_bits

    base = ["-M", "m.onnx", "-I", "d", "-N", "4", "-D", "trt"]
    args = build_parser().parse_args(base + [
        "--skip_layers", "conv1", "--skip_layers", "conv2", "conv3",
         "--layer_bits", "conv1=w4", "--layer_bits", "fc=w4", "--input_shape", "x:1,3,8,8", "--input_shape", "y:1,2",
         "--score_outputs", "a", "--score_outputs", "b", "--custom_op_lib", "l1.so", "--custom_op_lib", "l2.so"])
    assert args.skip_layers == ["conv1", "conv2", "conv3"]
    assert parse_layer_bits(args.layer_bits) == {"conv1": (4, None), "fc": (4, None)}
    assert parse_input_shapes(args.input_shape) == {"x": (1, 3, 8, 8), "y": (1, 2)}
    assert args.score_outputs == ["a", "b"] and args.custom_op_lib == ["l1.so", "l2.so"]
    with pytest.raises(DipoorletError, match="two w widths"):
        parse_layer_bits(build_parser().parse_args(base + ["--layer_bits", "fc=w4", "--layer_bits", "fc=w8"]).layer_bits)
    assert build_parser().parse_args(base).skip_layers == []     # the default is not shared between parses


def test_a_custom_op_library_named_twice_is_loaded_once(tmp_path):
    """--custom_op_lib L --custom_op_lib L (a wrapper's default plus the user's): registering L
    twice made onnxruntime refuse the model, blamed on its ops (a review of the extend change)."""
    from dipoorlet.config import QuantConfig

    lib = tmp_path / "libops.so"
    lib.write_bytes(b"")
    cfg = QuantConfig(model=tmp_path / "m.onnx", input_dir=tmp_path, data_num=1, deploy="trt",
                      custom_op_libs=[str(lib), str(lib), str(tmp_path / "." / "libops.so")])
    assert cfg.custom_op_libs == (str(lib),)


@pytest.mark.parametrize("message", ["Unable to allocate 32.0 GiB for an array with shape (8192, 8192, 64) and "
                                     "data type float64", ""])
def test_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch, message):
    """numpy's _ArrayMemoryError (a MemoryError) had ended the run in a traceback, exit 1 (found
    by a hunt on a 2 GB model). Python's own MemoryError has no message: it printed "()"."""
    from dipoorlet import pipeline

    def short(cfg, comm=None):
        raise MemoryError(message)

    monkeypatch.setattr(pipeline, "quantize", short)
    case = Case(tmp_path)
    rc, err = run_cli(case, capsys)
    (line,) = error_lines(err)
    assert rc == 2 and "out of memory" in line and "Traceback" not in err
    assert f"({message or 'MemoryError'})" in line
    assert_nothing_written(case)


def test_a_log_that_could_not_be_written_in_full_says_so(tmp_path, capsys):
    """A run on a nearly full disk left dipoorlet.log cut at 4 KB with exit 0 and no word; a
    record naming a path that is not UTF-8 was dropped from the log (found by a hunt). A flush
    that failed while the disk was full but whose bytes reach the file by the close is no loss
    (found by a review). The warning names the folder: the run names its log after closing it."""
    import errno

    from dipoorlet.util import QuietFileHandler

    def handler(name):
        fh = QuietFileHandler(tmp_path / name, mode="w", encoding="utf-8")
        log = logging.getLogger("dipoorlet.test_quiet." + name)
        log.addHandler(fh)
        log.propagate = False
        return fh, log

    fh, log = handler("a.log")
    try:
        log.warning("model %s", "caf\udce9/mod\udce9l.onnx")        # os.fsdecode of latin-1 bytes
        real, n = fh.stream.write, {"k": 0}

        def full(text):
            n["k"] += 1
            if n["k"] > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(text)

        fh.stream.write = full
        for i in range(3):
            log.warning("record %d", i)
    finally:
        log.removeHandler(fh)
        fh.close()
    text = (tmp_path / "a.log").read_text(encoding="utf-8")
    assert "model caf\\udce9/mod\\udce9l.onnx" in text and "record 0" in text and "record 1" not in text
    lost = len("record 1\n") + len("record 2\n")
    err = capsys.readouterr().err
    assert f"dipoorlet: warning: the log this run wrote into {tmp_path} is incomplete: its last " in err
    assert "bytes could not be written (No space left on device)" in err
    assert int(err.split("its last ")[1].split(" bytes")[0]) >= lost

    fh, log = handler("b.log")
    flush, n = fh.stream.flush, {"k": 0}

    def full_once():
        n["k"] += 1
        if n["k"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return flush()

    fh.stream.flush = full_once
    for i in range(3):
        log.warning("record %d", i)
    log.removeHandler(fh)
    fh.close()
    assert (tmp_path / "b.log").read_text(encoding="utf-8").count("record") == 3
    assert "incomplete" not in capsys.readouterr().err


def test_a_backend_name_is_the_backend_beside_a_folder_of_that_name(tmp_path, capsys, monkeypatch):
    """-D trt -O trt: the output folder is made before the platform loads, and the folder check
    took 'trt' for a folder of specs (found by a review)."""
    case = Case(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trt").mkdir(exist_ok=True)
    case.args["-D"] = "trt"
    rc, err = run_cli(case, capsys)
    assert rc == 0, err
