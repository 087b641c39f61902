"""dipoorlet: offline post-training quantization of ONNX models for deployment backends."""
__version__ = "0.1.0"


def quantize(**kwargs):
    """Quantize a model: ``dipoorlet.quantize(model=..., input_dir=..., data_num=..., deploy="trt",
    output_dir=..., act_quant="mse", ...)``.

    Takes the fields of :class:`dipoorlet.config.QuantConfig` (the CLI's flags by their long
    names); returns a :class:`dipoorlet.pipeline.Result` whose ``report`` is the dict written to
    ``report.json``. Raises :class:`dipoorlet.errors.DipoorletError` on bad input.
    """
    from dipoorlet.config import QuantConfig
    from dipoorlet.pipeline import quantize as _quantize

    return _quantize(QuantConfig(**kwargs))


def profile(**kwargs) -> dict:
    """Quantize and return the error report, for CI gates: per-layer cumulative and isolated
    error, network-output cosine/SQNR, and the auto_skip result when ``auto_skip`` is given::

        rep = dipoorlet.profile(model="m.onnx", input_dir="calib", data_num=64, deploy="trt",
                                output_dir="out")
        assert rep["outputs"][0]["cosine"] >= 0.999, rep["most_sensitive_layers"]
    """
    kwargs.setdefault("skip_prof_layer", False)
    return quantize(**kwargs).report
