"""Threads per MPI process (dipoorlet/threads.py): the launcher's variables -> each process's
share of the node's cores, without overriding what the user set."""
from __future__ import annotations

import os

import pytest

from dipoorlet import threads

VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE",
        "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID",
        "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", threads.ENV)


@pytest.fixture
def env(monkeypatch):
    for v in VARS:   # set, then delete: teardown restores each (what share_cores sets does not leak)
        monkeypatch.setenv(v, "x")
        monkeypatch.delenv(v)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    return monkeypatch


def test_outside_mpi_nothing_is_set(env):
    assert threads.share_cores() is None
    assert "OMP_NUM_THREADS" not in os.environ and threads.session_threads() == 0


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"])
def test_local_processes_share_the_cores(env, var):
    env.setenv(var, "4")
    assert threads.share_cores() == 2
    assert os.environ["OPENBLAS_NUM_THREADS"] == "2" and threads.session_threads() == 2


def test_the_users_settings_win(env):
    """One thread variable set (a cluster module's OMP_NUM_THREADS=1) is the intent for all."""
    env.setenv("MPI_LOCALNRANKS", "2")
    env.setenv("OMP_NUM_THREADS", "3")
    assert threads.share_cores() == 3
    assert os.environ["OPENBLAS_NUM_THREADS"] == "3" and os.environ["MKL_NUM_THREADS"] == "3"


def test_a_binding_launcher_is_not_divided_again(env):
    """srun -c 2 -n 4 on an 8-core node: each process is bound to 2 cores and gets 2 threads."""
    env.setattr(os, "cpu_count", lambda: 8)
    env.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    env.setenv("MPI_LOCALNRANKS", "4")
    assert threads.share_cores() == 2


def test_more_processes_than_cores_get_one_thread(env):
    env.setenv("MPI_LOCALNRANKS", "32")
    assert threads.share_cores() == 1


@pytest.mark.parametrize("spec,node,want", [("2(x3),1", "0", 2), ("2(x3),1", "3", 1), ("4", "0", 4), ("bad", "0", 1)])
def test_srun_tasks_on_this_node(env, spec, node, want):
    env.setenv("SLURM_STEP_NUM_TASKS", "7")
    env.setenv("SLURM_STEP_TASKS_PER_NODE", spec)
    env.setenv("SLURM_NODEID", node)
    assert threads.local_processes() == want


def test_the_cli_module_loads_no_numpy_before_main_sets_the_share():
    """share_cores() runs at the start of cli.main: the BLAS reads its thread variables when numpy
    is first imported, so importing the CLI (python -m dipoorlet, the dipoorlet script) must not."""
    import subprocess
    import sys

    code = "import sys, dipoorlet.__init__, dipoorlet.cli; print(sorted(m for m in ('numpy', 'onnxruntime', 'onnx') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_sample_sums_from_several_threads_at_once_equal_the_serial_ones():
    """The sensitivity analysis scores its samples on several threads; the error sums' chunk
    buffers are per thread (shared, two threads' chunks overwrote each other: the PP-OCRv4
    recognizer's p2o.MatMul.2 read 16.8 dB where a serial run reads 62.6). Oracle: the same
    sums computed one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from dipoorlet.layer_errors import sample_sums

    rng = np.random.default_rng(0)
    pairs = []
    for k in range(16):
        f = rng.standard_normal(200_000).astype(np.float32)
        pairs.append((f, f + rng.standard_normal(f.size).astype(np.float32) * 10.0 ** -(k % 4 + 1)))
    want = [sample_sums(f, q) for f, q in pairs]
    for _ in range(3):
        with ThreadPoolExecutor(max_workers=4) as pool:
            got = list(pool.map(lambda p: sample_sums(*p), pairs))
        assert got == want


@pytest.mark.parametrize("value", ["x", "\u00b2", " ", "-1"])
def test_launcher_variables_that_are_not_numbers_are_ignored(monkeypatch, value):
    from dipoorlet import threads

    for var in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_RANK", "MPI_LOCALNRANKS", "DIPOORLET_THREADS",
                "SLURM_PROCID", "SLURM_NODEID"):
        monkeypatch.setenv(var, value)
    assert threads.launcher_rank() == 0
    assert threads.local_processes() == 1
    assert threads.session_threads() == 0
