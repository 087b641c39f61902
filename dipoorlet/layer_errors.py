"""Per-layer error of the quantized model, streamed: no activation outlives its sample.

For every quantized node's outputs and every network output, the float model's tensor is compared
with the quantized model's tensor at the same name (the *cumulative* error: everything upstream
quantized, as the reference tool reports it). Both models run once per sample, each in one
session built for the pass. Each sample's scalars (cosine, error and signal energy, max |error|)
go at once into per-tensor accumulators of fixed size (:class:`ErrorStats`): sums are exact
(Shewchuk's partials, as ``math.fsum``), so accumulators merged across processes in any order
give bit-identical results, and memory does not grow with -N. Only the network outputs keep one
cosine per sample (8 bytes), for the report's per-sample distribution.

Cosine of a sample: sum(f*q) / sqrt(sum(f^2) sum(q^2)), 1 when both are zero. Layer cosine is the
mean over samples (as the reference); SQNR is 10 log10(sum f^2 / sum (f-q)^2) over all samples.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

import numpy as np

from dipoorlet.data import sample_name
from dipoorlet.progress import progress
from dipoorlet.util import sqnr_db
from dipoorlet.qdq import dq_source
from dipoorlet.runtime import SIMULATE, Runner

log = logging.getLogger(__name__)


@dataclass
class ErrorRow:
    tensor: str
    node: str
    op_type: str
    cosine: float
    min_cosine: float
    sqnr_db: float
    max_abs_err: float
    is_output: bool = False
    pooled: bool = False    # cosine over the samples together (fewer than TINY values per sample)
    resized: int = 0        # samples left out: the quantization changed the tensor's size


# float64 sums over pieces of this many values, converted into buffers held for the whole run: a
# float64 copy of a whole large activation costs page faults per call, and OpenBLAS splits a dot
# product of more than 10,000 values over threads, which right after an onnxruntime run (its
# threads still spinning) took 20-35 ms per call instead of 0.2 (PP-OCR classifier: the error
# profile's metrics took 3.2 of its 4.0 s)
# (one set per thread: the sensitivity analysis scores its samples on several threads at once)
_CHUNK = 8192
_BUFS = threading.local()


# A tensor of fewer values than this per sample (a score, a few logits or class probabilities) has
# no meaningful cosine of its own (one value: always +-1, so --fail_below could never fail; two
# logits: nearly a sign check, on whose mean --auto_skip kept float layers that cut the logits'
# SQNR, PP-OCR classifier on imx 8.4 -> 4.4 dB): its cosine is taken over the samples together, in
# the report, --fail_below and the sensitivity searches alike
TINY = 8


def sample_metrics(f: np.ndarray, q: np.ndarray) -> tuple[float, float, float, float]:
    """(cosine, error energy, signal energy, max |error|) of one sample's tensor, in float64."""
    return sample_sums(f, q)[:4]


def sample_sums(f: np.ndarray, q: np.ndarray) -> tuple[float, float, float, float, float, float]:
    """:func:`sample_metrics` and the sums f.q and q.q behind the cosine. Tensors of different
    sizes (an NMS output whose box count the quantization changed) have no such metrics: NaN,
    counted as such."""
    f, q = f.reshape(-1), q.reshape(-1)
    if f.size != q.size:
        nan = math.nan
        return nan, nan, float(np.dot(f.astype(np.float64), f.astype(np.float64))), nan, nan, nan
    bufs = getattr(_BUFS, "bufs", None)
    if bufs is None:
        bufs = _BUFS.bufs = [np.empty(_CHUNK) for _ in range(3)]
    fb, qb, db = bufs
    ff = qq = fq = dd = 0.0
    peaks = []
    for s in range(0, f.size, _CHUNK):
        m = min(_CHUNK, f.size - s)
        a, b, d = fb[:m], qb[:m], db[:m]
        np.copyto(a, f[s:s + m])
        np.copyto(b, q[s:s + m])
        with np.errstate(invalid="ignore", over="ignore"):   # inf * 0, inf - inf: NaN, counted as such
            ff += float(a @ a)
            qq += float(b @ b)
            fq += float(a @ b)
            np.subtract(a, b, out=d)
            dd += float(d @ d)
        np.abs(d, out=d)
        peaks.append(d.max())
    if ff == 0.0 and qq == 0.0:
        cos = 1.0
    elif ff == 0.0 or qq == 0.0:
        cos = 0.0
    else:
        cos = fq / math.sqrt(ff * qq)
    return cos, dd, ff, float(np.max(peaks)) if peaks else 0.0, fq, qq


def nonfinite(outs: dict, names) -> list[str]:
    """The float tensors of ``names`` in ``outs`` that hold a NaN or an Inf."""
    return [t for t in names if t in outs and np.asarray(outs[t]).dtype.kind == "f"
            and not np.isfinite(outs[t]).all()]


def warn_left_out(comm, bad: list, what: str, why: str, left: str = "sample(s) left out, {why}") -> None:
    """Say once (rank 0) which samples ``what`` left out and ``why``; ``bad``: this rank's
    (sample index, its files) pairs; ``left``: what befell them. Every process calls it (a gather)."""
    bad = sorted(comm.gather_samples({"_": list(bad)})["_"])
    if comm.rank == 0 and bad:
        log.warning("%s: %d %s: %s%s; check those inputs (a fully padded sequence, an empty image) or leave them "
                    "out of the data", what, len(bad), left.format(why=why),
                    "; ".join(w for _, w in bad[:3]), " ..." if len(bad) > 3 else "")


def pooled_cosine(ff: float, qq: float, fq: float) -> float:
    """Cosine from the sums over all samples (for tensors of one value per sample)."""
    if ff == 0.0 and qq == 0.0:
        return 1.0
    if ff == 0.0 or qq == 0.0:
        return 0.0
    return fq / math.sqrt(ff * qq)


def profile_targets(graph, placement, layers: bool, taps: dict | None = None) -> dict[str, tuple[str, str]]:
    """tensor -> (node name, op type) for quantized nodes' float outputs, plus network outputs.
    ``taps``: node -> the tensor that holds its output as the input model has it, where an edit
    moved it (a MatMul whose input trt's activation shift moved: the Add after it)."""
    targets = {}
    taps = taps or {}
    if layers:
        quantized = set(placement.quantized_nodes)
        for node in graph.topological_nodes():
            if node.name in quantized:
                outs = [taps[node.name]] if node.name in taps else node.output
                for out in outs:
                    if out and graph.is_float(out):
                        targets.setdefault(out, (node.name, node.op_type))
    for out in graph.output_names:
        prod = graph.producer.get(out)
        targets[out] = (prod.name if prod else out, prod.op_type if prod else "Input")
    return targets


class ExactSum:
    """The correctly rounded sum of floats added one by one, in any order and across processes:
    the exact sum is held as non-overlapping partials (Shewchuk 1997, the algorithm behind
    ``math.fsum``), a few floats whatever the count. Non-finite values are tracked apart."""

    __slots__ = ("partials", "nan", "pos_inf", "neg_inf")

    def __init__(self):
        self.partials: list[float] = []
        self.nan = self.pos_inf = self.neg_inf = False

    def add(self, x: float) -> None:
        x = float(x)
        if not math.isfinite(x):
            if x != x:
                self.nan = True
            elif x > 0:
                self.pos_inf = True
            else:
                self.neg_inf = True
            return
        partials, i = self.partials, 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                partials[i] = lo
                i += 1
            x = hi
        partials[i:] = [x]

    def merge(self, other: "ExactSum") -> None:
        for x in other.partials:
            self.add(x)
        self.nan |= other.nan
        self.pos_inf |= other.pos_inf
        self.neg_inf |= other.neg_inf

    def value(self) -> float:
        if self.nan or (self.pos_inf and self.neg_inf):
            return math.nan
        if self.pos_inf or self.neg_inf:
            return math.inf if self.pos_inf else -math.inf
        return math.fsum(self.partials)


class ErrorStats:
    """One tensor's error over the samples seen: count, exact sums of cosine, error and signal
    energy, the lowest cosine and the largest |error| (NaN samples counted apart; samples whose
    quantized tensor has another size than the float one are not added, only counted: ``resized``)."""

    __slots__ = ("n", "cos", "err", "sig", "min_cos", "max_abs", "nan", "fq", "qq", "tiny", "resized")

    def __init__(self):
        self.n, self.cos, self.err, self.sig = 0, ExactSum(), ExactSum(), ExactSum()
        self.min_cos, self.max_abs, self.nan, self.resized = math.inf, 0.0, 0, 0
        self.fq, self.qq, self.tiny = ExactSum(), ExactSum(), True

    def add(self, cos: float, err: float, sig: float, max_abs: float, fq: float | None = None,
            qq: float | None = None, size: int | None = None) -> None:
        self.n += 1
        self.cos.add(cos)
        self.err.add(err)
        self.sig.add(sig)
        if fq is None or size is None or size >= TINY:
            self.tiny = False
        else:
            self.fq.add(fq)
            self.qq.add(qq)
        if cos != cos or max_abs != max_abs:
            self.nan += 1
        if cos == cos:
            self.min_cos = min(self.min_cos, cos)
        if max_abs == max_abs:
            self.max_abs = max(self.max_abs, max_abs)

    def cosine(self) -> tuple[float, float]:
        """(mean cosine, lowest cosine): per sample, or over the samples together for a tensor of
        one value per sample (both then that one pooled cosine)."""
        if self.tiny and self.n:
            c = pooled_cosine(self.sig.value(), self.qq.value(), self.fq.value())
            return c, c
        return (self.cos.value() / self.n if self.n else math.nan,
                self.min_cos if self.min_cos != math.inf else math.nan)

    def merge(self, other: "ErrorStats") -> "ErrorStats":
        self.n += other.n
        for a, b in ((self.cos, other.cos), (self.err, other.err), (self.sig, other.sig),
                     (self.fq, other.fq), (self.qq, other.qq)):
            a.merge(b)
        self.tiny = self.tiny and other.tiny
        self.min_cos = min(self.min_cos, other.min_cos)
        self.max_abs = max(self.max_abs, other.max_abs)
        self.nan += other.nan
        self.resized += other.resized
        return self


def grid_bounds(plan, places, floored=()) -> dict[str, tuple[float, float, float]]:
    """tensor -> (lowest and highest value its per-tensor grid represents, its step) for every
    quantized activation; a value more than half a step beyond them saturates. ``floored``: the
    Softmax inputs whose grid starts at a floor on purpose (calibrate.softmax_floors): what lies
    below it weighs nothing in the Softmax, so only their top end counts (a -1e4 or float32.min
    mask clipped there topped the saturation table at 1e80x its rounding noise)."""
    out = {}
    for t in places.activations:
        qp = plan.activations.get(t)
        if qp is None or qp.axis is not None or np.ndim(qp.scale) != 0:
            continue
        scale, zp = float(qp.scale), float(qp.zero_point)
        lo, hi = (qp.qmin - zp) * scale, (qp.qmax - zp) * scale
        out[t] = (-math.inf if t in floored else lo, hi, scale)
    return out


class Clipped:
    """One quantized activation's values beyond its grid over the profile's samples: exact counts
    and an exact sum of the squared saturation error (mergeable across processes in any order),
    and the largest value relative to the grid's edge."""

    __slots__ = ("beyond", "total", "lost", "peak", "step", "nan")

    def __init__(self, step: float = 0.0):
        self.beyond, self.total, self.lost, self.peak, self.step, self.nan = 0, 0, ExactSum(), 0.0, step, 0

    def add(self, x: np.ndarray, bounds) -> None:
        lo, hi, step = bounds
        lo_edge, hi_edge = lo - 0.5 * step, hi + 0.5 * step
        x = x.reshape(-1)
        self.total += int(x.size)
        if not x.size:
            return
        top = float(x.max())
        if top != top:      # a NaN (max propagates it): counted apart, the other values measured
            finite = x[~np.isnan(x)]
            self.nan += int(x.size - finite.size)
            x = finite
            if not x.size:
                return
            top = float(x.max())
        bottom = float(x.min())
        self.peak = max(self.peak, top / hi if hi > 0 and top > 0 else 0.0,
                        bottom / lo if lo < 0 and bottom < 0 else 0.0)
        if top <= hi_edge and bottom >= lo_edge:
            return
        out = x[(x > hi_edge) | (x < lo_edge)].astype(np.float64)
        self.beyond += int(out.size)
        with np.errstate(invalid="ignore", over="ignore"):
            d = out - np.clip(out, lo, hi)
            # numpy's own pairwise sum: the same bits whatever BLAS threads the process has (MPI)
            self.lost.add(float(np.sum(d * d)))

    def noise_ratio(self) -> float:
        """Saturation noise per value over the grid's rounding noise (step^2 / 12): above 1, the
        saturated values cost more than the rounding of all the others."""
        if not self.total or self.step <= 0:
            return 0.0
        return self.lost.value() / self.total / (self.step ** 2 / 12.0)

    def merge(self, other: "Clipped") -> "Clipped":
        self.beyond += other.beyond
        self.total += other.total
        self.lost.merge(other.lost)
        self.peak = max(self.peak, other.peak)
        self.step = self.step or other.step
        self.nan += other.nan
        return self


def _warn_hidden(comm, hidden: dict, targets: dict, mine: int) -> None:
    """Say once (rank 0) which layers' float tensors held a NaN or Inf on some samples that the
    network outputs did not show (a masked softmax of a padded sequence), and that their rows
    leave those samples out (a row left with none is not shown)."""
    parts = comm.allgather((hidden, mine))
    if comm.rank != 0:
        return
    total, counts = sum(n for _, n in parts), {}
    for h, _ in parts:
        for t, k in h.items():
            counts[t] = counts.get(t, 0) + k
    if not counts:
        return
    worst = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    gone = sum(1 for _, k in worst if k >= total)
    log.warning("error profile: %d layer tensor(s) hold NaN or Inf in the float model on some samples, which the "
                "network outputs do not show: %s; their rows leave those samples out%s; check those layers "
                "(a mask of -inf through a softmax, a log of 0)", len(worst),
                ", ".join(f"{t} ({targets[t][0]}, {k} of {total} samples)" for t, k in worst[:4])
                + (" ..." if len(worst) > 4 else ""),
                f", and {gone} row(s) with no sample left are not shown" if gone else "")


def collect_errors(graph, qmodel, data, indices, targets: dict, comm, device="cpu", on_float=None, grids=None,
                   floors=None):
    """({tensor: ErrorStats} merged over every process, {network output: (sample, cosine, mean
    square of the float output) in sample order}, {quantized activation: Clipped}); all complete on rank 0. ``grids``
    (:func:`grid_bounds`): the activations whose values beyond their grid are counted, as the
    quantized model computes them just before their Q. ``floors``: {Softmax input: its grid's
    floor} (calibrate.softmax_floors): its row compares the values the float model has at or above
    the floor, as a value below it weighs under 2e-9 in the Softmax; a mask of -inf or of
    float32's lowest (GPT-2's, summed twice) had made every sample's sums non-finite and the
    attention scores' rows vanished from the report (found by a hunt)."""
    floors = dict(floors or {})
    names = list(targets)
    grids = dict(grids or {})
    inputs = {i.name for i in qmodel.graph.input}
    # the tensor each Q reads: a quantized network output keeps its name on the DQ's output, and
    # its producer writes <t>_float (qdq.py), which is what saturates
    producers = {o: n for n in qmodel.graph.node for o in n.output}
    before_q = {t: dq_source(producers, t) or t for t in grids}
    exposed = names + list(dict.fromkeys(s for s in before_q.values() if s not in names and s not in inputs))
    outputs = [t for t in names if t in set(graph.output_names)]
    fp = Runner(graph.model, names, types=graph.types, device=device)
    qr = Runner(qmodel, exposed, types=graph.types, optimize=SIMULATE, device=device, quantized=True)
    stats = {t: ErrorStats() for t in names}
    clipped = {t: Clipped(b[2]) for t, b in grids.items()}
    out_cos: dict[str, list] = {t: [] for t in outputs}
    bad, bad_outputs = [], set()
    hidden: dict[str, int] = {}     # layer tensor -> samples on which the float model holds a NaN/Inf there
    for i in progress(indices, "error profile", comm):
        feed = data.sample(i)
        f_out, _ = fp.run(feed)
        if on_float is not None:
            on_float(i, f_out)
        q_out, _ = qr.run(feed)
        inside = []
        for t in names:
            if f_out[t].size != q_out[t].size:
                # a value-dependent size the quantization moved (NonZero, NMS): no value-by-value
                # comparison on this sample; left out for this tensor and sample only (its NaN made
                # the whole output unscored)
                stats[t].resized += 1
                continue
            if t in floors:
                f_t, q_t = np.asarray(f_out[t]), np.asarray(q_out[t])
                live = f_t >= floors[t]                     # NaN and the mask's values fall out
                if not live.any():
                    continue
                m = sample_sums(f_t[live], q_t[live])
            else:
                m = sample_sums(f_out[t], q_out[t])
            if not math.isfinite(m[2]):
                # the float tensor holds a NaN or an Inf: no error is defined against it (scored,
                # it made every mean in the report NaN); left out for this tensor and sample only
                if t in out_cos:
                    if not bad or bad[-1][0] != i:
                        bad.append((i, sample_name(feed, i)))
                    bad_outputs.add(t)
                else:
                    inside.append(t)
                continue
            stats[t].add(*m, size=f_out[t].size)
            if t in out_cos:
                # sample, cosine, float output energy per value (windows of other sizes compare)
                out_cos[t].append((i, m[0], m[2] / max(f_out[t].size, 1)))
        if inside and not (bad and bad[-1][0] == i):     # the outputs show it: said with the sample
            for t in inside:
                hidden[t] = hidden.get(t, 0) + 1
        for t, c in clipped.items():
            src = before_q[t]
            c.add(np.asarray(feed[src] if src in inputs else q_out[src]), grids[t])
    names_bad = sorted(set().union(*comm.allgather(sorted(bad_outputs))))
    warn_left_out(comm, bad, f"error profile of {', '.join(names_bad[:3])}", "the float model's output is NaN "
                  "or Inf on them")
    _warn_hidden(comm, hidden, targets, len(list(indices)))
    gathered = comm.gather_samples({t: [st] for t, st in stats.items()})
    merged = {}
    for t, parts in gathered.items():
        merged[t] = ErrorStats()
        for part in parts:
            merged[t].merge(part)
    clips = {}
    for t, parts in comm.gather_samples({t: [c] for t, c in clipped.items()}).items():
        clips[t] = Clipped(grids[t][2])
        for part in parts:
            clips[t].merge(part)
    cosines = comm.gather_samples(out_cos)
    return merged, {t: sorted(v) for t, v in cosines.items()}, clips


def summarize(stats: dict, targets: dict, outputs: list[str], quantized=()) -> list[ErrorRow]:
    """One row per layer tensor and one per network output (a quantized layer's output that is
    also a network output gets both)."""
    quantized = set(quantized)
    rows = []
    for t, st in stats.items():
        if not st.n:
            continue
        err, sig = st.err.value(), st.sig.value()
        sqnr = sqnr_db(sig, err)
        node, op = targets[t]
        mean_cos, min_cos = st.cosine()
        # no sample compared (each NaN, or of another size): no largest error either
        values = (mean_cos, min_cos, sqnr, st.max_abs if st.nan < st.n else math.nan)
        if t not in outputs or node in quantized:
            rows.append(ErrorRow(t, node, op, *values, False, st.tiny, st.resized))
        if t in outputs:
            rows.append(ErrorRow(t, node, op, *values, True, st.tiny, st.resized))
    return rows
