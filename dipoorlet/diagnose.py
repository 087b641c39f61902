"""Why the most sensitive layers lose accuracy, and what a user can do about each.

The isolated sensitivity (:mod:`dipoorlet.sensitivity`) ranks layers and splits the worst into
weight-only and activation-only error. This module turns that into a diagnosis per layer:

* **activations** dominate: the quantized input's per-channel ranges (max |x| per channel over
  the sensitivity samples, reduced inside the graph) and their spread (widest channel over the
  median one) under one per-tensor scale; whether equalization could have evened them out, and if
  not, the op that blocks it (a HardSwish, an Add, a Concat between the producing layer and this
  one); the remedy is keeping the layer float (``--skip_layers``; TensorRT then runs it in FP16).
* **weights** dominate: the SQNR of the layer's weights on their int8 grid; the remedy is output-aware
  rounding (``--gptq``, :mod:`dipoorlet.reconstruct`) or keeping the layer float.

Cost: one pass over the sensitivity samples for the activation channel ranges of at most
:data:`DIAGNOSE_LAYERS` layers.
"""
from __future__ import annotations

import math

import numpy as np

from dipoorlet.graph import node_attr
from dipoorlet.util import sqnr_db

DIAGNOSE_LAYERS = 5
MIN_LOSS = 1e-4          # layers whose isolated output cosine is above 1 - MIN_LOSS are fine


def _channels(g, node, tensor: str) -> tuple[list[int] | None, int] | None:
    """(reduced axes, channels) of ``tensor`` as ``node`` reads it; axes None: channels last."""
    shape = g.shape(tensor)
    if node.op_type in ("Conv", "ConvTranspose") and g.is_constant(node.input[1]) and node.input[0] == tensor:
        w = g.weight(node.input[1]).shape
        c = w[1] * int(node_attr(node, "group", 1)) if node.op_type == "Conv" else w[0]
        if shape is not None and len(shape) >= 3:
            return [0] + list(range(2, len(shape))), int(c)
        return None
    if node.op_type == "MatMul" and node.input[0] == tensor and g.is_constant(node.input[1]):
        w = g.weight(node.input[1]).shape
        return (None, int(w[0])) if len(w) == 2 else None
    if node.op_type == "Gemm" and node.input[0] == tensor and shape is not None and len(shape) == 2:
        # A is [M, K] (transA: [K, M]): its K input channels, as the weight reads them (without
        # them, clipping on held-out data was told as rounding at a classifier's head)
        if node_attr(node, "transA", 0):
            return ([1], int(shape[0])) if isinstance(shape[0], int) and shape[0] > 0 else None
        return (None, int(shape[1])) if isinstance(shape[1], int) and shape[1] > 0 else None
    if shape is not None and len(shape) >= 3 and isinstance(shape[1], int) and shape[1] > 0:
        return [0] + list(range(2, len(shape))), int(shape[1])    # NCHW ops: pooling, Add
    if shape is not None and len(shape) == 2 and isinstance(shape[1], int) and shape[1] > 0:
        return [0], int(shape[1])        # [N, C]: a recurrent cell's state, a head's features
    return None


def _blocker(g, tensor: str, depth: int = 8):
    """How equalization relates to ``tensor``: ("reachable", conv) when a walk up through ops
    that commute with a per-channel scale meets a Conv, ("blocked", node) at the first op that
    does not, ("smoothed", mul) for a MatMul input smoothing made, or ("input", None)."""
    from dipoorlet.equalize import PASS_THROUGH

    t = tensor
    for _ in range(depth):
        prod = g.producer.get(t)
        if prod is None:
            return "input", None
        if prod.op_type == "Conv":
            return "reachable", prod
        if prod.op_type == "Mul" and prod.name.endswith("_smooth_Mul"):
            return "smoothed", prod
        if prod.op_type == "Add" and "_shift_Add" in prod.name:          # dipoorlet.shift (or _shift_Add_1…)
            t = prod.input[0]
            continue
        if prod.op_type in PASS_THROUGH or prod.op_type == "Pad" or _by_positive_scalar(g, prod):
            t = prod.input[0]
            continue
        return "blocked", prod
    return "blocked", g.producer.get(t)


def _smoothing_note(smooth: bool) -> str:
    if not smooth:
        return "input smoothing is off: this platform quantizes the Mul it inserts"
    return ("input smoothing (the scale moved into this Conv's weights) did not apply: estimated to "
            "gain under 3 dB, or the Conv is excluded (shared weight, a Pad before it, part of a Conv "
            "pair, --skip_layers)")


def _by_positive_scalar(g, node) -> bool:
    """Mul or Div of a tensor by a positive scalar constant (commutes with a channel scale)."""
    if node.op_type not in ("Mul", "Div") or len(node.input) != 2 or not g.is_constant(node.input[1]):
        return False
    v = np.asarray(g.weight(node.input[1]))
    return v.size == 1 and float(v.ravel()[0]) > 0


def _describe(g, node) -> str:
    """A blocking op in words: ``x * f(x)`` gates (HardSwish, Swish exported as Mul) by name."""
    if node.op_type == "Mul" and len(node.input) == 2:
        makers = {g.producer[i].op_type for i in node.input if i in g.producer}
        if makers & {"Clip", "HardSigmoid", "Sigmoid", "Relu"}:
            return f"a HardSwish/Swish-style gate (x * f(x), {node.op_type} {node.name})"
    return f"{node.op_type} {node.name}"


def _is_weight(g, wp) -> bool:
    """A layer's weight input (index 1, or 0 for MatMul(W, x)), not a Conv/Gemm bias."""
    from dipoorlet.placement import left_weight

    return wp.index == 1 or left_weight(g, g.node_by_name[wp.node], wp.index)


def _weight_sqnr(g, places, plan, node: str) -> float | None:
    from dipoorlet.qparams import dequantize_array, quantize_array

    for wp in places.weights.values():
        if wp.node != node or not _is_weight(g, wp) or wp.tensor not in plan.weights:
            continue
        w = g.weight(wp.tensor).astype(np.float64)
        qp = plan.weights[wp.tensor]
        w_hat = dequantize_array(quantize_array(w, qp), qp)
        err = float(((w - w_hat) ** 2).sum())
        sig = float((w ** 2).sum())
        return sqnr_db(sig, err, no_signal=None)
    return None


def _per_tensor_weight_spread(g, places, plan, node: str) -> float | None:
    """The channel-range spread of ``node``'s weight when the platform quantizes it per tensor
    (one grid for all channels), else None."""
    from dipoorlet.sensitivity import channel_ranges, spread_of

    for wp in places.weights.values():
        if wp.node != node or wp.index != 1 or wp.tensor not in plan.weights or plan.weights[wp.tensor].axis is not None:
            continue
        amax = channel_ranges(g.node_by_name[node], g.weight(wp.tensor).astype(np.float64))
        spread = spread_of(amax) if amax is not None else None
        return spread if spread is not None and math.isfinite(spread) else None
    return None


def diagnose(g, places, plan, isolated, data, indices, comm, device="cpu", equalize_on=True,
             equalized=(), smooth=True, k: int = DIAGNOSE_LAYERS, shifted=(), platform: str = "trt",
             samples: int | None = None, gptq=(), method: str | None = None,
             gptq_ran: bool = False, max_act_bits: int = 8, rounding: str = "--gptq", sparse: dict | None = None,
             sparse_pattern: str | None = None, promoted=(), deferred: str | None = None,
             held_out: bool = False, floated=(), unfit=None, calibration=None, criterion: str = "cosine",
             bc_ran: bool = False, a16=None, asked_a: dict | None = None,
             calib_n: int | None = None) -> list[dict]:
    """One row per layer among the ``k`` most sensitive that lose more than ``MIN_LOSS``, leaving
    out ``floated`` (the layers --auto_skip kept float: they limit nothing in the written model).
    ``shifted``: dipoorlet.shift's rows; a shifted input is described by its source tensor (its
    channel ranges and its clip on the asymmetric grid), not by the shifted copy.
    ``calibration``: the calibration statistics by tensor (their ranges: the largest value the
    calibration data holds, against what held-out samples reach). ``calib_n``: the calibration
    samples (-N), which a suggested --gptq would fit."""
    source = {r["shifted"]: r for r in shifted}
    from dipoorlet.equalize import channel_stats

    floated = set(floated)
    # ranked by --criterion, NaN first; a layer losing under MIN_LOSS of cosine needs no advice
    worst = [s for s in sorted((s for s in isolated if s.node not in floated),
                               key=lambda s: s.isolated.rank(criterion))[:k]
             if not s.isolated.cosine >= 1 - MIN_LOSS]
    if not worst:
        return []
    inputs: dict[str, list[str]] = {}
    for t, p in places.activations.items():
        if t not in plan.activations:
            continue
        for owner in dict.fromkeys(p.owners):
            inputs.setdefault(owner, []).append(t)
    # a network output quantized in place belongs to its producer's grids (qnn, snpe: a state
    # output that held-out samples clip was told as its input's rounding, and the a16 advice on
    # it changed nothing)
    owned_outputs = set()
    for t, owner in places.output_owners.items():
        p = places.activations.get(t)
        if p is not None and p.output and t in plan.activations and t not in inputs.get(owner, []):
            inputs.setdefault(owner, []).append(t)
            owned_outputs.add(t)
    items, seen = [], set()
    for s in worst:
        node = g.node_by_name[s.node]
        for t in inputs.get(s.node, []):
            m = source[t]["tensor"] if t in source else t
            ch = _channels(g, node, t)
            if ch is not None and m not in seen:
                seen.add(m)
                items.append((m, ch[0], ch[1]))
    ranges = channel_stats(g, items, data, indices, comm, device, label="diagnosis: channel ranges") if items else {}
    # the channel ranges come from the sensitivity samples (``samples`` over all processes,
    # ``indices`` this one's share), the clip from all N: say so
    n_samples = samples if samples is not None else len(list(indices))
    # the nodes whose output a pair rescaled (a Conv, or an affine Mul/Add): an input reached from
    # one of them is equalized; one reached from a pair's absorber only is not (its input side was
    # rescaled; "already equalized" had been said there, found by a bug hunt)
    rescaled = {r["producer"] for r in equalized if r.get("producer")}
    folded = {r["tensor"]: r["folded_into"] for r in equalized if r.get("folded_into")}
    from dipoorlet.equalize import matmul_targets
    from dipoorlet.sensitivity import grid_copies, grid_partners

    smoothable = matmul_targets(g) if smooth else {}

    copies = grid_copies(g, places, plan)           # B -> (A, c): B's grid is A's times c
    copied = {}
    for b, (a, c) in copies.items():
        copied.setdefault(a, (b, c))
    partners = grid_partners(g, places, plan)
    rows = []
    for s in worst:
        row = {"node": s.node, "op_type": s.op_type, "isolated_cosine": s.isolated.cosine,
               "isolated_sqnr_db": s.isolated.sqnr_db}
        if s.weight_only is not None and s.activation_only is not None:
            # a NaN score is the worst: the activations alone turning the output NaN blame them,
            # not the weights (a weightless Sigmoid was told "weight rounding dominates")
            a_db, w_db = s.activation_only.sqnr_db, s.weight_only.sqnr_db
            if a_db != a_db or w_db != w_db:
                row["cause"] = "activations" if a_db != a_db else "weights"
            else:
                row["cause"] = "activations" if a_db < w_db else "weights"
        acts = []
        for t in inputs.get(s.node, []):
            a = {"tensor": t, "amax": float(np.max(plan.activations[t].amax)), "bits": int(plan.activations[t].bits),
                 "step": float(np.max(plan.activations[t].scale))}
            if plan.shared.get(t):
                a["grid_shared_by"] = int(plan.shared[t])
            m = t
            if t in source:
                m = a["shifted_from"] = source[t]["tensor"]
                a["clip"] = [float(v) for v in source[t]["clip"]]
            st = (calibration or {}).get(m)
            if st is not None and math.isfinite(st.minmax.lo) and math.isfinite(st.minmax.hi):
                a["calibration_max"] = max(abs(st.minmax.lo), abs(st.minmax.hi))
            lo = float(np.min(plan.activations[t].lo))
            if st is not None and st.floor is not None and lo >= st.floor - 1e-6 * max(abs(st.floor), 1.0) \
                    and st.minmax.lo < lo:
                # a Softmax input's grid starts at its floor on purpose: below it a value weighs
                # nothing, and its channel maxima are the mask's (3.4e38; found by a hunt)
                a["softmax_floor"] = [lo, float(np.max(plan.activations[t].hi))]
            elif m in ranges:
                r = ranges[m][0]
                live = r[r > 0]
                if live.size:
                    a["channel_max"] = float(live.max())
                    a["channel_spread"] = float(live.max() / np.median(live))
                    a["channel_samples"] = n_samples
                    a["channel_held_out"] = held_out
            if t in copies:
                a["grid_copy_of"], a["grid_factor"] = copies[t]
                a["grid_via"] = g.producer[t].op_type
            elif t in copied:
                a["grid_copied_to"], a["grid_factor"] = copied[t]
                a["grid_via"] = g.producer[copied[t][0]].op_type
            if t in owned_outputs:
                a["output"] = True       # its own output's grid: equalization is about inputs
                acts.append(a)
                continue
            kind, via = _blocker(g, t)
            node = g.node_by_name[s.node]
            conv_input = node.op_type == "Conv" and node.input[0] == t and g.is_constant(node.input[1])
            matmul_input = (node.op_type in ("MatMul", "Gemm") and node.input[0] == t and g.is_constant(node.input[1])
                            and len(g.weight(node.input[1]).shape) == 2)
            if not equalize_on and any(r.get("method") == "weight ranges (data-free)" for r in equalized):
                a["equalization"] = ("activation ranges are not equalized on per-tensor-weight platforms "
                                     "(the weights' channel ranges were equalized instead)")
            elif not equalize_on:
                a["equalization"] = "off for this platform or by --no_equalize"
            elif kind == "smoothed":
                a["equalization"] = "already smoothed (a per-channel input scale moved into the weights)"
            elif t in folded:
                a["equalization"] = f"already smoothed (the per-channel scale went into {folded[t]})"
            elif matmul_input:
                a["equalization"] = (
                    "MatMul input smoothing is off: this platform quantizes the Mul it would insert, and the op "
                    "making this input cannot take the scale (a Mul by a per-channel constant or a "
                    "LayerNormalization that only these layers read)" if not smooth else
                    "MatMul input smoothing estimated to gain under 3 dB" if s.node in smoothable.get(t, ()) else
                    "MatMul input smoothing does not apply: the weight is not this MatMul's own (another layer "
                    "reads it) or not a float32 2-D initializer")
            elif kind == "reachable":
                a["equalization"] = ("already equalized" if via.name in rescaled else
                                     f"reachable from {via.name} but not equalized: estimated to gain under 3 dB, "
                                     f"or the pair does not qualify ({via.name}'s weight or bias shared, its output "
                                     "read by an op that is not a Conv of its own or does not commute with a channel "
                                     "scale, or a graph output)")
            elif kind == "blocked" and via.name in rescaled:
                # equalization rescaled it after all (an Add whose scalar constant it made per
                # channel, PP-LCNet's affine blocks): "blocked by" it was false (found by a hunt)
                a["equalization"] = "already equalized"
            elif kind == "blocked":
                a["equalization"] = f"blocked by {_describe(g, via)}, which does not commute with a channel scale"
                if conv_input:
                    a["equalization"] += "; " + _smoothing_note(smooth)
            else:
                a["equalization"] = "a network input: nothing upstream to take a scale"
                if conv_input:
                    a["equalization"] += "; " + _smoothing_note(smooth)
            acts.append(a)
        row["activations"] = acts
        if partners.get(s.node):
            row["grid_partners"] = list(partners[s.node])
        wsq = _weight_sqnr(g, places, plan, s.node)
        if wsq is not None:
            row["weight_sqnr_db"] = wsq
        wbits = next((plan.weights[wp.tensor].bits for wp in places.weights.values()
                      if wp.node == s.node and _is_weight(g, wp) and wp.tensor in plan.weights), None)
        if wbits is not None and wbits < 8:
            row["weight_bits"] = int(wbits)
        spread = _per_tensor_weight_spread(g, places, plan, s.node)
        if spread is not None:
            row["weight_channel_spread"] = spread
        narrow_inputs = all(a["bits"] <= 8 for a in acts)     # --gptq fits layers with inputs of 8 bits or fewer
        fits = _gptq_could_fit(g, s.node) and narrow_inputs
        row["advice"] = _advice(row, platform, row["node"] in set(gptq), method,
                                gptq_hint=not gptq_ran and wsq is not None and fits,
                                max_act_bits=max_act_bits, rounding=rounding,
                                unfit=(unfit or {}).get(row["node"]) if gptq_ran else
                                None if fits else _why_not_fitted(g, s.node, narrow_inputs), ran=gptq_ran,
                                gptq_flag=_gptq_flag(bc_ran, a16), asked_a=asked_a)
        flag = _gptq_flag(bc_ran, a16)
        suggested = f"{flag} re-rounds" in row["advice"] or f"{flag} chooses" in row["advice"]
        if calib_n is not None and calib_n < FEW_FIT_SAMPLES and not gptq_ran and suggested:
            # the fit follows the calibration samples: with few, it can lose on other data while the
            # report's own figures gain (a hunt, PP-OCRv4 at -N 16: detector held-out mask IoU 0.933 ->
            # 0.829 on qnn, recognizer exact match 0.670 -> 0.553 on trt; in-sample SQNR +1.3-2.2 dB)
            row["advice"] += (f"; --gptq fits the {calib_n} calibration samples: with fewer than "
                              f"{FEW_FIT_SAMPLES}, check it on held-out data (--val_dir) or calibrate on more")
        if row["node"] in set(a16 or ()):
            row["advice"] = ("isolated scores measured on its 8-bit inputs, before --auto_a16 gave them 16-bit "
                             "grids; " + row["advice"])
        if sparse is not None and row["node"] in sparse and row.get("cause") == "weights":
            db = sparse[row["node"]]
            added = f", {-db:.1f} dB of layer output error against dense rounding" if db is not None else \
                " by magnitude (too few rows to fit)"
            row["advice"] = (f"weight error dominates: --sparse {sparse_pattern} pruned this layer{added}; a milder "
                             f"pattern (e.g. a RATE below 0.5), or keep it float with --skip_layers {row['node']}")
        if row["node"] in set(promoted):
            # the isolated scores were taken on the narrow grid --auto_w8 then replaced
            row["advice"] = ("isolated scores measured with its narrow weights, before --auto_w8 gave it 8-bit "
                             "weights; " + row["advice"])
        if deferred:
            row["advice"] = (f"isolated scores measured on nearest rounding ({deferred} was fitted after "
                             "--auto_w8's search); " + row["advice"])
        rows.append(row)
    return rows


# range methods that may clip far inside what the data reaches (KL divergence, a percentile);
# below this fraction of the largest channel value the advice names the method
TIGHT_CLIP = 0.25
WIDE_GRID = 4.0          # a grid this many times wider than the tensor's largest value: not its own clip
# held-out samples reaching this many times both an input's clip and the largest value the
# calibration data holds there: the calibration data does not cover them (a range method may clip
# far inside the calibration data itself: that is its own reading, TIGHT_CLIP's)
UNCOVERED = 2.0


FEW_FIT_SAMPLES = 32     # below this many calibration samples the advice to fit the rounding says to check it


def _gptq_flag(bc_ran: bool, a16) -> str:
    """--gptq as this run can take it: it turns the default bias correction off (on ti, W4,
    --gptq alone lost 5 dB where --gptq --bc gained 4), and --auto_a16 refuses it (``a16``: its
    chosen layers, None where it did not run)."""
    if a16 is not None:
        return ("--gptq (in a second run without --auto_a16, with --layer_bits NODE=a16 for the layers it "
                "chose)")
    return "--gptq --bc" if bc_ran else "--gptq"


def _why_not_fitted(g, name: str, narrow_inputs: bool) -> str:
    """Why --gptq would leave ``name`` alone (for advice that must not name it)."""
    from dipoorlet.placement import left_weight
    from dipoorlet.reconstruct import LEFT_WEIGHT, unfit_reason, wide_input

    node = g.node_by_name[name]
    if g.is_constant(node.input[0]) and left_weight(g, node, 0):
        return LEFT_WEIGHT
    if not narrow_inputs:
        return wide_input(16)
    if len(node.input) < 2 or not g.is_constant(node.input[1]):
        return "it has no constant weight to fit"
    return unfit_reason(g, node, node.input[1]) or "it cannot fit this layer"


def _gptq_could_fit(g, name: str) -> bool:
    """Whether --gptq could re-round this node's weight (the graph's reasons only)."""
    from dipoorlet.reconstruct import unfit_reason

    node = g.node_by_name[name]
    return len(node.input) > 1 and g.is_constant(node.input[1]) and unfit_reason(g, node, node.input[1]) is None


def _advice(row: dict, platform: str = "trt", gptq: bool = False, method: str | None = None,
            gptq_hint: bool = False, max_act_bits: int = 8, rounding: str = "--gptq",
            unfit: str | None = None, ran: bool = True, gptq_flag: str = "--gptq",
            asked_a: dict | None = None) -> str:
    """``gptq_hint``: the layer has a constant weight and --gptq did not run, so it could re-round
    that weight to compensate the rounding of the layer's input. ``max_act_bits``: the widest
    activation grid the platform runs (16: name --layer_bits NODE=a16 for activation losses).
    ``rounding``: the flag that chose the weights' rounding where ``gptq`` is set (--gptq or
    --adaround). ``unfit``: why the rounding that ran left this layer alone. ``gptq_flag``: how to
    ask for --gptq in this run's setting (see :func:`_gptq_flag`)."""
    node = row["node"]
    # layers whose input grids repeat one rounding go together (sensitivity.grid_partners)
    names = [node] + (list(row.get("grid_partners", [])) if row.get("cause") != "weights" else [])
    runs = "TensorRT runs it in FP16" if platform == "trt" else f"if {platform} can run it in float or FP16"
    keep = (f"keep it float with --skip_layers {node} ({runs})" if len(names) == 1 else
            f"keep it float with --skip_layers {' '.join(names)} ({runs}; together, as the rounding is shared)")
    if row.get("cause") == "weights":
        w = row.get("weight_sqnr_db")
        at = (f" (its weights are at {w:.1f} dB on their grid, rounded to nearest)"
              if w is not None and math.isfinite(w) else "")
        # after a fitted rounding the figure is still the nearest one's, said as such (it read
        # "(... rounded to nearest), after --brecq chose its rounding"; found by a hunt)
        at_fit = (f", after {rounding} chose its rounding (its grid holds its weights at {w:.1f} dB when "
                  "rounded to nearest)" if w is not None and math.isfinite(w) else
                  f", after {rounding} chose its rounding")
        spread = row.get("weight_channel_spread")
        bits = row.get("weight_bits")
        wider = (f", 8-bit weights for it (--layer_bits {node}=w8; they are {bits}-bit now)"
                 if bits is not None and bits < 8 else "")
        if spread is not None and spread >= 4:
            return (f"weight rounding dominates{at}: {platform} quantizes weights per tensor and this layer's "
                    f"channel ranges are {spread:.0f}x apart (max / median), so most channels keep few levels; "
                    f"per-channel weights avoid it (-D qnn, or a platform spec with per_channel = true in "
                    f"[weight] where the chip has them"
                    + (", e.g. SNPE's --use_per_channel_quantization)" if platform == "snpe" else ")")
                    + ("" if gptq or unfit else f"; where they must stay per tensor, {gptq_flag} chooses the "
                       "rounding by this layer's output error")
                    + (f"; {rounding} {'left' if ran else 'would leave'} this layer alone: {unfit}" if unfit else "")
                    + f"{wider.replace(', ', '; ', 1)}; or {keep}")
        if gptq and wider:
            return (f"weight rounding dominates{at_fit}: its weights need more "
                    f"bits (--layer_bits {node}=w8; they are {bits}-bit now), or {keep}")
        if gptq:
            # 8-bit weights fitted to a rounded input: measured alone they carry part of that input's
            # error (a 6-bit input read as an 8-bit weight loss; w8 changed nothing, a8 helped)
            narrow_in = [a for a in row.get("activations", []) if a.get("bits", 8) < 8]
            return (f"weight rounding dominates{at_fit}"
                    + (f" to fit its {narrow_in[0]['bits']}-bit input: the fit carries that input's error, so an "
                       f"8-bit input grid (--layer_bits {node}=a8) is the first thing to try" if narrow_in else
                       "; its weights are on the backend's own width already")
                    + f"; or {keep}")
        if unfit:
            return (f"weight rounding dominates{at}: {rounding} {'left' if ran else 'would leave'} this layer "
                    f"alone: {unfit}"
                    f"{wider.replace(', ', '; ', 1)}, or {keep}")
        return (f"weight rounding dominates{at}: {gptq_flag} chooses the rounding by this layer's output error "
                f"(one extra pass){wider}, or {keep}")
    facts, uncovered = [], []
    for a in row.get("activations", []):
        over = (f" over {a['channel_samples']} {'held-out ' if a.get('channel_held_out') else ''}samples"
                if a.get("channel_samples") else "")
        if "shifted_from" in a:
            lo, hi = a["clip"]
            part = [f"input {a['shifted_from']} clipped to [{lo:.4g}, {hi:.4g}] (asymmetric grid, shifted)"]
        elif "softmax_floor" in a:
            lo, hi = a["softmax_floor"]
            part = [f"input {a['tensor']} on a grid from the Softmax's floor {lo:.4g} to {hi:.4g} (lower values, the "
                    f"mask's, weigh nothing after the Softmax)"]
        elif (a.get("channel_max") or a.get("calibration_max")) and \
                a["amax"] > WIDE_GRID * (a.get("channel_max") or a["calibration_max"]):
            # not clipped: the grid is far wider than what this tensor carries (its own calibration
            # range where no channel statistics were taken: an LSTM state's h tied by a Concat to c,
            # 100x wider, had been said "clipped at" the wide grid's end; found by a hunt)
            own = a.get("channel_max") or a["calibration_max"]
            part = [f"{'output' if a.get('output') else 'input'} {a['tensor']} on a grid to {a['amax']:.4g}, "
                    f"{a['amax'] / own:.0f}x its "
                    f"largest value{over if a.get('channel_max') else ' on the calibration data'} ({own:.4g}), "
                    f"so its values use about {own / a['step']:.0f} of the grid's {2 ** a['bits'] - 1} steps"]
            if a.get("grid_shared_by"):
                part[0] += (f": one grid for the {a['grid_shared_by']} tensors that pass-through ops "
                            f"(MaxPool, Concat, Reshape...) tie together on {platform}")
        else:
            part = [f"{'output' if a.get('output') else 'input'} {a['tensor']} clipped at {a['amax']:.4g}"]
        if "channel_max" in a and "on a grid to" in part[0]:
            part.append(f"channel ranges {a['channel_spread']:.1f}x apart under one per-tensor scale")
        elif "channel_max" in a:
            part.append(f"largest channel max{over} {a['channel_max']:.4g}, channel ranges "
                        f"{a['channel_spread']:.1f}x apart under one per-tensor scale")
        if "equalization" in a:
            part.append(f"equalization: {a['equalization']}")
        top = a.get("channel_max")
        clip = max(abs(a["clip"][0]), abs(a["clip"][1])) if "shifted_from" in a else a.get("amax")
        seen = a.get("calibration_max")
        if (a.get("channel_held_out") and top and clip and seen and top >= UNCOVERED * clip
                and top >= UNCOVERED * seen):
            uncovered.append(a)
            part.append(f"the held-out samples reach {top / clip:.1f}x its clip and {top / seen:.1f}x the largest "
                        f"value of the calibration data there ({seen:.4g}): they are clipped, not rounded; "
                        f"calibrate on data like them (-I), or check that both are preprocessed alike")
        if "grid_copy_of" in a or "grid_copied_to" in a:
            how = (f"scaled by {a['grid_factor']:.4g} (a constant {a.get('grid_via', 'Mul')})"
                   if a["grid_factor"] != 1.0 else f"(a {a.get('grid_via', 'pass-through op')} moves values only)")
            part.append(f"its grid is {a['grid_copy_of']}'s {how}: its values were rounded there already, one "
                        f"rounding for {' and '.join(names)}" if "grid_copy_of" in a else
                        f"{a['grid_copied_to']} repeats its grid {how}: one rounding for {' and '.join(names)}")
        if method in ("entropy", "percentile") and top and clip is not None and clip < TIGHT_CLIP * top:
            part.append(f"-A {method} clips it at {clip / top:.0%} of the largest value seen; "
                        f"-A mse (the default) or hist clip by the rounding error they cost")
        facts.append("; ".join(part))
    lead = (("activation clipping dominates" if uncovered else "activation rounding dominates")
            if row.get("cause") == "activations" else "quantizing it costs")
    hint = (f"; {gptq_flag} re-rounds its weights to compensate part of its input's rounding (one extra pass)"
            if gptq_hint and row.get("activations") and not uncovered else "")
    narrow = [a for a in row.get("activations", []) if a.get("bits", 8) < max_act_bits]
    asked_a = asked_a or {}
    if narrow and not uncovered and all((asked_a.get(n) or 0) >= max_act_bits for n in names):
        # asked already: another reader of the same tensor asks fewer bits, and one grid serves
        # them all (the advice repeated the flag that had no effect; found by a flag hunt)
        hint += (f"; its --layer_bits {' '.join(f'{n}=a{asked_a[n]}' for n in names)} does not stand: another "
                 f"reader of {narrow[0]['tensor']} asks fewer bits and one grid serves them all (the log names "
                 f"them); give them a{max_act_bits} too")
    elif narrow and not uncovered:      # clipped held-out values: a finer grid does not reach them
        flags = " ".join(f"{n}=a{max_act_bits}" for n in names)
        hint += (f"; --layer_bits {flags} gives {'its' if len(names) == 1 else 'their'} inputs {max_act_bits}-bit "
                 f"grids ({platform} runs them; --a_bits {max_act_bits} for every layer)")
    return f"{lead} ({' / '.join(facts) or 'no quantized activation input'}){hint}; {keep}"


# The error is "spread" when half of the summed isolated error takes at least SPREAD_HALF layers
# (the PP-OCR classifier: its 72 layers' isolated losses add up to 27.2 dB on its logits, half of
# that takes 10 layers, and each alone loses under MIN_LOSS, so the per-layer diagnosis had nothing
# to say); MiniLM-L6, half in 5 (its FFN output MatMuls), is left to the per-layer rows
SPREAD_TOP = 3
SPREAD_HALF = 7


def shared_input_groups(places, plan) -> list[set]:
    """The quantized layers joined where they read one quantized activation: one grid rounds it
    for all of them, so its error reaches the output through each (coherently, not as
    independent errors); a layer reading no shared tensor is a group of its own."""
    from dipoorlet.qparams import UnionFind

    uf = UnionFind()
    for t, p in places.activations.items():
        if t in plan.activations:
            owners = list(dict.fromkeys(p.owners))
            for o in owners:
                uf.union(o, owners[0])
    groups: dict = {}
    for n in list(uf.parent):
        groups.setdefault(uf.find(n), set()).add(n)
    return list(groups.values())


def error_spread(isolated, floated=(), samples: int | None = None, platform: str = "trt",
                 max_act_bits: int = 8, act_bits: int = 8, rounding: str | None = None,
                 gptq_flag: str = "--gptq", a16=None, groups=()) -> dict | None:
    """How the isolated losses add up, where no few layers hold most of them (None otherwise, or
    where the summed loss stays under ``MIN_LOSS`` of output cosine).

    Quantization noise of independent layers adds as power at the output, so the isolated noise
    powers (10^(-SQNR/10) each) add up to an estimate of the whole model's; on the PP-OCR
    classifier that estimate reads 27.2 dB where the quantized model measures 26.3 dB on its
    logits. Layers reading one quantized tensor (``groups``, :func:`shared_input_groups`) count
    as one: one grid rounds that tensor for all of them, so one change (keeping it float, a
    16-bit grid) acts on all (a review found 16 branches reading one input called "spread"
    where two 16-bit grids gained 10.6 dB). ``floated``: layers --auto_skip kept float, and
    ``a16``: the layers --auto_a16 gave 16-bit inputs (None where it did not run), both left out.
    ``act_bits``: the narrowest activation grid in the plan (16: every input is on 16 bits
    already). ``rounding``: the flag whose fitted rounding (or pruning) the scores include, None
    where the weights are rounded to nearest."""
    skipped = set(floated)
    floated = skipped | set(a16 or ())
    rows = [s for s in isolated if s.node not in floated]
    if len(rows) < SPREAD_HALF:
        return None
    db = [s.isolated.sqnr_db for s in rows]
    if any(d != d or d == -math.inf for d in db):
        return None                  # a NaN or signal-free output: the per-layer rows say so
    power = {s.node: _power(s.isolated.sqnr_db) for s in rows}
    total = math.fsum(power.values())
    if not math.isfinite(total) or total / 2 < MIN_LOSS:    # 1 - cosine ~ noise / 2
        return None
    group_of = {n: k for k, grp in enumerate(groups) for n in grp}
    summed: dict = {}
    for n, pw in power.items():
        key = group_of.get(n, n)
        summed[key] = summed.get(key, 0.0) + pw
    noise = sorted(summed.values(), reverse=True)
    top = math.fsum(noise[:SPREAD_TOP]) / total
    acc, half = 0.0, len(noise)
    for k, n in enumerate(noise, 1):
        acc += n
        if acc >= total / 2:
            half = k
            break
    if half < SPREAD_HALF:
        return None
    merged = len(noise) < len(rows)
    # the worst layers' weight-only and activation-only scores (sensitivity.isolated splits them)
    split = [s for s in rows if s.weight_only is not None and s.activation_only is not None]
    a = math.fsum(_power(s.activation_only.sqnr_db) for s in split)
    w = math.fsum(_power(s.weight_only.sqnr_db) for s in split)
    act_share = a / (a + w) if 0 < a + w < math.inf else None
    out = {"layers": len(rows), "summed_sqnr_db": -10 * math.log10(total), "top_layers": SPREAD_TOP,
           "top_share": top, "half_layers": half, "samples": samples}
    if merged:
        out["groups"] = len(noise)
    if act_share is not None:
        out["activation_share"] = act_share
        out["split_layers"] = len(split)
    what = ("layers (those reading one quantized tensor counted as one)" if merged else "layers")
    lead = (("isolated scores measured before --auto_a16 gave " + f"{len(a16)} layers 16-bit inputs, which are "
             "left out here; " if a16 else "")
            + f"the isolated losses of the {len(rows)} quantized layers add up to an output SQNR of "
            f"{out['summed_sqnr_db']:.1f} dB" + (f" on the {samples} sensitivity samples" if samples else "")
            + f" (noise powers add); the {SPREAD_TOP} worst make {top:.0%} of that and half of it takes the {half} "
            f"worst {what}, so no few layers explain it alone and the isolated ranking is a weak guide to which to "
            "keep float (the layers' errors interact)")
    runs = "TensorRT runs them in FP16" if platform == "trt" else f"where {platform} runs them in float or FP16"
    # the search measures the whole model after each layer it keeps float: on the PP-OCR classifier
    # (-N 64) it kept 4 layers, 3 of them outside the isolated top 3, 26.3 -> 35.7 dB on the logits
    # and 97.94 -> 98.57% agreement; --drop (the weights fitted with the activations' rounding in
    # the loop) gave 96.95%
    keep = (f"more layers float (a stricter --auto_skip target, or a larger --max_float_layers; {runs})"
            if skipped else f"--auto_skip TARGET keeps layers float one by one, measuring the "
            f"whole model after each ({runs})")
    if act_share is not None and act_share >= 0.5:
        why = (f"; activations make {act_share:.0%} of the {len(split)} worst layers' error"
               if len(split) < len(rows) else f"; activations make {act_share:.0%} of it")
        if a16:
            fix = f"more 16-bit inputs (a stricter --auto_a16 target, or a larger --max_a16_layers); or {keep}"
        elif max_act_bits >= 16 and act_bits < 16:
            fix = (f"16-bit activation grids ({platform} runs them): --auto_a16 TARGET picks the fewest layers "
                   f"that meet a target, --a_bits {max_act_bits} takes them all; or {keep}")
        else:
            fix = keep
    else:
        why = (f"; weights make {1 - act_share:.0%} of the {len(split)} worst layers' error"
               if act_share is not None else "")
        fix = (f"--sparse pruned the weights: a milder pattern (e.g. a RATE below 0.5); or {keep}"
               if rounding == "--sparse" else
               f"{rounding} chose every layer's rounding already; {keep}" if rounding else
               f"{gptq_flag} chooses every layer's rounding by its output error (one extra pass), or --brecq "
               f"fits them block by block; or {keep}")
    out["advice"] = lead + why + ": " + fix
    return out


def _power(db: float) -> float:
    """The output's noise power relative to its signal at an SQNR of ``db`` (0 for NaN: no figure)."""
    return 10 ** (-db / 10) if db == db else 0.0
