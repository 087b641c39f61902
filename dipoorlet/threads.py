"""Threads per process under MPI (no numpy import here: the BLAS reads its variables when numpy
is first imported).

``mpirun -n 4`` on one node starts four processes that would each run onnxruntime and the BLAS
on every core: 4x oversubscribed pools whose idle threads spin. Measured on this 2-core machine
(PP-OCR classifier, ``--adaround --w_bits 4``, the per-layer solves split over 2 processes): 14.6-16.1
s with every process on both cores, 3.7 s with one thread each, against 5.9-7.0 s for one
process on both cores. So each process gets its share of the node's cores, unless the user set
the thread variables."""
from __future__ import annotations

import os
import re

_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE")
_BLAS_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
ENV = "DIPOORLET_THREADS"    # onnxruntime's intra-op threads per session (runtime.Runner)


def _slurm_local() -> int:
    """Tasks of this step on this node from srun's SLURM_STEP_TASKS_PER_NODE ("2(x3),1")."""
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return 1
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return 1
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(os.environ.get("SLURM_NODEID", "0") or 0)
    return counts[node] if 0 <= node < len(counts) else 1


_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def launcher_rank() -> int:
    """This process's rank as the launcher (mpirun/mpiexec/srun) numbered it, read from its
    variables before MPI starts (0 outside one): errors met before the communicator exists are
    printed by rank 0 alone."""
    for var in _RANK_VARS:
        v = os.environ.get(var, "")
        if v.isdigit():
            return int(v)
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1 and os.environ.get("SLURM_PROCID", "").isdigit():
        return int(os.environ["SLURM_PROCID"])
    return 0


def local_processes() -> int:
    """How many processes of this MPI/srun job share this node (1 outside one)."""
    for var in _LOCAL_SIZE_VARS:
        v = os.environ.get(var, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:
        return max(1, _slurm_local())
    return 1


def share_cores() -> int | None:
    """Under MPI with several processes on this node: each gets cores // processes threads for
    the BLAS and onnxruntime, where the user has not set them. Returns the share (None outside)."""
    n = local_processes()
    if n <= 1:
        return None
    node = os.cpu_count() or 1
    bound = usable_cores()
    # a launcher that binds each process to its own cores (srun -c 8) already divided them
    per = max(1, min(bound, node // n))
    # a thread count the user (or a cluster module) set for one library is their intent for all
    given = next((os.environ[v] for v in _BLAS_VARS if os.environ.get(v, "").isdigit()), None)
    for var in _BLAS_VARS:
        os.environ.setdefault(var, given or str(per))
    os.environ.setdefault(ENV, given or str(per))
    return int(os.environ[ENV]) if os.environ[ENV].isdigit() else per


def usable_cores() -> int:
    """The cores this process may run on (taskset, cpusets, a binding launcher), not the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def session_threads() -> int:
    """onnxruntime intra-op threads for a session: the MPI share, 0 (onnxruntime's default) outside."""
    v = os.environ.get(ENV, "")
    return int(v) if v.isdigit() and int(v) > 0 else 0
