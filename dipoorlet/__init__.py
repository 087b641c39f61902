"""dipoorlet: offline post-training quantization of ONNX models for deployment backends."""
__version__ = "0.1.0"


def quantize(**kwargs):
    """Quantize a model: ``dipoorlet.quantize(model=..., input_dir=..., data_num=..., deploy="trt",
    output_dir=..., act_quant="mse", ...)``.

    Takes the fields of :class:`dipoorlet.config.QuantConfig` or the CLI's long flag names
    (``eq_samples=4``, ``input_shape=["x:1,3,224,224"]``, ``layer_bits=["conv1=w4"]``,
    ``no_bc=True``); returns a :class:`dipoorlet.pipeline.Result` whose ``report`` is the dict written to
    ``report.json``. Raises :class:`dipoorlet.errors.DipoorletError` on bad input, and its subclass
    :class:`dipoorlet.errors.BelowTargetError` (carrying ``.result``; the outputs are written) when
    ``fail_below`` is given and a judged output scores below it.
    """
    from pathlib import Path

    from dipoorlet.cli import RUN_LOG, _check_log_names, name_run_log
    from dipoorlet.config import config_from_kwargs
    from dipoorlet.dist import launched_by_mpi, make_comm
    from dipoorlet.graph import check_model_path
    from dipoorlet.pipeline import OutputLock, check_output_dir, quantize as _quantize

    distributed = bool(kwargs.pop("mpirun", False)) | bool(kwargs.pop("slurm", False))
    cfg = config_from_kwargs(**kwargs)
    # the run's log goes into the output folder as from the CLI (dipoorlet.log; a failed run's beside
    # an earlier run's outputs is dipoorlet.failed.log); the caller sees what it saw before
    out = Path(cfg.output_dir)
    # as from the CLI: a missing model is named before -O (default <model dir>/results) is made,
    # and the log must not overwrite a file of the model (an API call had made ram/typo/results/
    # and a log there for a mistyped model path; found by a bug hunt)
    check_model_path(cfg.model)
    check_output_dir(out)
    _check_log_names(cfg)
    comm = make_comm(mpirun=True) if distributed else None
    if comm is None and launched_by_mpi():
        import logging

        logging.getLogger("dipoorlet").warning(
            "dipoorlet.quantize: this process is one of several an MPI launcher started, but the call runs in "
            "it alone; pass mpirun=True (every rank calling with the same arguments) to share the samples "
            "over the ranks, or give each rank its own output_dir")
    # one run at a time per process: the "dipoorlet" logger's setup and the custom-op libraries
    # of a run are process-wide (a second thread's call waits for the first); one run at a time
    # per output folder across processes (OutputLock)
    with _API_LOCK:
        from dipoorlet.pipeline import PUBLISHED

        PUBLISHED.clear()   # an earlier call's: an interrupt before this run publishes is said of this run
        if comm is not None and comm.world > 1:
            return _quantize_distributed(cfg, comm, out)
        ok = False
        lock = OutputLock(out)
        try:
            with _run_log(out / RUN_LOG, cfg.debug):
                try:
                    result = _quantize(cfg)
                except BaseException as exc:
                    # the run's log says why, as from the CLI (the caller gets the exception), and
                    # where the outputs are in -O already it is their log (an exception of a caller's
                    # signal handler, a SIGTERM handler's sys.exit, had named it dipoorlet.failed.log
                    # beside the new outputs; found by a hunt)
                    from dipoorlet.cli import _log_to_file, _published, _stop_note

                    ok = bool(_published())
                    if isinstance(exc, KeyboardInterrupt):
                        _log_to_file(f"dipoorlet: interrupted; {_stop_note()}")
                    elif isinstance(exc, Exception):
                        _log_to_file(f"dipoorlet: error: {exc}" + (f"; {_stop_note()}" if ok else ""))
                    else:
                        _log_to_file(f"dipoorlet: stopped ({type(exc).__name__}"
                                     f"{': ' + str(exc) if str(exc) else ''}); {_stop_note()}")
                    raise
                ok = True       # the outputs are written, a miss of fail_below included
                _check_bar(result, cfg)
            return result
        finally:
            name_run_log(out, ok)
            lock.release()


def _check_bar(result, cfg) -> None:
    from dipoorlet.errors import BelowTargetError

    low = _miss(result, cfg)
    if low:
        import logging

        logging.getLogger("dipoorlet").error("dipoorlet: fail_below %s: %s", cfg.fail_below, low)
        raise BelowTargetError(f"fail_below {cfg.fail_below}: {low}", result)


def _quantize_distributed(cfg, comm, out):
    """``mpirun=True`` under a launcher: every rank calls with the same arguments and reads its
    share of the samples; rank 0 logs into -O and writes the outputs (the other ranks' Result
    lists no files). A rank that fails takes every rank down (MPI_Abort) with its one-line
    message, as the CLI does, rather than leaving the others waiting in a collective."""
    import logging
    import sys

    from dipoorlet.cli import name_run_log, note_in_log, rank0_log
    from dipoorlet.errors import BelowTargetError, DipoorletError
    from dipoorlet.pipeline import OutputLock, quantize as _quantize

    ok = False
    # as from the CLI: another rank's abort can end rank 0 before it names a temporary log, so
    # rank 0 logs into dipoorlet.log directly unless -O holds an earlier run's outputs and log
    log_path = rank0_log(out)
    lock = None
    with _API_LOCK:
        try:
            if comm.rank == 0:
                lock = OutputLock(out)
                with _run_log(log_path, cfg.debug):
                    logging.getLogger("dipoorlet").info("dipoorlet.quantize: running as %d MPI processes", comm.world)
                    result = _quantize(cfg, comm)
                    ok = True
                    low = _miss(result, cfg)
                    if low:
                        logging.getLogger("dipoorlet").error("dipoorlet: fail_below %s: %s", cfg.fail_below, low)
            else:
                with _quiet_log():
                    result = _quantize(cfg, comm)
        except BaseException as exc:  # noqa: BLE001 - every failure must end every rank
            if isinstance(exc, KeyboardInterrupt):
                from dipoorlet.cli import _stop_note

                what = f"interrupted; {_stop_note()}"
            else:
                what = str(exc) if isinstance(exc, DipoorletError) else f"{type(exc).__name__}: {exc}"
            if comm.rank == 0:
                if lock is not None:     # (a run that found -O locked must not write into the other's log)
                    note_in_log(log_path, f"dipoorlet: error (rank 0): {what}")
                    name_run_log(out, ok)
            else:
                # an error every rank meets is printed once, by rank 0, whose abort ends the others
                # in this wait (as from the CLI); one of this rank's share is printed after it
                import time

                from dipoorlet.cli import RANK_ERROR_DELAY_S

                with _contextlib.suppress(BaseException):
                    time.sleep(RANK_ERROR_DELAY_S)
            if comm.rank != 0:
                note_in_log(log_path, f"dipoorlet: error (rank {comm.rank}): {what}")
            print(f"dipoorlet: error (rank {comm.rank}): {what}", file=sys.stderr, flush=True)
            comm.abort(exc.exit_code if isinstance(exc, DipoorletError) else 1)
            raise
        if comm.rank == 0:
            name_run_log(out, ok)
            lock.release()
    # only rank 0 holds the report: its verdict is shared, and every rank raises alike
    low = comm.bcast(low if comm.rank == 0 else None)
    if low:
        raise BelowTargetError(f"fail_below {cfg.fail_below}: {low}", result)
    return result


def _miss(result, cfg) -> str:
    from dipoorlet.cli import below_bar

    return below_bar(result.report, cfg.fail_below)


import contextlib as _contextlib  # noqa: E402
import threading as _threading  # noqa: E402

_API_LOCK = _threading.RLock()


@_contextlib.contextmanager
def _quiet_log():
    """A rank other than 0 of a distributed API call logs nothing (rank 0 logs for all)."""
    import logging

    logger = logging.getLogger("dipoorlet")
    saved = (logger.propagate, list(logger.handlers))
    for h in saved[1]:
        logger.removeHandler(h)
    quiet = logging.NullHandler()
    logger.addHandler(quiet)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(quiet)
        for h in saved[1]:
            logger.addHandler(h)
        logger.propagate = saved[0]


@_contextlib.contextmanager
def _run_log(path, debug: bool = False):
    """INFO (DEBUG) records of the "dipoorlet" loggers into ``path`` for one API call, while the
    caller's handlers, and Python's last-resort stderr handler where there are none, get exactly
    the records they got before: those at or above the level the "dipoorlet" logger had."""
    import logging

    logger = logging.getLogger("dipoorlet")
    before = logger.getEffectiveLevel()
    saved = (logger.level, logger.propagate, list(logger.handlers))

    class Forward(logging.Handler):
        def emit(self, record):
            if record.levelno < before:
                return
            found = False
            for h in saved[2]:
                found = True
                if record.levelno >= h.level:
                    h.handle(record)
            c = logger.parent if saved[1] else None
            while c is not None:
                for h in c.handlers:
                    found = True
                    if record.levelno >= h.level:
                        h.handle(record)
                c = c.parent if c.propagate else None
            if not found and logging.lastResort is not None and record.levelno >= logging.lastResort.level:
                logging.lastResort.handle(record)

    from dipoorlet.util import QuietFileHandler

    fh = QuietFileHandler(path, mode="w", encoding="utf-8")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for h in saved[2]:
        logger.removeHandler(h)
    logger.propagate = False
    logger.setLevel(logging.DEBUG if debug else min(before, logging.INFO))
    logger.addHandler(Forward())
    logger.addHandler(fh)
    try:
        yield
    finally:
        for h in list(logger.handlers):
            logger.removeHandler(h)
        fh.close()
        for h in saved[2]:
            logger.addHandler(h)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def profile(**kwargs) -> dict:
    """Quantize and return the error report, for CI gates: per-layer cumulative and isolated
    error, network-output cosine/SQNR, and the auto_skip result when ``auto_skip`` is given::

        rep = dipoorlet.profile(model="m.onnx", input_dir="calib", data_num=64, deploy="trt",
                                output_dir="out")
        assert rep["outputs"][0]["cosine"] >= 0.999, rep["most_sensitive_layers"]
    """
    kwargs.setdefault("skip_prof_layer", False)
    return quantize(**kwargs).report
