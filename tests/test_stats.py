"""dipoorlet.stats: fixed-edge histograms and min/max, checked against numpy."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from dipoorlet.stats import Histogram, LogHistogram, MinMax, TensorStats


def centred_data(rng, amax, bins, n, signed):
    """Values at bin centres +-30% of a bin: never on an edge, so binning is unambiguous."""
    width = amax / bins
    nbins = 2 * bins if signed else bins
    left = -amax if signed else 0.0
    k = rng.integers(0, nbins, size=n)
    return (left + (k + 0.5 + rng.uniform(-0.3, 0.3, size=n)) * width).astype(np.float32)


@pytest.mark.parametrize("signed", [True, False])
def test_update_equals_np_histogram_on_same_edges(rng, signed):
    amax, bins = 4.0, 64
    x = centred_data(rng, amax, bins, 20_000, signed)
    h = Histogram(-amax if signed else 0.0, amax, bins)
    h.update(x)
    expected, _ = np.histogram(x.astype(np.float64), bins=h.edges())
    np.testing.assert_array_equal(h.counts, expected)


def test_update_on_unrounded_data_matches_np_histogram_up_to_edge_ties(rng):
    x = rng.standard_normal(50_000).astype(np.float32) * 1.7
    h = Histogram(float(x.min()), float(x.max()), 256)
    h.update(x)
    expected, _ = np.histogram(x.astype(np.float64), bins=h.edges())
    assert h.counts.sum() == x.size
    assert np.abs(h.counts - expected).sum() <= 4  # only values within float32 rounding of an edge


def test_layout_signed_covers_minus_amax_to_amax_in_2_bins():
    h = Histogram(-1.0, 3.0, 100)
    assert h.signed and h.counts.size == 200
    assert h.edges()[0] == pytest.approx(-3.0) and h.edges()[-1] == pytest.approx(3.0)


def test_layout_non_negative_covers_zero_to_amax_in_bins():
    h = Histogram(0.0, 3.0, 100)
    assert not h.signed and h.counts.size == 100
    assert h.edges()[0] == 0.0 and h.edges()[-1] == pytest.approx(3.0)


def test_extremes_land_in_first_and_last_bin():
    h = Histogram(-2.0, 2.0, 16)
    h.update(np.array([-2.0, 2.0], dtype=np.float32))
    assert h.counts[0] == 1 and h.counts[-1] == 1 and h.counts.sum() == 2


def test_abs_counts_equals_direct_abs_histogram(rng):
    amax, bins = 2.0, 128
    x = centred_data(rng, amax, bins, 30_000, signed=True)
    h = Histogram(-amax, amax, bins)
    h.update(x)
    expected, _ = np.histogram(np.abs(x.astype(np.float64)), bins=bins, range=(0.0, amax))
    np.testing.assert_array_equal(h.abs_counts(), expected)


def test_abs_counts_of_non_negative_histogram_is_its_counts(rng):
    x = np.abs(rng.standard_normal(1000)).astype(np.float32)
    h = Histogram(0.0, float(x.max()), 32)
    h.update(x)
    np.testing.assert_array_equal(h.abs_counts(), h.counts)


def test_merge_rejects_different_edges():
    with pytest.raises(ValueError):
        Histogram(-1, 1, 16).merge(Histogram(-2, 2, 16))


finite32 = st.floats(-100, 100, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(1, 400), elements=finite32),
       cuts=st.lists(st.integers(0, 400), max_size=5), order=st.randoms(use_true_random=False),
       bins=st.integers(16, 64))
def test_merge_of_splits_equals_one_pass_in_any_order(x, cuts, order, bins):
    lo, hi = float(x.min()), float(x.max())
    whole = Histogram(lo, hi, bins)
    whole.update(x)
    parts = np.split(x, sorted(c % (x.size + 1) for c in cuts))
    order.shuffle(parts)
    merged = Histogram(lo, hi, bins)
    for p in parts:
        h = Histogram(lo, hi, bins)
        h.update(p)
        merged = merged.merge(h)
    np.testing.assert_array_equal(merged.counts, whole.counts)


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(1, 200), elements=finite32),
       cut=st.integers(0, 200))
def test_minmax_merge_equals_one_pass_and_commutes(x, cut):
    cut %= x.size + 1
    a, b = MinMax(), MinMax()
    for part, mm in ((x[:cut], a), (x[cut:], b)):
        for v in part:
            mm.update(float(v), float(v))
    for m in (a.merge(b), b.merge(a)):
        assert (m.lo, m.hi, m.count) == (float(x.min()), float(x.max()), x.size)


def test_minmax_merge_with_empty_is_identity():
    m = MinMax(-1.5, 2.0, 3)
    for merged in (m.merge(MinMax()), MinMax().merge(m)):
        assert (merged.lo, merged.hi, merged.count) == (-1.5, 2.0, 3)
        assert merged.amax == 2.0


def test_minmax_amax_of_empty_is_zero():
    assert MinMax().amax == 0.0 and MinMax().lo == math.inf


def test_tensorstats_merge_adds_histograms_and_ranges(rng):
    x = rng.standard_normal(1000).astype(np.float32)
    lo, hi = float(x.min()), float(x.max())
    halves = []
    for part in (x[:400], x[400:]):
        s = TensorStats()
        s.minmax.update(float(part.min()), float(part.max()))
        s.hist = Histogram(lo, hi, 32)
        s.hist.update(part)
        halves.append(s)
    merged = halves[0].merge(halves[1])
    whole = Histogram(lo, hi, 32)
    whole.update(x)
    assert (merged.minmax.lo, merged.minmax.hi) == (lo, hi)
    np.testing.assert_array_equal(merged.hist.counts, whole.counts)


def test_exact_sum_streams_and_merges_to_math_fsum_in_any_order():
    import math
    import random

    from dipoorlet.layer_errors import ExactSum

    rng = random.Random(3)
    values = [rng.uniform(-1, 1) * 10 ** rng.randint(-12, 12) for _ in range(3000)] + [1e16, 1.0, -1e16]
    want = math.fsum(values)
    for _ in range(3):
        rng.shuffle(values)
        parts = [ExactSum() for _ in range(4)]
        for k, v in enumerate(values):
            parts[k % 4].add(v)
        total = ExactSum()
        for p in parts[::-1]:
            total.merge(p)
        assert total.value() == want
        assert len(total.partials) < 40   # a few floats, not one per value
    s = ExactSum()
    s.add(1.0)
    s.add(math.inf)
    assert s.value() == math.inf
    s.add(-math.inf)
    assert math.isnan(s.value())


def test_error_stats_match_the_per_sample_computation():
    import math

    from dipoorlet.layer_errors import ErrorStats, sample_metrics

    rng = np.random.default_rng(0)
    pairs = [(rng.standard_normal(50).astype(np.float32), rng.standard_normal(50).astype(np.float32))
             for _ in range(20)]
    rows = [sample_metrics(f, f + 0.1 * q) for f, q in pairs]
    a, b = ErrorStats(), ErrorStats()
    for k, r in enumerate(rows):
        (a if k % 3 else b).add(*r)
    st = a.merge(b)
    assert st.n == 20
    assert st.cos.value() / st.n == math.fsum(r[0] for r in rows) / 20
    assert st.err.value() == math.fsum(r[1] for r in rows) and st.sig.value() == math.fsum(r[2] for r in rows)
    assert st.min_cos == min(r[0] for r in rows) and st.max_abs == max(r[3] for r in rows)


@pytest.mark.parametrize("n", [0, 1, 8191, 8192, 8193, 40000])
def test_sample_metrics_match_numpy_across_chunk_boundaries(n):
    """The metrics are summed over 8,192-value pieces: against numpy on whole float64 arrays."""
    from dipoorlet.layer_errors import sample_metrics
    rng = np.random.default_rng(n)
    f = rng.standard_normal((1, n)).astype(np.float32)
    q = f + 0.01 * rng.standard_normal((1, n)).astype(np.float32)
    cos, err, sig, mx = sample_metrics(f, q)
    f64, q64 = f.astype(np.float64).ravel(), q.astype(np.float64).ravel()
    if n == 0:
        assert (cos, err, sig, mx) == (1.0, 0.0, 0.0, 0.0)
        return
    assert cos == pytest.approx(f64 @ q64 / np.sqrt((f64 @ f64) * (q64 @ q64)), rel=1e-12)
    assert err == pytest.approx(np.sum((f64 - q64) ** 2), rel=1e-12)
    assert sig == pytest.approx(f64 @ f64, rel=1e-12)
    assert mx == np.abs(f64 - q64).max()
    q[0, n // 2] = np.nan
    cos, err, _, mx = sample_metrics(f, q)
    assert math.isnan(cos) and math.isnan(err) and math.isnan(mx)


def _log_oracle(x: np.ndarray) -> np.ndarray:
    """LogHistogram's layout from np.searchsorted on its magnitude edges (no bit tricks)."""
    edges = LogHistogram.bin_edges()
    n = LogHistogram.span
    out = np.zeros(2 * n + 4, dtype=np.int64)
    a = np.abs(x.astype(np.float64))
    out[-1] = np.isnan(x).sum()
    x = x[np.isfinite(a)]                # Inf and NaN are not binned
    a = a[np.isfinite(a)]
    small, big = a < edges[0], a >= edges[-1]
    out[-4], out[-3], out[-2] = small.sum(), (big & np.signbit(x)).sum(), (big & ~np.signbit(x)).sum()
    mid = ~(small | big)
    idx = np.searchsorted(edges, a[mid], side="right") - 1
    neg = np.signbit(x[mid])
    np.add.at(out, idx[neg], 1)
    np.add.at(out, n + idx[~neg], 1)
    return out


def test_log_histogram_buffered_small_and_direct_large_updates_match_the_oracle(rng):
    # sizes on both sides of the buffering threshold, and a merge while keys are still pending
    sizes = [7, 1000, LogHistogram.BUFFER - 1, 3, LogHistogram.BUFFER, 5 * LogHistogram.BUFFER, 40000, 40000]
    parts = [(rng.standard_normal(s) * rng.choice([1e-3, 1.0, 300.0])).astype(np.float32) for s in sizes]
    parts[1][:10] = 0.0
    parts[1][10:16] = [1e30, -1e-30, -1e20, np.nan, np.inf, -np.inf]
    a, b = LogHistogram(), LogHistogram()
    for i, p in enumerate(parts):
        (a if i % 2 else b).update(p)
    assert a._pending or b._pending      # the merge below must flush them
    merged = a.merge(b)
    np.testing.assert_array_equal(merged.counts, _log_oracle(np.concatenate(parts)))
    # updating after reading the counts keeps adding
    a.update(parts[0])
    np.testing.assert_array_equal(a.counts, _log_oracle(np.concatenate(parts[1::2] + [parts[0]])))


def test_a_single_value_output_gets_one_cosine_over_the_samples(tmp_path):
    """A score (one value per sample) has a per-sample cosine of +-1 whatever the error, so
    --fail_below could never fail on it: its cosine is taken over all samples' values together,
    against numpy on onnxruntime's outputs of the float and the written model."""
    from onnx import helper

    from conftest import input_feeds, make_model, ort_run, quantize_model, rand, vi
    from dipoorlet.cli import below_bar
    inits = {"w": rand((4, 3, 3, 3), 0, 0.5), "wf": rand((1, 4), 1, 0.5), "bf": np.full(1, 0.3, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["score"], name="fc", transB=1)]
    model = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("score", [1, 1])], inits)
    feeds = input_feeds(model, 8, seed=2)
    res, qm = quantize_model(tmp_path, model, feeds=feeds, w_bits=2, a_bits=2)
    (entry,) = res.report["outputs"]
    f = np.array([ort_run(model, x)[0].ravel()[0] for x in feeds], np.float64)
    q = np.array([ort_run(qm, x)[0].ravel()[0] for x in feeds], np.float64)
    want = f @ q / np.sqrt((f @ f) * (q @ q))
    assert entry["cosine_over_samples"] and entry["cosine"] == pytest.approx(want, abs=1e-6) and want < 0.999
    assert entry["min_cosine"] == entry["cosine"]
    assert "score cosine" in below_bar(res.report, 0.9999)
    assert "score" not in res.report.get("output_distribution", {})     # per-sample cosines: all 1


def test_sample_metrics_of_tensors_of_different_sizes_are_nan():
    """An output whose length the quantization changed (an NMS box list): no cosine, no error,
    counted as NaN rather than compared on a truncated copy."""
    from dipoorlet.layer_errors import sample_sums
    f, q = np.ones(7, np.float32), np.ones(10, np.float32)
    for a, b in ((f, q), (q, f)):
        cos, err, sig, mx, fq, qq = sample_sums(a, b)
        assert math.isnan(cos) and math.isnan(err) and math.isnan(mx) and sig == a.size
