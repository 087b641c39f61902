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
    node = _env_int("SLURM_NODEID", 0)
    return counts[node] if 0 <= node < len(counts) else 1


def _env_int(var: str, default: int = 1) -> int:
    """A launcher's integer variable; ``default`` where it is unset or not a number."""
    v = os.environ.get(var, "").strip()
    return int(v) if v.isascii() and v.isdigit() else default


_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def launcher_rank() -> int:
    """This process's rank as the launcher (mpirun/mpiexec/srun) numbered it, read from its
    variables before MPI starts (0 outside one): errors met before the communicator exists are
    printed by rank 0 alone."""
    for var in _RANK_VARS:
        if _env_int(var, -1) >= 0:
            return _env_int(var)
    if _env_int("SLURM_STEP_NUM_TASKS") > 1:
        return _env_int("SLURM_PROCID", 0)
    return 0


_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK",
                    "SLURM_LOCALID")


def launcher_local_rank() -> int:
    """This process's rank among the processes of its machine, as the launcher numbered it (0
    where none says)."""
    return next((_env_int(var) for var in _LOCAL_RANK_VARS if _env_int(var, -1) >= 0), 0)


def say_stopped(line: str, wait_s: float = 2.0) -> None:
    """Print ``line`` for a Ctrl-C/SIGTERM met before MPI started: by the launcher's rank 0; by
    another rank after ``wait_s``, with its number (where mpirun passed the signal to every rank,
    rank 0 says it and its abort ends this wait; a signal to that rank alone had ended the job on
    mpich's Abort line without a word; found by a hunt)."""
    import sys
    import time

    rank = launcher_rank()
    if rank:
        try:
            time.sleep(wait_s)
        except BaseException:  # noqa: BLE001 - a second Ctrl-C: said all the same
            pass
        line = line.replace("dipoorlet: ", f"dipoorlet: rank {rank}: ", 1)
    print(line, file=sys.stderr, flush=True)


def local_processes() -> int:
    """How many processes of this MPI/srun job share this node (1 outside one)."""
    for var in _LOCAL_SIZE_VARS:
        if _env_int(var, 0) > 0:
            return _env_int(var)
    if _env_int("SLURM_STEP_NUM_TASKS") > 1:
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
    given = next((os.environ[v].strip() for v in _BLAS_VARS if _env_int(v, 0) > 0), None)
    for var in _BLAS_VARS:
        os.environ.setdefault(var, given or str(per))
    os.environ.setdefault(ENV, given or str(per))
    return _env_int(ENV, per) or per


def usable_cores() -> int:
    """The cores this process may run on (taskset, cpusets, a binding launcher), not the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def session_threads() -> int:
    """onnxruntime intra-op threads for a session: the MPI share, 0 (onnxruntime's default) outside."""
    return max(_env_int(ENV, 0), 0)


def _launcher_size() -> tuple[int, str]:
    """The number of processes the launcher says it started (1 when none says more), and the
    variable that says so."""
    best = (1, "")
    # srun sets SLURM_STEP_NUM_TASKS for the tasks it starts; a batch script alone does not.
    for var in _LAUNCHER_VARS + ("SLURM_STEP_NUM_TASKS",):
        n = _env_int(var)
        if n > best[0]:
            best = (n, var)
    return best


def launched_by_mpi() -> bool:
    """True when started by mpirun/mpiexec/srun with more than one process."""
    return _launcher_size()[0] > 1


def abort_launch(code: int) -> None:
    """Ctrl-C before this process made its communicator, under a launcher: the other ranks may
    already wait in MPI's start-up for this one, and would wait forever after it exits (mpirun
    waits for them). Join the start-up and abort, which ends every rank; nothing outside one."""
    if not launched_by_mpi():
        return
    try:
        import sys

        MPI = import_mpi()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)
    except BaseException:  # noqa: BLE001 - no MPI to join (or a second Ctrl-C): exit as asked
        pass


def import_mpi():
    """mpi4py's MPI module (which starts MPI). mpi4py warns of a launcher of another MPI in several
    lines; make_comm says it in one."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="suspicious MPI execution environment")
        from mpi4py import MPI
    return MPI


def note_signals():
    """Note Ctrl-C and SIGTERM instead of acting on them: ``(noted, handlers before)``, or None off
    the main thread (where no handler can be set). Python-level handlers, not a blocked mask:
    onnxruntime's and numpy's threads do not block them, and a signal sent to the process reaches
    whichever thread does not. :func:`put_back` restores the handlers."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    noted, before = [], {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            before[sig] = signal.signal(sig, lambda signum, frame: noted.append(signum))
        except (ValueError, OSError):
            pass
    return noted, before


def put_back(before: dict) -> None:
    """The handlers :func:`note_signals` replaced (None, one not set from Python: the default)."""
    import signal

    for sig, handler in before.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
