"""Process communicators; the only module that imports mpi4py.

:class:`SingleProcess` is the default; :class:`MPIComm` runs under ``mpirun``/``mpiexec`` or
``srun`` (PMI). Statistics are merged with exact collectives — MIN/MAX of ranges and integer SUM
of fixed-edge histogram counts — and per-sample error scalars are gathered to rank 0 and summed in
sample order, so every output is bit-identical to a single-process run whatever the number of
processes. No shared file system and no NCCL are needed (the reference tool needs both).

A rank that fails calls :meth:`MPIComm.abort`, which takes every rank down at once with a
non-zero exit code, instead of leaving the others waiting in a collective.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from dipoorlet.errors import ConfigError
from dipoorlet.stats import TensorStats

from dipoorlet.threads import _launcher_size, import_mpi, launched_by_mpi  # noqa: F401 - launched_by_mpi re-exported


class SingleProcess:
    rank = 0
    world = 1
    local_rank = 0      # among the processes on this machine (which GPU a process takes)

    def merge_stats(self, stats: dict[str, TensorStats]) -> dict[str, TensorStats]:
        return stats

    def gather_samples(self, per_sample: dict) -> dict:
        return per_sample

    def allreduce_sum(self, array: np.ndarray) -> np.ndarray:
        return array

    def allreduce_max(self, array: np.ndarray) -> np.ndarray:
        return array

    def bcast(self, obj):
        return obj

    def allgather(self, obj) -> list:
        return [obj]

    def barrier(self) -> None:
        pass

    def abort(self, code: int = 2) -> None:
        raise SystemExit(code)


class MPIComm(SingleProcess):
    def __init__(self):
        try:
            MPI = import_mpi()
        except ImportError as exc:
            raise ConfigError("--mpirun/--slurm need mpi4py; install it with "
                              "pip install 'dipoorlet[mpi]' (mpi4py and the mpich wheel)") from exc
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world = self.comm.Get_size()
        try:        # MPI-3's shared-memory split: the processes of this machine
            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
            self.local_rank = node.Get_rank()
            node.Free()
        except Exception:  # noqa: BLE001 - an MPI without it: the launcher's own variable, if any
            from dipoorlet.threads import launcher_local_rank

            self.local_rank = launcher_local_rank()

    def merge_stats(self, stats):
        names = sorted(stats)
        ranges = np.array([[stats[n].minmax.lo, -stats[n].minmax.hi] for n in names], dtype=np.float64)
        counts = np.array([stats[n].minmax.count for n in names], dtype=np.int64)
        ranges = self._allreduce(ranges, self.MPI.MIN)
        counts = self._allreduce(counts, self.MPI.SUM)
        hist_names = [n for n in names if stats[n].hist is not None]
        if hist_names:
            flat = np.concatenate([stats[n].hist.counts for n in hist_names])
            flat = self._allreduce(flat, self.MPI.SUM)
            offset = 0
            for n in hist_names:
                size = stats[n].hist.counts.size
                stats[n].hist.counts = flat[offset:offset + size].copy()
                offset += size
        for n, (lo, neg_hi), c in zip(names, ranges, counts):
            mm = stats[n].minmax
            mm.lo, mm.hi, mm.count = float(lo), float(-neg_hi), int(c)
        return stats

    def _allreduce(self, array: np.ndarray, op) -> np.ndarray:
        out = np.empty_like(array)
        self.comm.Allreduce(np.ascontiguousarray(array), out, op=op)
        return out

    def allreduce_sum(self, array):
        return self._allreduce(np.asarray(array), self.MPI.SUM)

    def allreduce_max(self, array):
        return self._allreduce(np.asarray(array, dtype=np.float64), self.MPI.MAX)

    def gather_samples(self, per_sample: dict) -> dict:
        parts = self.comm.gather(per_sample, root=0)
        if self.rank != 0:
            return per_sample
        merged = {k: [] for k in per_sample}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, []).extend(v)
        return merged

    def bcast(self, obj):
        return self.comm.bcast(obj, root=0)

    def allgather(self, obj) -> list:
        return self.comm.allgather(obj)

    def barrier(self):
        self.comm.Barrier()

    def abort(self, code: int = 2):
        sys.stdout.flush()
        sys.stderr.flush()
        # the launcher forwards each rank's stderr through its proxy; Abort kills the proxies,
        # and a message still in transit was lost now and then (seen under load with 3 ranks)
        time.sleep(0.5)
        self.comm.Abort(code)


def make_comm(mpirun: bool = False, slurm: bool = False):
    """The communicator for this process: MPI when asked for or when launched under MPI/srun."""
    if mpirun or slurm or launched_by_mpi():
        comm = MPIComm()
        n, var = _launcher_size()
        if comm.world == 1 and n > 1:
            # each process would run alone into the same -O (mpi4py's MPI is not the launcher's,
            # or srun was not given --mpi=pmi2/pmix for an MPI that needs it)
            try:
                lib = " ".join(comm.MPI.Get_library_version().split(",")[0].split("\n")[0].split())[:40]
            except Exception:  # noqa: BLE001 - only for the message
                lib = "its MPI"
            raise ConfigError(f"the launcher started {n} processes ({var}={n}), but MPI sees each as alone (1 "
                              f"process in COMM_WORLD): mpi4py's MPI library ({lib}) does not match this launcher; start "
                              "with the mpirun/mpiexec of the MPI mpi4py was built with (python -c \"import "
                              "mpi4py; print(mpi4py.get_config())\"), or with srun --mpi=pmi2 / --mpi=pmix")
        return comm
    return SingleProcess()
