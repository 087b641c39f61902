"""Texas Instruments TIDL side files: ``ti_blob_range.txt`` and ``ti_blob_range.json``.

Source: ModelTC Dipoorlet ``deploy/deploy_ti.py``: a text file of ``<tensor> <min> <max>`` lines
and ``{"blob_range": {tensor: [min, max]}}`` (for NART), one entry per quantized activation.

The reference wrote the raw calibration range. TIDL quantizes with power-of-two scales,
symmetric for signed tensors and unsigned for non-negative ones, so the raw range is not what the
chip computes with; here ``[min, max]`` is the range that gives back the plan's own grid: for a
signed (symmetric) tensor ``[-127 s, 127 s]``, since a symmetric reader takes
``max(|min|, |max|) / 127`` as the scale (``-128 s`` would give it a scale one 127th too large,
which a power-of-two chip rounds up to the next power: one bit lost); for an unsigned one the
grid ``[0, 255 s]``. Numbers are written with Python's shortest
round-trip ``repr``, so parsing them back gives the same float64. Tensor names are taken as they
are; a name with a space would make the text file ambiguous (use the JSON file then), and one
with a line break is left out of it, with a warning.
"""
from __future__ import annotations

import logging

from dipoorlet.deploy import register
from dipoorlet.deploy.snpe import floats, grid_range, is_symmetric, pass_through_fill_ins, sym_amax
from dipoorlet.util import write_json, write_text

log = logging.getLogger(__name__)


def blob_ranges(ctx) -> dict[str, list[float]]:
    out = {}
    for t, qp in ctx.plan.activations.items():
        if is_symmetric(qp):
            a = max(floats(sym_amax(qp)))
            out[t] = [-a, a]
        else:
            lo, hi = grid_range(qp)
            out[t] = [min(floats(lo)), max(floats(hi))]
    for src, dst in pass_through_fill_ins(ctx).items():
        out[src] = out[dst]
    return out


@register("ti")
def export(ctx, folder):
    ranges = blob_ranges(ctx)
    broken = [t for t in ranges if "\n" in t or "\r" in t]
    if broken:
        log.warning("ti: %d tensor names hold a line break (e.g. %r) and are left out of ti_blob_range.txt, whose "
                    "lines they would split; ti_blob_range.json has them; rename them in the model",
                    len(broken), broken[0])
    text = "".join(f"{t} {lo!r} {hi!r}\n" for t, (lo, hi) in ranges.items() if t not in broken)
    return [write_text(folder / "ti_blob_range.txt", text),
            write_json(folder / "ti_blob_range.json", {"blob_range": ranges})]
