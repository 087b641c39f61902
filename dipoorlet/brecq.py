"""Block reconstruction of the weights' rounding (``--brecq``; with ``--drop``, QDrop).

BRECQ (Li et al., ICLR 2021) chooses every weight's rounding (the grid point below or above
it, AdaRound's rectified-sigmoid relaxation annealed to a hard choice) so that a *block* of
layers reproduces the float model's output of that block, not each layer its own output: the
layers of a block compensate each other's rounding and the nonlinearities between them are in
the loss. QDrop (Wei et al., ICLR 2022) adds random dropping of activation quantization during
that optimization: each element of each quantized activation inside the block keeps its float
value with probability 0.5, and the block's input mixes the quantized and the float model's
input likewise, which flattens the loss surface the rounding is fitted on and carries better to
data the rounding did not see.

How it runs here:

- the QDQ model the plan gives (activation grids, shifts and all) is executed in PyTorch
  (:mod:`dipoorlet.torch_graph`), in two streams that share tensor names: the quantized model
  (``q``) and the float model it was made from (``f``);
- the graph is cut into blocks of consecutive nodes (in the model's order) that hold 2 to 8
  layers with weights; a block ends where the fewest tensors cross the cut (a residual block's
  end), never inside a stretch the executor cannot differentiate (an op run through
  ``onnx.reference``);
- per block: the float stream's block outputs are the targets, the quantized stream's block
  inputs (every earlier block already rounded) the inputs; Adam moves the rounding variables for
  ``--ada_iters`` steps over mini-batches of the stored samples (``--ada_bs``, default 16); the
  loss is the block outputs' squared error relative to the float outputs' energy, normalized to 1
  at nearest rounding, plus AdaRound's regularizer (weight 10 against the mean over the block's
  weights, as ``--adaround``; exponent annealed 20 -> 2 after a 20% warm-up);
- the biases of the block's Conv/ConvTranspose/Gemm layers are learned with the rounding (in
  units of the layer's output rounding noise, so one step size serves every layer): the block
  also removes the mean error its rounding leaves, as ``--bc`` and the closed-form bias of
  ``--adaround`` do for one layer;
- a block keeps its new rounding and biases only where the hard-rounded loss over all its
  samples is below nearest rounding's; then both streams move past it;
- a layer that reads a shifted tensor (trt's activation shift, ``shift.py``) holds ``b - W_q d``:
  the trained block sees that bias follow the rounding, and the written bias is rebased on the
  chosen integers.

The fit runs on ``--recon_device`` (the CPU by default; a CUDA GPU with ``cuda``): every tensor
of it lives there, and arrays cross to numpy only for an op run outside torch and for the
integers chosen.

Memory holds the tensors that cross the current cut, for the samples used (``--gptq_samples``,
default at most 64 here), in both streams: it does not grow with N beyond that cap. Each grid's
largest and smallest weights keep their nearest levels (as ``--gptq`` and ``--adaround`` do).
Under MPI each process holds its share of the samples and draws its own mini-batches from
it; every step's gradient is the mean over the processes (an allreduce), and after each block
every process continues from rank 0's rounding. The result is therefore not byte-identical to a
one-process run (other mini-batches), unlike ``--gptq``/``--adaround``, whose statistics are
exact sums.

Differences from the reference tool (ModelTC's Dipoorlet): blocks are cut from the graph's
own structure (the reference takes runs of successive Conv/Gemm layers), every activation grid
inside the block is simulated as the backend will run it (the reference quantizes each layer's
output), and the loss covers every tensor leaving the block.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter

import numpy as np

from dipoorlet.adaround import BETA, GAMMA, WARMUP, ZETA
from dipoorlet.data import sample_name
from dipoorlet.layer_errors import warn_left_out
from dipoorlet.progress import progress
from dipoorlet.qdq import insert_qdq

log = logging.getLogger(__name__)

DEFAULT_SAMPLES = 64       # samples held in both streams when --gptq_samples is not given (at most N)
MIN_LAYERS, MAX_LAYERS = 2, 8
BATCH = 16                 # samples per optimization step (all of them where fewer)
LAMBDA = 10.0              # the regularizer's weight: mean over the block's weights, against the normalized loss
LR = 0.01                  # Adam's step on the rounding variables
DROP = 0.5                 # QDrop: probability that an element keeps its float value
SEED = 20251125
LEARN_BIAS = True          # Conv/ConvTranspose/Gemm biases are learned with the rounding
LEARNABLE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
LR_STEP = 2e-3             # Adam's step on the log of a learned activation scale (--lsq)


def _is_float(t) -> bool:
    return t.is_floating_point()


_FUSED = {}


def _fused(torch):
    """The relaxed rounding and its regularizer as two autograd functions that keep only V (and
    tensors the Soft holds anyway) for the backward pass and recompute the rest there. Built
    from torch's own ops in autograd's order, so the gradients are the same numbers; the chain
    of small ops had kept about 9 full-size tensors per layer and step (the sigmoid's output,
    the clamp's input, h, the masked h, |2h - 1|...) until the backward pass."""
    if "soft" in _FUSED:
        return _FUSED["soft"], _FUSED["reg"]

    # in place where the value is the same (a + b is b + a, 1 - x is -x + 1 in IEEE arithmetic):
    # each allocation of a full-size temporary had been one more block for glibc's heap to keep
    def sig_u(V):
        sig = torch.sigmoid(V)
        return sig, torch.mul(sig, ZETA - GAMMA).add_(GAMMA)

    def h_of(V):
        return torch.sigmoid(V).mul_(ZETA - GAMMA).add_(GAMMA).clamp_(0.0, 1.0)

    def into_v(g, sig, u):
        """g (a fresh tensor, changed in place) through the clamp, the affine map and the sigmoid."""
        g.masked_fill_(((u >= 0.0) & (u <= 1.0)).logical_not_(), 0.0)      # NaN: 0, as clamp's gradient
        g.mul_(ZETA - GAMMA)
        return g.mul_(u.fill_(1.0).sub_(sig)).mul_(sig)

    class SoftWeight(torch.autograd.Function):
        @staticmethod
        def forward(ctx, V, base, free, z, s):
            ctx.save_for_backward(V, free, s)
            return h_of(V).mul_(free).add_(base).sub_(z).mul_(s)

        @staticmethod
        def backward(ctx, grad):
            V, free, s = ctx.saved_tensors
            sig, u = sig_u(V)
            return into_v(torch.mul(grad, s).mul_(free), sig, u), None, None, None, None

    class SoftReg(torch.autograd.Function):
        @staticmethod
        def forward(ctx, V, free, beta):
            ctx.save_for_backward(V, free)
            ctx.beta = beta
            x = h_of(V)[free].mul_(2.0).sub_(1.0).abs_().pow_(beta)
            return x.neg_().add_(1.0).sum()

        @staticmethod
        def backward(ctx, grad):
            V, free = ctx.saved_tensors
            beta = ctx.beta
            sig, u = sig_u(V)
            x = torch.clamp(u, 0.0, 1.0)[free].mul_(2.0).sub_(1.0)
            g = torch.neg(grad.expand(x.shape))
            g.mul_(torch.abs(x).pow_(beta - 1).mul_(beta))
            g.mul_(x.sgn_())
            g.mul_(2.0)
            full = torch.zeros_like(V)
            full[free] = g
            return into_v(full, sig, u), None, None

    _FUSED["soft"], _FUSED["reg"] = SoftWeight.apply, SoftReg.apply
    return _FUSED["soft"], _FUSED["reg"]


class Soft:
    """One weight's rounding: integers base + h(V), h relaxed in [0, 1] or hard."""

    def __init__(self, torch, W: np.ndarray, qp, pins: np.ndarray, device="cpu"):
        self.torch = torch
        dev = self.device = torch.device(device)
        s = np.asarray(qp.scale, np.float64)
        z = np.asarray(qp.zero_point, np.float64)
        if s.ndim == 1 and W.ndim > 1:
            shape = [1] * W.ndim
            shape[qp.axis] = -1
            s, z = s.reshape(shape), (z.reshape(shape) if z.ndim else z)
        x = W.astype(np.float64) / s + z
        base = np.floor(x)
        rtn = np.clip(np.rint(x), qp.qmin, qp.qmax)
        fixed = (base < qp.qmin) | (base + 1 > qp.qmax) | pins
        self.free = torch.from_numpy(~fixed).to(dev)
        self.base = torch.from_numpy(np.where(fixed, rtn, base).astype(np.float32)).to(dev)
        # per-channel vectors shaped to broadcast, not full-size copies: with base, V, nearest
        # and free, every layer's rounding had held 5x its weight from before the first block
        # (a 302 MB stack: 1.5 GB; found by a hunt)
        self.s = torch.from_numpy(np.array(s, np.float32)).to(dev)
        self.z = torch.from_numpy(np.array(z, np.float32)).to(dev)
        frac = np.clip(x - base, 0.0, 1.0)
        p = np.clip((frac - GAMMA) / (ZETA - GAMMA), 1e-4, 1 - 1e-4)
        self.V = torch.nn.Parameter(torch.from_numpy(np.log(p / (1 - p)).astype(np.float32)).to(dev))
        self.nearest = torch.from_numpy(((rtn - base) * (~fixed)).astype(np.float32)).to(dev)
        self.mode = "soft"       # soft | hard | nearest
        self.n_free = int((~fixed).sum())
        self.qrange = (qp.qmin, qp.qmax)
        self.ints = self.near = None    # set by finish()
        self.differs = False

    def __call__(self, hard: bool):
        if self.ints is not None:
            return (self.torch.from_numpy(self.ints.astype(np.float32)).to(self.device) - self.z) * self.s
        if self.mode == "nearest":
            h = self.nearest
        elif self.mode == "hard" or hard:
            h = (self.V.detach() >= 0).float()      # h(V) >= 0.5
        else:
            return _fused(self.torch)[0](self.V, self.base, self.free, self.z, self.s)
        return (self.base + h * self.free - self.z) * self.s

    def reg(self, beta):
        return _fused(self.torch)[1](self.V, self.free, beta)

    def integers(self) -> np.ndarray:
        h = (self.V.detach() >= 0).float() if self.mode != "nearest" else self.nearest
        return (self.base + h * self.free).cpu().numpy()

    def finish(self, keep_near: bool) -> None:
        """Its block is fitted: keep the integers chosen (and, with ``keep_near``, the nearest
        ones where they differ) in the grid's integer type, and free the relaxed state (base, V,
        nearest and the free mask: 3.25x the weight in float32, which every fitted layer had held
        to the end of the run)."""
        ints = self.integers()
        near = (self.base + self.nearest * self.free).cpu().numpy()
        self.differs = self.mode == "hard" and not np.array_equal(ints, near)
        lo, hi = self.qrange
        dt = next(t for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64)
                  if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max)
        self.ints = ints.astype(dt)
        self.near = near.astype(dt) if keep_near and self.differs else None
        self.base = self.V = self.nearest = self.free = None


class Bias:
    """A learned bias: b0 + u * unit, u from 0; ``unit`` per output channel is the size of the
    layer's output rounding noise (input step x weight step x sqrt(fan-in)), so one learning rate
    serves every layer."""

    def __init__(self, torch, b0: np.ndarray, unit: np.ndarray, device="cpu"):
        self.b0 = torch.from_numpy(np.array(b0, np.float32)).to(device)
        self.unit = torch.from_numpy(np.broadcast_to(np.asarray(unit, np.float32), self.b0.shape).copy()).to(device)
        self.V = torch.nn.Parameter(torch.zeros_like(self.b0))
        self.mode = "nearest"      # nearest (b0) | soft/hard (learned)
        self.n_free = 0

    def __call__(self, hard: bool = True):
        return self.b0 if self.mode == "nearest" else self.b0 + self.V * self.unit

    def value(self) -> np.ndarray:
        return self().detach().cpu().numpy()


class Step:
    """A learned activation scale (``--lsq``): s0 * exp(V), V from 0, shared by every chain of one
    grid (tensors a backend ties together share it). LSQ's gradient reaches V through the
    straight-through rounding of the chains that read it."""

    def __init__(self, torch, s0, device="cpu"):
        self.torch = torch
        self.s0 = torch.from_numpy(np.array(s0, np.float32)).to(device)
        self.V = torch.nn.Parameter(torch.zeros_like(self.s0))
        self.mode = "nearest"      # nearest (s0) | soft/hard (learned)
        self.n_free = 0

    def __call__(self):
        return self.s0 if self.mode == "nearest" else self.s0 * self.torch.exp(self.V)

    def value(self) -> np.ndarray:
        return self().detach().cpu().numpy()


def _pins(W: np.ndarray, qp) -> np.ndarray:
    """Each grid's largest and smallest weight (per channel along the grid's axis, else of the
    tensor)."""
    mask = np.zeros(W.shape, bool)
    if np.ndim(qp.scale) and W.ndim > 1:
        m = np.moveaxis(W, qp.axis, 0).reshape(W.shape[qp.axis], -1)
        mm = np.moveaxis(mask, qp.axis, 0).reshape(m.shape)      # a view onto mask
        rows = np.arange(m.shape[0])
        mm[rows, np.argmax(m, axis=1)] = True
        mm[rows, np.argmin(m, axis=1)] = True
    else:
        mask.flat[np.argmax(W)] = True
        mask.flat[np.argmin(W)] = True
    return mask


def _layout(tg, learn_pos: list[int]):
    """Blocks as (start, end, layer positions) over tg.nodes, each tensor's last reader, and each
    constant's (past it, its torch copies and arrays can go)."""
    nodes = tg.nodes
    produced_at = {i: -1 for i in tg.inputs}
    last, const_last = {}, {}
    for k, n in enumerate(nodes):
        for t in tg.reads(n):
            if t in tg.consts or t in tg.wdq:
                const_last[t] = k
                continue
            last[t] = max(last.get(t, -1), k)
        for o in n.output:
            if o:
                produced_at[o] = k
    for o in tg.outputs:
        last[o] = len(nodes)
    # live[p]: tensors produced before position p that a node at p or later reads
    start_at: dict[int, int] = {}
    end_at: dict[int, int] = {}
    for t, k in produced_at.items():
        if t in last and last[t] > k:
            start_at[k + 1] = start_at.get(k + 1, 0) + 1
            end_at[last[t] + 1] = end_at.get(last[t] + 1, 0) + 1
    live = np.zeros(len(nodes) + 1, np.int64)
    cur = 0
    for p in range(len(nodes) + 1):
        cur += start_at.get(p, 0) - end_at.get(p, 0)
        live[p] = cur
    opaque = [k for k, o in enumerate(tg.opaque) if o]
    blocks = []
    s = 0
    L = len(learn_pos)
    # the fewest tensors any cut between two layers leaves live (1 in a CNN; more where a
    # tensor such as an attention mask is read all along)
    floor = min((int(live[learn_pos[e] + 1:learn_pos[e + 1] + 1].min()) for e in range(L - 1)), default=1)
    begin = 0                      # the earliest position the next block may start at
    while s < L:
        # candidate ends after layer e: (live tensors, cut position, e); no opaque node inside
        cands = []
        e = s
        while e < L:
            lo = learn_pos[e] + 1
            hi = learn_pos[e + 1] if e + 1 < L else len(nodes)
            blocked = [k for k in opaque if lo - 1 < k < hi]
            top = blocked[0] if blocked else hi
            if e + 1 == L:
                top = lo                   # the last layer's block ends right after it
            p = min(range(lo, top + 1), key=lambda q: live[q])
            cands.append((int(live[p]), p, e))
            n_layers = e - s + 1
            if blocked or e + 1 == L or n_layers >= MAX_LAYERS or (n_layers >= MIN_LAYERS and live[p] <= floor):
                break
            e += 1
        # at least MIN_LAYERS layers where the graph allows, then the fewest live tensors
        full = [c for c in cands if c[2] - s + 1 >= MIN_LAYERS] or cands
        _, end, e = min(full, key=lambda c: (c[0], c[1]))
        end = _past_affine(tg, end, live)
        if e + 1 == L:
            end = _past_output_grid(tg, end)
        blocks.append((begin, end, learn_pos[s:e + 1]))
        # the next block starts after any opaque node between this block's end and its layer
        nxt = learn_pos[e + 1] if e + 1 < L else len(nodes)
        between = [k for k in opaque if end <= k < nxt]
        begin = (between[-1] + 1) if between else end
        s = e + 1
    return blocks, last, const_last


def torch_device(want: str | None, local_rank: int = 0) -> str:
    """The torch device ``--brecq``/``--drop``/``--lsq`` fit on (``--recon_device``): cpu (the
    default, also where torch sees a GPU: the same bytes on every machine), cuda or cuda:N.
    ``cuda`` without an index takes GPU ``local_rank`` modulo the GPUs this process sees (one
    per process of a machine under mpirun/srun, where several GPUs are visible)."""
    from dipoorlet.errors import ConfigError
    from dipoorlet.torch_graph import import_torch

    torch = import_torch()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want in (None, "cpu"):
        if count and want is None:
            log.info("torch sees %d CUDA GPU%s; --recon_device cuda fits the rounding there (the CPU here)",
                     count, "" if count == 1 else "s")
        return "cpu"
    if not count:
        raise ConfigError(f"--recon_device {want}: this torch ({torch.__version__}) sees no CUDA GPU (a CPU build, "
                          f"or no driver); install a CUDA build of torch, or use --recon_device cpu")
    index = local_rank % count if want == "cuda" else int(want.split(":", 1)[1])
    if index >= count:
        raise ConfigError(f"--recon_device {want}: torch sees {count} CUDA GPU{'' if count == 1 else 's'} "
                          f"(cuda:0{'' if count == 1 else f' to cuda:{count - 1}'}); name one of them, or cuda")
    return f"cuda:{index}"


def reconstruct_blocks(g, places, plan, data, indices, comm, iters: int, drop: bool,
                       shifted=(), batch: int | None = None, lsq: bool = False, device: str = "cpu") -> dict:
    """Fit the rounding of every Conv/ConvTranspose/Gemm/MatMul weight block by block; results go
    into ``plan.values`` (owned by the layer). Returns the summary for report.json. The fit seeds
    torch's random generator; the caller's generator state is restored afterwards (an API caller's
    next torch.rand was the seeded sequence's)."""
    from dipoorlet.torch_graph import import_torch

    torch = import_torch()
    dev = torch.device(device)
    if dev.type != "cuda":
        # (only the CPU's generator: fork_rng's default saves every GPU's, starting CUDA on each)
        with torch.random.fork_rng(devices=[]):
            return _reconstruct_blocks(torch, g, places, plan, data, indices, comm, iters, drop, shifted, batch, lsq,
                                       dev)
    from dipoorlet.errors import DipoorletError

    # full float32 convolutions and products, as on the CPU (cuDNN's default is TF32, a 10-bit
    # mantissa, in the float targets as in the quantized stream); this process's GPU only
    flags = _tf32_off(torch)
    try:
        with torch.random.fork_rng(devices=[dev.index or 0]), torch.cuda.device(dev):
            return _reconstruct_blocks(torch, g, places, plan, data, indices, comm, iters, drop, shifted, batch,
                                       lsq, dev)
    except torch.cuda.OutOfMemoryError as exc:
        raise DipoorletError(f"--recon_device {dev}: the GPU ran out of memory ({str(exc).splitlines()[0][:160]}); "
                             f"both streams' samples stay on it: fewer samples (--gptq_samples), a smaller --ada_bs, "
                             f"or --recon_device cpu") from None
    finally:
        _restore(torch, flags)


def _tf32_off(torch) -> list:
    """Turn TF32 off for CUDA convolutions and matrix products; returns what to restore."""
    import warnings

    saved = []
    with warnings.catch_warnings():      # (newer torch: the legacy flags' deprecation warning)
        warnings.simplefilter("ignore")
        for obj, name in ((torch.backends.cudnn, "allow_tf32"), (torch.backends.cuda.matmul, "allow_tf32")):
            try:
                value = getattr(obj, name)
                setattr(obj, name, False)
                saved.append((obj, name, value))
            except Exception:  # noqa: BLE001 - a torch that names these otherwise: its defaults stay
                pass
    return saved


def _restore(torch, saved: list) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj, name, value in saved:
            try:
                setattr(obj, name, value)
            except Exception:  # noqa: BLE001
                pass


def _reconstruct_blocks(torch, g, places, plan, data, indices, comm, iters, drop, shifted, batch, lsq, dev) -> dict:
    from dipoorlet.pipeline import is_bias
    from dipoorlet.torch_graph import TorchGraph

    t0 = time.perf_counter()
    qmodel = insert_qdq(g, places, plan)
    qnodes = {n.name: n for n in qmodel.graph.node}
    uses: dict[str, int] = {}
    for wp in places.weights.values():
        uses[wp.tensor] = uses.get(wp.tensor, 0) + 1
    values = plan.values
    float_values, learn = {}, {}
    skipped = {}
    for (name, index), wp in places.weights.items():
        qp = plan.weights.get(wp.tensor)
        if qp is None or name not in qnodes:
            continue
        out = qnodes[name].input[index]
        src = values.get(wp.tensor) if (wp.tensor in values and plan.value_owners.get(wp.tensor) in (None, name)) \
            else g.weight(wp.tensor)
        float_values[out] = np.asarray(src, np.float32)
        if is_bias(g, name, index):
            continue
        op = g.node_by_name[name].op_type
        if op not in LEARNABLE_OPS:
            continue
        if uses[wp.tensor] != 1:
            skipped[name] = "weight shared with another node"
            continue
        learn[out] = (name, wp.tensor, qp)
    # constants the plan replaced in the quantized model (shifted biases, --bc): the float
    # stream reads the float graph's own
    qinit = {t.name for t in qmodel.graph.initializer}
    float_consts = {k: g.weight(k) for k in values if k in qinit and k in g.initializers}
    tg = TorchGraph(qmodel, float_values, float_consts, device=dev)
    for r in shifted:
        for name in r["consumers"]:
            node = qnodes.get(name)
            if node is not None and node.input[1] in learn:
                alpha = float(next((a.f for a in node.attribute if a.name == "alpha"), 1.0))
                tg.shift_corr[name] = (node.input[1], float(r["shift"]), alpha)
    torch.manual_seed(SEED)
    # each layer's rounding is made when its block starts and shrunk to its integers when the
    # block is done (all of them made up front had held 3.25x the weights for the whole run)
    softs = {}
    no_soft = set()      # weights a reader outside torch keeps at their nearest rounding
    # biases of Conv/ConvTranspose/Gemm layers whose input has a grid: learned with the rounding
    biases, bias_of = {}, {}
    reads = Counter(i for m in qmodel.graph.node for i in m.input)
    outputs = {o.name for o in qmodel.graph.output}
    for out, (name, tensor, qp) in learn.items():
        node = qnodes[name]
        if not LEARN_BIAS or node.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(node.input) < 3 \
                or not node.input[2]:
            continue
        bname = node.input[2]
        if reads[bname] != 1 or bname in outputs:
            continue            # a bias read by several layers, or a network output, keeps its value
        chain = tg.chains.get(node.input[0])
        if chain is None or chain.scale.ndim or (bname not in tg.consts and bname not in tg.wdq):
            continue
        b0 = tg.value(bname, {}, "q").cpu().numpy()
        W = float_values[out]
        s_w = np.asarray(qp.scale, np.float64)
        if node.op_type == "ConvTranspose":
            fan_in = W.shape[0] * int(np.prod(W.shape[2:]))
        elif node.op_type == "Gemm":
            fan_in = W.shape[0] if _gemm_trans(node) == 0 else W.shape[1]
        else:
            fan_in = int(np.prod(W.shape[1:]))
        unit = float(chain.scale.item()) * s_w * math.sqrt(fan_in)
        if b0.ndim != 1 or np.size(unit) not in (1, b0.size):
            continue
        biases[bname] = Bias(torch, b0, unit, dev)
        bias_of[out] = bname
        tg.bias[bname] = biases[bname]
    readers = {}
    for k, n in enumerate(tg.nodes):
        for i in n.input:
            if i in learn:
                if tg.opaque[k]:       # runs outside torch (e.g. an auto_pad SAME Conv): no gradient
                    skipped[n.name] = f"{n.op_type} runs outside torch here (no gradient)"
                    no_soft.add(i)
                    bname = bias_of.pop(i, None)
                    if bname:
                        tg.bias.pop(bname, None)
                    continue
                readers.setdefault(k, []).append(i)
    learn_pos = sorted(readers)
    if not learn_pos:
        return {"blocks": 0, "layers": 0, "candidates": 0, "skipped": skipped}
    # past the last position reading a constant, its torch copies (float, dequantized) and arrays
    # go (every block's had stayed to the end of the run)
    blocks, last, const_last = _layout(tg, learn_pos)
    by_last, done_consts = sorted((k, t) for t, k in const_last.items()), 0
    rebased = {g.node_by_name[n].input[1] for r in shifted or () for n in r["consumers"]
               if n in g.node_by_name and len(g.node_by_name[n].input) > 1}
    # --lsq: one learned scale per activation grid (the tensors a backend ties share one), learned
    # in the block that holds every chain reading it; power-of-two grids keep theirs
    groups_lsq: dict[int, dict] = {}
    if lsq:
        at = {n.output[0]: k for k, n in enumerate(tg.nodes) if n.output and n.output[0] in tg.chains}
        for dq, fq in tg.chains.items():
            tensor = fq.src if fq.src in plan.activations else dq if dq in plan.activations else None
            rule = plan.rules.get(tensor)
            if tensor is None or dq not in at or (rule is not None and rule.power_of_two):
                continue
            qp = plan.activations[tensor]
            grp = groups_lsq.setdefault(id(qp), {"step": Step(torch, fq.scale.cpu().numpy(), dev), "pos": [], "qp": qp})
            grp["pos"].append(at[dq])
            fq.step = grp["step"]
    total = comm.allreduce_sum(np.array([len(indices)], np.float64))[0]
    log.info("%s: %d layers in %d blocks, %d samples, %d steps per block, on %s", "qdrop" if drop else "brecq",
             len(learn_pos), len(blocks), int(total), iters, _device_name(torch, dev))
    # the samples, both streams: tensor name -> torch tensor
    qs, fs = [], []
    for i in indices:
        feed = {k: torch.from_numpy(np.array(v)).to(dev) for k, v in data.sample(i).items()}
        qs.append(dict(feed))
        fs.append(dict(feed))
    pos = 0
    records = []
    gen = torch.Generator(device=dev).manual_seed(SEED + comm.rank)
    rng = np.random.default_rng(SEED + comm.rank)
    # samples on which a block's float target or quantized input holds a NaN/Inf (a fully padded
    # sequence through a -inf mask): left out from that block on, as --adaround/--gptq do (one NaN
    # made every block's summed loss NaN, and every block kept its nearest rounding without a word)
    bad: list[int] = []
    for bi, (start, end, layer_pos) in enumerate(progress(blocks, "brecq blocks", comm)):
        live = [j for j in range(len(qs)) if qs[j] is not None]
        with torch.no_grad():
            for envs in (qs, fs):
                for j in live:
                    env = envs[j]
                    tg.run(env, pos, start, "q" if envs is qs else "f")
                    _forget(env, last, start)
        produced = {o for n in tg.nodes[start:end] for o in n.output if o}
        outs = [t for t in produced if last.get(t, -1) >= end]
        ins = sorted({t for n in tg.nodes[start:end] for t in tg.reads(n)
                      if t not in produced and t not in tg.consts and t not in tg.wdq})
        targets = [None] * len(fs)
        inner = [t for t in produced if last.get(t, -1) < end]
        with torch.no_grad():
            for j in live:
                env = fs[j]
                tg.run(env, start, end, "f")
                targets[j] = {t: env[t] for t in outs if _is_float(env[t])}
                # the block's inner tensors: not needed past the targets (they were held for every
                # sample through the fit, 3x the tensors crossing the cut; found by a memory hunt)
                for t in inner:
                    env.pop(t, None)
                # a block input may hold -inf: an additive attention mask's positions left out (every
                # such sample had been dropped, and with all of them masked nothing was fitted;
                # found by a review); NaN in an input, or anything not finite in a target, is not data
                if not all(bool(torch.isfinite(v).all()) for v in targets[j].values()) or any(
                        bool(torch.isnan(qs[j][t]).any()) for t in ins if t in qs[j] and _is_float(qs[j][t])):
                    bad.append(j)
                    qs[j] = fs[j] = targets[j] = None
        live = [j for j in live if qs[j] is not None]
        outs = [t for t in outs if live and t in targets[live[0]]]
        names = [tg.nodes[k].name for k in layer_pos]
        mine = [o for k in layer_pos for o in readers[k]]
        for o in mine:
            if o not in softs:
                W = np.asarray(float_values[o], np.float64)
                softs[o] = Soft(torch, W, learn[o][2], _pins(W, learn[o][2]), dev)
                del W
                if o not in no_soft:
                    tg.soft[o] = softs[o]
        blk_softs = [softs[o] for o in mine] + [biases[bias_of[o]] for o in mine if o in bias_of]
        blk_steps = [grp["step"] for grp in groups_lsq.values() if all(start <= k < end for k in grp["pos"])]

        # samples whose block inputs have the same shapes run as one batch (concatenated on the
        # first axis) where the block allows it: checked on the float stream against the targets
        groups: dict[tuple, list[int]] = {}
        for j in live:
            env = qs[j]
            groups.setdefault(tuple(tuple(env[t].shape) if t in env else None for t in ins), []).append(j)
        # (the first axis need not be 1: a sequence model's frames are its batch; the check decides)
        stack = {t: all(t in qs[j] and _is_float(qs[j][t]) and qs[j][t].ndim for j in live) for t in ins}

        def run_batch(idx, mode, mode_drop=0.0, hard=False, fmix=None, check=False):
            src = qs if mode == "q" else fs
            env = {}
            for t in ins:
                if t not in src[idx[0]]:
                    continue
                env[t] = torch.cat([src[j][t] for j in idx], 0) if stack[t] and len(idx) > 1 else src[idx[0]][t]
                if fmix is not None and stack[t]:
                    f = torch.cat([fs[j][t] for j in idx], 0) if len(idx) > 1 else fs[idx[0]][t]
                    if f.shape == env[t].shape:
                        env[t] = torch.where(torch.rand(f.shape, generator=gen, device=dev) < fmix, f, env[t])
            tg.run(env, start, end, mode, drop=mode_drop, gen=gen, hard=hard)
            tot = 0.0
            for t in outs:
                f = torch.cat([targets[j][t] for j in idx], 0) if len(idx) > 1 else targets[idx[0]][t]
                if check:
                    if env[t].shape != f.shape or not torch.allclose(env[t], f, rtol=1e-3, atol=1e-5 * float(
                            f.abs().max()) + 1e-12):
                        return None
                    continue
                d = (env[t] - f).reshape(len(idx), -1)
                ff = f.reshape(len(idx), -1)
                tot = tot + (d.pow(2).sum(1) / (ff.pow(2).sum(1) + 1e-12)).sum()
            return tot

        batched = all(stack.values()) and bool(outs) and all(targets[live[0]][t].ndim for t in outs)
        if batched:
            big = max(groups.values(), key=len)
            if len(big) > 1:
                try:            # a Reshape to a fixed batch of 1 fails here, or gives other values
                    with torch.no_grad():
                        batched = run_batch(big[:2], "f", check=True) is not None
                except Exception as exc:   # noqa: BLE001 - torch's RuntimeError, or onnxruntime's own
                    #                        types from an op run outside torch (an If's batch-1 branch)
                    log.debug("brecq: samples run one at a time (two stacked failed: %s)", exc)
                    batched = False
        if not batched:
            groups = {(j,): [j] for j in live}
        bs = max(1, min(batch or BATCH, max(len(live), 1)))
        chunks = [grp[i:i + (bs if batched else 1)] for grp in groups.values()
                  for i in range(0, len(grp), bs if batched else 1)]

        def block_loss(idx_lists, **kw):
            tot = 0.0
            for idx in idx_lists:
                tot = tot + run_batch(idx, "q", **kw)
            return tot

        for sft in blk_softs + blk_steps:
            sft.mode = "nearest"
        with torch.no_grad():
            l_near = float(comm.allreduce_sum(np.array([float(block_loss(chunks))]))[0])
        for sft in blk_softs + blk_steps:
            sft.mode = "soft"
        rounders = [s for s in blk_softs if isinstance(s, Soft)]
        n_free = sum(s.n_free for s in rounders)
        params = [s.V for s in blk_softs + blk_steps]
        opt = torch.optim.Adam([{"params": [s.V for s in blk_softs], "lr": LR}]
                               + ([{"params": [s.V for s in blk_steps], "lr": LR_STEP}] if blk_steps else []))
        warm = int(WARMUP * iters)
        n_live = comm.allreduce_sum(np.array([len(live)], np.float64))[0]
        norm = l_near / max(n_live, 1.0) if l_near > 0 else 1.0
        for it in range(iters if params and l_near > 0 else 0):
            idx_lists = _draw(groups, bs, batched, rng)
            opt.zero_grad()
            loss = block_loss(idx_lists, mode_drop=DROP if drop else 0.0, fmix=DROP if drop else None) / (bs * norm)
            if it >= warm:
                beta = BETA[1] + (BETA[0] - BETA[1]) * max(0.0, 1.0 - (it - warm) / max(iters - warm, 1))
                loss = loss + LAMBDA * sum(s.reg(beta) for s in rounders) / max(n_free, 1)
            if idx_lists and loss.requires_grad:
                loss.backward()
                for p in params:       # a Sqrt at 0 (a magnitude) gives inf * 0: no step there
                    if p.grad is not None:
                        torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
            if comm.world > 1:
                # the mean over the processes that drew samples: one without any (fewer samples
                # than processes) would add a zero gradient and halve the step
                active = 1.0 if idx_lists and loss.requires_grad else 0.0
                grads = np.concatenate([(p.grad.cpu().numpy().ravel() if p.grad is not None and active else
                                         np.zeros(p.numel(), np.float32)) for p in params] + [np.array([active])])
                grads = comm.allreduce_sum(grads.astype(np.float64))
                grads = grads[:-1] / max(grads[-1], 1.0)
                off = 0
                for p in params:
                    p.grad = torch.from_numpy(grads[off:off + p.numel()].astype(np.float32).reshape(p.shape)).to(dev)
                    off += p.numel()
            opt.step()
        # the block is fitted: its gradients and Adam's two moments per parameter (3x the
        # block's weights) go now, not with the next block's optimizer (they had stayed: +180 MB
        # per block on a 302 MB MatMul stack; found by a memory hunt)
        for p in params:
            p.grad = None
        del opt
        if comm.world > 1:       # every process continues from rank 0's rounding, whatever the sums did
            learned = blk_softs + blk_steps
            for sft, v in zip(learned, comm.bcast([sft.V.detach().cpu().numpy() for sft in learned])):
                with torch.no_grad():
                    sft.V.copy_(torch.from_numpy(v).to(dev))

        def hard_loss():
            with torch.no_grad():
                return float(comm.allreduce_sum(np.array([float(block_loss(chunks, hard=True))]))[0])

        for sft in blk_softs + blk_steps:
            sft.mode = "hard"
        l_hard = hard_loss()
        scales_kept = bool(blk_steps)
        if blk_steps:           # the learned scales stay only where they lower the loss the rounding reached
            for st in blk_steps:
                st.mode = "nearest"
            l_fixed = hard_loss()
            if l_fixed <= l_hard:
                l_hard, scales_kept = l_fixed, False
            else:
                for st in blk_steps:
                    st.mode = "hard"
        kept = l_hard < l_near
        if not kept:
            scales_kept = False
            for sft in blk_softs + blk_steps:
                sft.mode = "nearest"
        rec = {"block": bi, "layers": names, "outputs": len(outs),
               "loss_db": round(10 * math.log10(l_hard / l_near), 3) if l_near > 0 and l_hard > 0 else None,
               "kept": bool(kept)}
        if lsq:
            rec["scales"] = len(blk_steps) if scales_kept else 0
        records.append(rec)
        log.info("%s block %d/%d (%s): block output error %.4g -> %.4g%s%s", "qdrop" if drop else "brecq", bi + 1,
                 len(blocks), ", ".join(names), l_near, l_hard,
                 "" if kept else " (nearest kept)",
                 f" ({len(blk_steps)} activation scales learned)" if scales_kept else "")
        with torch.no_grad():
            for j in live:
                tg.run(qs[j], start, end, "q")
                _forget(qs[j], last, end)
                _forget(fs[j], last, end)
        for o, sft in softs.items():
            if sft.ints is None and const_last.get(o, -1) < end:
                sft.finish(learn[o][1] in rebased)
        while done_consts < len(by_last) and by_last[done_consts][0] < end:
            tg.forget_const(by_last[done_consts][1])
            done_consts += 1
        pos = end
    warn_left_out(comm, [(indices[j], sample_name(data.sample(indices[j]), indices[j])) for j in sorted(bad)],
                  "qdrop" if drop else "brecq", "a block's float output or quantized input is NaN/Inf on them")
    total -= comm.allreduce_sum(np.array([len(bad)], np.float64))[0]
    changed, old_w, new_w = [], {}, {}
    # the dequantized weights before and after, kept only for the layers reading a shifted input
    # (whose biases are rebased below), in float32: float64 copies of every layer's had been the
    # run's peak (+1.6 GB on a 302 MB MatMul stack; found by a hunt)
    for out, (name, tensor, qp) in learn.items():
        sft = softs.get(out)
        if sft is None or not sft.differs:
            continue
        z, s = sft.z.cpu().numpy().astype(np.float64), sft.s.cpu().numpy().astype(np.float64)
        value = (sft.ints.astype(np.float64) - z) * s
        if tensor in rebased:
            old_w[tensor] = ((sft.near.astype(np.float64) - z) * s).astype(np.float32)
            new_w[tensor] = value.astype(np.float32)
        plan.values[tensor] = value.astype(g.weight(tensor).dtype)
        del value
        plan.value_owners[tensor] = name
        changed.append(name)
    for out, bname in bias_of.items():
        b = biases[bname]
        if b.mode == "nearest" or not np.any(b.V.detach().cpu().numpy()):
            continue
        name = learn[out][0]
        tensor = next(wp.tensor for (n, i), wp in places.weights.items() if n == name and i == 2) \
            if bname in tg.wdq else bname
        plan.values[tensor] = b.value().astype(np.float32)
        plan.value_owners[tensor] = name
        if name not in changed:
            changed.append(name)
    if shifted and new_w:
        from dipoorlet.shift import rebased_for_values

        # a shifted input's consumers hold b - W_q d: rebase on the new W_q
        plan.values.update(rebased_for_values(g, plan, shifted, old_w, new_w))
    ratios = []
    if groups_lsq:
        # learned scales replace their grids (every tensor that shares one): the clip range follows
        # the scale, the zero point stays
        new_qp = {}
        for key, grp in groups_lsq.items():
            st = grp["step"]
            if st.mode == "nearest" or not np.any(st.V.detach().cpu().numpy()):
                continue
            qp = grp["qp"]
            r = np.exp(st.V.detach().cpu().numpy().astype(np.float64))
            new_qp[key] = dataclasses.replace(
                qp, scale=st.value().astype(np.float32),
                lo=(np.asarray(qp.lo, np.float64) * r).astype(np.float32),
                hi=(np.asarray(qp.hi, np.float64) * r).astype(np.float32))
            ratios.append(float(np.mean(r)))
        for t, qp in list(plan.activations.items()):
            if id(qp) in new_qp:
                plan.activations[t] = new_qp[id(qp)]
    gains = [r["loss_db"] for r in records if r["kept"] and r["loss_db"] is not None]
    log.info("%s: %d of %d blocks re-rounded (%d layers) over %d samples in %.1f s; block output error "
             "change: median %.1f dB", "qdrop" if drop else "brecq", sum(r["kept"] for r in records), len(records),
             len(changed), int(total), time.perf_counter() - t0, float(np.median(gains)) if gains else 0.0)
    return {"blocks": len(records), "layers": len(changed), "changed": changed, "candidates": len(learn),
            "samples": int(total), "device": str(dev),
            "iters": iters, "drop": bool(drop), "block_loss": records, "skipped": skipped,
            **({"lsq": {"grids": len(groups_lsq), "learned": len(ratios),
                        "scale_ratio": [round(min(ratios), 4), round(float(np.median(ratios)), 4),
                                        round(max(ratios), 4)] if ratios else None}} if lsq else {})}


def _device_name(torch, dev) -> str:
    if dev.type != "cuda":
        return "the CPU"
    return f"{dev} ({torch.cuda.get_device_name(dev)})"


def _past_output_grid(tg, p: int) -> int:
    """Move the last block's cut past the Q/DQ of a network output that reads the tensor just
    produced (backends that quantize network outputs: snpe, qnn, rk...): its loss then measures
    the output as written. Cut before it, a block that fixed an overshoot the output's clip had
    absorbed anyway, and added error the clip keeps, was kept (the written output's SQNR fell
    23.4 -> 20.2 dB; found by a bug hunt)."""
    nodes = tg.nodes
    while 0 < p < len(nodes):
        n = nodes[p]
        fq = tg.chains.get(n.output[0]) if n.op_type == "DequantizeLinear" else None
        if fq is None or n.output[0] not in tg.outputs or fq.src not in {o for o in nodes[p - 1].output if o}:
            break
        p += 1
    return p


def _past_affine(tg, p: int, live) -> int:
    """Move a cut past the Add/Sub/Mul/Div of a constant that reads the tensor just produced (a
    MatMul's bias, an absorbed shift, a --bc correction): the block's loss then sees the layer's
    whole output, not a part that a constant outside the block changes."""
    nodes = tg.nodes
    while p < len(nodes) and p > 0 and live[p + 1] <= live[p]:
        n = nodes[p]
        prev = {o for o in nodes[p - 1].output if o}
        if n.op_type not in ("Add", "Sub", "Mul", "Div") or tg.opaque[p]:
            break
        data = [i for i in n.input if i in prev]
        const = [i for i in n.input if i in tg.consts]
        if len(data) != 1 or len(const) != 1:
            break
        p += 1
    return p


def _gemm_trans(node) -> int:
    return next((a.i for a in node.attribute if a.name == "transB"), 0)


def _draw(groups: dict, bs: int, batched: bool, rng) -> list[list[int]]:
    """One step's samples: ``bs`` of them (all where fewer), as batches of equal input shapes
    (groups drawn by their size until ``bs`` samples are in) or one by one."""
    n = sum(len(v) for v in groups.values())
    if n == 0:
        return []
    if not batched:
        return [[int(j)] for j in rng.choice(n, min(bs, n), replace=False)]
    keys = list(groups)
    sizes = np.array([len(groups[k]) for k in keys], np.float64)
    out, count = [], 0
    for gi in rng.choice(len(keys), len(keys), replace=False, p=sizes / sizes.sum()):
        grp = groups[keys[gi]]
        take = min(bs - count, len(grp))
        out.append([int(j) for j in rng.choice(grp, take, replace=False)])
        count += take
        if count >= bs:
            break
    return out


def _forget(env: dict, last: dict, p: int) -> None:
    """Drop the tensors no node at position p or later reads."""
    for t in [t for t in env if last.get(t, -1) < p]:
        del env[t]
