"""Peak RSS of dipoorlet for a small and a large -N on the same model and data.

    python scripts/memory_vs_n.py [--task ocr_cls] [--small 32] [--large 512] [-A mse]

Statistics, not activations, are kept: the peak must not grow with -N. Each run is a fresh
process; peak RSS is that process's own (see fetch.run_measured).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import default_shared, resolve_task  # noqa: E402
from fetch import run_measured  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="ocr_cls")
    ap.add_argument("--small", type=int, default=32)
    ap.add_argument("--large", type=int, default=512)
    ap.add_argument("-A", default="mse")
    ap.add_argument("--out", default=str(ROOT / "scripts" / ".cache" / "memory"))
    a = ap.parse_args(argv)
    if not 1 <= a.small < a.large:
        ap.error(f"--small and --large must satisfy 1 <= small < large, got {a.small} and {a.large}")
    task = resolve_task(a.task)(Path(a.out) / f"{a.task}-work", a.large, default_shared())
    rows = []
    for n in (a.small, a.large):
        out = Path(a.out) / f"{a.task}-{n}"
        r = run_measured([sys.executable, "-m", "dipoorlet", "-M", task.model, "-I", task.calib_dir,
                          "-N", n, "-D", "trt", "-A", a.A, "-O", out])
        if r["rc"] != 0:
            raise SystemExit(r["stderr"][-2000:])
        rows.append((n, r["wall_s"], r["peak_rss_mb"]))
        print(f"-N {n}: {r['wall_s']:.1f} s, peak RSS {r['peak_rss_mb']:.1f} MB", flush=True)
    (n0, _, m0), (n1, _, m1) = rows
    print(f"\n| -N | wall s | peak RSS MB |\n|---|---|---|")
    for n, w, m in rows:
        print(f"| {n} | {w:.1f} | {m:.1f} |")
    print(f"\npeak RSS at -N {n1} is {100 * (m1 / m0 - 1):+.1f}% of -N {n0} ({a.task}, -A {a.A}, full report)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
