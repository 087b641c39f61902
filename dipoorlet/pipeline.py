"""``quantize()``: the one orchestrator. No algorithm code here, only the order of stages.

load → prepare (incl. BN folding, float16 widening) → equalization (a statistics pass; data-free
weight equalization on per-tensor-weight backends) → place Q/DQ → calibration (one pass: ranges
and histograms; with -A minmax the equalization pass already gave the ranges) → ranges → plan →
weights → activation shift → bias correction (default; not with a fitted rounding) → QDQ model → deploy files → error profile →
report. Every output is written into a staging
folder inside -O and moved into place only when the whole run has succeeded, so a failed run
leaves no half-written file behind.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from dipoorlet import calibrate, layer_errors, placement as placement_mod, platform as platform_mod, prepare, report, sensitivity
from dipoorlet import shift as shift_mod
from dipoorlet.config import QuantConfig
from dipoorlet.data import VALIDATION, DataSource, input_specs, shard, spread
from dipoorlet.deploy import DeployContext, export_all
from dipoorlet.dist import MPIComm, SingleProcess
from dipoorlet.errors import ConfigError, DataError, ModelError, OutputError
from dipoorlet.graph import (FLOAT_TYPES, INTEGER_TYPES, PROTOBUF_LIMIT, Graph, node_attr, check_float, model_bytes, model_files,
                             opset_of, save_model, subgraphs)
from dipoorlet.qdq import insert_qdq
from dipoorlet.qparams import MIN_SCALE, QuantPlan, bias_qparams, levels, make_qparams, share_scales
from dipoorlet.ranges import NEEDS_HISTOGRAM, RANGE_METHODS, RangeParams, clip_range, power_of_two_clip
from dipoorlet.util import write_json

log = logging.getLogger(__name__)

# integer and bool element types: outputs of these (class ids, indices, masks) are not scored by default


@dataclass
class Result:
    output_dir: Path
    files: list[Path]
    report: dict
    rows: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)


def check_output_dir(path: Path) -> None:
    if os.path.lexists(path) and not path.is_dir():
        what = "a broken symbolic link" if path.is_symlink() and not path.exists() else "not a folder"
        raise OutputError(f"-O {path} is {what}; pass -O with a folder (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"output folder {path} is not writable ({exc.strerror}); "
                          "pass -O with a folder you can write to") from exc


LOCK = ".dipoorlet.lock"


class OutputLock:
    """One run at a time per -O: an exclusive lock (flock) on ``-O/.dipoorlet.lock`` for the
    run's life, the file removed when the run ends. Two runs into one folder shared the temporary
    log name and could publish into each other; the second now stops with one line. Holding it, a
    run also removes the staging folders runs killed by SIGKILL left behind (none can be live),
    except one that keeps earlier outputs it could not put back. A file system without flock
    runs unlocked."""

    def __init__(self, out_dir: Path):
        self.fd, self.path = None, Path(out_dir) / LOCK
        try:
            import fcntl
        except ImportError:   # not POSIX
            return
        for _ in range(5):
            try:
                # never through a symbolic link: the pid written into it would replace a file elsewhere
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
            except OSError:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = os.read(fd, 64).decode("ascii", "replace").strip()
                except OSError:
                    holder = ""
                os.close(fd)
                raise OutputError(f"another dipoorlet run{' (pid ' + holder + ')' if holder.isdigit() else ''} "
                                  f"is writing into -O {out_dir}; wait for it to finish or choose another -O") from None
            except OSError:   # no flock here (some network file systems): run unlocked
                os.close(fd)
                return
            try:              # the file a run that just ended removed is no lock: open the new one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except OSError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            return
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError:
            pass
        _sweep_staging(Path(out_dir))

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.unlink(self.path)     # while held: a run that opened it meanwhile sees it gone
            except OSError:
                pass
            os.close(self.fd)            # closing the descriptor drops the lock
            self.fd = None


def _sweep_staging(out_dir: Path) -> None:
    for folder in out_dir.glob(".dipoorlet-staging-*"):
        if not folder.is_dir() or folder.is_symlink():
            continue
        held = folder / ".replaced"
        if held.is_dir() and any(p.is_file() for p in held.rglob("*")):
            log.warning("%s holds earlier outputs a killed run could not put back; left in place", folder)
            continue
        shutil.rmtree(folder, ignore_errors=True)


def guard_inputs(model, input_dir, out_dir: Path, savefp: bool = False) -> None:
    """Refuse, before any work, a run whose outputs would replace its own model or data: -M is a
    model this tool writes into -O (an earlier run's quant_model.onnx quantized again in place),
    or -M / -I lies where the --savefp outputs go."""
    out = Path(out_dir).resolve()
    m = Path(model).resolve()
    # (transformed_model.onnx is written only where a transform ran: a run that would replace it is
    # stopped when the outputs are published, see _publish)
    if m.parent == out and m.name in ("quant_model.onnx", "quant_model_qdq.onnx", "quant_model.onnx.data",
                                      "quant_model_qdq.onnx.data"):
        raise OutputError(f"-M {model} is in -O {out_dir}, where this run writes {m.name}: it would be "
                          f"overwritten; copy the model elsewhere or choose another -O")
    for what, path in (("-M", m), ("-I", Path(input_dir).resolve())) if savefp else ():
        if path == out / "output" or out / "output" in path.parents:
            raise OutputError(f"{what} {path} is under {out / 'output'}, where --savefp writes; "
                              f"move it or choose another -O")


def load_graph(cfg: QuantConfig, plat=None) -> Graph:
    g = Graph.load(cfg.model)
    check_float(g.model, cfg.model)
    # the names the input model has: where the side files name anything else (a folded
    # BatchNormalization's weight, a tensor the opset conversion made), transformed_model.onnx
    # is the float model they describe
    g.source_names = ({t.name for t in g.graph.initializer} | {i.name for i in g.graph.input}
                      | {o for n in g.graph.node for o in n.output})
    g.torch_scopes = torch_scopes(g.model)
    # a backend that quantizes a HardSwish op's input and output only runs the decomposed form
    # as that one op (its converter fuses it): fused here so the gate gets no grid of its own
    done = prepare.prepare(g, hardswish=plat is not None and "HardSwish" in plat.quantize_ops)
    g.prepared = done
    log.info("model %s: opset %d (was %d), %d nodes, %d Constant weights moved to initializers, "
             "%d constant subexpressions folded, %d BatchNormalization and %d constant Add/Sub/Mul/Div folded "
             "into Conv/ConvTranspose%s%s", cfg.model, g.opset,
             done["opset_from"], len(g.graph.node), done["constants_to_initializers"], done["constants_folded"],
             done["batchnorms_folded"], done["elementwise_folded"],
             f", {done['layernorms_fused']} decomposed LayerNorms fused" if done.get("layernorms_fused") else "",
             f", {done['hardswish_fused']} decomposed HardSwish fused" if done.get("hardswish_fused") else "")
    if done.get("pool_counts_unpadded"):
        log.info("%d AveragePool with ceil_mode=1 and no padding: count_include_pad=1 -> 0, the same function, in "
                 "the form onnxruntime's integer kernel gets right", done["pool_counts_unpadded"])
    if done["float16_widened"]:
        log.warning("model %s is %s: calibrated and written in float32 (%d weights, types and Casts "
                    "widened; inputs %s now float32); the backends build float32 Q/DQ models and run "
                    "the layers left float in FP16 when asked (e.g. TensorRT --fp16)", cfg.model,
                    " and ".join(getattr(g, "half_types", None) or ["float16"]), done["float16_widened"],
                    sorted(g.file_dtypes) or "none")
    untyped = [o for n in g.graph.node for o in n.output if o and g.elem_type(o) is None]
    if untyped:
        # ONNX shape inference knows no custom op's outputs: onnxruntime (with --custom_op_lib)
        # says which are float, so the ops that read them are quantized as usual
        from dipoorlet.runtime import resolve_types

        found = resolve_types(g.model, untyped)
        outputs = {o.name: o for o in g.graph.output}
        for k, v in found.items():
            if k in outputs:        # a network output declared without a type
                outputs[k].type.tensor_type.elem_type = v
            else:
                g.graph.value_info.append(onnx.helper.make_tensor_value_info(k, v, None))
        if found:
            g.refresh()
            log.info("%d tensors typed by onnxruntime where ONNX shape inference left them untyped", len(found))
    cfg = _follow_folds(_follow_duplicates(_follow_modules(cfg, g), g), g)
    bad = _nonfinite_weights(g)
    if bad:
        # the float model computes NaN/Inf there too; quantized, one Inf made a per-tensor grid's
        # scale inf and every channel non-finite (found by a bug hunt)
        many = len(bad) > 1
        log.warning("%s NaN/Inf value(s) (the float model computes NaN/Inf from %s too): %s float; check "
                    "the export (a BatchNormalization of variance 0 folded?)",
                    ", ".join(f"{n}'s {t} holds {k}" for n, (t, k) in list(bad.items())[:4])
                    + (f" and {len(bad) - 4} more" if len(bad) > 4 else ""),
                    "them" if many else "it", "those layers stay" if many else "the layer stays")
        cfg = dataclasses.replace(cfg, skip_layers=tuple(cfg.skip_layers) + tuple(n for n in bad
                                                                                   if n not in cfg.skip_layers))
    unknown = [o for o in cfg.score_outputs if o not in g.output_names]
    if unknown:
        raise ConfigError(f"--score_outputs names {unknown}, which are not outputs of the model; its outputs "
                          f"are {list(g.output_names)[:8]}")
    ints = [o for o in g.output_names if g.elem_type(o) in INTEGER_TYPES]
    if not cfg.score_outputs and ints and len(ints) < len(g.output_names):
        # class ids, indices, counts, masks: a cosine of them is not a measure of the quantization,
        # and it decided --fail_below and the --auto_* searches (a 0.994 "cosine" of ArgMax ids
        # failed a 0.999 gate whose float output read 0.99996)
        rest = [o for o in g.output_names if o not in ints]
        log.info("scoring the outputs %s; %s integer, not compared by cosine (--score_outputs to choose)",
                 ", ".join(rest[:6]), ", ".join(ints[:6]) + (" are" if len(ints) > 1 else " is"))
        cfg = dataclasses.replace(cfg, score_outputs=tuple(rest))
    elif not cfg.score_outputs and ints:
        # nothing else to judge: said, since the README's default leaves integer outputs out
        log.warning("every output of the model is integer (%s): they are scored as they are, by cosine, which "
                    "--fail_below and the --auto_* searches then judge (class ids that differ at a few pixels read "
                    "as a cosine, not as an agreement); make the float tensor before them (an ArgMax's input) an "
                    "output too to judge that instead", ", ".join(ints[:6]))
    elif any(o in ints for o in cfg.score_outputs):
        # asked for by name: scored, and said how (class ids at cosine 0.982 passed a 0.95 gate
        # and stopped --auto_skip where the agreement was 93.75%; found by a hunt)
        named = [o for o in cfg.score_outputs if o in ints]
        log.warning("--score_outputs %s: integer output(s), scored by cosine as they are, which --fail_below and the "
                    "--auto_* searches then judge (class ids that differ read as a cosine, not as an agreement); "
                    "name the float tensor before them (an ArgMax's input) to judge that instead", ", ".join(named))
    missing = (set(cfg.skip_layers) | set(cfg.layer_bits)) - set(g.node_by_name)
    inside = _nested_node_names(g) & missing
    if inside:
        # nodes of an If/Loop/Scan body: they stay float whatever is asked (the tool quantizes
        # the main graph only); they had been called "not nodes of the model"
        bits = sorted(inside & set(cfg.layer_bits))
        if bits:
            raise ConfigError(f"--layer_bits names {bits}, which sit inside If/Loop/Scan bodies: their ops stay "
                              "float, as this tool quantizes the main graph only; drop them, or export the branch "
                              "that runs as the graph itself")
        log.warning("--skip_layers %s: inside If/Loop/Scan bodies, whose ops stay float anyway (this tool "
                    "quantizes the main graph only)", ", ".join(sorted(inside)[:5]))
        cfg = dataclasses.replace(cfg, skip_layers=tuple(n for n in cfg.skip_layers if n not in inside))
        missing -= inside
    if missing:
        sample = ", ".join(sorted(g.node_by_name)[:5])
        mods = sorted({sc[-1] for sc in getattr(g, "torch_scopes", {}).values() if sc})
        raise ConfigError(f"--skip_layers/--layer_bits name {sorted(missing)}, which are not nodes of the model "
                          f"(nodes are named like: {sample}, ...); use node names, not tensor names"
                          + (f" (--skip_layers also takes the torch modules this export recorded, like: "
                             f"{', '.join(mods[:3])}, ...)" if mods else ""))
    return g, cfg


def _nonfinite_weights(g: Graph) -> dict[str, tuple[str, int]]:
    """Layers (Conv/ConvTranspose/Gemm/MatMul) whose constant weight or bias holds NaN or Inf:
    node -> (that constant, how many values)."""
    out = {}
    for node in g.graph.node:
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or not node.name:
            continue
        for name in node.input[:3]:
            if name and g.is_constant(name) and g.is_float(name):
                w = g.weight(name)
                k = int(w.size - np.count_nonzero(np.isfinite(w)))
                if k:
                    out[node.name] = (name, k)
                    break
    return out


SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def torch_scopes(model) -> dict[str, list[str]]:
    """Node name -> the torch module path torch's dynamo exporter recorded for it (its
    ``pkg.torch.onnx.name_scopes`` metadata: ``['', 'm', 'm.encoder', ..., 'linear_4']``, the last
    entry the traced call's own name); empty for other exporters, whose node names carry the
    path already (``/encoder/layer.0/.../MatMul``)."""
    import ast

    out = {}
    for node in model.graph.node:
        for p in node.metadata_props:
            if p.key != SCOPES_KEY:
                continue
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                break
            if isinstance(scopes, list) and all(isinstance(x, str) for x in scopes):
                # dynamo puts a placeholder scope on nodes it traced outside any module (a Shape)
                out[node.name] = [x for x in scopes[:-1] if x and not x.startswith("_empty_nn_module_stack")]
            break
    return out


def torch_module(g: Graph, node: str) -> str | None:
    """The innermost torch module a node was traced in (dynamo exports), e.g.
    ``m.encoder.layer.0.intermediate.dense`` for ``node_MatMul_85``; None where not recorded."""
    scopes = getattr(g, "torch_scopes", {}).get(node)
    return scopes[-1] if scopes else None


def _follow_modules(cfg: QuantConfig, g: Graph) -> QuantConfig:
    """A --skip_layers name that is no node but a torch module of a dynamo export (its nodes
    are named ``node_MatMul_85``, their module paths are in the metadata) keeps the module's
    nodes float, as users name their layers in PyTorch."""
    scopes = getattr(g, "torch_scopes", {})
    if not scopes:
        return cfg
    expanded = []
    for name in cfg.skip_layers:
        if name in g.node_by_name or name in getattr(g, "duplicate_names", {}):
            expanded.append(name)
            continue
        members = [n for n, sc in scopes.items() if name in sc]
        if not members:
            expanded.append(name)          # said below: not a node of the model
            continue
        # the nodes preparation kept or folded into another (a tied lm_head's Transpose is gone;
        # a review found the run stopped on a node name the user never typed)
        folded = getattr(g, "folded_into", {})
        members = [n for n in members if n in g.node_by_name or n in folded]
        if not members:
            log.warning("--skip_layers %s: the torch module's nodes were all folded away when the model was "
                        "prepared (constants, Identity ops); nothing of it to keep float", name)
            continue
        log.info("--skip_layers %s: the torch module's %d nodes (%s)", name, len(members),
                 ", ".join(members[:6]) + (" ..." if len(members) > 6 else ""))
        expanded += members
    return dataclasses.replace(cfg, skip_layers=tuple(dict.fromkeys(expanded)))


def _follow_duplicates(cfg: QuantConfig, g: Graph) -> QuantConfig:
    """--skip_layers/--layer_bits naming a name several nodes of the model shared apply to every
    one of them (renamed NAME_1, ... to tell them apart); it had reached the first alone, without
    a word (found by a hunt)."""
    folded = getattr(g, "folded_into", {})
    # the nodes of that name preparation kept (or folded into a Conv): an Identity or a constant
    # subexpression of the name is gone (a review found the run stopped on a name the user never typed)
    dups = {n: [m for m in names if m in g.node_by_name or m in folded]
            for n, names in getattr(g, "duplicate_names", {}).items()}
    dups = {n: names for n, names in dups.items() if names}
    named = [n for n in dict.fromkeys([*cfg.skip_layers, *cfg.layer_bits]) if n in dups]
    if not named:
        return cfg
    for n in named:
        if len(dups[n]) > 1:
            log.warning("%d nodes of the model are named %s (now %s): --skip_layers/--layer_bits naming it apply "
                        "to all of them", len(dups[n]), n, ", ".join(dups[n]))
    skip = tuple(dict.fromkeys(m for n in cfg.skip_layers for m in dups.get(n, [n])))
    bits = {m: v for n, v in cfg.layer_bits.items() for m in dups.get(n, [n])}
    return dataclasses.replace(cfg, skip_layers=skip, layer_bits=bits)


def _follow_folds(cfg: QuantConfig, g: Graph) -> QuantConfig:
    """--skip_layers/--layer_bits naming a node that preparation folded into a Conv (a
    BatchNormalization, a constant Add/Mul ...) apply to that Conv."""
    folded = getattr(g, "folded_into", {})
    moved = {n: folded[n] for n in list(cfg.skip_layers) + list(cfg.layer_bits) if n in folded}
    if not moved:
        return cfg
    for n, conv in moved.items():
        log.info("%s was folded into %s (as the backends fold it); --skip_layers/--layer_bits apply to %s",
                 n, conv, conv)
    skip = tuple(dict.fromkeys(moved.get(n, n) for n in cfg.skip_layers))
    # merged field by field (bn=w3 conv=a4: w3 and a4); where both give one field, the Conv's own
    # setting wins, with a warning
    bits, source = {}, {}
    for n, v in sorted(cfg.layer_bits.items(), key=lambda kv: kv[0] not in moved):   # folded nodes first
        target = moved.get(n, n)
        had = bits.get(target, (None, None))
        for k, (old, new) in enumerate(zip(had, v)):
            if old is not None and new is not None and old != new:
                f = "wa"[k]
                log.warning("--layer_bits asks %s%d for %s and %s%d for %s, both %s once folded; %s%d is used",
                            f, old, source[(target, k)], f, new, n, target, f, new)
        bits[target] = tuple(o if w is None else w for o, w in zip(had, v))
        for k, w in enumerate(v):
            if w is not None:
                source[(target, k)] = n
    return dataclasses.replace(cfg, skip_layers=skip, layer_bits=bits)


PROFILE_SAMPLES = 64    # the error profile's default sample count, at most (--prof_samples)


def profile_samples(cfg: QuantConfig) -> int:
    """Samples the error profile reads: it reports and gates (--fail_below), so 64 spread over
    the N estimate it well; a run over thousands of samples would otherwise spend as long again running
    the float and the quantized model side by side. --savefp saves every sample's float outputs."""
    if cfg.savefp:
        return cfg.data_num
    return min(cfg.data_num, cfg.prof_samples or PROFILE_SAMPLES)


def open_validation(cfg: QuantConfig, specs, comm):
    """--val_dir's samples as (source, K, this process's share of K indices spread evenly over
    the folder), or None. Checked before any pass, every sample the profile will read (this process's share):
    the layout, the count, each sample's shape, dtype and values; a mistake there would otherwise
    surface only after calibration."""
    if cfg.val_dir is None:
        return None
    probe = DataSource(cfg.val_dir, specs, 0, cfg.input_shapes, role=VALIDATION)
    have = probe.available()
    if have == 0:
        raise DataError(f"validation data {cfg.val_dir} holds no samples; expected "
                        f"{cfg.val_dir}/<input name>/0.npy (or .bin) ... as for -I, or an .npz")
    gap = probe.beyond_gap()
    if gap is not None:     # the count stops at the gap: the samples after it would go unread unsaid
        folder, missing, later = gap
        raise DataError(f"validation data {folder} has no sample {missing}.npy or {missing}.bin but {later} "
                        f"sample files numbered above it; number the samples 0..K-1 without gaps")
    if cfg.val_num is not None and cfg.val_num > have:
        raise DataError(f"validation data {cfg.val_dir} holds {have} samples (0..{have - 1}) but --val_num is "
                        f"{cfg.val_num}; lower --val_num to {have} or add samples")
    val = DataSource(cfg.val_dir, specs, have, cfg.input_shapes, role=VALIDATION)
    k = cfg.val_num or min(have, PROFILE_SAMPLES)
    indices = spread(k, have, comm.rank, comm.world)
    for i in indices:
        val.sample(i)
    return val, k, indices


def _changed(cfg: QuantConfig, name: str) -> bool:
    """Whether the field ``name`` of ``cfg`` was given (:attr:`QuantConfig.given`) or differs from
    QuantConfig's default."""
    return name in cfg.given or getattr(cfg, name) != QuantConfig.__dataclass_fields__[name].default


def one_pass_minmax(cfg: QuantConfig) -> bool:
    """Equalization statistics and -A minmax ranges from one pass (:func:`equalize.equalize_and_calibrate`;
    the statistics still read only --eq_samples / 64 samples spread over the N)."""
    return cfg.act_quant == "minmax"


def check_bits(cfg: QuantConfig, plat) -> None:
    """--a_bits / --layer_bits asking for wider activations than the backend runs."""
    wide = [("--a_bits", cfg.a_bits)] + [(f"--layer_bits {n}", b[1]) for n, b in cfg.layer_bits.items()]
    if cfg.auto_a16:
        wide.append(("--auto_a16", 16))
    for flag, bits in wide:
        if bits is not None and bits > plat.activation.max_bits:
            keep = "" if flag in ("--a_bits", "--auto_a16") else ", or --skip_layers to keep the layer float"
            narrower = "" if flag == "--auto_a16" else f"use 2..{plat.activation.max_bits} or "
            raise ConfigError(f"{flag} asks for {bits}-bit activations, but {plat.name} runs at most "
                              f"{plat.activation.max_bits}-bit activations; {narrower}use a backend with 16-bit "
                              f"activations (qnn, snpe, ort){keep}")
    if cfg.sparse is not None and cfg.a_bits == 16:
        raise ConfigError("--sparse with --a_bits 16: the pruning is fitted on statistics of layer inputs of 8 bits "
                          "or fewer; prune at 8 bits, or give single layers 16-bit inputs with --layer_bits NODE=a16 "
                          "(those layers stay dense)")
    if cfg.auto_a16 and cfg.shift and shift_mod.applicable(plat):
        raise ConfigError(f"--auto_a16 on {plat.name}: its activation shift renames the tensors the search "
                          "would widen; add --no_shift")


def rule_for(base, bits: int | None):
    """The platform's rule with another bit width (per-layer overrides, --a_bits/--w_bits)."""
    return base if bits is None or bits == base.bits else dataclasses.replace(base, bits=bits)


def warn_degenerate(stats, plan: QuantPlan) -> None:
    """Say which activations calibration could not size, and so stay float (plan_grids): empty in
    every sample, or exactly 0 in every sample outside a group that shares a grid. A grid sized on
    0 is the narrowest there is (about +-1e-8): any other value at deployment would be clipped to
    about 0, e.g. an attention mask term that unpadded calibration sentences leave at 0 (MiniLM's
    (1 - mask) * min: padding would be attended to) or an all-zero recurrent state."""
    def names(ts):
        return ", ".join(ts[:4]) + (f" and {len(ts) - 4} more" if len(ts) > 4 else "")

    def verb(ts, one, many):
        return one if len(ts) == 1 else many

    empty = [t for t, st in stats.items() if st.minmax.count and st.minmax.lo > st.minmax.hi]
    zero = [t for t, st in stats.items() if _zero(st) and t not in plan.activations]
    if empty:
        # NaN is left out of the ranges, so a tensor NaN everywhere reads as empty too (a mask of
        # (1 - m) * -inf gives NaN where m is 1; found by a bug hunt): the line names both
        log.warning("%s %s empty (a zero-length dimension) or NaN throughout in every calibration sample: %s "
                    "float; calibrate with samples of the lengths deployment sees, or find what makes NaN in "
                    "the float model (0 · ∞, log or sqrt of a negative)", names(empty), verb(empty, "is", "are"),
                    verb(empty, "it stays", "they stay"))
    if zero:
        log.warning("%s %s 0 in every calibration sample, which sizes no grid: %s float (a grid of +-%g "
                    "would clip any other value at deployment); calibrate with samples in which %s (a "
                    "recurrent state past the first frame, a padded batch's mask) to quantize %s",
                    names(zero), verb(zero, "is", "are"), verb(zero, "it stays", "they stay"), MIN_SCALE,
                    verb(zero, "it varies", "they vary"), verb(zero, "it", "them"))


def _zero(st) -> bool:
    return bool(st.minmax.count) and st.minmax.lo == 0.0 == st.minmax.hi


def shared_loss_line(losses: dict, plat) -> str:
    """One line on the tensors a shared grid leaves few steps (QuantPlan.shared_losses)."""
    platform = plat.name
    worst = sorted(losses.items(), key=lambda kv: kv[1]["steps"])
    parts = [f"{t} ({v['own'][0]:.4g}..{v['own'][1]:.4g}: {v['steps']:.1f} of the {2 ** v['bits'] - 1} steps of "
             f"the grid {v['grid'][0]:.4g}..{v['grid'][1]:.4g}, tied by {', '.join(v['tied_by'][:2])})"
             for t, v in worst[:3]]
    nodes = list(dict.fromkeys(n for _, v in worst for n in v["tied_by"]))
    return (f"{len(losses)} tensor{'s' if len(losses) > 1 else ''} share{'' if len(losses) > 1 else 's'} a grid far "
            f"wider than {'their' if len(losses) > 1 else 'its'} own values ({platform} gives a Concat's inputs and "
            f"output, and a pass-through op's input and output, one grid): " + "; ".join(parts)
            + (f" and {len(losses) - 3} more" if len(losses) > 3 else "")
            + f"; values there round to few levels, which an output's cosine may not show where the wider "
              f"members dominate it; --skip_layers {' '.join(nodes[:4])} keeps the tying op{'s' if len(nodes) > 1 else ''} "
              f"float (each input its own grid)"
            # a backend without 16-bit activations refuses a16 (rk, imx; found by a review)
            + (", or 16-bit grids for the group (--layer_bits NODE=a16 on its readers)"
               if plat.activation.max_bits >= 16 and any(v["bits"] < 16 for v in losses.values()) else ""))


def plan_grids(g: Graph, stats, cfg: QuantConfig, plat, places, quiet: bool = False) -> QuantPlan:
    """Activation grids (plan_activations), tied into one per group of pass-through ops on
    backends that share them (share_scales), without the activations that were 0 in every
    calibration sample and belong to no such group: a grid sized on 0 is the narrowest there is
    (+-MIN_SCALE), so they stay float (warn_degenerate says so). One that shares a group's grid
    keeps it (a Concat input that is 0 next to ones that are not)."""
    probabilities = calibrate.open_length_probabilities(g)
    plan = plan_activations(stats, cfg, plat, places, reach_one=probabilities)
    widened = [t for t in probabilities if t in plan.activations and t in stats and stats[t].minmax.hi < 1]
    if widened and not quiet:
        log.info("%d Softmax outputs over rows of no fixed length get grids up to 1, where calibration reached "
                 "%.3g: a shorter row's largest probability is higher, 1 for a row of one: %s", len(widened),
                 min(stats[t].minmax.hi for t in widened),
                 ", ".join(widened[:4]) + (f" and {len(widened) - 4} more" if len(widened) > 4 else ""))
    if plat.share_scale:
        share_scales(g, plan, plat.share_scale, quantized=places.quantized_nodes if places is not None else None)
        if plan.shared_losses and not quiet:
            log.warning("%s", shared_loss_line(plan.shared_losses, plat))
    for t in [t for t, qp in plan.activations.items() if t in stats and _zero(stats[t])
              and float(np.max(qp.amax)) <= MIN_SCALE * 4]:     # (x4: a power-of-two grid rounds up)
        del plan.activations[t]
        plan.rules.pop(t, None)
        plan.asked_bits.pop(t, None)
    carrying = [t for t in sorted(calibrate.mask_carrying(g)) if t in plan.activations and not plan.shared.get(t)]
    for t in carrying:
        del plan.activations[t]
        plan.rules.pop(t, None)
        plan.asked_bits.pop(t, None)
    if carrying and not quiet:
        log.info("%d tensors hold an attention mask added to another term short of a Softmax (T5 adds it to its "
                 "position bias) and stay float: a grid sized on the calibration data clips the mask at "
                 "deployment, or rounds the other term away: %s", len(carrying),
                 ", ".join(carrying[:4]) + (f" and {len(carrying) - 4} more" if len(carrying) > 4 else ""))
    return plan


MAX_AMAX = 1e30    # beyond it an activation stays float (see plan_activations)


def plan_activations(stats, cfg: QuantConfig, plat, places=None, reach_one=()) -> QuantPlan:
    """``reach_one``: tensors whose grids reach at least 1 (calibrate.open_length_probabilities)."""
    method = RANGE_METHODS[cfg.act_quant]
    reach_one = set(reach_one)
    plan = QuantPlan()
    for t, st in stats.items():
        if st.minmax.count == 0 or st.minmax.lo > st.minmax.hi:
            continue   # never seen, or empty in every sample: no range to size a grid from (warn_degenerate)
        if not math.isfinite(st.minmax.amax):
            log.warning("tensor %s reaches %s/%s on the calibration data (infinite values, or NaN throughout); it "
                        "stays float", t, st.minmax.lo, st.minmax.hi)
            continue
        # a Softmax input's grid starts at its floor (calibrate.softmax_floors), not at the mask
        reach = (max(abs(st.floor), abs(st.minmax.hi)) if st.floor is not None and st.floor > st.minmax.lo
                 else st.minmax.amax)
        if reach > MAX_AMAX:
            # float32's lowest (HF attention masks write (1 - mask) * finfo.min) or the like: a
            # grid over it has steps of 1e28 and up, and its end levels dequantize to inf
            log.warning("tensor %s reaches %.4g..%.4g on the calibration data (a mask of float32's lowest "
                        "value?): no integer grid can hold that range and it stays float; export the mask "
                        "with a moderate constant (e.g. -1e4) to quantize it", t, st.minmax.lo, st.minmax.hi)
            continue
        point = places.activations.get(t) if places is not None else None
        # the nodes whose --layer_bits decide this grid: its readers, and the producer of a network
        # output quantized in place (a layer's aM covers the activations it owns, output included)
        owners = list(point.owners) if point is not None else []
        if point is not None and point.output and t in places.output_owners:
            owners.append(places.output_owners[t])
        asked = {o: cfg.layer_bits[o][1] for o in owners if o in cfg.layer_bits and cfg.layer_bits[o][1]}
        bits = list(asked.values())
        # readers asking different widths share one grid: 16 bits where one asks for it (as in
        # shared MaxPool/Concat groups), else the narrowest; a reader that asks nothing asks for
        # --a_bits or the backend's width (--a_bits 16 with conv=a8 kept the other reader at 16)
        default = cfg.a_bits or plat.activation.bits
        plain = [o for o in dict.fromkeys(owners) if o not in asked]
        widths = bits + ([default] if plain and bits else [])
        pick = (max(widths) if max(widths) > 8 else min(widths)) if bits else cfg.a_bits
        # an explicit NODE=aM that does not stand here, or a reader narrowed below its width: say so
        if any(b != pick for b in bits) or (plain and bits and pick < default):
            readers = [f"{o}: {b}" for o, b in asked.items()] + [f"{o}: {default} (asked nothing)" for o in plain]
            log.warning("%s is read by layers asking different activation widths (%s); one grid serves them "
                        "all: %d bits", t, ", ".join(readers), pick)
        rule = rule_for(plat.activation, pick)
        nonneg = rule.unsigned_nonnegative and st.minmax.lo >= 0
        qmin, qmax = levels(rule)
        steps = 2**rule.bits - 1 if nonneg else (qmax if rule.symmetric else qmax - qmin)
        # entropy compares the clipped histogram with its requantization on the grid's own levels
        # per side (128 at 8 bits, 8 at 4: a 4-bit search sized its clip for 128); a 16-bit grid
        # has more levels than the 2048 bins hold, so its search keeps the whole range
        params = RangeParams(qmax=steps, threshold=cfg.threshold, percentile=cfg.percentile,
                             quant_bins=2 ** (rule.bits - 1) if rule.bits <= 8 else cfg.bins)
        lo, hi = method(st, params)
        if rule.power_of_two and rule.symmetric and cfg.act_quant == "mse":
            # -A mse on a power-of-two grid: the best power-of-two step, not mse's step rounded up
            clip = power_of_two_clip(st, steps)
            if clip is not None:
                lo, hi = clip_range(st, clip)
        if st.floor is not None and st.floor < hi and (lo < st.floor or st.floor_exact):
            # a Softmax input: below it a value weighs nothing; where a mask is added, the grid
            # reaches it so that padded positions stay hidden (calibrate.softmax_floors)
            lo = st.floor
        if t in reach_one and hi < 1.0 and st.minmax.lo >= 0:
            hi = 1.0
        plan.activations[t] = make_qparams(lo, hi, rule)
        plan.rules[t] = rule
        if bits:
            plan.asked_bits[t] = pick
    return plan


def _bias_sites(g: Graph, places, plan: QuantPlan):
    """(node, weight point, bias tensor, bias values, input grid) of every Conv/ConvTranspose/Gemm
    whose input and weight are both quantized and whose bias is a constant vector per output
    channel."""
    act_of_use = {use: t for t, point in places.activations.items() for use in point.uses}
    for (node_name, index), wp in list(places.weights.items()):
        node = g.node_by_name[node_name]
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(node.input) < 3:
            continue
        bias = node.input[2]
        if not bias or not g.is_constant(bias):
            continue
        src = act_of_use.get((node_name, 0))
        prod = g.producer.get(node.input[0])
        if src is None and prod is not None and prod.op_type == "Pad":
            src = act_of_use.get((prod.name, 0))
        if src is None or src not in plan.activations or wp.tensor not in plan.weights:
            continue
        s_w = plan.weights[wp.tensor]
        # a ConvTranspose gets a per-channel grid only with group 1 (placement.weight_axis), where
        # its axis-1 scales line up with the bias channels as a Conv's do
        shape = g.weight(bias).shape
        if len(shape) != 1 or (s_w.scale.size > 1 and shape[0] != s_w.scale.size):
            continue  # e.g. a Gemm bias of shape (1, N) broadcast by the op: left float
        value = np.asarray(plan.values.get(bias, g.weight(bias)), np.float64)
        yield node_name, wp, bias, value, plan.activations[src]


def _bias_limit(g: Graph, wp, s_in, s_w, channels: int) -> float:
    """The largest |int32 bias| that leaves the accumulator room for the layer's products: a
    bias fitted to 2^31 - 1 itself overflows once fan-in x |x_q| x |w_q| is added (measured: a
    Gemm's output signs flipped in onnxruntime's integer kernels). At least 2^30."""
    w = g.weight(wp.tensor)
    fan_in = max(1, w.size // max(1, channels))
    x_steps = float(s_in.qmax - s_in.qmin)
    symmetric = s_w.signed and not np.any(np.asarray(s_w.zero_point) != 0)
    w_steps = float(max(abs(s_w.qmin), abs(s_w.qmax)) if symmetric else s_w.qmax - s_w.qmin)
    return max(2.0 ** 31 - 1 - fan_in * x_steps * w_steps, 2.0 ** 30)


def _bias_overflows(g: Graph, wp, value, s_in, plan: QuantPlan) -> bool:
    s_w = plan.weights[wp.tensor]
    scale = bias_qparams(s_in, s_w).scale.astype(np.float64)
    return bool(np.any(np.abs(value) / scale > _bias_limit(g, wp, s_in, s_w, value.size)))


def fit_biases(g: Graph, places, plan: QuantPlan, quiet: bool = False) -> set:
    """Widen the weight grids under which a layer's bias would not fit int32 on s_in * s_w, with
    room left for the products the accumulator adds (:func:`_bias_limit`); returns the weights
    widened.

    Integer kernels add the bias to the int32 accumulator on that scale, also where the model
    carries it as float: TFLite's converter (imx, ti) quantizes a float bias itself, and so do
    onnxruntime's default graph optimizations (its BiasQuantization transformer), whose value
    overflows to the far end of int32. Measured on a Gemm reading a state that was 0 in every
    calibration sample (before such tensors stayed float): output cosine 0.59 in a default session
    where the Q/DQ-as-float simulation read 0.9999. So the weight scale is raised until the bias
    fits, as TFLite's and onnxruntime's quantizers do (per channel where the weights have
    per-channel grids): the layer's output is then all but its bias, and its weights' products
    lose nothing at the output's own scale. A weight two layers share is widened for both (one
    pass: widening only makes the other layers' biases fit better; plan_biases plans their int32
    grids again)."""
    widened = set()
    readers: dict[str, int] = {}
    for (name, index), wp in places.weights.items():
        if index == 1:
            readers[wp.tensor] = readers.get(wp.tensor, 0) + 1
    for node_name, wp, bias, value, s_in in _bias_sites(g, places, plan):
        if bias in plan.weights:
            continue        # an int32 grid planned on the grids it has (dropped when they change)
        if _bias_overflows(g, wp, value, s_in, plan) and \
                _widen_for_bias(g, plan, wp, s_in, value, node_name, readers.get(wp.tensor, 1) > 1, quiet):
            widened.add(wp.tensor)
    return widened


def settle_biases(g: Graph, places, plan: QuantPlan, plat) -> None:
    """After a step that moved biases or grids: int32 bias grids where the backend has them
    (plan_biases), else only the weight grids a float bias needs (fit_biases)."""
    if plat.quantize_bias:
        plan_biases(g, places, plan)
    else:
        fit_biases(g, places, plan)


def plan_biases(g: Graph, places, plan: QuantPlan, quiet: bool = False) -> None:
    """int32 biases for Conv/ConvTranspose/Gemm whose input and weight are both quantized, on
    weight grids widened where a bias would not fit (fit_biases); a layer whose weight grid was
    widened gets its int32 grid planned again (it may share that weight with the layer that
    needed it)."""
    widened = fit_biases(g, places, plan, quiet)
    for node_name, wp, bias, value, s_in in _bias_sites(g, places, plan):
        if bias in plan.weights and wp.tensor not in widened:
            continue
        plan.weights[bias] = bias_qparams(s_in, plan.weights[wp.tensor])
        places.weights[(node_name, 2)] = placement_mod.WeightPoint(bias, node_name, 2, plan.weights[bias].axis)


DEAD_CHANNEL = 1e-4   # a channel whose largest |w| is below this fraction of the layer's is dead


def _widen_for_bias(g: Graph, plan: QuantPlan, wp, s_in, bias: np.ndarray, node_name: str,
                    shared: bool = False, quiet: bool = False) -> bool:
    """Widen ``wp``'s weight grid until ``bias`` fits int32 on s_in * s_w (:func:`_bias_limit`):
    only the output channels that overflow where the grid is per channel, the whole tensor where
    it is per tensor; a power-of-two grid stays on powers of two. Typical causes: a pruned or dead
    output channel (its per-channel scale is tiny; its weights keep a grid far finer than any live
    channel's) or an input that calibration saw nearly constant (a tiny input scale). The widened
    channels are recorded in ``plan.widened`` (weight_clip_val.json gives their grids). A weight
    that other layers read too (``shared``) is widened for them as well, with a warning: it
    coarsens their weights (257x, output cosine 0.9999 -> 0.84, where one of two Gemms sharing a
    weight read a near-zero input), which the report then measures; leaving that bias float
    instead broke the model in onnxruntime's default session (0.46-0.85) while the simulation
    read 0.9999. ``quiet``: a trial plan (--auto_w8's search), no log. Returns whether it widened."""
    weight = wp.tensor
    s_w = plan.weights[weight]
    scale = np.asarray(s_w.scale, np.float64)
    s_x = float(np.max(s_in.scale))
    lim = _bias_limit(g, wp, s_in, s_w, bias.size)
    per_channel = s_w.axis is not None and scale.ndim > 0 and scale.size == bias.size
    need = np.abs(bias) / (s_x * lim) * (1 + 1e-6)
    if not per_channel:
        need = np.full_like(scale, need.max())
    over = need > scale
    if not np.any(over):
        return False
    w = np.asarray(plan.values.get(weight, g.weight(weight)), np.float64)
    dead = False
    if per_channel:
        wmax = np.abs(np.moveaxis(w, s_w.axis, 0)).reshape(w.shape[s_w.axis], -1).max(axis=1)
        dead = wmax.shape == over.shape and bool(np.all(wmax[over] <= DEAD_CHANNEL * wmax.max()))
    wide = np.maximum(scale, need)
    if np.all(np.log2(scale) == np.round(np.log2(scale))):     # a power-of-two backend stays on its grids
        wide = 2.0 ** np.ceil(np.log2(wide))
    new = np.where(over, wide, scale).astype(np.float32)
    zp = np.asarray(s_w.zero_point, np.float64)
    lo = np.where(over, (s_w.qmin - zp) * new, s_w.lo).astype(np.float32)
    hi = np.where(over, (s_w.qmax - zp) * new, s_w.hi).astype(np.float32)
    plan.weights[weight] = dataclasses.replace(s_w, scale=new, lo=lo, hi=hi)
    plan.widened[weight] = over | plan.widened.get(weight, False)
    if quiet:
        return True
    if shared and not dead and node_name not in plan.shared_widened:
        plan.shared_widened.add(node_name)
        log.warning("bias of %s does not fit int32 on s_in * s_w (input grid step %.3g): its weight %s, which other "
                    "layers read too, gets a grid up to %.3gx wider for all of them, which coarsens their weights "
                    "(the report measures it); calibrate with samples in which %s's input varies, or keep %s float "
                    "(--skip_layers)", node_name, s_x, weight, float(np.max(new / scale)), node_name, node_name)
    note = f" (dead: largest |w| under {DEAD_CHANNEL:g} of the layer's)" if dead else ""
    log.info("bias of %s: %s widened up to %.3gx so that the bias fits int32 on s_in * s_w (input grid step "
             "%.3g)", node_name, f"the weight grids of {int(over.sum())} output channel(s){note}" if per_channel
             else "its per-tensor weight grid", float(np.max(new / scale)), s_x)
    return True


def is_bias(g: Graph, node_name: str, index: int) -> bool:
    """A Conv/ConvTranspose/Gemm bias input (int32 on backends that quantize biases)."""
    return index == 2 and g.node_by_name[node_name].op_type in ("Conv", "ConvTranspose", "Gemm")


def drop_bias_grids(g: Graph, places, plan: QuantPlan, nodes=None) -> None:
    """Forget the int32 bias grids of ``nodes`` (every node where None), for plan_biases to plan
    them again on new weight or input grids, or on new bias values."""
    for (node_name, index), wp in list(places.weights.items()):
        if is_bias(g, node_name, index) and (nodes is None or node_name in nodes):
            plan.weights.pop(wp.tensor, None)
            del places.weights[(node_name, index)]


def plan_weights(g: Graph, places, plan: QuantPlan, plat, cfg: QuantConfig, skip_biases: bool = False) -> None:
    """Grids for the placed weights not planned yet (``skip_biases``: not the bias inputs). A
    weight several layers share takes the widest --layer_bits width its readers ask for (it has
    one grid; only the first reader's was read, so naming another reader did nothing)."""
    readers: dict[str, dict[str, int]] = {}     # weight -> {reader: the width it asks for}
    for wp in places.weights.values():
        readers.setdefault(wp.tensor, {})[wp.node] = (cfg.layer_bits.get(wp.node, (None, None))[0] or cfg.w_bits
                                                      or plat.weight.bits)
    for (name, index), wp in places.weights.items():
        if wp.tensor in plan.weights or (skip_biases and is_bias(g, name, index)):
            continue
        widths = readers[wp.tensor]
        w_bits = max(widths.values())
        if len(set(widths.values())) > 1:
            log.warning("--layer_bits: weight %s is shared by %s, which ask for %s; it has one grid: %d-bit "
                        "for all of them (the widest)", wp.tensor, ", ".join(sorted(widths)),
                        " and ".join(f"{b}-bit" for b in sorted(set(widths.values()))), w_bits)
        w = g.weight(wp.tensor).astype(np.float32)
        if wp.axis is None:
            lo, hi = w.min(), w.max()
        else:
            moved = np.moveaxis(w, wp.axis, 0).reshape(w.shape[wp.axis], -1)
            lo, hi = moved.min(axis=1), moved.max(axis=1)
        plan.weights[wp.tensor] = make_qparams(lo, hi, rule_for(plat.weight, w_bits), axis=wp.axis)


def quantize(cfg: QuantConfig, comm=None) -> Result:
    """The whole run (see the module docstring); every onnxruntime session in it registers
    ``cfg.custom_op_libs``."""
    from dipoorlet.runtime import custom_op_libs

    PUBLISHED.clear()
    with custom_op_libs(cfg.custom_op_libs):
        return _quantize(cfg, comm)


def _same_settings(cfg: QuantConfig, comm) -> None:
    """Under MPI every process must run the same settings: through the API a rank given another
    -N or -A finished without a word, with outputs no process count would give, and another
    --no_bc ended in an MPI "Message truncated" error (found by a hunt)."""
    if comm.world <= 1:
        return
    import hashlib

    # each process may name its own GPU (recon_device="cuda:<local rank>"), not another kind of device
    same = dataclasses.replace(cfg, recon_device=cfg.recon_device and cfg.recon_device.split(":")[0])
    mine = hashlib.sha1(repr(same).encode()).hexdigest()
    differ = int(comm.allreduce_sum(np.array([int(comm.bcast(mine) != mine)], np.int64))[0])
    if differ:
        raise ConfigError(f"the {comm.world} MPI processes were given different settings ({differ} differ from rank "
                          "0's): every rank must make the same dipoorlet.quantize() call (or run the same command)")


def _quantize(cfg: QuantConfig, comm=None) -> Result:
    comm = comm or SingleProcess()
    _same_settings(cfg, comm)
    t0 = time.perf_counter()
    timings = {}
    out_dir = Path(cfg.output_dir)
    check_output_dir(out_dir)
    plat = platform_mod.load(cfg.deploy)
    bc_by_default = cfg.bias_correction is None    # neither --bc nor --no_bc
    cfg = dataclasses.replace(cfg, bias_correction=cfg.bias_correction_on())
    check_bits(cfg, plat)
    recon_dev = "cpu"
    if cfg.brecq:
        from dipoorlet.brecq import torch_device

        # before any pass: a missing optional extra, or a GPU torch does not see, is a one-line error
        recon_dev = torch_device(cfg.recon_device, getattr(comm, "local_rank", 0))
    elif cfg.recon_device is not None:
        log.warning("--recon_device applies with --brecq, --drop or --lsq only (--adaround and --gptq fit with "
                    "numpy on the CPU); ignored")
    if cfg.gptq_samples and not (cfg.gptq or cfg.adaround or cfg.brecq or cfg.sparse is not None):
        log.warning("--gptq_samples applies with --gptq, --adaround, --brecq or --sparse only; ignored")
    if cfg.bc_samples is not None and not cfg.bias_correction:
        log.warning("--bc_samples applies with bias correction only (off here: --no_bc, --auto_a16/--auto_w8 "
                    "or a fitted rounding without --bc); ignored")
    if _changed(cfg, "ada_iters") and not (cfg.adaround or cfg.brecq):
        log.warning("--ada_iters applies with --adaround or --brecq/--drop only; ignored")
    if isinstance(comm, MPIComm) and comm.world == 1:
        # --mpirun/--slurm (or mpirun=True) without a launcher of several processes: one process,
        # which had gone without a word (found by a hunt)
        log.info("--mpirun/--slurm: MPI runs this as one process; start it with mpirun -n K (or srun -n K) to "
                 "share the samples over K processes")
    fitting = [f for f, on in (("--gptq", cfg.gptq), ("--adaround", cfg.adaround),
                               ("--drop" if cfg.drop else "--lsq" if cfg.lsq else "--brecq", cfg.brecq),
                               ("--sparse", cfg.sparse is not None)) if on]
    if bc_by_default and fitting and not cfg.bias_correction and not (cfg.auto_a16 or cfg.auto_w8):
        # said: off by default there, and it can matter either way (a hunt's 3-bit CNN lost 6 dB
        # to the default run with --adaround, and --bc gained them back and more, without a word)
        log.info("bias correction is off with %s by default (it lowered the real models measured with a fitted "
                 "rounding, but helped a 3-bit test network: README, Weight transforms); --bc keeps it: compare "
                 "both on your model", " ".join(fitting))
    # a sample count above the samples there are reads them all: said once (it was silent, while
    # --val_num beyond --val_dir's samples is refused; found by a README walkthrough)
    fitted = cfg.gptq or cfg.adaround or cfg.brecq or cfg.sparse is not None
    counts = [("--eq_samples", cfg.equalize_samples),
              ("--bc_samples", cfg.bc_samples if cfg.bias_correction else None),   # else said ignored above
              ("--gptq_samples", cfg.gptq_samples if fitted else None)]
    if cfg.val_dir is None:        # with --val_dir these two count held-out samples (--val_num)
        counts += [("--prof_samples", cfg.prof_samples),
                   ("--sens_samples", cfg.sens_samples if _changed(cfg, "sens_samples") else None)]
    over = [f"{flag} {k}" for flag, k in counts if k is not None and k > cfg.data_num]
    if over:
        log.info("%s: more than the %d calibration samples (-N); all %d are read", ", ".join(over), cfg.data_num,
                 cfg.data_num)
    if cfg.max_a16_layers is not None and not cfg.auto_a16:
        log.warning("--max_a16_layers applies with --auto_a16 only; ignored")
    if cfg.max_w8_layers is not None and not cfg.auto_w8:
        log.warning("--max_w8_layers applies with --auto_w8 only; ignored")
    if cfg.equalize_samples is not None and not (cfg.equalize and plat.weight.per_channel):
        log.warning("--eq_samples applies where activation equalization reads samples (backends with per-channel "
                    "weights, without --no_equalize); ignored %s", "with --no_equalize" if not cfg.equalize
                    else f"on {plat.name}, whose per-tensor weights are equalized from the weights alone")
    if cfg.stpu_wg and plat.name != "stpu":
        log.warning("--stpu_wg applies to -D stpu only; ignored on %s", plat.name)
    if _changed(cfg, "max_float_layers") and not cfg.auto_skip:
        log.warning("--max_float_layers applies with --auto_skip only; ignored")
    # flags whose step this run skips, said as the ones above (they were silent; found by a hunt)
    if not sensitivity_runs(cfg):
        for flag, field_name in (("--sens_samples", "sens_samples"), ("--criterion", "criterion")):
            if _changed(cfg, field_name):
                log.warning("%s applies to the sensitivity analysis, which --skip_prof_layer skips (without "
                            "--auto_skip/--auto_a16/--auto_w8); ignored", flag)
    if _changed(cfg, "gptq_memory") and not (cfg.gptq or cfg.adaround or cfg.sparse is not None):
        log.warning("--gptq_memory applies with --gptq, --adaround or --sparse only; ignored")
    if _changed(cfg, "trt_version") and plat.name != "trt":
        log.warning("--trt_version applies to -D trt only (its calibration cache); ignored on %s", plat.name)
    if not cfg.shift and not shift_mod.applicable(plat):
        log.warning("--no_shift: %s shifts no activation (trt's symmetric grids only); ignored", plat.name)
    for flag, methods in (("--threshold", ("hist",)), ("--percentile", ("percentile",)),
                          ("--bins", ("hist", "mse", "entropy", "percentile"))):
        if _changed(cfg, flag[2:]) and cfg.act_quant not in methods:
            log.warning("%s applies with -A %s only; ignored with -A %s", flag, " or ".join(methods), cfg.act_quant)
    guard_inputs(cfg.model, cfg.input_dir, out_dir, cfg.savefp)
    g, cfg = load_graph(cfg, plat)
    specs = input_specs(g)
    const = [i.name for i in g.model.graph.input if i.name in g.initializers]
    if not specs:
        raise ModelError(f"model {cfg.model} has no input to calibrate: "
                         + (f"its graph inputs {const} all have initializers, which make them constants"
                            if const else "its graph has no inputs")
                         + "; export the model with the inputs it takes at inference")
    if const:
        log.info("graph inputs with an initializer are treated as constants (their default values): %s",
                 ", ".join(const[:6]) + (" ..." if len(const) > 6 else ""))
    data = DataSource(cfg.input_dir, specs, cfg.data_num, cfg.input_shapes)
    val = open_validation(cfg, specs, comm)
    indices = shard(cfg.data_num, comm.rank, comm.world)
    _declare_input_ranks(g, data)

    # a bias of its own for every Conv/Gemm, which bias correction moves and equalization scales
    # (neither took a layer without one, or one sharing its bias)
    from dipoorlet.bias_correction import give_biases

    given = give_biases(g, cfg.skip_layers, matmul_note=cfg.bias_correction)
    # the side files name the biases given (stpu's per layer): the graph holding them must ship
    g.prepared["biases_given"] = given["zero_biases"] + given["copied_biases"]
    equalized = []
    stats = None
    # Per-channel weights: rescaling channels costs the producer's weights nothing. Power-of-two
    # grids (imx) too, with every -A: with mse's steps rounded up it had cost imx's VAD 4 points;
    # with -A mse choosing them by error it costs 1 and most OCR models gain (README, Measured).
    eq_on = cfg.equalize and plat.weight.per_channel
    if eq_on:
        from dipoorlet import equalize

        # The Mul that MatMul smoothing inserts must not be quantized itself, or the outliers it
        # removes are quantized at its input.
        t = time.perf_counter()
        # Channel statistics from K samples spread over the N: they choose scales, the calibration that
        # follows still sees all N.
        smooth = "Mul" not in plat.quantize_ops
        k = min(cfg.data_num, cfg.equalize_samples or equalize.default_samples(cfg.data_num))
        if one_pass_minmax(cfg):
            # -A minmax: the ranges of the transformed tensors follow from per-channel ranges of
            # the untransformed ones, so one pass over all N samples serves both stages
            candidates = list(placement_mod.place(g, plat, cfg.skip_layers, warn=False).activations)
            equalized, stats = equalize.equalize_and_calibrate(g, data, indices, comm, cfg.device, smooth,
                                                               cfg.skip_layers, candidates,
                                                               eq_subset=set(spread(k, cfg.data_num, 0, 1)))
        else:
            eq_indices = spread(k, cfg.data_num, comm.rank, comm.world)
            # where the backend quantizes Mul, a MatMul input's scale goes into the op making it
            # (an RMSNorm's gamma, a LayerNorm) or nowhere
            equalized = equalize.equalize(g, data, eq_indices, comm, cfg.device, smooth=smooth, skip=cfg.skip_layers,
                                          fold=True)
        timings["equalize_s"] = time.perf_counter() - t
    elif cfg.equalize and not plat.weight.per_channel:
        from dipoorlet import equalize

        # one grid per weight tensor: even out the weights' channel ranges between Conv pairs
        equalized = equalize.equalize_weights(g)
    places = placement_mod.place(g, plat, cfg.skip_layers)
    skipped_bits = sorted(set(cfg.layer_bits) & set(cfg.skip_layers))
    if skipped_bits:
        log.warning("--layer_bits %s: also in --skip_layers, so kept float; the setting does nothing",
                    ", ".join(skipped_bits[:5]))
    unquantized = sorted(set(cfg.layer_bits) - set(places.quantized_nodes) - set(cfg.skip_layers))
    if unquantized:
        log.warning("--layer_bits %s: %s not quantized on %s (kept float), so the setting does nothing",
                    ", ".join(unquantized[:5]), "this node is" if len(unquantized) == 1 else "these nodes are",
                    plat.name)
    nested = _nested_quantizable(g, plat)
    if nested:
        log.warning("%d ops inside If/Loop/Scan bodies stay float (%s): this tool quantizes the main graph only",
                    sum(nested.values()), ", ".join(f"{op} x{n}" for op, n in sorted(nested.items())))
    weighted = {name for name, _ in places.weights}
    no_weight = sorted(n for n, (w, _) in cfg.layer_bits.items()
                       if w and n in places.quantized_nodes and n not in weighted)
    if no_weight:
        log.warning("--layer_bits %s: no quantized weight (%s), so its w-width does nothing",
                    ", ".join(no_weight[:5]), ", ".join(sorted({g.node_by_name[n].op_type for n in no_weight})))
    owners = _activation_owners(places)
    no_act = sorted(n for n, (_, a) in cfg.layer_bits.items() if a and n in places.quantized_nodes and n not in owners)
    if no_act:
        log.warning("--layer_bits %s: owns no quantized activation (%s; its input is fused into its producer), so "
                    "its a-width does nothing; give it to the producer", ", ".join(no_act[:5]),
                    ", ".join(sorted({g.node_by_name[n].op_type for n in no_act})))
    targets = list(places.activations)
    log.info("%d nodes quantized, %d activation tensors and %d weights get Q/DQ on %s",
             len(places.quantized_nodes), len(targets), len(places.weights), plat.name)
    if not targets and not places.weights:
        double = sorted({n.op_type for n in g.graph.node if n.op_type in plat.quantize_ops
                         and any(x and g.elem_type(x) == onnx.TensorProto.DOUBLE for x in n.input)})
        if double:
            raise ModelError(f"nothing in {cfg.model.name} is quantizable on {plat.name}: its "
                             f"{', '.join(double[:6])} ops compute in float64 (double), and dipoorlet quantizes "
                             "float32 models (float16 ones are widened); export or convert the model to float32")
        inside = (f"; its {', '.join(sorted(nested))} ops sit inside If/Loop/Scan bodies, which this tool "
                  "leaves float: export the branch that runs as the graph itself") if nested else ""
        raise ModelError(f"nothing in {cfg.model.name} is quantizable on {plat.name} "
                         f"(its ops: {sorted({n.op_type for n in g.graph.node})[:12]}{inside}); "
                         "check the platform or the --skip_layers list")

    t = time.perf_counter()
    if stats is not None:
        missing = [x for x in targets if x not in stats]
        if missing:   # a tensor the transforms made that the one pass could not derive
            stats.update(calibrate.collect(g, data, indices, missing, comm, False, cfg.bins, cfg.device))
        stats = {x: stats[x] for x in targets}
        log.info("calibration: ranges from the equalization pass (one pass over the data; %d of %d tensors "
                 "measured again)", len(missing), len(targets))
    else:
        stats = calibrate.collect(g, data, indices, targets, comm, cfg.act_quant in NEEDS_HISTOGRAM,
                                  cfg.bins, cfg.device)
    # a Softmax input stretched by an additive attention mask: its grid need not reach the mask
    calibrate.softmax_floors(g, data, indices, stats, comm, cfg.device)
    data.share_notes(comm)      # every process has read its share of the samples by now
    timings["calibration_s"] = time.perf_counter() - t
    plan = plan_grids(g, stats, cfg, plat, places)
    mixed = [t for t in placement_mod.position_mixed(g, places.positions) if t in plan.activations]
    if mixed:
        # the nodes that own their grids (their readers; the producer of an output quantized in place)
        producers = list(dict.fromkeys(o for t in mixed if t in places.activations for o in (
            list(places.activations[t].owners) + ([places.output_owners[t]] if t in places.output_owners else []))))
        log.warning("%d quantized tensors hold positions or sizes (a Range over the input's length or size) added "
                    "to or beside data, e.g. a detector's anchors plus its predicted offsets: their grids are sized "
                    "on the calibration inputs and clip them at a larger input; calibrate at the largest size "
                    "deployment sees, or keep them float with --skip_layers %s", len(mixed),
                    " ".join(producers[:8]) + (" ..." if len(producers) > 8 else ""))
    warn_degenerate(stats, plan)
    plan_weights(g, places, plan, plat, cfg)
    shifted = []
    if cfg.shift and shift_mod.applicable(plat):
        shifted = shift_mod.apply(g, places, plan, stats, RANGE_METHODS[cfg.act_quant], cfg.threshold,
                                  cfg.percentile)
        if shifted:   # same weights, new tensor names: the weight grids stay as planned
            places = placement_mod.place(g, plat, cfg.skip_layers, warn=False)
    unsized = _unsized_input_layers_float(places, plan, stats)
    _gridless_to_float(g, places, plan, unsized, stats)
    fit_biases(g, places, plan)    # before the steps that fit weights or biases to these grids
    corrections = None

    def correct_biases(alone: bool = True):
        from dipoorlet import bias_correction

        t = time.perf_counter()
        out = bias_correction.correct(g, places, plan, data, bc_indices(cfg, comm), comm, cfg.device,
                                      alone=alone and sensitivity_runs(cfg))
        timings["bias_correction_s"] = time.perf_counter() - t
        return out

    reconstructed = None
    rounding = ("adaround" if cfg.adaround else "sparse" if cfg.sparse is not None else "gptq" if cfg.gptq
                else ("qdrop" if cfg.drop else "brecq") if cfg.brecq else None)
    # with --auto_w8 the rounding is fitted after the search, on the grids the search leaves
    # (where it has narrow weights to choose from)
    defer = rounding in ("gptq", "adaround", "brecq", "qdrop") and cfg.auto_w8 is not None and any(
        plan.weights[wp.tensor].bits < plat.weight.bits for (n, i), wp in places.weights.items()
        if not is_bias(g, n, i) and wp.tensor in plan.weights)
    if cfg.bias_correction:
        # the corrections measured alone serve the sensitivity analysis, unless a fit changes the
        # weights before it
        corrections = correct_biases(alone=not rounding or defer)

    def fit_rounding(places, plan):
        from dipoorlet import reconstruct

        t = time.perf_counter()
        if cfg.brecq:
            from dipoorlet import brecq

            k = min(cfg.data_num, cfg.gptq_samples or brecq.DEFAULT_SAMPLES)
            if k < cfg.data_num and not cfg.gptq_samples:
                log.info("%s: %d of the %d samples, spread over them and held in both streams (--gptq_samples to "
                         "change)", rounding, k, cfg.data_num)
            out = brecq.reconstruct_blocks(g, places, plan, data, spread(k, cfg.data_num, comm.rank, comm.world), comm,
                                           cfg.ada_iters, cfg.drop, shifted, batch=cfg.ada_bs, lsq=cfg.lsq,
                                           device=recon_dev)
            timings[f"{rounding}_s"] = time.perf_counter() - t
            return out
        k = min(cfg.data_num, cfg.gptq_samples or reconstruct.DEFAULT_SAMPLES)
        if k < cfg.data_num and not cfg.gptq_samples:
            log.info("%s: statistics over %d of the %d samples, spread over them (--gptq_samples to change)",
                     rounding, k, cfg.data_num)
        out = reconstruct.reconstruct(g, places, plan, data, spread(k, cfg.data_num, comm.rank, comm.world), comm,
                                      cfg.device, cfg.gptq_memory, samples=k,
                                      method="adaround" if cfg.adaround else "gptq",
                                      iters=cfg.ada_iters, sparse=cfg.sparse)
        if shifted and out.get("magnitude"):
            # a layer pruned by magnitude alone (too few rows to fit the bias with the weights)
            # reading a shifted input holds b - W_q d with the dense W_q: rebase it on the pruned one
            plan.values.update(shift_mod.rebased_for_fitted(
                g, plan, shifted, [g.node_by_name[name].input[1] for name in out["magnitude"]]))
        timings[f"{rounding}_s"] = time.perf_counter() - t
        return out

    nearest_plan = None
    if rounding and not defer:
        if rounding != "sparse":
            # the grids and values before the fit (the fit replaces entries, never edits them):
            # its network output is compared with the fitted one's (analyse)
            nearest_plan = dataclasses.replace(plan, activations=dict(plan.activations), weights=dict(plan.weights),
                                               values=dict(plan.values), value_owners=dict(plan.value_owners),
                                               rules=dict(plan.rules))
        reconstructed = fit_rounding(places, plan)
        if rounding in ("gptq", "adaround") and not reconstructed.get("candidates") and bc_by_default:
            # the flag turned bias correction off for a fit that has no layer to fit (every
            # input on a 16-bit grid: W4A16 on qnn lost 6 dB to nearest rounding alone)
            log.warning("%s fitted no layer: bias correction, which it turns off, runs instead (--no_bc to "
                        "skip it)", rounding)
            corrections = correct_biases()
            nearest_plan = None     # nothing fitted to compare
    settle_biases(g, places, plan, plat)    # biases the steps above moved

    t = time.perf_counter()
    analysis = analyse(cfg, g, places, plan, data, comm, stats=stats, plat=plat, shifted=shifted, val=val,
                       nearest_plan=nearest_plan)
    if corrections is not None:
        analysis["bias_correction"] = corrections
    if reconstructed is not None:
        analysis[rounding] = reconstructed
        check = analysis.pop("rounding_check", None)
        if check is not None:
            reconstructed["network_output"] = check
            f, near = check["fitted"], check["nearest"]
            if fit_lost(check):
                log.warning("%s: the network output is worse than with nearest rounding on %d of the %d sensitivity "
                            "samples (SQNR %.2f dB against %.2f, cosine %.6f against %.6f), though each layer's fit "
                            "beat nearest rounding on that layer; more samples (-N, --gptq_samples)%s, or run without "
                            "%s (bias correction then runs by default)", _flag(rounding), check["worse_samples"],
                            check["samples"], f["sqnr_db"], near["sqnr_db"], f["cosine"], near["cosine"],
                            ", more --ada_iters" if rounding in ("adaround", "brecq", "qdrop") else "", _flag(rounding))
    if equalized:
        analysis["equalization"] = equalized
    if shifted:
        analysis["shift"] = shifted
    a16 = analysis.get("auto_a16")
    missed_as_written = False
    if a16 is not None and a16.float_layers:   # before the diagnosis, which then sees the 16-bit grids
        changed = promote_a16(g, places, plan, stats, cfg, plat, a16.float_layers)
        log.info("auto_a16: %d layers' inputs on 16-bit grids (%d of %d tensors): %s", len(a16.float_layers),
                 len(changed), len(plan.activations), ", ".join(a16.float_layers[:6])
                 + (f" and {len(a16.float_layers) - 6} more (report.json: auto_a16.a16_layers)"
                    if len(a16.float_layers) > 6 else ""))
        # the search scored each reader's input on its own grid; the written model gives a tensor
        # two layers read one grid (16-bit where either asked) and replans int32 biases: measure it
        a16.measured = analysis["_scorer"].score(insert_qdq(g, places, plan))
        est, got = a16.after.value(a16.criterion), a16.measured.value(a16.criterion)
        searched_met = a16.met
        a16.met = got >= a16.target   # the written model decides, both ways
        if searched_met and not a16.met:
            missed_as_written = True
            log.warning("auto_a16: the search's estimate met %s %s (%.6f), but the "
                        "model as written reads %.6f on the same samples%s; compare -D %s without --auto_a16, "
                        "or choose layers by hand (--layer_bits NODE=a16)", a16.criterion, a16.target, est, got,
                        f", below the 8-bit model's {a16.before.value(a16.criterion):.6f}"
                        if got < a16.before.value(a16.criterion) else "", plat.name)
    elif a16 is not None:
        # no layer kept: the model written is the one the search measured first (report.md said
        # "estimated by the search" of it; found by a bug hunt)
        a16.measured = a16.before
    w8 = analysis.get("auto_w8")
    if w8 is not None and w8.float_layers:
        changed = promote_w8(g, places, plan, cfg, plat, w8.float_layers, shifted)
        log.info("auto_w8: %d layers' weights on %d-bit grids: %s", len(changed), plat.weight.bits,
                 ", ".join(w8.float_layers[:6]) + (" ..." if len(w8.float_layers) > 6 else ""))
    if defer:
        if plat.quantize_bias:
            # the fit re-chooses the biases too (it leaves a bias with an int32 grid alone):
            # their int32 grids are planned again after it, on the fitted values
            drop_bias_grids(g, places, plan)
        reconstructed = fit_rounding(places, plan)
        settle_biases(g, places, plan, plat)
        analysis[rounding] = reconstructed
    if w8 is not None and (w8.float_layers or defer):
        # the written model (promoted grids, and the rounding fitted on them) decides
        w8.measured = analysis["_scorer"].score(insert_qdq(g, places, plan))
        w8.met = w8.measured.value(w8.criterion) >= w8.target
    if w8 is not None and not w8.met and defer and w8.after.value(w8.criterion) >= w8.target:
        log.warning("auto_w8: the search met %s %s on nearest rounding (%.6f), but with the %s rounding fitted "
                    "afterwards the model as written reads %.6f on the same samples (the rounding fits each "
                    "layer's output on the calibration data, not this score); compare without %s",
                    w8.criterion, w8.target, w8.after.value(w8.criterion), _flag(rounding),
                    w8.measured.value(w8.criterion), _flag(rounding))
    elif w8 is not None and not w8.met:
        # layers pinned below the backend's weight width (--layer_bits NODE=w4): the search leaves
        # them, and their loss is no activation's (the advice sent it to --auto_skip; found by a hunt)
        pinned = sorted((n, b) for n, b in cfg.layer_bits.items() if b[0] and b[0] < plat.weight.bits)
        acts = "activations (--auto_skip, or a backend with 16-bit activations and --auto_a16)"
        if len(w8.float_layers) < w8.candidates and not w8.tried_all:
            rest = "a larger --max_w8_layers may meet it"
        elif pinned:
            rest = (f"what is left is not the candidates' weights: the weights --layer_bits keeps narrow "
                    f"({', '.join(f'{n}=w{b[0]}' for n, b in pinned[:4])}), which the search leaves as asked, or {acts}")
        else:
            rest = f"what is left is not the candidates' weights: {acts}"
        explicit = sum(1 for n, b in cfg.layer_bits.items() if b[0] and n in places.quantized_nodes)
        log.warning("auto_w8: target %s %s not met (%s %s with %d layers' weights on %d-bit grids over the %d "
                    "sensitivity samples); %s", w8.criterion, w8.target, w8.criterion,
                    short_of(w8.target, (w8.measured or w8.after).value(w8.criterion)), len(w8.float_layers), plat.weight.bits,
                    analysis["sens_samples"],
                    rest + (f"; {explicit} layers with an explicit --layer_bits weight width were not candidates"
                            if explicit else ""))
    left = ""
    # the weights' remedies: bias correction, which the search turns off by default, runs when the
    # chosen layers are given as --layer_bits (a captcha OCR on qnn: 0.9916 from the search,
    # 0.9993 with its grids and bias correction; the advice had named --gptq only; found by a hunt)
    weight_fix = ("run again without --auto_a16 and with the layers it chose as --layer_bits NODE=a16 (report.json: "
                  "auto_a16.a16_layers), where bias correction, which the search turns off, runs by default; or "
                  "--gptq there, or --skip_layers" if bc_by_default else "--gptq, or --skip_layers")
    if a16 is not None and not a16.met and not missed_as_written:
        if len(a16.float_layers) < a16.candidates and not a16.tried_all:
            left = "a larger --max_a16_layers may meet it"
        elif "_scorer" in analysis:
            # every candidate is on 16 bits: weigh what is left with every activation float and
            # the weights as written (the clipping of sensitivity samples beyond the calibrated
            # ranges, which a 16-bit grid keeps, had been called the weights' rounding)
            w_score = analysis["_scorer"].score(insert_qdq(g, places.restrict(places.quantized_nodes, acts=False),
                                                            plan))
            weights_only = w_score.value(a16.criterion)
            # the weights' share of the error power left (SQNR adds as powers)
            got = (a16.measured or a16.after).sqnr_db
            share = 10 ** ((got - w_score.sqnr_db) / 10) if math.isfinite(got) and math.isfinite(w_score.sqnr_db) \
                else (0.0 if w_score.sqnr_db == math.inf else 1.0)
            clipping = ("values beyond the grids' ends, which a 16-bit grid keeps where it keeps the 8-bit clip "
                        "(sensitivity samples beyond the calibrated ranges, or tails the range method clips): "
                        "calibrate on data like them, try -A minmax, or keep the clipped layers float (--auto_skip, "
                        "--skip_layers); report.md lists the saturated tensors with --val_dir")
            # inputs --layer_bits keeps on 8 bits stay there: part of what is left, which the advice
            # had put down to clipping only (found by a hunt)
            pinned = sorted(f"{n}=a{b[1]}" for n, b in cfg.layer_bits.items() if b[1] and b[1] <= 8)
            acts_left = (f"the inputs --layer_bits keeps on 8 bits ({', '.join(pinned[:4])}"
                         f"{' ...' if len(pinned) > 4 else ''}), which the search leaves as asked, or {clipping}"
                         if pinned else clipping)
            if weights_only >= a16.target:
                what = "the activations" if pinned else "the activations' clipping"
                left = f"what is left is {what}, not the weights (weights alone read {weights_only:.6f}): {acts_left}"
            elif share >= 0.5:
                left = (f"what is left is mostly the weights' rounding (weights alone, every activation float, read "
                        f"{weights_only:.6f}, {100 * share:.0f}% of the error): {weight_fix}")
            else:
                left = (f"the activations make most of what is left (weights alone, every activation float, read "
                        f"{weights_only:.6f}, {100 * share:.0f}% of the error): {acts_left}")
        else:
            left = f"what is left is the weights' rounding: {weight_fix}"
    analysis.pop("_scorer", None)
    if a16 is not None and not a16.met and not missed_as_written:
        # a node --skip_layers keeps float (its --layer_bits does nothing, as the log said) is no candidate anyway
        pinned_a = sum(1 for n, b in cfg.layer_bits.items() if b[1] and n in places.quantized_nodes)
        log.warning("auto_a16: target %s %s not met (%s %s with %d layers' inputs on 16-bit grids over the %d "
                    "sensitivity samples); %s", a16.criterion, a16.target, a16.criterion,
                    short_of(a16.target, (a16.measured or a16.after).value(a16.criterion)),
                    len(a16.float_layers), analysis["sens_samples"],
                    left + (f"; {pinned_a} layers with an explicit --layer_bits activation width were not candidates"
                            if pinned_a else ""))
    if analysis.get("isolated"):
        from dipoorlet import diagnose

        sens_source, _, sens_indices = sensitivity_samples(cfg, data, val, comm)
        analysis["diagnosis"] = diagnose.diagnose(
            g, places, plan, analysis["isolated"], sens_source, sens_indices,
            comm, cfg.device, equalize_on=eq_on, equalized=equalized, smooth="Mul" not in plat.quantize_ops,
            shifted=shifted, platform=plat.name, samples=analysis["sens_samples"], method=cfg.act_quant,
            # a deferred fit ran after the isolated scores (the advice says so) but still chose
            # these layers' rounding: the advice must not offer it again
            gptq=set(reconstructed.get("changed", ())) if reconstructed and rounding in ("brecq", "qdrop")
            else {r["node"] for r in reconstructed["gain_db"]}
            if reconstructed and reconstructed.get("gain_db") and rounding != "sparse" else (),
            gptq_ran=reconstructed is not None, max_act_bits=plat.activation.max_bits,
            rounding=_flag(rounding) if rounding in ("adaround", "brecq", "qdrop") else "--gptq",
            sparse={r["node"]: r["db"] for r in reconstructed["gain_db"]} | {
                n: None for n in reconstructed.get("magnitude", [])} if rounding == "sparse" else None,
            sparse_pattern=reconstructed.get("pattern") if rounding == "sparse" else None,
            promoted=w8.float_layers if w8 is not None else (), bc_ran=corrections is not None,
            a16=a16.float_layers if a16 is not None else None,
            asked_a={n: b[1] for n, b in cfg.layer_bits.items() if b[1]}, calib_n=cfg.data_num,
            deferred=_flag(rounding) if defer else None, held_out=bool(analysis.get("sens_held_out")),
            floated=analysis["auto_skip"].float_layers if analysis.get("auto_skip") is not None else (),
            unfit=reconstructed.get("skipped") if reconstructed and rounding != "sparse" else None,
            calibration=stats, criterion=cfg.criterion)
        scattered = None if w8 is not None else diagnose.error_spread(
            analysis["isolated"],
            floated=analysis["auto_skip"].float_layers if analysis.get("auto_skip") is not None else (),
            samples=analysis["sens_samples"], platform=plat.name, max_act_bits=plat.activation.max_bits,
            act_bits=min((int(a.bits) for a in plan.activations.values()), default=8),
            rounding=_flag(rounding) if reconstructed is not None else None,
            gptq_flag=diagnose._gptq_flag(corrections is not None, a16.float_layers if a16 is not None else None),
            a16=a16.float_layers if a16 is not None else None,
            groups=diagnose.shared_input_groups(places, plan))
        if scattered is not None:
            analysis["error_spread"] = scattered
    if analysis.get("auto_skip") is not None:
        places = places.restrict([n for n in places.quantized_nodes
                                  if n not in analysis["auto_skip"].float_layers])
        plan = plan.restricted(places)
        if reconstructed and reconstructed.get("gain_db"):   # layers auto_skip kept float lost their rounding
            kept = set(places.quantized_nodes)
            floated = [r["node"] for r in reconstructed["gain_db"] if r["node"] not in kept]
            reconstructed["gain_db"] = [r for r in reconstructed["gain_db"] if r["node"] in kept]
            reconstructed["layers"] = len(reconstructed["gain_db"])
            if floated:
                reconstructed["kept_float_by_auto_skip"] = floated
        if rounding in ("brecq", "qdrop") and reconstructed and reconstructed.get("changed"):
            kept = set(places.quantized_nodes)
            floated = [n for n in reconstructed["changed"] if n not in kept]
            reconstructed["changed"] = [n for n in reconstructed["changed"] if n in kept]
            reconstructed["layers"] = len(reconstructed["changed"])
            if floated:
                reconstructed["kept_float_by_auto_skip"] = floated
        if rounding == "sparse" and reconstructed and reconstructed.get("magnitude"):
            kept = set(places.quantized_nodes)
            floated = [n for n in reconstructed["magnitude"] if n not in kept]
            reconstructed["magnitude"] = [n for n in reconstructed["magnitude"] if n in kept]
            if floated:
                reconstructed["kept_float_by_auto_skip"] = reconstructed.get("kept_float_by_auto_skip", []) + floated
        if rounding == "sparse" and reconstructed and reconstructed.get("kept_float_by_auto_skip"):
            # those layers run dense and float now: the zero share counts the layers still pruned
            from dipoorlet.reconstruct import zero_share

            reconstructed["zero_fraction"] = round(zero_share(
                plan.values[wp.tensor] for (name, index), wp in places.weights.items()
                if not is_bias(g, name, index) and wp.tensor in plan.values
                and plan.value_owners.get(wp.tensor) == name), 6)
    timings["sensitivity_s"] = time.perf_counter() - t
    if plat.name == "ort":
        _warn_matmulnbits(g, places, plan)
    if comm.rank == 0 and log.isEnabledFor(logging.DEBUG):
        _log_grids(plan)
    qmodel = insert_qdq(g, places, plan)
    _drop_shapeless_value_info(qmodel)
    _drop_default_pool_dilations(qmodel)
    _check(qmodel)
    _loads_by_default(qmodel)      # every rank: the error profile below runs the model rank 0 writes
    if comm.rank == 0:
        _runs_batched_by_default(g, places, qmodel, data, indices)
        if plat.name == "ort" and len(indices):
            _runs_by_default(qmodel, data.sample(indices[0]), cfg.quant_format == "QOP")
        if plat.name == "ort" or cfg.quant_format == "QOP":
            _warn_padded_ceil_pools(qmodel)

    targets_prof = layer_errors.profile_targets(g, places, layers=not cfg.skip_prof_layer,
                                                taps={n: t for r in shifted for n, t in r["taps"].items()})
    # --savefp: every rank writes its samples into one staging folder that rank 0 names.
    staging = out_dir / comm.bcast(f".dipoorlet-staging-{uuid.uuid4().hex[:12]}")
    savefp = _fp_saver(staging, g.output_names) if cfg.savefp else None
    try:
        if savefp is not None and comm.world > 1:
            _check_shared_output(staging, comm)
        t = time.perf_counter()
        if val is not None:
            prof_data, k, prof_indices = val
            log.info("profile: %d held-out samples from --val_dir %s%s", k, cfg.val_dir,
                     f", spread over its {len(prof_data)}" if k < len(prof_data) else "")
        else:
            k = profile_samples(cfg)
            if k < cfg.data_num:
                log.info("profile: %d of the %d samples, spread over them (--prof_samples to change)", k,
                         cfg.data_num)
            prof_data, prof_indices = data, spread(k, cfg.data_num, comm.rank, comm.world)
        errors, out_cosines, clipped = layer_errors.collect_errors(
            g, qmodel, prof_data, prof_indices, targets_prof, comm, cfg.device, savefp,
            # values beyond the grids: counted on held-out samples only, where they are the point
            # (exposing every quantized activation cost the PP-OCRv4 detector's run 20% more peak memory)
            grids=layer_errors.grid_bounds(plan, places, {t for t, st in (stats or {}).items() if st.floor is not None})
            if val is not None else None,
            floors={t: st.floor for t, st in (stats or {}).items() if st.floor is not None and t in plan.activations})
        timings["profile_s"] = time.perf_counter() - t
        if comm.rank != 0:
            # from the last collective on, wait with signals held until rank 0 has published: a
            # rank that returned here and then died of a Ctrl-C/SIGTERM sent to it alone made
            # mpirun kill rank 0 in the middle of its moves into -O (a mix of two runs' files), and
            # one taken after that collective said "no output was written" while rank 0 went on
            # to publish (found by a bug hunt). A signal held here is raised when the outputs are
            # in place (or rank 0's failure has ended the run)
            with _signals_held():
                prof_data.share_notes(comm)
                published = comm.bcast(None)
                if published:          # before a held signal is raised, which reports it
                    PUBLISHED.append(Path(published))
            return Result(out_dir, [], {}, [], timings)
        prof_data.share_notes(comm)
        # Every collective step is done (the gather waited for all ranks): rank 0 writes.
        rows = layer_errors.summarize(errors, targets_prof, g.output_names,
                                 places.quantized_nodes if not cfg.skip_prof_layer else ())
        broken = [r.tensor for r in rows if r.is_output and not math.isfinite(r.cosine)]
        resized = [t for t in g.output_names if t in errors and errors[t].resized]
        if resized:    # NonZero, NMS, TopK by a threshold: the count itself moved
            log.warning("network output %s: its size differs between the float and the quantized model on %s "
                        "(a data-dependent shape: values crossed a threshold that NonZero, NMS or the like "
                        "counts); such samples cannot be compared value by value and are not scored",
                        ", ".join(resized[:4]), ", ".join(f"{errors[t].resized} of {errors[t].n + errors[t].resized} "
                                                          f"samples{' (none left)' if not errors[t].n else ''}"
                                                          for t in resized[:4]))
        if broken:   # the float model's NaN samples were left out before: these are the quantization's
            log.warning("network output %s: the quantized model computes NaN or Inf where the float model is "
                        "finite (an op such as Reciprocal, Div or Log reading a value its grid rounds to 0); "
                        "the report gives it no cosine; keep that op's input float (--skip_layers) or widen "
                        "its grid (--layer_bits NODE=a16 where the backend runs 16-bit activations)",
                        ", ".join(broken[:4]))
        try:
            files, rep = _write_staging(cfg, g, plan, places, plat, data, indices, qmodel, staging, equalized,
                                        shifted, rows, k, analysis, stats, out_cosines,
                                        clipped if val is not None else None)
        except OSError as exc:
            what = f": {exc.filename}" if exc.filename else ""
            raise OutputError(f"could not write the outputs into {out_dir} ({exc.strerror or exc}{what}); free "
                              f"space there or choose another -O; nothing in it was changed") from exc
        timings["total_s"] = time.perf_counter() - t0
        final = _publish(staging, out_dir, keep=(*model_files(cfg.model), *data.paths(),
                                                 *(val[0].paths() if val else ())))
        if comm.world > 1:
            comm.bcast(str(out_dir))       # the other ranks waited for this (see above)
        return Result(out_dir, final, rep, rows, timings)
    finally:
        if comm.rank == 0:
            held = staging / ".replaced"
            if held.is_dir() and any(p.is_file() for p in held.rglob("*")):
                log.error("earlier outputs that could not be put back are kept in %s", held)
            else:
                shutil.rmtree(staging, ignore_errors=True)


def _write_staging(cfg, g, plan, places, plat, data, indices, qmodel, staging: Path, equalized, shifted, rows,
                   k, analysis, stats, out_cosines, clipped=None):
    """Every output file, written into the staging folder; returns (files, report)."""
    staging.mkdir(exist_ok=True)
    qop_info = None
    if cfg.quant_format == "QOP":
        qop_model, qop_info = _to_qop(qmodel, data.sample(indices[0]), plat.name == "ort")
        files = [save_model(qmodel, staging / "quant_model_qdq.onnx"),
                 save_model(qop_model, staging / "quant_model.onnx")]
    else:
        files = [save_model(qmodel, staging / "quant_model.onnx")]
    renamed = any(t not in g.source_names for t in [*plan.activations, *plan.weights])
    # a node the input model leaves unnamed (or names twice) gets a name here, which layer-keyed
    # side files (atlas, rk, rv, stpu) use: the graph that holds those names must ship
    if equalized or shifted or plan.values or renamed or g.prepared["float16_widened"] or g.prepared["nodes_named"] \
            or g.prepared["batchnorms_folded"] or g.prepared["elementwise_folded"] \
            or g.prepared.get("layernorms_fused") or g.prepared.get("hardswish_fused") \
            or g.prepared.get("pool_counts_unpadded") or g.prepared.get("biases_given"):
        files.append(_save_transformed(g, plan, staging / "transformed_model.onnx"))
    files += export_all(DeployContext(g, plan, places, plat, cfg), staging)
    meta = {"model": str(cfg.model), "platform": plat.name, "method": cfg.act_quant,
            **({"score_outputs": list(cfg.score_outputs)} if cfg.score_outputs else {}),
            "network_outputs": list(g.output_names),
            "samples": cfg.data_num, "profile_samples": k,
            **({"profile_data": str(cfg.val_dir)} if cfg.val_dir is not None else {}),
            "quantized_nodes": len(places.quantized_nodes),
            "qdq_tensors": sum(1 for t in places.activations if t in plan.activations),
            "qdq_tensors_16bit": sum(1 for t in places.activations
                                     if t in plan.activations and plan.activations[t].bits > 8),
            "weights": len(places.weights),
            "int32_biases": sum(1 for (_, index) in places.weights if index == 2),
            "weight_parameters": weight_coverage(g, places, plan),
            **({"shared_grid_losses": {t: v for t, v in sorted(plan.shared_losses.items(), key=lambda kv: kv[1]["steps"])
                                       if t in plan.activations and plan.shared.get(t)}}
               if plan.shared_losses else {}),
            **({"quant_format": qop_info} if qop_info is not None else {})}
    modules = {n: m for n in places.quantized_nodes if (m := torch_module(g, n))}
    if modules:      # a dynamo export's nodes (node_MatMul_85) by the torch module they came from
        meta["torch_modules"] = modules
    rep = report.build(rows, places, meta, analysis, stats, plan, out_cosines, clipped)
    files += report.write(staging, rep)
    return files, rep


def short_of(target: float, value: float) -> str:
    """A score that missed its target, with digits enough to show it is not the target
    (--auto_skip 1.0 read "not met (cosine 1.000000 ...)"; found by a hunt)."""
    for digits in (6, 9, 12):
        text = f"{value:.{digits}f}"
        if text != f"{target:.{digits}f}":
            return text
    return repr(value)


# where each op reads its weights (None: any constant input); 2-D constants elsewhere (a Gemm's
# [1, N] bias, a recurrent op's biases and initial state) are not counted
WEIGHT_INPUTS = {"Conv": (1,), "ConvTranspose": (1,), "DeformConv": (1,), "Gemm": (0, 1), "MatMul": (0, 1),
                 "FusedMatMul": (0, 1), "Einsum": None, "GRU": (1, 2), "LSTM": (1, 2), "RNN": (1, 2),
                 "Attention": (1,), "Gather": (0,), "EmbedLayerNormalization": (2, 3, 4)}


def weight_coverage(g, places, plan) -> dict:
    """How many weight parameters (float initializers of two or more dimensions that a layer op
    reads as its weight, or a Gather as its table, each counted once) the quantized model holds on
    an integer grid, and the float ones by op type: a GRU, an Einsum or an embedding table that
    the backend does not quantize stayed float without a word in report.md (found by a hunt).
    Nodes inside If/Loop/Scan bodies, never quantized, count with their graph's and the outer
    initializers they read. A weight on a grid counts as quantized whichever else reads it, and
    tensors are told apart by scope, not by name (two branches may each hold a "V")."""
    on_grid = {wp.tensor for wp in places.weights.values() if wp.tensor in plan.weights}
    seen, left = set(), {}          # (scope, name) of the tensors counted
    quantized = 0
    for name in on_grid:
        t = g.initializers.get(name)
        if t is not None and len(t.dims) >= 2 and t.data_type in FLOAT_TYPES:
            seen.add(("", name))
            quantized += int(np.prod(t.dims))

    def walk(graph, inits, scope):
        inits = {**inits, **{t.name: ((scope, t.name), t) for t in graph.initializer}}
        for node in graph.node:
            for j, sub in enumerate(subgraphs(node)):
                walk(sub, inits, f"{scope}/{node.name or node.output[0]}:{j}")
            at = WEIGHT_INPUTS.get(node.op_type, ())
            for k, name in enumerate(node.input):
                key, t = inits.get(name, (None, None))
                if (at is not None and k not in at) or t is None or key in seen or len(t.dims) < 2 \
                        or t.data_type not in FLOAT_TYPES:
                    continue
                seen.add(key)
                row = left.setdefault(node.op_type, {"parameters": 0, "nodes": []})
                row["parameters"] += int(np.prod(t.dims))
                if node.name not in row["nodes"]:
                    row["nodes"].append(node.name)

    walk(g.graph, {name: (("", name), t) for name, t in g.initializers.items()}, "")
    return {"quantized": quantized, "float": sum(r["parameters"] for r in left.values()),
            "float_by_op": dict(sorted(left.items(), key=lambda kv: -kv[1]["parameters"]))}


def sensitivity_samples(cfg: QuantConfig, data, val, comm) -> tuple:
    """(source, n, this process's share of the n indices) the sensitivity analysis and its
    diagnosis read: --sens_samples spread over the calibration samples, or with --val_dir over
    the K held-out samples the profile reads (which open_validation checked up front)."""
    if val is None:
        n = min(cfg.sens_samples, cfg.data_num)
        return data, n, spread(n, cfg.data_num, comm.rank, comm.world)
    source, k, _ = val
    picks = spread(k, source.n, 0, 1)
    n = min(cfg.sens_samples, k)
    return source, n, [picks[j] for j in spread(n, k, comm.rank, comm.world)]


def bc_indices(cfg: QuantConfig, comm) -> list[int]:
    """This process's share of the samples bias correction reads (--bc_samples)."""
    from dipoorlet.bias_correction import BC_SAMPLES

    return spread(min(cfg.data_num, cfg.bc_samples or BC_SAMPLES), cfg.data_num, comm.rank, comm.world)


def sensitivity_runs(cfg: QuantConfig) -> bool:
    """Whether :func:`analyse` scores sensitivity variants (it may still find no sample to score)."""
    return not cfg.skip_prof_layer or bool(cfg.auto_skip or cfg.auto_a16 or cfg.auto_w8)


CHECK_MARGIN_DB = 0.1   # a fitted rounding this far below nearest rounding at the network output,
CHECK_SHARE = 0.75      # and worse on this share of the samples or more, is warned


def fit_lost(check: dict) -> bool:
    """Whether a fitted rounding lost to nearest rounding at the network output (the
    ``network_output`` entry of report.json's fit): pooled over the sensitivity samples and on most
    of them. The pooled SQNR alone is one sample's on a classifier's logits: 8 samples of the PP-OCR
    classifier at W4 read 8.6 dB fitted against 12.1 nearest, while the fit was better on 6 of them
    (and on 200 held-out crops, top-1 agreement 0.81 against 0.50)."""
    return (check["fitted"]["sqnr_db"] < check["nearest"]["sqnr_db"] - CHECK_MARGIN_DB
            and check["worse_samples"] >= CHECK_SHARE * check["samples"])


def analyse(cfg: QuantConfig, g: Graph, places, plan, data, comm, stats=None, plat=None, shifted=(),
            val=None, nearest_plan=None) -> dict:
    """Isolated sensitivity, weight range spread and auto_skip, as the config asks.

    With --val_dir (``val``) every score is taken on --sens_samples of the held-out samples the
    error profile reads (--val_num, spread over them), as the profile's are: the layers that
    --auto_skip/--auto_a16/--auto_w8 choose and the targets they meet are then judged on data
    calibration did not see (scored on calibration samples, a choice can fit those few
    samples: on the PP-OCR classifier --auto_skip gained 11 dB on its 8 sensitivity samples
    and 0.5 dB on evaluation crops)."""
    out: dict = {"weight_spread": sensitivity.weight_spread(g, places)}
    auto = cfg.auto_skip or cfg.auto_a16 or cfg.auto_w8
    if not sensitivity_runs(cfg):
        return out
    source, n, indices = sensitivity_samples(cfg, data, val, comm)
    crit = sensitivity.parse_target(auto)[0] if auto else (
        "cosine" if cfg.criterion == "maxabs" else cfg.criterion)
    scorer = sensitivity.Scorer(g, source, indices, comm, cfg.device, crit, outputs=cfg.score_outputs)
    out["sens_samples"] = n
    out["sens_held_out"] = val is not None
    logits = [(o, t) for o, t in zip(cfg.score_outputs or g.output_names, scorer.outputs) if o != t]
    if logits:
        out["sens_scored_on"] = dict(logits)
        log.info("sensitivity%s: %s scored on %s, the Softmax's logits (probabilities barely move until a "
                 "decision flips); the report's output cosine is taken on the probabilities, over %s",
                 " and " + ("--auto_skip" if cfg.auto_skip else "--auto_a16" if cfg.auto_a16 else "--auto_w8")
                 if auto else "", ", ".join(o for o, _ in logits), ", ".join(repr(t) for _, t in logits),
                 "the held-out samples" if val is not None else "the profile's samples")
    if scorer.count == 0:
        log.warning("sensitivity: no sample left to score (the float model's scored output is NaN on every "
                    "one); no sensitivity analysis%s", ", and no --auto_skip/--auto_a16/--auto_w8 search" if auto else "")
        return out
    out["isolated"] = sensitivity.isolated(g, places, plan, scorer, cfg.criterion)
    out["criterion"] = cfg.criterion
    if nearest_plan is not None:
        # a fitted rounding against nearest rounding at the network output, on the same samples:
        # each layer's fit is kept only where it beats nearest rounding on that layer, which does
        # not promise the whole model (--adaround --ada_iters 300 at W4 on the PP-OCR classifier:
        # large per-layer gains, the output 3 dB below nearest rounding; found by a hunt)
        scorer.release()
        (fitted, f_err), (nearest, n_err) = (scorer.score(insert_qdq(g, places, p), per_sample=True)
                                             for p in (plan, nearest_plan))
        out["rounding_check"] = {"samples": len(f_err), "worse_samples": sum(a > b for a, b in zip(f_err, n_err)),
                                 "fitted": {"cosine": fitted.cosine, "sqnr_db": fitted.sqnr_db},
                                 "nearest": {"cosine": nearest.cosine, "sqnr_db": nearest.sqnr_db}}
    if cfg.auto_skip:
        crit, target = sensitivity.parse_target(cfg.auto_skip)
        out["auto_skip"] = sensitivity.auto_skip(g, places, plan, scorer, out["isolated"], crit,
                                                 target, cfg.max_float_layers)
    if cfg.auto_a16 and cfg.a_bits == 16:
        log.warning("--auto_a16 with --a_bits 16: every activation is 16-bit already; nothing to choose")
    elif cfg.auto_a16:
        crit, target = sensitivity.parse_target(cfg.auto_a16, flag="--auto_a16")
        fixed = {n for n, (_, a) in cfg.layer_bits.items() if a}   # an explicit NODE=aM stands
        # a layer owning no activation (a Relu fused into its Conv) has nothing to widen: no
        # candidate (such layers took trial slots and counted among the 16-bit layers)
        fixed |= set(places.quantized_nodes) - _activation_owners(places)
        wide = None
        if stats is not None and plat is not None:
            # every activation's 16-bit grid, from the same statistics: a trial switches the
            # chosen layers' inputs onto these instead of leaving them float
            wide = plan_grids(g, stats, dataclasses.replace(cfg, a_bits=16, layer_bits={}), plat, places, quiet=True)
        out["auto_a16"] = sensitivity.auto_a16(g, places, plan, scorer, out["isolated"], crit,
                                               target, cfg.max_a16_layers, fixed=fixed, wide_plan=wide)
        scorer.release()           # the trials' sessions; the promoted model gets its own
        out["_scorer"] = scorer    # to measure the promoted model as written
    if cfg.auto_w8:
        crit, target = sensitivity.parse_target(cfg.auto_w8, flag="--auto_w8")
        readers: dict[str, int] = {}
        for wp in places.weights.values():
            readers[wp.tensor] = readers.get(wp.tensor, 0) + 1
        weights = [(name, wp) for (name, index), wp in places.weights.items()
                   if not is_bias(g, name, index) and wp.tensor in plan.weights]
        explicit = {name for name, _ in weights if cfg.layer_bits.get(name, (None, None))[0] is not None}
        # candidates: narrow weights read by this node alone (a shared weight has one grid for
        # every reader, which a trial of one reader would not score), no explicit NODE=wN
        below = [(name, wp) for name, wp in weights
                 if plan.weights[wp.tensor].bits < plat.weight.bits and name not in explicit]
        narrow = {name for name, wp in below if readers[wp.tensor] == 1}
        shared = {name for name, wp in below if readers[wp.tensor] > 1}
        if shared:
            log.info("--auto_w8: %d layers read a weight another layer also reads and are not candidates: %s",
                     len(shared), ", ".join(sorted(shared)[:6]))
        if not narrow:
            log.warning("--auto_w8: no candidate layer (weights narrower than %d bits, read by one layer, without an "
                        "explicit --layer_bits NODE=wN: %d such explicit layers); nothing to choose",
                        plat.weight.bits, len(explicit))
        else:
            # every weight on the backend's own width, from the same weights: a trial switches the
            # chosen layers' weights onto these
            wide = QuantPlan()
            plan_weights(g, places, wide, plat, dataclasses.replace(cfg, w_bits=None, layer_bits={}), skip_biases=True)
            # biases that absorb an activation shift through W_q: rebased on the 8-bit grids
            wide.values = shift_mod.rebased_biases(g, plan, shifted, wide.weights)
            if plat.quantize_bias:
                # int32 biases on s_in * s_w8, planned as the written model's will be
                full = QuantPlan(activations=dict(plan.activations), weights=dict(wide.weights),
                                 values={**plan.values, **wide.values})
                plan_biases(g, places.restrict(list(places.quantized_nodes)), full, quiet=True)
                wide.weights = full.weights
            out["auto_w8"] = sensitivity.auto_w8(g, places, plan, scorer, out["isolated"], crit, target,
                                                 cfg.max_w8_layers, narrow, wide)
            scorer.release()
            out["_scorer"] = scorer
    if out.get("auto_skip") is not None and not out["auto_skip"].met:
        a = out["auto_skip"]
        if a.last_kept:
            more = (f"every other layer is float, and {a.last_kept}, the last with a grid, stays quantized (a model "
                    "without one is the float model; the target is tighter than one quantized layer allows)")
        elif len(a.float_layers) >= cfg.max_float_layers:
            more = "a larger --max_float_layers may meet it"
        elif a.over_cap:
            more = (f"{len(a.over_cap)} group(s) of layers that share one rounding (e.g. {a.over_cap[0]}) go float "
                    f"together and would pass --max_float_layers {cfg.max_float_layers}: a larger "
                    "--max_float_layers may meet it")
        elif sum(1 for st in a.steps if not st.get("again")) >= a.candidates:    # first tries only
            # every layer tried: advice to allow more float layers cannot help (it said so)
            more = ("every quantized layer was tried (one without a gain once more, beside the layers kept float "
                    "after it), and no layer kept float moves it closer: layers that help only together, or a loss "
                    "spread over many small ones (report.md's worst layers show where it goes)")
        else:
            more = "the search stops after 3 trials per allowed float layer: a larger --max_float_layers tries more"
        log.warning("auto_skip: target %s %s not met (%s %s with %d layers float over the %d sensitivity "
                    "samples%s); %s", a.criterion, a.target, a.criterion,
                    short_of(a.target, a.after.value(a.criterion)), len(a.float_layers), n,
                    ", on the logits" if out.get("sens_scored_on") else "", more)
    return out


def _unsized_input_layers_float(places, plan, stats) -> dict[str, list[str]]:
    """A layer whose every quantized input was 0 in every calibration sample (no grid: see
    warn_degenerate) keeps its weights float too: no backend describes a layer with an integer
    weight and a float input (atlas_record.json left such a Conv out while quant_model.onnx gave
    it int8 weights; found by a bug hunt), and with its input 0 the weights' rounding was never
    measured. _gridless_to_float then gives it its decision."""
    inputs: dict[str, list[str]] = {}
    for t, p in places.activations.items():
        for owner in p.owners:
            inputs.setdefault(owner, []).append(t)
    gone: dict[str, list[str]] = {}
    for key, wp in list(places.weights.items()):
        ts = inputs.get(wp.node)
        if ts and all(t not in plan.activations and t in stats and _zero(stats[t]) for t in ts):
            del places.weights[key]
            gone[wp.node] = sorted(ts)
    return gone


def _why_no_grid(t: str, stats) -> str:
    """Why calibration sized no grid for ``t`` (plan_activations / plan_grids), for a decision."""
    st = (stats or {}).get(t)
    if st is None or _zero(st):
        return f"{t} 0 in every calibration sample"
    mm = st.minmax
    if not mm.count or mm.lo > mm.hi:
        return f"{t} empty or NaN throughout in every calibration sample"
    if not math.isfinite(mm.amax):
        return f"{t} reaches {mm.lo:.4g}..{mm.hi:.4g}"
    return f"{t} reaches {mm.lo:.4g}..{mm.hi:.4g}, beyond any integer grid"


def _gridless_to_float(g, places, plan, unsized=None, stats=None) -> None:
    """Nodes placed as quantized whose every grid the plan left out (inputs 0 in every calibration
    sample, warn_degenerate; or of a range no grid holds, a mask of -inf or float32's lowest)
    compute in float: say so in their decision (report.json counted an Add with no Q/DQ left as
    quantized; every such decision said "0 in every calibration sample", found by a bug hunt)."""
    from dipoorlet.placement import Decision

    gridded = {n for (n, _), wp in places.weights.items() if wp.tensor in plan.weights}
    for t, p in places.activations.items():
        if t in plan.activations:      # the nodes that read it through its Q/DQ, own it, or produce it
            gridded.update(u for u, _ in p.uses)
            gridded.update(p.owners)
            if t in g.producer:
                gridded.add(g.producer[t].name)
            if p.output and t in places.output_owners:
                gridded.add(places.output_owners[t])
    # a node whose output reaches a grid through ops that only move values (PRelu -> Transpose ->
    # Flatten -> MatMul on qnn) computes onto that grid: it had been called "kept float: no grid
    # left", with no reason (found by a hunt)
    from dipoorlet.placement import pass_through_chain

    dropped_owners = {o for t, p in places.activations.items() if t not in plan.activations for o in p.owners}
    for d in places.decisions:
        if d.quantized and d.node not in gridded and d.node not in dropped_owners and d.node in g.node_by_name:
            if any(t in plan.activations for o in g.node_by_name[d.node].output if o
                   for t in pass_through_chain(g, o)[1:]):
                gridded.add(d.node)
    dropped = {t for t in places.activations if t not in plan.activations}
    gone = []
    unsized = unsized or {}
    owns = {o for t, p in places.activations.items() if t in plan.activations for o in p.owners} | {
        places.output_owners[t] for t, p in places.activations.items()
        if p.output and t in plan.activations and t in places.output_owners}
    for k, d in enumerate(places.decisions):
        if d.quantized and d.node in unsized:
            # inputs and weights float (_unsized_input_layers_float); a layer that still owns an
            # output grid (a quantized network output) stays counted, with that said
            zero = ", ".join(unsized[d.node][:3])
            if d.node in owns:
                places.decisions[k] = Decision(d.node, d.op_type, True, f"output grid only: inputs and weights "
                                               f"float ({zero} 0 in every calibration sample)")
            else:
                places.decisions[k] = Decision(d.node, d.op_type, False,
                                               f"kept float: no grid left ({zero} 0 in every calibration sample)")
                gone.append(d.node)
        elif d.quantized and d.node not in gridded:
            why = [_why_no_grid(t, stats) for t in sorted(dropped) if d.node in places.activations[t].owners]
            places.decisions[k] = Decision(d.node, d.op_type, False,
                                           "kept float: no grid left" + (f" ({'; '.join(why[:3])})" if why else ""))
            gone.append(d.node)
    if gone:
        # the placement's count in the log came before these (the summary's is after)
        log.info("%d of the placed nodes compute in float, no grid of theirs left: %s; %d nodes quantized",
                 len(gone), ", ".join(gone[:5]) + (" ..." if len(gone) > 5 else ""), len(places.quantized_nodes))


def _activation_owners(places) -> set[str]:
    """The quantized nodes that own an activation grid: one of their inputs, or a network output
    they produce."""
    return {o for p in places.activations.values() for o in p.owners} | set(places.output_owners.values())


def _flag(rounding: str) -> str:
    """The flag that chose the rounding ("qdrop" runs under --drop)."""
    return "--drop" if rounding == "qdrop" else f"--{rounding}"


def _nbits_fusable(g: Graph, node) -> bool:
    """A MatMul, or a Gemm reading its weight untransposed: what onnxruntime 1.32's default
    session turns into MatMulNBits when the weight has an int8 DequantizeLinear."""
    if node.op_type == "MatMul":
        return True
    if node.op_type != "Gemm" or node_attr(node, "transB", 0) or node_attr(node, "transA", 0) \
            or node_attr(node, "alpha", 1.0) != 1.0:
        return False     # measured on onnxruntime 1.32: alpha 0.5 is not fused
    if len(node.input) < 3 or not node.input[2]:
        return True
    # nor a bias scaled (beta 2) or of another shape than [N] ((1, N), (4, N), (1,) stay Gemms)
    dims = lambda t: list(g.weight(t).shape) if g.is_constant(t) else list(g.shape(t) or [])
    w, b = dims(node.input[1]), dims(node.input[2])
    return node_attr(node, "beta", 1.0) == 1.0 and len(w) == 2 and b == w[-1:]


def _warn_matmulnbits(g: Graph, places, plan: QuantPlan) -> None:
    """onnxruntime's default session (ORT_ENABLE_EXTENDED and up) fuses a DequantizeLinear of an
    int8 weight into the MatMul that reads it as MatMulNBits (and into a Gemm whose weight is stored
    [K, N], transB = 0; one with transB = 1 stays a Gemm), which by default
    (accuracy level 4) quantizes that layer's input to int8 on the fly: a 16-bit input grid
    gains little there (on a two-MatMul model: 41.4 dB output SQNR with Q/DQ as float, 39.2 dB in
    a default onnxruntime 1.32 session, 41.4 dB at accuracy level 2). Say so where it applies."""
    wide = {use[0] for t, point in places.activations.items()
            if t in plan.activations and plan.activations[t].bits > 8 for use in point.uses}
    hit = sorted(name for (name, index) in places.weights
                 if index == 1 and name in wide and _nbits_fusable(g, g.node_by_name[name]))
    if hit:
        log.warning("%d MatMul/Gemm with 16-bit inputs (%s): a default onnxruntime session runs them as "
                    "MatMulNBits, which quantizes their inputs to int8 again; deploy with session option "
                    "session.qdq_matmulnbits_accuracy_level = 2 (or a lower one) to keep the 16-bit inputs",
                    len(hit), ", ".join(hit[:4]) + (" ..." if len(hit) > 4 else ""))


def promote_a16(g: Graph, places, plan: QuantPlan, stats, cfg: QuantConfig, plat, layers) -> list[str]:
    """Give ``layers``' activation inputs 16-bit grids (--auto_a16's choice), from the same
    statistics and range method; int32 biases on those inputs are planned again (their grid is
    s_in * s_w). Returns the tensors whose grid changed."""
    bits = dict(cfg.layer_bits)
    for n in layers:
        if bits.get(n, (None, None))[1] is None:     # an explicit --layer_bits NODE=aM stands
            bits[n] = (bits.get(n, (None, None))[0], 16)
    new = plan_grids(g, stats, dataclasses.replace(cfg, layer_bits=bits), plat, places, quiet=True)
    changed = [t for t, qp in new.activations.items()
               if t in plan.activations and qp.bits != plan.activations[t].bits]
    for t in changed:
        plan.activations[t] = new.activations[t]
        plan.rules[t] = new.rules[t]
    # what a shared grid leaves its members is the new plan's (a group moved to 16 bits had kept
    # its 8-bit entry in the report; found by a review)
    plan.shared_losses = {t: v for t, v in new.shared_losses.items() if t in plan.activations}
    if plat.quantize_bias and changed:
        moved = set(changed)

        def reads_moved(name: str) -> bool:
            src = g.node_by_name[name].input[0]
            prod = g.producer.get(src)
            return src in moved or (prod is not None and prod.op_type == "Pad" and prod.input[0] in moved)
        drop_bias_grids(g, places, plan, {name for name, _ in places.weights if reads_moved(name)})
        plan_biases(g, places, plan)
    return changed


def promote_w8(g: Graph, places, plan: QuantPlan, cfg: QuantConfig, plat, layers, shifted=()) -> list[str]:
    """Give ``layers``' weights the backend's own width (--auto_w8's choice); biases that absorb
    an activation shift through W_q are rebased on the new grids, int32 biases on those layers
    are planned again (their grid is s_in * s_w). Returns the weights replanned."""
    chosen = set(layers)
    bits = dict(cfg.layer_bits)
    for n in chosen:
        bits[n] = (plat.weight.bits, bits.get(n, (None, None))[1])
    new = QuantPlan()
    plan_weights(g, places.restrict([n for n in places.quantized_nodes if n in chosen]), new, plat,
                 dataclasses.replace(cfg, layer_bits=bits), skip_biases=True)
    plan.values.update(shift_mod.rebased_biases(g, plan, shifted, new.weights))
    changed = sorted(new.weights)
    plan.weights.update(new.weights)
    if plat.quantize_bias and changed:
        drop_bias_grids(g, places, plan, chosen)
        plan_biases(g, places, plan)
    elif changed:
        fit_biases(g, places, plan)
    return changed


def _save_transformed(g: Graph, plan, path: Path) -> Path:
    """The float model after the weight transforms (equalization's rescaled weights and inserted
    Muls, corrected biases), without Q/DQ: the graph whose tensor names and ranges the side files
    describe, for the flows that take a float model plus ranges (TensorRT's setDynamicRange or
    calibration cache, SNPE/QNN encodings, RKNN and Atlas parameter files). The input model
    would not match them: its weights differ and the smoothed tensors are not in it."""
    # the values are written in the model's place, not put into it and taken back: protobuf kept
    # both copies of every changed weight in the model for the rest of the run (found by a hunt)
    inits = {t.name for t in g.graph.initializer}
    return save_model(g.model, path, replace={k: v for k, v in plan.values.items() if k in inits})


def _shapeless(vi) -> bool:
    """A tensor declared with a type but no shape, not even a rank (onnx.checker rejects it on
    graph inputs, outputs and value_info)."""
    return vi.type.HasField("tensor_type") and not vi.type.tensor_type.HasField("shape")


def _declare_input_ranks(g: Graph, data) -> None:
    """Graph inputs and outputs declared without any shape (onnxruntime runs such models,
    onnx.checker and TensorRT's parser reject them) get the rank of the first sample's values,
    every dimension symbolic: inputs from the sample, outputs from one float run on it."""
    ins = [vi for vi in g.graph_inputs if _shapeless(vi)]
    outs = [vi for vi in g.graph.output if _shapeless(vi)]
    if not ins and not outs:
        return
    first = data.sample(0)
    ranks = {vi.name: np.asarray(first[vi.name]).ndim for vi in ins}
    if outs:
        from dipoorlet.runtime import Runner

        got, _ = Runner(g.model, [vi.name for vi in outs], types=g.types).run(first, ranges=False)
        ranks.update({vi.name: np.asarray(got[vi.name]).ndim for vi in outs})
    # by name: the session above may have rebuilt the graph's output list
    in_names, out_names = {v.name for v in ins}, {v.name for v in outs}
    for vi in [v for v in g.graph.input if v.name in in_names] + [v for v in g.graph.output if v.name in out_names]:
        if not _shapeless(vi):
            continue
        shape = vi.type.tensor_type.shape
        shape.SetInParent()            # rank 0 (a scalar) is a shape with no dims, not no shape
        for k in range(ranks[vi.name]):
            shape.dim.add().dim_param = f"{vi.name}_dim{k}"
        log.info("'%s' declares no shape; rank %d from the first sample", vi.name, ranks[vi.name])
    if model_bytes(g.model) < PROTOBUF_LIMIT:
        # the intermediate tensors' ranks follow from the inputs' now
        try:
            inferred = onnx.shape_inference.infer_shapes(g.model)
            del g.graph.value_info[:]
            g.graph.value_info.extend(inferred.graph.value_info)
        except Exception as exc:  # noqa: BLE001 - inference is a nicety here
            log.debug("shape inference after declaring ranks failed: %s", exc)
    g.refresh()


def _drop_shapeless_value_info(model) -> None:
    """value_info entries with a type but no shape (not even a rank) fail onnx.checker and tell
    a backend nothing; the model runs the same without them."""
    keep = [vi for vi in model.graph.value_info if not _shapeless(vi)]
    if len(keep) != len(model.graph.value_info):
        del model.graph.value_info[:]
        model.graph.value_info.extend(keep)


def _check(qmodel) -> None:
    try:
        if model_bytes(qmodel) < PROTOBUF_LIMIT:
            onnx.checker.check_model(qmodel, full_check=False)
    except Exception as exc:
        msg = " ".join(str(exc).split())
        if "is deprecated in domain_version" in msg:
            # an op of the input model that onnx now marks deprecated (GroupNormalization-18:
            # onnxruntime runs it, onnx.checker refuses it); this tool writes no such op itself
            log.warning("the quantized model keeps an op of the input model that onnx.checker refuses as deprecated "
                        "(%s); onnxruntime runs it, but tools that check the model may not: export the model at an "
                        "opset where the op is current (e.g. GroupNormalization at 21)", msg[:200])
            return
        # a bug of ours, not the user's input
        raise RuntimeError(f"the quantized model fails onnx.checker: {exc}") from exc


# ops whose opset-21 version differs from their opset-20 one only by the tensor types it accepts
# (int4/uint4/float8 and the like, which an 8-bit model does not hold) or, for Q/DQ, by attributes
# (block_size, output_dtype) this tool does not write
_TYPES_ONLY_AT_21 = frozenset({"Cast", "CastLike", "Constant", "ConstantOfShape", "DequantizeLinear", "Flatten",
                               "Identity", "If", "Loop", "Pad", "QuantizeLinear", "Reshape", "Scan", "Shape",
                               "Size", "Squeeze", "Transpose", "Unsqueeze"})
# ops whose opset-22 version only added bfloat16 to the types it accepts (ONNX 1.17)
_BFLOAT16_AT_22 = frozenset({
    "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "AveragePool", "Bernoulli", "Conv", "ConvTranspose", "Cos",
    "Cosh", "DeformConv", "Det", "Dropout", "Elu", "EyeLike", "GRU", "GlobalAveragePool", "GlobalLpPool",
    "GlobalMaxPool", "GridSample", "HardSigmoid", "HardSwish", "InstanceNormalization", "LSTM", "LpNormalization",
    "LpPool", "MaxPool", "MaxRoiPool", "MaxUnpool", "Mish", "Multinomial", "NegativeLogLikelihoodLoss", "RNN",
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "RoiAlign", "Round", "Selu", "Sin",
    "Sinh", "Softplus", "Softsign", "Tan", "ThresholdedRelu"})
_TYPES_AT_20 = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                          onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT8, onnx.TensorProto.UINT8,
                          onnx.TensorProto.INT16, onnx.TensorProto.UINT16, onnx.TensorProto.INT32,
                          onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
                          onnx.TensorProto.BOOL, onnx.TensorProto.STRING})


def _as_opset_20(qmodel) -> bool:
    """Lower an opset-21 or -22 QDQ model to opset 20 in place where that changes nothing: every
    default-domain op means the same at 20, no tensor has a type opset 20 lacks (bfloat16 either,
    from 22), every Q/DQ grid is 8-bit (a 16-bit one needs 21) and no Q/DQ carries an opset-21
    attribute. Returns whether it did."""
    from dipoorlet.graph import _all_nodes

    version = opset_of(qmodel)
    if version not in (21, 22) or qmodel.functions:
        return False
    types = _TYPES_AT_20 - ({onnx.TensorProto.BFLOAT16} if version == 22 else set())
    consts = {t.name: t.data_type for t in qmodel.graph.initializer}
    for node in _all_nodes(qmodel):
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            since = onnx.defs.get_schema(node.op_type, version, "").since_version
        except Exception:  # noqa: BLE001 - not an onnx op
            return False
        if since == 21 and node.op_type not in _TYPES_ONLY_AT_21 or since == 22 and node.op_type not in _BFLOAT16_AT_22:
            return False
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            if any(a.name in ("block_size", "output_dtype") for a in node.attribute):
                return False
            zp = node.input[2] if len(node.input) > 2 else ""
            # 8-bit grids, and the int32 grids of biases (DequantizeLinear only, since opset 10)
            fits = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8) + (
                (onnx.TensorProto.INT32,) if node.op_type == "DequantizeLinear" else ())
            if not zp or consts.get(zp) not in fits:
                return False
        if node.op_type == "Cast" and node_attr(node, "to", onnx.TensorProto.FLOAT) not in types:
            return False
    graph = qmodel.graph
    infos = list(graph.input) + list(graph.output) + list(graph.value_info)
    if any(t.data_type not in types for t in graph.initializer) or any(
            v.type.HasField("tensor_type") and v.type.tensor_type.elem_type not in types for v in infos):
        return False
    for imp in qmodel.opset_import:
        if imp.domain in ("", "ai.onnx"):
            imp.version = 20
    return True


def _default_session_failure(model, feed=None) -> str:
    """Why a default (optimizing) onnxruntime CPU session fails to load ``model``, or to run it on
    ``feed`` where one is given; '' where it does not."""
    from dipoorlet.runtime import _ort, ort_message, session_options

    try:
        sess = _ort().InferenceSession(model.SerializeToString(), session_options(),
                                       providers=["CPUExecutionProvider"])
        if feed is not None:
            sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})
        return ""
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several types
        return ort_message(exc)


def _loads_by_default(qmodel) -> None:
    """onnxruntime (1.32 and earlier) rejects an opset-21+ QDQ model with int8 grids in a default
    session: its QDQ propagation copies a Q/DQ pair across MaxPool, Reshape, Transpose... as a
    QuantizeLinear whose output_dtype (int8) disagrees with the zero point it gives it (uint8), and
    the session fails to load (the same model loads with optimizations off, as the tool runs it).
    Check that a default session loads such a model; lower it to opset 20 where that changes
    nothing (only types and attributes an 8-bit model does not use changed at 21), else say how to
    run it. Models below opset 21 are not checked (the bug needs 21)."""
    if opset_of(qmodel) < 21 or model_bytes(qmodel) >= PROTOBUF_LIMIT or not any(
            n.op_type == "QuantizeLinear" for n in qmodel.graph.node):
        return
    from dipoorlet.runtime import _ort

    ort = _ort()
    why = _default_session_failure(qmodel)
    if not why:
        return
    was = opset_of(qmodel)
    lowered = onnx.ModelProto()
    lowered.CopyFrom(qmodel)
    if _as_opset_20(lowered) and not _default_session_failure(lowered):
        try:
            onnx.checker.check_model(lowered, full_check=True)
        except Exception:  # noqa: BLE001 - keep the model at its opset then
            pass
        else:
            qmodel.CopyFrom(lowered)
            log.info("quant_model.onnx is written at opset 20, not %d: onnxruntime %s's default session "
                     "fails to load the opset-%d model (%s); nothing the model uses changed between the two",
                     was, ort.__version__, was, why[:160])
            return
    log.warning("quant_model.onnx runs in onnxruntime with graph optimizations off (as this tool ran it), but "
                "onnxruntime %s's default session fails to load it (%s); run it with "
                "GraphOptimizationLevel.ORT_ENABLE_BASIC, or export the float model at opset 20 or lower",
                ort.__version__, why[:200])


def _readers_of_16bit(qmodel) -> list[str]:
    """Nodes (other than Q/DQ) reading a DequantizeLinear whose zero point is 16-bit, or
    writing into a QuantizeLinear onto such a grid (a 16-bit output grid keeps a layer QDQ too)."""
    wide_zp = {t.name for t in qmodel.graph.initializer
               if t.data_type in (onnx.TensorProto.UINT16, onnx.TensorProto.INT16)}
    wide_in = {n.output[0] for n in qmodel.graph.node
               if n.op_type == "DequantizeLinear" and len(n.input) > 2 and n.input[2] in wide_zp}
    wide_out = {n.input[0] for n in qmodel.graph.node
                if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in wide_zp}
    # a node that reads no Q/DQ at all (a layer --skip_layers keeps float) would not be converted
    # anyway: not listed as kept QDQ by its 16-bit output (found by a hunt)
    dq_out = {n.output[0] for n in qmodel.graph.node if n.op_type == "DequantizeLinear"}
    return [n.name for n in qmodel.graph.node
            if n.op_type not in ("QuantizeLinear", "DequantizeLinear") and dq_out & set(n.input)
            and (wide_in & set(n.input) or wide_out & set(n.output))]


def _log_grids(plan: QuantPlan) -> None:
    """--debug: every grid the quantized model gets, one line each (the side files hold the same
    in each backend's own spelling)."""
    for kind, grids in (("activation", plan.activations), ("weight", plan.weights)):
        for t, q in grids.items():
            scale = np.asarray(q.scale, np.float64)
            where = "per-tensor" if q.axis is None else f"axis {q.axis}, {scale.size} channels"
            lo, hi = (np.asarray(v, np.float64) for v in (q.lo, q.hi)) if q.lo is not None else (None, None)
            clip = "" if lo is None else f", clip [{lo.min():.6g}, {hi.max():.6g}]"
            log.debug("grid %s %s: %d-bit %s, %s, scale %.6g..%.6g, zero point %d..%d%s", kind, t, q.bits,
                      "signed" if q.signed else "unsigned", where, scale.min(), scale.max(),
                      int(np.min(q.zero_point)), int(np.max(q.zero_point)), clip)


def _drop_default_pool_dilations(qmodel) -> None:
    """Drop an AveragePool's ``dilations`` where every one is 1 (the default: nothing changes).
    onnxruntime's default session fuses a quantized AveragePool into QLinearAveragePool with
    the node's attributes, and that op has no ``dilations``: an opset-19 export that spells out
    the default gave a -D ort model that a default session refused to load."""
    for node in qmodel.graph.node:
        if node.op_type == "AveragePool" and node.domain in ("", "ai.onnx"):
            for i, a in enumerate(node.attribute):
                if a.name == "dilations" and all(v == 1 for v in a.ints):
                    del node.attribute[i]
                    break


def _warn_padded_ceil_pools(qmodel) -> None:
    """A quantized AveragePool with ceil_mode=1, padding and count_include_pad=1: a default
    onnxruntime session fuses it into QLinearAveragePool, which divides the windows ceil mode adds
    at the border by the whole kernel (float and the simulation divide by the cells inside the
    padded input; 0.6 relative error on those outputs measured). QOP leaves it QDQ, which the
    default session fuses all the same."""
    from dipoorlet.prepare import padded_ceil_pool
    from dipoorlet.qop import shape_reader

    made = {o: n for n in qmodel.graph.node for o in n.output}
    shape = shape_reader(qmodel)
    pools = [n.name for n in qmodel.graph.node if n.op_type == "AveragePool" and n.input
             and getattr(made.get(n.input[0]), "op_type", "") == "DequantizeLinear"
             and padded_ceil_pool(n, shape(n.input[0]))]
    if pools:
        log.warning("AveragePool %s (ceil_mode=1, padded, count_include_pad=1): onnxruntime's default session "
                    "fuses its Q/DQ into QLinearAveragePool, which divides the border windows ceil mode adds by "
                    "the whole kernel, so deployed numbers there differ from this run's; run the model at "
                    "GraphOptimizationLevel.ORT_ENABLE_BASIC, or keep the pool float (--skip_layers)",
                    ", ".join(pools[:4]) + (" ..." if len(pools) > 4 else ""))


def _runs_by_default(qmodel, feed: dict, qop: bool) -> None:
    """-D ort deploys on onnxruntime itself: check that a default (optimizing) CPU session loads
    the QDQ model and runs it on one sample, at any opset. Its Q/DQ fusions fail on some graphs
    the model is right in (an opset-18 Resize with ``axes``, a dilated AveragePool); the tool's
    own sessions run with them off, so without this the run said nothing."""
    if model_bytes(qmodel) >= PROTOBUF_LIMIT or not any(n.op_type == "QuantizeLinear" for n in qmodel.graph.node):
        return
    why = _default_session_failure(qmodel, feed)
    if why:
        from dipoorlet.runtime import _ort

        log.warning("-D ort: %s runs in onnxruntime with graph optimizations off (as this tool ran it), but "
                    "onnxruntime %s's default session fails on it (%s); run it with "
                    "GraphOptimizationLevel.ORT_ENABLE_BASIC, or keep the layer the error names float "
                    "(--skip_layers)", "quant_model_qdq.onnx" if qop else "quant_model.onnx",
                    _ort().__version__, why[:200])


def _runs_batched_by_default(g: Graph, places, qmodel, data, indices) -> None:
    """A MatMul weight of rank > 2 with per-column grids (backends whose spec keeps
    per_channel_batched): onnxruntime's CPU optimizer fuses some of them into
    MatMulIntegerToFloat, whose kernel rejects those grids when it runs (not when the session
    loads), depending on the activations' grids. Run a default session once on one sample and
    say how to run the file where it fails; the tool's own sessions run with optimizations off."""
    matmuls = {n.name for n in g.graph.node if n.op_type == "MatMul"}
    batched = sorted({wp.node for wp in places.weights.values() if wp.axis is not None and wp.node in matmuls
                      and len(g.shape(wp.tensor) or []) > 2})
    if not batched or not len(indices) or model_bytes(qmodel) >= PROTOBUF_LIMIT:
        return
    why = _default_session_failure(qmodel, data.sample(indices[0]))
    if why:
        log.warning("MatMul %s: its weight of rank > 2 has per-column grids, which a default onnxruntime "
                    "session fails to run (%s); run quant_model.onnx in onnxruntime at ORT_ENABLE_BASIC, as "
                    "the tool does, or set per_channel_batched = false under [weight] in a copy of the "
                    "backend's spec for one grid per weight",
                    ", ".join(batched[:4]) + (" ..." if len(batched) > 4 else ""), why)


def _to_qop(qmodel, feed: dict, ort_backend: bool = False):
    """(the QOperator model, what report.json says of it: ``quant_format``)."""
    from dipoorlet import qop

    try:
        model, converted, excluded, cos, fused_error = qop.convert_checked(qmodel, feed)
    except RuntimeError as exc:   # QOP is QDQ wherever an op cannot be converted: here, everywhere
        log.warning("--quant_format QOP: %s; quant_model.onnx is the QDQ model", exc)
        return qmodel, {"format": "QDQ", "asked": "QOP", "why": str(exc)[:300]}
    log.info("--quant_format QOP: %d ops converted to QLinear form; the rest stay QDQ", converted)
    unq = qop.unquantized_outputs(qmodel)
    if unq:
        log.info("--quant_format QOP: %d Conv/MatMul/Gemm stay QDQ because this backend leaves their "
                 "output float, or it is also a network output or read inside an If/Loop/Scan body (a QLinear "
                 "op writes one quantized tensor, which its readers alone take); their readers: %s", sum(unq.values()),
                 ", ".join(f"{k} x{n}" for k, n in sorted(unq.items(), key=lambda kv: -kv[1])[:5]))
    wide = _readers_of_16bit(qmodel)
    if wide:
        log.info("--quant_format QOP: %d ops read or write 16-bit grids and stay QDQ (onnxruntime's QLinear ops "
                 "take 8-bit tensors only): %s", len(wide), ", ".join(wide[:5]))
    if excluded:
        log.warning("--quant_format QOP: onnxruntime has no integer kernel for %d ops as converted; "
                    "they stay QDQ (%s)", len(excluded), ", ".join(excluded[:5]))
    if cos < 0.99:
        log.warning("--quant_format QOP: on the first calibration sample the QOP model's output cosine "
                    "to the QDQ model (both in onnxruntime) is only %.4f; compare them on your data, and "
                    "deploy quant_model_qdq.onnx if the QOP model is worse", cos)
    if fused_error:
        log.warning("--quant_format QOP: the model runs in onnxruntime with graph optimizations off, but a "
                    "default session fails (%s); run it with GraphOptimizationLevel.ORT_ENABLE_BASIC%s",
                    fused_error[:200], "" if ort_backend else ", or quantize with -D ort")
    # ops that still read a DequantizeLinear output in the written model (the conversion leaves
    # some without a word: a Gemm(W, x), an Add whose output stays float...)
    dq_out = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    still = [n.name or n.op_type for n in model.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear")
             and any(i in dq_out for i in n.input)]
    left = len(still)
    if still:
        log.info("--quant_format QOP: %d ops still read Q/DQ (float arithmetic between them, as in the QDQ model): "
                 "%s", left, ", ".join(still[:8]) + (f" and {left - 8} more" if left > 8 else ""))
    info = {"format": "QOP", "converted_ops": int(converted), "qdq_left": left,
            "cosine_to_qdq_first_sample": None if cos != cos else round(float(cos), 6)}
    if fused_error:
        info["default_session_error"] = fused_error[:300]
    return model, info


def _nested_node_names(g: Graph) -> set[str]:
    """Names of the nodes inside the main graph's If/Loop/Scan bodies, at any depth."""
    from dipoorlet.graph import subgraphs

    names, todo = set(), [sub for node in g.graph.node for sub in subgraphs(node)]
    while todo:
        for inner in todo.pop().node:
            todo.extend(subgraphs(inner))
            if inner.name:
                names.add(inner.name)
    return names


def _nested_quantizable(g: Graph, plat) -> dict[str, int]:
    """Ops of the backend's quantize list inside subgraphs (If/Loop/Scan bodies) that compute in
    float, by type: a Loop's iteration counter Add or an index Mul (int64) is no layer left float
    (counted, they made a model with nothing else to quantize read "its Add ops sit inside
    If/Loop/Scan bodies"; found by a bug hunt). An op whose output type no inference gave is
    counted unless its inputs are all known not to be float."""
    from dipoorlet.graph import subgraphs

    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    found: dict[str, int] = {}
    todo = [(sub, g.types) for node in g.graph.node for sub in subgraphs(node)]
    while todo:
        sub, outer = todo.pop()
        types = dict(outer)          # a body sees the enclosing scopes' names, its own shadow them
        for vi in list(sub.input) + list(sub.value_info) + list(sub.output):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types[vi.name] = (vi.type.tensor_type.elem_type, None)
        for t in sub.initializer:
            types[t.name] = (t.data_type, None)
        for inner in sub.node:
            if inner.op_type == "Constant" and inner.attribute and inner.attribute[0].HasField("t"):
                types[inner.output[0]] = (inner.attribute[0].t.data_type, None)
        for inner in sub.node:
            todo.extend((s, types) for s in subgraphs(inner))
            if inner.op_type not in plat.quantize_ops or inner.domain not in ("", "ai.onnx"):
                continue
            known = [types[o][0] for o in inner.output if o in types]
            if known:
                is_float = any(t in floats for t in known)
            else:
                ins = [types[i][0] if i in types else None for i in inner.input if i]
                is_float = not ins or any(t is None or t in floats for t in ins)
            if is_float:
                found[inner.op_type] = found.get(inner.op_type, 0) + 1
    return found


def _sees(path: Path) -> bool:
    return path.is_file()


def _check_shared_output(staging: Path, comm) -> None:
    """--savefp under MPI: each rank writes its own samples' outputs into rank 0's staging
    folder, so -O must be on a file system every rank shares; on node-local disks the other
    nodes' samples would be missing from -O without a word. Rank 0 leaves a mark there and
    every rank looks for it before the profile pass (all ranks raise alike)."""
    import socket

    mark = staging / ".rank0"
    if comm.rank == 0:
        staging.mkdir(parents=True, exist_ok=True)
        mark.write_text(socket.gethostname())
    comm.barrier()
    seen = comm.allgather((_sees(mark), socket.gethostname()))
    blind = [f"{r} ({host})" for r, (ok, host) in enumerate(seen) if not ok]
    if blind:
        raise OutputError(f"--savefp under MPI: rank {', '.join(blind[:4])} cannot see -O {staging.parent} as rank 0 "
                          f"({seen[0][1]}) writes it, so its samples' outputs would be missing; put -O on a file "
                          "system every rank shares, or run without --savefp")
    if comm.rank == 0:
        mark.unlink(missing_ok=True)


def _fp_saver(staging: Path, outputs: list[str]):
    """--savefp: the float model's outputs per sample, ``output/<tensor>/onnx-output-<i>.bin`` as
    the reference tool writes them; each rank writes its own samples into the staging folder."""
    folders, taken = {}, set()
    for name in outputs:
        # the reference tool's folder name; two outputs that differ by '/' against '_' get their
        # own folders (one overwrote the other's samples)
        base = folder = name.replace("/", "_")
        dots = base in ("", ".", "..")
        if dots:        # output/. is output/ itself and output/.. is -O (found by a hunt)
            base = folder = base.replace(".", "_") or "_"
        if len(base.encode("utf-8", "surrogateescape")) > 200:
            # a file name holds at most 255 bytes (ENAMETOOLONG with a traceback, mid-run)
            import hashlib

            digest = hashlib.sha1(base.encode("utf-8", "surrogateescape")).hexdigest()[:12]
            base = folder = base.encode("utf-8", "surrogateescape")[:180].decode("utf-8", "ignore") + "_" + digest
            log.warning("--savefp: output %r's name is too long for a folder name; its samples go into output/%s",
                        name[:60] + "...", folder)
        k = 1
        while folder in taken:
            folder, k = f"{base}_{k}", k + 1
        if folder != base:
            log.warning("--savefp: outputs %r and another both map to folder output/%s; %r's samples go into "
                        "output/%s", name, base, name, folder)
        elif dots:
            log.warning("--savefp: output %r cannot be a folder name; its samples go into output/%s", name, folder)
        taken.add(folder)
        folders[name] = folder

    def save(i, tensors):
        for name in outputs:
            folder = staging / "output" / folders[name]
            folder.mkdir(parents=True, exist_ok=True)
            # file.write, not ndarray.tofile: a full disk is then an OSError with its errno (tofile
            # raised one without, which the CLI could not tell from a bug)
            with open(folder / f"onnx-output-{i}.bin", "wb") as f:
                f.write(np.ascontiguousarray(tensors[name]).reshape(-1).view(np.uint8).data)
    return save


MANIFEST = ".dipoorlet-files.json"


# the -O this process's latest run published into (what the CLI says when an interrupt arrives
# after the outputs are in place)
PUBLISHED: list = []


def _kept_paths(keep) -> set:
    kept = set()
    for k in keep:
        try:
            kept.add(Path(k).resolve())
        except OSError:
            pass
    return kept


def _publish(staging: Path, out_dir: Path, keep=()) -> list[Path]:
    """Move every finished file from staging into -O, all or nothing: first every path is checked
    (no folder in the way, none of ``keep`` overwritten), then the files they replace are moved
    aside into staging, then the new ones in (each an atomic rename); if a move fails, what was
    moved goes back and -O holds the earlier run's files as before. Then remove what an earlier
    run into the same -O wrote and this one did not (a ``transformed_model.onnx`` the new side
    files do not describe, another backend's files, ``--savefp`` outputs): its list is kept in
    ``.dipoorlet-files.json``. Only plain files under -O named there are removed: never a symlink
    or anything reached through one, never a path outside -O, never one of ``keep`` (this run's
    own model and data)."""
    import json

    kept = _kept_paths(keep)
    aside = staging / ".replaced"
    moves = [(src, out_dir / src.relative_to(staging)) for src in sorted(staging.rglob("*")) if src.is_file()]
    for _, dst in moves:
        for parent in _folders_between(out_dir, dst):
            if parent.exists() and not parent.is_dir():
                raise OutputError(f"cannot write {dst}: {parent} is a file, not a folder; remove or rename it, "
                                  f"or choose another -O; nothing in {out_dir} was changed")
        if dst.is_dir():
            raise OutputError(f"cannot write {dst}: a folder of that name is in the way; remove or rename it, "
                              f"or choose another -O; nothing in {out_dir} was changed")
        if dst.exists() and dst.resolve() in kept:
            raise OutputError(f"cannot write {dst}: it is this run's own input (-M/-I); move the input or "
                              f"choose another -O; nothing in {out_dir} was changed")
    moved_aside, moved_in, made = [], [], []
    with _signals_held():
        _move_all(moves, out_dir, aside, moved_aside, moved_in, made)
        PUBLISHED.append(out_dir)       # an interrupt held till now is reported as coming after this
        final = [dst for _, dst in moves]
        manifest = out_dir / MANIFEST
        try:
            before = json.loads(manifest.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            before = []
        args = (out_dir, aside, manifest, before if isinstance(before, list) else [],
                {p.relative_to(out_dir).as_posix() for p in final}, kept)
        try:
            _after_moves(*args)
        except BaseException:
            # the outputs are in: an exception that a handler of the caller's raised (a time limit's
            # SIGALRM, a SIGTERM handler's sys.exit; not held like Ctrl-C) had cut the clean-up short
            # and left an earlier backend's files beside the new ones (found by a hunt): finished
            # first, then raised
            _after_moves(*args)
            raise
    return final


def _after_moves(out_dir: Path, aside: Path, manifest: Path, before: list, written: set, kept: set) -> None:
    """What :func:`_publish` does once the new files are in (each step may run twice)."""
    shutil.rmtree(aside, ignore_errors=True)      # the files the new ones replaced
    stale = _remove_stale(out_dir, before, written, kept)
    failed_log = out_dir / "dipoorlet.failed.log"
    if failed_log.is_file() and not failed_log.is_symlink():
        failed_log.unlink()   # the log of a failed run whose predecessors' outputs these replace
    if stale:
        log.info("removed %d files an earlier run wrote into %s and this one did not (%s)", len(stale),
                 out_dir, ", ".join(sorted(stale)[:6]) + (" ..." if len(stale) > 6 else ""))
    try:
        write_json(manifest, {"files": sorted(written)})
    except OSError as exc:     # the outputs are in place; only the next run's clean-up needs the list
        log.warning("could not write %s (%s): a later run into this folder will not remove these files",
                    manifest, exc.strerror or exc)


@contextlib.contextmanager
def _signals_held():
    """SIGINT/SIGTERM wait until the block is done (the moves into -O take milliseconds; an
    interrupt between them would leave -O half old, half new). Python-level: onnxruntime's and the
    histogram worker's threads would take a signal blocked in this thread alone; a held signal is
    raised again afterwards, to the handler that was there."""
    import signal

    from dipoorlet.threads import note_signals, put_back

    held = note_signals()
    if held is None:
        yield
        return
    pending, saved = held
    try:
        yield
    finally:
        put_back(saved)
        for sig in pending[:1]:
            signal.raise_signal(sig)


def _folders_between(out_dir: Path, dst: Path) -> list[Path]:
    """The folders from -O down to ``dst``'s, -O itself excluded (output/, output/<name>/)."""
    rel = dst.relative_to(out_dir)
    return [out_dir.joinpath(*rel.parts[:i]) for i in range(1, len(rel.parts))]


def _move_all(moves, out_dir: Path, aside: Path, moved_aside: list, moved_in: list, made: list) -> None:
    """The earlier files aside, the new ones in; on any failure (an interrupt included) every
    move is undone and the error raised again (an OSError as one line)."""
    try:
        for _, dst in moves:
            if os.path.lexists(dst):
                held = aside / dst.relative_to(out_dir)
                held.parent.mkdir(parents=True, exist_ok=True)
                os.replace(dst, held)
                moved_aside.append((held, dst))
        for src, dst in moves:
            for parent in _folders_between(out_dir, dst):
                if not parent.exists():
                    parent.mkdir()
                    made.append(parent)
            os.replace(src, dst)
            moved_in.append((src, dst))
    except BaseException as exc:
        for src, dst in reversed(moved_in):
            try:
                os.replace(dst, src)
            except OSError:
                pass
        for folder in reversed(made):        # folders this run created (--savefp's output/...)
            try:
                folder.rmdir()
            except OSError:
                pass
        for held, dst in reversed(moved_aside):
            try:
                os.replace(held, dst)
            except OSError:
                log.error("could not put back %s (kept in %s)", dst, held)
        if not isinstance(exc, OSError):
            raise
        import errno

        # the advice fits the cause: a permission error had been told to free space (found by a bug hunt)
        fix = ("make it writable (or remove it) or choose another -O"
               if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else
               # a folder in -O that links to another file system (-O/output): files cannot be
               # renamed across (found by a hunt: it had advised freeing space)
               f"something in {out_dir} lies on another file system (a linked folder, a mount), and files are "
               "moved into place, not copied: make it a plain folder, or choose another -O"
               if exc.errno == errno.EXDEV else "free space there or choose another -O")
        raise OutputError(f"could not write {exc.filename or out_dir} ({exc.strerror or exc}); "
                          f"the earlier files in {out_dir} are as they were; {fix}") from exc


def _remove_stale(out_dir: Path, listed: list, written: set, kept: set) -> list[str]:
    """Remove the files of ``listed`` (an earlier run's manifest) that this run did not write;
    returns their normalized names. See :func:`_publish` for what is never touched."""
    import posixpath

    stale = []
    for rel in listed:
        if not isinstance(rel, str):
            continue
        norm = posixpath.normpath(rel.replace("\\", "/"))
        parts = norm.split("/")
        if posixpath.isabs(norm) or norm in (".", "") or ".." in parts or norm in written:
            continue
        chain = [out_dir.joinpath(*parts[:k]) for k in range(1, len(parts) + 1)]
        if any(p.is_symlink() for p in chain) or not chain[-1].is_file():
            continue
        real = chain[-1].resolve()
        if real in kept or any(k in real.parents for k in kept):
            continue
        try:
            chain[-1].unlink()
            stale.append(norm)
            for parent in reversed(chain[:-1]):   # folders the removal emptied
                if any(parent.iterdir()):
                    break
                parent.rmdir()
        except OSError as exc:   # the outputs are written: a file that will not go is only reported
            log.warning("could not remove %s, an earlier run's output (%s)", chain[-1], exc)
    return stale
