"""Per-tensor statistics, updated batch by batch and merged exactly.

Two passes, as PPQ does: the first finds each tensor's global min/max; the second bins values
into a histogram whose edges are fixed by that range. Because the edges never move, histograms
from different batches, orders or processes add up to exactly the same counts (integer sums), so
a run over 1 or N processes gives identical results. Re-binning as data arrives (onnxruntime's
approach) makes the answer depend on batch order.

The histogram is signed. For a tensor that is never negative it covers [0, amax] in ``bins``
bins; otherwise [-amax, amax] in ``2*bins`` bins. Folding the signed histogram about zero gives
the |x| histogram of ``bins`` bins over [0, amax] exactly, which is what the symmetric range
methods (hist, mse, entropy) consume; asymmetric ones read the signed histogram.
"""
from __future__ import annotations

import math

import numpy as np


class MinMax:
    __slots__ = ("lo", "hi", "count")

    def __init__(self, lo=math.inf, hi=-math.inf, count=0):
        self.lo, self.hi, self.count = float(lo), float(hi), int(count)

    def update(self, lo: float, hi: float, count: int = 1) -> None:
        if lo != lo or hi != hi:  # NaN inside the model (sqrt of a negative…): never quantizable
            lo, hi = -math.inf, math.inf
        self.lo = min(self.lo, lo)
        self.hi = max(self.hi, hi)
        self.count += count

    def merge(self, other: "MinMax") -> "MinMax":
        return MinMax(min(self.lo, other.lo), max(self.hi, other.hi), self.count + other.count)

    @property
    def amax(self) -> float:
        return max(abs(self.lo), abs(self.hi)) if self.count else 0.0


class Histogram:
    """Fixed-edge histogram of one tensor; see the module docstring for the layout."""

    __slots__ = ("amax", "bins", "signed", "counts")

    def __init__(self, lo: float, hi: float, bins: int = 2048):
        self.amax = float(max(abs(lo), abs(hi), 1e-30))
        self.bins = int(bins)
        self.signed = lo < 0
        self.counts = np.zeros(2 * bins if self.signed else bins, dtype=np.int64)

    @property
    def left(self) -> float:
        return -self.amax if self.signed else 0.0

    @property
    def width(self) -> float:
        return self.amax / self.bins

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float32).ravel()
        n = self.counts.size
        # Bin index (x - left) * bins / amax, as x * k + c in float32: deterministic per element,
        # so every process bins a value alike; three passes over memory, no temporaries but one.
        # No clip pass: values lie in [left, amax], so indices lie in [-eps, n]; truncation sends
        # -eps to 0 and the one extra bin (x == amax) is folded into the last.
        k = np.float32(self.bins / self.amax)
        idx = np.multiply(x, k)
        idx += np.float32(-self.left) * k
        counts = np.bincount(idx.astype(np.intp), minlength=n + 1)
        self.counts += counts[:n]
        self.counts[-1] += counts[n:].sum()

    def merge(self, other: "Histogram") -> "Histogram":
        if (other.amax, other.bins, other.signed) != (self.amax, self.bins, self.signed):
            raise ValueError("histograms with different edges cannot be merged")
        out = Histogram.__new__(Histogram)
        out.amax, out.bins, out.signed = self.amax, self.bins, self.signed
        out.counts = self.counts + other.counts
        return out

    def abs_counts(self) -> np.ndarray:
        """Counts of |x| over [0, amax] in ``bins`` bins."""
        if not self.signed:
            return self.counts.copy()
        b = self.bins
        return self.counts[b:] + self.counts[:b][::-1]

    def edges(self) -> np.ndarray:
        return self.left + self.width * np.arange(self.counts.size + 1, dtype=np.float64)


class TensorStats:
    """What calibration knows about one tensor: its range and, if a method asks, a histogram."""

    __slots__ = ("minmax", "hist")

    def __init__(self):
        self.minmax = MinMax()
        self.hist: Histogram | None = None

    def merge(self, other: "TensorStats") -> "TensorStats":
        out = TensorStats()
        out.minmax = self.minmax.merge(other.minmax)
        if self.hist is not None and other.hist is not None:
            out.hist = self.hist.merge(other.hist)
        else:
            out.hist = self.hist if self.hist is not None else other.hist
        return out
