"""Run configuration: one frozen dataclass, validated on creation."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields as dataclass_fields
from pathlib import Path

import numpy as np

from dipoorlet.errors import ConfigError
from dipoorlet.ranges import RANGE_METHODS
from dipoorlet.util import did_you_mean


def parse_layer_bits(items) -> dict:
    """``["conv1=w4a8", "fc=w4"]`` -> {"conv1": (4, 8), "fc": (4, None)}."""
    out = {}
    for item in items:
        node, sep, spec = str(item).rpartition("=")
        m = re.fullmatch(r"(?:w(\d+))?(?:a(\d+))?", spec.lower())
        if not sep or not node or not m or not spec:
            raise ConfigError(f"--layer_bits {item!r} is not NODE=wNaM; write e.g. conv1=w4a8 or fc=w4")
        got = (int(m.group(1)) if m.group(1) else None, int(m.group(2)) if m.group(2) else None)
        if node in out:     # conv1=w4 conv1=a16 add up; two different widths for one grid do not
            had = out[node]
            clash = [k for k, a, b in (("w", had[0], got[0]), ("a", had[1], got[1]))
                     if a is not None and b is not None and a != b]
            if clash:
                raise ConfigError(f"--layer_bits gives {node} two {clash[0]} widths ({clash[0]}{had[0 if clash[0] == 'w' else 1]} "
                                  f"and {clash[0]}{got[0 if clash[0] == 'w' else 1]}); keep one")
            got = tuple(h if n is None else n for h, n in zip(had, got))
        out[node] = got
    return out


# the Python API's keywords by the CLI's long flag names, where the field is named otherwise
FLAG_FIELDS = {"eq_samples": "equalize_samples", "input_shape": "input_shapes", "custom_op_lib": "custom_op_libs"}
NEGATED_FLAGS = {"no_equalize": "equalize", "no_shift": "shift", "no_bc": "bias_correction"}
MAX_BINS = 16384   # --bins: see QuantConfig's check


def config_from_kwargs(**kwargs) -> "QuantConfig":
    """QuantConfig from the Python API's keywords: its field names, or the CLI's long flag names
    (``eq_samples=4``, ``input_shape=["x:1,3,224,224"]``, ``no_bc=True``, ``bc=True``); an unknown
    keyword is a ConfigError that names the closest ones."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(QuantConfig)} - {"given"}
    out, given = {}, {}

    def put(field_name, value, key):
        if field_name in given:
            raise ConfigError(f"dipoorlet.quantize() got both {given[field_name]!r} and {key!r}, which set the "
                              f"same thing ({field_name}); give one")
        given[field_name] = key
        out[field_name] = value

    for key, value in kwargs.items():
        if key in fields:
            put(key, value, key)
        elif key in FLAG_FIELDS:
            put(FLAG_FIELDS[key], value, key)
        elif key in NEGATED_FLAGS:
            if value:
                put(NEGATED_FLAGS[key], False, key)
        elif key == "bc":
            if value:
                put("bias_correction", True, key)
        else:
            names = sorted(fields | set(FLAG_FIELDS) | set(NEGATED_FLAGS) | {"bc"})
            guess = did_you_mean(key, names, {})
            raise ConfigError(f"dipoorlet.quantize() got an unknown keyword {key!r}"
                              + (f"; did you mean {' or '.join(guess)}?" if guess else "")
                              + " (the fields of dipoorlet.config.QuantConfig, or the CLI's long flag names but --log_all_ranks"
                              " and the reference tool's --we, --ada_epoch and --update_bn)")
    return QuantConfig(**out, given=frozenset(given))


def given_fields(dests) -> frozenset:
    """QuantConfig's field names for the CLI's flag destinations (``eq_samples``, ``no_bc``, ``bc``...)."""
    names = {f.name for f in dataclass_fields(QuantConfig)}
    out = set()
    for dest in dests:
        name = FLAG_FIELDS.get(dest) or NEGATED_FLAGS.get(dest) or ("bias_correction" if dest == "bc" else dest)
        if name in names:
            out.add(name)
    return frozenset(out)


def _path_hint(flag: str, value) -> str:
    """What to do instead of passing ``value`` where a path goes, on one line."""
    kind = type(value).__name__
    if kind == "ModelProto":
        return "; save the ModelProto with onnx.save and pass its path"
    if flag in ("-I", "--val_dir") and (kind == "ndarray" or isinstance(value, dict)):
        # an array's repr ran over several lines, cut off mid-array (found by a hunt)
        return ("; save the samples with numpy.savez(path, **{input_name: array_of_N_samples}) "
                "and pass the .npz path")
    return " " + " ".join(repr(value).split())[:60]


@dataclass(frozen=True)
class QuantConfig:
    model: Path
    input_dir: Path
    data_num: int
    deploy: str = "trt"
    output_dir: Path | None = None
    act_quant: str = "mse"
    bins: int = 2048
    threshold: float = 0.99999
    percentile: float = 99.999
    skip_layers: tuple[str, ...] = ()
    input_shapes: dict = field(default_factory=dict)
    savefp: bool = False
    skip_prof_layer: bool = False
    trt_version: str = "8601"
    quant_format: str = "QDQ"
    sens_samples: int = 8
    prof_samples: int | None = None    # --prof_samples; None: N up to PROFILE_SAMPLES (all N with --savefp)
    val_dir: Path | None = None        # --val_dir: held-out samples the error profile reads instead
    val_num: int | None = None         # --val_num; None: all of --val_dir's samples up to PROFILE_SAMPLES
    criterion: str = "cosine"
    auto_skip: str | None = None
    max_float_layers: int = 10
    auto_a16: str | None = None         # raise sensitive layers' inputs to 16 bits until the target
    max_a16_layers: int | None = None   # None: as many as the target needs
    auto_w8: str | None = None          # raise sensitive layers' narrow weights to 8 bits until the target
    max_w8_layers: int | None = None    # None: as many as the target needs
    fail_below: str | float | None = None   # --fail_below: a mean cosine (0.99, cosine:0.99) or sqnr:DB
    score_outputs: tuple[str, ...] = ()   # --score_outputs: the outputs targets and --fail_below judge (default: all but integer outputs)
    w_bits: int | None = None          # override the platform's weight bits
    a_bits: int | None = None          # override the platform's activation bits
    layer_bits: dict = field(default_factory=dict)  # node -> (weight bits | None, act bits | None)
    stpu_wg: bool = False
    bias_correction: bool | None = None  # --bc / --no_bc; None: the default, bias_correction_on()
    bc_samples: int | None = None      # --bc_samples; None: N up to BC_SAMPLES
    gptq: bool = False                 # --gptq: output-aware weight rounding (reconstruct.py)
    adaround: bool = False             # --adaround: AdaRound on the same statistics (adaround.py)
    ada_iters: int = 1000              # --ada_iters: AdaRound's optimization steps per layer (per block)
    brecq: bool = False                # --brecq: block reconstruction of the rounding, in torch (brecq.py)
    drop: bool = False                 # --drop: QDrop during --brecq
    lsq: bool = False                  # --lsq: activation scales learned during --brecq (LSQ)
    ada_bs: int | None = None          # --ada_bs: --brecq's samples per optimization step (default 16)
    sparse: object = None              # --sparse N:M or RATE: pruned as rounded (SparseGPT); parsed to (n, m) or a float
    gptq_samples: int | None = None    # --gptq_samples; None: N, at most 256
    gptq_memory: float = 256.0         # --gptq_memory MB: statistics held at once (more passes beyond)
    equalize: bool = True              # --no_equalize turns activation equalization off
    equalize_samples: int | None = None  # --eq_samples; None: equalize.default_samples(N)
    shift: bool = True                 # --no_shift: no asymmetric-grid shift on symmetric backends
    device: str = "cpu"
    recon_device: str | None = None    # --recon_device: torch's device for --brecq/--drop/--lsq (None: cpu)
    custom_op_libs: tuple = ()         # --custom_op_lib: onnxruntime custom-op libraries (.so/.dll)
    debug: bool = False
    # the fields set on purpose (CLI flags on the command line, the API's keywords), so a flag given at
    # its default value is still told apart from one left out (``-D qnn --trt_version 8601`` was not
    # warned as ignored); not part of the settings compared across MPI ranks
    given: frozenset = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self):
        # an empty path (an unset shell variable: -O "$OUT") would be "." or the default folder
        wanted = {"-M": (self.model, "the model file"), "-I": (self.input_dir, "the calibration data folder"),
                  "-O": (self.output_dir, "an output folder, or leave -O out for <model dir>/results"),
                  "--val_dir": (self.val_dir, "the held-out data folder, or leave --val_dir out")}
        for flag, (value, what) in wanted.items():
            if isinstance(value, str) and not value.strip():
                raise ConfigError(f"{flag} is an empty path; give {what}")
            if not (isinstance(value, (str, os.PathLike)) or value is None and flag in ("-O", "--val_dir")):
                raise ConfigError(f"{flag} must be a path (str or pathlib.Path), got {type(value).__name__}"
                                  + _path_hint(flag, value))
        for name in ("skip_layers", "score_outputs", "custom_op_libs", "layer_bits", "input_shapes"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike, list, tuple, dict, set, frozenset)):
                raise ConfigError(f"{name} must be a name or a list of them, got {type(value).__name__} {value!r}")
        if not isinstance(self.act_quant, str):
            raise ConfigError(f"-A must be a method name, got {self.act_quant!r}; one of {', '.join(sorted(RANGE_METHODS))}")
        if not isinstance(self.deploy, (str, os.PathLike)):
            from dipoorlet.platform import available

            raise ConfigError(f"-D must be a backend name or the path of a .toml spec, got {self.deploy!r}; one of "
                              f"{', '.join(available())}")
        object.__setattr__(self, "model", Path(self.model))
        object.__setattr__(self, "input_dir", Path(self.input_dir))
        out = Path(self.output_dir) if self.output_dir else self.model.parent / "results"
        object.__setattr__(self, "output_dir", out)
        for name in ("skip_layers", "score_outputs", "custom_op_libs"):   # a single name is one name
            value = getattr(self, name) or ()
            # a set in name order: its iteration order follows each process's hash seed, and MPI
            # ranks given the same set had been refused as given different settings (a review)
            object.__setattr__(self, name, (value,) if isinstance(value, (str, Path)) else
                               tuple(sorted(value, key=str)) if isinstance(value, (set, frozenset)) else tuple(value))
        if self.layer_bits is None:                                 # the API's "none given"
            object.__setattr__(self, "layer_bits", {})
        if isinstance(self.layer_bits, (str, list, tuple)):        # the CLI's form: "conv1=w4a8", ...
            items = [self.layer_bits] if isinstance(self.layer_bits, str) else self.layer_bits
            object.__setattr__(self, "layer_bits", parse_layer_bits(items))
        elif isinstance(self.layer_bits, dict) and any(isinstance(v, str) for v in self.layer_bits.values()):
            object.__setattr__(self, "layer_bits", {**self.layer_bits, **parse_layer_bits(
                f"{k}={v}" for k, v in self.layer_bits.items() if isinstance(v, str))})
        for node, bits in self.layer_bits.items():
            if not (isinstance(bits, (tuple, list)) and len(bits) == 2):
                raise ConfigError(f"--layer_bits {node}: expected 'wNaM' or (weight bits, activation bits) with "
                                  f"None for either, got {bits!r}")
        if self.input_shapes is None:
            object.__setattr__(self, "input_shapes", {})
        if isinstance(self.input_shapes, (str, list, tuple)):      # the CLI's form: "x:1,3,224,224", ...
            from dipoorlet.data import parse_input_shapes

            items = [self.input_shapes] if isinstance(self.input_shapes, str) else list(self.input_shapes)
            object.__setattr__(self, "input_shapes", parse_input_shapes(items))
        if isinstance(self.act_quant, str) and self.act_quant.lower() in RANGE_METHODS:
            object.__setattr__(self, "act_quant", self.act_quant.lower())     # -A MSE
        if self.act_quant not in RANGE_METHODS:
            # other tools' names for the same methods (onnxruntime's CalibrationMethod, TensorRT's calibrators)
            other = {"kl": ["entropy"], "kld": ["entropy"], "max": ["minmax"], "octav": ["mse"],
                     "histogram": ["hist"], "entropy2": ["entropy"], "percent": ["percentile"]}
            guess = did_you_mean(self.act_quant, RANGE_METHODS, other)[:1]
            raise ConfigError(f"unknown -A {self.act_quant!r}; " + (f"did you mean {guess[0]}? " if guess else "")
                              + f"valid: {', '.join(sorted(RANGE_METHODS))}")
        if not isinstance(self.data_num, int) or isinstance(self.data_num, bool) or self.data_num < 1:
            raise ConfigError(f"-N must be a positive number of samples, got {self.data_num!r}")
        # the mse search holds a table of ~bins/8 candidate clips by ~bins/5 columns (100000 bins took
        # 4.3 GB on a one-Conv model, a million asked for 202 GiB)
        if not isinstance(self.bins, int) or not 16 <= self.bins <= MAX_BINS:
            raise ConfigError(f"--bins must be an integer from 16 to {MAX_BINS}, got {self.bins!r}; "
                              f"the default 2048 suits 8-bit grids")
        number = lambda v: isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
        if not number(self.threshold) or not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"--threshold is a mass fraction in (0, 1], got {self.threshold!r}; e.g. 0.99999")
        if not number(self.percentile) or not 50.0 < self.percentile <= 100.0:
            raise ConfigError(f"--percentile must be in (50, 100], got {self.percentile!r}; e.g. 99.999")
        if not isinstance(self.sens_samples, int) or self.sens_samples < 1:
            raise ConfigError(f"--sens_samples must be a positive integer, got {self.sens_samples!r}")
        _optional_count(self.prof_samples, "--prof_samples")
        if self.val_dir is not None:
            object.__setattr__(self, "val_dir", Path(self.val_dir))
        _optional_count(self.val_num, "--val_num")
        if self.val_num is not None and self.val_dir is None:
            raise ConfigError("--val_num counts --val_dir's samples; pass --val_dir DIR with it")
        if self.val_dir is not None and self.prof_samples is not None:
            raise ConfigError("--prof_samples counts the calibration samples the profile reads; with --val_dir "
                              "it reads --val_num held-out samples instead: drop --prof_samples")
        if self.savefp and self.prof_samples is not None:
            raise ConfigError("--prof_samples with --savefp: --savefp saves the float outputs of all N samples, so "
                              "the profile reads all N; drop one of the two")
        if self.val_dir is not None and self.savefp:
            raise ConfigError("--savefp saves the float outputs of the calibration samples, which the profile "
                              "does not read with --val_dir; run --savefp without --val_dir")
        if self.criterion not in ("cosine", "sqnr", "maxabs"):
            raise ConfigError(f"--criterion must be cosine, sqnr or maxabs, got {self.criterion!r}")
        _optional_count(self.equalize_samples, "--eq_samples")
        for flag in ("savefp", "skip_prof_layer", "stpu_wg", "gptq", "adaround", "brecq", "drop", "lsq", "equalize",
                     "shift",
                     "debug"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        _optional_count(self.gptq_samples, "--gptq_samples")
        if (isinstance(self.gptq_memory, bool) or not isinstance(self.gptq_memory, (int, float))
                or not self.gptq_memory > 0 or self.gptq_memory == float("inf")):
            raise ConfigError(f"--gptq_memory must be a positive number of MB, got {self.gptq_memory!r}")
        if isinstance(self.ada_iters, bool) or not isinstance(self.ada_iters, int) or self.ada_iters < 1:
            raise ConfigError(f"--ada_iters must be a positive integer, got {self.ada_iters!r}")
        if self.sparse is not None:
            object.__setattr__(self, "sparse", parse_sparse(self.sparse))
            if self.adaround:
                raise ConfigError("--sparse with --adaround: pruning is decided with GPTQ's rounding (SparseGPT); "
                                  "drop --adaround (--sparse implies --gptq)")
        _optional_count(self.ada_bs, "--ada_bs")
        if (self.drop or self.lsq) and not self.brecq:
            object.__setattr__(self, "brecq", True)
        if self.brecq and (self.gptq or self.adaround or self.sparse is not None):
            raise ConfigError("--brecq/--drop/--lsq with --gptq/--adaround/--sparse: each chooses the weights' rounding; "
                              "use one (--brecq fits blocks of layers in torch, --adaround and --gptq single layers "
                              "from statistics)")
        if self.gptq and self.adaround:
            raise ConfigError("--gptq and --adaround both choose the weights' rounding from the same statistics; "
                              "use one (--adaround optimizes it by gradient descent, --gptq greedily)")
        if not isinstance(self.max_float_layers, int) or self.max_float_layers < 1:
            raise ConfigError(f"--max_float_layers must be a positive integer, got {self.max_float_layers!r}")
        if self.auto_skip is not None:
            from dipoorlet.sensitivity import parse_target
            parse_target(self.auto_skip)
        if self.max_a16_layers is not None and (not isinstance(self.max_a16_layers, int) or self.max_a16_layers < 1):
            raise ConfigError(f"--max_a16_layers must be a positive integer, got {self.max_a16_layers!r}")
        if self.auto_a16 is not None:
            from dipoorlet.sensitivity import parse_target
            parse_target(self.auto_a16, flag="--auto_a16")
            if self.auto_skip is not None:
                raise ConfigError("--auto_skip and --auto_a16 both choose layers to treat apart; "
                                  "use one (--layer_bits NODE=a16 and --skip_layers set layers by hand)")
            if self.gptq or self.adaround or self.sparse is not None or self.bias_correction or self.brecq:
                raise ConfigError("--auto_a16 with --gptq/--adaround/--brecq/--drop/--lsq/--sparse/--bc: those fit the "
                                  "weights (--lsq the activation scales too) to the 8-bit inputs before the search; run "
                                  "--auto_a16 first, then again with --layer_bits NODE=a16 for the layers it chose "
                                  "(report.json: auto_a16.a16_layers) and the fit")
        _optional_count(self.max_w8_layers, "--max_w8_layers")
        if self.auto_w8 is not None:
            from dipoorlet.sensitivity import parse_target
            parse_target(self.auto_w8, flag="--auto_w8")
            if self.auto_skip is not None or self.auto_a16 is not None:
                raise ConfigError("--auto_w8 with --auto_skip/--auto_a16: each search chooses layers to treat apart; "
                                  "use one (--layer_bits NODE=w8, NODE=a16 and --skip_layers set layers by hand)")
            if self.sparse is not None or self.bias_correction:
                raise ConfigError("--auto_w8 with --sparse/--bc: those fit the weights to their narrow grids before "
                                  "the search; run --auto_w8 first, then again with --layer_bits NODE=w8 for the layers "
                                  "it chose (report.json: auto_w8.w8_layers) and --sparse/--bc (--gptq and --adaround "
                                  "combine with --auto_w8: they are fitted after the search)")
        if self.fail_below is not None:
            from dipoorlet.sensitivity import parse_target
            parse_target(self.fail_below, flag="--fail_below", any_cosine=True)
        if self.w_bits is not None and not (isinstance(self.w_bits, int) and 2 <= self.w_bits <= 8):
            raise ConfigError(f"--w_bits must be an integer in 2..8, got {self.w_bits!r}")
        if self.a_bits is not None and not (isinstance(self.a_bits, int) and (2 <= self.a_bits <= 8 or self.a_bits == 16)):
            raise ConfigError(f"--a_bits must be an integer in 2..8, or 16 on a backend with 16-bit activations, "
                              f"got {self.a_bits!r}")
        for node, (wb, ab) in self.layer_bits.items():
            if wb is not None and not 2 <= wb <= 8:
                raise ConfigError(f"--layer_bits {node}: weight bits must be in 2..8, got w{wb}")
            if ab is not None and not (2 <= ab <= 8 or ab == 16):
                raise ConfigError(f"--layer_bits {node}: activation bits must be in 2..8 or 16, got a{ab}")
        if self.bias_correction is not None and not isinstance(self.bias_correction, bool):
            raise ConfigError(f"bias_correction (--bc/--no_bc) must be True, False or None (the default), "
                              f"got {self.bias_correction!r}")
        if not isinstance(self.equalize, bool):
            raise ConfigError(f"equalize (--no_equalize) must be True or False, got {self.equalize!r}")
        _optional_count(self.bc_samples, "--bc_samples")
        if isinstance(self.trt_version, int) and not isinstance(self.trt_version, bool) and self.trt_version >= 0:
            object.__setattr__(self, "trt_version", str(self.trt_version))
        if not (isinstance(self.trt_version, str) and re.fullmatch(r"[0-9]+", self.trt_version)):
            raise ConfigError(f"--trt_version is TensorRT's version as ASCII digits (8601 for 8.6.1), "
                              f"got {self.trt_version!r}")
        if self.quant_format not in ("QDQ", "QOP"):
            raise ConfigError(f"--quant_format must be QDQ or QOP, got {self.quant_format!r}")
        libs = (self.custom_op_libs,) if isinstance(self.custom_op_libs, (str, os.PathLike)) else self.custom_op_libs
        if any(isinstance(x, str) and not x.strip() for x in libs):    # (abspath would make it the working folder)
            raise ConfigError("--custom_op_lib is an empty path; give the path of the onnxruntime custom-op library "
                              "(.so/.dll/.dylib), or leave the flag out")
        # absolute: onnxruntime's loader searches the library path, not the working folder, for a bare name
        # once each: a library named twice (a wrapper's default plus the user's) registers its ops
        # twice, which onnxruntime refuses ("Domain already set in registry")
        object.__setattr__(self, "custom_op_libs", tuple(dict.fromkeys(os.path.abspath(str(x)) for x in libs)))
        for lib in self.custom_op_libs:
            if not os.path.isfile(lib):
                raise ConfigError(f"--custom_op_lib {lib} is not a file; pass the path of the onnxruntime custom-op "
                                  f"library (.so/.dll/.dylib), e.g. onnxruntime_extensions.get_library_path()")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.recon_device is not None and not (isinstance(self.recon_device, str) and re.fullmatch(
                r"cpu|cuda(:[0-9]+)?", self.recon_device)):
            raise ConfigError(f"--recon_device must be cpu, cuda or cuda:N (a GPU's index), got {self.recon_device!r}")

    def bias_correction_on(self) -> bool:
        """--bc / --no_bc, or the default. On by default: it lowers the error on
        nearly every model measured (README, Weight transforms). Not where the rounding is fitted
        (on the classifier, detector and recognizer --gptq lost with it), nor before a search that
        re-plans the weights. Power-of-two grids (imx) too since session 22: with -A mse's steps
        rounded up and no equalization it had cost imx's VAD 9 points and its PP-OCRv5 detector
        0.56 mask IoU; with both changed it gains on five of eight models there, is flat on one
        and lowers the VAD and MiniLM."""
        if self.bias_correction is not None:
            return self.bias_correction
        fitted = self.gptq or self.adaround or self.brecq or self.sparse is not None
        return not (fitted or self.auto_a16 is not None or self.auto_w8 is not None)


def _optional_count(value, flag: str) -> None:
    """None, or a positive integer (not a bool); else the one-line error naming ``flag``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{flag} must be a positive integer, got {value!r}")


def parse_sparse(value):
    """--sparse: ``N:M`` (at most N non-zero weights in every M consecutive input channels, e.g.
    2:4 for TensorRT's sparse kernels) -> (n, m); a share of zero weights in (0, 1) -> float."""
    if isinstance(value, tuple) and len(value) == 2:
        n, m = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if not 0.0 < float(value) < 1.0:
            raise ConfigError(f"--sparse RATE is the share of zero weights, in (0, 1); got {value!r}")
        return float(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*\d+\s*:\s*\d+\s*", value):
        n, m = (int(v) for v in value.split(":"))
    elif isinstance(value, str):
        try:
            return parse_sparse(float(value))
        except ValueError:
            raise ConfigError(f"--sparse takes N:M (e.g. 2:4) or a share of zero weights (e.g. 0.5); got {value!r}") from None
    else:
        raise ConfigError(f"--sparse takes N:M (e.g. 2:4) or a share of zero weights (e.g. 0.5); got {value!r}")
    if not (isinstance(n, int) and isinstance(m, int) and 0 < n < m <= 32):
        raise ConfigError(f"--sparse N:M keeps N of every M weights, 0 < N < M <= 32; got {n}:{m}")
    return (n, m)
