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

    from dipoorlet.cli import RUN_LOG, below_bar, name_run_log
    from dipoorlet.errors import BelowTargetError
    from dipoorlet.config import config_from_kwargs
    from dipoorlet.pipeline import check_output_dir, quantize as _quantize

    cfg = config_from_kwargs(**kwargs)
    # the run's log goes into the output folder as from the CLI (dipoorlet.log; a failed run's beside
    # an earlier run's outputs is dipoorlet.failed.log); the caller sees what it saw before
    out = Path(cfg.output_dir)
    check_output_dir(out)
    ok = False
    # one run at a time per process: the "dipoorlet" logger's setup and the custom-op libraries
    # of a run are process-wide (a second thread's call waits for the first)
    with _API_LOCK:
        try:
            with _run_log(out / RUN_LOG, cfg.debug):
                result = _quantize(cfg)
                ok = True       # the outputs are written, a miss of fail_below included
                low = below_bar(result.report, cfg.fail_below)
                if low:
                    import logging

                    logging.getLogger("dipoorlet").error("dipoorlet: fail_below %s: %s", cfg.fail_below, low)
                    raise BelowTargetError(f"fail_below {cfg.fail_below}: {low}", result)
            return result
        finally:
            name_run_log(out, ok)


import contextlib as _contextlib  # noqa: E402
import threading as _threading  # noqa: E402

_API_LOCK = _threading.RLock()


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

    fh = logging.FileHandler(path, mode="w", encoding="utf-8")
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
