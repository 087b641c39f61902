"""Calibration memory does not grow with -N: the range and histogram passes stream samples.

tracemalloc traces numpy's allocations (and onnxruntime's output arrays, which numpy owns), so
a pass that kept every sample or activation alive would show a peak growing with N.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from conftest import conv_model, rand, save, write_samples
from dipoorlet import calibrate, platform as platform_mod
from dipoorlet.data import DataSource, input_specs
from dipoorlet.dist import SingleProcess
from dipoorlet.graph import Graph
from dipoorlet.placement import place
from dipoorlet.prepare import prepare

HW = 64  # a sample is 48 KiB, each activation 128 KiB


def _calibration_peak(tmp_path, n: int, layout: str) -> int:
    model_path = save(conv_model(cin=3, cout=8, hw=HW), tmp_path / "model.onnx")
    feeds = [{"x": rand((1, 3, HW, HW), i)} for i in range(n)]
    if layout == "npz":
        data = tmp_path / "calib.npz"
        np.savez(data, x=np.concatenate([f["x"] for f in feeds]))
    else:
        data = write_samples(tmp_path / "data", feeds)
    g = Graph.load(model_path)
    prepare(g)
    targets = list(place(g, platform_mod.load("trt")).activations)
    source = DataSource(data, input_specs(g), n)
    comm = SingleProcess()
    tracemalloc.start()
    try:
        stats = calibrate.collect(g, source, range(n), targets, comm, histograms=True, bins=2048)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stats["x"].hist.counts.sum() == n * 3 * HW * HW  # the passes really saw every sample
    return peak


def _assert_flat(small: int, large: int):
    # 56 more samples would add 2.7 MiB of input alone if any were kept
    assert large - small < max(0.15 * small, 1 << 20), (small, large)


def test_calibration_peak_memory_does_not_grow_with_n(tmp_path):
    small = _calibration_peak(tmp_path / "8", 8, "folder")
    large = _calibration_peak(tmp_path / "64", 64, "folder")
    _assert_flat(small, large)


def test_calibration_peak_memory_does_not_grow_with_n_for_npz(tmp_path):
    small = _calibration_peak(tmp_path / "8", 8, "npz")
    large = _calibration_peak(tmp_path / "64", 64, "npz")
    _assert_flat(small, large)
