"""Benchmark dipoorlet against onnxruntime's own quantizer on a real model.

    python scripts/benchmark.py --task ocr_cls [--n-calib 64] \\
        [--methods dipoorlet:mse,dipoorlet:minmax,ort:MinMax,ort:Percentile] [--out scripts/.cache/bench]

Tasks live in scripts/tasks/ (ocr_cls, ocr_det, ocr_rec in ocr.py; vad, minilm in their own
modules when present). Every quantizer runs in a fresh process, through a small wrapper that reports
that one run's wall time and peak RSS. Each produced model is then evaluated by the task with
onnxruntime's graph optimizations off (Q/DQ run as float: the quantization error alone). A plain
float pass of the model over the calibration samples, also in a fresh process, is timed as the
yardstick for calibration speed.

onnxruntime's quantizer (``ort:MinMax|Entropy|Percentile``): ``quantize_static`` in QDQ format,
per-channel weights, activations and weights QInt8 (W8A8), after ``quant_pre_process`` (retried with
``skip_symbolic_shape=True`` where its symbolic shape inference fails, skipped if that fails too); a model below opset 13 is converted to 13 first (onnxruntime writes per-channel
DequantizeLinear that it can't load at opset 11/12). Its histogram methods need one input shape, so
samples of different shapes are zero-padded to the largest for them (noted in the table).

``ort:Entropy`` gets 2048 histogram bins (``--ort-entropy-bins``): with quantize_static's default of 128
its ranges equal MinMax's.

dipoorlet (``dipoorlet:<method>``): ``python -m dipoorlet -M model -I calib -N n -D trt -O out -A method``;
``dipoorlet:mse+gptq+w4`` adds ``--gptq --w_bits 4`` (each ``+flag`` becomes ``--flag``, ``+wN`` ``--w_bits N``).

Results go to ``<out>/<task>/results.{json,md}`` and the table is printed.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pkgutil
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

DEFAULT_METHODS = ("dipoorlet:mse,dipoorlet:minmax,dipoorlet:hist,dipoorlet:entropy,dipoorlet:percentile,"
                   "ort:MinMax,ort:Entropy,ort:Percentile")


# ----------------------------------------------------------------------------------- tasks
def task_registry() -> dict:
    """task name -> prepare function, over every importable module in scripts/tasks/."""
    import tasks

    reg = {}
    for info in pkgutil.iter_modules(tasks.__path__):
        try:
            mod = importlib.import_module(f"tasks.{info.name}")
        except Exception as e:  # a task module that can't be imported here: skip it
            reg.setdefault("_errors", {})[info.name] = f"{type(e).__name__}: {e}"
            continue
        if hasattr(mod, "TASKS"):
            reg.update(mod.TASKS)
        if hasattr(mod, "NAME") and hasattr(mod, "prepare"):
            reg.setdefault(mod.NAME, mod.prepare)
    return reg


def resolve_task(name: str):
    reg = task_registry()
    if name in reg and name != "_errors":
        return reg[name]
    errors = reg.get("_errors", {})
    known = sorted(k for k in reg if k != "_errors")
    msg = f"unknown task {name!r}; available: {', '.join(known) or 'none'}"
    if errors:
        msg += "; modules that failed to import: " + "; ".join(f"{k} ({v})" for k, v in errors.items())
    raise SystemExit(msg)


def shared_folder(given: str | None) -> Path | None:
    """--shared DIR (must be a folder: a typo would silently give rendered inputs), else the default."""
    if given is None:
        return default_shared()
    if not Path(given).is_dir():
        print(f"--shared {given} is not a folder; pass the real-data folder (shared/data) or leave --shared out",
              file=sys.stderr)
        raise SystemExit(2)
    return Path(given)


def default_shared(announce: bool = True) -> Path | None:
    """The real-data folder: ``$DIPOORLET_SHARED_DATA``, else ``shared/data`` beside this checkout or
    beside the main checkout of a git worktree (a worktree under /tmp has no ``../shared``). Without
    one the tasks render their inputs, and the figures are not the README's: that is said on stderr."""
    import subprocess

    env = os.environ.get("DIPOORLET_SHARED_DATA")
    if env:
        if not Path(env).is_dir():
            raise SystemExit(f"DIPOORLET_SHARED_DATA={env} is not a folder; point it at the real-data folder "
                             f"(shared/data) or unset it")
        return Path(env)
    roots = [ROOT]
    try:
        common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10)
        if common.returncode == 0 and common.stdout.strip():
            roots.append(Path(common.stdout.strip()).parent)
    except (OSError, subprocess.SubprocessError):
        pass
    for root in roots:
        p = root.parent / "shared" / "data"
        if p.is_dir():
            return p
    if announce:
        print(f"note: no real data folder found ({ROOT.parent / 'shared' / 'data'} missing, DIPOORLET_SHARED_DATA "
              f"unset): the tasks render their inputs here, so the figures are not comparable with the README's; "
              f"pass --shared DIR", file=sys.stderr, flush=True)
    return None


# ----------------------------------------------------------------------------------- calibration data
def calib_inputs(calib_dir: Path, n: int | None = None) -> list[dict]:
    """The samples of a dipoorlet calibration folder (calib/<input>/<i>.npy) as feed dicts."""
    import numpy as np

    names = sorted(d.name for d in Path(calib_dir).iterdir() if d.is_dir())
    files = {k: sorted((Path(calib_dir) / k).glob("*.npy"), key=lambda p: int(p.stem) if p.stem.isdigit() else p.stem)
             for k in names}
    count = min(len(v) for v in files.values()) if files else 0
    if n:
        count = min(count, n)
    return [{k: np.load(files[k][i]) for k in names} for i in range(count)]


def pad_to_common(feeds: list[dict]) -> tuple[list[dict], bool]:
    """Zero-pad every input to the largest shape seen for it (bottom/right). True if any changed."""
    import numpy as np

    if not feeds:
        return feeds, False
    shapes = {k: np.max([f[k].shape for f in feeds], 0) for k in feeds[0]}
    changed = False
    out = []
    for f in feeds:
        g = {}
        for k, a in f.items():
            if tuple(a.shape) != tuple(shapes[k]):
                changed = True
                b = np.zeros(shapes[k], a.dtype)
                b[tuple(slice(0, s) for s in a.shape)] = a
                a = b
            g[k] = a
        out.append(g)
    return out, changed


# ----------------------------------------------------------------------------------- child processes
def child_float(model: str, calib: str, n: int) -> None:
    """One plain float pass (onnxruntime, default optimizations) over the calibration samples."""
    import onnxruntime  # noqa: F401  (imports are not part of the float pass, as in dipoorlet's timing)
    from tasks import session

    t0 = time.perf_counter()

    feeds = calib_inputs(Path(calib), n)
    s = session(model, simulated=False)
    t1 = time.perf_counter()
    for f in feeds:
        s.run(None, f)
    t2 = time.perf_counter()
    print(json.dumps({"float_run_s": t2 - t1, "float_total_s": t2 - t0, "samples": len(feeds)}))


def child_ort(model: str, calib: str, n: int, method: str, out: str, entropy_bins: int = 2048) -> None:
    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                          QuantType, quantize_static)

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, calib = str(Path(model).resolve()), str(Path(calib).resolve())
    # quant_pre_process writes its temporary files (sym_shape_infer_temp.onnx, <uuid>.data) into
    # the working directory: keep them in this method's folder, not wherever the benchmark runs
    os.chdir(out)
    m = onnx.load(model)
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 13)
    src = model
    if opset < 13:
        from onnx import version_converter

        m = version_converter.convert_version(m, 13)
        src = str(out / "opset13.onnx")
        onnx.save(m, src)
    pre = str(out / "pre.onnx")
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(src, pre)
    except Exception as e:
        # its symbolic shape inference fails on some exports (Concat along axis != 0 of shapes):
        # the rest of the pre-processing (onnx shape inference, constant folding, BN fusion) still runs
        print(f"note: quant_pre_process failed ({type(e).__name__}: {e}); retrying with skip_symbolic_shape")
        try:
            quant_pre_process(src, pre, skip_symbolic_shape=True)
        except Exception as e2:
            print(f"note: quant_pre_process failed again ({type(e2).__name__}: {e2}); quantizing without it")
            pre = src
    feeds = calib_inputs(Path(calib), n)
    padded = False
    if method in ("Entropy", "Percentile", "Distribution"):
        feeds, padded = pad_to_common(feeds)
    if padded:
        print("note: samples zero-padded to one shape")

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

        def rewind(self):
            self.it = iter(feeds)

    if method == "Entropy" and entropy_bins:
        # quantize_static passes no bin count to the entropy calibrator: its default, 128 bins for
        # 128 quantized bins, leaves nothing to clip (the ranges equal MinMax's). Use 2048 bins, as
        # TensorRT's entropy calibration does.
        q = importlib.import_module("onnxruntime.quantization.quantize")

        orig = q.create_calibrator

        def create_calibrator(*a, extra_options=None, **k):
            extra_options = dict(extra_options or {})
            extra_options.setdefault("num_bins", entropy_bins)
            return orig(*a, extra_options=extra_options, **k)

        q.create_calibrator = create_calibrator
    quantize_static(pre, str(out / "quant_model.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    calibrate_method=getattr(CalibrationMethod, method))
    print(json.dumps({"padded": padded, "samples": len(feeds)}))


# ----------------------------------------------------------------------------------- driver
def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return {}


def _reason(r: dict) -> str:
    if r["rc"] == 124:
        return "timeout"
    text = (r.get("stderr") or "") + "\n" + (r.get("stdout") or "")
    if "MemoryError" in text or "bad_alloc" in text or "Failed to allocate" in text or r["rc"] in (-9, 137):
        return "out of memory"
    lines = [l.strip() for l in (r.get("stderr") or "").strip().splitlines()
             if l.strip() and not l.startswith("WARNING")]
    lines = lines or [l.strip() for l in text.strip().splitlines() if l.strip()]
    return (lines[-1] if lines else f"exit code {r['rc']}")[:160]


def run_method(spec: str, task, n: int, out: Path, args, evaluate: bool = True) -> dict:
    from fetch import run_measured

    tool, _, method = spec.partition(":")
    mdir = out / spec.replace(":", "_")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    if tool == "dipoorlet":
        # dipoorlet:mse+gptq+w4 -> -A mse --gptq --w_bits 4 (each "+flag" becomes --flag)
        method, *extra = method.split("+")
        flags = [f for e in extra for f in (["--w_bits", e[1:]] if e[:1] == "w" and e[1:].isdigit() else [f"--{e}"])]
        cmd = [sys.executable, "-m", "dipoorlet", "-M", task.model, "-I", task.calib_dir, "-N", n,
               "-D", "trt", "-O", mdir, "-A", method, "--skip_prof_layer"] + flags + args.dipoorlet_args.split()
    elif tool == "ort":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", "ort", str(task.model),
               str(task.calib_dir), str(args.ort_n_calib or n), method, str(mdir), str(args.ort_entropy_bins)]
    else:
        raise SystemExit(f"unknown method {spec!r} (use dipoorlet:<method> or ort:<MinMax|Entropy|Percentile>)")
    qmodel = mdir / "quant_model.onnx"
    if qmodel.exists():
        qmodel.unlink()
    r = run_measured(cmd, cwd=ROOT, env=env, timeout=args.timeout,
                     mem_limit_mb=args.mem_limit_gb * 1024 if args.mem_limit_gb else None)
    (mdir).mkdir(parents=True, exist_ok=True)
    (mdir / "log.txt").write_text(f"$ {' '.join(map(str, cmd))}\n--- stdout\n{r['stdout']}\n--- stderr\n{r['stderr']}\n")
    row = {"method": spec, "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"], "rc": r["rc"]}
    if tool == "dipoorlet":
        row["calib_s"] = calibration_seconds(mdir / "dipoorlet.log")
        row["calib_pass_s"] = calibration_seconds(mdir / "dipoorlet.log", only="calibration")
    info = _last_json(r["stdout"]) if tool == "ort" else {}
    notes = []
    if tool == "ort" and method == "Entropy" and args.ort_entropy_bins:
        notes.append(f"{args.ort_entropy_bins} bins")
    if info.get("padded"):
        notes.append("padded to one shape")
    if tool == "ort" and args.ort_n_calib and args.ort_n_calib != n:
        notes.append(f"{info.get('samples', args.ort_n_calib)} samples")
    if r["rc"] != 0 or not qmodel.exists():
        row["status"] = "failed: " + _reason(r)
    elif not evaluate:
        row["status"] = "ok"
    else:
        try:
            row["metrics"] = task.evaluate(qmodel)
            row["status"] = "ok"
        except Exception as e:
            row["status"] = f"evaluation failed: {type(e).__name__}: {str(e)[:120]}"
    if notes:
        row["note"] = ", ".join(notes)
    return row


def calibration_seconds(log: Path, only: str | None = None) -> float:
    """dipoorlet's passes over the calibration data before it writes the model, from its log:
    the calibration pass (ranges and histograms, session included) plus, when they ran, the
    equalization statistics pass, the bias-correction and the --gptq/--adaround/--sparse statistics passes (``only``: that one alone; NaN for
    the calibration pass of a one-pass run, whose ranges come from the equalization pass)."""
    import re

    if log.exists():
        if only == "calibration" and "ranges from the equalization pass" in log.read_text():
            return float("nan")   # one pass (-A minmax): no separate calibration pass to time
        for line in reversed(log.read_text().splitlines()):
            found = dict(re.findall(r"\b(equalization|bias correction|gptq|adaround|brecq|qdrop|sparse|calibration) ([0-9.]+) s\b", line))
            if "calibration" in found:
                if only:
                    return float(found.get(only, "nan"))
                return sum(float(v) for v in found.values())
    return float("nan")


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def table(rows: list[dict], headline: str, float_s: float | None, float_total: float | None = None) -> str:
    """``× float pass``: whole run vs. the whole fresh float process. ``calibration × float pass``:
    dipoorlet's calibration (its session, reads and passes) vs. the float pass's session, reads and
    runs (``float_total_s``, imports excluded on both sides)."""
    keys = [headline]
    for r in rows:
        for k, v in (r.get("metrics") or {}).items():
            if k not in keys and isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("n_"):
                keys.append(k)
    head = ["method", "wall s", "× float pass", "calibration s", "calibration × float pass",
            "calibration pass alone × float pass", "peak RSS MB"] + keys + ["status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m = r.get("metrics") or {}
        ratio = r["wall_s"] / float_s if float_s and r["method"] != "float" else float("nan")
        status = r.get("status", "")
        if r.get("note"):
            status += f" ({r['note']})"
        calib = r.get("calib_s", float("nan"))
        alone = r.get("calib_pass_s", float("nan"))
        cells = [r["method"], _fmt(r["wall_s"]), _fmt(ratio), _fmt(calib),
                 _fmt(calib / float_total if float_total else float("nan")),
                 _fmt(alone / float_total if float_total else float("nan")),
                 f"{r['peak_rss_mb']:.0f}" if not math.isnan(r["peak_rss_mb"]) else "—"]
        cells += [_fmt(m.get(k, float("nan"))) for k in keys] + [status]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="ocr_cls")
    ap.add_argument("--n-calib", type=int, default=64)
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated tool:method list")
    ap.add_argument("--out", default=str(SCRIPTS / ".cache" / "bench"))
    ap.add_argument("--shared", default=None, help="real data folder (default: ../shared/data if present)")
    ap.add_argument("--no-shared", action="store_true", help="make the inputs here, as on a fresh machine")
    ap.add_argument("--ort-n-calib", type=int, default=None,
                    help="calibration samples for onnxruntime's quantizer (default: --n-calib)")
    ap.add_argument("--ort-entropy-bins", type=int, default=2048,
                    help="histogram bins for ort:Entropy (0: onnxruntime's default 128, which equals MinMax)")
    ap.add_argument("--dipoorlet-args", default="", help="extra flags for every dipoorlet run, e.g. '--eq_samples 16'")
    ap.add_argument("--repeat", type=int, default=1, help="run each method this many times; times are the fastest")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per quantizer run")
    ap.add_argument("--mem-limit-gb", type=float, default=16,
                    help="address-space cap per quantizer run (0: none)")
    ap.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: expected a positive number of runs")
    if args.n_calib < 1 or (args.ort_n_calib is not None and args.ort_n_calib < 1):
        ap.error(f"--n-calib {args.n_calib} / --ort-n-calib {args.ort_n_calib}: expected a positive number of samples")
    if not args._child:     # before the task is prepared and the float pass run
        for spec in [m.strip() for m in args.methods.split(",") if m.strip()]:
            tool, _, method = spec.partition(":")
            if tool not in ("dipoorlet", "ort") or not method or (
                    tool == "ort" and method not in ("MinMax", "Entropy", "Percentile")):
                ap.error(f"unknown method {spec!r} (use dipoorlet:<method> or ort:<MinMax|Entropy|Percentile>)")

    if args._child:
        kind, *rest = args._child
        if kind == "float":
            child_float(rest[0], rest[1], int(rest[2]))
        elif kind == "ort":
            child_ort(rest[0], rest[1], int(rest[2]), rest[3], rest[4], int(rest[5]) if len(rest) > 5 else 2048)
        return 0

    from fetch import run_measured

    shared = None if args.no_shared else shared_folder(args.shared)
    prepare = resolve_task(args.task)
    # absolute: the runs start in the checkout (cwd=ROOT), and a relative --out had named a
    # folder there that the data was not in
    out = Path(args.out).resolve() / args.task
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {args.out}: cannot create {out} ({exc.strerror}); name a writable folder")
    t0 = time.perf_counter()
    try:
        task = prepare(out / "work", args.n_calib, shared)
    except RuntimeError as exc:       # a download or an export that failed: its one line
        print(f"benchmark.py: {exc}", file=sys.stderr)
        return 2
    print(f"task {task.name}: model {task.model}, {task.n_calib} calibration samples in {task.calib_dir} "
          f"(prepared in {time.perf_counter() - t0:.1f} s)", flush=True)

    # the float yardstick: one pass over the calibration samples in a fresh process
    float_cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", "float", str(task.model),
                 str(task.calib_dir), str(task.n_calib)]
    r = run_measured(float_cmd, cwd=ROOT, timeout=args.timeout)
    fp = _last_json(r["stdout"])
    for _ in range(args.repeat - 1):      # the fastest of --repeat runs, as for the quantizers
        again = run_measured(float_cmd, cwd=ROOT, timeout=args.timeout)
        fp2 = _last_json(again["stdout"])
        if again["rc"] == 0 and r["rc"] == 0:
            r["wall_s"] = min(r["wall_s"], again["wall_s"])
            for key in ("float_run_s", "float_total_s"):
                if key in fp and key in fp2:
                    fp[key] = min(fp[key], fp2[key])
    float_row = {"method": "float", "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"],
                 "metrics": task.evaluate(task.model), "status": "float model, one onnxruntime pass in a fresh process"}
    float_s = r["wall_s"] if r["rc"] == 0 else None
    print(f"float pass over {fp.get('samples', '?')} calibration samples: {fp.get('float_run_s', float('nan')):.2f} s "
          f"of inference, {r['wall_s']:.2f} s for the whole fresh process (import, session, data), "
          f"peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)

    rows = [float_row]
    for spec in [m.strip() for m in args.methods.split(",") if m.strip()]:
        print(f"running {spec} ...", flush=True)
        row = run_method(spec, task, args.n_calib, out, args)
        for _ in range(args.repeat - 1):   # timings: the fastest of --repeat runs
            again = run_method(spec, task, args.n_calib, out, args, evaluate=False)
            if again["status"] == "ok" and row["status"] == "ok":
                for key in ("wall_s", "calib_s", "calib_pass_s"):
                    if key in row:
                        row[key] = min(row[key], again[key])
        rows.append(row)
        m = row.get("metrics") or {}
        print(f"  {spec}: {row['status']}, {row['wall_s']:.1f} s, {row['peak_rss_mb']:.0f} MB, "
              f"{task.headline} {_fmt(m.get(task.headline, float('nan')))}", flush=True)

    md = table(rows, task.headline, float_s, fp.get("float_total_s"))
    # what the task itself used: a --shared folder without the task's data gives rendered inputs
    used = {(row.get("metrics") or {}).get("data") for row in rows} - {None}
    real = bool(shared) and used <= {"real"}
    data_line = (f"real, from {shared}" if real else
                 f"{'/'.join(sorted(used)) or 'rendered'} here ("
                 + (f"{shared} holds no real data for this task" if shared else "no real data folder") + ")")
    splits = {(row.get("metrics") or {}).get("split") for row in rows} - {None}
    split_line = f"Calibration / evaluation split: {'; '.join(sorted(splits))}.\n" if splits else ""
    if shared and not real:
        print(f"note: {task.name} found no real data under {shared}; its inputs are {data_line}", file=sys.stderr)
    header = (f"## {task.name}: {task.n_calib} calibration samples\n\n"
              f"Float pass over the calibration samples: {fp.get('float_run_s', float('nan')):.2f} s inference, "
              f"{r['wall_s']:.2f} s in a fresh process (the `× float pass` column divides by this).\n"
              f"Metrics: simulated (onnxruntime with graph optimizations off), versus the float model "
              f"and, where there are labels, versus them.\n"
              f"Data: {data_line}.\n{split_line}\n")
    print()
    print(header + md)
    (out / "results.md").write_text(header + md + "\n")
    (out / "results.json").write_text(json.dumps(
        {"task": task.name, "n_calib": task.n_calib, "model": str(task.model), "data": str(shared) if real else None,
         "data_used": sorted(used), "split": sorted(splits),
         "float_pass": fp,
         "float_pass_process_s": r["wall_s"], "rows": rows}, indent=2, default=str))
    if not any(row["status"] == "ok" for row in rows[1:]):
        print("every method failed (see the status column)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
