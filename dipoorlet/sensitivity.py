"""Where accuracy is lost: isolated layer sensitivity and automatic mixed precision.

*Isolated* error of a node: the model with only that node's inputs and weights quantized,
everything else float, measured at the network outputs against the float model (on the logits
when an output is a Softmax). It answers "what
does quantizing this layer cost by itself", which the cumulative profile cannot (there, every
layer inherits the error of all layers before it).

Cost: one pass of the full model per quantized node over the sensitivity samples (``--sens_samples``,
default 8; sharded across MPI ranks, held in memory), plus one float pass per sample for the
reference outputs. Every variant runs in one onnxruntime session (:class:`~dipoorlet.qdq.Switchboard`:
each layer's Q/DQ switched by a boolean input, weights fed float or fake-quantized), not one
session per variant: building those cost three times the inference (MiniLM, 48 layers: the whole
run 47.7 s -> 15.0 s, same scores to float32 rounding).
We chose whole-model passes over extracting each node's downstream subgraph: the downstream part
is on average half the model, but extracting it needs the float values of every tensor crossing
the cut for every sample, which would either be stored (memory growing with N) or recomputed.
For the worst layers, two more passes split the error into its weight-only and activation-only
parts. With bias correction, a layer scored alone takes the correction a run quantizing it alone
measures (:func:`~dipoorlet.bias_correction.isolated`); variants of several layers keep the whole
model's, as the model ``--auto_skip`` writes does (correcting them for the float layers did worse
on three of five models, README).

``auto_skip`` greedily keeps the most sensitive layers in float until the network output meets a
target (cosine or SQNR) or a maximum number of float layers is reached, re-measuring the whole
model after each step; a layer whose float version does not improve the output is quantized
again (layer errors interact: the isolated ranking is a guide, not a guarantee). It reports what
each step bought.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from dipoorlet.progress import progress
from dipoorlet.data import sample_name, with_extra
from dipoorlet.layer_errors import TINY, nonfinite, pooled_cosine, sample_sums, warn_left_out
from dipoorlet.util import nan_worst, sqnr_db
from dipoorlet.qdq import Switchboard
from dipoorlet.runtime import Runner
from dipoorlet.threads import session_threads, usable_cores

log = logging.getLogger(__name__)

CRITERIA = ("cosine", "sqnr", "maxabs")

# The scoring sessions run on one onnxruntime thread each, and the sensitivity samples run
# side by side on this process's share of the cores (at most MAX_WORKERS). The switchboard
# feeds the weights as inputs, which onnxruntime's GEMM does not pack once: it splits the output
# columns over its threads and blocks the sum by each thread's slice, so its float32 results
# changed with the thread count, and with them the scores between one process (2 threads) and
# mpirun -n 2 (one each): the PP-OCRv4 recognizer's p2o.MatMul.12 read 54.03 dB against 53.99. One thread per
# run gives every process count and every machine the same scores.
THREADS = 1
# at most this many samples at once: each run holds its own activations (hundreds of MB for a
# detector at 1280x1280), so a machine with more cores leaves the rest idle in this analysis
MAX_WORKERS = 4


@dataclass
class OutputScore:
    """Error at the network outputs; the worst output counts for multi-output models."""
    cosine: float
    sqnr_db: float
    max_abs_err: float

    def value(self, criterion: str) -> float:
        return {"cosine": self.cosine, "sqnr": self.sqnr_db, "maxabs": -self.max_abs_err}[criterion]

    def rank(self, criterion: str) -> float:
        """:meth:`value` for ordering: NaN (a variant whose output is NaN or Inf) is the worst,
        not a key that leaves ``sorted`` in an arbitrary order."""
        return nan_worst(self.value(criterion))


RESHAPING = ("Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze")   # same values, another shape


def scored_tensor(graph, output: str) -> str:
    """The tensor sensitivity is measured on: a Softmax output is scored on its logits.

    Probabilities of a confident classifier barely move until a decision flips, so their cosine
    ranks layers by noise; the logits show every layer's effect smoothly.
    """
    prod = graph.producer.get(output)
    # exporters often end a classifier with Softmax -> Identity (paddle2onnx's scale_0 output),
    # and the opset conversion of a Softmax below opset 13 wraps it in Reshapes
    while prod is not None and prod.op_type in RESHAPING:
        prod = graph.producer.get(prod.input[0])
    if prod is not None and prod.op_type == "Softmax" and graph.is_float(prod.input[0]):
        return prod.input[0]
    return output


class Scorer:
    """Scores quantized variants of one model against float outputs computed once per sample."""

    def __init__(self, graph, data, indices, comm, device="cpu", criterion="cosine", outputs=()):
        """``outputs``: the network outputs to score (--score_outputs; default every output)."""
        self.criterion = criterion
        self.graph, self.data, self.indices, self.comm, self.device = graph, data, list(indices), comm, device
        self.outputs = [scored_tensor(graph, o) for o in (outputs or graph.output_names)]
        self.workers = 1 if device == "cuda" else min(MAX_WORKERS, session_threads() or usable_cores())
        self._pool = None
        fp = self._runner(graph.model, optimize=True)
        # The (few) sensitivity samples are held in memory: each is run once per variant.
        self.samples = {i: data.sample(i) for i in self.indices}
        # Float reference outputs of those samples: network outputs only.
        self.reference = dict(zip(self.indices, self._map(lambda i: fp.run(self.samples[i])[0], self.indices)))
        bad = [i for i in self.indices if nonfinite(self.reference[i], self.outputs)]
        for i in bad:       # no error is defined against a NaN: it would rank every layer alike
            del self.reference[i]
        warn_left_out(comm, [(i, sample_name(self.samples.pop(i), i)) for i in bad],
                      "sensitivity", "the float model's scored output is NaN or Inf on them")
        self.indices = [i for i in self.indices if i not in bad]
        # over every process: with none left, a variant's score would read cosine 0 as if measured
        self.count = int(comm.allreduce_sum(np.array([len(self.indices)], dtype=np.int64))[0])
        self._board = None
        self._mixed = None   # (places, plan, off_plan) -> board of --auto_a16's 8/16-bit trials

    def score(self, qmodel, per_sample: bool = False):
        """Score one quantized model (its own session); ``per_sample``: (score, every sample's
        squared error summed over the scored outputs, in sample order)."""
        return self._score(self._runner(qmodel), {}, per_sample)

    def board(self, places, plan):
        """One session holding every variant of ``places`` (see :class:`~dipoorlet.qdq.Switchboard`)."""
        if self._board is None or self._board[0] is not places or self._board[1] is not plan:
            sb = Switchboard(self.graph, places, plan)
            if self.device == "cuda":
                sb.place_on("cuda")
            self._board = (places, plan, sb, self._runner(sb.model))
        return self._board[2], self._board[3]

    def _runner(self, model, optimize=False) -> Runner:
        threads = 0 if self.device == "cuda" else THREADS
        return Runner(model, self.outputs, types=self.graph.types, optimize=optimize, device=self.device,
                      threads=threads, quantized=model is not self.graph.model)

    def _map(self, fn, items: list) -> list:
        """``fn`` over ``items`` in order, up to ``workers`` at once (onnxruntime releases the GIL)."""
        if self.workers <= 1 or len(items) <= 1:
            return [fn(i) for i in items]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="dipoorlet-sens")
        return list(self._pool.map(fn, items))

    def release(self) -> None:
        """Drop the switchboard sessions (and their weight copies); the reference outputs stay."""
        self._board = None
        self._mixed = None

    def score_mixed(self, places, plan, off_plan, acts, weights) -> OutputScore:
        """Score ``places`` with ``acts``' activations on ``plan``'s grids and every other
        quantized activation on ``off_plan``'s (a second board, built once)."""
        key = (places, plan, off_plan)
        if self._mixed is None or any(a is not b for a, b in zip(self._mixed[0], key)):
            self._mixed = None   # one extra session at a time
            sb = Switchboard(self.graph, places, plan, off_plan=off_plan)
            if self.device == "cuda":
                sb.place_on("cuda")
            self._mixed = (key, sb, self._runner(sb.model))
        _, sb, runner = self._mixed
        return self._score(runner, sb.feed(acts, weights if weights is not None else sb.owners))

    def score_variant(self, places, plan, acts, weights, alone: bool = False) -> OutputScore:
        """Score ``places`` with only ``acts``' activations and ``weights``' weights quantized;
        ``alone``: one layer scored by itself, its bias corrected as a run quantizing it alone
        would (see :meth:`~dipoorlet.qdq.Switchboard.feed`)."""
        sb, runner = self.board(places, plan)
        return self._score(runner, sb.feed(acts, weights, alone=alone))

    def _score(self, runner, extra: dict, per_sample: bool = False):
        def one(i):
            q, _ = runner.run(with_extra(self.samples[i], extra))
            return i, [sample_sums(self.reference[i][t], q[t]) + (q[t].size, self.reference[i][t].size)
                       for t in self.outputs]

        rows = self._map(one, self.indices)
        rows = self.comm.gather_samples({"_": rows})["_"]
        rows.sort(key=lambda r: r[0])
        worst = None
        for k, _ in enumerate(self.outputs):
            # a sample whose output size the quantization changed (NonZero, NMS) has no value-by-
            # value error: left out, as the error profile leaves it out (it made every score NaN);
            # where every sample changed, the score is NaN and ranks worst
            same = [r[1][k] for r in rows if r[1][k][6] == r[1][k][7]]
            if not same:
                cos = err = sig = mx = math.nan
            elif all(m[6] < TINY for m in same):   # one cosine over the samples together
                cos = pooled_cosine(math.fsum(m[2] for m in same), math.fsum(m[5] for m in same),
                                    math.fsum(m[4] for m in same))
            else:
                cos = math.fsum(m[0] for m in same) / len(same)
            if same:
                err = math.fsum(m[1] for m in same)
                sig = math.fsum(m[2] for m in same)
                mx = max(m[3] for m in same)
            sqnr = sqnr_db(sig, err) if same else math.nan
            s = OutputScore(cos, sqnr, mx)
            if worst is None or s.rank(self.criterion) < worst.rank(self.criterion):
                worst = s
        if per_sample:
            return self.comm.bcast((worst, [math.fsum(m[1] for m in r[1]) for r in rows]))
        return self.comm.bcast(worst)


@dataclass
class LayerSensitivity:
    node: str
    op_type: str
    isolated: OutputScore
    weight_only: OutputScore | None = None
    activation_only: OutputScore | None = None


def isolated(graph, places, plan, scorer: Scorer, criterion="cosine", split_worst=10) -> list[LayerSensitivity]:
    ops = {d.node: d.op_type for d in places.decisions}
    nodes = list(places.quantized_nodes)
    rows = []
    t0 = time.perf_counter()
    for k, node in enumerate(progress(nodes, "sensitivity: isolated layers", scorer.comm)):
        if k == 1:     # the first variant also built the session
            t0 = time.perf_counter()
        score = scorer.score_variant(places, plan, {node}, {node}, alone=True)
        rows.append(LayerSensitivity(node, ops[node], score))
        if k == 1:
            _announce(time.perf_counter() - t0, len(nodes) + 2 * min(split_worst, len(nodes)), len(scorer.indices))
    for row in sorted(rows, key=lambda r: r.isolated.rank(criterion))[:split_worst]:
        row.weight_only = scorer.score_variant(places, plan, (), {row.node}, alone=True)
        row.activation_only = scorer.score_variant(places, plan, {row.node}, (), alone=True)
    return rows


def _announce(one_s: float, variants: int, samples: int) -> None:
    """Say up front what the analysis will cost when it is long (every variant runs the whole
    model on every sensitivity sample: a 104-layer detector at 800x608 takes minutes). ``one_s``:
    the second variant's time (the first also built the session); two are done."""
    eta = one_s * (variants - 2)
    if eta > 30:
        log.info("sensitivity: %d variants x %d samples of the whole model, about %.0f s more; "
                 "--sens_samples 2 cuts it by %dx, --skip_prof_layer skips it (and the per-layer profile)",
                 variants, samples, eta, max(1, samples // 2))


@dataclass
class AutoSkipResult:
    target: float
    criterion: str
    before: OutputScore
    after: OutputScore
    float_layers: list[str] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    met: bool = False
    candidates: int = 0    # layers the search could choose from (--auto_a16: not the fixed ones)
    measured: OutputScore | None = None    # --auto_a16: the promoted model as written
    last_kept: str | None = None    # --auto_skip: a layer not tried, the last one with a grid
    over_cap: list = field(default_factory=list)   # --auto_skip: groups not tried, past --max_float_layers
    tried_all: bool = False    # --auto_a16/--auto_w8: a trial took every candidate (a larger cap adds none)


def parse_target(text: str, flag: str = "--auto_skip", any_cosine: bool = False) -> tuple[str, float]:
    """``"0.999"`` or ``"cosine:0.999"`` / ``"sqnr:30"`` → (criterion, value).

    ``any_cosine``: a cosine bar anywhere in [-1, 1] (--fail_below: -1 never fails), not a target
    in (0, 1] that a search must reach."""
    from dipoorlet.errors import ConfigError

    crit, _, val = str(text).rpartition(":")
    crit = crit.strip().lower() or "cosine"
    try:
        value = float(val)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected a number or CRITERION:NUMBER, "
                          "e.g. 0.999 or sqnr:30") from None
    if crit not in ("cosine", "sqnr"):
        raise ConfigError(f"{flag} criterion {crit!r}: use cosine or sqnr")
    if not math.isfinite(value):
        raise ConfigError(f"{flag} {text!r}: the target must be a finite number")
    if crit == "cosine" and any_cosine and not -1 <= value <= 1:
        raise ConfigError(f"{flag} cosine bar must be in [-1, 1], got {value}")
    if crit == "cosine" and not any_cosine and not 0 < value <= 1:
        raise ConfigError(f"{flag} cosine target must be in (0, 1], got {value}")
    return crit, value


# ops that only move values: their output's Q/DQ on their input's grid moves none of them
VALUE_MOVING = frozenset({"MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity",
                          "Concat", "Slice", "Split", "DepthToSpace", "SpaceToDepth"})


def _grid_edges(graph, places, plan):
    """(B, A, c) for each quantized activation B whose grid is quantized activation A's scaled by
    c > 0, B computed from A by a multiplication by the scalar constant c (Mul, or Div by 1/c)
    or by an op that only moves values (c = 1: MaxPool, Reshape, Concat...), where every level
    of A's grid lands on the same level of B's (same width and zero point, scales within half a
    level at the grid's ends)."""
    if graph is None or plan is None:     # a search driven without a graph (tests)
        return
    for t, qb in plan.activations.items():
        prod = graph.producer.get(t)
        if prod is None or qb.axis is not None or t not in places.activations:
            continue
        if prod.op_type in ("Mul", "Div") and len(prod.input) == 2:
            a, c = prod.input
            if prod.op_type == "Mul" and graph.is_constant(a):
                a, c = c, a
            if graph.is_constant(a) or not graph.is_constant(c) or graph.weight(c).size != 1:
                continue
            k = float(np.asarray(graph.weight(c), np.float64).reshape(-1)[0])
            sources = [(a, (1.0 / k if k else 0.0) if prod.op_type == "Div" else k)]
        elif prod.op_type in VALUE_MOVING:
            data = prod.input if prod.op_type == "Concat" else prod.input[:1]
            sources = [(a, 1.0) for a in data if a and not graph.is_constant(a)]
        else:
            continue
        for a, k in sources:
            qa = plan.activations.get(a)
            if not (k > 0 and math.isfinite(k)) or qa is None or qa.axis is not None or qa.bits != qb.bits:
                continue
            # level n of A (from the zero point) lands on level n / (1 + d) of B: the same level
            # over the whole grid while |n d| < 1/2 (-A mse's clips are scaled copies to ~5e-4)
            zp = int(qa.zero_point)
            d = float(qb.scale) / (float(qa.scale) * k) - 1.0
            if int(qb.zero_point) == zp and abs(d) * max(abs(qa.qmin - zp), abs(qa.qmax - zp)) < 0.5 * (1 + d):
                yield t, a, k


def grid_copies(graph, places, plan) -> dict[str, tuple[str, float]]:
    """Quantized activations whose grid repeats another's: ``{B: (A, c)}`` (the first such A) for
    the edges of :func:`_grid_edges`. A backend that quantizes a Mul's (or a MaxPool's...) input
    and output rounds the values onto A's grid and then onto B's, which puts them where they
    are: one rounding, not two (PP-LCNetV3's learnable affine blocks, x * a + b after every
    activation, in the PP-OCRv4 detector and recognizer on qnn; a MaxPool's input and output on
    backends that share their grid)."""
    out = {}
    for b, a, k in _grid_edges(graph, places, plan):
        out.setdefault(b, (a, k))
    return out


def grid_partners(graph, places, plan) -> dict[str, list[str]]:
    """For each quantized node reading an activation that :func:`grid_copies` ties to others, the
    other quantized nodes tied to it, directly or through others (closed: every member of a
    group lists all the others, in the graph's order): widening or floating one of them alone
    leaves the rounding in place, on the copy's grid or on its source's (the PP-OCRv4 detector
    on qnn: --layer_bits p2o.Mul.10=a16 alone 9.31 -> 9.52 dB, p2o.Add.14=a16 alone 9.28 dB)."""
    from dipoorlet.qparams import UnionFind

    uf = UnionFind()
    find, union = uf.find, uf.union
    # tensors tied by a copy, and each tensor with the quantized nodes reading it: one
    # union-find over both, so a node reading tensors of two groups joins them
    quantized = list(places.quantized_nodes)
    tied = set()
    for b, a, _ in _grid_edges(graph, places, plan):
        union(("t", a), ("t", b))
        tied.update((a, b))
    is_q = set(quantized)
    for t in sorted(tied):
        if t in places.activations:
            for o in places.activations[t].owners:
                if o in is_q:
                    union(("t", t), ("n", o))
    members: dict = {}
    for n in quantized:                      # in the graph's order, whatever the hash seed
        members.setdefault(find(("n", n)), []).append(n)
    return {n: [m for m in group if m != n] for group in members.values() if len(group) > 1 for n in group}


def _with_partners(order: list[str], partners: dict[str, list[str]], allowed=None) -> list[tuple]:
    """``order`` as groups: each node with its grid partners (those in ``allowed``) not already
    in an earlier group."""
    seen, groups = set(), []
    for n in order:
        if n in seen:
            continue
        group = (n,) + tuple(m for m in partners.get(n, ()) if m not in seen and m != n
                              and (allowed is None or m in allowed))
        seen.update(group)
        groups.append(group)
    return groups


def auto_skip(graph, places, plan, scorer: Scorer, sens: list[LayerSensitivity], criterion: str,
              target: float, max_layers: int) -> AutoSkipResult:
    """Keep the most sensitive layers float, one at a time, until the output meets ``target``.
    A layer whose input's grid another's repeats (:func:`grid_partners`) goes float with it."""
    quantized = list(places.quantized_nodes)
    sb, _ = scorer.board(places, plan)
    before = scorer.score_variant(places, plan, sb.owners, sb.owners)
    res = AutoSkipResult(target, criterion, before, before)
    order = _with_partners([s.node for s in sorted(sens, key=lambda s: s.isolated.rank(criterion))],
                           grid_partners(graph, places, plan), set(quantized))
    res.candidates = len(order)
    current = before
    rejected = []       # (group that gained nothing float, how many layers were float then)

    def attempt(group: tuple, again: str = "") -> None:
        """Score ``group`` float beside the layers kept so far; kept where it gains. ``again``:
        how the log names a second try (which is not remembered as rejected)."""
        nonlocal current
        group = tuple(n for n in group if n not in res.float_layers)
        if not group:
            return
        if len(res.float_layers) + len(group) > max_layers:
            if not again:       # a second try past the cap is simply not made
                res.over_cap.append(" + ".join(group))     # a group that would pass --max_float_layers
                log.info("auto_skip: %s not tried: these layers share one rounding and go float together, past "
                         "--max_float_layers %d", " + ".join(group), max_layers)
            return
        name = " + ".join(group)
        keep = [n for n in quantized if n not in res.float_layers and n not in group]
        left = places.restrict(keep)
        if not left.activations and not left.weights and again:
            return              # a second try that would leave no grid is not made
        if not left.activations and not left.weights:
            # the last layer with a grid: keeping it float too would leave a float model (written
            # with no Q/DQ, its target "met"), which --skip_layers of the same layers refuses
            log.info("auto_skip: %s stays quantized: it is the last layer with a grid", name)
            res.last_kept = name
            return
        trial = scorer.score_variant(places, plan, keep, keep)
        helped = trial.rank(criterion) > current.rank(criterion)   # NaN: the worst
        res.steps.append({"float_layer": name, "cosine": trial.cosine, "sqnr_db": trial.sqnr_db,
                          "kept": helped} | ({"again": again} if again else {}))
        log.info("auto_skip: %s float%s -> output cosine %.6f, SQNR %.2f dB%s", name,
                 f" ({again})" if again else "", trial.cosine, trial.sqnr_db,
                 "" if helped else " (no gain: quantized again)")
        if helped:
            res.float_layers.extend(group)
            current = trial
        elif not again:
            rejected.append((group, len(res.float_layers)))

    done = lambda: current.value(criterion) >= target or len(res.float_layers) >= max_layers
    if current.value(criterion) >= target:     # said, not only in report.json (found by a hunt)
        log.info("auto_skip: target %s %s met with every layer quantized (%s %.6f over the sensitivity samples)",
                 criterion, target, criterion, current.value(criterion))
    for group in order[:3 * max_layers]:  # bounded: at most 3 trials per float layer allowed
        if done():
            break
        attempt(group)
    # the layers without a gain once more, beside those kept float since: a layer may only help
    # with another (one whose outlier output the next layer reads: either float alone gained
    # nothing, both together 7.5 -> 18.4 dB; found by a hunt)
    for group, floats_then in list(rejected):
        if done():
            break
        if len(res.float_layers) > floats_then:      # something changed beside it since
            attempt(group, "again, beside the layers kept float since")
    # and the three most sensitive of them two by two: a pair that helps only together (the
    # hunt's two layers: 7.5 dB either alone, 18.4 dB together)
    top = [g for g, _ in rejected[:3]]
    for a, b in itertools.combinations(top, 2):
        if done():
            break
        if not set(a + b) & set(res.float_layers):
            attempt(a + b, "together")
    res.after = current
    res.met = current.value(criterion) >= target
    return res


def auto_a16(graph, places, plan, scorer: Scorer, sens: list[LayerSensitivity], criterion: str,
             target: float, max_layers: int | None, fixed: set = frozenset(), wide_plan=None) -> AutoSkipResult:
    """The fewest most-sensitive layers whose inputs on 16-bit grids meet ``target`` (--auto_a16).

    A trial puts the activation inputs of the ``k`` most sensitive layers (isolated score) on
    their 16-bit grids from ``wide_plan`` and keeps every weight quantized (without a
    ``wide_plan``, those inputs stay float: the stand-in, which a 16-bit grid does not always
    match: a square root of 16-bit-rounded powers near zero in a VAD's STFT). The search is
    :func:`_promote_search`'s. The chosen layers' inputs then get 16-bit grids and the error
    profile measures the model as written. Layers in ``fixed`` (an explicit --layer_bits
    NODE=aM) are not candidates: the promotion would not change them, and a trial that scored
    them as 16-bit would report a target the written model misses."""
    quantized = list(places.quantized_nodes)
    sb, _ = scorer.board(places, plan)
    order = [s.node for s in sorted(sens, key=lambda s: s.isolated.rank(criterion)) if s.node not in fixed]
    # a layer whose input's grid another's repeats is widened with it (grid_partners)
    order = _with_partners(order, grid_partners(graph, places, plan), set(order))

    def score(wide: set) -> OutputScore:
        acts = [n for n in quantized if n not in wide]
        return (scorer.score_mixed(places, plan, wide_plan, acts, None) if wide_plan is not None
                else scorer.score_variant(places, plan, acts, sb.owners))

    how = "on 16-bit grids" if wide_plan is not None else "float (as 16-bit)"
    return _promote_search(scorer, places, plan, order, score, criterion, target, max_layers, "a16",
                           f"the %d most sensitive layers' inputs {how}")


def auto_w8(graph, places, plan, scorer: Scorer, sens: list[LayerSensitivity], criterion: str,
            target: float, max_layers: int | None, candidates: set, wide_plan) -> AutoSkipResult:
    """The fewest most-sensitive layers whose weights on ``wide_plan``'s grids (the backend's
    own width, 8 bits) meet ``target`` (--auto_w8, for models quantized with narrower weights).
    A trial keeps every activation and every other weight on its narrow grid; only layers in
    ``candidates`` (narrow weights, no explicit --layer_bits NODE=wN) are tried."""
    sb, _ = scorer.board(places, plan)
    order = [s.node for s in sorted(sens, key=lambda s: s.isolated.rank(criterion)) if s.node in candidates]

    def score(wide: set) -> OutputScore:
        return scorer.score_mixed(places, plan, wide_plan, sb.owners, sb.owners - set(wide))

    return _promote_search(scorer, places, plan, order, score, criterion, target, max_layers, "w8",
                           "the %d most sensitive layers' weights on 8-bit grids")


def _promote_search(scorer: Scorer, places, plan, order: list, score, criterion: str, target: float,
                    max_layers: int | None, kind: str, what: str) -> AutoSkipResult:
    """The smallest ``k`` such that promoting the first ``k`` of ``order`` (``score(set)``
    scores a promotion) meets ``target``: ``k`` doubles until the target is met (or
    ``max_layers``, default every candidate, is reached; missing it there, all ``max_layers``
    are kept), then a bisection finds the ``k`` that meets it where ``k - 1`` does not (the
    score over a few samples is not monotone in ``k``, so not always the smallest such ``k``):
    about 2 log2(k) trials instead of one per layer, so models whose loss is spread over many
    layers (a recognizer, a transformer) get as many as they need."""
    sb, _ = scorer.board(places, plan)
    before = scorer.score_variant(places, plan, sb.owners, sb.owners)
    res = AutoSkipResult(target, criterion, before, before)
    # ``order``'s entries are layers or groups of layers promoted together (grid_partners); k
    # counts entries, max_layers and the report count layers
    groups = [tuple(e) if isinstance(e, (tuple, list)) else (e,) for e in order]
    first = lambda k: [n for grp in groups[:k] for n in grp]
    cap = len(groups)
    while max_layers is not None and cap and len(first(cap)) > max_layers:
        cap -= 1
    res.candidates = len(first(len(groups)))
    tried: dict[int, OutputScore] = {0: before}

    def trial(k: int) -> OutputScore:
        if k not in tried:
            layers = first(k)
            tried[k] = score(set(layers))
            res.steps.append({f"{kind}_layers": len(layers), "cosine": tried[k].cosine, "sqnr_db": tried[k].sqnr_db})
            log.info(f"auto_{kind}: {what} -> output cosine %.6f, SQNR %.2f dB", len(layers), tried[k].cosine,
                     tried[k].sqnr_db)
        return tried[k]

    ok = lambda k: trial(k).value(criterion) >= target
    if ok(0) or cap == 0:
        res.met = ok(0)
        if res.met:
            log.info("auto_%s: target %s %s met with no layer promoted (%s %.6f over the sensitivity samples)",
                     kind, criterion, target, criterion, before.value(criterion))
        return res
    lo, hi = 0, 1                      # lo fails; find a hi that meets the target
    while not ok(hi):
        lo = hi
        if hi >= cap:
            break
        hi = min(2 * hi, cap)
    if ok(hi):
        while hi - lo > 1:             # smallest k in (lo, hi] that meets it
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    else:
        # even ``cap`` layers miss it: keep them all. Not the best prefix tried: the score over a
        # few samples is not monotone in k (weight and activation errors partly cancel), and on
        # the PP-OCRv5 recognizer (qnn) the best-scoring prefix, 16 of 165 layers, read 0.44
        # exact match where all 165 read 0.65. But never a set that scores below none at all on the
        # very samples searched (a --auto_a16 search on the PP-OCR classifier kept 3 layers scoring
        # 0.9973 against 0.9987 without them): then none
        hi = cap
        if trial(cap).rank(criterion) < before.rank(criterion):
            log.warning(f"auto_{kind}: even {len(first(cap))} layers miss the target and score below none at all "
                        f"(%.6g against %.6g); none is kept", trial(cap).value(criterion), before.value(criterion))
            hi = 0
    res.float_layers = first(hi)
    res.after = tried[hi]
    res.met = ok(hi)
    res.tried_all = len(groups) in tried
    return res


def channel_ranges(node, w: np.ndarray) -> np.ndarray | None:
    """max |w_c| over each output channel of ``node``'s weight ``w`` (None when it has none): a
    MatMul's columns (the last axis, across the batches of a batched weight), a grouped
    ConvTranspose's C_out channels (its [C_in, C_out/group, k...] weight holds group blocks of
    input channels, each for its own C_out/group outputs; axis 1 alone merged the groups, and a
    batched MatMul weight was measured along its rows: 16 rows at 1.6x where its 8 columns are
    9.1x apart, found by a bug hunt)."""
    if node.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or w.ndim < 2:
        return None
    if node.op_type == "ConvTranspose":
        group = next((int(a.i) for a in node.attribute if a.name == "group"), 1) or 1
        if group > 1 and w.shape[0] % group == 0:
            blocks = w.reshape((group, w.shape[0] // group) + w.shape[1:])      # [g, C_in/g, C_out/g, k...]
            w = np.moveaxis(blocks, 2, 1).reshape((group * w.shape[1], -1))      # [C_out, C_in/g * k...]
            return np.abs(w).max(axis=1)
        axis = 1
    elif node.op_type == "MatMul":
        axis = w.ndim - 1
    else:
        axis = 0 if node.op_type == "Conv" or any(a.name == "transB" and a.i for a in node.attribute) else 1
    return np.abs(np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)).max(axis=1)


def spread_of(amax: np.ndarray) -> float:
    """Largest channel range over the median one, among the live channels: dead or pruned ones
    (all but 0 beside the layer's largest) get no levels on any grid worth counting, and with half
    the channels dead the median was 0 and the spread infinite."""
    from dipoorlet.equalize import DEAD

    top = float(amax.max()) if amax.size else 0.0
    live = amax[amax > DEAD * top]
    if top <= 0 or live.size == 0:
        return 1.0
    return float(top / float(np.median(live)))


def weight_spread(graph, places) -> list[dict]:
    """Per-channel range spread of each weight: max over channels of max|w_c| / median of them.

    On per-tensor platforms a large spread means most channels get only a few integer levels
    (the reference tool's "degradation by per layer" list); cross-layer equalization fixes it.
    """
    rows = []
    for wp in places.weights.values():
        amax = channel_ranges(graph.node_by_name[wp.node], graph.weight(wp.tensor).astype(np.float32)) \
            if wp.index == 1 else None
        if amax is not None:
            rows.append({"node": wp.node, "weight": wp.tensor, "channels": int(amax.size), "spread": spread_of(amax)})
    return sorted(rows, key=lambda r: -r["spread"])
