"""Collect per-tensor statistics by streaming calibration samples through onnxruntime.

One session serves both passes. Pass 1 (always) fetches only the ``ReduceMin``/``ReduceMax``
nodes appended inside the graph for every target tensor, so two scalars per tensor leave
onnxruntime. Pass 2 (histogram methods) fetches the target tensors themselves; each sample is
binned into fixed-edge histograms at once and dropped, on a worker thread so numpy's binning
overlaps the next inference (both release the GIL). Memory holds one sample's exposed tensors
plus the statistics: it does not grow with -N.
"""
from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

from dipoorlet.progress import progress
from dipoorlet.runtime import Runner
from dipoorlet.stats import Histogram, TensorStats

log = logging.getLogger(__name__)


def collect(graph, data, indices, targets: list[str], comm, histograms: bool, bins: int = 2048,
            device="cpu") -> dict[str, TensorStats]:
    """Ranges of every target (merged across processes), plus histograms if asked."""
    # With histograms, leave one core to the numpy binning thread (it overlaps inference).
    threads = max(1, (os.cpu_count() or 2) - 1) if histograms else 0
    runner = Runner(graph.model, targets if histograms else [], reduce_minmax=targets,
                    types=graph.types, device=device, threads=threads)
    stats = range_pass(runner, data, indices, targets, comm)
    if histograms:
        stats = histogram_pass(runner, data, indices, stats, bins, comm)
    return stats


def range_pass(runner, data, indices, targets: list[str], comm) -> dict[str, TensorStats]:
    stats = {t: TensorStats() for t in targets}
    for i in progress(indices, "calibration: ranges", comm):
        _, ranges = runner.run(data.sample(i), tensors=False)
        for t, (lo, hi) in ranges.items():
            stats[t].minmax.update(lo, hi)
    return comm.merge_stats(stats)


def histogram_pass(runner, data, indices, stats: dict[str, TensorStats], bins: int, comm) -> dict[str, TensorStats]:
    targets = [t for t, s in stats.items() if s.minmax.count and math.isfinite(s.minmax.amax)]
    for t in targets:
        stats[t].hist = Histogram(stats[t].minmax.lo, stats[t].minmax.hi, bins)

    def fold(tensors):
        for t in targets:
            stats[t].hist.update(tensors[t])

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for i in progress(indices, "calibration: histograms", comm):
            tensors, _ = runner.run(data.sample(i), ranges=False)
            if pending is not None:
                pending.result()
            pending = pool.submit(fold, tensors)
        if pending is not None:
            pending.result()
    local = {t: stats[t] for t in targets}
    return {**stats, **comm.merge_stats(local)}
