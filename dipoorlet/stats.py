"""Per-tensor statistics, updated batch by batch and merged exactly.

One pass: calibration fills a :class:`LogHistogram` whose edges are the float32 bit patterns
(data-independent) while the range is being found, then turns it into the fixed-width
:class:`Histogram` over the final range that the range methods read. Because the edges never
move, histograms from different batches, orders or processes add up to exactly the same counts
(integer sums), so a run over 1 or N processes gives identical results. Re-binning as data
arrives (onnxruntime's approach) makes the answer depend on batch order; PPQ's two passes (range,
then bins fixed by it) cost one more inference per sample.

The fixed-width histogram is signed. For a tensor that is never negative it covers [0, amax] in ``bins``
bins; otherwise [-amax, amax] in ``2*bins`` bins. Folding the signed histogram about zero gives
the |x| histogram of ``bins`` bins over [0, amax] exactly, which is what the symmetric range
methods (hist, mse, entropy) consume; asymmetric ones read the signed histogram.
"""
from __future__ import annotations

import math
import sys

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


class LogHistogram:
    """Histogram of one tensor on fixed, data-independent edges: the float32 bit pattern.

    A value's bin is its sign, its exponent and the top ``MANTISSA_BITS`` bits of its mantissa,
    so every power-of-two octave is split into 128 bins of equal width (0.8% relative). The
    edges do not depend on the data, so one pass over the samples can fill the histogram while
    the range is still unknown (the range comes from the same pass), and histograms from any
    batch order or any number of processes add up to the same integer counts.

    Octaves from 2^-48 to 2^48 are kept; smaller magnitudes (exact zeros included) are counted
    as zero, larger finite ones at the top of their own sign (one overflow count for both gave a
    tensor of 1e16s all of it on its wider side, and -A percentile clipped the other side to
    1/1000 of its size); Inf and NaN are not binned (a tensor reaching Inf stays float; NaN is
    left out of the ranges), NaN is counted. Layout of ``counts``: negative values by magnitude
    (``span`` bins), positive values (``span`` bins), then the zero count, the negative and the
    positive overflow counts, and the NaN count (exponent 255 with a mantissa in its top 7 bits:
    every NaN arithmetic makes).
    :meth:`to_linear` turns it into the fixed-width :class:`Histogram` over the tensor's final
    range that the range methods read.
    """

    MANTISSA_BITS = 7
    MIN_EXP, MAX_EXP = -48, 48
    # Tensors smaller than this are not binned one by one: their keys (2 bytes a value) wait
    # until this many have gathered. One bincount costs ~40 us whatever its size (a 65,536-bin
    # table), as much as binning 25,000 values, so a small network's ~50 small activations
    # cost that per sample; buffered, one bincount serves many samples. Memory: at most
    # 2 * BUFFER bytes per tensor (128 KB), whatever -N.
    BUFFER = 1 << 16
    __slots__ = ("_counts", "_pending", "_pending_n")

    _shift = 23 - MANTISSA_BITS
    _lo_key = (127 + MIN_EXP) << MANTISSA_BITS      # key of 2^MIN_EXP
    _hi_key = (127 + MAX_EXP) << MANTISSA_BITS      # key of 2^MAX_EXP
    span = _hi_key - _lo_key
    _half = 1 << (8 + MANTISSA_BITS)                # keys of |x| lie in [0, _half)
    # The top 16 bits of a float32 are its sign, exponent and 7 mantissa bits: the key itself,
    # readable as a uint16 view without computing anything (which half depends on byte order).
    _top = 1 if sys.byteorder == "little" else 0

    _inf_key = 255 << MANTISSA_BITS                 # exponent 255: Inf and NaN

    def __init__(self):
        self._counts = np.zeros(2 * self.span + 4, dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_n = 0

    @property
    def counts(self) -> np.ndarray:
        self._flush()
        return self._counts

    @counts.setter
    def counts(self, value: np.ndarray) -> None:
        self._pending, self._pending_n = [], 0
        self._counts = value

    def update(self, x: np.ndarray) -> None:
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        keys = x.view(np.uint16)[self._top::2]
        if keys.size >= self.BUFFER:
            self._add(keys)
            return
        self._pending.append(keys.copy())      # the caller may reuse x's memory
        self._pending_n += keys.size
        if self._pending_n >= self.BUFFER:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            keys = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
            self._pending, self._pending_n = [], 0
            self._add(keys)

    def _add(self, keys: np.ndarray) -> None:
        # bincount straight from the (strided) uint16 view: 3 ns per value, against 4.5 for
        # shifting into a key array first (and no temporary of 8 bytes per value)
        c = np.bincount(keys, minlength=2 * self._half)
        pos, neg = c[:self._half], c[self._half:]       # sign bit set: the upper half
        lo, hi, n = self._lo_key, self._hi_key, self.span
        counts = self._counts
        counts[:n] += neg[lo:hi]
        counts[n:2 * n] += pos[lo:hi]
        counts[-4] += neg[:lo].sum() + pos[:lo].sum()
        counts[-3] += neg[hi:self._inf_key].sum()
        counts[-2] += pos[hi:self._inf_key].sum()
        counts[-1] += neg[self._inf_key + 1:].sum() + pos[self._inf_key + 1:].sum()

    @property
    def nan(self) -> int:
        """How many NaN values the tensor held."""
        return int(self.counts[-1])

    def merge(self, other: "LogHistogram") -> "LogHistogram":
        out = LogHistogram()
        out.counts = self.counts + other.counts
        return out

    @classmethod
    def bin_edges(cls) -> np.ndarray:
        """Magnitude edges of the ``span`` bins of one sign (span + 1 values)."""
        keys = np.arange(cls._lo_key, cls._hi_key + 1, dtype=np.int64)
        return np.left_shift(keys, cls._shift).astype(np.int32).view(np.float32).astype(np.float64)

    def to_linear(self, lo: float, hi: float, bins: int = 2048) -> Histogram:
        """The fixed-width histogram over [lo, hi] (as :class:`Histogram` lays it out), with each
        bin's count spread evenly over its value interval. Below amax/16 the float bins are
        finer than the linear ones and nothing is lost; above, a count moves by at most 0.8% of
        its value."""
        out = Histogram(lo, hi, bins)
        n = self.span
        mag_edges = self.bin_edges()
        lin = np.arange(bins + 1, dtype=np.float64) * (out.amax / bins)

        def spread(c: np.ndarray, zero: float, over: float) -> np.ndarray:
            # cumulative count at each linear edge, interpolated inside the float bins
            cum = np.concatenate([[0.0], np.cumsum(c, dtype=np.float64)])
            at = np.interp(lin, mag_edges, cum) + zero
            at[0] = 0.0                             # zeros land in the first bin, as x=0 does
            at[-1] = cum[-1] + zero + over          # everything up to amax (and clamped beyond)
            return np.diff(at)

        zero, over_neg, over_pos = (float(v) for v in self.counts[-4:-1])
        if not out.signed:
            # a one-sided range: anything on the other side is clamped onto 0, as the grid does
            out.counts = spread(self.counts[n:2 * n], zero + float(self.counts[:n].sum()) + over_neg, over_pos)
            return out
        pos = spread(self.counts[n:2 * n], zero, over_pos)
        neg = spread(self.counts[:n], 0.0, over_neg)
        out.counts = np.concatenate([neg[::-1], pos])
        return out


class TensorStats:
    """What calibration knows about one tensor: its range and, if a method asks, a histogram.
    ``floor``: for a Softmax input, the lowest value its grid needs to reach (see
    :func:`dipoorlet.calibrate.softmax_floors`), None elsewhere; ``floor_exact``: the grid starts
    there even below the calibrated range (a mask added to it at deployment)."""

    __slots__ = ("minmax", "hist", "floor", "floor_exact")

    def __init__(self):
        self.minmax = MinMax()
        self.hist: Histogram | LogHistogram | None = None
        self.floor: float | None = None
        self.floor_exact = False

    def merge(self, other: "TensorStats") -> "TensorStats":
        out = TensorStats()
        out.minmax = self.minmax.merge(other.minmax)
        floors = [f for f in (self.floor, other.floor) if f is not None]
        out.floor = min(floors) if floors else None
        out.floor_exact = self.floor_exact or other.floor_exact
        if self.hist is not None and other.hist is not None:
            out.hist = self.hist.merge(other.hist)
        else:
            out.hist = self.hist if self.hist is not None else other.hist
        return out
