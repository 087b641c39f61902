"""End-to-end CLI runs on a tiny CNN: the files, the TensorRT cache, the report's numbers."""
from __future__ import annotations

import json
import logging
import struct

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import (initializer, input_feeds, make_model, ort_run, ort_session, quantized_tensors, rand, save, tiny_cnn,
                      vi, write_samples)
from dipoorlet.cli import main
from dipoorlet.ranges import RANGE_METHODS

N = 8
EXPECTED_FILES = {"quant_model.onnx", "trt_clip_val.json", "trt_calib.cache", "act_clip_val.json",
                  "weight_clip_val.json", "report.json", "report.md", "report.html", "dipoorlet.log",
                  # the Gemm's one-sided input is shifted (dipoorlet.shift): the float graph changed
                  "transformed_model.onnx",
                  # what this run wrote, so the next run into -O can remove what it does not rewrite
                  ".dipoorlet-files.json"}


def _close_logs():
    root = logging.getLogger("dipoorlet")
    for h in list(root.handlers):
        h.close()
        root.removeHandler(h)


def run_cli(tmp, method="mse", extra=()):
    model = tiny_cnn()
    model_path = save(model, tmp / "model.onnx")
    feeds = input_feeds(model, N, seed=21)
    data = write_samples(tmp / "data", feeds)
    out = tmp / "out"
    try:
        rc = main(["-M", str(model_path), "-I", str(data), "-N", str(N), "-D", "trt", "-O", str(out),
                   "-A", method, *extra])
    finally:
        _close_logs()
    assert rc == 0
    return model, feeds, out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_cli(tmp_path_factory.mktemp("e2e"))


def test_writes_every_file_and_nothing_else(run):
    _, _, out = run
    assert {p.name for p in out.iterdir()} == EXPECTED_FILES


def test_trt_cache_header(run):
    _, _, out = run
    assert (out / "trt_calib.cache").read_text().splitlines()[0] == "TRT-8601-EntropyCalibration2"


@pytest.fixture(scope="module")
def run_a6(tmp_path_factory):
    return run_cli(tmp_path_factory.mktemp("e2e_a6"), extra=["--a_bits", "6"])


@pytest.mark.parametrize("which", ["run", "run_a6"])
def test_trt_cache_scales_decode_to_amax_over_127(which, request):
    # TensorRT's grid is int8 whatever the plan's bits: a 6-bit plan once wrote its own scale
    # (amax / 31) into the cache, a range 4x wider than trt_clip_val.json's
    _, _, out = request.getfixturevalue(which)
    blob = json.loads((out / "trt_clip_val.json").read_text())["blob_range"]
    lines = (out / "trt_calib.cache").read_text().splitlines()[1:]
    cache = {}
    for line in lines:
        name, hexval = line.rsplit(": ", 1)
        assert len(hexval) == 8 and hexval == hexval.lower()
        cache[name] = struct.unpack("!f", bytes.fromhex(hexval))[0]
    assert set(cache) == set(blob) and cache
    for name, amax in blob.items():
        assert cache[name] == pytest.approx(amax / 127, rel=1e-6)


def test_trt_files_cover_exactly_the_qdq_tensors(run):
    _, _, out = run
    qm = onnx.load(str(out / "quant_model.onnx"))
    blob = json.loads((out / "trt_clip_val.json").read_text())["blob_range"]
    assert set(blob) == quantized_tensors(qm)
    for name, amax in blob.items():
        assert float(initializer(qm, name + "_scale")) == pytest.approx(amax / 127, rel=1e-6)


def test_act_clip_val_agrees_with_trt_clip_val(run):
    _, _, out = run
    acts = json.loads((out / "act_clip_val.json").read_text())
    blob = json.loads((out / "trt_clip_val.json").read_text())["blob_range"]
    assert set(acts) == set(blob)
    for name, (lo, hi) in acts.items():
        assert lo <= 0.0 <= hi
        assert blob[name] == pytest.approx(max(-lo, hi), rel=1e-6)


def test_weight_clip_val_is_per_output_channel_min_max(run):
    model, _, out = run
    weights = json.loads((out / "weight_clip_val.json").read_text())
    assert set(weights) == {"w1", "w2", "wf"}
    for name, (lo, hi) in weights.items():
        w = initializer(model, name)
        flat = w.reshape(w.shape[0], -1)  # Conv axis 0, Gemm transB=1 axis 0
        np.testing.assert_allclose(lo, flat.min(1), rtol=1e-6)
        np.testing.assert_allclose(hi, flat.max(1), rtol=1e-6)


def _cosine(f, q):
    f, q = f.astype(np.float64).ravel(), q.astype(np.float64).ravel()
    return float(f @ q / np.sqrt((f @ f) * (q @ q)))


def test_report_output_cosine_equals_independent_computation(run):
    model, feeds, out = run
    report = json.loads((out / "report.json").read_text())
    fp, qs = ort_session(model), ort_session(out / "quant_model.onnx")
    cosines = [_cosine(fp.run(None, f)[0], qs.run(None, f)[0]) for f in feeds]
    (entry,) = report["outputs"]
    assert entry["tensor"] == "logits"
    assert entry["cosine"] == pytest.approx(np.mean(cosines), abs=1e-6)
    assert entry["min_cosine"] == pytest.approx(min(cosines), abs=1e-6)


def test_output_cosine_of_a_sensible_cnn_is_high(run):
    _, _, out = run
    assert json.loads((out / "report.json").read_text())["outputs"][0]["cosine"] >= 0.99


def test_report_json_metadata_and_layers(run):
    _, _, out = run
    report = json.loads((out / "report.json").read_text())
    assert (report["platform"], report["method"], report["samples"]) == ("trt", "mse", N)
    assert {l["node"] for l in report["layers"]} == {"conv1", "pool1", "conv2", "add2", "gap", "fc"}
    assert {d["node"] for d in report["decisions"]} == {n.name for n in tiny_cnn().graph.node} | {"f_shift_Add"}
    assert [r["tensor"] for r in report["shift"]] == ["f"]


def test_report_md_and_log_name_the_output(run):
    _, _, out = run
    assert "logits" in (out / "report.md").read_text()
    log = (out / "dipoorlet.log").read_text()
    assert "logits" in log and "quant_model.onnx" in log


def test_quant_model_is_valid_and_runs_optimized(run):
    model, feeds, out = run
    qm = onnx.load(str(out / "quant_model.onnx"))
    onnx.checker.check_model(qm, full_check=True)
    (y,) = ort_run(out / "quant_model.onnx", feeds[0], optimize=True)
    assert y.shape == (1, 10)


@pytest.mark.parametrize("method", sorted(RANGE_METHODS))
def test_each_method_end_to_end(tmp_path, method):
    _, _, out = run_cli(tmp_path, method)
    assert {p.name for p in out.iterdir()} == EXPECTED_FILES
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == method
    assert report["outputs"][0]["cosine"] >= 0.99


def test_trt_version_flag_sets_cache_header(tmp_path):
    _, _, out = run_cli(tmp_path, "minmax", ["--trt_version", "10003"])
    assert (out / "trt_calib.cache").read_text().startswith("TRT-10003-EntropyCalibration2\n")


def test_savefp_writes_float_outputs_per_sample(tmp_path):
    model, feeds, out = run_cli(tmp_path, "minmax", ["--savefp"])
    # the closing "wrote:" line counts them (it named the top-level files only; found by a hunt)
    wrote = [ln for ln in (out / "dipoorlet.log").read_text().splitlines() if ln.startswith("wrote: ")]
    assert wrote and f"output/ ({N} files)" in wrote[-1] and "quant_model.onnx" in wrote[-1]
    for i in (0, N - 1):
        saved = np.fromfile(out / "output" / "logits" / f"onnx-output-{i}.bin", dtype=np.float32)
        (ref,) = ort_run(model, feeds[i])
        np.testing.assert_allclose(saved, ref.ravel(), rtol=1e-5, atol=1e-6)


def test_skip_prof_layer_reports_outputs_only(tmp_path):
    _, _, out = run_cli(tmp_path, "minmax", ["--skip_prof_layer"])
    report = json.loads((out / "report.json").read_text())
    assert report["layers"] == [] and len(report["outputs"]) == 1


def test_rerun_into_same_folder_replaces_files_without_leftovers(tmp_path):
    run_cli(tmp_path, "minmax")
    _, _, out = run_cli(tmp_path, "hist")
    assert {p.name for p in out.iterdir()} == EXPECTED_FILES
    assert json.loads((out / "report.json").read_text())["method"] == "hist"


def test_rerun_removes_what_the_earlier_run_wrote_and_this_one_did_not(tmp_path):
    # a stale transformed_model.onnx would not match the new side files' tensor names; another
    # backend's files and --savefp outputs would mislead as well. Other files stay.
    run_cli(tmp_path, "minmax", ["--savefp"])
    out = tmp_path / "out"
    assert (out / "transformed_model.onnx").is_file() and (out / "output").is_dir()
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "keep.bin").write_bytes(b"1")
    _, _, out = run_cli(tmp_path, "minmax", ["--no_shift", "--no_equalize", "--no_bc"])
    names = {p.name for p in out.iterdir()}
    assert names == (EXPECTED_FILES - {"transformed_model.onnx"}) | {"notes.txt", "sub"}
    assert (out / "sub" / "keep.bin").read_bytes() == b"1"
    listed = set(json.loads((out / ".dipoorlet-files.json").read_text())["files"])
    assert listed == EXPECTED_FILES - {"transformed_model.onnx", ".dipoorlet-files.json", "dipoorlet.log"}


def test_rerun_cleanup_never_follows_links_nor_removes_this_runs_inputs(tmp_path):
    import os

    run_cli(tmp_path, "minmax")                       # writes transformed_model.onnx (the shift)
    out = tmp_path / "out"
    # a hand-edited list: other spellings of files this run rewrites, paths outside -O
    (tmp_path / "outside.txt").write_text("x")
    listed = json.loads((out / ".dipoorlet-files.json").read_text())["files"]
    listed += ["./quant_model.onnx", "report/../report.json", str(out / "trt_calib.cache"),
               "../outside.txt", "linked/keep.txt", "notes_link"]
    (tmp_path / "userdir").mkdir()
    (tmp_path / "userdir" / "keep.txt").write_text("mine")
    os.symlink(tmp_path / "userdir", out / "linked")
    (out / "my_notes.txt").write_text("mine")
    os.symlink(out / "my_notes.txt", out / "notes_link")
    (out / ".dipoorlet-files.json").write_text(json.dumps({"files": listed}))
    # the next run reads its model from -O: what it reads must survive
    model = out / "transformed_model.onnx"
    data = tmp_path / "data"
    try:
        rc = main(["-M", str(model), "-I", str(data), "-N", str(N), "-D", "trt", "-O", str(out),
                   "-A", "minmax", "--no_shift", "--no_equalize", "--no_bc"])
    finally:
        _close_logs()
    assert rc == 0
    assert model.is_file()
    for name in ("quant_model.onnx", "report.json", "trt_calib.cache", "my_notes.txt"):
        assert (out / name).is_file(), name
    assert (tmp_path / "outside.txt").is_file() and (tmp_path / "userdir" / "keep.txt").is_file()
    assert (out / "notes_link").is_symlink() and (out / "linked").is_symlink()


def test_a_rerun_that_would_replace_its_own_model_stops_and_keeps_it(tmp_path, capsys):
    """-M is -O's transformed_model.onnx and this run transforms again: the outputs are not
    published, the model and the earlier files stay as they were."""
    run_cli(tmp_path, "minmax")
    out = tmp_path / "out"
    model = out / "transformed_model.onnx"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and not p.name.startswith("dipoorlet")}
    try:
        rc = main(["-M", str(model), "-I", str(tmp_path / "data"), "-N", str(N), "-D", "trt", "-O", str(out),
                   "-A", "hist", "--bc"])      # --bc's biases make a transformed model
    finally:
        _close_logs()
    assert rc == 2
    line = [l for l in capsys.readouterr().err.splitlines() if l.startswith("dipoorlet: error:")]
    assert len(line) == 1 and "transformed_model.onnx" in line[0] and "own input" in line[0]
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and not p.name.startswith("dipoorlet")}
    assert after == before


def test_a_failed_rerun_keeps_the_log_of_the_outputs_in_the_folder(tmp_path):
    model, _, out = run_cli(tmp_path, "minmax")
    good = (out / "dipoorlet.log").read_text()
    assert "wrote:" in good
    try:
        rc = main(["-M", str(tmp_path / "model.onnx"), "-I", str(tmp_path / "data"), "-N", str(N + 5),
                   "-D", "trt", "-O", str(out)])
    finally:
        _close_logs()
    assert rc == 2
    assert (out / "dipoorlet.log").read_text() == good          # still describes the files here
    assert "error" in (out / "dipoorlet.failed.log").read_text()
    assert not (out / ".dipoorlet-run.log").exists()
    run_cli(tmp_path, "minmax")                                   # a good run replaces both
    assert not (out / "dipoorlet.failed.log").exists()
    (out / "dipoorlet.failed.log").write_text("an old failure")    # any successful publish, API too
    import dipoorlet

    dipoorlet.quantize(model=tmp_path / "model.onnx", input_dir=tmp_path / "data", data_num=N, deploy="trt",
                       output_dir=out, act_quant="minmax", skip_prof_layer=True)
    assert not (out / "dipoorlet.failed.log").exists()
    with pytest.raises(dipoorlet.errors.DataError) as exc:     # an API call's failed log says why too
        dipoorlet.quantize(model=tmp_path / "model.onnx", input_dir=tmp_path / "data", data_num=N + 5,
                           deploy="trt", output_dir=out)
    assert f"dipoorlet: error: {exc.value}" in (out / "dipoorlet.failed.log").read_text()


def test_profile_reads_prof_samples_spread_over_n_and_savefp_all(tmp_path, capsys):
    """--prof_samples 2 of N: the report's output cosine is the mean over samples 0 and N // 2
    (onnxruntime oracle) and says how many it read, in report.md, report.html and the console
    summary. (With --savefp, which saves every sample's float outputs, it is refused:
    test_cli_errors.)"""
    model, feeds, out = run_cli(tmp_path / "a", extra=["--prof_samples", "2"])
    assert "error profile over 2 of them, spread evenly" in (out / "report.html").read_text()
    assert "error profile over 2 of them, spread evenly" in capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["profile_samples"] == 2 and report["samples"] == len(feeds)
    fp, qs = ort_session(model), ort_session(out / "quant_model.onnx")
    cosines = [_cosine(fp.run(None, f)[0], qs.run(None, f)[0]) for f in (feeds[0], feeds[len(feeds) // 2])]
    assert report["outputs"][0]["cosine"] == pytest.approx(np.mean(cosines), abs=1e-6)
    assert "error profile over 2 of them, spread evenly" in (out / "report.md").read_text()


def _md_cells(line: str) -> int:
    """Cells of a Markdown table row: '|' not escaped by a backslash separate them."""
    import re

    return len(re.findall(r"(?<!\\)\|", line)) - 1


def test_report_md_tables_have_one_cell_per_header(run):
    # the outputs table's "max |err|" header made 7 cells against the separator's 5: GitHub
    # rendered the main table as a paragraph of pipes
    _, _, out = run
    lines = (out / "report.md").read_text().splitlines()
    tables = 0
    for i, line in enumerate(lines):
        if line.startswith("|-"):
            tables += 1
            width = _md_cells(line)
            k = i - 1
            while k < len(lines) and lines[k].startswith("|"):
                assert _md_cells(lines[k]) == width, lines[k]
                k += 1
    assert tables >= 3 and "max \\|err\\|" in lines[[l.startswith("| output") for l in lines].index(True)]


def test_report_lists_many_float_nodes_with_a_count_of_the_rest(run):
    """report.md cut the kept-float list at 50 and report.html at 100, silently; both now list
    up to report.KEPT_FLOAT_ROWS and say how many more report.json holds."""
    from dipoorlet import report as rp
    from dipoorlet.report_html import html

    _, _, out = run
    rep = json.loads((out / "report.json").read_text())
    rep["decisions"] = [d for d in rep["decisions"] if d["quantized"]]
    rep["decisions"] += [{"node": f"n{i}", "op_type": "Conv", "quantized": False, "reason": "skipped by --skip_layers"}
                         for i in range(rp.KEPT_FLOAT_ROWS + 30)]
    md, page = rp.markdown(rep), html(rep)
    last, first_left_out = f"n{rp.KEPT_FLOAT_ROWS - 1}", f"n{rp.KEPT_FLOAT_ROWS}"
    assert f"| {last} " in md and f"| {first_left_out} " not in md
    assert f"<td>{last}</td>" in page and f"<td>{first_left_out}</td>" not in page
    for text in (md, page):
        assert "… and 30 more (report.json's decisions list every node)" in text


def test_python_api_profile_and_quantize_can_be_called_again(tmp_path):
    """dipoorlet.profile is the API function, before and after a run (a submodule of that name
    used to replace it on the package once loaded)."""
    import dipoorlet

    model = tiny_cnn()
    model_path = save(model, tmp_path / "model.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, N, seed=3))
    reports = []
    for k in range(2):
        assert callable(dipoorlet.profile)
        reports.append(dipoorlet.profile(model=str(model_path), input_dir=str(data), data_num=N, deploy="trt",
                                         output_dir=str(tmp_path / f"out{k}"), act_quant="minmax"))
        _close_logs()
    assert reports[0]["outputs"] == reports[1]["outputs"]
    res = dipoorlet.quantize(model=str(model_path), input_dir=str(data), data_num=N, deploy="trt",
                             output_dir=str(tmp_path / "out2"), act_quant="minmax")
    assert (res.output_dir / "quant_model.onnx").is_file()
    assert callable(dipoorlet.profile)
    assert "INFO dipoorlet.pipeline: model" in (res.output_dir / "dipoorlet.log").read_text()
    assert not (res.output_dir / ".dipoorlet-run.log").exists()


def test_python_api_takes_the_clis_long_flag_names(tmp_path):
    """dipoorlet.quantize takes the CLI's long names and forms as documented (eq_samples, no_bc,
    layer_bits as NODE=wN strings, a single --skip_layers name) and gives the run the CLI gives;
    an unknown keyword is a DipoorletError naming the close ones, not a TypeError."""
    import dipoorlet
    from dipoorlet.cli import main
    from dipoorlet.errors import DipoorletError

    model = tiny_cnn()
    model_path = save(model, tmp_path / "model.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, N, seed=3))
    api = dipoorlet.quantize(model=model_path, input_dir=data, data_num=N, output_dir=tmp_path / "api",
                             eq_samples=2, no_bc=True, skip_layers="conv1", layer_bits=["fc=w4"],
                             skip_prof_layer=True).report
    assert main(["-M", str(model_path), "-I", str(data), "-N", str(N), "-D", "trt", "-O", str(tmp_path / "cli"),
                 "--eq_samples", "2", "--no_bc", "--skip_layers", "conv1", "--layer_bits", "fc=w4", "--skip_prof_layer"]) == 0
    cli = json.loads((tmp_path / "cli" / "report.json").read_text())
    assert "bias_correction" not in api and api["outputs"] == cli["outputs"]
    assert (tmp_path / "api" / "weight_clip_val.json").read_text() == (tmp_path / "cli" / "weight_clip_val.json").read_text()
    for bad, words in (({"eq_sample": 2}, ["'eq_sample'", "eq_samples"]), ({"layer_bits": {"fc": "w99"}}, ["w99"]),
                       ({"bias_correction": True, "no_bc": True}, ["'bias_correction' and 'no_bc'", "give one"]),
                       ({"layer_bits": {"fc": 5}}, ["--layer_bits fc", "got 5"]),
                       # wrong types: one line each, not a TypeError from deep inside
                       ({"threshold": None}, ["--threshold", "None"]), ({"percentile": "99"}, ["--percentile", "'99'"]),
                       ({"output_dir": 3}, ["-O must be a path", "int"]), ({"skip_layers": 3}, ["skip_layers", "int"]),
                       ({"model": model}, ["-M must be a path", "onnx.save"]),
                       ({"input_dir": np.zeros((N, 3, 64, 64), np.float32)}, ["-I must be a path", "numpy.savez"]),
                       ({"input_dir": {"x": np.zeros((N, 3))}}, ["-I must be a path", "dict", ".npz"]),
                       ({"deploy": None}, ["-D must be a backend name", "got None", "trt"]),   # was a TypeError
                       ({"deploy": 3}, ["-D must be a backend name", "got 3"])):
        with pytest.raises(DipoorletError) as err:
            dipoorlet.quantize(**{"model": model_path, "input_dir": data, "data_num": N, "output_dir": tmp_path / "bad",
                                  **bad})
        assert all(w in str(err.value) for w in words) and "\n" not in str(err.value)


def test_python_api_names_a_missing_model_before_making_any_folder(tmp_path):
    """As from the CLI: dipoorlet.quantize with a mistyped model path had made the default -O
    (<model dir>/results, parents included) and a log in it before saying the model is missing
    (found by a bug hunt); and a log that would overwrite a file of the model is refused."""
    import dipoorlet
    from dipoorlet.errors import ModelError, OutputError

    missing = tmp_path / "typo" / "sub" / "m.onnx"
    for out in (None, tmp_path / "out"):
        with pytest.raises(ModelError, match="does not exist"):
            dipoorlet.quantize(model=missing, input_dir=tmp_path, data_num=1, deploy="trt",
                               **({"output_dir": out} if out else {}))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    model = tiny_cnn()
    (tmp_path / "out").mkdir()
    onnx.save(model, tmp_path / "out" / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="dipoorlet.log", size_threshold=0)
    before = (tmp_path / "out" / "dipoorlet.log").read_bytes()
    with pytest.raises(OutputError, match="is a file of the model"):
        dipoorlet.quantize(model=tmp_path / "out" / "m.onnx", input_dir=tmp_path, data_num=1, deploy="trt",
                           output_dir=tmp_path / "out")
    assert (tmp_path / "out" / "dipoorlet.log").read_bytes() == before


def test_python_api_log_says_the_run_was_interrupted(tmp_path, monkeypatch):
    """Ctrl-C in a dipoorlet.quantize call: the caller gets the KeyboardInterrupt and the log in -O
    ends on why the run stopped, not on an ordinary line (found by a bug hunt)."""
    import dipoorlet
    from dipoorlet import pipeline

    def interrupted(cfg, comm=None):
        import logging

        logging.getLogger("dipoorlet").info("calibrating")
        raise KeyboardInterrupt

    model = tiny_cnn()
    model_path = save(model, tmp_path / "model.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, N, seed=3))
    dipoorlet.quantize(model=model_path, input_dir=data, data_num=N, output_dir=tmp_path / "earlier",
                       skip_prof_layer=True)       # publishes: an interrupt below is not said to come after it
    monkeypatch.setattr(pipeline, "quantize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dipoorlet.quantize(model=model_path, input_dir=tmp_path, data_num=1, deploy="trt", output_dir=tmp_path / "o")
    assert (tmp_path / "o" / "dipoorlet.log").read_text().splitlines()[-1] == "dipoorlet: interrupted; no output was written"

    def after_publishing(cfg, comm=None):
        pipeline.PUBLISHED.append(tmp_path / "earlier")
        raise KeyboardInterrupt

    # an interrupt held until the outputs were all in -O: the run's log is dipoorlet.log, as from the CLI
    monkeypatch.setattr(pipeline, "quantize", after_publishing)
    with pytest.raises(KeyboardInterrupt):
        dipoorlet.quantize(model=model_path, input_dir=data, data_num=N, output_dir=tmp_path / "earlier")
    assert not (tmp_path / "earlier" / "dipoorlet.failed.log").exists()
    last = (tmp_path / "earlier" / "dipoorlet.log").read_text().splitlines()[-1]
    assert last == f"dipoorlet: interrupted; after the outputs were written into {tmp_path / 'earlier'}"


def test_an_exception_after_the_outputs_are_in_finishes_the_clean_up_and_names_the_log(tmp_path, monkeypatch):
    """An exception that a caller's signal handler raises once the new files are in -O (a time
    limit's SIGALRM, a SIGTERM handler's sys.exit; Ctrl-C and SIGTERM themselves are held): the
    earlier backend's files still go, so -O holds one run's files, and the run's log is
    dipoorlet.log, ending on what stopped it (it was dipoorlet.failed.log beside the new outputs,
    and trt's files stayed beside snpe's; found by a hunt)."""
    import dipoorlet
    from dipoorlet import pipeline

    model = tiny_cnn()
    model_path = save(model, tmp_path / "model.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, N, seed=3))
    out = tmp_path / "o"
    kw = dict(model=model_path, input_dir=data, data_num=N, output_dir=out, skip_prof_layer=True)
    real = pipeline._remove_stale
    for exc, last in ((TimeoutError("caller's time limit"), "dipoorlet: error: caller's time limit; after the "
                                                           f"outputs were written into {out}"),
                      (SystemExit(143), f"dipoorlet: stopped (SystemExit: 143); after the outputs were written "
                                        f"into {out}")):
        dipoorlet.quantize(deploy="trt", **kw)
        fired = []

        def cut_short(*a, **k):
            if not fired:
                fired.append(1)
                raise exc
            return real(*a, **k)

        monkeypatch.setattr(pipeline, "_remove_stale", cut_short)
        with pytest.raises(type(exc)):
            dipoorlet.quantize(deploy="snpe", **kw)
        monkeypatch.setattr(pipeline, "_remove_stale", real)
        names = {p.name for p in out.iterdir()}
        assert "snpe_encodings.json" in names and not names & {"trt_calib.cache", "trt_clip_val.json"}, names
        assert "dipoorlet.failed.log" not in names
        log = (out / "dipoorlet.log").read_text().splitlines()
        assert log[-1] == last and any("snpe" in line for line in log)
        assert json.loads((out / ".dipoorlet-files.json").read_text())["files"] == sorted(
            p.name for p in out.iterdir() if p.is_file() and not p.name.startswith((".", "dipoorlet")))


def test_python_api_log_file_gets_info_while_the_callers_handlers_get_what_they_did(tmp_path):
    """dipoorlet.log holds the run's INFO lines; a caller whose logging passes WARNING and up
    still gets only those (here a warning for an option that does not apply)."""
    import logging

    import dipoorlet

    model = tiny_cnn()
    model_path = save(model, tmp_path / "model.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, N, seed=3))
    logger = logging.getLogger("dipoorlet")
    propagate, cli_level = logger.propagate, logger.level
    logger.propagate = True              # as in a program that never ran the CLI
    logger.setLevel(logging.NOTSET)
    level, handlers = logger.level, list(logger.handlers)
    records = []

    class Keep(logging.Handler):            # a caller's handler: no level of its own, as basicConfig's
        def emit(self, record):
            records.append(record)

    root = logging.getLogger()
    keep, root_level = Keep(), root.level
    root.addHandler(keep)
    root.setLevel(logging.WARNING)
    try:
        dipoorlet.quantize(model=str(model_path), input_dir=str(data), data_num=N, deploy="trt",
                           output_dir=str(tmp_path / "out"), act_quant="minmax", ada_iters=500)
        after = (logger.level, list(logger.handlers), logger.propagate)
    finally:
        logger.propagate = propagate
        root.removeHandler(keep)
        logger.setLevel(cli_level)
        root.setLevel(root_level)
    ours = [r for r in records if r.name.startswith("dipoorlet")]
    assert ours and all(r.levelno >= logging.WARNING for r in ours)
    assert any("--ada_iters" in r.getMessage() for r in ours)
    text = (tmp_path / "out" / "dipoorlet.log").read_text()
    assert "INFO dipoorlet.pipeline" in text and "--ada_iters" in text
    assert after == (level, handlers, True)


def test_input_under_the_output_folder_is_fine_without_savefp_and_reruns_with_it(tmp_path, capsys):
    """-I is -O/output (where --savefp writes) without --savefp: a normal run. -I holding -O
    (the default -O <model dir>/results with the model inside the data folder): --savefp runs
    twice, its .bin outputs are not mistaken for the input files."""
    model = tiny_cnn()
    feeds = input_feeds(model, N, seed=5)
    out = tmp_path / "out"
    data = write_samples(out / "output" / "calib", feeds)
    model_path = save(model, tmp_path / "model.onnx")
    try:
        assert main(["-M", str(model_path), "-I", str(data), "-N", str(N), "-D", "trt", "-O", str(out),
                     "-A", "minmax"]) == 0
    finally:
        _close_logs()
    root = tmp_path / "proj"
    data2 = write_samples(root, feeds)
    model2 = save(model, root / "model.onnx")
    for _ in range(2):
        try:
            rc = main(["-M", str(model2), "-I", str(root), "-N", str(N), "-D", "trt", "-A", "minmax", "--savefp"])
        finally:
            _close_logs()
        assert rc == 0, capsys.readouterr().err
    assert data2 == root and len(list((root / "results" / "output").rglob("*.bin"))) == N


def test_python_api_calls_from_two_threads_run_one_after_the_other(tmp_path):
    """The "dipoorlet" logger's setup and the custom-op libraries are per process: calls from two
    threads both succeed, each writes its own log, and the logger is as it was afterwards."""
    import threading

    import dipoorlet

    model = tiny_cnn()
    model_path = save(model, tmp_path / "model.onnx")
    data = write_samples(tmp_path / "data", input_feeds(model, N, seed=3))
    logger = logging.getLogger("dipoorlet")
    state = (logger.level, list(logger.handlers), logger.propagate)
    errors = []

    def call(k):
        try:
            dipoorlet.quantize(model=str(model_path), input_dir=str(data), data_num=N, deploy="trt",
                               output_dir=str(tmp_path / f"t{k}"), act_quant="minmax")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert (logger.level, list(logger.handlers), logger.propagate) == state
    for k in range(2):
        assert "INFO dipoorlet.pipeline" in (tmp_path / f"t{k}" / "dipoorlet.log").read_text()


def test_a_nearly_empty_output_is_named_as_the_reason_for_a_low_min_cosine(tmp_path):
    """A detector's map of a window without text is nearly zero: its cosine measures noise. The
    report names that sample, its energy per value against the median sample's and the mean
    cosine without it, all checked here against onnxruntime and numpy."""
    from conftest import conv_model, input_feeds, quantize_model

    model = conv_model(bias=False)
    feeds = input_feeds(model, 6, seed=3)
    feeds[4] = {"x": feeds[4]["x"] * np.float32(0.03)}        # sample 4: a nearly empty output
    res, q = quantize_model(tmp_path, model, feeds=feeds, act_quant="minmax", bias_correction=False)
    (entry,) = res.report["outputs"]
    fp, qs = ort_session(model), ort_session(tmp_path / "out" / "quant_model.onnx")
    f = [fp.run(None, x)[0].astype(np.float64) for x in feeds]
    cos = [_cosine(a, qs.run(None, x)[0]) for a, x in zip(f, feeds)]
    energy = [float((a * a).mean()) for a in f]
    assert np.all(np.isfinite(cos)) and int(np.argmin(cos)) == 4 == entry["min_cosine_sample"]
    assert cos[4] < min(cos[:4] + cos[5:]) - 0.01
    assert entry["min_cosine_energy_ratio"] == pytest.approx(energy[4] / np.median(energy), rel=1e-2)
    assert entry["min_cosine_nearly_empty"] is True and entry["nearly_empty_samples"] == 1
    assert entry["cosine_without_nearly_empty"] == pytest.approx(np.mean(cos[:4] + cos[5:]), abs=1e-6)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "its min cos is sample 4's" in md and "without the 1 nearly empty sample, mean cos" in md
    assert "its min cos is sample 4&#x27;s" in (tmp_path / "out" / "report.html").read_text()
    # a --fail_below gate still fails on the mean over every sample, and says what pulled it down
    from dipoorlet.cli import below_bar

    bar = (entry["cosine"] + entry["cosine_without_nearly_empty"]) / 2
    msg = below_bar(res.report, bar)
    assert f"y cosine {entry['cosine']} ({entry['cosine_without_nearly_empty']} without its 1 nearly empty " \
           "sample" in msg and f"below {bar}" in msg


def test_lowest_sample_ignores_nan_and_infinite_samples():
    """An NMS output of another size (NaN cosine) or a float output holding inf (infinite energy)
    is left out, and the JSON fields stay finite."""
    from dipoorlet.report import _lowest_sample

    got = _lowest_sample([(0, 0.99, 1.0), (1, float("nan"), 1.0), (2, 0.0, float("inf")), (3, 0.5, 1e-6),
                          (4, 0.98, 2.0)])
    assert got == {"min_cosine_sample": 3, "min_cosine_energy_ratio": 1e-6, "min_cosine_nearly_empty": True,
                   "nearly_empty_samples": 1, "cosine_without_nearly_empty": 0.985}
    assert json.loads(json.dumps(got, allow_nan=False)) == got


def test_a_second_run_into_a_locked_output_folder_stops_with_one_line(tmp_path, capsys):
    """Two runs into one -O shared the temporary log name and could publish into each other: the
    one that finds -O locked stops before writing anything there."""
    import dipoorlet
    from dipoorlet.pipeline import LOCK, OutputLock

    model, data, out = run_cli(tmp_path, "minmax")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK}
    held = OutputLock(out)                  # stands for a run in progress in another process
    stale = out / ".dipoorlet-staging-0123456789ab"     # what a run killed by SIGKILL leaves
    (stale / "output").mkdir(parents=True)
    try:
        assert held.fd is not None
        rc = main(["-M", str(tmp_path / "model.onnx"), "-I", str(tmp_path / "data"), "-N", str(N), "-D", "trt",
                   "-O", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and "another dipoorlet run" in err and "is writing into -O" in err
        with pytest.raises(dipoorlet.errors.OutputError, match="another dipoorlet run"):
            dipoorlet.quantize(model=tmp_path / "model.onnx", input_dir=tmp_path / "data", data_num=N, deploy="trt",
                               output_dir=out)
    finally:
        held.release()
        _close_logs()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK} == before
    run_cli(tmp_path, "minmax")                                   # unlocked: runs, and sweeps the stale folder
    assert not stale.exists()


def test_a_lock_file_that_is_a_symlink_is_not_followed(tmp_path):
    from dipoorlet.pipeline import LOCK, OutputLock

    (tmp_path / "o").mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "o" / LOCK).symlink_to(victim)
    lock = OutputLock(tmp_path / "o")        # runs unlocked rather than write its pid into the target
    lock.release()
    assert victim.read_text() == "precious"


def test_an_output_the_quantization_turns_to_inf_is_warned_and_fails_the_bar(tmp_path, capsys):
    """Reciprocal of a Conv whose small values round to 0 on a grid sized by one large value: the
    quantized output is Inf where the float one is finite. The report had a row of Nones and no
    word; --fail_below said 'cosine None'."""
    from dipoorlet.cli import main

    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv1"),
             helper.make_node("Reciprocal", ["c"], ["r"], name="recip"),
             helper.make_node("Conv", ["x", "w3"], ["y"], name="conv3")]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("r", [1, 2, 8, 8]), vi("y", [1, 4, 8, 8])],
                       {"w": np.abs(rand((2, 3, 1, 1), 2, 0.5)) + 0.1, "w3": rand((4, 3, 1, 1), 3, 0.5)})
    rng = np.random.default_rng(0)
    feeds = []
    for _ in range(4):
        x = (np.abs(rng.standard_normal((1, 3, 8, 8))) * 1e-3 + 1e-3).astype(np.float32)
        x[0, 0, 0, 0] = 100.0
        feeds.append({"x": x})
    data = write_samples(tmp_path / "data", feeds)
    out = tmp_path / "out"
    rc = main(["-M", str(save(model, tmp_path / "m.onnx")), "-I", str(data), "-N", "4", "-D", "trt", "-O", str(out),
               "-A", "minmax", "--no_bc", "--no_equalize", "--fail_below", "0.9"])
    err = capsys.readouterr().err
    assert rc == 3
    assert "network output r: the quantized model computes NaN or Inf" in err
    assert "r cosine not finite" in err and "cosine None" not in err
    rows = {o["tensor"]: o for o in json.loads((out / "report.json").read_text())["outputs"]}
    assert rows["r"]["cosine"] is None and rows["y"]["cosine"] > 0.99


def test_summary_marks_outputs_scored_over_the_samples_together(tmp_path):
    from types import SimpleNamespace

    from dipoorlet.cli import summary

    rep = {"platform": "trt", "method": "mse", "samples": 8, "layers": [], "worst_layers": [], "quantized_nodes": 1,
           "qdq_tensors": 1, "weights": 1,
           "outputs": [{"tensor": "prob", "cosine": 0.99, "min_cosine": 0.99, "sqnr_db": 20.0, "cosine_over_samples": True},
                       {"tensor": "map", "cosine": 0.999, "min_cosine": 0.99, "sqnr_db": 30.0}]}
    text = summary(SimpleNamespace(report=rep, timings={}, files=[], output_dir=tmp_path), None)
    assert "prob *" in text and "map *" not in text and "* fewer than 8 values per sample" in text


def test_an_output_whose_size_the_quantization_changes_is_named_for_that(tmp_path, capsys):
    """GatherND over NonZero of a thresholded Conv: quantization moves values across the
    threshold, so the output's length differs. It was reported as NaN/Inf with the advice for a
    Reciprocal, and as a max error of 0.0 though no sample was compared. The samples of another
    size are left out and the others scored (they made the whole output NaN: no mean cosine,
    --fail_below blamed NaN/Inf, every sensitivity score NaN): onnxruntime oracle on the
    samples of equal size."""
    from dipoorlet.cli import main

    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1] * 4, name="conv"),
             helper.make_node("Relu", ["c"], ["y"], name="relu"),
             helper.make_node("Greater", ["y", "thr"], ["gt"], name="gt"),
             helper.make_node("NonZero", ["gt"], ["nz"], name="nz"),
             helper.make_node("Transpose", ["nz"], ["nzt"], name="tr"),
             helper.make_node("GatherND", ["y", "nzt"], ["sel"], name="gnd")]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 2, 8, 8]), vi("sel", ["K"])],
                       {"w": rand((2, 3, 3, 3), 0, 0.3), "b": rand((2,), 1, 0.1), "thr": np.array(0.5, np.float32)})
    feeds = input_feeds(model, 8, seed=0)
    sizes = [(ort_run(model, f)[1].size) for f in feeds]
    out = tmp_path / "out"
    rc = main(["-M", str(save(model, tmp_path / "m.onnx")), "-I", str(write_samples(tmp_path / "d", feeds)), "-N", "8",
               "-D", "qnn", "-O", str(out), "--score_outputs", "sel", "--fail_below", "0.9"])
    err = capsys.readouterr().err
    q = onnx.load(str(out / "quant_model.onnx"))
    moved = sum(ort_run(q, f)[1].size != n for f, n in zip(feeds, sizes))
    assert 0 < moved < len(feeds)                               # the case holds
    rep = json.loads((out / "report.json").read_text())
    row = {o["tensor"]: o for o in rep["outputs"]}["sel"]
    same = [(ort_run(model, f)[1], ort_run(q, f)[1]) for f in feeds]
    same = [(a, b) for a, b in same if a.size == b.size]
    want = np.mean([float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in same])
    assert row["resized_samples"] == moved and row["cosine"] == pytest.approx(want, abs=2e-6)
    assert rc == 0, err
    assert all(s["isolated"]["cosine"] is not None for s in rep["sensitivity"])
    assert f"network output sel: its size differs between the float and the quantized model on {moved} of 8" in err
    assert "computes NaN or Inf" not in err


def test_a_sample_with_a_batch_of_0_is_one_line(tmp_path, capsys):
    # the float model runs on it, but bias correction's and --gptq's own graphs did not: a
    # traceback, or a line blaming the model
    from dipoorlet.cli import main

    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1] * 4, name="conv")],
                       [vi("x", ["N", 3, 8, 8])], [vi("y", ["N", 4, 8, 8])],
                       {"w": rand((4, 3, 3, 3), 0, 0.3), "b": rand((4,), 1, 0.1)})
    r = np.random.default_rng(0)
    data = write_samples(tmp_path / "d", [{"x": r.standard_normal((n, 3, 8, 8)).astype(np.float32)} for n in (2, 3, 0, 2)])
    for extra in ([], ["--gptq"]):
        rc = main(["-M", str(save(model, tmp_path / "m.onnx")), "-I", str(data), "-N", "4", "-D", "trt",
                   "-O", str(tmp_path / "out"), *extra])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("dipoorlet: error:")]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err
        assert "2.npy holds no values (x (0, 3, 8, 8): a batch of 0)" in lines[0]
