"""dipoorlet: offline post-training quantization of ONNX models for deployment backends."""
__version__ = "0.1.0"


def quantize(**kwargs):
    """Quantize a model: ``dipoorlet.quantize(model=..., input_dir=..., data_num=..., deploy="trt",
    output_dir=..., act_quant="mse", ...)``.

    Takes the fields of :class:`dipoorlet.config.QuantConfig` (the CLI's flags by their long
    names); returns a :class:`dipoorlet.pipeline.Result` whose ``report`` is the dict written to
    ``report.json``. Raises :class:`dipoorlet.errors.DipoorletError` on bad input.
    """
    import logging
    from pathlib import Path

    from dipoorlet.cli import RUN_LOG, name_run_log
    from dipoorlet.config import QuantConfig
    from dipoorlet.pipeline import check_output_dir, quantize as _quantize

    cfg = QuantConfig(**kwargs)
    # the run's log goes into the output folder as from the CLI (dipoorlet.log; a failed run's beside
    # an earlier run's outputs is dipoorlet.failed.log); the caller's own handlers stay as they are
    out = Path(cfg.output_dir)
    check_output_dir(out)
    logger = logging.getLogger("dipoorlet")
    level = logger.level
    if level == logging.NOTSET or level > logging.INFO:
        logger.setLevel(logging.DEBUG if cfg.debug else logging.INFO)
    fh = logging.FileHandler(out / RUN_LOG, mode="w", encoding="utf-8")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(fh)
    ok = False
    try:
        result = _quantize(cfg)
        ok = True
        return result
    finally:
        logger.removeHandler(fh)
        fh.close()
        logger.setLevel(level)
        name_run_log(out, ok)


def profile(**kwargs) -> dict:
    """Quantize and return the error report, for CI gates: per-layer cumulative and isolated
    error, network-output cosine/SQNR, and the auto_skip result when ``auto_skip`` is given::

        rep = dipoorlet.profile(model="m.onnx", input_dir="calib", data_num=64, deploy="trt",
                                output_dir="out")
        assert rep["outputs"][0]["cosine"] >= 0.999, rep["most_sensitive_layers"]
    """
    kwargs.setdefault("skip_prof_layer", False)
    return quantize(**kwargs).report
