"""TensorRT side files: ``trt_clip_val.json`` and a calibration cache.

- ``trt_clip_val.json``: ``{"blob_range": {tensor: amax}}``, amax = scale * 127 (the clip
  range the grid covers), for use with ``ITensor.setDynamicRange(-amax, amax)``. Source: Dipoorlet
  ``deploy/deploy_trt.py`` (``json.dump(..., indent=4)``).
- ``trt_calib.cache``: the text cache TensorRT's INT8 calibrators read and write. First line
  ``TRT-<version>-EntropyCalibration2``, then ``tensor: <hex>`` per tensor, the hex being the 8
  lowercase digits of the big-endian IEEE-754 float32 scale = amax / 127 (sources: NVIDIA TAO
  export code; ModelOpt ``calib_utils.py`` reads it with ``struct.unpack("!f", bytes.fromhex(h))``;
  onnxruntime's TensorRT provider reads it with ``strtoul(hex, 16)``). TensorRT 10 may reject a
  cache whose version header differs from its own: ``--trt_version`` sets it (default 8601).

Both cover the tensors that carry Q/DQ in ``quant_model.onnx``, which is the primary artefact for
TensorRT 8.x and later (explicit quantization); tensors not listed run in higher precision.
"""
from __future__ import annotations

import logging
import struct

from dipoorlet.deploy import register
from dipoorlet.deploy.snpe import floats, is_symmetric, sym_amax
from dipoorlet.util import write_json, write_text

log = logging.getLogger(__name__)


def cache_hex(scale: float) -> str:
    return struct.pack(">f", float(scale)).hex()


@register("trt")
def export(ctx, folder):
    # from the grid itself (scale * 127), so both files agree even where the clip range was
    # empty (an always-zero tensor gets the smallest positive scale, not a range of 0)
    amax = {t: float(max(floats(sym_amax(qp)))) for t, qp in ctx.plan.activations.items()}
    version = getattr(ctx.config, "trt_version", "8601")
    lines = [f"TRT-{version}-EntropyCalibration2"]
    # TensorRT's grid is int8 symmetric whatever the plan says: its scale is amax / 127 (for a
    # 6-bit or asymmetric plan, the plan's own scale would state a 4x wider range than the json)
    broken = [t for t in ctx.plan.activations if "\n" in t or "\r" in t]
    colon = [t for t in ctx.plan.activations if ":" in t and t not in broken]
    for t in ctx.plan.activations:
        if t not in broken:     # a line break would start a line of its own: every reader misparses it
            lines.append(f"{t}: {cache_hex(amax[t] / 127.0)}")
    if broken:
        log.warning("trt: %d tensor names hold a line break (e.g. %r) and are left out of trt_calib.cache, "
                    "whose lines they would split; trt_clip_val.json has them; rename them in the model",
                    len(broken), broken[0])
    if colon:
        log.warning("trt: %d tensor names hold ':' (e.g. %r); trt_calib.cache lines are 'name: scale' with no "
                    "escape, so a reader that splits at the first ':' misreads them; trt_clip_val.json and "
                    "quant_model.onnx are not affected", len(colon), colon[0])
    odd = [t for t, qp in ctx.plan.activations.items() if not (is_symmetric(qp) and qp.qmax == 127)]
    if odd:
        log.warning("trt: %d activation grids are not int8 symmetric (e.g. %s); TensorRT quantizes "
                    "them on its own int8 grid over the clip range in trt_clip_val.json / "
                    "trt_calib.cache, not on the narrower grid quant_model.onnx simulates", len(odd), odd[0])
    return [write_json(folder / "trt_clip_val.json", {"blob_range": amax}),
            write_text(folder / "trt_calib.cache", "\n".join(lines) + "\n")]
