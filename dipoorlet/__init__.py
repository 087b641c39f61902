"""dipoorlet: offline post-training quantization of ONNX models for deployment backends."""
__version__ = "0.1.0"


def quantize(**kwargs):
    """Python API: ``dipoorlet.quantize(model=..., input_dir=..., data_num=..., deploy="trt", ...)``.

    Takes the fields of :class:`dipoorlet.config.QuantConfig`; returns a
    :class:`dipoorlet.pipeline.Result`. Raises :class:`dipoorlet.errors.DipoorletError` on bad input.
    """
    from dipoorlet.config import QuantConfig
    from dipoorlet.pipeline import quantize as _quantize

    return _quantize(QuantConfig(**kwargs))
