"""``report.html``: one self-contained page (inline SVG, no scripts, no network) a person reads.

Plots: per-layer SQNR along the network depth (cumulative and isolated), the activation
histograms of the worst layers with the chosen clip range, and the distribution of per-sample
output cosines. Tables: outputs, worst and most sensitive layers, auto_skip/auto_a16/auto_w8, the
diagnosis, float layers.
"""
from __future__ import annotations

import html as _html
import math

W, H, PAD = 860, 260, 48
CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:920px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f4f4f4}.bad{color:#b00020;font-weight:600}.ok{color:#1b7f3b;font-weight:600}
svg{background:#fcfcfc;border:1px solid #e4e4e4}.legend span{margin-right:16px}.muted{color:#777}
.grid{display:flex;flex-wrap:wrap;gap:10px}"""


def esc(x) -> str:
    return _html.escape("-" if x is None else str(x))


def _fmt(v, nd=4):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _scale(lo, hi, a, b):
    span = (hi - lo) or 1.0
    return lambda v: a + (v - lo) / span * (b - a)


def depth_plot(layers) -> str:
    """SQNR (dB) of every quantized layer in network order: cumulative and isolated."""
    cum = [l.get("sqnr_db") for l in layers]
    iso = [(l.get("isolated") or {}).get("sqnr_db") for l in layers]
    vals = [v for v in cum + iso if v is not None]
    if not vals:
        return "<p class=muted>no per-layer data (--skip_prof_layer)</p>"
    lo, hi = min(0.0, min(vals)), max(vals) * 1.05 + 1
    x = _scale(0, max(len(layers) - 1, 1), PAD, W - 12)
    y = _scale(lo, hi, H - 30, 12)
    parts = [f'<svg width="{W}" height="{H}" role="img" aria-label="per-layer SQNR">']
    for k in range(6):
        v = lo + (hi - lo) * k / 5
        parts.append(f'<line x1="{PAD}" x2="{W-12}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
                     f'<text x="{PAD-6}" y="{y(v)+4:.1f}" font-size="11" text-anchor="end">{v:.0f}</text>')
    parts.append(f'<text x="12" y="{H/2}" font-size="11" transform="rotate(-90 12 {H/2})">SQNR dB</text>'
                 f'<text x="{W/2}" y="{H-6}" font-size="11">layer (network order)</text>')
    for series, color in ((cum, "#1f6fb2"), (iso, "#d9480f")):
        pts = [(i, v) for i, v in enumerate(series) if v is not None]
        if not pts:
            continue
        path = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in pts)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.6"/>')
        for i, v in pts:
            parts.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="2.6" fill="{color}">'
                         f'<title>{esc(layers[i]["node"])} ({esc(layers[i]["op_type"])}): {v:.2f} dB</title></circle>')
    parts.append("</svg>")
    legend = ('<div class=legend><span style="color:#1f6fb2">● cumulative (everything upstream quantized)</span>'
              '<span style="color:#d9480f">● isolated (only this layer quantized, at the output)</span></div>')
    return "".join(parts) + legend


def bar_plot(counts, lo, hi, title, clip=None, width=420, height=170) -> str:
    if not counts:
        return ""
    peak = max(counts) or 1
    # log counts: activation histograms are dominated by a spike near zero
    ys = [math.log1p(c) / math.log1p(peak) for c in counts]
    bw = (width - 20) / len(counts)
    parts = [f'<svg width="{width}" height="{height}"><text x="8" y="14" font-size="12">{esc(title)}</text>']
    for i, v in enumerate(ys):
        h = v * (height - 44)
        parts.append(f'<rect x="{10 + i*bw:.1f}" y="{height-24-h:.1f}" width="{max(bw-0.6, 0.6):.1f}" '
                     f'height="{h:.1f}" fill="#5b8fd0"><title>{counts[i]}</title></rect>')
    x = _scale(lo, hi, 10, width - 10)
    if clip:
        for c in clip:
            if c is not None and lo <= c <= hi:
                parts.append(f'<line x1="{x(c):.1f}" x2="{x(c):.1f}" y1="20" y2="{height-24}" '
                             f'stroke="#d9480f" stroke-dasharray="4,3"/>')
    parts.append(f'<text x="10" y="{height-8}" font-size="10">{lo:.3g}</text>'
                 f'<text x="{width-10}" y="{height-8}" font-size="10" text-anchor="end">{hi:.3g}</text></svg>')
    return "".join(parts)


def _auto_section(name, a, how, label, layers, after, note) -> list[str]:
    """The HTML of an --auto_skip / --auto_a16 / --auto_w8 result: heading, summary, one row per trial."""
    from dipoorlet.report import auto_trials

    status = '<span class=ok>met</span>' if a["met"] else '<span class=bad>not met</span>'
    head, rows = auto_trials(name, a)
    return [f"<h2>{name}: {esc(a['criterion'])} ≥ {esc(a['target'])} — {status}{how}</h2>",
            f"<p>{label}: <b>{esc(', '.join(layers) or 'none')}</b>; output cosine "
            f"{_fmt(a['before']['cosine'], 6)} → {_fmt(after['cosine'], 6)}, SQNR "
            f"{_fmt(a['before']['sqnr_db'], 2)} → {_fmt(after['sqnr_db'], 2)} dB{note}</p>",
            _table(head, [["-" if c is None else esc(str(c)) for c in row] for row in rows])]


def _table(headers, rows) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cos_cell(v, bar=0.999):
    if v is None:
        return "-"
    return f'<span class="{"ok" if v >= bar else "bad"}">{v:.6f}</span>'


def html(rep: dict) -> str:
    from dipoorlet.report import (a16_figure, float_weights_note, format_note, kept_float, node_label, output_label,
                                  profile_note, shared_grid_note)

    layers = rep.get("layers", [])
    qop_note = format_note(rep)
    weights_note = float_weights_note(rep)
    shared_note = shared_grid_note(rep)
    by_node = {l["node"]: l for l in layers}
    out = [f"<!doctype html><html><head><meta charset=utf-8><title>dipoorlet report</title>"
           f"<style>{CSS}</style></head><body>",
           f"<h1>Quantization report: {esc(rep['model'])}</h1>",
           f"<p>platform <b>{esc(rep['platform'])}</b>, activation ranges <b>{esc(rep['method'])}</b>, "
           f"{esc(rep['samples'])} calibration samples{esc(profile_note(rep))}; {esc(rep['quantized_nodes'])} nodes quantized, "
           f"{esc(rep['qdq_tensors'])} activations with Q/DQ.</p>",
           *([f"<p>{esc(qop_note)}</p>"] if qop_note else []),
           *([f"<p>{esc(weights_note)}</p>"] if weights_note else []),
           *([f"<p>{esc(shared_note)}</p>"] if shared_note else []),
           "<h2>Network outputs</h2>",
           _table(["output", "mean cosine", "min cosine", "SQNR dB", "max |err|"],
                  [[esc(output_label(o, rep)), _cos_cell(o["cosine"]),
                    _cos_cell(o["min_cosine"]), _fmt(o["sqnr_db"], 2), _fmt(o["max_abs_err"])]
                   for o in rep.get("outputs", [])])]
    if any(o.get("cosine_over_samples") for o in rep.get("outputs", [])):
        out.append("<p>* fewer than 8 values per sample: one cosine over all samples' values together (a "
                   "single value's own cosine is always 1, two logits' nearly a sign check).</p>")
    from dipoorlet.report import lowest_cosine_notes

    out += [f"<p>{esc(n)}</p>" for n in lowest_cosine_notes({"outputs": rep.get("outputs", [])})]
    for name, d in rep.get("output_distribution", {}).items():
        e = d["edges"]
        out.append(bar_plot(d["counts"], e[0], e[-1], f"per-sample output cosine: {name} ({d['samples']} samples)",
                            width=W, height=150))
    from dipoorlet.report import _transforms, profile_source

    if rep.get("profile_data"):
        out.insert(out.index("<h2>Network outputs</h2>") + 1,
                   f"<p class=muted>error profile over {esc(profile_source(rep))}</p>")
    c = rep.get("clipped")
    if c and c["tensors_clipped"]:
        out += [f"<h2>Values beyond the calibrated ranges</h2><p class=muted>{esc(profile_source(rep))}: "
                f"{c['tensors_clipped']} of {c['tensors']} quantized activations saturate; saturation / rounding "
                "noise above 1 costs more than the grid's rounding</p>",
                _table(["tensor", "values beyond", "fraction", "largest / range edge", "saturation / rounding noise"],
                       [[esc(w["tensor"]), w["values"], f"{w['fraction']:.3g}", _fmt(w["peak_over_range"], 3),
                         _fmt(w["saturation_over_rounding_noise"], 3)] for w in c["worst"]])]
    transforms = _transforms(rep)
    if transforms:
        out += ["<h2>Transforms applied</h2><p class=muted>their float graph: transformed_model.onnx</p><ul>",
                *[f"<li>{esc(line[2:])}</li>" for line in transforms if line.startswith("- ")], "</ul>"]
    a = rep.get("auto_skip")
    if a:
        out += _auto_section("auto_skip", a, "", "kept in float", a["float_layers"], a["after"], "")
    a = rep.get("auto_a16")
    if a:
        after, note = a16_figure(a)
        out += _auto_section("auto_a16", a, " (as written)" if a.get("after_measured") else " (estimated)",
                             "inputs on 16-bit grids", a["a16_layers"], after, note)
    a = rep.get("auto_w8")
    if a:
        out += _auto_section("auto_w8", a, " (as written)" if a.get("after_measured") else " (estimated)",
                             "weights on 8-bit grids", a["w8_layers"], a.get("after_measured") or a["after_estimated"],
                             "")
    if rep.get("diagnosis") or rep.get("error_spread"):
        out += ["<h2>What limits accuracy, and what to do</h2><ul>",
                *([f"<li><b>spread over many layers</b>: {esc(rep['error_spread']['advice'])}</li>"]
                  if rep.get("error_spread") else []),
                *[f"<li><b>{esc(node_label(d['node'], rep))}</b> ({esc(d['op_type'])}, isolated output cosine "
                  f"{_fmt(d.get('isolated_cosine'), 6)}, SQNR {_fmt(d.get('isolated_sqnr_db'), 1)} dB"
                  f"{', mostly ' + esc(d['cause']) if d.get('cause') else ''}): {esc(d['advice'])}</li>"
                  for d in rep.get("diagnosis", [])], "</ul>"]
    out += ["<h2>Error along the network</h2>", depth_plot(layers)]
    sens = {s["node"]: s for s in rep.get("sensitivity", [])}
    if rep.get("most_sensitive_layers"):
        rows = []
        for n in rep["most_sensitive_layers"]:
            l = sens.get(n, {})
            iso, wo, ao = l.get("isolated") or {}, l.get("weight_only") or {}, l.get("activation_only") or {}
            rows.append([esc(node_label(n, rep)), esc(l.get("op_type")), _cos_cell(iso.get("cosine")),
                         _fmt(iso.get("sqnr_db"), 2),
                         _fmt(wo.get("cosine"), 6), _fmt(ao.get("cosine"), 6)])
        held = " held-out samples from --val_dir" if rep.get("sensitivity_held_out") else " samples"
        out += [f"<h2>Most sensitive layers (isolated, {esc(rep.get('sensitivity_samples'))}{held})</h2>",
                _table(["node", "op", "output cosine", "SQNR dB", "weights only", "activations only"], rows)]
    if rep.get("worst_layers"):
        out += ["<h2>Worst layers (cumulative)</h2>",
                _table(["node", "op", "cosine", "SQNR dB"],
                       [[esc(node_label(n, rep)), esc(by_node[n]["op_type"]), _cos_cell(by_node[n]["cosine"]),
                         _fmt(by_node[n]["sqnr_db"], 2)] for n in rep["worst_layers"] if n in by_node])]
    hists = rep.get("activation_histograms", {})
    if hists:
        out.append("<h2>Activation ranges of the worst layers</h2><p class=muted>log-count histogram of the "
                   "calibration data; dashed lines: the clip range chosen</p><div class=grid>")
        for t, h in hists.items():
            if "counts" in h:
                out.append(bar_plot(h["counts"], h["edges"][0], h["edges"][1], f"{t} → {h['node']}", h.get("clip")))
            else:
                out.append(f"<p>{esc(t)} → {esc(h['node'])}: range [{_fmt(h['min'])}, {_fmt(h['max'])}], "
                           f"clip {esc(h.get('clip'))} (histograms are kept by -A hist/mse/entropy/percentile)</p>")
        out.append("</div>")
    if rep.get("weight_spread"):
        out += ["<h2>Weight range spread</h2><p class=muted>max channel range / median channel range; "
                "large values hurt per-tensor weight quantization</p>",
                _table(["node", "channels", "spread"],
                       [[esc(w["node"]), w["channels"], _fmt(w["spread"], 2)] for w in rep["weight_spread"]])]
    skipped, more = kept_float(rep)
    if skipped:
        out += ["<h2>Nodes kept in float</h2>",
                _table(["node", "op", "reason"], [[esc(d["node"]), esc(d["op_type"]), esc(d["reason"])]
                                                  for d in skipped])]
        if more:
            out.append(f"<p class=muted>… and {more} more (report.json's decisions list every node)</p>")
    out.append("</body></html>")
    return "\n".join(out)
