"""Process communicators: the only module that would import mpi4py.

:class:`SingleProcess` is the default. Statistics are merged with exact operations (min/max and
integer histogram counts), so the result is the same for any number of processes.
"""
from __future__ import annotations

from dipoorlet.stats import TensorStats


class SingleProcess:
    rank = 0
    world = 1

    def merge_stats(self, stats: dict[str, TensorStats]) -> dict[str, TensorStats]:
        return stats

    def gather(self, obj):
        return [obj]

    def barrier(self) -> None:
        pass

    def gather_samples(self, per_sample: dict) -> dict:
        return per_sample
