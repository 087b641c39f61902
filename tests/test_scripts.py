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
    ("memory_vs_n.py", ["--small", "16", "--large", "8"], ["small < large", "16 and 8"]),
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
