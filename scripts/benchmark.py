"""Benchmark dipoorlet against onnxruntime's quantizer on a real model: wall time, peak RSS, task metric.

    python scripts/benchmark.py --task ocr_cls --n-calib 64
    python scripts/benchmark.py --task ocr_det --methods dipoorlet:mse,ort:MinMax
    python scripts/benchmark.py --task ocr_cls --methods dipoorlet:mse --n-calib 32,512   # memory vs N

Each quantizer runs in a fresh child process (peak RSS is that run's alone). Every quantized model is
scored by the task's ``evaluate`` with onnxruntime graph optimizations disabled (Q/DQ as float: the
quantization error, not a CPU int8 kernel's). dipoorlet's calibration time is read from its report
(range + histogram passes), next to one plain float pass over the same samples.
Tasks: ocr_cls, ocr_det, ocr_rec (PP-OCR, rapidocr-onnxruntime wheel), vad (Silero), minilm.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from fetch import run_measured  # noqa: E402
from tasks import session  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
DEFAULT_METHODS = ("dipoorlet:mse,dipoorlet:minmax,dipoorlet:hist,dipoorlet:entropy,dipoorlet:percentile,"
                   "ort:MinMax,ort:Entropy,ort:Percentile")

ORT_SCRIPT = r'''
import sys, json, glob, os
from pathlib import Path
import numpy as np, onnx
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                      quantize_static)
model, calib, n, method, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
names = sorted(p.name for p in calib.iterdir() if p.is_dir())
class Reader(CalibrationDataReader):
    def __init__(self):
        self.i = 0
    def get_next(self):
        if self.i >= n:
            return None
        feed = {k: np.load(calib / k / f"{self.i}.npy") for k in names}
        self.i += 1
        return feed
src = out + ".pre.onnx"
m = onnx.load(model)
if m.opset_import[0].version < 13:
    m = onnx.version_converter.convert_version(m, 13)
onnx.save(m, src)
try:
    from onnxruntime.quantization.shape_inference import quant_pre_process
    quant_pre_process(src, src, skip_symbolic_shape=True)
except Exception as e:
    print("quant_pre_process failed, quantizing without it:", e, file=sys.stderr)
quantize_static(src, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                calibrate_method=getattr(CalibrationMethod, method))
'''


def load_task(name: str):
    for module in ("tasks.ocr", "tasks.vad", "tasks.minilm"):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            print(f"(skipping {module}: {exc})", file=sys.stderr)
            continue
        tasks = getattr(mod, "TASKS", {mod.NAME: mod.prepare})
        if name in tasks:
            return tasks[name]
    raise SystemExit(f"unknown task {name!r}; try ocr_cls, ocr_det, ocr_rec, vad, minilm")


def float_pass_seconds(model: Path, calib: Path, n: int) -> float:
    """One float pass as a user would run it: build the session, read each sample, run it.

    dipoorlet's calibration time is measured the same way (its session, its reads, its runs)."""
    t = time.perf_counter()
    sess = session(model, simulated=False)
    names = [i.name for i in sess.get_inputs()]
    for i in range(n):
        sess.run(None, {k: np.load(calib / k / f"{i}.npy") for k in names})
    return time.perf_counter() - t


def run_method(spec: str, task, n: int, out: Path, platform: str) -> dict:
    tool, method = spec.split(":")
    out.mkdir(parents=True, exist_ok=True)
    if tool == "dipoorlet":
        cmd = [sys.executable, "-m", "dipoorlet", "-M", task.model, "-I", task.calib_dir, "-N", n,
               "-D", platform, "-A", method, "-O", out, "--skip_prof_layer"]
        qmodel = out / "quant_model.onnx"
    else:
        qmodel = out / f"ort_{method}.onnx"
        cmd = [sys.executable, "-c", ORT_SCRIPT, task.model, task.calib_dir, n, method, qmodel]
    r = run_measured(cmd, timeout=3600)
    row = {"method": spec, "rc": r["rc"], "wall_s": round(r["wall_s"], 2), "peak_rss_mb": round(r["peak_rss_mb"], 1)}
    if r["rc"] != 0:
        row["error"] = (r["stderr"].strip().splitlines() or ["?"])[-1][:200]
        return row
    if tool == "dipoorlet":
        rep = json.loads((out / "report.json").read_text())
        row["output_cosine"] = rep["outputs"][0]["cosine"]
    t = time.perf_counter()
    row.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in task.evaluate(qmodel).items()})
    row["eval_s"] = round(time.perf_counter() - t, 1)
    return row


def calibration_seconds(out: Path) -> float | None:
    log = out / "dipoorlet.log"
    if not log.exists():
        return None
    for line in reversed(log.read_text().splitlines()):
        if "calibration " in line and " s," in line:
            return float(line.split("calibration ")[1].split(" s")[0])
    return None


def markdown(rows, keys) -> str:
    head = "| " + " | ".join(keys) + " |\n|" + "|".join("---" for _ in keys) + "|\n"
    return head + "\n".join("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="ocr_cls")
    ap.add_argument("--n-calib", default="64", help="samples; a comma list compares memory across N")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--platform", default="trt")
    ap.add_argument("--out", default=str(ROOT / "scripts" / ".cache" / "bench"))
    ap.add_argument("--no-shared", action="store_true", help="ignore ../shared/data (fresh-machine data)")
    a = ap.parse_args(argv)
    shared = None if a.no_shared or not SHARED.is_dir() else SHARED
    rows = []
    for n in [int(x) for x in a.n_calib.split(",")]:
        work = Path(a.out) / f"{a.task}-work-{n}"
        t = time.perf_counter()
        task = load_task(a.task)(work, n, shared)
        print(f"[{a.task}] prepared {n} calibration samples in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        fp = float_pass_seconds(task.model, task.calib_dir, n)
        base = {"method": "float", "n": n, "float_pass_s": round(fp, 3)}
        base.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in task.evaluate(task.model).items()})
        rows.append(base)
        for spec in a.methods.split(","):
            out = Path(a.out) / f"{a.task}-{a.platform}-{spec.replace(':', '-')}-{n}"
            row = run_method(spec, task, n, out, a.platform)
            row["n"] = n
            calib_s = calibration_seconds(out) if spec.startswith("dipoorlet") else None
            if calib_s is not None:
                row["calib_s"] = calib_s
                row["calib_vs_float_pass"] = round(calib_s / fp, 2)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    keys = ["method", "n", "wall_s", "calib_s", "calib_vs_float_pass", "peak_rss_mb", task.headline]
    keys += sorted({k for r in rows for k in r} - set(keys) - {"rc", "eval_s", "data", "float_pass_s", "error"})
    keys += ["error"]
    table = markdown(rows, keys)
    print(f"\n{a.task} on {a.platform}; float pass over the calibration samples: "
          f"{', '.join(str(r['float_pass_s']) + ' s (N=' + str(r['n']) + ')' for r in rows if r['method'] == 'float')}\n")
    print(table)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"{a.task}-{a.platform}.md").write_text(table)
    (Path(a.out) / f"{a.task}-{a.platform}.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
