"""dipoorlet.ranges: every range method against an oracle computed in numpy from the raw data."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import stats_from
from dipoorlet.ranges import NEEDS_HISTOGRAM, RANGE_METHODS, RangeParams, entropy, hist, minmax, mse, percentile

N = 50_000


def _data(kind: str, seed: int = 0) -> np.ndarray:
    r = np.random.default_rng(seed)
    if kind == "normal":
        x = r.standard_normal(N)
    elif kind == "laplace":
        x = r.laplace(size=N)
    elif kind == "relu":
        x = np.maximum(r.standard_normal(N) + 0.3, 0.0)
    elif kind == "uniform":
        x = r.uniform(-1.0, 3.0, N)
    elif kind == "outliers":
        x = np.concatenate([r.standard_normal(N - 10), r.uniform(-30, 30, 10)])
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


DISTS = ["normal", "laplace", "relu", "uniform", "outliers"]


def test_registry_names_and_histogram_needs():
    assert set(RANGE_METHODS) == {"minmax", "hist", "percentile", "mse", "entropy"}
    assert NEEDS_HISTOGRAM == {"hist", "percentile", "mse", "entropy"}


# ---- minmax ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", DISTS)
def test_minmax_is_exact_data_range(kind):
    x = _data(kind)
    assert minmax(stats_from(x), RangeParams()) == (float(x.min()), float(x.max()))


# ---- hist (ModelTC Dipoorlet) -------------------------------------------------------------------
def hist_oracle(x: np.ndarray, bins: int, threshold: float) -> float:
    """First |x| bin whose cumulative mass reaches ``threshold``; clip at its centre."""
    a = np.abs(x.astype(np.float64))
    amax = a.max()
    counts, _ = np.histogram(a, bins=bins, range=(0.0, amax))
    cdf = np.cumsum(counts) / a.size
    i = next(k for k, v in enumerate(cdf) if v >= threshold)
    return (i + 0.5) * amax / bins


@pytest.mark.parametrize("kind", DISTS)
@pytest.mark.parametrize("threshold", [0.99, 0.999, 0.99999])
def test_hist_clips_at_centre_of_threshold_bin(kind, threshold):
    x, bins = _data(kind), 2048
    lo, hi = hist(stats_from(x, bins), RangeParams(threshold=threshold))
    c = hist_oracle(x, bins, threshold)
    width = float(np.abs(x).max()) / bins
    # the package bins in float32: allow a value on a bin edge to move the answer by one bin
    assert hi == pytest.approx(min(float(x.max()), c), abs=1.01 * width)
    assert lo == pytest.approx(max(float(x.min()), -c), abs=1.01 * width)


def test_hist_matches_oracle_exactly_on_typical_data():
    x, bins = _data("normal"), 2048
    lo, hi = hist(stats_from(x, bins), RangeParams(threshold=0.999))
    c = hist_oracle(x, bins, 0.999)
    assert (lo, hi) == pytest.approx((-c, c), rel=1e-9)


# ---- percentile -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", DISTS)
@pytest.mark.parametrize("pct", [99.0, 99.99, 99.999])
def test_percentile_within_one_bin_of_np_percentile(kind, pct):
    x, bins = _data(kind), 2048
    st = stats_from(x, bins)
    lo, hi = percentile(st, RangeParams(percentile=pct))
    width = st.hist.width
    # the histogram's empirical CDF crosses pct inside the bin of the order statistic of rank
    # ceil(pct/100 * n): numpy's "inverted_cdf" definition (the default "linear" one
    # interpolates between order statistics, which lie further apart than a bin in the tails)
    pc = lambda q: float(np.percentile(x, q, method="inverted_cdf"))
    expected_hi = max(pc(pct), 0.0)
    expected_lo = min(pc(100 - pct), 0.0) if x.min() < 0 else float(x.min())
    assert abs(hi - expected_hi) <= width
    assert abs(lo - expected_lo) <= width


# ---- mse (OCTAV) ----------------------------------------------------------------------------
def quant_mse(x: np.ndarray, c: float) -> float:
    """Real MSE of symmetric int8 fake quantization with scale c/127 (TensorRT's grid)."""
    s = c / 127.0
    return float(np.mean((x - np.clip(np.rint(x / s), -128, 127) * s) ** 2))


def brute_force_best_mse(x: np.ndarray, steps: int = 1500) -> float:
    x = x.astype(np.float64)
    amax = np.abs(x).max()
    return min(quant_mse(x, c) for c in np.linspace(amax / steps, amax, steps))


def _mse_of_method(x):
    lo, hi = mse(stats_from(x), RangeParams(qmax=127))
    return quant_mse(x.astype(np.float64), max(-lo, hi))


@pytest.mark.parametrize("kind", ["normal", "laplace", "uniform", "outliers"])
def test_mse_within_2_percent_of_brute_force_optimum(kind):
    x = _data(kind)
    assert _mse_of_method(x) <= 1.02 * brute_force_best_mse(x)


@pytest.mark.parametrize("zero_fraction", [0.8, 0.95])
def test_mse_within_2_percent_of_brute_force_optimum_on_sparse_relu(zero_fraction):
    r = np.random.default_rng(7)
    x = np.abs(r.standard_normal(N))
    x[r.uniform(size=N) < zero_fraction] = 0.0
    x = x.astype(np.float32)
    assert _mse_of_method(x) <= 1.02 * brute_force_best_mse(x)


# ---- entropy (TensorRT KL) ------------------------------------------------------------------
def trt_kl(counts: np.ndarray, i: int, nq: int = 128) -> float:
    """KL(P||Q) for threshold bin i, TensorRT / Migacz GTC'17 (no smoothing)."""
    counts = counts.astype(np.float64)
    p = counts[:i].copy()
    p[i - 1] += counts[i:].sum()                  # outliers fold into the last bin
    nonzero = p > 0
    per_level = i // nq
    level = np.minimum(np.arange(i) // per_level, nq - 1)   # the last level takes the remainder
    mass = np.bincount(level, weights=counts[:i], minlength=nq)
    used = np.bincount(level, weights=nonzero.astype(np.float64), minlength=nq)
    q = np.where(nonzero, mass[level] / np.maximum(used[level], 1.0), 0.0)
    if q.sum() == 0 or np.any(nonzero & (q == 0)):
        return np.inf
    p, q = p / p.sum(), q / q.sum()
    return float(np.sum(p[nonzero] * np.log(p[nonzero] / q[nonzero])))


def kl_oracle(counts: np.ndarray, nq: int = 128) -> tuple[int, list]:
    """Full scan of every candidate bin; returns (best bin count i, KL curve from i = nq). The
    zero bin takes its neighbour's count, as pytorch-quantization's entropy calibrator does."""
    counts = counts.astype(np.float64)
    counts[0] = counts[1]
    kls = [trt_kl(counts, i, nq) for i in range(nq, counts.size + 1)]
    return nq + int(np.argmin(kls)), kls


@pytest.mark.parametrize("kind", DISTS)
@pytest.mark.parametrize("bins", [512, 2048])
def test_entropy_threshold_matches_full_scan_kl(kind, bins):
    x = _data(kind)
    st = stats_from(x, bins)
    lo, hi = entropy(st, RangeParams())
    i_method = int(round(max(-lo, hi) / st.hist.width))
    i_oracle, kls = kl_oracle(st.hist.abs_counts())
    kl_method, kl_best = kls[i_method - 128], kls[i_oracle - 128]
    assert abs(i_method - i_oracle) <= 8 or kl_method <= kl_best * 1.01 + 1e-9


@pytest.mark.parametrize("zero_fraction", [0.0, 0.5, 0.7, 0.9])
def test_entropy_is_not_pulled_down_by_the_zeros_of_a_relu_output(zero_fraction):
    # the zero spike in the first bin once clipped a half-normal with 50% zeros at 2.0 (not ~4)
    r = np.random.default_rng(0)
    x = np.abs(r.standard_normal(200_000))
    x[r.uniform(size=x.size) < zero_fraction] = 0.0
    x = x.astype(np.float32)
    lo, hi = entropy(stats_from(x, 2048), RangeParams())
    assert lo == 0.0 and 0.7 * x.max() < hi <= x.max()


def test_entropy_clips_heavy_outliers():
    x = _data("outliers")
    lo, hi = entropy(stats_from(x), RangeParams())
    assert max(-lo, hi) < 0.5 * float(np.abs(x).max())


# ---- contract shared by all methods ---------------------------------------------------------
@pytest.mark.parametrize("method", sorted(RANGE_METHODS))
@pytest.mark.parametrize("kind", DISTS)
def test_range_contains_zero_and_stays_within_data(method, kind):
    x = _data(kind)
    lo, hi = RANGE_METHODS[method](stats_from(x, 512), RangeParams())
    assert lo <= 0.0 <= hi
    assert float(x.min()) <= lo and hi <= float(x.max())


@pytest.mark.parametrize("method", sorted(RANGE_METHODS))
def test_all_zero_tensor_gives_zero_range(method):
    lo, hi = RANGE_METHODS[method](stats_from(np.zeros(1000, np.float32), 512), RangeParams())
    assert (lo, hi) == (0.0, 0.0)


@pytest.mark.parametrize("method", [
    "minmax", "entropy", "hist", "mse", "percentile",
])
def test_constant_positive_tensor_gives_ordered_range(method):
    lo, hi = RANGE_METHODS[method](stats_from(np.full(1000, 2.5, np.float32), 512), RangeParams())
    assert lo <= hi


# ---- power-of-two grids under -A mse ---------------------------------------------------------
def _pow2_oracle(x: np.ndarray, qmax: int = 127) -> tuple[float, dict]:
    """Every power-of-two step from the one covering max|x| down to 1/16 of it, scored by the
    real squared error of symmetric fake quantization of the raw data."""
    x = x.astype(np.float64)
    top = int(np.ceil(np.log2(np.abs(x).max() / qmax)))
    errs = {}
    for k in range(top - 4, top + 1):
        s = 2.0 ** k
        errs[s * qmax] = float(np.mean((x - np.clip(np.rint(x / s), -qmax, qmax) * s) ** 2))
    return min(errs, key=errs.get), errs


@pytest.mark.parametrize("kind", DISTS)
def test_power_of_two_clip_is_the_best_power_of_two_step(kind):
    from dipoorlet.ranges import power_of_two_clip

    x = _data(kind, seed=3)
    got = power_of_two_clip(stats_from(x), 127)
    best, errs = _pow2_oracle(x)
    assert np.log2(got / 127) == np.round(np.log2(got / 127))
    assert got in errs
    # the histogram estimate may pick a neighbour only where the two errors are within 3%
    assert errs[got] <= 1.03 * errs[best]


def test_power_of_two_clip_takes_the_finer_step_when_the_tail_is_cheap_to_clip():
    """Normal data (sigma 1.15) whose mse clip (~4.3) needs a step just over 2^-5: rounding it up
    to a power of two (the earlier rule) gives 2^-4, twice as coarse, where 2^-5 clips only the
    values above 3.97."""
    from dipoorlet.qparams import make_qparams
    from dipoorlet.platform import TensorRule
    from dipoorlet.ranges import power_of_two_clip

    x = _data("normal", seed=4) * np.float32(1.15)
    st = stats_from(x)
    got = power_of_two_clip(st, 127)
    best, errs = _pow2_oracle(x)
    assert got == best == 127 * 2.0 ** -5 < max(errs)
    lo, hi = mse(st, RangeParams(qmax=127))
    rule = TensorRule(bits=8, symmetric=True, power_of_two=True)
    assert float(make_qparams(lo, hi, rule).scale) == 2.0 ** -4      # what mse + rounding up gives
    assert errs[got] < 0.6 * errs[127 * 2.0 ** -4]


def test_power_of_two_clip_keeps_the_covering_step_for_uniform_data():
    from dipoorlet.ranges import power_of_two_clip

    x = np.random.default_rng(5).uniform(-1.9, 1.9, N).astype(np.float32)   # 1.9/127: step 2^-6 covers it
    got = power_of_two_clip(stats_from(x), 127)
    assert got == 127 * 2.0 ** -6 == _pow2_oracle(x)[0]


def test_power_of_two_clip_unsigned_grid():
    """ti's unsigned grid for a non-negative tensor: 255 steps of a power of two."""
    from dipoorlet.ranges import power_of_two_clip

    r = np.random.default_rng(6)
    x = np.maximum(r.standard_normal(N), 0).astype(np.float32)
    got = power_of_two_clip(stats_from(x), 255)
    best, errs = _pow2_oracle(x, qmax=255)
    assert got in errs and errs[got] <= 1.03 * errs[best]


def test_power_of_two_clip_without_histogram_or_data():
    from dipoorlet.ranges import power_of_two_clip
    from dipoorlet.stats import TensorStats

    assert power_of_two_clip(TensorStats(), 127) is None
    assert power_of_two_clip(stats_from(np.zeros(100, np.float32)), 127) is None


# ---- asymmetric grids, narrow grids, values beyond 2^48 --------------------------------------
@pytest.mark.parametrize("bits", [4, 6])
def test_entropy_sizes_the_clip_for_the_grids_own_levels(bits):
    # with 8 levels (4 bits) the clip that loses least by KL is tighter than for 128
    x = _data("laplace")
    st = stats_from(x)
    wide = entropy(st, RangeParams(quant_bins=128))[1]
    narrow = entropy(st, RangeParams(quant_bins=2 ** (bits - 1)))[1]
    i_oracle, _ = kl_oracle(st.hist.abs_counts(), 2 ** (bits - 1))
    assert narrow < wide
    assert abs(narrow / st.hist.width - i_oracle) <= 1


def test_log_histogram_keeps_each_signs_overflow_and_drops_nan_and_inf():
    # values beyond 2^48 went to one shared overflow count, all of it given to the wider side:
    # -A percentile clipped the other side to 1/1000 of its size
    from dipoorlet.stats import LogHistogram, TensorStats

    r = np.random.default_rng(0)
    x = (r.standard_normal(20_000) * 1e16).astype(np.float32)
    st = TensorStats()
    st.minmax.update(float(x.min()), float(x.max()))
    st.hist = LogHistogram()
    st.hist.update(np.concatenate([x, np.array([np.nan, -np.nan, np.inf], np.float32)]))
    st.hist = st.hist.to_linear(st.minmax.lo, st.minmax.hi, 2048)
    assert st.hist.counts.sum() == pytest.approx(x.size)     # NaN and Inf not counted
    # magnitudes past 2^48 are not resolved, so each side's tail sits at its own extreme
    lo, hi = percentile(st, RangeParams(percentile=99.9))
    assert lo == pytest.approx(float(x.min()), rel=1e-3) and hi == pytest.approx(float(x.max()), rel=1e-3)


@pytest.mark.parametrize("n_clips", [1, 63, 64, 65, 300])
def test_quant_error_matches_a_per_candidate_oracle(n_clips):
    """The blocked, in-place error table equals the one-expression form exactly and a per-candidate
    numpy loop to rounding (empty bins, clips past the largest value, block edges at 64)."""
    from dipoorlet.ranges import quant_error

    r = np.random.default_rng(n_clips)
    n, qmax = 2048, 127
    counts = r.integers(0, 50, n) * (r.random(n) < 0.6)
    centres = (np.arange(n) + 0.5) * 0.01
    clips = np.sort(r.uniform(0.5, 25.0, n_clips))
    got = quant_error(counts, centres, clips, qmax)
    nz = counts > 0
    step = (clips / qmax)[:, None]
    x = centres[nz][None, :]
    one = ((x - np.minimum(np.round(x / step), qmax) * step) ** 2) @ counts[nz].astype(np.float64)
    np.testing.assert_array_equal(got, one)
    for j, c in enumerate(clips):
        s = c / qmax
        q = np.minimum(np.round(centres / s), qmax) * s
        np.testing.assert_allclose(got[j], float(np.sum(counts * (centres - q) ** 2)), rtol=1e-12)
