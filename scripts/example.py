"""A real example: quantize PP-OCR's text-direction classifier with dipoorlet for TensorRT.

    python scripts/example.py [--task ocr_cls] [--n-calib 64] [-A mse] [--no-shared] [-- extra dipoorlet flags]

It fetches the model from the ``rapidocr-onnxruntime`` wheel on PyPI (``pip download --no-deps``),
prepares data (real text-line crops from ``../shared/data`` when that folder exists, rendered
text lines otherwise), runs

    python -m dipoorlet -M <model> -I <calib> -N <n> -D trt -O <out> -A <method>

and compares the quantized model with the float one (onnxruntime with graph optimizations off, so
Q/DQ run as float: the quantization error alone). Needs Pillow for the OCR tasks.
Other tasks: ocr_det, ocr_rec (and vad, minilm where scripts/tasks has them).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

from benchmark import default_shared, resolve_task  # noqa: E402


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Quantize a real model with dipoorlet and check it.")
    ap.add_argument("--task", default="ocr_cls", help="ocr_cls (default), ocr_det, ocr_rec, ...")
    ap.add_argument("--n-calib", type=int, default=64, help="calibration samples (default 64)")
    ap.add_argument("-A", "--act-quant", default="mse", help="dipoorlet's -A (default mse)")
    ap.add_argument("--out", default=str(SCRIPTS / ".cache" / "example"), help="work and output folder")
    ap.add_argument("--shared", default=None, metavar="DIR",
                    help="the real-data folder (default: $DIPOORLET_SHARED_DATA, else shared/data beside the checkout)")
    ap.add_argument("--no-shared", action="store_true", help="render the inputs even if ../shared/data exists")
    args, extra = ap.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]

    if args.shared is not None and not Path(args.shared).is_dir():
        ap.error(f"--shared {args.shared} is not a folder; point it at the real-data folder (shared/data)")
    shared = None if args.no_shared else Path(args.shared) if args.shared else default_shared(announce=False)
    prepare = resolve_task(args.task)
    out = Path(args.out).resolve() / args.task    # absolute: dipoorlet runs in the checkout (cwd=ROOT)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {args.out}: cannot create {out} ({exc.strerror}); name a writable folder")
    print(f"[1/3] preparing {args.task}: model and {args.n_calib} calibration samples "
          f"({'real data from ' + str(shared) if shared else 'rendered data'}) ...", flush=True)
    try:
        task = prepare(out / "work", args.n_calib, shared)
    except RuntimeError as exc:       # a download or an export that failed: its one line
        print(f"example.py: {exc}", file=sys.stderr)
        return 2

    qdir = out / f"dipoorlet_{args.act_quant}"
    cmd = [sys.executable, "-m", "dipoorlet", "-M", str(task.model), "-I", str(task.calib_dir),
           "-N", str(task.n_calib), "-D", "trt", "-O", str(qdir), "-A", args.act_quant, *extra]
    print("[2/3] " + " ".join(cmd), flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    qmodel = qdir / "quant_model.onnx"
    if r.returncode != 0 or not qmodel.exists():
        print(f"dipoorlet failed (exit code {r.returncode})", file=sys.stderr)
        return r.returncode or 1

    print("[3/3] evaluating float and quantized models ...", flush=True)
    fm, qm = task.evaluate(task.model), task.evaluate(qmodel)
    keys = [task.headline] + [k for k, v in fm.items() if k != task.headline and not k.startswith("n_")
                              and isinstance(v, (int, float)) and not isinstance(v, bool)]
    print()
    print(f"{task.name}: {task.n_calib} calibration samples, dipoorlet -A {args.act_quant} -D trt "
          f"in {wall:.1f} s; evaluated on {fm.get('n_eval', '?')} {fm.get('data', '')} samples")
    print("| model | size MB | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name, path, m in (("float", task.model, fm), (f"dipoorlet {args.act_quant}", qmodel, qm)):
        size = Path(path).stat().st_size / 2**20
        print(f"| {name} | {size:.1f} | " + " | ".join(_fmt(m.get(k, '—')) for k in keys) + " |")
    print(f"\nquantized model: {qmodel}")
    print(f"reports (where accuracy was lost, layer by layer): {qdir / 'report.md'}, {qdir / 'report.html'}")
    if shared is None:
        # a fresh checkout has no real data beside it: say that these figures are the rendered
        # inputs', not the README's (a fresh-machine check found nothing said so)
        why = ("--no-shared" if args.no_shared else "no real-data folder: shared/data beside the checkout is "
               "missing and DIPOORLET_SHARED_DATA is unset")
        print(f"note: the inputs were rendered here ({why}), so these figures are not the README's, which score "
              "real inputs; pass --shared DIR to use real data")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
