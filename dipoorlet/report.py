"""Error report writers: JSON for machines, Markdown for people, a terminal table at the end."""
from __future__ import annotations

import math

from dipoorlet.util import write_json, write_text


def _num(x: float):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(x, 6)


def worst(rows, k: int = 10):
    return sorted((r for r in rows if not r.is_output), key=lambda r: r.cosine)[:k]


def build(rows, placement, meta: dict) -> dict:
    return {
        **meta,
        "outputs": [{"tensor": r.tensor, "cosine": _num(r.cosine), "min_cosine": _num(r.min_cosine),
                     "sqnr_db": _num(r.sqnr_db), "max_abs_err": _num(r.max_abs_err)}
                    for r in rows if r.is_output],
        "layers": [{"node": r.node, "op_type": r.op_type, "tensor": r.tensor, "cosine": _num(r.cosine),
                    "min_cosine": _num(r.min_cosine), "sqnr_db": _num(r.sqnr_db),
                    "max_abs_err": _num(r.max_abs_err)} for r in rows if not r.is_output],
        "worst_layers": [r.node for r in worst(rows)],
        "decisions": [{"node": d.node, "op_type": d.op_type, "quantized": d.quantized, "reason": d.reason}
                      for d in placement.decisions],
    }


def table(headers, body) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in body]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), sep] + [fmt(r) for r in cells[1:]])


def markdown(report: dict) -> str:
    out = [f"# dipoorlet report: {report['model']}", "",
           f"platform `{report['platform']}`, method `{report['method']}`, {report['samples']} samples, "
           f"{report['quantized_nodes']} quantized nodes, {report['qdq_tensors']} Q/DQ activations", "",
           "## Network outputs", "",
           table(["output", "mean cosine", "min cosine", "SQNR dB"],
                 [[o["tensor"], o["cosine"], o["min_cosine"], o["sqnr_db"]] for o in report["outputs"]])]
    layers = {l["node"]: l for l in report["layers"]}
    if report["worst_layers"]:
        out += ["", "## 10 worst layers (cumulative error)", "",
                table(["node", "op", "cosine", "SQNR dB"],
                      [[n, layers[n]["op_type"], layers[n]["cosine"], layers[n]["sqnr_db"]]
                       for n in report["worst_layers"]])]
    return "\n".join(out) + "\n"


def write(folder, report: dict) -> list:
    return [write_json(folder / "report.json", report), write_text(folder / "report.md", markdown(report))]
