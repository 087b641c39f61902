"""Range methods: pure functions from a tensor's statistics to a clip range ``(lo, hi)``.

Registered by name (``-A``). Each needs at most a MinMax and a fixed-edge Histogram
(:mod:`dipoorlet.stats`), so each is exact under merging across processes.

``qmax`` is the largest integer level of the target grid (127 for signed symmetric int8, 255 for
unsigned 8-bit); methods that model rounding noise use it, so other bit widths work unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dipoorlet.stats import TensorStats

RANGE_METHODS: dict[str, Callable] = {}
NEEDS_HISTOGRAM: set[str] = set()


@dataclass(frozen=True)
class RangeParams:
    qmax: int = 127
    threshold: float = 0.99999      # hist: |x| mass kept
    percentile: float = 99.999      # percentile: two-sided
    quant_bins: int = 128           # entropy: levels of the quantized distribution


def register(name: str, histogram: bool):
    def deco(fn):
        RANGE_METHODS[name] = fn
        if histogram:
            NEEDS_HISTOGRAM.add(name)
        return fn
    return deco


def clip_range(st: TensorStats, c: float) -> tuple[float, float]:
    """Symmetric clip ``c`` intersected with the data range; always lo <= 0 <= hi."""
    return min(max(st.minmax.lo, -c), 0.0), max(min(st.minmax.hi, c), 0.0)


@register("minmax", histogram=False)
def minmax(st: TensorStats, p: RangeParams) -> tuple[float, float]:
    """The global minimum and maximum over all calibration samples."""
    return st.minmax.lo, st.minmax.hi


@register("hist", histogram=True)
def hist(st: TensorStats, p: RangeParams) -> tuple[float, float]:
    """Smallest |x| bin whose cumulative mass reaches ``threshold``; clip at its centre.

    Same as the reference tool (|x| histogram over [0, amax] of the pooled samples, clip value
    ``(i + 0.5) * width``), but the histogram is built on data-independent edges and re-binned
    over the global range, so the result does not depend on how samples were split across
    processes.
    """
    counts = st.hist.abs_counts()
    total = counts.sum()
    if total == 0:
        return minmax(st, p)
    cdf = np.cumsum(counts) / total
    i = int(np.searchsorted(cdf, p.threshold, side="left"))
    if i >= counts.size:
        return minmax(st, p)
    return clip_range(st, (i + 0.5) * st.hist.width)


@register("percentile", histogram=True)
def percentile(st: TensorStats, p: RangeParams) -> tuple[float, float]:
    """Two-sided percentiles of the signed values, interpolated linearly inside a bin.

    ``hi`` is the ``percentile``-th percentile and ``lo`` the ``(100 - percentile)``-th, so an
    asymmetric platform gets both ends; a symmetric one uses ``max(|lo|, |hi|)``. onnxruntime's
    Percentile method instead takes one percentile of |x|, which is what ``hist`` does.
    """
    h = st.hist
    counts = h.counts.astype(np.float64)
    total = counts.sum()
    if total == 0:
        return minmax(st, p)
    cdf = np.concatenate([[0.0], np.cumsum(counts) / total])
    edges = h.edges()
    q = p.percentile / 100.0
    hi = float(np.interp(q, cdf, edges))
    lo = float(np.interp(1.0 - q, cdf, edges)) if h.signed else st.minmax.lo
    return min(max(st.minmax.lo, lo), 0.0), max(min(st.minmax.hi, hi), 0.0)


def _octav(counts: np.ndarray, centres: np.ndarray, qmax: int) -> float:
    """OCTAV's fixed point ``s <- E[|x| 1{|x|>s}] / (E[1{|x|<=s}] / (12 qmax^2) + E[1{|x|>s}])``."""
    c = counts.astype(np.float64)
    s = float((c * centres).sum() / max(c.sum(), 1.0))
    for _ in range(50):
        out = centres > s
        denom = c[~out].sum() / (12.0 * qmax**2) + c[out].sum()
        new = float((c[out] * centres[out]).sum() / denom) if denom > 0 else s
        if abs(new - s) <= 1e-6 * max(s, 1e-12):
            return new
        s = new
    return s


def quant_error(counts: np.ndarray, centres: np.ndarray, clips: np.ndarray, qmax: int) -> np.ndarray:
    """Squared error of quantizing every bin centre on the grid of each clip value.

    Exact for values at the centres: rounding to the step ``s / qmax`` inside the range,
    clipping to ``s`` outside. Unlike the uniform-noise model it knows that zeros (post-ReLU
    tensors are mostly zeros) cost nothing.
    """
    nz = counts > 0  # empty bins cost nothing; activation histograms are mostly empty
    step = (clips / qmax)[:, None]
    x = centres[nz][None, :]
    # (x - min(round(x / step), qmax) * step)^2, written in place 64 candidates at a time (each
    # block stays in cache; the same values as the one-expression form, which made six arrays
    # of candidates x bins, up to 4 MB each, per call)
    err = np.empty((clips.size, x.shape[1]))
    for a in range(0, clips.size, 64):
        b, s = err[a:a + 64], step[a:a + 64]
        np.divide(x, s, out=b)
        np.round(b, out=b)
        np.minimum(b, qmax, out=b)
        b *= s
        np.subtract(x, b, out=b)
        np.square(b, out=b)
    return err @ counts[nz].astype(np.float64)


@register("mse", histogram=True)
def mse(st: TensorStats, p: RangeParams) -> tuple[float, float]:
    """MSE-optimal symmetric clip on the pooled |x| histogram, OCTAV-seeded.

    OCTAV (Sakr et al., ICML 2022) iterates a fixed point of the expected error under a
    uniform-noise model (``1/(12 qmax^2)`` is the paper's ``4^-B / 3``). Its model charges
    rounding noise to exact zeros, so on sparse post-ReLU tensors its clip is too small; we use its
    fixed point as one candidate and pick, among it, every 8th bin edge and the edges around the
    best, the clip with the least *actual* quantization error of the histogram (bin centres
    rounded on each candidate grid).

    On an asymmetric grid over both signs the clip's step is really ``2c / qmax`` (the grid spans
    [-c, c]), which this model takes for ``c / qmax``: it clips less than that grid's MSE optimum.
    Scoring the real step (session 31) lowered the tensors' MSE but measured worse on the tasks
    with -D qnn: PP-OCR classifier agreement 97.22 -> 96.86%, recognizer exact match 0.570 -> 0.547
    (``scripts/benchmark.py ... --dipoorlet-args "-D qnn"``), so the wider clip stays.

    The reference tool runs OCTAV per sample and averages the clip values. The mean of
    per-sample optima is not the optimum for the data as a whole, and it cannot be merged exactly
    across processes; the pooled histogram is both.
    """
    counts = st.hist.abs_counts()
    if counts.sum() == 0:
        return minmax(st, p)
    w = st.hist.width
    n = counts.size
    centres = (np.arange(n) + 0.5) * w
    edges = np.arange(1, n + 1) * w
    coarse = np.unique(np.concatenate([edges[7::8], edges[-1:], [_octav(counts, centres, p.qmax)]]))
    coarse = coarse[coarse > 0]
    err = quant_error(counts, centres, coarse, p.qmax)
    best = coarse[int(np.argmin(err))]
    k = int(round(best / w))
    fine = edges[max(0, k - 9):min(n, k + 8)]
    cands = np.concatenate([fine, [best]])
    err = quant_error(counts, centres, cands, p.qmax)
    return clip_range(st, float(min(cands[int(np.argmin(err))], st.hist.amax)))


def power_of_two_clip(st: TensorStats, qmax: int) -> float | None:
    """The clip ``2^k * qmax`` (a power-of-two step) with the least quantization error of the
    pooled |x| histogram, or None without one.

    A power-of-two backend cannot hold the step that ``mse`` picks: rounding that step up to the
    next power of two (what :func:`~dipoorlet.qparams.make_qparams` does) keeps the clip but makes
    the step up to 2x coarser, about 3 dB more rounding noise on average. Here the power-of-two
    step that covers the largest value and the four below it are scored on the histogram
    (rounding inside, clipping outside), so a tensor whose tail is cheaper to clip than its body
    is to round gets the finer step. Each bin is scored at 8 points spread over its width: at
    the smallest candidates a step spans only a few bins, and bin centres alone would fall on
    or halfway between grid points.
    """
    if st.hist is None:
        return None
    counts = st.hist.abs_counts().astype(np.float64)
    amax = float(st.minmax.amax)
    if counts.sum() == 0 or not (amax > 0 and np.isfinite(amax)):
        return None
    nz = np.nonzero(counts)[0]
    sub = (np.arange(8) + 0.5) / 8
    x = ((nz[:, None] + sub[None, :]) * st.hist.width).ravel()
    weight = np.repeat(counts[nz] / 8, 8)
    top = int(np.ceil(np.log2(amax / qmax)))
    clips = qmax * 2.0 ** np.arange(top - 4, top + 1, dtype=np.float64)
    return float(clips[int(np.argmin(quant_error(weight, x, clips, qmax)))])


def _kl_at(counts: np.ndarray, i: int, nq: int) -> float:
    p = counts[:i].astype(np.float64)
    p[i - 1] += counts[i:].sum()
    nonzero = p != 0
    starts = np.arange(nq) * (i // nq)
    merged = np.add.reduceat(counts[:i].astype(np.float64), starts)
    norm = np.add.reduceat(nonzero.astype(np.float64), starts)
    lengths = np.diff(np.append(starts, i))
    q = np.repeat(np.where(norm > 0, merged / np.maximum(norm, 1), 0.0), lengths) * nonzero
    ps, qs = p.sum(), q.sum()
    if ps == 0 or qs == 0:
        return np.inf
    p, q = p / ps, q / qs
    m = p > 0
    return float(np.sum(p[m] * np.log(p[m] / np.maximum(q[m], 1e-12))))


@register("entropy", histogram=True)
def entropy(st: TensorStats, p: RangeParams) -> tuple[float, float]:
    """TensorRT's KL-divergence calibration (Migacz, GTC 2017) on the |x| histogram.

    For each candidate threshold bin ``i``, the reference distribution P is the first ``i`` bins
    with the tail mass folded into the last; Q is those bins merged into ``quant_bins`` levels and
    expanded back over P's non-zero bins. The threshold minimizing KL(P||Q) wins, at the edge of
    bin ``i``. Candidates are scanned every 8 bins and then refined bin by bin around the best
    (TensorRT scans every bin; the KL curve is smooth at that scale and this is 7x cheaper).

    The first bin's count is replaced by the second's, as NVIDIA's pytorch-quantization does
    (``bins[0] = bins[1]``): the exact zeros of a ReLU output (half of it, typically) sit in that
    bin, and merged into the first of 128 levels they dominate the divergence and pull the
    threshold down (on a half-normal with 50% zeros: 2.0 instead of 4.1, 117x the rounding
    error of no clipping at all).
    """
    counts = st.hist.abs_counts().astype(np.float64)
    if counts.size > 1:
        counts[0] = counts[1]
    nq = p.quant_bins
    if counts.sum() == 0 or counts.size <= nq:
        return minmax(st, p)
    n = counts.size
    coarse = list(range(nq, n + 1, 8))
    if coarse[-1] != n:
        coarse.append(n)
    kl = [_kl_at(counts, i, nq) for i in coarse]
    best = coarse[int(np.argmin(kl))]
    fine = range(max(nq, best - 8), min(n, best + 8) + 1)
    kl_fine = [_kl_at(counts, i, nq) for i in fine]
    i = fine[int(np.argmin(kl_fine))]
    return clip_range(st, i * st.hist.width)
