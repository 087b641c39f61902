"""Wall time of dipoorlet under mpirun with 1, 2 and 4 processes on a real model.

    python scripts/mpi_benchmark.py [--task ocr_det] [--n-calib 32] [--ranks 1,2,4] [-A hist]

Also checks that every output file is byte-identical to the first run's (the first of
--ranks). Every process runs on --threads threads (default 1): onnxruntime's Conv and OpenBLAS
round by their thread count, so one process of 2 threads and two of 1 differ in the last bits
of a bias (on the PP-OCRv4 detector up to 0.7% of four biases; README, *Distributed
calibration*). Needs the ``[mpi]`` extra (mpi4py and the mpich wheel, which puts ``mpirun``
next to the Python executable).
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

# every file a run writes but the log, whose timings differ
SKIPPED = {"dipoorlet.log"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="ocr_det", help="benchmark task (default ocr_det)")
    ap.add_argument("--n-calib", type=int, default=32, help="calibration samples (default 32)")
    ap.add_argument("--ranks", default="1,2,4", help="process counts to run, comma-separated (default 1,2,4)")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads per process (DIPOORLET_THREADS, OPENBLAS/OMP_NUM_THREADS; default 1)")
    ap.add_argument("-A", default="hist", help="dipoorlet's -A (default hist)")
    ap.add_argument("-D", default="trt", help="dipoorlet's -D (default trt)")
    ap.add_argument("--out", default=str(ROOT / "scripts" / ".cache" / "mpi"), help="work and output folder")
    ap.add_argument("--profile", action="store_true",
                    help="include the per-layer profile and sensitivity passes (default: outputs only)")
    a = ap.parse_args(argv)
    try:
        counts = [int(r) for r in a.ranks.split(",")]
    except ValueError:
        ap.error(f"--ranks {a.ranks}: expected process counts separated by commas, e.g. 1,2,4")
    if not counts or min(counts) < 1 or a.threads < 1 or a.n_calib < 1:
        ap.error("--ranks, --threads and --n-calib take positive numbers")
    env = dict(os.environ, DIPOORLET_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads),
               OMP_NUM_THREADS=str(a.threads))
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    if mpirun is None:
        raise SystemExit("mpirun not found: pip install 'dipoorlet[mpi]'")
    task = resolve_task(a.task)(Path(a.out) / f"{a.task}-work", a.n_calib, default_shared())
    rows, first = [], None
    for ranks in counts:
        out = Path(a.out) / f"{a.task}-{ranks}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [mpirun, "-n", str(ranks), sys.executable, "-m", "dipoorlet", "-M", str(task.model),
               "-I", str(task.calib_dir), "-N", str(a.n_calib), "-D", a.D, "-A", a.A, "-O", str(out), "--mpirun"]
        if not a.profile:
            cmd.append("--skip_prof_layer")
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:          # dipoorlet's own line, not a CalledProcessError traceback
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise SystemExit(f"mpirun -n {ranks} dipoorlet exited {done.returncode}:\n{tail}")
        wall = time.perf_counter() - t
        first = first or out
        names = sorted({p.name for d in (first, out) for p in d.iterdir() if p.is_file()} - SKIPPED)
        differ = [f for f in names if not ((first / f).exists() and (out / f).exists()
                                             and (first / f).read_bytes() == (out / f).read_bytes())]
        rows.append((ranks, wall, differ))
        print(f"{ranks} process(es): {wall:.1f} s, {len(names)} output files, "
              f"{'all identical' if not differ else 'differing: ' + ', '.join(differ)}", flush=True)
    print(f"\n| processes | wall s | speed-up vs {rows[0][0]} | outputs identical |\n|---|---|---|---|")
    for ranks, wall, differ in rows:
        print(f"| {ranks} | {wall:.1f} | {rows[0][1] / wall:.2f}x | {'yes' if not differ else 'NO'} |")
    print(f"\n({os.cpu_count()} CPU cores on this machine; {a.threads} thread(s) per process; {a.task}, "
          f"-N {a.n_calib}, -A {a.A}, -D {a.D})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
