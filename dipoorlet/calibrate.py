"""Collect per-tensor statistics by streaming calibration samples through onnxruntime.

One session, one pass over the samples. Ranges come from ``ReduceMin``/``ReduceMax`` nodes
appended inside the graph for every target tensor, so two scalars per tensor leave onnxruntime.
Histogram methods also fetch the target tensors themselves; each sample is binned at once into a
histogram on fixed, data-independent edges (:class:`~dipoorlet.stats.LogHistogram`, the float32
bit pattern) and dropped, on a worker thread so numpy's binning overlaps the next inference (both
release the GIL). Because those edges need no range, the range and the histogram come from the
same pass; after the pass (and the merge across processes) each histogram is turned into the
fixed-width one over the tensor's final range. Memory holds one sample's exposed tensors plus
the statistics: it does not grow with -N.

The earlier design (PPQ's) needed two passes: one for the range, then one to bin on edges fixed
by it. One pass costs one float inference per sample less.
"""
from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx

from dipoorlet.progress import progress
from dipoorlet.runtime import Runner
from dipoorlet.stats import LogHistogram, TensorStats

log = logging.getLogger(__name__)


def collect(graph, data, indices, targets: list[str], comm, histograms: bool, bins: int = 2048,
            device="cpu") -> dict[str, TensorStats]:
    """Ranges of every target (merged across processes), plus histograms if asked."""
    # With histograms, leave one core to the numpy binning thread (it overlaps inference).
    from dipoorlet.threads import session_threads

    cores = session_threads() or (os.cpu_count() or 2)      # under MPI: this process's share
    threads = max(1, cores - 1) if histograms else 0
    runner = Runner(graph.model, targets if histograms else [], reduce_minmax=targets,
                    types=graph.types, device=device, threads=threads, spin=not histograms,
                    nan_safe=not histograms)
    if not histograms:
        return range_pass(runner, data, indices, targets, comm)
    stats = histogram_pass(runner, data, indices, targets, bins, comm)
    # onnxruntime's plain reductions (the histogram pass's: NaN-safe ones cost it 60% more) misread
    # a tensor holding NaN; the histograms count NaN, so those tensors' ranges are taken again,
    # NaN left out (a pass over the few tensors that hold any, only where one does)
    nan = sorted(t for t, st in stats.items() if st.hist is not None and st.hist.nan > 0)
    if nan:
        del runner
        # known to hold NaN: straight to the NaN-safe reductions (the guard would run both)
        again = range_pass(Runner(graph.model, [], reduce_minmax=nan, types=graph.types, device=device,
                                  spin=True, nan_safe="where"), data, indices, nan, comm)
        for t in nan:
            stats[t].minmax = again[t].minmax
    _mask_inf_as_lowest(graph, stats)
    for st in stats.values():
        mm = st.minmax
        usable = mm.count and mm.lo <= mm.hi and math.isfinite(mm.lo) and math.isfinite(mm.hi)
        st.hist = st.hist.to_linear(mm.lo, mm.hi, bins) if usable else None
    return stats


def range_pass(runner, data, indices, targets: list[str], comm) -> dict[str, TensorStats]:
    stats = {t: TensorStats() for t in targets}
    for i in progress(indices, "calibration: ranges", comm):
        _, ranges = runner.run(data.sample(i), tensors=False)
        for t, (lo, hi) in ranges.items():
            stats[t].minmax.update(lo, hi)
    return comm.merge_stats(stats)


def histogram_pass(runner, data, indices, targets: list[str], bins: int, comm) -> dict[str, TensorStats]:
    """Ranges and the float32 log-histograms of every target in one pass (:func:`collect` turns
    them fixed-width: ``bins`` bins over [0, amax], or 2*bins over [-amax, amax])."""
    stats = {t: TensorStats() for t in targets}
    for t in targets:
        stats[t].hist = LogHistogram()

    def fold(tensors):
        for t in targets:
            stats[t].hist.update(tensors[t])

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for i in progress(indices, "calibration: ranges and histograms", comm):
            tensors, ranges = runner.run(data.sample(i))
            for t, (lo, hi) in ranges.items():
                stats[t].minmax.update(lo, hi)
            if pending is not None:
                pending.result()
            pending = pool.submit(fold, tensors)
        if pending is not None:
            pending.result()
    return comm.merge_stats(stats)


# A Softmax weighs a value x of a row by exp(x - row max): one SOFTMAX_MARGIN below the row's
# maximum, under exp(-20) = 2e-9 of the maximum's weight.
SOFTMAX_MARGIN = 20.0
# where a mask is added at deployment but calibration never saw one, the grid is widened to reach
# this far below the lowest row maximum: a padded position clipped there weighs under exp(-12) =
# 6e-6 of its row's maximum (0.3% for 512 of them), at less cost to the real scores' steps
SOFTMAX_MASK_MARGIN = 12.0
# measured only where the calibrated range is this wide (a -1e4 attention mask in it): on a range
# of 80 an 8-bit grid still has steps of 0.3, and the extra pass would buy little
SOFTMAX_WIDE = 4 * SOFTMAX_MARGIN
ROWMAX_SUFFIX = "__dpl_rowmax"
# a row whose maximum lies this far below the sample's largest row maximum is a masked-out row
# (a padded query under a two-sided or causal mask: all of it near -1e4); it does not set the
# floor, which would otherwise sink to the mask
MASKED_ROW_GAP = 100.0
# a sample whose every Softmax row maximum lies below this, where a mask is added, has every query
# masked (masks are -1e4, -1e9 or float32's lowest; scores do not reach -1000)
MASKED_SAMPLE = -1000.0


def _softmax_axes(graph, tensor: str) -> list[int] | None:
    """The axes every reader of ``tensor`` normalizes over, where all its readers are Softmax ops
    that agree on them (opset 13 and up: one axis; before: every axis from ``axis`` on), else
    None."""
    from dipoorlet.graph import node_attr, opset_of

    readers = graph.consumers.get(tensor, [])
    if not readers or tensor in graph.output_names or any(n.op_type != "Softmax" or n.domain not in ("", "ai.onnx")
                                                          for n in readers):
        return None
    opset = opset_of(graph.model)
    shape = graph.shape(tensor)
    rank = len(shape) if shape is not None else None
    found = set()
    for n in readers:
        axis = int(node_attr(n, "axis", -1 if opset >= 13 else 1))
        if opset >= 13:
            found.add((axis % rank,) if rank else (axis,))
        elif rank:
            found.add(tuple(range(axis % rank, rank)))
        else:
            return None
    return list(found.pop()) if len(found) == 1 else None


# ops that pass a tensor's values on unchanged (a probability stays one)
_SAME_VALUES = ("Cast", "Identity", "Dropout", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten")


def open_length_probabilities(graph) -> list[str]:
    """Softmax outputs (and what Cast, Reshape, Transpose... pass on of them) whose rows have no
    fixed length: the normalized axis (opset < 13: one of the axes from ``axis`` on) is a dynamic
    or unknown dimension. A row's largest probability grows as the row gets shorter, up to 1 for a
    row of one (a KV-cache decoder's first token attends to itself alone), so a grid sized on the
    calibration lengths clips a shorter row's; their grids reach 1 (plan_grids). Rows of a fixed
    length (a CNN's spatial attention, a ViT's patches) keep their calibrated grids."""
    from dipoorlet.graph import node_attr, opset_of

    opset = opset_of(graph.model)
    found: list[str] = []
    for n in graph.graph.node:
        if n.op_type != "Softmax" or n.domain not in ("", "ai.onnx") or not n.output or not graph.is_float(n.output[0]):
            continue
        shape = graph.shape(n.input[0])
        if shape:
            axis = int(node_attr(n, "axis", -1 if opset >= 13 else 1)) % len(shape)
            axes = [axis] if opset >= 13 else range(axis, len(shape))
            if all(shape[a] is not None for a in axes):
                continue
        todo = [n.output[0]]
        while todo:
            t = todo.pop()
            if t in found:
                continue
            found.append(t)
            todo += [r.output[0] for r in graph.consumers.get(t, []) if r.op_type in _SAME_VALUES and r.input
                     and r.input[0] == t and r.output and graph.is_float(r.output[0])]
    return found


# ops a mask term passes on its way from the model's attention_mask input to the scores it is
# added to (Cast, Unsqueeze, (1 - m) * -1e4, a boolean Where ...): no op that mixes in weights
MASK_OPS = {"Cast", "CastLike", "Unsqueeze", "Squeeze", "Reshape", "Expand", "Tile", "Slice", "Identity",
            "Flatten", "Transpose", "Concat", "Sub", "Mul", "Add", "Div", "Neg", "Not", "Equal", "Less",
            "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Where", "Max", "Min", "Clip",
            "Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements"}
# the inputs a mask passes through: a Gather's data (transformers 4.57 indexes the padding mask,
# mask[b, kv]; an embedding lookup of token ids is data from a table, no mask), a Scatter's data
# and updates (older exports slice-assign the padding into the causal mask), not their indices
MASK_DATA_INPUTS = {"Gather": (0,), "GatherElements": (0,), "GatherND": (0,), "ScatterND": (0, 2),
                    "ScatterElements": (0, 2), "CastLike": (0,)}    # (CastLike's second gives a type only)


def _from_input(graph, tensor: str, depth: int = 16, integer: bool = False) -> bool:
    """``tensor`` is computed from a network input by MASK_OPS alone (and constants); with
    ``integer``, from an integer or boolean input (an attention_mask as exporters write it)."""
    if any(i.name == tensor for i in graph.graph_inputs):
        return not integer or not graph.is_float(tensor)
    node = graph.producer.get(tensor)
    if node is None or depth == 0 or node.op_type not in MASK_OPS:
        return False
    reads = [node.input[k] for k in MASK_DATA_INPUTS.get(node.op_type, range(len(node.input))) if k < len(node.input)]
    fed = [(x, _from_input(graph, x, depth - 1, integer)) for x in reads if x and not graph.is_constant(x)]
    # every other operand holds no data (constants, a causal mask made from a Range or a Shape):
    # "scores + ALiBi" is no mask though its ALiBi comes from attention_mask (BLOOM's padding mask
    # then read as added to another mask, and was missed; found by a review)
    dep = graph.value_dependent()
    return any(f for _, f in fed) and all(f or x not in dep for x, f in fed)


def _mask_fed(graph, tensor: str, integer: bool = False) -> bool:
    """``tensor`` is attention scores plus a mask term (an Add or Sub with one operand from the
    network inputs by MASK_OPS alone, the other not; or a Where choosing between the scores and
    a constant by such a condition): padded positions at deployment reach it with a large
    negative value, whatever the calibration samples held."""
    node = graph.producer.get(tensor)
    # BART-style attention adds the mask to [B, H, L, L] scores between two Reshapes; T5's casts
    # the sum float -> float before its Softmax (the mask margin was never applied; found by a hunt)
    while node is not None and (node.op_type in ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze",
                                                 "Identity") or _float_cast(graph, node)):
        node = graph.producer.get(node.input[0])
    if node is None:
        return False
    if node.op_type in ("Add", "Sub") and len(node.input) == 2:
        fed = [_from_input(graph, x, integer=integer) and not graph.is_constant(x) for x in node.input]
        # (with ``integer``: the other operand is no input of its own, a state or a prior)
        return fed[0] != fed[1] and not (integer and any(_from_input(graph, x) and not graph.is_constant(x)
                                                         for x, f in zip(node.input, fed) if not f))
    if node.op_type == "Where" and len(node.input) == 3:
        return (_from_input(graph, node.input[0], integer=integer) and not graph.is_constant(node.input[0])
                and (graph.is_constant(node.input[1]) or graph.is_constant(node.input[2])))
    return False


def _mask_inf_as_lowest(graph, stats: dict[str, TensorStats]) -> None:
    """A Softmax input reaching -inf (a mask of -inf, or two float32-lowest masks added, as GPT-2's
    causal and padding masks in transformers 4.57 exports) and otherwise finite is taken as
    reaching float32's lowest, which a Softmax weighs alike (0): its grid then starts at its floor
    (softmax_floors) as a float32-lowest mask's does, where it had stayed float ("reaches -inf"),
    every GPT-2 Softmax on qnn/ort (found by a bug hunt)."""
    lowest = float(np.finfo(np.float32).min)
    for t, st in stats.items():
        mm = st.minmax
        if mm.count and mm.lo == -math.inf and math.isfinite(mm.hi) and _softmax_axes(graph, t) is not None:
            mm.lo = lowest


def _float_cast(graph, node) -> bool:
    """A Cast (or CastLike) from float to float: it moves no value."""
    return (node.op_type in ("Cast", "CastLike") and bool(node.input) and graph.is_float(node.input[0])
            and graph.is_float(node.output[0]))


def mask_carrying(graph) -> set[str]:
    """Tensors that hold an attention mask added to something else on its way to a Softmax: an
    Add/Sub (or Where) of a mask term computed from an integer or boolean input (an attention_mask;
    a float input added to a layer's output is a state or a prior, no mask: it had lost its grid,
    found by a review) and another tensor (:func:`_mask_fed`), and what Adds, Subs,
    float Casts and ops that only move values make of one, as far as a Softmax reads it, short of
    the Softmax's own input (when Softmax ops alone read it). Calibrated on unpadded samples such a
    tensor holds no mask, its grid ends near its other term, and at deployment the mask is
    clipped there: T5 adds the mask to its position bias first, a ±0.32 grid, and padded tokens
    were attended to (a padded sentence's own tokens read cosine 0.75; found by a bug hunt)."""
    carrying: set[str] = set()
    moving = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Expand", "Slice")
    for node in graph.topological_nodes():
        if not node.output or not node.output[0] or not graph.is_float(node.output[0]):
            continue
        out = node.output[0]
        if node.op_type in ("Add", "Sub", "Where") and _mask_fed(graph, out, integer=True):
            carrying.add(out)
        elif node.op_type in ("Add", "Sub") and any(x in carrying for x in node.input):
            carrying.add(out)
        elif (node.op_type in moving or _float_cast(graph, node)) and node.input and node.input[0] in carrying:
            carrying.add(out)
    # ... on its way to a Softmax (an Add of a state input and a layer's output is no mask), short
    # of an input that Softmax ops alone read (its grid starts at its floor: softmax_floors)
    toward, todo = set(), [n.input[0] for n in graph.graph.node if n.op_type == "Softmax" and n.input]
    while todo:
        t = todo.pop()
        if t in toward or t not in carrying:
            continue
        toward.add(t)
        node = graph.producer.get(t)
        if node is not None:
            todo.extend(x for x in node.input if x)
    return {t for t in toward if _softmax_axes(graph, t) is None}


def softmax_floors(graph, data, indices, stats: dict[str, TensorStats], comm, device="cpu") -> dict[str, float]:
    """Lower ends for the grids of Softmax inputs whose range an additive attention mask stretches.

    A -1e4 mask added to attention scores puts a uint8 grid's steps at 39 (qnn quantizes the
    Softmax input): every real score rounds to one or two levels, and a masked-attention block's
    output cosine fell to 0.75. Yet a Softmax reads a value only relative to its row's maximum,
    and one ``SOFTMAX_MARGIN`` below it weighs under 2e-9. So the grid need reach no lower than
    the lowest row maximum any calibration sample has, less the margin: a masked value clipped
    there still weighs under 2e-9 of its row's maximum. A row whose maximum lies more than
    ``MASKED_ROW_GAP`` below its sample's largest row maximum is masked out as a whole (a padded
    query under a two-sided or causal mask) and does not count: it would sink the floor to the
    mask (a grid from -1e4 again, 2.7 dB).

    The other way round: calibrated on unpadded samples, a mask term is 0 throughout, and the grid
    ended at the scores' own minimum (-1.5 on a small BERT): a padded batch at deployment had
    its -1e4 clipped there, and the real positions gave the padding half their attention (output
    cosine 0.97, 0.91 at worst). Where a mask is added to the scores (:func:`_mask_fed`) and the
    calibrated minimum lies less than ``SOFTMAX_MASK_MARGIN`` below the lowest row maximum, the
    grid is widened down to that margin.

    One extra float pass measures the row maxima (ReduceMax over the Softmax's axes, inside the
    graph; one value per row leaves onnxruntime) for the tensors whose calibrated range is wider than
    ``SOFTMAX_WIDE`` and the mask-fed ones, only where there is one; they are merged across
    processes (their minimum). Sets ``stats[t].floor`` (and ``floor_exact`` where it widens the
    grid) and returns ``{tensor: floor}``."""
    from onnx import helper

    from dipoorlet.graph import opset_of

    _mask_inf_as_lowest(graph, stats)          # (the -A minmax one-pass ranges come here unseen by collect)
    cands, masked = {}, set()
    for t, st in stats.items():
        mm = st.minmax
        if not mm.count or not (math.isfinite(mm.lo) and math.isfinite(mm.hi)):
            continue
        axes = _softmax_axes(graph, t)
        if axes is None:
            continue
        if _mask_fed(graph, t):
            masked.add(t)
        if t in masked or mm.hi - mm.lo > SOFTMAX_WIDE:
            cands[t] = axes
    if not cands:
        return {}
    g = graph.model.graph
    n_nodes = len(g.node)
    opset = opset_of(graph.model)
    names = {t: t + ROWMAX_SUFFIX for t in cands}
    try:
        for t, axes in cands.items():
            row = names[t]
            if opset >= 18:
                g.node.append(helper.make_node("Constant", [], [row + "_axes"], name=row + "_axes",
                                               value=helper.make_tensor(row + "_axes", onnx.TensorProto.INT64,
                                                                        [len(axes)], axes)))
                g.node.append(helper.make_node("ReduceMax", [t, row + "_axes"], [row], name=row, keepdims=0))
            else:
                g.node.append(helper.make_node("ReduceMax", [t], [row], name=row, axes=axes, keepdims=0))
        types = {n: (onnx.TensorProto.FLOAT, None) for n in names.values()}
        runner = Runner(graph.model, list(names.values()), types=types, device=device, spin=True)
    finally:
        while len(g.node) > n_nodes:
            g.node.pop()
    order = sorted(cands)
    # where a mask is added, a sample whose every row maximum lies below MASKED_SAMPLE (every
    # query masked: a calibration sample of all padding) does not count either; it had sunk the
    # floor to the mask (a Llama on qnn, held-out cosine 0.985 -> 0.413 from one such sample in
    # 16; found by a hunt). Scores that lie lower by themselves (an added prior of -160 moves no
    # probability) still count: leaving them out clipped that sample (a review: cosine 1.0 -> 0.35)
    low = np.full(len(order), np.inf)
    alone = np.full(len(order), np.inf)     # every sample counted, as before: what the log compares
    for i in progress(indices, "calibration: Softmax row maxima", comm):
        found, _ = runner.run(data.sample(i), ranges=False)
        for k, t in enumerate(order):
            rows = np.asarray(found[names[t]], np.float64).reshape(-1)
            rows = rows[np.isfinite(rows)]
            if rows.size:
                top = float(rows.max())
                live = float(rows[rows >= top - MASKED_ROW_GAP].min())
                alone[k] = min(alone[k], live)
                if not (t in masked and top <= MASKED_SAMPLE):
                    low[k] = min(low[k], live)
    low = -comm.allreduce_max(-low)
    alone = -comm.allreduce_max(-alone)
    low = np.where(np.isfinite(low), low, alone)          # every sample all masked: as before
    masked_out = [t for t, a, v in zip(order, alone, low) if a < v]
    if masked_out:
        log.info("Softmax inputs: %d tensors have calibration samples whose every row maximum lies below %g, where "
                 "a mask is added (every query masked: a sample of all padding?); their grids' lower ends leave "
                 "those samples out: %s", len(masked_out), MASKED_SAMPLE, ", ".join(masked_out[:4])
                 + (" ..." if len(masked_out) > 4 else ""))
    out, extended = {}, {}
    for t, v in zip(order, low):
        floor = float(v) - SOFTMAX_MARGIN
        if not math.isfinite(floor) or floor >= stats[t].minmax.hi:
            continue
        if floor <= stats[t].minmax.lo:
            floor = float(v) - SOFTMAX_MASK_MARGIN
            if t not in masked or floor >= stats[t].minmax.lo:
                continue
            extended[t] = floor
        stats[t].floor = floor
        stats[t].floor_exact = t in extended
        out[t] = floor
    shrunk = {t: f for t, f in out.items() if t not in extended}
    if shrunk:
        log.info("Softmax inputs: %d grids start at the lowest row maximum of the calibration data less %g "
                 "instead of their minimum (a value that far below its row's maximum weighs under 2e-9): %s",
                 len(shrunk), SOFTMAX_MARGIN, ", ".join(f"{t} {stats[t].minmax.lo:.4g} -> {f:.4g}"
                                                         for t, f in list(shrunk.items())[:4])
                 + (" ..." if len(shrunk) > 4 else ""))
    if extended:
        log.info("Softmax inputs: %d grids reach down to the lowest row maximum of the calibration data less %g, "
                 "below anything the calibration samples held, since an attention mask is added to them: padded "
                 "positions at deployment then weigh under 6e-6 instead of being clipped into the scores: %s",
                 len(extended), SOFTMAX_MASK_MARGIN, ", ".join(f"{t} {stats[t].minmax.lo:.4g} -> {f:.4g}"
                                                          for t, f in list(extended.items())[:4])
                 + (" ..." if len(extended) > 4 else ""))
    return out
