"""Collect per-tensor statistics by streaming calibration samples through onnxruntime.

One session, one pass over the samples. Ranges come from ``ReduceMin``/``ReduceMax`` nodes
appended inside the graph for every target tensor, so two scalars per tensor leave onnxruntime.
Histogram methods also fetch the target tensors themselves; each sample is binned at once into a
histogram on fixed, data-independent edges (:class:`~dipoorlet.stats.LogHistogram`, the float32
bit pattern) and dropped, on a worker thread so numpy's binning overlaps the next inference (both
release the GIL). Because those edges need no range, the range and the histogram come from the
same pass; after the pass (and the merge across processes) each histogram is turned into the
fixed-width one over the tensor's final range. Memory holds one sample's exposed tensors plus
the statistics: it does not grow with -N.

The earlier design (PPQ's) needed two passes: one for the range, then one to bin on edges fixed
by it. One pass costs one float inference per sample less.
"""
from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

from dipoorlet.progress import progress
from dipoorlet.runtime import Runner
from dipoorlet.stats import LogHistogram, TensorStats

log = logging.getLogger(__name__)


def collect(graph, data, indices, targets: list[str], comm, histograms: bool, bins: int = 2048,
            device="cpu") -> dict[str, TensorStats]:
    """Ranges of every target (merged across processes), plus histograms if asked."""
    # With histograms, leave one core to the numpy binning thread (it overlaps inference).
    from dipoorlet.threads import session_threads

    cores = session_threads() or (os.cpu_count() or 2)      # under MPI: this process's share
    threads = max(1, cores - 1) if histograms else 0
    runner = Runner(graph.model, targets if histograms else [], reduce_minmax=targets,
                    types=graph.types, device=device, threads=threads, spin=not histograms,
                    nan_safe=not histograms)
    if not histograms:
        return range_pass(runner, data, indices, targets, comm)
    stats = histogram_pass(runner, data, indices, targets, bins, comm)
    # onnxruntime's plain reductions (the histogram pass's: NaN-safe ones cost it 60% more) misread
    # a tensor holding NaN; the histograms count NaN, so those tensors' ranges are taken again,
    # NaN left out (a pass over the few tensors that hold any, only where one does)
    nan = sorted(t for t, st in stats.items() if st.hist is not None and st.hist.nan > 0)
    if nan:
        del runner
        again = range_pass(Runner(graph.model, [], reduce_minmax=nan, types=graph.types, device=device,
                                  spin=True, nan_safe=True), data, indices, nan, comm)
        for t in nan:
            stats[t].minmax = again[t].minmax
    for st in stats.values():
        mm = st.minmax
        usable = mm.count and mm.lo <= mm.hi and math.isfinite(mm.lo) and math.isfinite(mm.hi)
        st.hist = st.hist.to_linear(mm.lo, mm.hi, bins) if usable else None
    return stats


def range_pass(runner, data, indices, targets: list[str], comm) -> dict[str, TensorStats]:
    stats = {t: TensorStats() for t in targets}
    for i in progress(indices, "calibration: ranges", comm):
        _, ranges = runner.run(data.sample(i), tensors=False)
        for t, (lo, hi) in ranges.items():
            stats[t].minmax.update(lo, hi)
    return comm.merge_stats(stats)


def histogram_pass(runner, data, indices, targets: list[str], bins: int, comm) -> dict[str, TensorStats]:
    """Ranges and the float32 log-histograms of every target in one pass (:func:`collect` turns
    them fixed-width: ``bins`` bins over [0, amax], or 2*bins over [-amax, amax])."""
    stats = {t: TensorStats() for t in targets}
    for t in targets:
        stats[t].hist = LogHistogram()

    def fold(tensors):
        for t in targets:
            stats[t].hist.update(tensors[t])

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for i in progress(indices, "calibration: ranges and histograms", comm):
            tensors, ranges = runner.run(data.sample(i))
            for t, (lo, hi) in ranges.items():
                stats[t].minmax.update(lo, hi)
            if pending is not None:
                pending.result()
            pending = pool.submit(fold, tensors)
        if pending is not None:
            pending.result()
    return comm.merge_stats(stats)
