"""Per-layer error of the quantized model, streamed: no activation outlives its sample.

For every quantized node's outputs and every network output, the float model's tensor is compared
with the quantized model's tensor at the same name (the *cumulative* error: everything upstream
quantized, as the reference tool reports it). Both models run once per sample, each in one
session built for the pass. Per sample only a few scalars are kept (cosine, error and signal
energy, max |error|), tagged with the sample index so results merged across processes are summed
in sample order and come out bit-identical for any process count.

Cosine of a sample: sum(f*q) / sqrt(sum(f^2) sum(q^2)), 1 when both are zero. Layer cosine is the
mean over samples (as the reference); SQNR is 10 log10(sum f^2 / sum (f-q)^2) over all samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dipoorlet.progress import progress
from dipoorlet.runtime import Runner


@dataclass
class ErrorRow:
    tensor: str
    node: str
    op_type: str
    cosine: float
    min_cosine: float
    sqnr_db: float
    max_abs_err: float
    is_output: bool = False


def sample_metrics(f: np.ndarray, q: np.ndarray) -> tuple[float, float, float, float]:
    f = f.astype(np.float64, copy=False).ravel()
    q = q.astype(np.float64, copy=False).ravel()
    ff, qq, fq = float(f @ f), float(q @ q), float(f @ q)
    if ff == 0.0 and qq == 0.0:
        cos = 1.0
    elif ff == 0.0 or qq == 0.0:
        cos = 0.0
    else:
        cos = fq / math.sqrt(ff * qq)
    d = f - q
    return cos, float(d @ d), ff, float(np.abs(d).max()) if d.size else 0.0


def profile_targets(graph, placement, layers: bool) -> dict[str, tuple[str, str]]:
    """tensor -> (node name, op type) for quantized nodes' float outputs, plus network outputs."""
    targets = {}
    if layers:
        quantized = set(placement.quantized_nodes)
        for node in graph.topological_nodes():
            if node.name in quantized:
                for out in node.output:
                    if out and graph.is_float(out):
                        targets[out] = (node.name, node.op_type)
    for out in graph.output_names:
        prod = graph.producer.get(out)
        targets[out] = (prod.name if prod else out, prod.op_type if prod else "Input")
    return targets


def collect_errors(graph, qmodel, data, indices, targets: dict, comm, device="cpu", on_float=None):
    names = list(targets)
    fp = Runner(graph.model, names, types=graph.types, device=device)
    qr = Runner(qmodel, names, types=graph.types, optimize=False, device=device)
    per_sample: dict[str, list] = {t: [] for t in names}
    for i in progress(indices, "error profile", comm):
        feed = data.sample(i)
        f_out, _ = fp.run(feed)
        q_out, _ = qr.run(feed)
        if on_float is not None:
            on_float(i, f_out)
        for t in names:
            per_sample[t].append((i,) + sample_metrics(f_out[t], q_out[t]))
    return comm.gather_samples(per_sample)


def summarize(per_sample: dict, targets: dict, outputs: list[str], quantized=()) -> list[ErrorRow]:
    """One row per layer tensor and one per network output (a quantized layer's output that is
    also a network output gets both)."""
    quantized = set(quantized)
    rows = []
    for t, samples in per_sample.items():
        samples = sorted(samples)
        if not samples:
            continue
        cos = [s[1] for s in samples]
        err = math.fsum(s[2] for s in samples)
        sig = math.fsum(s[3] for s in samples)
        sqnr = math.inf if err == 0 else (10 * math.log10(sig / err) if sig > 0 else -math.inf)
        node, op = targets[t]
        values = (math.fsum(cos) / len(cos), min(cos), sqnr, max(s[4] for s in samples))
        if t not in outputs or node in quantized:
            rows.append(ErrorRow(t, node, op, *values, False))
        if t in outputs:
            rows.append(ErrorRow(t, node, op, *values, True))
    return rows
