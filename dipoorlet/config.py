"""Run configuration: one frozen dataclass, validated on creation."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dipoorlet.errors import ConfigError
from dipoorlet.ranges import RANGE_METHODS


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
    stpu_wg: bool = False
    device: str = "cpu"
    debug: bool = False

    def __post_init__(self):
        object.__setattr__(self, "model", Path(self.model))
        object.__setattr__(self, "input_dir", Path(self.input_dir))
        out = Path(self.output_dir) if self.output_dir else self.model.parent / "results"
        object.__setattr__(self, "output_dir", out)
        object.__setattr__(self, "skip_layers", tuple(self.skip_layers or ()))
        if self.act_quant not in RANGE_METHODS:
            raise ConfigError(f"unknown -A {self.act_quant!r}; valid: {', '.join(sorted(RANGE_METHODS))}")
        if not isinstance(self.data_num, int) or self.data_num < 1:
            raise ConfigError(f"-N must be a positive number of samples, got {self.data_num!r}")
        if not isinstance(self.bins, int) or self.bins < 16:
            raise ConfigError(f"--bins must be an integer >= 16, got {self.bins!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"--threshold is a mass fraction in (0, 1], got {self.threshold}; e.g. 0.99999")
        if not 50.0 < self.percentile <= 100.0:
            raise ConfigError(f"--percentile must be in (50, 100], got {self.percentile}; e.g. 99.999")
        if self.quant_format not in ("QDQ", "QOP"):
            raise ConfigError(f"--quant_format must be QDQ or QOP, got {self.quant_format!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
