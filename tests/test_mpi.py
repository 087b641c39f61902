"""Distributed calibration under mpirun gives byte-identical outputs to one process."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("mpi4py", reason="MPI tests need the [mpi] extra (mpi4py, mpich)")
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (pip install mpich)")

OUTPUTS = ["quant_model.onnx", "trt_clip_val.json", "trt_calib.cache", "act_clip_val.json",
           "weight_clip_val.json", "report.json", "report.md", "report.html"]


def _model(path: Path) -> None:
    rng = np.random.default_rng(1)
    w = lambda name, *shape: numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)
    nodes = [
        # conv0 -> relu0 -> conv1 is an equalization pair: its channel ranges are merged with MAX
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0"),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["a1"], name="add1"),
        helper.make_node("GlobalAveragePool", ["a1"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], name="fc", transB=1),
    ]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
                              [w("w0", 3, 3, 1, 1), w("b0", 3), w("w1", 6, 3, 3, 3), w("b1", 6), w("w2", 6, 6, 3, 3), w("b2", 6), w("w3", 5, 6), w("b3", 5)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("mpi")
    _model(root / "m.onnx")
    rng = np.random.default_rng(2)
    (root / "calib" / "x").mkdir(parents=True)
    for i in range(11):  # 11 samples: uneven over 2 and 3 ranks
        (rng.standard_normal((1, 3, 12, 12)) * (1 + i % 3)).astype(np.float32).tofile(root / "calib" / "x" / f"{i}.bin")
    return root


def _run(root: Path, out: Path, method: str, ranks: int, calib="calib"):
    cmd = [sys.executable, "-m", "dipoorlet", "-M", str(root / "m.onnx"), "-I", str(root / calib),
           "-N", "11", "-D", "trt", "-A", *method.split(), "-O", str(out)]
    if ranks > 1:
        cmd = [MPIRUN, "-n", str(ranks)] + cmd + ["--mpirun"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("method", ["minmax", "hist", "mse", "entropy", "percentile", "mse --bc", "mse --gptq",
                                    "mse --gptq --gptq_memory 0.001 -D snpe", "mse --adaround --ada_iters 50 --w_bits 4",
                                    "mse --sparse 0.5", "mse --sparse 1:3",
                                    "mse --w_bits 4 --auto_w8 sqnr:60 --sens_samples 4 --adaround --ada_iters 50",
                                    "mse -D qnn --a_bits 4 --auto_a16 0.99999 --max_a16_layers 2 --sens_samples 4",
                                    "mse -D imx", "mse -D ti"])
def test_outputs_identical_for_any_process_count(case, method):
    single = _run(case, case / f"one-{method}", method, 1)
    assert single.returncode == 0, single.stderr
    for ranks in (2, 3):
        res = _run(case, case / f"{ranks}-{method}", method, ranks)
        assert res.returncode == 0, res.stderr
        names = OUTPUTS if "-D" not in method else sorted(
            p.name for p in (case / f"one-{method}").iterdir() if p.suffix != ".log")
        assert "quant_model.onnx" in names
        for name in names:
            a = (case / f"one-{method}" / name).read_bytes()
            b = (case / f"{ranks}-{method}" / name).read_bytes()
            assert a == b, f"{name} differs between 1 and {ranks} processes ({method})"


def test_bad_file_on_one_rank_stops_every_rank(case):
    bad = case / "calib_bad"
    shutil.copytree(case / "calib", bad)
    arr = np.fromfile(bad / "x" / "10.bin", dtype=np.float32)
    arr[3] = np.inf
    arr.tofile(bad / "x" / "10.bin")  # sample 10 lands on the last rank
    out = case / "bad-out"
    res = _run(case, out, "hist", 3, calib="calib_bad")
    assert res.returncode != 0
    assert "10.bin" in res.stderr and "NaN/Inf" in res.stderr
    leftovers = [p.name for p in out.iterdir()] if out.exists() else []
    # (the aborted rank 0 could not remove its lock file; the next run takes it over)
    assert not [n for n in leftovers if n not in ("dipoorlet.log", ".dipoorlet.lock")], leftovers
    # the failing rank's line reaches rank 0's log too (its abort ends rank 0 before rank 0 could)
    assert "error (rank 2)" in (out / "dipoorlet.log").read_text() and "10.bin" in (out / "dipoorlet.log").read_text()


def test_an_error_every_rank_meets_is_printed_once(case):
    """A bad flag is seen by all three ranks: one 'dipoorlet: error' line, not three."""
    res = _run(case, case / "allbad-out", "minmax --skip_layers nope", 3)
    assert res.returncode == 2
    lines = [l for l in res.stderr.splitlines() if "dipoorlet: error" in l]
    assert len(lines) == 1 and "nope" in lines[0], res.stderr


@pytest.mark.parametrize("flags,needle", [("minmax --bogus", "--bogus"), ("minmax --update_bn", "--update_bn"),
                                          ("minmax --skip_layers nope --debug", "nope")])
def test_errors_before_and_after_the_communicator_are_printed_once(case, flags, needle):
    """argparse's errors (before MPI starts) and the reference-flag refusals are printed by rank 0
    alone; --debug's traceback comes with the one line under MPI too."""
    res = _run(case, case / "allbad2-out", flags, 3)
    assert res.returncode == 2
    lines = [l for l in res.stderr.splitlines() if "dipoorlet: error" in l]
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert ("Traceback" in res.stderr) == ("--debug" in flags)
    assert res.stderr.count("Traceback") <= 1


def test_a_failed_run_keeps_the_log_of_the_outputs_in_the_folder(case):
    out = case / "log-out"
    assert _run(case, out, "minmax", 2).returncode == 0
    good = (out / "dipoorlet.log").read_text()
    bad = case / "calib_nan"
    shutil.copytree(case / "calib", bad)
    arr = np.fromfile(bad / "x" / "10.bin", dtype=np.float32)
    arr[0] = np.nan
    arr.tofile(bad / "x" / "10.bin")
    res = _run(case, out, "minmax", 2, calib="calib_nan")
    assert res.returncode == 2 and "10.bin" in res.stderr
    assert (out / "dipoorlet.log").read_text() == good


def test_a_rerun_removes_the_earlier_runs_rank_logs(case):
    out = case / "ranklogs-out"
    assert _run(case, out, "minmax --log_all_ranks", 3).returncode == 0
    assert {p.name for p in out.glob("dipoorlet.rank*.log")} == {"dipoorlet.rank1.log", "dipoorlet.rank2.log"}
    assert _run(case, out, "minmax --log_all_ranks", 2).returncode == 0
    assert {p.name for p in out.glob("dipoorlet.rank*.log")} == {"dipoorlet.rank1.log"}
    assert _run(case, out, "minmax", 2).returncode == 0
    assert not list(out.glob("dipoorlet.rank*.log"))


def test_a_failed_run_keeps_the_earlier_runs_rank_logs(case):
    out = case / "ranklogs-fail-out"
    assert _run(case, out, "minmax --log_all_ranks", 2).returncode == 0
    before = (out / "dipoorlet.rank1.log").read_text()
    assert _run(case, out, "minmax --log_all_ranks --skip_layers nope", 2).returncode == 2
    assert (out / "dipoorlet.rank1.log").read_text() == before          # the failed run's is kept aside
    assert _run(case, out, "minmax --log_all_ranks", 2).returncode == 0
    assert (out / "dipoorlet.rank1.log").read_text() != before
    # the failed run's rank log, kept aside under a temporary name, goes with a later run that
    # writes its outputs (it had stayed through every later run; found by a hunt)
    assert _run(case, out, "minmax --log_all_ranks --skip_layers nope", 2).returncode == 2
    assert (out / ".dipoorlet-run.rank1.log").is_file()
    assert _run(case, out, "minmax", 2).returncode == 0
    assert not list(out.glob(".dipoorlet-run.rank*.log")) and not list(out.glob("dipoorlet.rank*.log"))


def test_more_ranks_than_samples_with_bias_correction(case):
    """3 ranks, 2 samples: one rank has none, yet every collective (equalization MAX, the bias
    correction sums, the histogram merge) lines up and the outputs equal one process's."""
    outs = {}
    for ranks in (1, 3):
        out = case / f"bc-n2-{ranks}"
        cmd = [sys.executable, "-m", "dipoorlet", "-M", str(case / "m.onnx"), "-I", str(case / "calib"),
               "-N", "2", "-D", "trt", "-A", "mse", "--bc", "-O", str(out)]
        if ranks > 1:
            cmd = [MPIRUN, "-n", str(ranks)] + cmd + ["--mpirun"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        outs[ranks] = out
    for name in OUTPUTS:
        assert (outs[1] / name).read_bytes() == (outs[3] / name).read_bytes(), name


def test_brecq_under_mpi_sums_gradients_over_processes(case, tmp_path):
    """--brecq with the samples split over 2 processes (6 and 5): every process takes part in
    every step (gradients summed), rank 0 writes; the result is not byte-identical to one
    process (different mini-batches), but both lower the output error of nearest rounding on
    the same samples (onnxruntime against the float model)."""
    pytest.importorskip("torch", reason="--brecq needs the [torch] extra")
    from conftest import ort_run

    extra = ["--w_bits", "3", "--skip_prof_layer", "--no_equalize", "--no_bc"]
    outs = {}
    for name, ranks, flags in (("nearest", 1, []), ("one", 1, ["--brecq", "--ada_iters", "60"]),
                               ("two", 2, ["--brecq", "--ada_iters", "60"]),
                               ("two_lsq", 2, ["--lsq", "--ada_iters", "60"])):
        out = tmp_path / name
        res = _run(case, out, "minmax " + " ".join(extra + flags), ranks)
        assert res.returncode == 0, res.stderr
        outs[name] = onnx.load(str(out / "quant_model.onnx"))
    import json

    rep = json.loads((tmp_path / "two" / "report.json").read_text())
    assert rep["brecq"]["samples"] == 11 and rep["brecq"]["layers"] >= 1
    assert "lsq" in json.loads((tmp_path / "two_lsq" / "report.json").read_text())["brecq"]
    model = onnx.load(str(case / "m.onnx"))
    feeds = [{"x": np.fromfile(case / "calib" / "x" / f"{i}.bin", np.float32).reshape(1, 3, 12, 12)}
             for i in range(11)]
    err = {k: sum(float(np.sum((ort_run(model, f)[0] - ort_run(q, f)[0]) ** 2)) for f in feeds)
           for k, q in outs.items()}
    assert err["one"] < err["nearest"] and err["two"] < err["nearest"] and err["two_lsq"] < err["nearest"], err


def test_validation_profile_identical_for_any_process_count(case):
    """--val_dir's samples are shared out over the ranks like the calibration samples; the profile
    and the saturation counts merge exactly (5 samples: uneven over 2 and 3 ranks)."""
    val = case / "val"
    if not val.exists():
        rng = np.random.default_rng(7)
        (val / "x").mkdir(parents=True)
        for i in range(5):
            (rng.standard_normal((1, 3, 12, 12)) * 4).astype(np.float32).tofile(val / "x" / f"{i}.bin")
    outs = {}
    for ranks in (1, 2, 3):
        out = case / f"val-{ranks}"
        res = _run(case, out, f"hist --val_dir {val}", ranks)
        assert res.returncode == 0, res.stderr
        outs[ranks] = out
    import json

    rep = json.loads((outs[1] / "report.json").read_text())
    assert rep["profile_samples"] == 5 and rep["clipped"]["tensors_clipped"] > 0
    for ranks in (2, 3):
        for name in OUTPUTS:
            assert (outs[1] / name).read_bytes() == (outs[ranks] / name).read_bytes(), (name, ranks)


@pytest.mark.parametrize("flags", [["--no_bc"], ["--gptq"]])
def test_sensitivity_and_rounding_identical_whatever_the_threads_per_process(tmp_path, flags):
    """The sensitivity analysis feeds weights to its one session as inputs, and onnxruntime's
    GEMM on a B that is an input (not a constant it packs once) rounds with the thread count:
    it splits N over the threads and then blocks K by the width of each thread's slice (here
    K=240, N=120 > M=40: one thread sums K in two blocks, two threads in one). A process of
    ``mpirun -n 2`` on a 2-core node gets one onnxruntime thread, one process two; the scores
    must not change with that (the PP-OCRv4 recognizer's p2o.MatMul.12 read 54.03 dB against 53.99),
    nor the model --gptq writes (its statistics pass ran every Q/DQ unfolded, so the weights
    reached the MatMuls as such inputs: the recognizer's model differed)."""
    rng = np.random.default_rng(3)
    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)

    nodes = [helper.make_node("MatMul", ["x", "wa"], ["a"], name="mm0"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "wb"], ["y"], name="mm1")]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 40, 240])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 40, 120])],
                              [w("wa", 240, 120), w("wb", 120, 120)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    (tmp_path / "calib" / "x").mkdir(parents=True)
    for i in range(16):     # 640 rows: --gptq fits mm1 (120 inputs)
        rng.standard_normal((1, 40, 240)).astype(np.float32).tofile(tmp_path / "calib" / "x" / f"{i}.bin")
    reports = []
    # one process of two threads (its samples scored two at a time), two processes of one
    for ranks, threads in ((1, "2"), (2, "1")):
        out = tmp_path / f"out{ranks}"
        cmd = [sys.executable, "-m", "dipoorlet", "-M", str(tmp_path / "m.onnx"), "-I", str(tmp_path / "calib"),
               "-N", "16", "-D", "trt", *flags, "-O", str(out)]
        if ranks > 1:
            cmd = [MPIRUN, "-n", str(ranks)] + cmd + ["--mpirun"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "DIPOORLET_THREADS": threads})
        assert res.returncode == 0, res.stderr
        reports.append(out / "report.json")
    import json

    one, two = (json.loads(p.read_text())["sensitivity"] for p in reports)
    assert [r["node"] for r in one] == ["mm0", "mm1"]
    assert one == two
    assert reports[0].read_bytes() == reports[1].read_bytes()
    for name in OUTPUTS:
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes(), name


_API_SCRIPT = """
import sys, dipoorlet
from dipoorlet.errors import DipoorletError
root, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
calib = sys.argv[4] if len(sys.argv) > 4 else "calib"
kw = {"mpirun": True} if mode.startswith("mpi") else {}
if mode == "mpi-bar":
    kw["fail_below"] = 1.0
try:
    res = dipoorlet.quantize(model=root + "/m.onnx", input_dir=root + "/" + calib, data_num=11, deploy="trt",
                             output_dir=out, act_quant="mse", **kw)
except DipoorletError as exc:
    sys.stdout.write(f"<raised {type(exc).__name__} {exc.exit_code}>\\n")    # one write: two ranks share stdout
    sys.exit(exc.exit_code)
sys.stdout.write(f"<files={len(res.files)}>\\n")
"""


def test_api_call_with_mpirun_true_shares_samples_and_matches_one_process(case, tmp_path):
    script = tmp_path / "api.py"
    script.write_text(_API_SCRIPT)
    single = _run(case, tmp_path / "one", "mse", 1)
    assert single.returncode == 0, single.stderr
    res = subprocess.run([MPIRUN, "-n", "2", sys.executable, str(script), str(case), str(tmp_path / "api"), "mpi"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    counts = sorted(int(n) for n in re.findall(r"<files=(\d+)>", res.stdout))
    assert len(counts) == 2 and counts[0] == 0 < counts[1]       # rank 0 lists the files it wrote
    for name in OUTPUTS:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "api" / name).read_bytes(), name
    log = (tmp_path / "api" / "dipoorlet.log").read_text()
    assert "running as 2 MPI processes" in log       # rank 0's log is in -O
    assert not list((tmp_path / "api").glob("*rank*"))


def test_api_call_under_a_launcher_without_mpirun_warns(case, tmp_path):
    script = tmp_path / "api.py"
    script.write_text(_API_SCRIPT)
    res = subprocess.run([MPIRUN, "-n", "2", sys.executable, str(script), str(case), str(tmp_path / "api"), "one"],
                         capture_output=True, text=True, timeout=120)
    # both ranks ran alone into the same folder, as asked; each says how to share the samples
    assert res.stderr.count("pass mpirun=True") == 2, res.stderr


def test_a_launcher_whose_mpi_is_not_mpi4pys_is_one_line(case, tmp_path):
    env = dict(os.environ, OMPI_COMM_WORLD_SIZE="2")   # as Open MPI's mpirun would set it
    cmd = [sys.executable, "-m", "dipoorlet", "-M", str(case / "m.onnx"), "-I", str(case / "calib"), "-N", "11",
           "-D", "trt", "-O", str(tmp_path / "o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "OMPI_COMM_WORLD_SIZE=2" in lines[0] and "mpi4py" in lines[0]
    assert not (tmp_path / "o" / "quant_model.onnx").exists()


def test_api_call_with_mpirun_true_stops_every_rank_on_one_ranks_bad_file(case, tmp_path):
    bad = tmp_path / "calib_bad"
    shutil.copytree(case / "calib", bad)
    arr = np.fromfile(bad / "x" / "10.bin", dtype=np.float32)
    arr[3] = np.inf
    arr.tofile(bad / "x" / "10.bin")  # sample 10 lands on rank 1
    shutil.copy(case / "m.onnx", tmp_path / "m.onnx")
    script = tmp_path / "api.py"
    script.write_text(_API_SCRIPT)
    res = subprocess.run([MPIRUN, "-n", "2", sys.executable, str(script), str(tmp_path), str(tmp_path / "o"), "mpi",
                          "calib_bad"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode != 0
    assert "dipoorlet: error (rank 1)" in res.stderr and "10.bin" in res.stderr
    assert not (tmp_path / "o" / "quant_model.onnx").exists()
    # rank 0's log is dipoorlet.log (no temporary name another rank's abort would leave) and
    # holds the failing rank's line
    assert "error (rank 1)" in (tmp_path / "o" / "dipoorlet.log").read_text()


def test_api_call_with_mpirun_true_raises_and_logs_a_missed_fail_below_on_every_rank(case, tmp_path):
    script = tmp_path / "api.py"
    script.write_text(_API_SCRIPT)
    res = subprocess.run([MPIRUN, "-n", "2", sys.executable, str(script), str(case), str(tmp_path / "o"), "mpi-bar"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 3, res.stderr
    assert res.stdout.count("<raised BelowTargetError 3>") == 2, res.stdout
    assert "fail_below 1.0" in (tmp_path / "o" / "dipoorlet.log").read_text()
    assert (tmp_path / "o" / "quant_model.onnx").exists()


def test_savefp_under_mpi_refuses_an_output_folder_a_rank_cannot_see(case, tmp_path):
    """-O on node-local disks: rank 1 (made blind to rank 0's mark here) would write its samples'
    outputs where rank 0 never publishes them; every rank stops with one line instead."""
    script = tmp_path / "blind.py"
    script.write_text(
        "import sys\nfrom mpi4py import MPI\nimport dipoorlet, dipoorlet.pipeline as p\n"
        "if MPI.COMM_WORLD.Get_rank() == 1:\n    p._sees = lambda path: False\n"
        "root, out = sys.argv[1], sys.argv[2]\n"
        "dipoorlet.quantize(model=root + '/m.onnx', input_dir=root + '/calib', data_num=11, deploy='trt',\n"
        "                   output_dir=out, act_quant='minmax', savefp=True, mpirun=True)\n")
    res = subprocess.run([MPIRUN, "-n", "2", sys.executable, str(script), str(case), str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "--savefp under MPI: rank 1" in res.stderr and "shares" in res.stderr
    assert not (tmp_path / "o" / "quant_model.onnx").exists()
    assert not list((tmp_path / "o").glob(".dipoorlet-staging-*"))
    ok = _run(case, tmp_path / "ok", "minmax --savefp", 2)      # a shared -O: every sample's outputs
    assert ok.returncode == 0, ok.stderr
    assert len(list((tmp_path / "ok" / "output").rglob("onnx-output-*.bin"))) == 11


def test_a_data_note_from_another_ranks_share_reaches_rank_0s_log(case, tmp_path):
    """Sample 9 holds raw int32 pixels and falls in rank 1's share: one process warns about it,
    and so must rank 0 under mpirun (the warning was in no log but rank 1's, which is off by
    default)."""
    calib = tmp_path / "calib" / "x"
    calib.mkdir(parents=True)
    rng = np.random.default_rng(5)
    for i in range(11):
        a = rng.standard_normal((1, 3, 12, 12)).astype(np.float32)
        if i == 9:
            a = (a * 50 + 128).clip(0, 255).astype(np.int32)
        np.save(calib / f"{i}.npy", a)
    for ranks in (1, 2):
        out = tmp_path / f"o{ranks}"
        cmd = [sys.executable, "-m", "dipoorlet", "-M", str(case / "m.onnx"), "-I", str(tmp_path / "calib"),
               "-N", "11", "-D", "trt", "-A", "minmax", "--skip_prof_layer", "-O", str(out)]
        if ranks > 1:
            cmd = [MPIRUN, "-n", str(ranks)] + cmd + ["--mpirun"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        line = "9.npy holds int32 values for float input 'x'"
        assert res.stderr.count(line) == 1, (ranks, res.stderr)
        assert (out / "dipoorlet.log").read_text().count(line) == 1, ranks


def test_brecq_with_fewer_samples_than_processes_matches_one_process(tmp_path):
    """-N 1 on 2 processes: the rank without samples added a zero gradient to the mean and
    halved every step, which Adam's epsilon turns into other updates (here the learned scales'
    keep/drop decision flipped: 25.5 dB in one process, 27.2 under mpirun). The mean is now over
    the processes that drew samples, and the output equals one process's byte for byte."""
    pytest.importorskip("torch", reason="--lsq needs the [torch] extra")
    rng = np.random.default_rng(1)
    w = lambda name, *shape: numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "r1"], ["a1"], name="add1"),
             helper.make_node("Reshape", ["a1", "shp"], ["t"], name="resh"),
             helper.make_node("MatMul", ["t", "wm"], ["m"], name="mm"),
             helper.make_node("Relu", ["m"], ["rm"], name="relum"),
             helper.make_node("ReduceMean", ["rm"], ["g"], name="rmean", axes=[1], keepdims=0),
             helper.make_node("Gemm", ["g", "w3", "b3"], ["y"], name="fc", transB=1)]
    inits = [w("w0", 8, 3, 3, 3), w("b0", 8), w("w1", 8, 8, 3, 3), w("b1", 8), w("w2", 8, 8, 3, 3), w("b2", 8),
             numpy_helper.from_array(np.array([1, 8, 64], np.int64), "shp"), w("wm", 64, 16), w("w3", 5, 16),
             w("b3", 5)]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    (tmp_path / "calib" / "x").mkdir(parents=True)
    np.save(tmp_path / "calib" / "x" / "0.npy", rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    env = dict(os.environ, DIPOORLET_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    outs = []
    for ranks in (1, 2):
        out = tmp_path / f"o{ranks}"
        cmd = [sys.executable, "-m", "dipoorlet", "-M", str(tmp_path / "m.onnx"), "-I", str(tmp_path / "calib"),
               "-N", "1", "-D", "snpe", "--lsq", "--ada_iters", "30", "--w_bits", "4", "--skip_prof_layer",
               "-O", str(out)]
        if ranks > 1:
            cmd = [MPIRUN, "-n", str(ranks)] + cmd + ["--mpirun"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stderr
        outs.append((out / "quant_model.onnx").read_bytes())
    assert outs[0] == outs[1]


def test_a_signal_to_one_rank_while_rank_0_publishes_leaves_one_runs_outputs(case, tmp_path):
    """Ctrl-C/SIGTERM sent to rank 1 alone once its share was done: rank 1 had returned and died
    of it, and mpirun killed rank 0 in the middle of its moves into -O (a mix of an earlier run's
    and this run's files, exit 15 or 2, no message; found by a bug hunt). Rank 1 now waits for
    rank 0's publish with the signal held and says it after: exit 143, the outputs all there."""
    script = tmp_path / "late.py"
    script.write_text(
        "import os, signal, sys, time\nfrom mpi4py import MPI\nimport dipoorlet.pipeline as p\n"
        "from dipoorlet.cli import main\n"
        "rank, pidfile = MPI.COMM_WORLD.Get_rank(), sys.argv[1]\n"
        "if rank == 1:\n    open(pidfile, 'w').write(str(os.getpid()))\n"
        "real = p._publish\n"
        "def publish(*a, **k):\n"
        "    os.kill(int(open(pidfile).read()), signal.SIGTERM)\n"
        "    time.sleep(1.0)\n"
        "    return real(*a, **k)\n"
        "p._publish = publish\n"
        "sys.exit(main(sys.argv[2:]))\n")
    out = tmp_path / "o"
    first = _run(case, out, "minmax -D qnn", 1)          # an earlier run's outputs in -O
    assert first.returncode == 0, first.stderr
    cmd = [MPIRUN, "-n", "2", sys.executable, str(script), str(tmp_path / "rank1.pid"), "-M", str(case / "m.onnx"),
           "-I", str(case / "calib"), "-N", "11", "-D", "trt", "-A", "minmax", "-O", str(out), "--mpirun"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 143, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("dipoorlet:")]
    assert lines == [f"dipoorlet: rank 1: terminated (SIGTERM); after the outputs were written into {out}"], res.stderr
    import json

    assert json.loads((out / "report.json").read_text())["platform"] == "trt"
    assert {"trt_calib.cache", "quant_model.onnx", "dipoorlet.log"} <= {p.name for p in out.iterdir()}
    assert not (out / "qnn_encodings.json").exists()
    assert not list(out.glob(".dipoorlet-staging-*"))


def test_ranks_given_different_settings_are_refused():
    """Through the API a rank given another -N or -A had finished without a word (outputs no
    process count gives), another --no_bc in an MPI "Message truncated" error (found by a hunt).
    A stand-in communicator: rank 1 of 2, rank 0's settings differ."""
    from dipoorlet.config import QuantConfig
    from dipoorlet.errors import ConfigError
    from dipoorlet.pipeline import _same_settings

    cfg = QuantConfig(model="m.onnx", input_dir="d", data_num=6, deploy="trt")

    class Comm:
        world, rank = 2, 1

        def __init__(self, rank0):
            self.rank0 = rank0

        def bcast(self, obj):
            import hashlib
            return hashlib.sha1(repr(self.rank0).encode()).hexdigest()

        def allreduce_sum(self, a):
            return a * 2 if a.any() else a

    _same_settings(cfg, Comm(cfg))
    with pytest.raises(ConfigError, match="different settings"):
        _same_settings(cfg, Comm(QuantConfig(model="m.onnx", input_dir="d", data_num=7, deploy="trt")))


def test_mpirun_flag_without_a_launcher_says_it_runs_one_process(case, tmp_path):
    """--mpirun given to a process no launcher started: one process, said so (it had run without a
    word, as if the samples were shared)."""
    cmd = [sys.executable, "-m", "dipoorlet", "-M", str(case / "m.onnx"), "-I", str(case / "calib"), "-N", "11",
           "-D", "trt", "-A", "minmax", "-O", str(tmp_path / "o"), "--mpirun", "--skip_prof_layer"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--mpirun/--slurm: MPI runs this as one process; start it with mpirun -n K" in res.stderr
    two = _run(case, tmp_path / "two", "minmax", 2)
    assert two.returncode == 0 and "runs this as one process" not in two.stderr


def test_each_process_knows_its_rank_among_those_of_its_machine(tmp_path):
    """--recon_device cuda takes GPU local_rank (modulo the GPUs seen): under mpirun -n 2 on one
    machine the two processes are 0 and 1."""
    script = tmp_path / "lr.py"
    script.write_text("from dipoorlet.dist import MPIComm\nc = MPIComm()\nprint(f'local {c.rank} {c.local_rank}', flush=True)\n")
    res = subprocess.run([MPIRUN, "-n", "2", sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    import re

    # (the two processes' lines may arrive interleaved)
    pairs = sorted((int(a), int(b)) for a, b in re.findall(r"local (\d+) (\d+)", res.stdout))
    assert pairs == [(0, 0), (1, 1)]
