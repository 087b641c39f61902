"""Command line: argv → QuantConfig → pipeline.quantize(); errors become one line and exit 2."""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import time
from pathlib import Path

from dipoorlet import __version__
from dipoorlet.errors import DipoorletError

log = logging.getLogger("dipoorlet")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2, like ours
        from dipoorlet.threads import launcher_rank

        # under mpirun every rank meets it: rank 0 alone prints it
        self.exit(2, f"dipoorlet: error: {message} (see python -m dipoorlet --help)\n" if launcher_rank() == 0 else None)


def build_parser() -> argparse.ArgumentParser:
    from dipoorlet import platform
    from dipoorlet.ranges import RANGE_METHODS

    p = _Parser(prog="python -m dipoorlet",
                description="Post-training quantization of an ONNX model for a deployment backend.")
    p.add_argument("-M", "--model", required=True, help="float ONNX model")
    p.add_argument("-I", "--input_dir", required=True,
                   help="calibration data: DIR/<input_name>/<i>.bin|.npy, or an .npz of [N,...] arrays")
    p.add_argument("-O", "--output_dir", default=None, help="output folder (default: <model dir>/results)")
    p.add_argument("-N", "--data_num", type=int, required=True, help="number of calibration samples")
    p.add_argument("-A", "--act_quant", default="mse", metavar="METHOD",
                   help=f"activation range method: {', '.join(sorted(RANGE_METHODS))} (default mse)")
    p.add_argument("-D", "--deploy", required=True, metavar="PLATFORM",
                   help=f"backend: {', '.join(platform.available())}, or a path to a .toml spec")
    p.add_argument("--bins", type=int, default=2048, help="histogram bins (hist, mse, entropy, percentile)")
    p.add_argument("--threshold", type=float, default=0.99999, help="|x| mass kept by -A hist")
    p.add_argument("--percentile", type=float, default=99.999, help="percentile for -A percentile")
    p.add_argument("--skip_layers", nargs="+", action="extend", default=[], metavar="NODE", help="node names to keep in float")
    p.add_argument("--input_shape", nargs="+", action="extend", default=[], metavar="NAME:D1,D2,..",
                   help="shape of a dynamic input for raw .bin data, e.g. x:1,3,640,640")
    p.add_argument("--savefp", action="store_true", help="save the float model's outputs per sample")
    p.add_argument("--skip_prof_layer", action="store_true", help="profile network outputs only")
    p.add_argument("--quant_format", default="QDQ", choices=["QDQ", "QOP"],
                   help="QDQ (Quantize/DequantizeLinear pairs) or QOP (QLinearConv, QGemm… where possible)")
    bc = p.add_mutually_exclusive_group()
    bc.add_argument("--bc", action="store_true",
                   help="bias correction: after calibration, remove the mean shift each quantized "
                        "Conv/Gemm/MatMul adds to its output (one extra pass of the quantized model). On "
                        "by default; give --bc to keep it with --gptq, "
                        "--adaround, --brecq or --sparse, which turn it off otherwise (--auto_a16 and --auto_w8 "
                        "turn it off and refuse --bc)")
    bc.add_argument("--no_bc", action="store_true", help="no bias correction")
    p.add_argument("--bc_samples", type=int, default=None, metavar="K",
                   help="samples the bias correction pass reads (default: all N up to 256)")
    p.add_argument("--gptq", action="store_true",
                   help="choose each Conv/Gemm/MatMul weight's rounding (and its bias) to minimize the "
                        "layer's output error on the calibration data, its input's quantization included "
                        "(GPTQ on input statistics; one extra pass of the quantized model)")
    p.add_argument("--adaround", action="store_true",
                   help="choose each Conv/Gemm/MatMul weight's rounding, up or down, by AdaRound: gradient "
                        "descent on the layer's output error from the same statistics as --gptq (no torch "
                        "needed; one extra pass of the quantized model)")
    p.add_argument("--ada_iters", type=int, default=1000, metavar="N",
                   help="AdaRound's optimization steps per layer (default 1000)")
    p.add_argument("--brecq", action="store_true",
                   help="choose the weights' rounding block by block (BRECQ): AdaRound's relaxation fitted by "
                        "gradient descent so each block of 2-8 layers reproduces the float model's block output, "
                        "activation grids simulated; needs PyTorch (the [torch] extra); --ada_iters steps per block")
    p.add_argument("--drop", action="store_true",
                   help="QDrop: --brecq with activation quantization randomly dropped (p = 0.5 per element) "
                        "while the rounding is fitted; implies --brecq")
    p.add_argument("--lsq", action="store_true",
                   help="learn the activation scales inside each --brecq block with the rounding (LSQ's "
                        "gradient); a block keeps them only where they lower its output error; implies --brecq")
    p.add_argument("--sparse", default=None, metavar="N:M|RATE",
                   help="prune the quantized Conv/Gemm/MatMul weights as they are rounded (SparseGPT, from the "
                        "--gptq statistics): N:M keeps at most N non-zero weights in every M consecutive input "
                        "channels (2:4 for TensorRT's sparse kernels), RATE zeroes that share of every row")
    p.add_argument("--gptq_samples", type=int, default=None, metavar="K",
                   help="samples the --gptq/--adaround statistics pass reads (default: N, at most 256)")
    p.add_argument("--gptq_memory", type=float, default=256.0, metavar="MB",
                   help="memory for --gptq/--adaround's statistics (two K x K float64 matrices per layer); layers that "
                        "do not fit share further passes over the samples (default 256)")
    p.add_argument("--no_equalize", action="store_true",
                   help="do not equalize per-channel activation ranges between Conv pairs nor smooth "
                        "MatMul/Conv inputs (on by default for platforms with per-channel weights), nor "
                        "equalize weight ranges between Conv pairs (on by default with per-tensor weights)")
    p.add_argument("--no_shift", action="store_true",
                   help="do not shift one-sided activations (ReLU/GELU outputs) onto the symmetric "
                        "grid with the shift absorbed in the next layer's bias (on by default for "
                        "symmetric-activation platforms such as trt)")
    p.add_argument("--eq_samples", type=int, default=None, metavar="K",
                   help="samples the equalization statistics pass reads (default: all N up to 64)")
    p.add_argument("--stpu_wg", action="store_true", help="stpu: Winograd F(2,3) for 3x3 stride-1 convolutions")
    p.add_argument("--sens_samples", type=int, default=8,
                   help="samples for isolated layer sensitivity and --auto_skip (default 8)")
    p.add_argument("--prof_samples", type=int, default=None, metavar="K",
                   help="samples the error profile (report tables, --fail_below) reads (default: all N "
                        "up to 64, as the equalization statistics; all N with --savefp)")
    p.add_argument("--val_dir", default=None, metavar="DIR",
                   help="held-out samples in -I's layout (e.g. inputs from deployment): the error profile "
                        "(report tables, clipped values, --fail_below) reads these instead of the calibration "
                        "samples, so it shows what calibration did not see")
    p.add_argument("--val_num", type=int, default=None, metavar="K",
                   help="--val_dir samples the profile reads, spread evenly over the folder (default: all of them up to 64)")
    p.add_argument("--criterion", default="cosine", choices=["cosine", "sqnr", "maxabs"],
                   help="how layers are ranked by sensitivity")
    p.add_argument("--auto_skip", default=None, metavar="TARGET",
                   help="keep the most sensitive layers float until the output meets TARGET "
                        "(e.g. 0.999 or cosine:0.999 or sqnr:30)")
    p.add_argument("--max_float_layers", type=int, default=10,
                   help="at most this many float layers for --auto_skip (default 10)")
    p.add_argument("--auto_a16", default=None, metavar="TARGET",
                   help="on backends with 16-bit activations (qnn, snpe, ort): give the most sensitive layers' "
                        "inputs 16-bit grids until the output meets TARGET (mixed W8A8/W8A16)")
    p.add_argument("--max_a16_layers", type=int, default=None,
                   help="at most this many layers for --auto_a16 (default: as many as the target needs)")
    p.add_argument("--auto_w8", default=None, metavar="TARGET",
                   help="with weights narrower than 8 bits (--w_bits 4): give the most sensitive layers 8-bit "
                        "weights until the output meets TARGET (mixed W4/W8)")
    p.add_argument("--max_w8_layers", type=int, default=None,
                   help="at most this many layers for --auto_w8 (default: as many as the target needs)")
    p.add_argument("--fail_below", default=None, metavar="TARGET",
                   help="exit with code 3 (for CI) when a network output is below TARGET: its mean cosine over the "
                        "profile's samples (0.99 or cosine:0.99) or its SQNR in dB (sqnr:30; pooled over the "
                        "samples, so outputs near zero on some samples do not pull it down)")
    p.add_argument("--score_outputs", nargs="+", action="extend", default=[], metavar="OUTPUT",
                   help="network outputs that --auto_skip/--auto_a16/--auto_w8 targets, the sensitivity ranking and "
                        "--fail_below judge, e.g. a recurrent model's prediction, not its state (default: every "
                        "output but integer ones such as class ids)")
    p.add_argument("--w_bits", type=int, default=None, help="weight bits for every layer (default: the platform's)")
    p.add_argument("--a_bits", type=int, default=None, help="activation bits for every layer (2..8; 16 where the backend has 16-bit activations: qnn, snpe, ort)")
    p.add_argument("--layer_bits", nargs="+", action="extend", default=[], metavar="NODE=wNaM",
                   help="per-layer bit widths, e.g. conv1=w8a8 fc=w4 (w or a may be left out)")
    p.add_argument("--trt_version", default="8601", help="version in the TensorRT calibration cache header")
    p.add_argument("--mpirun", action="store_true", help="run as one of the processes mpirun/mpiexec started")
    p.add_argument("--slurm", action="store_true", help="run as one of the tasks srun started (PMI)")
    p.add_argument("--log_all_ranks", action="store_true",
                   help="under MPI, ranks other than 0 also log, to dipoorlet.rank<N>.log")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="onnxruntime device")
    p.add_argument("--recon_device", default=None, metavar="cpu|cuda|cuda:N",
                   help="torch's device for --brecq/--drop/--lsq (default cpu); cuda takes one GPU per process "
                        "of a machine under mpirun/srun")
    p.add_argument("--custom_op_lib", nargs="+", action="extend", default=[], metavar="LIB",
                   help="onnxruntime custom-op libraries for the model's non-standard ops (they stay float), "
                        "e.g. the path onnxruntime_extensions.get_library_path() gives")
    p.add_argument("--debug", action="store_true", help="full tracebacks and debug logs")
    p.add_argument("--version", action="version", version=f"dipoorlet {__version__}")
    # the reference tool's flags with no counterpart here: a clear word instead of argparse's
    for flag in ("--we", "--update_bn"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ada_bs", type=int, default=None, metavar="B",
                   help="--brecq's samples per optimization step (default 16, per process under MPI)")
    p.add_argument("--ada_epoch", type=int, default=None, help=argparse.SUPPRESS)
    return p


def setup_logging(out_dir: Path | None, debug: bool, rank: int = 0, all_ranks: bool = False,
                  world: int = 1) -> None:
    """Console and dipoorlet.log on rank 0; other ranks are silent unless --log_all_ranks."""
    root = logging.getLogger("dipoorlet")
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.handlers.clear()
    root.propagate = False
    if rank != 0 and not all_ranks:
        root.addHandler(logging.NullHandler())
        return
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(console)
    if out_dir is not None:
        # one process logs into a temporary file that becomes dipoorlet.log when the run ends (see
        # finish_log): a failed run must not replace the log of the run whose outputs -O holds.
        # Under MPI another rank's MPI_Abort can end rank 0 anywhere, before it names the log: it
        # writes dipoorlet.log directly into a folder without an earlier run's outputs (so a
        # failed run leaves its log), and the temporary file where it would replace their log.
        name = (RUN_LOG if world == 1 else rank0_log(out_dir).name) if rank == 0 else rank_log(out_dir, rank).name
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            from dipoorlet.util import QuietFileHandler

            fh = QuietFileHandler(out_dir / name, mode="w", encoding="utf-8")
            fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            root.addHandler(fh)
        except OSError:
            pass  # reported as a clear error by the pipeline's output check


RUN_LOG = ".dipoorlet-run.log"


def finish_log(out_dir: Path | None, ok: bool) -> None:
    """Close the log file and name it: ``dipoorlet.log`` after a run that wrote its outputs, or
    when -O holds no earlier run's outputs; else ``dipoorlet.failed.log``, next to the earlier
    run's files and log."""
    _close_log_files()
    name_run_log(out_dir, ok)


def _close_log_files() -> None:
    root = logging.getLogger("dipoorlet")
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler):
            h.close()
            root.removeHandler(h)


def rank_log(out_dir: Path, rank: int) -> Path:
    """--log_all_ranks: where rank ``rank`` (> 0) logs. Beside an earlier run's outputs, a
    temporary name that finish_rank_log gives the rank's log once the run has written its
    outputs: a failed run must not replace the earlier run's dipoorlet.rank<N>.log."""
    return _rank_run_log(out_dir, rank) if _earlier_outputs(out_dir) else out_dir / f"dipoorlet.rank{rank}.log"


def _rank_run_log(out_dir: Path, rank: int) -> Path:
    return out_dir / f".dipoorlet-run.rank{rank}.log"


def finish_rank_log(out_dir: Path, rank: int) -> None:
    """After a run that wrote its outputs: close this rank's log and give it its name."""
    _close_log_files()
    tmp = _rank_run_log(out_dir, rank)
    if tmp.is_file():
        try:
            os.replace(tmp, out_dir / f"dipoorlet.rank{rank}.log")
        except OSError:
            pass


def _check_log_names(cfg) -> None:
    """The log and lock files a run writes into -O must not be the model's own files (an
    external-data file named dipoorlet.log in -O was overwritten with the log; found by a bug
    hunt). The outputs themselves are checked when they are published."""
    from dipoorlet.errors import OutputError
    from dipoorlet.graph import model_files
    from dipoorlet.pipeline import LOCK

    out = cfg.output_dir.resolve()
    for f in model_files(cfg.model):
        try:
            r = f.resolve()
        except OSError:
            continue
        # dipoorlet.log, dipoorlet.failed.log, dipoorlet.rank<N>.log, .dipoorlet-run[.rank<N>].log
        if r.parent == out and (r.name == LOCK or (r.name.endswith(".log") and r.name.startswith(
                ("dipoorlet.", RUN_LOG[:-len("log")])))):
            raise OutputError(f"{f} is a file of the model -M, and the run writes its {r.name} into -O {cfg.output_dir}; "
                              "choose another -O, or move the model")


def rank0_log(out_dir: Path) -> Path:
    """The file rank 0 of an MPI run logs into (setup_logging's choice): another rank that fails
    adds its error line there, since its abort ends rank 0 before rank 0 can."""
    return out_dir / (RUN_LOG if _earlier_outputs(out_dir) else "dipoorlet.log")


def note_in_log(path: Path | None, line: str) -> None:
    """Append ``line`` to another process's log where this process sees it (a shared -O)."""
    if path is None or not path.is_file():
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass


def _earlier_outputs(out_dir: Path) -> bool:
    """-O holds an earlier run's outputs and their log."""
    from dipoorlet.pipeline import MANIFEST

    return (out_dir / MANIFEST).exists() and (out_dir / "dipoorlet.log").exists()


def name_run_log(out_dir: Path | None, ok: bool) -> None:
    """Rename the closed run log (see :func:`finish_log`)."""
    if out_dir is None or not (out_dir / RUN_LOG).exists():
        return
    name = "dipoorlet.log" if ok or not _earlier_outputs(out_dir) else "dipoorlet.failed.log"
    try:
        os.replace(out_dir / RUN_LOG, out_dir / name)
    except OSError as exc:   # never turn the run's own result into a failure
        print(f"dipoorlet: warning: the log stays in {out_dir / RUN_LOG} ({exc})", file=sys.stderr)


def summary(result, cfg) -> str:
    from dipoorlet.report import (float_weights_note, lowest_cosine_notes, node_label, output_label, profile_note,
                                  shared_grid_note, table)

    rep = result.report
    lines = ["", f"dipoorlet {__version__}: {rep['platform']} / -A {rep['method']} / {rep['samples']} samples"]
    rows = [[output_label(o, rep), o["cosine"], o["min_cosine"], o["sqnr_db"]] for o in rep["outputs"]]
    note = profile_note(rep)       # " (error profile over ...)" where it read a part or held-out samples
    if note:
        lines.append(note.strip(" ()") + ":")
    lines.append(table(["network output", "mean cos", "min cos", "SQNR dB"], rows))
    if any(o.get("cosine_over_samples") for o in rep["outputs"]):
        lines.append("* fewer than 8 values per sample: one cosine over all samples' values together")
    lines += lowest_cosine_notes(rep)
    c = rep.get("clipped")
    if c and c["tensors_clipped"] and rep.get("profile_data"):
        w = c["worst"][0]
        g = lambda v: "inf" if v is None else f"{v:.3g}"    # None: infinite (JSON has no inf)
        lines.append(f"{c['tensors_clipped']} of {c['tensors']} quantized activations saturate on these samples; worst "
                     f"{w['tensor']}: {100 * w['fraction']:.3g}% of its values, up to {g(w['peak_over_range'])}x its range, "
                     f"{g(w['saturation_over_rounding_noise'])}x its rounding noise (report.md lists them)")
    layers = {l["node"]: l for l in rep["layers"]}
    if rep["worst_layers"]:
        lines.append("")
        lines.append(table(["worst layers (cumulative)", "op", "cos", "SQNR dB"],
                           [[node_label(n, rep), layers[n]["op_type"], layers[n]["cosine"], layers[n]["sqnr_db"]]
                            for n in rep["worst_layers"]]))
    if rep.get("diagnosis") or rep.get("error_spread"):
        lines.append("")
        lines.append("what limits accuracy (isolated sensitivity; details in report.md):")
        if rep.get("error_spread"):
            lines.append(f"  spread over many layers: {rep['error_spread']['advice']}")
        lines += [f"  {node_label(d['node'], rep)}: {d['advice']}" for d in rep.get("diagnosis", [])[:2 if rep.get("error_spread") else 3]]
    t = result.timings
    lines.append("")
    wide = f" ({rep['qdq_tensors_16bit']} 16-bit)" if rep.get("qdq_tensors_16bit") else ""
    lines.append(f"{rep['quantized_nodes']} nodes quantized, {rep['qdq_tensors']} activations{wide} and "
                 f"{rep['weights'] - rep.get('int32_biases', 0)} weights with Q/DQ"
                 + (f" (and {rep['int32_biases']} int32 biases)" if rep.get("int32_biases") else "") + "; "
                 + "".join(f"{label} {t[key]:.2f} s, " for key, label in
                           (("equalize_s", "equalization"), ("bias_correction_s", "bias correction"),
                            ("gptq_s", "gptq"), ("adaround_s", "adaround"), ("brecq_s", "brecq"), ("qdrop_s", "qdrop"),
                            ("sparse_s", "sparse")) if key in t)
                 + f"calibration {t.get('calibration_s', 0):.2f} s, "
                 + (f"sensitivity {t['sensitivity_s']:.2f} s, " if t.get("sensitivity_s", 0) >= 0.005 else "")
                 + f"profile {t.get('profile_s', 0):.2f} s, total {t.get('total_s', 0):.2f} s")
    if float_weights_note(rep):
        lines.append(float_weights_note(rep))
    if shared_grid_note(rep):
        lines.append(shared_grid_note(rep))
    # files in sub-folders (--savefp's output/, one per sample and tensor) as one entry per folder
    folders: dict[str, int] = {}
    for p in result.files:
        if p.parent != result.output_dir:
            top = p.relative_to(result.output_dir).parts[0]
            folders[top] = folders.get(top, 0) + 1
    lines.append("wrote: " + ", ".join(sorted([str(p.relative_to(result.output_dir)) for p in result.files
                                               if p.parent == result.output_dir]
                                              + [f"{d}/ ({k} file{'s' if k != 1 else ''})" for d, k in folders.items()])))
    return "\n".join(lines)


def parse_layer_bits(items) -> dict:
    """``["conv1=w4a8", "fc=w4"]`` -> {"conv1": (4, 8), "fc": (4, None)} (config.parse_layer_bits)."""
    from dipoorlet.config import parse_layer_bits as parse

    return parse(items)


def below_bar(report: dict, bar) -> str:
    """A message when a judged output is below ``bar`` (--fail_below: a cosine, or "cosine:X" /
    "sqnr:DB"), else ''."""
    if bar is None:
        return ""
    from dipoorlet.sensitivity import parse_target

    crit, value = parse_target(bar, flag="--fail_below", any_cosine=True)
    key = "cosine" if crit == "cosine" else "sqnr_db"
    judged = set(report.get("score_outputs") or [o["tensor"] for o in report.get("outputs", [])])

    def why(o) -> str:
        rest = o.get("cosine_without_nearly_empty")
        if crit != "cosine" or not o.get("nearly_empty_samples") or rest is None:
            return ""
        k = o["nearly_empty_samples"]
        return (f" ({rest} without its {k} nearly empty sample{'s' if k > 1 else ''}, outputs near zero whose "
                "cosine measures noise: see report.md; sqnr:DB judges the pooled error instead)")

    def low(o) -> bool:
        v = o.get(key)
        if v is None:   # report.json holds no inf: an SQNR of None with no error at all is infinite
            return not (key == "sqnr_db" and o.get("max_abs_err") == 0)
        return v < value

    name = "cosine" if crit == "cosine" else "SQNR"
    unit = "" if crit == "cosine" else " dB"
    rows = [f"{o['tensor']} {name} {o.get(key)}{unit}{why(o)}" if o.get(key) is not None else
            f"{o['tensor']} {name} not finite (the quantized output is NaN or Inf)"
            for o in report.get("outputs", []) if o["tensor"] in judged and low(o)]
    # an output no profile sample scored (each was left out: the float model's output was NaN
    # there) has no row: it meets no bar
    scored = {o["tensor"] for o in report.get("outputs", [])}
    rows += [f"{t}: no profile sample scored it (the log says why)"
             for t in report.get("score_outputs") or report.get("network_outputs") or () if t not in scored]
    return ("; ".join(rows) + f" below {value}{unit} (outputs were written)") if rows else ""


def _log_to_file(message: str) -> None:
    for h in logging.getLogger("dipoorlet").handlers:
        if isinstance(h, logging.FileHandler):
            try:
                h.stream.write(message + "\n")
                h.flush()
            except (OSError, ValueError):
                pass    # a full disk: the line is on stderr already (this raised past it, exit 1)


def _given_dests(argv) -> set[str]:
    """The flags on the command line, by destination: the parser again with no defaults, so a flag
    given at its default value (``--trt_version 8601``) is told from one left out."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(sys.argv[1:] if argv is None else argv)))


def main(argv=None) -> int:
    from dipoorlet.threads import share_cores

    share_cores()      # under mpirun/srun: this process's share of the cores (before numpy's pools start)
    args = build_parser().parse_args(argv)
    state = {"out_dir": None, "ok": False}
    _load_native_modules()
    installed, previous = _catch_sigterm()
    try:
        return _main(args, argv, state)
    finally:
        # Ctrl-C and SIGTERM wait until the log is renamed and the lock is gone: one landing here,
        # just after the outputs were written, had left the earlier run's log as dipoorlet.log and
        # the lock in place, and was reported as "no output was written", exit 130 (found by a
        # hunt). A signal noted here is raised again after, with the handlers the process had.
        from dipoorlet.threads import note_signals

        held = note_signals()
        try:
            finish_log(state["out_dir"], state["ok"])
            if state.get("lock") is not None:
                state["lock"].release()
        finally:
            _restore_signals(state, installed, previous, held)


def _restore_signals(state, installed: bool, previous, held) -> None:
    from dipoorlet.threads import put_back

    noted, before = held if held is not None else ([], {})
    put_back(before)
    ignored = bool(state.get("helper_rank") and state["ok"])
    if ignored:
        # an MPI rank other than 0 whose run is done (rank 0 has published): a signal while it
        # finalizes would make mpirun kill rank 0 as it closes its log, and report the
        # signal as the run's exit code; there is nothing left to stop
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    elif installed:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    if noted and not ignored:
        term = signal.getsignal(signal.SIGTERM)
        if signal.SIGTERM in noted and term in (signal.SIG_DFL, None):
            # as a SIGTERM during the run: Terminated, which python -m dipoorlet says (what -O holds)
            # and ends with 143, under mpirun through MPI's abort (re-raised with the default
            # action, the process died by the signal: mpich reported exit code 15 with its banner)
            raise Terminated()
        for sig in dict.fromkeys(noted):
            # a caller's own handler (or Ctrl-C's KeyboardInterrupt, said by __main__) gets it now
            signal.raise_signal(sig)


class Terminated(KeyboardInterrupt):
    """SIGTERM (slurm's time limit, kill, a CI step's timeout): unwinds like Ctrl-C, so the
    staging folder goes and -O keeps what it held. A KeyboardInterrupt: CPython 3.11's compile()
    drops other exceptions a signal handler raises while it compiles a module, and a SIGTERM
    during a lazy import was then lost (the run finished, exit 0); handlers catch it before
    KeyboardInterrupt."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _load_native_modules() -> None:
    """Import the compiled modules before the SIGTERM handler is set: a Terminated raised while
    one initializes aborted the process (exit 134, "terminate called after throwing an instance
    of nanobind::python_error") or surfaced as an ImportError with a traceback (exit 1). A SIGTERM
    before the handler gets the default action (exit 143)."""
    # Ctrl-C is held back while they load too: one landing in onnxruntime's initialization came
    # back as ImportError('initialization failed'), which the except below swallowed (the run went
    # on, exit 0), and one in onnx's aborted the process (exit 134). It is delivered right after.
    block = hasattr(signal, "pthread_sigmask")
    if block:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import numpy  # noqa: F401
        import onnx  # noqa: F401
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            pass            # the run says what is missing where it needs it
    finally:
        if block:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _catch_sigterm():
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False, None
    try:
        return True, signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return False, None


REFERENCE_ONLY = {
    "update_bn": "--update_bn is not built here: BatchNormalization is folded into the Conv before quantization; "
                 "bias correction (on by default; --bc keeps it with a fitted rounding) removes the mean shift each "
                 "quantized layer adds to its output",
}


def _refuse_reference_flags(args) -> None:
    """The reference tool's flags that have no counterpart: a refusal that says what to use."""
    from dipoorlet.errors import ConfigError

    for name, why in REFERENCE_ONLY.items():
        if getattr(args, name):
            raise ConfigError(why)


def _note_reference_flags(args) -> None:
    """The reference tool's flags that this tool covers otherwise: a note in the log."""
    if args.we:
        log.info("--we: weight/activation equalization is on by default here (--no_equalize turns it off)")
    for name in ("ada_bs", "ada_epoch"):
        if name == "ada_bs" and (args.brecq or args.drop or args.lsq):
            continue            # --brecq's mini-batch size
        if getattr(args, name) is not None:
            log.warning("--%s ignored: %s; --ada_iters N sets its optimization steps (default 1000)", name,
                        "--brecq counts steps, not epochs" if args.brecq or args.drop or args.lsq else
                        "AdaRound here is full-batch over input statistics, not mini-batches of activations")


_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def _main(args, argv, state) -> int:
    debug = args.debug
    comm = None
    try:
        from dipoorlet.dist import make_comm

        comm = make_comm(args.mpirun, args.slurm)
        state["helper_rank"] = comm.world > 1 and comm.rank != 0
        _refuse_reference_flags(args)      # with the communicator: printed once, by rank 0
        from dipoorlet.config import QuantConfig, given_fields
        from dipoorlet.data import parse_input_shapes
        from dipoorlet.graph import check_model_path
        from dipoorlet.pipeline import PUBLISHED, check_output_dir, quantize

        PUBLISHED.clear()   # what a run before this one in the process published (an interrupt is said of this run's)

        cfg = QuantConfig(model=args.model, input_dir=args.input_dir, data_num=args.data_num,
                          deploy=args.deploy, output_dir=args.output_dir, act_quant=args.act_quant,
                          bins=args.bins, threshold=args.threshold, percentile=args.percentile,
                          skip_layers=tuple(args.skip_layers),
                          input_shapes=parse_input_shapes(args.input_shape), savefp=args.savefp,
                          skip_prof_layer=args.skip_prof_layer, trt_version=args.trt_version,
                          quant_format=args.quant_format, stpu_wg=args.stpu_wg,
                          bias_correction=True if args.bc else False if args.no_bc else None,
                          bc_samples=args.bc_samples,
                          gptq=args.gptq, adaround=args.adaround, ada_iters=args.ada_iters,
                          brecq=args.brecq, drop=args.drop, lsq=args.lsq, ada_bs=args.ada_bs, sparse=args.sparse,
                          gptq_samples=args.gptq_samples, gptq_memory=args.gptq_memory,
                          equalize=not args.no_equalize, shift=not args.no_shift, equalize_samples=args.eq_samples,
                          sens_samples=args.sens_samples, prof_samples=args.prof_samples,
                          val_dir=args.val_dir, val_num=args.val_num,
                          criterion=args.criterion, auto_skip=args.auto_skip,
                          max_float_layers=args.max_float_layers, fail_below=args.fail_below,
                          score_outputs=tuple(args.score_outputs),
                          auto_a16=args.auto_a16, max_a16_layers=args.max_a16_layers,
                          auto_w8=args.auto_w8, max_w8_layers=args.max_w8_layers,
                          w_bits=args.w_bits, a_bits=args.a_bits, layer_bits=parse_layer_bits(args.layer_bits),
                          device=args.device, recon_device=args.recon_device,
                          custom_op_libs=tuple(args.custom_op_lib), debug=debug,
                          given=given_fields(_given_dests(argv)))
        check_model_path(cfg.model)  # before -O (default <model dir>/results) is created
        check_output_dir(cfg.output_dir)
        _check_log_names(cfg)
        if comm.rank == 0:     # one run at a time into -O (before its log is opened there)
            from dipoorlet.pipeline import OutputLock

            state["lock"] = OutputLock(cfg.output_dir)
        setup_logging(cfg.output_dir, debug, comm.rank, args.log_all_ranks, comm.world)
        state["out_dir"] = cfg.output_dir if comm.rank == 0 else None
        state["rank0_log"] = rank0_log(cfg.output_dir)
        log.info("dipoorlet %s: %s", __version__, " ".join(sys.argv[1:] if argv is None else argv))
        _note_reference_flags(args)
        if comm.world > 1:
            log.info("running as %d MPI processes", comm.world)
        start = time.perf_counter()
        result = quantize(cfg, comm)
        state["ok"] = True   # the outputs are written (--fail_below's exit 3 included)
        if comm.rank != 0 and args.log_all_ranks:
            finish_rank_log(cfg.output_dir, comm.rank)
        if comm.rank == 0:
            _remove_other_rank_logs(cfg.output_dir, comm.world if args.log_all_ranks else 1)
            log.info(summary(result, cfg))
            low = below_bar(result.report, cfg.fail_below)
            if low:
                log.error("dipoorlet: --fail_below %s: %s", cfg.fail_below, low)
                return 3
        log.debug("done in %.2f s", time.perf_counter() - start)
        return 0
    except DipoorletError as exc:
        import traceback

        # --debug: the traceback, and still the exit code of bad input (under MPI printed by the
        # rank that prints the line)
        return _fail(comm, state, str(exc), exc.exit_code, traceback.format_exc() if debug else "")
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
            return _fail(comm, state, f"{exc.strerror}{': ' + str(exc.filename)[:120] + '...' if exc.filename else ''}; "
                                      "choose a shorter -O path; -O keeps what it held", 2)
        if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
            # the disk, not the tool: one line (the outputs are written into staging and published
            # all at once, so -O keeps what it held)
            return _fail(comm, state, f"{exc.strerror}{': ' + str(exc.filename) if exc.filename else ''}; free "
                                      f"space or choose another -O (or --savefp off); -O keeps what it held", 2)
        if isinstance(exc, MemoryError):
            # the machine, not the tool: one line (numpy's _ArrayMemoryError had ended the run in a
            # traceback; found by a hunt on a 2 GB model)
            return _fail(comm, state, f"out of memory ({str(exc) or type(exc).__name__}); a run holds about 5x the "
                                      "model's weights at its peak: run on a machine with more memory, or with "
                                      "--skip_prof_layer; -O keeps what it held", 2)
        if comm is not None and comm.world > 1:
            import traceback
            traceback.print_exc()
            print(f"dipoorlet: internal error (rank {comm.rank}): {exc}", file=sys.stderr)
            finish_log(state["out_dir"], False)
            comm.abort(1)
        raise
    except Terminated:
        return _stop(comm, state, "terminated (SIGTERM)", 143)
    except KeyboardInterrupt:
        return _stop(comm, state, "interrupted", 130)


def _remove_other_rank_logs(out_dir: Path, world: int) -> None:
    """After a run that wrote its outputs: the per-rank logs (--log_all_ranks) an earlier run left
    in -O that this run did not write."""
    ours = {f"dipoorlet.rank{r}.log" for r in range(1, world)}
    # and the temporary names a failed run's ranks left (.dipoorlet-run.rank<N>.log; a hunt found
    # them kept through later runs), but not this run's: its ranks may still be renaming theirs
    ours |= {_rank_run_log(Path(out_dir), r).name for r in range(1, world)}
    for path in [*Path(out_dir).glob("dipoorlet.rank*.log"), *Path(out_dir).glob(".dipoorlet-run.rank*.log")]:
        if path.name not in ours and path.is_file() and not path.is_symlink():
            try:
                path.unlink()
            except OSError:
                pass


def _fail(comm, state, message: str, code: int, trace: str = "") -> int:
    """One error line; under MPI every rank is taken down. An error every rank meets (a bad flag,
    a missing model) is printed by rank 0 alone: the others wait a moment first, and rank 0's
    MPI_Abort ends them before they print; an error of one rank's share of the data is printed
    by that rank after the wait. Before the communicator exists (it could not be made), only the
    launcher's rank 0 prints."""
    from dipoorlet.threads import launcher_rank

    multi = comm is not None and comm.world > 1
    if multi and comm.rank != 0:
        try:
            time.sleep(RANK_ERROR_DELAY_S)
        except BaseException:  # noqa: BLE001 - Ctrl-C/SIGTERM in the wait: this rank aborts all the same
            pass
    if comm is None and launcher_rank() != 0:
        return code
    where = f" (rank {comm.rank})" if multi else ""
    if multi and comm.rank != 0:
        note_in_log(state.get("rank0_log"), f"dipoorlet: error{where}: {message}")
    if trace:
        print(trace.rstrip(), file=sys.stderr, flush=True)
    print(f"dipoorlet: error{where}: {message}", file=sys.stderr, flush=True)
    _log_to_file(f"dipoorlet: error{where}: {message}")
    if multi:
        finish_log(state["out_dir"], False)   # MPI_Abort skips every finally block
        comm.abort(code)  # take every rank down now, never leave them waiting
    return code


def _published() -> list:
    return getattr(sys.modules.get("dipoorlet.pipeline"), "PUBLISHED", None) or []


def _stop_note() -> str:
    PUBLISHED = _published()
    return f"after the outputs were written into {PUBLISHED[-1]}" if PUBLISHED else "no output was written"


def _stop(comm, state, what: str, code: int) -> int:
    """Ctrl-C or SIGTERM: the staging folder is gone (the exception unwound through the pipeline);
    under MPI the other ranks are taken down too, or they would wait in a collective forever."""
    # not imported here: Ctrl-C may have cut the pipeline's own import short (a module left half
    # initialized), and a pipeline that never loaded published nothing
    PUBLISHED = _published()
    done = _stop_note()
    if PUBLISHED:
        state["ok"] = True          # the log describes the outputs -O now holds
    if comm is not None and comm.world > 1 and comm.rank != 0 and PUBLISHED:
        # a signal to this rank alone, held until rank 0 had published: the run is done, rank 0
        # finishes it (an abort would kill it while it closes its log); this rank exits with the code
        print(f"dipoorlet: rank {comm.rank}: {what}; {done}", file=sys.stderr, flush=True)
        _log_to_file(f"dipoorlet: rank {comm.rank}: {what}; {done}")
        return code
    if comm is not None and comm.world > 1 and comm.rank != 0:
        # mpirun passes Ctrl-C to every rank: rank 0 says it and its abort ends this wait (a
        # signal sent to this rank alone is said after it)
        try:
            time.sleep(RANK_ERROR_DELAY_S)
        except BaseException:  # noqa: BLE001 - a second Ctrl-C: this rank aborts all the same
            pass
    from dipoorlet.threads import abort_launch, say_stopped

    if comm is not None:
        print(f"dipoorlet: {what}; {done}", file=sys.stderr, flush=True)
    else:                       # before MPI started
        say_stopped(f"dipoorlet: {what}; {done}", RANK_ERROR_DELAY_S)
    # the log says so too: a run a CI step's time limit or slurm ended had left a log that stopped
    # on an ordinary line, which reads like a hang or a crash (found by a bug hunt)
    _log_to_file(f"dipoorlet: {what}; {done}")
    if comm is None:
        abort_launch(code)
    if comm is not None and comm.world > 1:
        finish_log(state["out_dir"], False)
        comm.abort(code)
    return code


RANK_ERROR_DELAY_S = 2.0
