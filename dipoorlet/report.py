"""The report: ``report.json`` (every number), ``report.md`` (tables for a terminal or a merge
request) and ``report.html`` (one self-contained page with plots, see :mod:`dipoorlet.report_html`)."""
from __future__ import annotations

import math

import numpy as np

from dipoorlet.util import nan_worst, write_json, write_text


def _num(x):
    if x is None:
        return None
    x = float(x)
    return None if not math.isfinite(x) else round(x, 6)


def _score(s):
    return None if s is None else {"cosine": _num(s.cosine), "sqnr_db": _num(s.sqnr_db),
                                   "max_abs_err": _num(s.max_abs_err)}


def worst(rows, k: int = 10):
    # a NaN cosine (a tensor gone NaN or Inf in the quantized model) is the worst of all
    return sorted((r for r in rows if not r.is_output), key=lambda r: nan_worst(r.cosine))[:k]


def _histograms(nodes, places, stats, plan, bins: int = 64, shifted=()) -> dict:
    """Activation histograms (folded to ``bins`` bins) of the inputs of ``nodes``. A shifted
    tensor (``shifted``: dipoorlet.shift's rows) is shown from its source's statistics moved by
    the shift, so the histogram and the clip are in the same units."""
    alias = {r["shifted"]: (r["tensor"], float(r["shift"])) for r in shifted}
    out = {}
    for node in nodes:
        for t, p in places.activations.items():
            src, d = alias.get(t, (t, 0.0))
            if node not in p.owners or t in out or src not in stats:
                continue
            st = stats[src]
            entry = {"node": node, "min": _num(st.minmax.lo + d), "max": _num(st.minmax.hi + d)}
            if t in plan.activations:
                entry["clip"] = [_num(plan.activations[t].lo), _num(plan.activations[t].hi)]
            if st.hist is not None:
                counts = st.hist.counts
                k = max(1, counts.size // bins)
                folded = counts[: counts.size // k * k].reshape(-1, k).sum(axis=1)
                entry["edges"] = [_num(st.hist.left + d), _num(st.hist.left + d + st.hist.width * k * folded.size)]
                entry["counts"] = folded.astype(int).tolist()
            out[t] = entry
    return out


def _output_distribution(cosines: dict, outputs: list[str], bins: int = 20) -> dict:
    dist = {}
    for t in outputs:
        cos = np.array([c for _, c, _ in cosines.get(t, [])], dtype=np.float64)
        cos = cos[np.isfinite(cos)]  # a model whose own output is NaN for a sample
        # a cosine rounds to 1 + 1 ulp now and then: np.histogram drops values past its range
        cos = np.clip(cos, -1.0, 1.0)
        if cos.size == 0:
            continue
        lo = float(min(cos.min(), 0.99))
        counts, edges = np.histogram(cos, bins=bins, range=(lo, 1.0))
        dist[t] = {"edges": [_num(e) for e in edges], "counts": counts.astype(int).tolist(),
                   "samples": int(cos.size)}
    return dist


def _lowest_sample(per_sample: list) -> dict:
    """The sample with the lowest output cosine and its float output's energy per value over the
    median sample's: a nearly empty output (a detector's map of a window without text) has a
    cosine that weighs the noise on near-zero values, which its SQNR, pooled by energy, does
    not. ``per_sample``: (sample, cosine, mean square of the float output)."""
    rows = [(c, i, e) for i, c, e in per_sample if math.isfinite(c) and math.isfinite(e)]
    if not rows:
        return {}
    c, i, e = min(rows)
    typical = float(np.median([r[2] for r in rows]))
    if not typical > 0:
        return {"min_cosine_sample": int(i)}
    full = [r[0] for r in rows if r[2] >= NEARLY_EMPTY * typical]
    return {"min_cosine_sample": int(i), "min_cosine_energy_ratio": float(f"{e / typical:.3g}"),
            "min_cosine_nearly_empty": bool(e < NEARLY_EMPTY * typical),
            "nearly_empty_samples": len(rows) - len(full),
            "cosine_without_nearly_empty": _num(sum(full) / len(full)) if full else None}


NEARLY_EMPTY = 0.01   # a sample whose float output's energy per value is under 1% of the median sample's


def output_label(o: dict, report: dict) -> str:
    """A network output's name in the report tables: ``*`` for a cosine over the samples
    together, "(not judged)" for one that --score_outputs (or the default, which leaves integer
    outputs out) does not judge."""
    judged = report.get("score_outputs")
    return (o["tensor"] + (" *" if o.get("cosine_over_samples") else "")
            + (" (not judged)" if judged and o["tensor"] not in judged else ""))


def lowest_cosine_notes(report: dict) -> list[str]:
    """One line per network output whose lowest per-sample cosine comes from a nearly empty
    output, so that a min cos of 0.02 is read for what it is."""
    notes = []
    for o in report["outputs"]:
        if o.get("min_cosine_nearly_empty"):
            rest = o.get("cosine_without_nearly_empty")
            k = o["nearly_empty_samples"]
            notes.append(f"{o['tensor']}: its min cos is sample {o['min_cosine_sample']}'s, whose float output "
                         f"carries {o['min_cosine_energy_ratio']:.2g}x the median sample's energy per value: nearly "
                         "empty, so that cosine measures the noise on near-zero values (the SQNR pools the "
                         "samples by their energy)"
                         + (f"; without the {k} nearly empty sample{'s' if k > 1 else ''}, mean cos {rest}"
                            if rest is not None else "")
                         + " (the table's mean and a --fail_below cosine count every sample; --fail_below sqnr:DB "
                           "gates on the pooled SQNR)")
    return notes


def clipped_summary(clipped: dict, k: int = 10) -> dict:
    """The quantized activations with values beyond their grid on the profile's samples, most
    clipped first."""
    hit = [(t, c, c.noise_ratio()) for t, c in clipped.items() if c.beyond]
    hit.sort(key=lambda tcr: (-tcr[2], -tcr[1].beyond))
    return {"tensors": len(clipped), "tensors_clipped": len(hit),
            **({"nan_values": sum(c.nan for c in clipped.values())} if any(c.nan for c in clipped.values()) else {}),
            "worst": [{"tensor": t, "fraction": c.beyond / c.total, "values": c.beyond,
                       "peak_over_range": _num(c.peak), "saturation_over_rounding_noise": _num(r)}
                      for t, c, r in hit[:k]]}


def build(rows, places, meta: dict, analysis: dict | None = None, stats=None, plan=None,
          output_cosines=None, clipped=None) -> dict:
    analysis = analysis or {}
    iso = {s.node: s for s in analysis.get("isolated", [])}
    layers = []
    for r in rows:
        if r.is_output:
            continue
        row = {"node": r.node, "op_type": r.op_type, "tensor": r.tensor, "cosine": _num(r.cosine),
               "min_cosine": _num(r.min_cosine), "sqnr_db": _num(r.sqnr_db), "max_abs_err": _num(r.max_abs_err)}
        if r.node in iso:
            s = iso[r.node]
            row["isolated"] = _score(s.isolated)
            if s.weight_only is not None:
                row["weight_only"] = _score(s.weight_only)
                row["activation_only"] = _score(s.activation_only)
        layers.append(row)
    worst_nodes = [r.node for r in worst(rows)]
    rep = {
        **meta,
        "outputs": [{"tensor": r.tensor, "cosine": _num(r.cosine), "min_cosine": _num(r.min_cosine),
                     "sqnr_db": _num(r.sqnr_db), "max_abs_err": _num(r.max_abs_err),
                     **({"cosine_over_samples": True} if r.pooled else {}),
                     **({"resized_samples": r.resized} if r.resized else {})}
                    for r in rows if r.is_output],
        "layers": layers,
        "worst_layers": worst_nodes,
        # ranked as --criterion ranks them (the weight/activation split went to those), NaN first
        "most_sensitive_layers": [s.node for s in sorted(iso.values(),
                                                          key=lambda s: s.isolated.rank(analysis.get("criterion",
                                                                                                     "cosine")))[:10]],
        "sensitivity": [{"node": s.node, "op_type": s.op_type, "isolated": _score(s.isolated),
                         "weight_only": _score(s.weight_only), "activation_only": _score(s.activation_only)}
                        for s in iso.values()],
        "weight_spread": analysis.get("weight_spread", [])[:10],
        "decisions": [{"node": d.node, "op_type": d.op_type, "quantized": d.quantized, "reason": d.reason}
                      for d in places.decisions],
    }
    if "sens_samples" in analysis:
        rep["sensitivity_samples"] = analysis["sens_samples"]
        rep["sensitivity_held_out"] = bool(analysis.get("sens_held_out"))
        if analysis.get("sens_scored_on"):
            rep["sensitivity_scored_on"] = analysis["sens_scored_on"]   # output -> the logits scored
    if "bias_correction" in analysis:
        rep["bias_correction"] = analysis["bias_correction"]
    for key in ("gptq", "adaround", "sparse", "brecq", "qdrop"):
        if key in analysis:
            rep[key] = analysis[key]
    if "equalization" in analysis:
        rep["equalization"] = analysis["equalization"]
    if "shift" in analysis:
        rep["shift"] = analysis["shift"]
    if analysis.get("diagnosis"):
        rep["diagnosis"] = analysis["diagnosis"]
    if analysis.get("error_spread"):
        rep["error_spread"] = analysis["error_spread"]
    a = analysis.get("auto_skip")
    if a is not None:
        rep["auto_skip"] = {"criterion": a.criterion, "target": a.target, "met": a.met,
                            "float_layers": a.float_layers, "before": _score(a.before),
                            "after": _score(a.after), "steps": a.steps}
    for kind, layers in (("auto_a16", "a16_layers"), ("auto_w8", "w8_layers")):
        a = analysis.get(kind)
        if a is not None:
            # before/after_estimated and the steps are the search's trials; after_measured and the
            # outputs table above measure the model as written
            rep[kind] = {"criterion": a.criterion, "target": a.target, "met": a.met,
                         layers: a.float_layers, "before": _score(a.before),
                         "after_estimated": _score(a.after),
                         **({"after_measured": _score(a.measured)} if a.measured is not None else {}),
                         "steps": a.steps}
    if stats is not None and plan is not None:
        focus = list(dict.fromkeys(rep["most_sensitive_layers"][:5] + worst_nodes[:5]))
        rep["activation_histograms"] = _histograms(focus, places, stats, plan,
                                                   shifted=analysis.get("shift", ()))
    if clipped is not None:
        rep["clipped"] = clipped_summary(clipped)
    if output_cosines is not None:
        for o in rep["outputs"]:
            if not o.get("cosine_over_samples"):
                o.update(_lowest_sample(output_cosines.get(o["tensor"], [])))
        # a single-value output's per-sample cosines are all +-1: no distribution to show
        rep["output_distribution"] = _output_distribution(
            output_cosines, [o["tensor"] for o in rep["outputs"] if not o.get("cosine_over_samples")])
    return rep


def table(headers, body) -> str:
    # a '|' inside a cell ends it in every Markdown table renderer (the header "max |err|" turned
    # GitHub's rendering of the outputs table into a paragraph of pipes)
    # (a line break, legal in an ONNX name, split its row in two: written as \n)
    cell = lambda c: "-" if c is None else str(c).replace("|", "\\|").replace("\r", "\\r").replace("\n", "\\n")
    cells = [list(map(cell, headers))] + [[cell(c) for c in row] for row in body]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), sep] + [fmt(r) for r in cells[1:]])


def _iso(layer, key="isolated"):
    s = layer.get(key)
    return (s["cosine"], s["sqnr_db"]) if s else (None, None)


def node_label(n: str, report: dict) -> str:
    """A node as the tables show it: with its torch module where a dynamo export recorded one
    (``node_MatMul_85 (m.encoder.layer.0.intermediate.dense)``)."""
    m = report.get("torch_modules", {}).get(n)
    return f"{n} ({m})" if m else n


def markdown(report: dict) -> str:
    qop_note = format_note(report)
    out = [f"# dipoorlet report: {report['model']}", "",
           f"platform `{report['platform']}`, method `{report['method']}`, {report['samples']} samples"
           + profile_note(report) + ", "
           f"{report['quantized_nodes']} quantized nodes, {report['qdq_tensors']} Q/DQ activations"
           + (f" ({report['qdq_tensors_16bit']} on 16-bit grids)" if report.get('qdq_tensors_16bit') else ""), "",
           *([qop_note, ""] if qop_note else []),
           *([float_weights_note(report), ""] if float_weights_note(report) else []),
           *([shared_grid_note(report), ""] if shared_grid_note(report) else []),
           "## Network outputs", "",
           table(["output", "mean cosine", "min cosine", "SQNR dB", "max |err|"],
                 [[output_label(o, report), o["cosine"], o["min_cosine"],
                   o["sqnr_db"], o["max_abs_err"]] for o in report["outputs"]])]
    if any(o.get("cosine_over_samples") for o in report["outputs"]):
        out += ["", "\\* fewer than 8 values per sample: one cosine over all samples' values together "
                "(a single value's own cosine is always 1, two logits' nearly a sign check)"]
    notes = lowest_cosine_notes(report)
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    out += _clipped_section(report)
    out += _transforms(report)
    layers = {l["node"]: l for l in report["layers"]}
    if report["worst_layers"]:
        out += ["", "## 10 worst layers (cumulative: everything upstream quantized)", "",
                table(["node", "op", "cosine", "SQNR dB", "isolated cosine"],
                      [[node_label(n, report), layers[n]["op_type"], layers[n]["cosine"], layers[n]["sqnr_db"],
                        _iso(layers[n])[0]] for n in report["worst_layers"]])]
    sens = {s["node"]: s for s in report.get("sensitivity", [])}
    if report.get("most_sensitive_layers"):
        body = []
        for n in report["most_sensitive_layers"]:
            l = sens.get(n, {})
            body.append([node_label(n, report), l.get("op_type"), *_iso(l), _iso(l, "weight_only")[0],
                         _iso(l, "activation_only")[0]])
        out += ["", f"## 10 most sensitive layers (isolated: only this layer quantized, effect at the "
                f"output, {report.get('sensitivity_samples')} "
                f"{'held-out samples from --val_dir' if report.get('sensitivity_held_out') else 'samples'})", "",
                table(["node", "op", "output cosine", "SQNR dB", "weights only", "activations only"], body)]
    if report.get("diagnosis") or report.get("error_spread"):
        out += ["", "## What limits accuracy, and what to do", ""]
        if report.get("error_spread"):
            out.append(f"- **spread over many layers**: {report['error_spread']['advice']}")
        for d in report.get("diagnosis", []):
            cause = f", mostly {d['cause']}" if d.get("cause") else ""
            out.append(f"- **{node_label(d['node'], report)}** ({d['op_type']}, isolated output cosine {d['isolated_cosine']:.6f}, "
                       f"SQNR {d['isolated_sqnr_db']:.1f} dB{cause}): {d['advice']}")
    if report.get("weight_spread"):
        out += ["", "## Weight range spread (max channel / median channel; large = per-tensor hurts)", "",
                table(["node", "channels", "spread"],
                      [[w["node"], w["channels"], round(w["spread"], 2)] for w in report["weight_spread"]])]
    a = report.get("auto_skip")
    if a:
        out += _auto_section("auto_skip", a, "", "kept in float", a["float_layers"], a["after"], "")
    a = report.get("auto_a16")
    if a:
        after, note = a16_figure(a)
        out += _auto_section("auto_a16", a, ", as written" if a.get("after_measured") else ", estimated by the search",
                             "inputs on 16-bit grids", a["a16_layers"], after, note)
    a = report.get("auto_w8")
    if a:
        out += _auto_section("auto_w8", a, ", as written", "weights on 8-bit grids", a["w8_layers"],
                             a.get("after_measured") or a["after_estimated"], "")
    skipped, more = kept_float(report)
    if skipped:
        out += ["", "## Nodes kept in float, and why", "",
                table(["node", "op", "reason"], [[d["node"], d["op_type"], d["reason"]] for d in skipped])]
        if more:
            out += ["", f"… and {more} more (report.json's decisions list every node)"]
    return "\n".join(out) + "\n"


def float_weights_note(report: dict) -> str | None:
    """A line on the weight parameters left float where they are 1% or more of all: which ops
    hold them (a GRU the backend does not quantize, a skipped Conv, an embedding table)."""
    w = report.get("weight_parameters") or {}
    total = w.get("quantized", 0) + w.get("float", 0)
    if not total or w["float"] < 0.01 * total:
        return None
    parts = []
    for op, row in list(w["float_by_op"].items())[:4]:
        nodes = row["nodes"]
        parts.append(f"{op} {row['parameters']:,} ({', '.join(nodes[:2])}{' …' if len(nodes) > 2 else ''})")
    more = len(w["float_by_op"]) - 4
    return (f"Weights kept float: {w['float']:,} of {total:,} parameters ({100 * w['float'] / total:.0f}%): "
            + "; ".join(parts) + (f"; {more} more op types" if more > 0 else "")
            + " (why: report.json's decisions)")


def shared_grid_note(report: dict) -> str | None:
    """A line on the tensors a shared grid (Concat, pass-through ops) leaves few steps: the
    network output's cosine can hide them where a wider member dominates it."""
    losses = report.get("shared_grid_losses") or {}
    if not losses:
        return None
    parts = [f"{t} ({v['own'][0]:.4g}..{v['own'][1]:.4g} uses {v['steps']:.1f} of the {2 ** v['bits'] - 1} steps "
             f"of {v['grid'][0]:.4g}..{v['grid'][1]:.4g}, tied by {', '.join(v['tied_by'][:2])})"
             for t, v in list(losses.items())[:3]]
    nodes = list(dict.fromkeys(n for v in losses.values() for n in v["tied_by"]))
    return ("Shared grids far wider than their tensors' values: " + "; ".join(parts)
            + (f"; {len(losses) - 3} more in report.json" if len(losses) > 3 else "")
            + f" (--skip_layers {' '.join(nodes[:4])} gives each its own grid)")


def format_note(report: dict) -> str | None:
    """What --quant_format QOP wrote, in words (None for a QDQ run)."""
    q = report.get("quant_format")
    if not q:
        return None
    if q.get("format") != "QOP":
        return f"quant_model.onnx is the QDQ model: the QOperator conversion failed ({q.get('why')})"
    cos = q.get("cosine_to_qdq_first_sample")
    if not q.get("converted_ops"):
        return ("quant_model.onnx holds no QLinear op (--quant_format QOP converted none here): it is the QDQ "
                "model, which the figures here measure, simulated")
    return (f"quant_model.onnx is in QOperator form ({q['converted_ops']} ops as QLinear ops, {q['qdq_left']} still "
            f"reading Q/DQ); the figures here measure quant_model_qdq.onnx, simulated (Q/DQ as float), which onnxruntime's "
            f"integer kernels follow to within their rounding"
            + (f" (output cosine QOP to QDQ on the first calibration sample: {cos})" if cos is not None else ""))


def profile_note(report: dict) -> str:
    """" (error profile over ...)" where the profile did not read all the calibration samples, else ""."""
    if report.get("profile_data"):
        return f" (error profile over {profile_source(report)})"
    if report.get("profile_samples", report["samples"]) < report["samples"]:
        return f" (error profile over {report['profile_samples']} of them, spread evenly)"
    return ""


def profile_source(report: dict) -> str:
    """Which samples the profile read, in words."""
    if report.get("profile_data"):
        return f"{report['profile_samples']} held-out samples from --val_dir {report['profile_data']}"
    return f"{report.get('profile_samples', report['samples'])} calibration samples"


def _clipped_section(report: dict) -> list[str]:
    c = report.get("clipped")
    if not c:
        return []
    head = ["", f"## Values beyond the calibrated ranges ({profile_source(report)})", ""]
    if not c["tensors_clipped"]:
        return head + [f"None of the {c['tensors']} quantized activations saturated."]
    note = ("Values beyond a range saturate in deployment. Some is by design (-A hist/mse/entropy/percentile "
            "clip rare tails to refine the grid, and a tensor after quantized layers overshoots its float "
            "range by their error), but many here, and few with --val_dir pointed at the calibration samples, "
            "mean the calibration data does not cover these inputs: calibrate on samples like them (add them "
            "to -I).")
    return head + [f"{c['tensors_clipped']} of {c['tensors']} quantized activations have values beyond their grid. "
                   + note, "",
                   table(["tensor", "values beyond", "fraction", "largest / range edge",
                          "saturation / rounding noise"],
                         [[w["tensor"], w["values"], f"{w['fraction']:.3g}", w["peak_over_range"],
                           w["saturation_over_rounding_noise"]] for w in c["worst"]]),
                   "", "Saturation / rounding noise: the squared error of the saturated values per value, "
                   "over the grid's own rounding noise (step² / 12); above 1 they cost more than the "
                   "rounding of everything else."]


def _auto_section(name, a, how, label, layers, after, note) -> list[str]:
    """The markdown lines of an --auto_skip / --auto_a16 / --auto_w8 result, with one row per trial."""
    lines = ["", f"## {name}: target {a['criterion']} ≥ {a['target']} ({'met' if a['met'] else 'NOT met'}{how})", "",
             f"{label}: {', '.join(layers) or 'none'}; output cosine {a['before']['cosine']} → {after['cosine']}, "
             f"SQNR {a['before']['sqnr_db']} → {after['sqnr_db']} dB{note}"]
    head, rows = auto_trials(name, a)
    if rows:
        lines += ["", table(head, rows)]
    return lines


def a16_figure(a: dict) -> tuple[dict, str]:
    """The --auto_a16 score shown with its verdict, which is the written model's where it was
    measured (as --auto_w8's), and a note giving the search's estimate beside it."""
    est = a["after_estimated"]
    if not a.get("after_measured"):
        return est, ""
    return a["after_measured"], f" (the search estimated {est['cosine']} / {est['sqnr_db']} dB)"


def auto_trials(name: str, a: dict) -> tuple[list, list]:
    """The trial table of an --auto_skip / --auto_a16 / --auto_w8 result: headers and rows."""
    r = lambda v, k: None if v is None else round(v, k)
    steps = a.get("steps") or []
    if name == "auto_skip":
        return (["step", "layer tried in float", "output cosine", "SQNR dB", "kept float"],
                [[i + 1, s["float_layer"], r(s["cosine"], 6), r(s["sqnr_db"], 2), "yes" if s.get("kept") else "no gain"]
                 for i, s in enumerate(steps)])
    key, what = ("a16_layers", "most sensitive layers at 16 bits") if name == "auto_a16" else \
        ("w8_layers", "most sensitive layers with 8-bit weights")
    return (["trial", what, "output cosine", "SQNR dB"],
            [[i + 1, s.get(key), r(s["cosine"], 6), r(s["sqnr_db"], 2)] for i, s in enumerate(steps)])


KEPT_FLOAT_ROWS = 200     # report.md / report.html list at most this many float nodes (report.json all)


def kept_float(report: dict) -> tuple[list, int]:
    """The nodes kept float for a reason the reader can act on (not "not quantized on <backend>"),
    at most KEPT_FLOAT_ROWS, and how many more there are."""
    skipped = [d for d in report.get("decisions", []) if not d["quantized"] and "not quantized on" not in d["reason"]]
    return skipped[:KEPT_FLOAT_ROWS], max(0, len(skipped) - KEPT_FLOAT_ROWS)


def _transforms(report: dict) -> list[str]:
    """What the weight transforms changed (the float graph they give is transformed_model.onnx)."""
    lines = []
    eq = report.get("equalization") or []
    pairs = [r for r in eq if "producer" in r]
    smooth = [r for r in eq if "producer" not in r]
    if pairs:
        kind = ("weight equalization (data-free, per-tensor weights)" if all("method" in r for r in pairs)
                else "equalization")
        lines.append(f"- {kind}: {len(pairs)} producer/consumer pairs rescaled ("
                     + ", ".join(f"{r['producer']} → {', '.join(r['absorbers'])}" for r in pairs[:5])
                     + (" …" if len(pairs) > 5 else "") + ")")
    if smooth:
        lines.append(f"- input smoothing: {len(smooth)} MatMul/Conv inputs ("
                     + ", ".join(r["tensor"] for r in smooth[:5]) + (" …" if len(smooth) > 5 else "") + ")")
    shift = report.get("shift") or []
    if shift:
        lines.append(f"- activation shift onto the asymmetric grid: {len(shift)} tensor{'s' * (len(shift) != 1)} ("
                     + ", ".join(f"{r['tensor']} {r['step_ratio']:.2f}x finer" for r in shift[:5])
                     + (" …" if len(shift) > 5 else "") + "; `--no_shift` turns it off)")
    bc = report.get("bias_correction") or {}
    if bc.get("layers"):
        lines.append(f"- bias correction: {bc['layers']} layers over {bc.get('samples', '?')} samples "
                     "(`--no_bc` turns it off)")
    sp = report.get("sparse") or {}
    if sp.get("pattern"):
        worst = sorted((r for r in sp.get("gain_db") or [] if r.get("db") is not None), key=lambda r: r["db"])
        lines.append(f"- sparse {sp['pattern']}: {sp['layers']} layers pruned as they were rounded (SparseGPT), "
                     f"{len(sp.get('magnitude') or [])} by magnitude, {len(sp.get('skipped') or {})} left dense; "
                     f"{100 * sp.get('zero_fraction', 0):.1f}% of their weights zero"
                     + (" (output error added against dense rounding: " + ", ".join(
                         f"{r['node']} {-r['db']:.1f} dB" for r in worst[:5]) + ")" if worst else ""))
    br = report.get("brecq") or report.get("qdrop") or {}
    if br.get("candidates"):
        kept = [r for r in br.get("block_loss") or [] if r.get("kept") and r.get("loss_db") is not None]
        lines.append(f"- {'qdrop' if br.get('drop') else 'brecq'}: {br['layers']} of {br['candidates']} layers "
                     f"re-rounded in {sum(1 for r in br.get('block_loss') or [] if r.get('kept'))} of {br['blocks']} "
                     f"blocks, {br.get('iters', '?')} steps each over {br.get('samples', '?')} samples"
                     + (f" (block output error on them: median {float(np.median([r['loss_db'] for r in kept])):.1f} dB)"
                        if kept else "")
                     + (f"; {len(br['skipped'])} left alone" if br.get("skipped") else "")
                     + (f"; {br['lsq']['learned']} of {br['lsq']['grids']} activation scales learned (x"
                        f"{br['lsq']['scale_ratio'][0]:.3g}-{br['lsq']['scale_ratio'][2]:.3g})"
                        if (br.get("lsq") or {}).get("learned") else ""))
    key = "adaround" if report.get("adaround") else "gptq"
    gq = report.get(key) or {}
    if gq.get("candidates"):
        best = [r for r in gq.get("gain_db") or [] if r.get("db") is not None]
        lines.append(f"- {key}: {gq['layers']} of {gq['candidates']} candidate layers re-rounded over {gq.get('samples', '?')} "
                     "samples (layer output error on the calibration data"
                     + (": " + ", ".join(f"{r['node']} −{r['db']:.1f} dB" for r in best[:5]) if best else "")
                     + (" …" if len(best) > 5 else "") + ")"
                     + (f"; {len(gq['skipped'])} other layers left alone (not candidates: report.json says why)"
                        if gq.get("skipped") else ""))
    for k in ("gptq", "adaround", "brecq", "qdrop"):
        check = (report.get(k) or {}).get("network_output")
        if check:
            from dipoorlet.pipeline import fit_lost

            fit, near = check["fitted"]["sqnr_db"], check["nearest"]["sqnr_db"]
            lines.append(f"- {k} at the network output over {check['samples']} sensitivity samples: SQNR {fit:.2f} dB, "
                         f"against {near:.2f} dB with nearest rounding; worse on {check['worse_samples']} of them"
                         + (" (the fit helped each layer, not the model)" if fit_lost(check) else ""))
    if not lines:
        return []
    return ["", "## Transforms applied (their float graph: transformed_model.onnx)", "", *lines]


def write(folder, report: dict) -> list:
    from dipoorlet.report_html import html

    return [write_json(folder / "report.json", report), write_text(folder / "report.md", markdown(report)),
            write_text(folder / "report.html", html(report))]
