"""Wall time of dipoorlet under mpirun with 1, 2 and 4 processes on a real model.

    python scripts/mpi_benchmark.py [--task ocr_det] [--n-calib 32] [--ranks 1,2,4] [-A hist]

Also checks that every output file is byte-identical to the single-process run. Needs the
``[mpi]`` extra (mpi4py and the mpich wheel, which puts ``mpirun`` next to the Python executable).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import default_shared, resolve_task  # noqa: E402

COMPARED = ["quant_model.onnx", "act_clip_val.json", "weight_clip_val.json", "report.json", "report.md",
            "report.html"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="ocr_det")
    ap.add_argument("--n-calib", type=int, default=32)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("-A", default="hist")
    ap.add_argument("-D", default="trt")
    ap.add_argument("--out", default=str(ROOT / "scripts" / ".cache" / "mpi"))
    ap.add_argument("--profile", action="store_true",
                    help="include the per-layer profile and sensitivity passes (default: outputs only)")
    a = ap.parse_args(argv)
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    if mpirun is None:
        raise SystemExit("mpirun not found: pip install 'dipoorlet[mpi]'")
    task = resolve_task(a.task)(Path(a.out) / f"{a.task}-work", a.n_calib, default_shared())
    rows, first = [], None
    for ranks in [int(r) for r in a.ranks.split(",")]:
        out = Path(a.out) / f"{a.task}-{ranks}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [mpirun, "-n", str(ranks), sys.executable, "-m", "dipoorlet", "-M", str(task.model),
               "-I", str(task.calib_dir), "-N", str(a.n_calib), "-D", a.D, "-A", a.A, "-O", str(out), "--mpirun"]
        if not a.profile:
            cmd.append("--skip_prof_layer")
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:          # dipoorlet's own line, not a CalledProcessError traceback
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise SystemExit(f"mpirun -n {ranks} dipoorlet exited {done.returncode}:\n{tail}")
        wall = time.perf_counter() - t
        first = first or out
        same = all((first / f).read_bytes() == (out / f).read_bytes() for f in COMPARED)
        rows.append((ranks, wall, same))
        print(f"{ranks} process(es): {wall:.1f} s, outputs identical to 1 process: {same}", flush=True)
    print(f"\n| processes | wall s | speed-up | outputs identical |\n|---|---|---|---|")
    for ranks, wall, same in rows:
        print(f"| {ranks} | {wall:.1f} | {rows[0][1] / wall:.2f}x | {'yes' if same else 'NO'} |")
    print(f"\n({os.cpu_count()} CPU cores on this machine; {a.task}, -N {a.n_calib}, -A {a.A}, -D {a.D})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
