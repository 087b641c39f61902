"""Every platform on every real model: does the run complete, are the side files written, and what
does the quantized model score against the float one.

    python scripts/platforms.py [--tasks ocr_cls,ocr_det,vad,minilm] [--platforms trt,snpe,...] [-N 32]
                                [--args="--a_bits 16"]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from benchmark import resolve_task, shared_folder  # noqa: E402
from dipoorlet import platform as platforms  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--tasks", default="ocr_cls,ocr_det,ocr_rec,vad,minilm")
    ap.add_argument("--platforms", default=",".join(platforms.available()))
    ap.add_argument("-N", type=int, default=32)
    ap.add_argument("-A", default="mse")
    ap.add_argument("--out", default=str(ROOT / "scripts" / ".cache" / "platforms"))
    ap.add_argument("--args", default="", help="extra dipoorlet flags for every run, e.g. '--a_bits 16'")
    ap.add_argument("--shared", default=None, help="real data folder (default: shared/data beside the checkout)")
    a = ap.parse_args(argv)
    unknown = [p for p in a.platforms.split(",") if p not in platforms.available()]
    if unknown:
        ap.error(f"--platforms: unknown {', '.join(unknown)} (choose from {', '.join(platforms.available())})")
    if a.N < 1:
        ap.error(f"-N {a.N}: expected a positive number of calibration samples")
    for name in a.tasks.split(","):
        resolve_task(name)          # an unknown task: its one line before any work
    shared = shared_folder(a.shared)
    results = {}
    for name in a.tasks.split(","):
        task = resolve_task(name)(Path(a.out) / f"{name}-work", a.N, shared)
        results[name] = {}
        for plat in a.platforms.split(","):
            out = Path(a.out) / f"{name}-{plat}"
            cmd = [sys.executable, "-m", "dipoorlet", "-M", str(task.model), "-I", str(task.calib_dir),
                   "-N", str(a.N), "-D", plat, "-A", a.A, "-O", str(out), "--skip_prof_layer"] + a.args.split()
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True)
            cell = {"rc": r.returncode, "wall_s": round(time.perf_counter() - t, 1)}
            if r.returncode == 0:
                spec = platforms.load(plat)
                files = sorted(p.name for p in out.iterdir() if p.is_file())
                cell["files"] = files
                cell.update({k: round(v, 4) for k, v in task.evaluate(out / "quant_model.onnx").items()
                             if isinstance(v, float)})
                cell["deploy"] = list(spec.deploy)
            else:
                cell["error"] = (r.stderr.strip().splitlines() or ["?"])[-1][:160]
            results[name][plat] = cell
            print(name, plat, json.dumps(cell), flush=True)
        results[name]["float"] = {k: round(v, 4) for k, v in task.evaluate(task.model).items() if isinstance(v, float)}
    plats = a.platforms.split(",")
    print("\n| model (metric) | " + " | ".join(plats) + " |\n|---|" + "---|" * len(plats))
    for name, row in results.items():
        metric = next((k for k in ("agreement", "mask_iou", "exact_match", "spearman", "box_f1") if k in row["float"]),
                      None)
        cells = [str(row[p].get(metric, "FAIL " + row[p].get("error", ""))) for p in plats]
        print(f"| {name} ({metric}; float {row['float'].get(metric)}) | " + " | ".join(cells) + " |")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "platforms.json").write_text(json.dumps(results, indent=2))
    failed = [f"{name}/{p}" for name, row in results.items() for p in plats if row[p]["rc"] != 0]
    if failed:      # a CI step running this must not pass on a table of failures
        print(f"platforms.py: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
