"""Collect per-tensor statistics by streaming calibration samples through onnxruntime.

Pass 1 (always): one session with ``ReduceMin``/``ReduceMax`` appended inside the graph for every
target tensor, so only two scalars per tensor leave onnxruntime. Pass 2 (histogram methods): one
session exposing the target tensors; each batch is binned into fixed-edge histograms at once and
dropped, on a worker thread so numpy's binning overlaps the next inference (both release the
GIL). Memory holds one batch of exposed tensors plus the statistics: it does not grow with -N.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from dipoorlet.runtime import Runner
from dipoorlet.stats import Histogram, TensorStats
from dipoorlet.progress import progress

log = logging.getLogger(__name__)


def range_pass(graph, data, indices, targets: list[str], comm, device="cpu") -> dict[str, TensorStats]:
    runner = Runner(graph.model, [], reduce_minmax=targets, types=graph.types, device=device)
    stats = {t: TensorStats() for t in targets}
    for i in progress(indices, "calibration: ranges", comm):
        _, ranges = runner.run(data.sample(i))
        for t, (lo, hi) in ranges.items():
            stats[t].minmax.update(lo, hi)
    return comm.merge_stats(stats)


def histogram_pass(graph, data, indices, stats: dict[str, TensorStats], bins: int, comm,
                   device="cpu") -> dict[str, TensorStats]:
    targets = [t for t, s in stats.items() if s.minmax.count]
    for t in targets:
        stats[t].hist = Histogram(stats[t].minmax.lo, stats[t].minmax.hi, bins)
    runner = Runner(graph.model, targets, types=graph.types, device=device)

    def fold(tensors):
        for t, x in tensors.items():
            stats[t].hist.update(x)

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for i in progress(indices, "calibration: histograms", comm):
            tensors, _ = runner.run(data.sample(i))
            if pending is not None:
                pending.result()
            pending = pool.submit(fold, tensors)
        if pending is not None:
            pending.result()
    local = {t: stats[t] for t in targets}
    return {**stats, **comm.merge_stats(local)}
