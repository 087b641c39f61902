"""Platform specs: every rule a backend imposes, as data (``platforms/<name>.toml``).

A spec is validated when it is loaded; a missing or mistyped key raises a ConfigError naming the
key. ``-D NAME`` picks a shipped spec, ``-D path/to/chip.toml`` a user's own.
"""
from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dipoorlet.errors import ConfigError
from dipoorlet.util import did_you_mean


@dataclass(frozen=True)
class TensorRule:
    bits: int = 8
    symmetric: bool = True
    unsigned: bool = False
    per_channel: bool = False
    narrow_range: bool = False
    power_of_two: bool = False
    unsigned_nonnegative: bool = False
    # per-column grids on a batched (rank > 2) constant MatMul weight; onnxruntime's integer
    # MatMul kernels accept them on 2-D weights only
    per_channel_batched: bool = True
    # activations: the widest grid the chip runs (16 where it has 16-bit activations, e.g. QNN's
    # HTP: --a_bits 16 / --layer_bits NODE=a16); weights: always bits
    max_bits: int = 8


@dataclass(frozen=True)
class Platform:
    name: str
    description: str
    deploy: tuple[str, ...]
    activation: TensorRule
    weight: TensorRule
    quantize_network_output: bool
    quantize_bias: bool
    quantize_ops: frozenset[str]
    weight_inputs: dict[str, int] = field(default_factory=dict)
    residual_add_producers: frozenset[str] = frozenset()
    residual_add_float_before: frozenset[str] = frozenset()
    pad_into: frozenset[str] = frozenset()
    activation_producers: frozenset[str] = frozenset()
    fused_activations: frozenset[str] = frozenset()
    share_scale: frozenset[str] = frozenset()
    source: str = ""


_SCHEMA = {
    "name": str, "description": str, "deploy": list,
    "activation": dict, "weight": dict, "bias": dict, "ops": dict, "fusion": dict,
}
_RULE_KEYS = {"bits": int, "symmetric": bool, "unsigned": bool, "per_channel": bool,
              "narrow_range": bool, "power_of_two": bool, "unsigned_nonnegative": bool,
              "per_channel_batched": bool, "max_bits": int,
              "quantize_network_output": bool}
_OPS_KEYS = {"quantize": list, "weights": dict, "share_scale": list}
_FUSION_KEYS = {"residual_add_producers": list, "residual_add_float_before": list, "pad_into": list, "activation_producers": list,
                "activations": list}


# side-file formats that hold a 16-bit activation grid: AIMET encodings carry its bitwidth; the
# reference tool's clip files carry ranges only, which mean the same at any width
WIDE_FORMATS = frozenset({"snpe", "qnn", "reference"})


def platforms_dir() -> Path:
    """Installed wheels carry the specs as ``dipoorlet/platforms``; a source tree has ``platforms/``."""
    here = Path(__file__).resolve().parent
    for cand in (here / "platforms", here.parent / "platforms"):
        if cand.is_dir():
            return cand
    return Path(str(resources.files("dipoorlet.platforms")))


def available() -> list[str]:
    return sorted(p.stem for p in platforms_dir().glob("*.toml"))


# what users call the backends, for the suggestion when -D names none of them
_ALIASES = {"tensorrt": ["trt"], "nvidia": ["trt"], "onnxruntime": ["ort"], "rknn": ["rk", "rv"],
            "rockchip": ["rk", "rv"], "rv1126": ["rv"], "rk3588": ["rk"], "tidl": ["ti"], "ascend": ["atlas"],
            "huawei": ["atlas"], "amct": ["atlas"], "cambricon": ["magicmind"], "mlu": ["magicmind"],
            "qualcomm": ["snpe", "qnn"], "hexagon": ["snpe", "qnn"], "qairt": ["qnn"], "nxp": ["imx"],
            "eiq": ["imx"], "sensetime": ["stpu"]}


def load(name_or_path: str) -> Platform:
    path = Path(name_or_path)
    if path.is_dir() and not name_or_path.endswith(".toml") and name_or_path.lower() not in available():
        # a folder of specs: "unknown platform ...; did you mean atlas?" (found by a hunt); a
        # backend's name is the backend whatever folder of that name -O or the user made here
        specs = sorted(p.name for p in path.glob("*.toml"))
        raise ConfigError(f"-D {name_or_path} is a folder; pass one backend ({', '.join(available())}) or the path "
                          f"of one .toml spec" + (f", e.g. {path / specs[0]}" if specs else ""))
    if name_or_path.endswith(".toml"):
        if not path.is_file():
            raise ConfigError(f"platform spec {path} does not exist; pass -D with one of "
                              f"{', '.join(available())} or the path of a .toml spec")
    else:
        path = platforms_dir() / f"{name_or_path}.toml"
        if not path.is_file() and name_or_path.lower() in available():   # -D TRT
            path = platforms_dir() / f"{name_or_path.lower()}.toml"
        if not path.is_file():
            guess = did_you_mean(name_or_path, available(), _ALIASES)
            raise ConfigError(f"unknown platform -D {name_or_path!r}; "
                              + (f"did you mean {' or '.join(guess)}? " if guess else "")
                              + f"valid: {', '.join(available())} (or a path to your own .toml spec)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"platform spec {path} is not valid TOML ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"platform spec {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "save it as UTF-8") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read platform spec {path}: {exc.strerror or exc}") from exc
    return parse(data, str(path))


def _check_op_types(ops, where: str) -> None:
    """Every name must be an ONNX op type (a typo such as 'Matmul' would silently match nothing)."""
    import onnx.defs

    known = {sch.name for sch in onnx.defs.get_all_schemas_with_history()}
    bad = [o for o in ops if not isinstance(o, str) or o not in known]
    if bad:
        lower = {k.lower(): k for k in known}
        hints = [f"{b!r} (did you mean {lower[b.lower()]!r}?)" if isinstance(b, str) and b.lower() in lower
                 else repr(b) for b in bad]
        verb = "is not an ONNX op type" if len(bad) == 1 else "are not ONNX op types"
        raise ConfigError(f"platform spec {where}: {', '.join(hints)} {verb}; use the op type names of the "
                          f"ONNX spec, e.g. 'MatMul'")


def _need(d: dict, key: str, typ, where: str):
    if key not in d:
        raise ConfigError(f"platform spec {where}: missing key '{key}'; add it (the specs in platforms/*.toml "
                          f"show every key)")
    v = d[key]
    if typ is int and isinstance(v, bool) or not isinstance(v, typ):
        raise ConfigError(f"platform spec {where}: key '{key}' must be {typ.__name__}, got {v!r}")
    return v


def _rule(d: dict, where: str, defaults: dict) -> TensorRule:
    unknown = set(d) - set(_RULE_KEYS)
    if unknown:
        raise ConfigError(f"platform spec {where}: unknown key(s) {sorted(unknown)}; "
                          f"valid: {sorted(_RULE_KEYS)}")
    if "quantize_network_output" in d and not where.endswith("[activation]"):
        raise ConfigError(f"platform spec {where}: quantize_network_output belongs in [activation]")
    for key in ("per_channel", "per_channel_batched"):
        if key in d and where.endswith("[activation]"):
            raise ConfigError(f"platform spec {where}: {key} applies to weights only; "
                              "activations are quantized per tensor")
    if "max_bits" in d and not where.endswith("[activation]"):
        raise ConfigError(f"platform spec {where}: max_bits applies to activations only "
                          "(16-bit activation grids); weights are 2..8 bits")
    vals = {}
    for key, typ in _RULE_KEYS.items():
        if key == "quantize_network_output":
            if key in d:
                _need(d, key, bool, where)
            continue
        if key == "max_bits":
            continue
        vals[key] = _need(d, key, typ, where) if key in d or key not in defaults else defaults[key]
    act = where.endswith("[activation]")
    if not (2 <= vals["bits"] <= 8 or (act and vals["bits"] == 16)):
        raise ConfigError(f"platform spec {where}: bits must be 2..8{' or 16' if act else ''}, got {vals['bits']}")
    vals["max_bits"] = _need(d, "max_bits", int, where) if "max_bits" in d else max(vals["bits"], 8)
    if vals["max_bits"] not in (8, 16) or vals["max_bits"] < vals["bits"]:
        raise ConfigError(f"platform spec {where}: max_bits must be 8 or 16 and at least bits, "
                          f"got {vals['max_bits']}")
    if vals["unsigned"] and vals["symmetric"]:
        raise ConfigError(f"platform spec {where}: unsigned grids are asymmetric; set symmetric = false")
    if vals["unsigned_nonnegative"] and not vals["symmetric"]:
        raise ConfigError(f"platform spec {where}: unsigned_nonnegative applies to symmetric grids; "
                          "set symmetric = true or drop it")
    return TensorRule(**vals)


def parse(data: dict, source: str) -> Platform:
    for key, typ in _SCHEMA.items():
        _need(data, key, typ, source)
    unknown = set(data) - set(_SCHEMA)
    if unknown:
        raise ConfigError(f"platform spec {source}: unknown key(s) {sorted(unknown)}; valid: {sorted(_SCHEMA)}")
    defaults = {"unsigned": False, "per_channel": False, "narrow_range": False, "power_of_two": False,
                "unsigned_nonnegative": False, "per_channel_batched": True}
    act = _rule(data["activation"], source + " [activation]", defaults)
    wt = _rule(data["weight"], source + " [weight]", defaults)
    ops = data["ops"]
    _known(ops, _OPS_KEYS, source + " [ops]")
    quantize = _need(ops, "quantize", list, source + " [ops]")
    _check_op_types(quantize, source + " [ops] quantize")
    weights = ops.get("weights", {})
    if not isinstance(weights, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                for v in weights.values()):
        raise ConfigError(f"platform spec {source} [ops]: 'weights' must map op types to input indices")
    import onnx.defs

    _check_op_types(list(weights), source + " [ops] weights")
    for op, index in weights.items():
        if not onnx.defs.has(op, ""):
            raise ConfigError(f"platform spec {source} [ops]: weights {op}: not an op of the default ONNX domain, "
                              "which is all this tool quantizes; name ops such as Conv or MatMul")
        most = max(onnx.defs.get_schema(op, "").max_input, 0)
        if index >= most:
            raise ConfigError(f"platform spec {source} [ops]: weights {op} = {index}, but {op} has inputs 0.."
                              f"{most - 1}; give the index of its weight input (Conv's is 1)")
        if op in ("Conv", "ConvTranspose", "Gemm") and index == 2:
            raise ConfigError(f"platform spec {source} [ops]: weights {op} = 2 names its bias ([bias] quantize "
                              f"decides biases); give the index of its weight input, 1")
    if "share_scale" in ops:
        _check_op_types(ops["share_scale"], source + " [ops] share_scale")
    fusion = data["fusion"]
    _known(fusion, _FUSION_KEYS, source + " [fusion]")
    for key, names in fusion.items():      # a typo ('ReLU') silently moved Q/DQ
        _check_op_types(names, f"{source} [fusion] {key}")
    _known(data["bias"], {"quantize": bool}, source + " [bias]")
    from dipoorlet.deploy import FORMATS
    for fmt in data["deploy"]:
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise ConfigError(f"platform spec {source}: deploy format {fmt!r} unknown; valid: {sorted(FORMATS)}")
    narrow = sorted(set(data["deploy"]) - WIDE_FORMATS)
    if act.max_bits > 8 and narrow:
        raise ConfigError(f"platform spec {source}: deploy format {narrow[0]!r} holds 8-bit activation ranges "
                          f"only, but [activation] allows {act.max_bits} bits; set bits and max_bits to 8 or "
                          f"deploy with {', '.join(sorted(WIDE_FORMATS))}")
    return Platform(
        name=data["name"], description=data["description"], deploy=tuple(data["deploy"]),
        activation=act, weight=wt,
        quantize_network_output=bool(data["activation"].get("quantize_network_output", False)),
        quantize_bias=bool(_need(data["bias"], "quantize", bool, source + " [bias]")),
        quantize_ops=frozenset(quantize), weight_inputs=dict(weights),
        residual_add_producers=frozenset(fusion.get("residual_add_producers", [])),
        residual_add_float_before=frozenset(fusion.get("residual_add_float_before", [])),
        pad_into=frozenset(fusion.get("pad_into", [])),
        activation_producers=frozenset(fusion.get("activation_producers", [])),
        fused_activations=frozenset(fusion.get("activations", [])),
        share_scale=frozenset(ops.get("share_scale", [])), source=source,
    )


def _known(d: dict, keys: dict, where: str) -> None:
    unknown = set(d) - set(keys)
    if unknown:
        raise ConfigError(f"platform spec {where}: unknown key(s) {sorted(unknown)}; valid: {sorted(keys)}")
    for key, typ in keys.items():
        if key in d and not isinstance(d[key], typ):
            raise ConfigError(f"platform spec {where}: key '{key}' must be {typ.__name__}, got {d[key]!r}")
        if key in d and typ is list and not all(isinstance(x, str) for x in d[key]):
            raise ConfigError(f"platform spec {where}: key '{key}' must be a list of op type names")
