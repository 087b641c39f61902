"""Output-aware weight rounding from second-moment statistics (``--gptq``).

Rounding every weight to its nearest grid point minimizes the weight's own error, not the layer
output's. For a linear layer (Conv, Gemm, MatMul with a constant weight; a ConvTranspose whose
kernel equals its stride, a product per input pixel) the output error over
the calibration data is a quadratic form in the weights, fixed by second moments of the layer's
input. With ``x`` the layer's input in the quantized model *before* its Q/DQ, clipped to the
grid's range, and ``x̃`` after it (the value the layer reads),

    E(Wq) = sum ||W x - Wq x̃||^2 = tr(W Hxx W^T) - 2 tr(W Hc Wq^T) + tr(Wq H Wq^T)
    H = sum x̃ x̃^T,   Hc = sum x x̃^T,   Hxx = sum x x^T

summed over samples and, for a Conv, over the input patches of up to ``MAX_POSITIONS`` output
positions per sample (drawn with a seed per sample index; fewer where the samples already give
``ROWS_PER_INPUT`` rows per weight column, see :func:`positions`). The weights minimizing E without a
grid are ``W* = W Hc H^-1`` (ridge-regularized towards W): the layer compensates the rounding
of its own input (not its clipping, which the range method chose: a few clipped outliers would
otherwise decide every weight). E(Wq) = ||(Wq - W*) X̃||^2 + const, which GPTQ (Frantar et al.,
ICLR 2023) minimizes over the grid: columns are rounded in decreasing order of H's diagonal,
each one's rounding error spread over the columns not yet rounded through the Cholesky factor of
H^-1. A layer with a bias adds a column of ones that is never rounded, so the bias absorbs the
mean of what is left (bias correction, generalized).

Why the layer's *own* input and not the float model's: every layer is solved from one pass, and
a target of the float model's input makes each layer also undo every upstream layer's error,
which the upstream layers are undoing at the same time (measured: the PP-OCR classifier's
agreement fell from 96.3% to 88.5%). Compensating only its own input's quantization counts every
error once. A sequential variant (session 11: float target, stage by stage, the layers upstream
already re-rounded, so nothing is undone twice) lost too: the PP-OCRv4 detector's map cosine
0.984 against 0.988, the classifier 95.3% against 96.0%.

Each layer keeps the grid (scales, zero points) the plan gave it; only which grid point each
weight takes, and its bias, change, and only where the statistics say E falls. The statistics
are accumulated exactly (multiples of a fixed unit in units of the input's grid step, see
:func:`statistics`): exact sums are the same in any order, so an MPI run gives the same weights
as one process, byte for byte. Memory holds two K x K matrices per layer of the current pass
(K = input channels x kernel taps of one group; ``--gptq_memory`` sets how many layers share a
pass) and at most ``CHUNK`` + ``MAX_POSITIONS`` patch columns per layer at a time; a pass
exposes its layers' inputs, before and after their Q/DQ, one sample at a time (as ``--bc``
does). Nothing grows with N.
"""
from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass

import numpy as np

from dipoorlet.bias_correction import _bcast
from dipoorlet.data import sample_name
from dipoorlet.errors import ModelError
from dipoorlet.graph import node_attr
from dipoorlet.placement import left_weight
from dipoorlet.layer_errors import warn_left_out
from dipoorlet.progress import progress
from dipoorlet.qdq import append_watch, dq_source, insert_qdq, nan_free
from dipoorlet.qparams import quantize_array
from dipoorlet.runtime import SIMULATE, Runner

log = logging.getLogger(__name__)

MAX_POSITIONS = 1024      # Conv output positions (MatMul rows) drawn per sample and layer, at most;
ROWS_PER_INPUT = 64       # fewer where all samples together give this many rows per weight column
MIN_POSITIONS = 256       # without them, but never fewer than this per sample: fewer lost accuracy
CHUNK = 256               # columns gathered (over samples, or of one sample) per product
EXACT32 = 2 ** 24         # float32 holds every integer below this exactly
SEED = 20241123
MIN_ROWS_PER_INPUT = 4    # a layer is fitted only on at least this many input rows per weight column
DEFAULT_SAMPLES = 256     # --gptq_samples when not given (at most N)
MEMORY_MB = 256           # --gptq_memory: statistics held at once; more passes beyond it
DAMP = 0.01               # ridge and GPTQ damping, relative to the mean of H's diagonal


@dataclass
class Layer:
    node: str
    op_type: str
    weight: str
    bias: str | None
    pre: str          # the layer's input tensor before its Q/DQ (a float-graph tensor)
    xq: str           # the quantized model's tensor the layer reads (after its Q/DQ)
    step: float       # the input grid's scale
    zero_point: float
    qmin: int = -128  # the input grid's integer range
    qmax: int = 127
    group: int = 1
    kernel: tuple = ()
    strides: tuple = ()
    pads: tuple = ()
    dilations: tuple = ()
    trans_b: bool = False


LEFT_WEIGHT = "weight on the layer's left (MatMul(W, x) or Gemm(W, x)), which the fitted rounding does not handle"


def wide_input(bits: int, method: str = "gptq") -> str:
    """Why a layer with a ``bits``-wide input is left alone by ``method``."""
    return f"its input is on a {bits}-bit grid ({method} fits layers with inputs of 8 bits or fewer)"


def unfit_reason(g, node, weight: str) -> str | None:
    """Why GPTQ cannot fit this node whatever the data and grids (None where it may): the
    reasons that depend only on the graph. :func:`find_layers` adds those of the plan."""
    op = node.op_type
    if op not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or node.domain not in ("", "ai.onnx"):
        return f"{op} is not a Conv, ConvTranspose, Gemm or MatMul"
    w = g.weight(weight)
    if op == "ConvTranspose":
        why = _unfit_deconv(node, w)
        if why:
            return why
    if (op in ("Conv", "ConvTranspose") and w.ndim < 3) or (op not in ("Conv", "ConvTranspose") and w.ndim != 2):
        return f"{w.ndim}-D weight"
    if op == "Gemm" and node_attr(node, "transA", 0):
        return "Gemm with transA"
    if op == "Conv" and node_attr(node, "auto_pad", "NOTSET") not in (b"NOTSET", "NOTSET"):
        return "Conv with auto_pad"
    if len(g.consumers.get(weight, [])) != 1:
        return "weight shared with another node"
    return None


def find_layers(g, places, plan, qmodel, method: str = "gptq") -> tuple[list[Layer], dict]:
    """The layers GPTQ can round, and why others are left alone (node -> reason)."""
    qnodes = {n.name: n for n in qmodel.graph.node}
    producers = {o: n for n in qmodel.graph.node for o in n.output}
    uses: dict[str, int] = {}
    for wp in places.weights.values():
        uses[wp.tensor] = uses.get(wp.tensor, 0) + 1
    layers, skipped = [], {}
    for (name, index), wp in places.weights.items():
        if index == 0 and wp.tensor in plan.weights and left_weight(g, g.node_by_name[name], 0):
            skipped[name] = LEFT_WEIGHT
        if index != 1 or wp.tensor not in plan.weights:
            continue
        node = g.node_by_name[name]
        op = node.op_type
        w = g.weight(wp.tensor)
        if op not in ("Conv", "ConvTranspose", "Gemm", "MatMul"):
            continue
        why = unfit_reason(g, node, wp.tensor) or (
            "weight shared with another node" if uses[wp.tensor] != 1 else None)
        if why:
            skipped[name] = why
            continue
        qnode = qnodes.get(name)
        xq = qnode.input[0] if qnode is not None else None
        pre = dq_source(producers, xq) if xq else None
        qp = plan.activations.get(pre) if pre else None
        if qp is None or qp.axis is not None or np.ndim(qp.scale):
            skipped[name] = "its input has no per-tensor Q/DQ right before it"
            continue
        if qp.bits > 8:
            # its statistics are exact integer sums over 8-bit levels (products below 2^24)
            skipped[name] = wide_input(qp.bits, method)
            continue
        wq = plan.weights[wp.tensor]
        rows = w.shape[0] if op == "Conv" else w.shape[1] if op == "ConvTranspose" else (
            w.shape[0] if op == "Gemm" and node_attr(node, "transB", 0)
                                                 else w.shape[1])
        if np.ndim(wq.scale) and (wq.axis is None or np.size(wq.scale) != rows):
            skipped[name] = "weight grid not per output channel"
            continue
        bias = None
        if op in ("Conv", "Gemm") and len(node.input) > 2 and node.input[2] and g.is_constant(node.input[2]):
            if op == "Conv" or node_attr(node, "beta", 1.0) != 0.0:
                bias = node.input[2]
        elif op == "MatMul":
            users = g.consumers.get(node.output[0], [])
            if len(users) == 1 and users[0].op_type == "Add":
                other = [t for t in users[0].input if t != node.output[0]]
                if len(other) == 1 and g.is_constant(other[0]):
                    bias = other[0]
        if bias is not None and (bias in plan.weights or len(g.consumers.get(bias, [])) != 1 or bias in g.output_names
                                 or g.weight(bias).ndim != 1 or g.weight(bias).size != rows):
            bias = None
        lay = Layer(name, op, wp.tensor, bias, pre, xq, float(qp.scale), float(qp.zero_point), qp.qmin, qp.qmax)
        if op == "Conv":
            nd = w.ndim - 2
            lay.group = int(node_attr(node, "group", 1))
            lay.kernel = tuple(int(k) for k in w.shape[2:])
            lay.strides = tuple(int(v) for v in node_attr(node, "strides", [1] * nd))
            lay.dilations = tuple(int(v) for v in node_attr(node, "dilations", [1] * nd))
            lay.pads = tuple(int(v) for v in node_attr(node, "pads", [0] * (2 * nd)))
        elif op == "ConvTranspose":
            lay.kernel = tuple(int(k) for k in w.shape[2:])
        elif op == "Gemm":
            lay.trans_b = bool(node_attr(node, "transB", 0))
        layers.append(lay)
    return layers, skipped


def _unfit_deconv(node, w: np.ndarray) -> str | None:
    """Why a ConvTranspose is not a set of independent 1x1 convolutions (None where it is):
    with kernel = stride, no padding, group 1 and dilation 1 every output pixel reads one input
    pixel, through the kernel tap of its phase, so the layer is a matrix product per pixel whose
    rows are (output channel, tap)."""
    nd = w.ndim - 2
    kernel = [int(k) for k in w.shape[2:]]
    if int(node_attr(node, "group", 1) or 1) != 1:
        return "grouped ConvTranspose"
    if node_attr(node, "auto_pad", "NOTSET") not in (b"NOTSET", "NOTSET"):
        return "ConvTranspose with auto_pad"
    if [int(v) for v in node_attr(node, "strides", [1] * nd)] != kernel \
            or any(int(v) != 1 for v in node_attr(node, "dilations", [1] * nd)) \
            or any(int(v) for v in node_attr(node, "pads", [0] * (2 * nd))) \
            or any(int(v) for v in node_attr(node, "output_padding", [0] * nd)) \
            or node_attr(node, "output_shape", None) is not None:
        return "ConvTranspose whose taps overlap or are padded (only kernel = stride is fitted)"
    return None


def _taps(lay: Layer) -> int:
    return int(np.prod(lay.kernel)) if lay.op_type == "ConvTranspose" else 1


def weight_matrix(w: np.ndarray, lay: Layer) -> np.ndarray:
    """The weight as [groups, output channels per group, K] (a ConvTranspose's rows are
    (output channel, kernel tap), its K the input channels)."""
    if lay.op_type == "ConvTranspose":
        return np.moveaxis(w, 0, -1).reshape(1, -1, w.shape[0])
    if lay.op_type == "Conv":
        return w.reshape(lay.group, w.shape[0] // lay.group, -1)
    if lay.op_type == "Gemm" and lay.trans_b:
        return w[None]
    return w.T[None]


def from_matrix(m: np.ndarray, lay: Layer, shape) -> np.ndarray:
    if lay.op_type == "ConvTranspose":
        return np.moveaxis(m[0].reshape(tuple(shape[1:]) + (shape[0],)), -1, 0)
    if lay.op_type == "Conv":
        return m.reshape(shape)
    if lay.op_type == "Gemm" and lay.trans_b:
        return m[0]
    return m[0].T


def n_positions(x: np.ndarray, lay: Layer) -> int:
    if lay.op_type == "ConvTranspose":
        return int(x.shape[0] * np.prod(x.shape[2:]))
    if lay.op_type != "Conv":
        return int(np.prod(x.shape[:-1]))
    nd = len(lay.kernel)
    size = x.shape[0]
    for i in range(nd):
        padded = x.shape[2 + i] + lay.pads[i] + lay.pads[i + nd]
        size *= (padded - lay.dilations[i] * (lay.kernel[i] - 1) - 1) // lay.strides[i] + 1
    return size


def patches(x: np.ndarray, lay: Layer, pick: np.ndarray | None = None) -> np.ndarray:
    """The layer's input as [groups, K, P]: column p holds what output position p multiplies
    with the weight matrix (a Conv's zero-padded patch, a MatMul's row); ``pick`` selects
    positions (indices into batch x output positions, row-major). Only the picked patches are
    gathered."""
    if lay.op_type == "ConvTranspose":     # every input pixel, as for a 1x1 Conv
        cols = x.reshape(x.shape[0], x.shape[1], -1).transpose(1, 0, 2).reshape(x.shape[1], -1)
        return (cols if pick is None else cols[:, pick])[None]
    if lay.op_type != "Conv":
        rows = x.reshape(-1, x.shape[-1])
        if pick is not None:
            rows = rows[pick]
        return rows.T[None]
    nd = len(lay.kernel)
    n, c = x.shape[:2]
    if all(k == 1 for k in lay.kernel) and all(v == 1 for v in lay.strides) and not any(lay.pads):
        cols = x.reshape(n, c, -1).transpose(1, 0, 2).reshape(c, -1)     # a 1x1 Conv: the pixels
        if pick is not None:
            cols = cols[:, pick]
        return cols.reshape(lay.group, c // lay.group, -1)
    xp = np.pad(x, [(0, 0), (0, 0)] + [(lay.pads[i], lay.pads[i + nd]) for i in range(nd)])
    out = [(xp.shape[2 + i] - lay.dilations[i] * (lay.kernel[i] - 1) - 1) // lay.strides[i] + 1 for i in range(nd)]
    if pick is None:   # every position: strided slices of the padded input
        taps = []
        for off in np.ndindex(*lay.kernel):
            sl = tuple(slice(off[i] * lay.dilations[i],
                             off[i] * lay.dilations[i] + lay.strides[i] * (out[i] - 1) + 1, lay.strides[i])
                       for i in range(nd))
            taps.append(xp[(slice(None), slice(None)) + sl].reshape(n, c, -1).transpose(1, 0, 2).reshape(c, -1))
        return np.stack(taps, axis=1).reshape(lay.group, (c // lay.group) * len(taps), -1)
    coords = np.unravel_index(pick, (n, *out))
    last = np.moveaxis(xp, 1, -1)                         # channels last: a gather reads rows of c
    taps = [last[(coords[0],) + tuple(coords[1 + i] * lay.strides[i] + off[i] * lay.dilations[i]
                                      for i in range(nd))]
            for off in np.ndindex(*lay.kernel)]           # each [P, c]
    cols = np.stack(taps, axis=2)                         # [P, c, taps]
    return cols.transpose(1, 2, 0).reshape(lay.group, (c // lay.group) * len(taps), -1)


def gptq(W, H, scale, zp, qmin, qmax, fixed_last=False, damp=DAMP, block=128, pin=None, sparse=None,
         order=None):
    """GPTQ over a batch of problems: W [G, R, K], H [G, K, K], scale/zp [G, R] (or scalars).

    Returns (dequantized weights [G, R, K] float64, integers [G, R, K]); with ``fixed_last`` the
    last column (a bias) is processed last and never rounded (its integers are meaningless).
    ``pin`` = (mask, levels), both [G, R, K]: where mask is set the weight takes that level, and
    its error is spread over the columns not yet rounded like any other.

    ``sparse`` prunes as it rounds (SparseGPT, Frantar & Alistarh, ICML 2023): a float rate
    zeroes that share of each row's weights in every block of columns, an ``(n, m)`` pair keeps
    at most n non-zero weights in every m consecutive columns of ``order`` (N:M; ``order``, a
    permutation of the K columns with the bias last, then replaces the act order so that the
    groups are the backend's, e.g. m consecutive input channels of one kernel tap). A pruned
    weight takes the level of zero and its error is spread like a rounding error; which weights
    are pruned is decided a group (or block) at a time from the weights as updated so far, the
    smallest ``w^2 / [H^-1]_kk`` first (the error the pruning adds). Pinned weights are pruned
    last (only where the pattern leaves no choice)."""
    G, R, K = W.shape
    W = np.array(W, dtype=np.float64)
    H = np.array(H, dtype=np.float64)
    idx = np.arange(K)
    diag = H[:, idx, idx].copy()
    dead = diag <= 0
    for gi in range(G):   # an input that is always zero: its column is rounded to nearest
        H[gi, idx[dead[gi]], idx[dead[gi]]] = 1.0
    key = -H[:, idx, idx]
    if fixed_last:
        key[:, -1] = np.inf
    if order is not None:
        perm = np.broadcast_to(np.asarray(order), (G, K)).copy()
    else:
        perm = np.argsort(key, axis=1, kind="stable")  # act order: largest input energy first
    nm = sparse if isinstance(sparse, tuple) else None
    rate = sparse if sparse is not None and nm is None else None
    if nm is not None:
        block = max(nm[1], block - block % nm[1])        # groups never straddle two blocks
    inv = np.argsort(perm, axis=1)
    W = np.take_along_axis(W, perm[:, None, :], axis=2)
    if pin is not None:
        pmask = np.take_along_axis(pin[0], perm[:, None, :], axis=2)
        plev = np.take_along_axis(pin[1], perm[:, None, :], axis=2)
    H = H[np.arange(G)[:, None, None], perm[:, :, None], perm[:, None, :]]
    H[:, idx, idx] += damp * np.mean(H[:, idx, idx], axis=1)[:, None]
    Linv = np.linalg.inv(np.linalg.cholesky(H))
    U = np.swapaxes(np.linalg.cholesky(np.swapaxes(Linv, 1, 2) @ Linv), 1, 2)   # H^-1 = U^T U
    s = np.broadcast_to(np.asarray(scale, np.float64).reshape(-1, R) if np.ndim(scale) else
                        np.float64(scale), (G, R))
    z = np.broadcast_to(np.asarray(zp, np.float64).reshape(-1, R) if np.ndim(zp) else np.float64(zp), (G, R))
    Q = np.zeros_like(W)
    Qi = np.zeros(W.shape, dtype=np.int64)
    rounded = K - 1 if fixed_last else K
    pruned = np.zeros(W.shape, bool) if sparse is not None else None
    # of two pinned weights, the one further from the zero level is pruned last: by their levels,
    # not by the values as updated so far (error spreading had moved the other end above it, and
    # a 1:M group kept the end that does not set the grid; found by a bug hunt)
    pmag = np.abs(plev - z[:, :, None]) if pin is not None else None
    zero_level = np.clip(np.rint(z), qmin, qmax)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, :, i1:i2].copy()
        E1 = np.zeros_like(W1)
        U1 = U[:, i1:i2, i1:i2]
        if rate is not None:
            n_cols = min(i2, rounded) - i1
            k = int(round(rate * n_cols))
            if k > 0:
                sal = _saliency(W1[:, :, :n_cols], U1, i1, n_cols, pmask if pin is not None else None, pmag)
                worst = np.argsort(sal, axis=2, kind="stable")[:, :, :k]
                np.put_along_axis(pruned[:, :, i1:i1 + n_cols], worst, True, axis=2)
                if pin is not None:    # a rate never prunes a grid end (a 3x3 depthwise at 0.95)
                    pruned[:, :, i1:i1 + n_cols] &= ~pmask[:, :, i1:i1 + n_cols]
        for i in range(i2 - i1):
            col = i1 + i
            w = W1[:, :, i]
            if nm is not None and i % nm[1] == 0 and col < rounded:
                width = min(nm[1], rounded - col)
                drop = width - nm[0]
                if drop > 0:
                    sal = _saliency(W1[:, :, i:i + width], U1[:, i:i + width, i:i + width], col, width,
                                    pmask if pin is not None else None, pmag)
                    worst = np.argsort(sal, axis=2, kind="stable")[:, :, :drop]
                    np.put_along_axis(pruned[:, :, col:col + width], worst, True, axis=2)
            if col < rounded:
                qi = np.clip(np.rint(w / s) + z, qmin, qmax)
                if pin is not None:
                    qi = np.where(pmask[:, :, col], plev[:, :, col], qi)
                if pruned is not None:
                    qi = np.where(pruned[:, :, col], zero_level, qi)
                q = (qi - z) * s
                Qi[:, :, col] = qi.astype(np.int64)
            else:
                q = w
            Q[:, :, col] = q
            err = (w - q) / U1[:, i, i][:, None]
            W1[:, :, i:] -= err[:, :, None] * U1[:, i, i:][:, None, :]
            E1[:, :, i] = err
        W[:, :, i2:] -= E1 @ U[:, i1:i2, i2:]
    Q = np.take_along_axis(Q, inv[:, None, :], axis=2)
    Qi = np.take_along_axis(Qi, inv[:, None, :], axis=2)
    return Q, Qi


def _saliency(W1, U1, start: int, width: int, pmask, pmag) -> np.ndarray:
    """The error pruning each of ``width`` columns would add, per row (w^2 / [H^-1]_kk, with
    [H^-1]_kk = U_kk^2 for the columns not yet processed); pinned weights last, and of two
    pinned ones the one whose level lies further from zero (``pmag``) last (where a 1:M group
    holds both ends of a row, the end that sets a symmetric grid, max |w|, survives)."""
    d = np.einsum("gkk->gk", U1)[:, :width]
    sal = W1 ** 2 / (d[:, None, :] ** 2)
    if pmask is not None:
        sal = np.where(pmask[:, :, start:start + width], 1e300 * (1.0 + pmag[:, :, start:start + width]), sal)
    return sal


def objective(W, Wq, Hc, H) -> float:
    """E(Wq) - tr(W Hxx W^T) = tr(Wq H Wq^T) - 2 tr(W Hc Wq^T), summed over groups (the part of
    the layer's output error that depends on Wq)."""
    return float(np.sum((Wq @ H) * Wq) - 2 * np.sum((W @ Hc) * Wq))


def targets(g, lay: Layer) -> tuple[np.ndarray, float]:
    """The layer's float weight matrix [G, R, K (+1 bias column)] and the factor between the
    bias column and the bias tensor (a Gemm computes alpha (W x + b beta / alpha))."""
    node = g.node_by_name[lay.node]
    W = weight_matrix(g.weight(lay.weight).astype(np.float64), lay)
    if lay.bias is None:
        return W, 1.0
    ratio = node_attr(node, "beta", 1.0) / node_attr(node, "alpha", 1.0) if lay.op_type == "Gemm" else 1.0
    b = g.weight(lay.bias).astype(np.float64).reshape(W.shape[0], W.shape[1], 1) * ratio
    return np.concatenate([W, b], axis=2), ratio


def positions(inputs: int, samples: int) -> int:
    """Positions drawn per sample for a layer with ``inputs`` weight columns (bias included)
    when ``samples`` samples are read in all: enough for ROWS_PER_INPUT rows per column, between
    MIN_POSITIONS and MAX_POSITIONS. Measured (session 10; these metrics move by a few points
    with the draw's seed alone: the recognizer's exact match 0.63-0.69 over three seeds): a
    floor of 64 positions gave the PP-OCRv4 recognizer 0.59 at N = 32, 32 positions at N = 256
    the classifier 97.7% agreement against 98.6%; 256 gave 0.66 and 98.6%."""
    need = ROWS_PER_INPUT * inputs
    return int(min(MAX_POSITIONS, max(MIN_POSITIONS, math.ceil(need / max(samples, 1)))))


def statistics(g, qmodel, layers, data, indices, comm, device,
               label: str = "gptq statistics", samples: int | None = None,
               watch: str | None = None, types: dict | None = None,
               left_out_as: str | None = None) -> tuple[dict, dict, dict, int]:
    """Per layer the summed ``H = sum x~ x~^T`` (units of the input's grid step squared) and
    ``R = sum (x - x~) x~^T`` (units of 1/256 of that), so ``Hc = H + R / 256``; (on rank 0) the
    error-free part of the output energy, sum ||W x||^2 with x the clipped input before its Q/DQ
    (rounded to 1/256 of a step; sizes the report's dB only); and the number of input columns
    (positions) each layer saw.

    The quantized input is an integer there (level - zero point) and the input before rounding
    is rounded to 1/256 of a step, so its difference to the quantized one is an integer number of
    1/256 steps, small where the input is not clipped and zero where it is. Products are taken in
    float32 over at most as many columns as keep every partial sum an integer below 2^24 (exact),
    then added in float64 (exact while below 2^53 units: a bound summed over every sample is
    checked after the MPI sum, the same on every process): the sums are the same in any order
    and on any number of MPI processes.
    ``sum ||W x||^2`` is summed per sample, gathered in sample order and added with math.fsum.
    ``watch`` (:func:`~dipoorlet.qdq.append_watch`, ``types`` its model's types): a sample on which
    it flags a NaN is left out, and the log says which under ``left_out_as`` (None: not said)."""

    acc, bound, energy, mats = {}, {}, {}, {}
    for lay in layers:
        Wa, _ = targets(g, lay)
        K = Wa.shape[2] - (lay.bias is not None)
        mats[lay.node] = (Wa[:, :, :K].astype(np.float32),
                          Wa[:, :, K:].astype(np.float32) if lay.bias is not None else None)
        acc[lay.node] = np.zeros((2,) + Wa.shape[:1] + (Wa.shape[2], Wa.shape[2]))
        bound[lay.node] = np.zeros(3)    # bounds of |H| and |R| entries, columns seen
        energy[lay.node] = []
    pending = {lay.node: [] for lay in layers}

    def flush(lay, everything=False):
        # a few samples' columns per product: small inputs (a MatMul's 20 tokens) would otherwise
        # spend the time adding K x K matrices, not multiplying
        buf = pending[lay.node]
        if not buf or (not everything and sum(b[0].shape[2] for b in buf) < CHUNK):
            return
        pq = np.concatenate([b[0] for b in buf], axis=2) if len(buf) > 1 else buf[0][0]
        pr = np.concatenate([b[1] for b in buf], axis=2) if len(buf) > 1 else buf[0][1]
        if lay.bias is not None:     # the bias column: a row of ones (its R row stays zero)
            pq = np.concatenate([pq, np.ones((pq.shape[0], 1, pq.shape[2]), np.float32)], axis=1)
        mq, mr = max(b[2] for b in buf), max(max(b[3] for b in buf), 1.0)
        buf.clear()
        step = int(min(EXACT32 // (mq * mq), EXACT32 // (mr * mq)))
        a = acc[lay.node]
        k = pr.shape[1]
        if step < 16:        # wider than 8-bit grids: float32 would not be exact; float64 is to 2^53
            qt = np.swapaxes(pq, 1, 2).astype(np.float64)
            a[0] += pq.astype(np.float64) @ qt
            a[1, :, :k] += pr.astype(np.float64) @ qt
            return
        for c in range(0, pq.shape[2], step):
            q = pq[:, :, c:c + step]
            qt = np.swapaxes(q, 1, 2)
            a[0] += q @ qt
            a[1, :, :k] += pr[:, :, c:c + step] @ qt

    tensors = sorted({lay.xq for lay in layers} | {lay.pre for lay in layers})
    runner = Runner(qmodel, tensors + ([watch] if watch else []), types=types or g.types, optimize=SIMULATE,
                    device=device, quantized=True)
    count, bad = 0, []
    # every process draws alike: the cap depends on the whole run's sample count
    caps = {lay.node: positions(mats[lay.node][0].shape[2] + (lay.bias is not None),
                                samples if samples is not None else len(indices)) for lay in layers}
    last = {}
    for li, lay in enumerate(layers):
        last[lay.xq] = last[lay.pre] = li
    done_after: dict[int, list] = {}
    for t, li in last.items():
        done_after.setdefault(li, []).append(t)
    for i in progress(indices, label, comm):
        feed = data.sample(i)
        got, _ = runner.run(feed, ranges=False)
        if not nan_free(got, watch):
            bad.append((i, sample_name(feed, i)))
            continue
        units = {}      # per input tensor: (x~ in steps, (x - x~) in 1/256 steps), float32 integers
        for li, lay in enumerate(layers):
            if lay.xq not in units:
                inv = np.float32(1.0 / lay.step)
                q = np.rint(np.asarray(got[lay.xq]).astype(np.float32) * inv)
                # the input before rounding, clipped to the grid's range: the layer compensates
                # its input's rounding, not the clipping the range method chose (a few clipped
                # outliers would otherwise decide every weight)
                r = np.asarray(got[lay.pre]).astype(np.float32) * inv
                np.clip(r, np.float32(lay.qmin - lay.zero_point), np.float32(lay.qmax - lay.zero_point), out=r)
                r *= np.float32(256.0)
                np.rint(r, out=r)
                r -= np.float32(256.0) * q                      # exact: integers below 2^24
                # bounds of |x~| (at least 1: the bias column of ones) and |x - x~|
                units[lay.xq] = (q, r, max(float(np.abs(q).max(initial=0)), 1.0), float(np.abs(r).max(initial=0)))
            xq, xr, mq, mr = units[lay.xq]
            n = n_positions(xq, lay)
            cap = caps[lay.node]
            # one generator per (sample, layer): one shared by a pass's layers made a layer's draw,
            # and so its rounding, depend on which layers --gptq_memory put in its pass before it
            pick = np.sort(np.random.default_rng([SEED, int(i), zlib.crc32(lay.node.encode())]).choice(
                n, cap, replace=False)) if n > cap else None
            pieces = [None] if pick is None else [pick[c:c + CHUNK] for c in range(0, len(pick), CHUNK)]
            Wk, bias = mats[lay.node]
            e = 0.0
            for piece in pieces:      # gathered a piece at a time: bounded transient memory
                pq, pr = patches(xq, lay, piece), patches(xr, lay, piece)
                cols = pq.shape[2]
                bound[lay.node] += cols * np.array([mq * mq, mr * mq, 1.0])
                # the output energy of the clipped input (report only): x = x~ + r / 256
                xv = pr * np.float32(lay.step / 256.0)
                xv += pq * np.float32(lay.step)
                y = Wk @ xv
                if bias is not None:
                    y += bias
                e += float(np.sum(np.square(y, dtype=np.float64)))
                pending[lay.node].append((pq, pr, mq, mr))
                flush(lay)
            energy[lay.node].append(e)
            for t in done_after.get(li, ()):       # freed after their last layer: one sample's
                got.pop(t, None)                   # activations are not all held twice
                units.pop(t, None)
        count += 1
    if left_out_as:
        warn_left_out(comm, bad, left_out_as, "a quantized activation is NaN on them")
    rows = {}
    limit = 2.0 ** 53
    for lay in layers:
        flush(lay, everything=True)
        acc[lay.node] = comm.allreduce_sum(acc[lay.node])
        total_bound = comm.allreduce_sum(bound[lay.node])   # every process decides alike
        if np.any(total_bound[:2] >= limit):
            raise ModelError(f"--gptq: the input statistics of {lay.node} exceed float64's exact range "
                             f"(too many samples); lower --gptq_samples")
        rows[lay.node] = int(total_bound[2])
    gathered = comm.gather_samples(energy)
    consts = {k: math.fsum(v) for k, v in gathered.items()}
    total = int(comm.allreduce_sum(np.array([count], dtype=np.int64))[0])
    return acc, consts, rows, total


def sparse_order(lay: Layer, w: np.ndarray, m: int) -> tuple[np.ndarray | None, str | None]:
    """The weight matrix's columns in the order whose m consecutive entries form an N:M group
    (the backend's: m consecutive input channels of one kernel tap, as TensorRT's 2:4 sparse
    kernels read them), or (None, why) where the input channels do not split into groups of m."""
    if lay.op_type == "Conv":
        cin, taps = w.shape[1], int(np.prod(w.shape[2:]))
        if cin % m:
            return None, f"{cin} input channels per group, not a multiple of {m}: left dense"
        return np.arange(cin * taps).reshape(cin, taps).T.reshape(-1), None
    K = weight_matrix(w, lay).shape[2]
    if K % m:
        return None, f"{K} inputs, not a multiple of {m}: left dense"
    return np.arange(K), None


def _prune_by_magnitude(Wm: np.ndarray, sparse, order) -> np.ndarray:
    """Where a layer cannot be fitted: the pruning mask [G, R, K] by |w| alone (the smallest
    in each N:M group, or that share of each row)."""
    G, R, K = Wm.shape
    a = np.abs(Wm)
    mask = np.zeros(a.shape, bool)
    if isinstance(sparse, tuple):
        n, m = sparse
        grouped = a[:, :, order].reshape(G, R, -1, m)
        worst = np.argsort(grouped, axis=3, kind="stable")[..., :m - n]
        gm = np.zeros(grouped.shape, bool)
        np.put_along_axis(gm, worst, True, axis=3)
        mask[:, :, order] = gm.reshape(G, R, K)
    else:
        k = int(round(sparse * K))
        np.put_along_axis(mask, np.argsort(a, axis=2, kind="stable")[:, :, :k], True, axis=2)
    return mask


def _solve(g, plan, lay: Layer, stats, const: float, rows: int, skipped: dict, short: dict | None = None,
           method: str = "gptq", iters: int = 0, sparse=None, magnitude: list | None = None):
    """One layer's GPTQ from its statistics; (node, error before, error after) where the new
    rounding is kept, None where not (with the reason in ``skipped``: not tried, or no gain).
    With ``sparse`` (a rate or an (n, m) pair) the layer is pruned as it is rounded and the
    result is always kept (the error before is dense nearest rounding's); a layer with too few
    rows to fit is pruned by magnitude alone (listed in ``magnitude``)."""
    w = g.weight(lay.weight).astype(np.float64)
    qp = plan.weights[lay.weight]
    Wa, ratio = targets(g, lay)
    G, R, K = Wa.shape[0], Wa.shape[1], Wa.shape[2] - (lay.bias is not None)
    has_b = lay.bias is not None
    order = None
    if isinstance(sparse, tuple):
        order, why = sparse_order(lay, w, sparse[1])
        if order is None:
            skipped[lay.node] = why
            return None
        if has_b:
            order = np.append(order, K)
    # back to the tensors' own units: the weight columns act on x / step
    d = np.full(K + has_b, lay.step)
    if has_b:
        d[-1] = 1.0
    if rows < MIN_ROWS_PER_INPUT * (K + has_b):
        skipped[lay.node] = (f"{rows} input rows for {K + has_b} inputs: too few to fit "
                             f"(needs {MIN_ROWS_PER_INPUT}x; raise -N or --gptq_samples)")
        if short is not None:
            short[lay.node] = (rows, MIN_ROWS_PER_INPUT * (K + has_b))
        if sparse is not None:
            Wm = weight_matrix(w, lay)
            pruned = _prune_by_magnitude(Wm, sparse, order[:K] if order is not None else None)
            zp_w = _bcast(qp.zero_point, qp.axis, w.ndim)
            ints = np.where(from_matrix(pruned, lay, w.shape), np.clip(np.rint(zp_w), qp.qmin, qp.qmax),
                            quantize_array(w, qp))
            value = (ints - zp_w) * _bcast(qp.scale, qp.axis, w.ndim)
            plan.values[lay.weight] = value.astype(g.weight(lay.weight).dtype)
            plan.value_owners[lay.weight] = lay.node
            skipped[lay.node] += "; pruned by magnitude"
            if magnitude is not None:
                magnitude.append(lay.node)
        return None
    stats[1] *= 1.0 / 256.0
    stats[1] += stats[0]                        # Hc = H + R / 256
    stats *= d[None, None, :, None] * d[None, None, None, :]
    H, Hc = stats[0], stats[1]
    ints_rtn = quantize_array(w, qp)                # nearest rounding: the baseline and the pins
    rtn = weight_matrix(((ints_rtn.astype(np.float64) - _bcast(qp.zero_point, qp.axis, w.ndim))
                         * _bcast(qp.scale, qp.axis, w.ndim)), lay)
    if has_b:
        # the baseline is the bias the quantized model holds now (an activation shift or
        # --bc may have changed it)
        b_now = np.asarray(plan.values.get(lay.bias, g.weight(lay.bias)), np.float64).reshape(G, R, 1) * ratio
        rtn = np.concatenate([rtn, b_now], axis=2)
    idx = np.arange(K + has_b)
    reg = DAMP * np.mean(H[:, idx, idx], axis=1)[:, None, None] + 1e-30
    # W* = argmin ||Wa X - W' X~||^2 + reg ||W' - Wa||^2
    rhs = np.swapaxes(Wa @ Hc + reg * Wa, 1, 2)
    H[:, idx, idx] += reg[:, :, 0]
    target = np.swapaxes(np.linalg.solve(H, rhs), 1, 2)
    H[:, idx, idx] -= reg[:, :, 0]
    # a ConvTranspose's rows are (channel, tap): each channel's grid serves its taps' rows
    scale = (np.repeat(np.asarray(qp.scale, np.float64), _taps(lay)).reshape(G, R) if np.ndim(qp.scale)
             else float(qp.scale))
    zp = (np.repeat(np.asarray(qp.zero_point, np.float64), _taps(lay)).reshape(G, R) if np.ndim(qp.zero_point)
          else float(qp.zero_point))
    # each grid's largest and smallest weight keep their nearest-rounding levels (the others
    # compensate them): a backend that derives the grid from
    # transformed_model.onnx's weights (TensorRT's max |w| per channel) then finds the same
    # grid and the same integers
    ri = weight_matrix(ints_rtn.astype(np.int64), lay)
    Wm = weight_matrix(w, lay)
    mask = np.zeros((G, R, K + has_b), bool)
    levels = np.zeros((G, R, K + has_b))
    levels[:, :, :K] = ri
    if np.ndim(qp.scale):            # a grid per output channel: each row's ends (a ConvTranspose channel's taps are rows of their own; its ends are among theirs)
        for ends in (np.argmax(Wm, axis=2), np.argmin(Wm, axis=2)):
            np.put_along_axis(mask, ends[:, :, None], True, axis=2)
    else:                            # one grid for the tensor: the tensor's ends only
        for end in (np.argmax(Wm), np.argmin(Wm)):
            mask[np.unravel_index(end, Wm.shape)] = True
    if method == "adaround":
        from dipoorlet.adaround import adaround

        Q, Qi = adaround(Wa, target, H, scale, zp, qp.qmin, qp.qmax, fixed_last=has_b, pin=(mask, levels),
                         iters=iters)
    else:
        Q, Qi = gptq(target, H, scale, zp, qp.qmin, qp.qmax, fixed_last=has_b, pin=(mask, levels),
                     sparse=sparse, order=order)
    v_rtn, v_new = objective(Wa, rtn, Hc, H), objective(Wa, Q, Hc, H)
    del H, Hc
    if sparse is None and not v_new < v_rtn:
        # fitted, and nearest rounding stays: said as a reason (the diagnosis advised --gptq again)
        skipped[lay.node] = "fitted, nearest rounding kept (no lower output error)"
        return None
    ints = from_matrix(Qi[:, :, :K], lay, w.shape)
    value = ((ints - _bcast(qp.zero_point, qp.axis, w.ndim)) * _bcast(qp.scale, qp.axis, w.ndim))
    plan.values[lay.weight] = value.astype(g.weight(lay.weight).dtype)
    plan.value_owners[lay.weight] = lay.node
    if has_b:
        plan.values[lay.bias] = (Q[:, :, K].reshape(-1) / ratio).astype(g.weight(lay.bias).dtype)
        plan.value_owners[lay.bias] = lay.node
    # const: the error-free output energy; reconstruct() passes 0 and adds it (rank 0 holds it)
    return lay.node, const + v_rtn, const + v_new


def stat_bytes(g, lay: Layer) -> int:
    """Bytes of a layer's statistics (two K x K float64 matrices per group)."""
    G, _, K = weight_matrix(g.weight(lay.weight), lay).shape
    K += lay.bias is not None
    return 2 * G * K * K * 8


def passes(g, layers, budget_bytes: int) -> list[list[Layer]]:
    """Layers in graph order, split into passes whose statistics fit the budget (a layer larger
    than the budget gets a pass of its own). The same on every process."""
    out, cur, size = [], [], 0
    for lay in layers:
        b = stat_bytes(g, lay)
        if cur and size + b > budget_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(lay)
        size += b
    if cur:
        out.append(cur)
    return out


def reconstruct(g, places, plan, data, indices, comm, device="cpu", memory_mb: float = MEMORY_MB,
                samples: int | None = None, method: str = "gptq", iters: int = 1000, sparse=None) -> dict:
    """Choose every eligible layer's weight rounding (and bias) by GPTQ (``method="adaround"``:
    by AdaRound, :mod:`dipoorlet.adaround`, ``iters`` steps per layer); results go into
    ``plan.values`` (owned by the layer, so a layer kept float keeps its own weights).

    The statistics of all layers are gathered over the same quantized model (every layer
    rounded to nearest), in as many passes over the samples as ``memory_mb`` needs: a layer's
    result does not depend on which pass gathered it.

    ``sparse`` (a rate in (0, 1) or an (n, m) pair; GPTQ only) prunes every fitted layer as it
    is rounded (SparseGPT); layers with too few rows are pruned by magnitude; the others stay
    dense, with the reason."""
    qmodel = insert_qdq(g, places, plan)
    layers, skipped = find_layers(g, places, plan, qmodel, "sparse" if sparse is not None else method)
    if not layers:
        if sparse is not None:
            return _sparse_summary(g, plan, layers, [], [], [], skipped, sparse, 0, 0)
        reasons: dict[str, int] = {}
        for why in skipped.values():
            reasons[why] = reasons.get(why, 0) + 1
        log.warning("%s: no layer can be fitted (%s); every weight keeps its nearest rounding", method,
                    "; ".join(f"{k} layer{'s' if k > 1 else ''}: {why}" for why, k in
                              sorted(reasons.items(), key=lambda r: -r[1])[:3]) or "no quantized weights")
        return {"layers": 0, "candidates": 0, "skipped": skipped}
    watch, types = append_watch(qmodel, g.types)
    groups = passes(g, layers, int(memory_mb * 2 ** 20))
    if len(groups) > 1:
        log.info("%s: statistics of %d layers (%.1f MB) in %d passes of at most --gptq_memory %g MB "
                 "(a larger single layer gets a pass of its own)", method, len(layers),
                 sum(stat_bytes(g, lay) for lay in layers) / 2 ** 20, len(groups), memory_mb)
    changed, total, short, magnitude = [], 0, {}, []
    for gi, group in enumerate(groups):
        label = f"{method} statistics" if len(groups) == 1 else f"{method} statistics {gi + 1}/{len(groups)}"
        acc, consts, rows, total = statistics(g, qmodel, group, data, indices, comm, device, label, samples,
                                              # said once, not per pass: every pass meets the same samples
                                              watch, types, left_out_as=f"{method} statistics" if gi == 0 else None)
        if total == 0:
            return {"layers": 0, "candidates": len(layers), "skipped": skipped}
        # the layers are solved independently: under MPI each process solves every world-th one
        # and the results are exchanged, so every process ends with the same plan
        mine = [li for li in range(len(group)) if li % comm.world == comm.rank]
        records = []
        for li in (progress(mine, f"{method} layers", comm) if method == "adaround" else mine):
            lay = group[li]
            stats = acc.pop(lay.node)                   # freed layer by layer
            held = {t: plan.values.get(t) for t in (lay.weight, lay.bias) if t}
            sk, sh, mg = {}, {}, []
            done = _solve(g, plan, lay, stats, 0.0, rows[lay.node], sk, sh, method, iters, sparse, mg)
            del stats
            new = {t: (plan.values[t], plan.value_owners.get(t)) for t in held
                   if t in plan.values and plan.values[t] is not held[t]}
            records.append((li, done, new, sk, sh, mg))
        acc.clear()
        del acc
        gathered = sorted((r for part in comm.allgather(records) for r in part), key=lambda r: r[0])
        for li, done, new, sk, sh, mg in gathered:
            node = group[li].node
            for t, (value, owner) in new.items():
                plan.values[t] = value
                if owner is not None:
                    plan.value_owners[t] = owner
            skipped.update(sk)
            short.update(sh)
            magnitude.extend(mg)
            if done is not None:    # errors relative to the output energy, known on rank 0
                const = consts.get(node, float("nan"))
                changed.append((node, const + done[1], const + done[2]))
    if short:
        # rows grow with the samples: how many would fit every such layer
        need = max(math.ceil(want * total / max(have, 1)) for have, want in short.values())
        # a warning where it left nothing to gain; squeeze-and-excitation layers alone are routine
        (log.warning if not changed else log.info)(
            "%s: %d of %d layers saw too few input rows to fit (fewer than %d per weight column); "
            "about %d samples would fit them all (-N, --gptq_samples)", method, len(short), len(layers),
            MIN_ROWS_PER_INPUT, need)
    gains = [(n, 10 * np.log10(a / b) if a > 0 and b > 0 else float("nan")) for n, a, b in changed]
    gains.sort(key=lambda r: -r[1] if r[1] == r[1] else 0.0)
    if sparse is not None:
        return _sparse_summary(g, plan, layers, changed, gains, magnitude, skipped, sparse, total, len(groups))
    log.info("%s: %d of %d candidate layers re-rounded over %d samples%s%s", method, len(changed), len(layers), total,
             f"; {len(skipped)} layers left alone (report.json says why)" if skipped else "",
             "; largest error reductions: " + ", ".join(f"{n} {db:.1f} dB" for n, db in gains[:5]) if gains else "")
    return {"layers": len(changed), "candidates": len(layers), "samples": total, "passes": len(groups),
            "gain_db": [{"node": n, "db": round(float(db), 3) if db == db else None} for n, db in gains],
            "skipped": skipped}



def zero_share(arrays) -> float:
    """The share of exact zeros over all of ``arrays`` (0 for none)."""
    zeros = size = 0
    for v in arrays:
        v = np.asarray(v)
        zeros, size = zeros + int(np.count_nonzero(v == 0)), size + v.size
    return zeros / max(size, 1)


def _sparse_summary(g, plan, layers, changed, gains, magnitude, skipped, sparse, total, n_passes) -> dict:
    """What --sparse did: layers pruned with compensation (their output error against dense
    nearest rounding), by magnitude, or left dense, and the zero share of the pruned weights."""
    # a layer whose every weight is a pinned grid end (two inputs per row: each row's largest
    # weights, which a rate never prunes) was fitted but kept no zero: it is left dense
    by_node = {lay.node: lay for lay in layers}
    kept_dense = {n for n, _, _ in changed
                  if n in by_node and not np.any(np.asarray(plan.values[by_node[n].weight]) == 0)}
    if kept_dense:
        changed = [c for c in changed if c[0] not in kept_dense]
        gains = [r for r in gains if r[0] not in kept_dense]
        skipped = {**skipped, **{n: "every weight is its row's largest, which a rate never prunes (too few inputs "
                                    "per output)" for n in sorted(kept_dense)}}
    pruned = [n for n, _, _ in changed] + list(magnitude)
    share = zero_share(plan.values[lay.weight] for lay in layers if lay.node in pruned)
    pattern = f"{sparse[0]}:{sparse[1]}" if isinstance(sparse, tuple) else f"{sparse:g}"
    dense = {n: why for n, why in skipped.items() if n not in magnitude}
    worst = sorted(gains, key=lambda r: r[1] if r[1] == r[1] else 0.0)
    log.info("sparse %s: %d layers pruned with compensation over %d samples, %d by magnitude (too few rows), "
             "%d left dense; %.1f%% of their weights zero%s", pattern, len(changed), total, len(magnitude), len(dense),
             100.0 * share,
             # none fitted (every pruned layer by magnitude): no measured error to name (the line
             # had ended in an empty list; found by a hunt)
             "; largest output error added (vs dense nearest rounding): "
             + ", ".join(f"{n} {-db:.1f} dB" for n, db in worst[:5]) if worst else "")
    if not pruned:
        log.warning("sparse %s: no layer could be pruned (%s)", pattern,
                    "; ".join(f"{n}: {why}" for n, why in list(dense.items())[:4]) or "no candidates")
    elif dense:
        log.info("sparse %s: left dense: %s", pattern, "; ".join(f"{n} ({why})" for n, why in list(dense.items())[:8]))
    # a rate never prunes a row's pinned grid ends, so rows of few inputs fall short of it (a 3x3
    # depthwise at 0.9: 7 of 9): each such layer is named with the share it reached (the pooled
    # share alone hid them; found by a bug hunt)
    short = {}
    if not isinstance(sparse, tuple):
        for lay in layers:
            if lay.node in pruned:
                value = np.asarray(plan.values[lay.weight])
                z = zero_share([value])
                # a rate prunes round(rate * columns) per row and block of up to 128 columns:
                # that rounding alone is no shortfall (a 9-input row at 0.5 prunes 4)
                k = weight_matrix(value, lay).shape[-1]
                if z < sparse - 0.5 / max(1, min(k, 128)) - 1e-9:
                    short[lay.node] = round(z, 4)
        if short:
            log.info("sparse %s: %d layers reach less than the rate, their rows too short to prune more than all "
                     "but their grid ends: %s", pattern, len(short),
                     ", ".join(f"{n} {100 * z:.0f}%" for n, z in list(short.items())[:8])
                     + (" ..." if len(short) > 8 else ""))
    return {"pattern": pattern, "layers": len(changed), "magnitude": magnitude, "candidates": len(layers),
            "samples": total, "passes": n_passes, "zero_fraction": round(share, 6),
            **({"below_rate": short} if short else {}),
            "gain_db": [{"node": n, "db": round(float(db), 3) if db == db else None} for n, db in gains],
            "skipped": dense}
