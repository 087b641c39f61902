"""The README's real example: quantize the PP-OCR text-direction classifier for TensorRT.

    python scripts/example.py [--task ocr_cls] [--n-calib 64] [-A mse] [-D trt]

Fetches the model from the ``rapidocr-onnxruntime`` wheel (``pip download --no-deps``), makes
calibration and evaluation data (real text-line crops from ../shared/data/ocr-images when that
folder exists; text lines rendered with Pillow otherwise), runs ``python -m dipoorlet`` on it,
and scores the quantized model against the float model and the labels (upright vs. rotated 180°).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import SHARED, load_task  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="ocr_cls", help="ocr_cls, ocr_det, ocr_rec, vad or minilm")
    ap.add_argument("--n-calib", type=int, default=64)
    ap.add_argument("-A", default="mse", help="activation range method")
    ap.add_argument("-D", default="trt", help="backend")
    ap.add_argument("--out", default=str(ROOT / "scripts" / ".cache" / "example"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    shared = SHARED if SHARED.is_dir() else None
    print(f"preparing {a.task}: model and {a.n_calib} calibration samples "
          f"({'real data from ' + str(shared) if shared else 'rendered data'})", flush=True)
    task = load_task(a.task)(out / f"{a.task}-work", a.n_calib, shared)
    qdir = out / f"{a.task}-{a.D}-{a.A}"
    cmd = [sys.executable, "-m", "dipoorlet", "-M", str(task.model), "-I", str(task.calib_dir),
           "-N", str(a.n_calib), "-D", a.D, "-A", a.A, "-O", str(qdir)]
    print("$ " + " ".join(cmd), flush=True)
    t = time.perf_counter()
    rc = subprocess.call(cmd)
    if rc != 0:
        return rc
    wall = time.perf_counter() - t
    base, quant = task.evaluate(task.model), task.evaluate(qdir / "quant_model.onnx")
    keys = [k for k in quant if isinstance(quant[k], float)]
    print(f"\n{a.task}, -D {a.D} -A {a.A}, {a.n_calib} calibration samples, dipoorlet wall {wall:.1f} s")
    print("| model | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, row in (("float", base), ("quantized", quant)):
        print(f"| {name} | " + " | ".join(f"{row.get(k, ''):.4f}" for k in keys) + " |")
    print(f"\noutputs in {qdir} (report.html shows where accuracy was lost)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
