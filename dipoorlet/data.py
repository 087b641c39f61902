"""Calibration data: readers for the reference layout, .npy and .npz, and sharding.

Layouts (``-I PATH``):

- ``PATH/<input_name>/<i>.bin``: raw little-endian data of the input's dtype (float32 for float
  inputs), one sample per file, i = 0..N-1 — the reference tool's layout.
- ``PATH/<input_name>/<i>.npy``: one array per sample; its own shape, so samples may differ in
  size (images of different sizes for a detector, sentences of different lengths).
- ``PATH`` is an ``.npz`` file (or a folder holding exactly one) with one ``[N, ...]`` array per
  input; sample i is ``array[i]`` (with a batch axis of 1 added back when the model has one).

A sample's shape must match the model's static dimensions; dynamic ones take the file's shape
(``.npy``), ``--input_shape name:1,3,224,224``, or, for ``.bin``, the single unknown dimension the
file size determines. Float data must be finite; integer inputs (token ids) keep their dtype.
Only the shard of sample indices a process is given is ever read.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import helper

from dipoorlet.errors import DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    shape: tuple  # ints, None for dynamic dims; () a scalar; None (the field) when the rank is unknown
    file_dtype: np.dtype | None = None   # raw .bin files hold this dtype (default: dtype)
    mask: bool = False     # an additive attention mask: -inf marks a position left out (mask_inputs)

    @property
    def raw_dtype(self) -> np.dtype:
        return self.file_dtype if self.file_dtype is not None else self.dtype


def input_specs(graph) -> list[InputSpec]:
    specs = []
    masks = mask_inputs(graph)
    for vi in graph.graph_inputs:
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else np.dtype(np.float32)
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                      for d in tt.shape.dim) if tt.HasField("shape") else None
        specs.append(InputSpec(vi.name, dtype, shape, graph.file_dtypes.get(vi.name), mask=vi.name in masks))
    return specs


def mask_inputs(graph) -> set[str]:
    """Float inputs that only ever reach Softmax inputs, through the ops an attention mask passes
    (calibrate.MASK_OPS): additive masks, in which -inf marks a position left out (transformers'
    exports with a float mask input take it as such; -inf had been refused as bad data)."""
    from dipoorlet.calibrate import MASK_OPS

    found = set()
    if not hasattr(graph, "consumers"):
        return found
    for vi in graph.graph_inputs:
        if not graph.is_float(vi.name):
            continue
        seen, todo, softmax, other = {vi.name}, [vi.name], False, False
        while todo and not other:
            t = todo.pop()
            for n in graph.consumers.get(t, []):
                if n.op_type == "Softmax" and n.input and n.input[0] == t:
                    softmax = True
                elif n.op_type in MASK_OPS:
                    todo += [o for o in n.output if o and o not in seen and not seen.add(o)]
                else:
                    other = True
                    break
        if softmax and not other and not (seen & set(graph.output_names)):
            found.add(vi.name)
    return found


def shard(n: int, rank: int, world: int) -> range:
    """Contiguous block of sample indices for ``rank``; every index lands on exactly one rank."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def spread(k: int, n: int, rank: int, world: int) -> list[int]:
    """``rank``'s share of ``k`` sample indices spread evenly over ``0..n-1`` (all of them when
    k >= n): a subset that does not hang on the order of the files (sorted by class, by video)."""
    picked = [i * n // k for i in range(k)] if k < n else list(range(n))
    return [picked[j] for j in shard(len(picked), rank, world)]


def parse_input_shapes(items) -> dict[str, tuple]:
    """``["x:1,3,224,224", ...]`` -> {"x": (1, 3, 224, 224)}."""
    from dipoorlet.errors import ConfigError

    shapes = {}
    for item in items or []:
        name, sep, dims = item.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise ConfigError(f"--input_shape {item!r} is not NAME:D1,D2,...; "
                              "write e.g. --input_shape x:1,3,224,224") from None
        if any(d <= 0 for d in shape):
            raise ConfigError(f"--input_shape {item!r}: every dimension must be a positive integer; "
                              "write e.g. --input_shape x:1,3,224,224")
        if name in shapes:
            raise ConfigError(f"--input_shape names {name!r} twice ({_fmt(shapes[name])} and {_fmt(shape)}); "
                              "give each input once")
        shapes[name] = shape
    return shapes


class Sample(dict):
    """One sample's feed ({input name: array}); ``where`` names its file(s) for messages."""

    where: str | None = None


def sample_name(feed: dict, i: int) -> str:
    """Sample ``i``'s file(s) where ``feed`` came from a data source, for messages."""
    return getattr(feed, "where", None) or f"sample {i}"


def with_extra(feed: dict, extra: dict) -> dict:
    """``feed`` with ``extra`` inputs added (a switchboard's flags), keeping the sample's name."""
    out = Sample({**feed, **extra})
    out.where = getattr(feed, "where", None)
    return out


# (what, folder flag, count flag): messages name the flags of the data they are about
CALIBRATION = ("calibration", "-I", "-N")
VALIDATION = ("validation", "--val_dir", "--val_num")


def _numbered_from_zero(names: set) -> int:
    """How many sample files 0.npy/0.bin, 1..., k-1 ``names`` holds without a gap."""
    i = 0
    while f"{i}.npy" in names or f"{i}.bin" in names:
        i += 1
    return i


class DataSource:
    """Reads calibration samples ``i`` as {input name: array} feeds (``role``: :data:`CALIBRATION`,
    or :data:`VALIDATION` for --val_dir's held-out samples, which only the messages tell apart)."""

    def __init__(self, path, specs: list[InputSpec], n: int, input_shapes: dict | None = None,
                 role: tuple = CALIBRATION):
        self.what, self.dir_flag, self.n_flag = role
        self.path = Path(path)
        self.specs = specs
        self.n = n
        self.input_shapes = dict(input_shapes or {})
        self._said: set = set()
        self._notes: list = []     # what was said once, for share_notes
        unknown = set(self.input_shapes) - {s.name for s in specs}
        if unknown:
            from dipoorlet.errors import ConfigError
            raise ConfigError(f"--input_shape names {sorted(unknown)}, which are not model inputs "
                              f"{[s.name for s in specs]}; use the model's input names")
        for spec in specs:
            given = self.input_shapes.get(spec.name)
            if given is None or spec.shape is None:
                continue
            if len(given) != len(spec.shape) or any(d is not None and d != g for d, g in zip(spec.shape, given)):
                from dipoorlet.errors import ConfigError
                raise ConfigError(f"--input_shape {spec.name}:{','.join(map(str, given))} does not fit the "
                                  f"model's input {spec.name!r} of shape {_fmt(spec.shape)}; --input_shape only "
                                  f"fills in its dynamic dims ({spec.name}:{_example_dims(spec.shape)})")
        if not self.path.exists():
            raise DataError(f"{self.what} data {self.path} does not exist; pass {self.dir_flag} with a folder "
                            "holding one sub-folder per model input (or an .npz file)")
        self._npz = None
        npz = self._find_npz()
        if npz is not None:
            self._open_npz(npz)
        else:
            self.folders = {s.name: self._folder(s) for s in specs}
            self.files = {s.name: self._files(s) for s in specs}

    # ---- layout discovery ---------------------------------------------------------------
    def _find_npz(self):
        if self.path.is_file():
            if self.path.suffix != ".npz":
                raise DataError(f"{self.what} data {self.path} is a file but not .npz; pass a "
                                "folder with one sub-folder per input, or an .npz file")
            return self.path
        if not any((self.path / s.name).is_dir() or (self.path / self._own_name(s)).is_dir()
                   for s in self.specs):
            found = sorted(self.path.glob("*.npz"))
            if len(found) == 1:
                return found[0]
        return None

    def _open_npz(self, path: Path):
        self.npz_path = Path(path)
        try:
            self._npz = _npz_arrays(path)
        except Exception as exc:
            raise DataError(f"{path} is not a readable .npz file ({exc}); save it with numpy.savez") from exc
        keys = set(self._npz)
        for s in self.specs:
            if s.name not in keys:
                raise DataError(f"{path} has no array named {s.name!r} (has {sorted(keys)}); "
                                "store one [N, ...] array per model input under its name")
            if self._npz[s.name].ndim == 0:
                raise DataError(f"{path}[{s.name!r}] is a single number; store an [N, ...] array of "
                                "samples per model input")
            count = self._npz[s.name].shape[0]
            counts = {t.name: self._npz[t.name].shape[0] for t in self.specs
                      if t.name in keys and self._npz[t.name].ndim > 0}
            if len(set(counts.values())) > 1:
                # sample i is row i of every array: arrays of different lengths do not say which
                # rows belong together
                raise DataError(f"{path}: its arrays hold different numbers of samples ("
                                + ", ".join(f"{k!r} {v}" for k, v in counts.items())
                                + "); sample i is row i of every array, so store them with one N")
            if count < self.n:
                raise DataError(f"{path}[{s.name!r}] holds {count} samples but {self.n_flag} is {self.n}; "
                                f"lower {self.n_flag} to {count} or add samples")
        other = sorted(keys - {s.name for s in self.specs})
        if other:
            log.info("%s: %s not read (no model input has %s name; inputs: %s)", path,
                     ", ".join(repr(k) for k in other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else ""),
                     "its" if len(other) == 1 else "their", ", ".join(s.name for s in self.specs))

    def _own_name(self, spec: InputSpec) -> str:
        """The folder name for an input: its name with / : \\ made _, unless another input has that
        name or the same safe name (inputs `in:0` and `in_0`, or `a:0` and `a/0`, must not both read
        one folder), then the name itself."""
        safe = _safe(spec.name)
        return spec.name if any(s.name == safe or _safe(s.name) == safe for s in self.specs if s is not spec) else safe

    def _folder(self, spec: InputSpec) -> Path:
        for cand in (self.path / spec.name, self.path / self._own_name(spec)):
            if cand.is_dir():
                return cand
        npz = sorted(p.name for p in self.path.glob("*.npz"))
        if npz:
            raise DataError(f"{self.path} holds {len(npz)} .npz files ({', '.join(npz[:3])}) and no folder for "
                            f"model input {spec.name!r}; put every input's [N, ...] array into one .npz "
                            "(numpy.savez), or use one folder per input")
        try:
            listing = sorted(os.listdir(self.path))
        except OSError:       # unreadable: the error below stands without a hint
            listing = []
        files = [k for k in listing if (self.path / k).is_file()]
        loose = [k for k in files if k.endswith((".npy", ".bin"))]
        dirs = [k for k in listing if (self.path / k).is_dir()]
        if loose and len(self.specs) == 1:
            hint = (f"{len(loose)} sample file{'s' if len(loose) > 1 else ''} such as {loose[0]} in {self.path} "
                    f"itself: move them into {self.path / self._own_name(spec)}"
                    + (" and name them 0.npy, 1.npy ..." if not all(k[:-4].isdigit() for k in loose) else ""))
        else:
            hint = _layout_hint(self.path, files)
        if dirs and not hint:
            hint = (f"its folders are {', '.join(dirs[:4])}{' ...' if len(dirs) > 4 else ''}: name each after a "
                    f"model input ({', '.join(repr(x.name) for x in self.specs)})")
        raise DataError(f"no folder for model input {spec.name!r} in {self.path}; expected "
                        f"{self.path / self._own_name(spec)}/0.bin (or .npy) ... one file per sample"
                        + (f" ({hint})" if hint else ""))

    def _files(self, spec: InputSpec) -> list[Path]:
        folder, files = self.folders[spec.name], []
        names = set(os.listdir(folder))
        # from the names, not range(N): a huge -N must reach the missing-file error at once
        both = sorted(int(k[:-4]) for k in names if re.fullmatch(r"(0|[1-9][0-9]*)\.npy", k)
                      and int(k[:-4]) < self.n and f"{k[:-4]}.bin" in names)
        if both:
            log.warning("%s holds both %d.npy and %d.bin%s: the .npy files are read", folder, both[0], both[0],
                        f" (and {len(both) - 1} more such pairs)" if len(both) > 1 else "")
        for i in range(self.n):
            for ext in (".npy", ".bin"):
                if f"{i}{ext}" in names:
                    files.append(folder / f"{i}{ext}")
                    break
            else:
                have = sum(1 for k in names if k.endswith((".bin", ".npy")))
                # what the folder holds instead, where it holds none of the samples (with samples
                # 0..i-1 there, a stray preview.png or mean.npy is not the problem)
                hint = _layout_hint(folder, sorted(k for k in names if (folder / k).is_file())) if i == 0 else ""
                raise DataError(f"{folder} has no sample {i}.bin or {i}.npy (found {have} sample "
                                f"files, {self.n_flag} is {self.n}); "
                                + (hint or (f"lower {self.n_flag} to {i} (samples 0..{i - 1} are there)" if i else
                                            f"lower {self.n_flag}") + " or add files named 0..N-1"))
        return files

    def available(self) -> int:
        """How many samples 0..k-1 the source holds for every input (the .npz's shortest array)."""
        if self._npz is not None:
            return min(int(self._npz[s.name].shape[0]) for s in self.specs)
        counts = [_numbered_from_zero(set(os.listdir(self.folders[s.name]))) for s in self.specs]
        return min(counts) if counts else 0

    def beyond_gap(self) -> tuple[str, int, int] | None:
        """(input folder, first missing index, sample files numbered above it) where a folder's
        numbering has a gap with samples after it, else None (an .npz has no gaps)."""
        if self._npz is not None:
            return None
        for s in self.specs:
            names = set(os.listdir(self.folders[s.name]))
            i = _numbered_from_zero(names)
            later = [k for k in names if k.endswith((".npy", ".bin")) and k[:-4].isascii() and k[:-4].isdigit()
                     and int(k[:-4]) > i]
            if later:
                return str(self.folders[s.name]), i, len(later)
        return None

    # ---- reading -----------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n

    def sample(self, i: int) -> dict[str, np.ndarray]:
        out = Sample({s.name: self._read(s, i) for s in self.specs})
        out.where = self.where(i)
        if out and all(v.ndim and v.shape[0] == 0 for v in out.values()):
            # a batch of 0: nothing to calibrate on, and the passes' own per-sample graphs (bias
            # correction's means, the fitted roundings' statistics) cannot take it. One empty input
            # beside others (a decoder's empty past), or a sequence of length 0, is not this
            shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in out.items())
            raise DataError(f"{out.where} holds no values ({shapes}: a batch of 0); a {self.what} sample needs "
                            "at least one: remove it")
        return out

    def paths(self) -> list[Path]:
        """Every file this source reads (the .npz, or each sample file of -N)."""
        if self._npz is not None:
            return [self.npz_path]
        return [f for files in self.files.values() for f in files]

    def where(self, i: int) -> str:
        """Sample ``i``'s file(s), for messages."""
        if self._npz is not None:
            return f"{self.path}[{i}]"
        return ", ".join(str(self.files[s.name][i]) for s in self.specs)

    def _read(self, spec: InputSpec, i: int) -> np.ndarray:
        want = self.input_shapes.get(spec.name, spec.shape)
        if self._npz is not None:
            where = f"{self.path}[{spec.name!r}][{i}]"
            arr = np.array(self._npz[spec.name][i])
            if spec.shape and len(spec.shape) == arr.ndim + 1:
                arr = arr[None]
        else:
            path = self.files[spec.name][i]
            where = str(path)
            arr = self._read_file(spec, path)
            if path.suffix == ".npy" and want and len(want) == arr.ndim + 1 and want[0] in (1, None):
                arr = arr[None]     # a sample saved without its batch axis, as an .npz row holds it
                return self._check(spec, arr, where, added=True)
        if want is not None and arr.ndim == len(want) + 1 and arr.shape[0] == 1 and \
                all(w is None or w == a for w, a in zip(want, arr.shape[1:])):
            # a batch axis of 1 on an input that has none ([T, F] given [1, T, F]): no flag could
            # take it (--input_shape fills dynamic dims only), and the error's advice went in a
            # circle (found by a hunt on madmom's key CNN)
            self._note(("dropped", spec.name), logging.INFO,
                       f"{where} has a leading axis of 1 that input {spec.name!r} {_fmt(want)} does not have: "
                       "read without it (said once per input)")
            arr = arr[0]
        return self._check(spec, arr, where)

    def _read_file(self, spec: InputSpec, path: Path) -> np.ndarray:
        try:
            if path.suffix == ".npy":
                with open(path, "rb") as f:
                    if f.read(6) != b"\x93NUMPY":
                        # numpy's own error reads "contains pickled (object) data" for any such file
                        raise DataError(f"{path} is not a .npy file (it does not begin with numpy's header); "
                                        f"write each sample with numpy.save, or as raw {spec.raw_dtype} in a "
                                        ".bin file")
                    f.seek(0)
                    return np.load(f, allow_pickle=False)
            size = path.stat().st_size
            dtype = spec.raw_dtype
            if size % dtype.itemsize:
                raise DataError(f"{path} is {size} bytes, not a whole number of {dtype} values "
                                f"({dtype.itemsize} bytes each); the file is truncated or of "
                                "another dtype")
            raw = np.fromfile(path, dtype=dtype)
            wide = _looks_wider(raw)
            if wide:
                # read as float32, float64 data has a dynamic dim doubled and every other value
                # is a mantissa's low word: random exponents, or 0 / +-2 / +-1e-19 where the
                # values came from float32 or are whole numbers (as float16, float32 data alike)
                raise DataError(f"{path} looks like {wide[0]} data (read as {dtype}, {wide[1]}; as {wide[0]} "
                                f"they are ordinary); raw .bin files hold the input's dtype: save them as {dtype} "
                                f"(arr.astype(np.{dtype}).tofile(...)), or as .npy")
            if dtype != spec.dtype:      # a widened float16/bfloat16 input: the model now takes float32
                raw = raw.astype(spec.dtype)
        except DataError:
            raise
        except PermissionError as exc:
            raise DataError(f"cannot read {self.what} file {path} (permission denied); make it readable "
                            f"(chmod a+r) or run as its owner") from exc
        except Exception as exc:
            raise DataError(f"cannot read {self.what} file {path} ({exc}); "
                            "write it with numpy.save or as raw binary") from exc
        return raw.reshape(self._bin_shape(spec, raw.size, path))

    def _bin_shape(self, spec: InputSpec, size: int, path: Path) -> tuple:
        if spec.name in self.input_shapes:
            shape = self.input_shapes[spec.name]
        elif spec.shape is not None and all(d is not None for d in spec.shape):
            shape = spec.shape
        elif spec.shape is not None and sum(d is None for d in spec.shape) == 1:
            known = int(np.prod([d for d in spec.shape if d is not None]))
            if known == 0 or size % known:
                raise DataError(f"{path} holds {size} {spec.raw_dtype} values, which do not fill input "
                                f"{spec.name!r} of shape {_fmt(spec.shape)}; check the file or "
                                "pass --input_shape")
            shape = tuple(size // known if d is None else d for d in spec.shape)
        elif spec.shape is None:
            raise DataError(f"input {spec.name!r} has no shape in the model, so {path.name} (raw .bin) is "
                            f"ambiguous; pass --input_shape {spec.name}:D1,D2,... with all its dims, or "
                            f"store samples as .npy")
        else:
            raise DataError(f"input {spec.name!r} has shape {_fmt(spec.shape)} with several dynamic "
                            f"dims, so {path.name} (raw .bin) is ambiguous; pass --input_shape "
                            f"{spec.name}:{_example_dims(spec.shape)} or store samples as .npy")
        if int(np.prod(shape)) != size:
            twice = size == 2 * int(np.prod(shape)) and spec.raw_dtype == np.float32
            raise DataError(f"{path} holds {size} {spec.raw_dtype} values but input {spec.name!r} needs "
                            f"shape {_fmt(shape)} = {int(np.prod(shape))} values; "
                            + ("twice as many: float64 data? save it as float32, or " if twice else "")
                            + "check the file or --input_shape")
        return shape

    def _note(self, key, level: int, text: str) -> None:
        """Log ``text`` once per ``key`` (and keep it for :meth:`share_notes`)."""
        if key in self._said:
            return
        self._said.add(key)
        self._notes.append((key, level, text))
        log.log(level, "%s", text)

    def share_notes(self, comm) -> None:
        """Under MPI, rank 0 logs what the other processes' samples made them say once (a sample
        of raw int32 pixels that only rank 1 read was told in no log but rank 1's, which is off
        by default)."""
        if comm.world == 1:
            return
        every = comm.allgather(self._notes)
        self._notes = []
        if comm.rank != 0:
            return
        for rank, notes in enumerate(every[1:], 1):
            for key, level, text in notes:
                if key not in self._said:
                    self._said.add(key)
                    log.log(level, "%s (rank %d)", text, rank)

    def _check(self, spec: InputSpec, arr: np.ndarray, where: str, added: bool = False) -> np.ndarray:
        if np.issubdtype(spec.dtype, np.floating):
            if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
                raise DataError(f"{where} has dtype {arr.dtype}, input {spec.name!r} is {spec.dtype}; "
                                f"save the sample as {spec.dtype} (numpy: arr.astype(np.{spec.dtype}))")
            if np.issubdtype(arr.dtype, np.floating) and arr.dtype.itemsize > np.dtype(spec.dtype).itemsize:
                self._note(("wide", spec.name), logging.INFO,
                           f"{where} holds {arr.dtype} values for {spec.dtype} input {spec.name!r}: cast to "
                           f"{spec.dtype} (said once per input)")
            if np.issubdtype(arr.dtype, np.integer):
                self._note(spec.name, logging.WARNING,
                           f"{where} holds {arr.dtype} values for float input {spec.name!r}: cast to {spec.dtype} as "
                           "they are; if these are raw pixels, normalize them as the model expects before calibrating")
            src = arr
            with np.errstate(over="ignore"):     # values beyond float32 are reported below
                arr = arr.astype(spec.dtype, copy=False)
            if spec.mask and not np.isfinite(arr).all() and not (np.isnan(arr) | (arr == np.inf)).any():
                self._note(("mask", spec.name), logging.INFO,
                           f"{where} holds -inf in {spec.name!r}, an additive attention mask: taken as positions "
                           "left out (said once per input)")
            elif not np.isfinite(arr).all():
                bad = int((~np.isfinite(arr)).sum())
                if np.issubdtype(src.dtype, np.floating) and np.isfinite(src).all():
                    raise DataError(f"{where} holds {bad} values beyond {spec.dtype}'s range (largest |x| "
                                    f"{float(np.abs(src).max()):.3g}), which input {spec.name!r} cannot "
                                    "take; fix or remove that sample")
                raise DataError(f"{where} contains {bad} NaN/Inf values; {self.what} data must be "
                                "finite: fix or remove that sample")
        elif np.issubdtype(spec.dtype, np.integer) or spec.dtype == np.bool_:
            if np.issubdtype(arr.dtype, np.floating):
                what = ("a mask: save it as bool (np.bool_)" if spec.dtype == np.bool_
                        else "e.g. token ids: save it with an integer dtype")
                raise DataError(f"{where} holds floats but input {spec.name!r} is {spec.dtype} ({what})")
            if spec.dtype != np.bool_ and arr.dtype != np.bool_ and arr.size:
                info = np.iinfo(spec.dtype)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    # a plain cast wraps around: token id 2^32 + 3 became 3
                    raise DataError(f"{where} holds values {lo}..{hi}, beyond the range of input {spec.name!r} "
                                    f"({spec.dtype}: {info.min}..{info.max}); fix or remove that sample")
            if spec.dtype == np.bool_ and arr.dtype != np.bool_ and arr.size:
                lo, hi = int(arr.min()), int(arr.max())
                if lo < 0 or hi > 1:
                    # a cast makes every nonzero True: a mask of 0..2 (or token ids) read as all-ones
                    raise DataError(f"{where} holds values {lo}..{hi} but input {spec.name!r} is bool; give "
                                    "0/1 (or save it as np.bool_)")
            arr = arr.astype(spec.dtype, copy=False)
        if spec.shape is not None:
            want = self.input_shapes.get(spec.name, spec.shape)
            if len(want) != arr.ndim or any(w is not None and w != a for w, a in zip(want, arr.shape)):
                fits = lambda shape: all(w is None or w == a for w, a in zip(want, shape))
                turned = len(want) == arr.ndim >= 3 and (fits(arr.shape[:1] + arr.shape[-1:] + arr.shape[1:-1])
                                                         or fits(arr.shape[:1] + arr.shape[2:] + arr.shape[1:2]))
                given = spec.name in self.input_shapes
                shape = (f"{_fmt(arr.shape[1:])} (read as {_fmt(arr.shape)}, a batch axis added)" if added
                         else _fmt(arr.shape))
                raise DataError(f"{where} has shape {shape} but input {spec.name!r} "
                                f"expects {_fmt(want)}" + (" (from --input_shape)" if given else "") + "; "
                                + ("the same sizes in another order (channels last?): transpose the data to "
                                   "the model's layout" if turned else
                                   # --input_shape fills dynamic dims only: it cannot add or drop an axis
                                   f"re-export the data with the input's {len(want)} "
                                   f"{'axis' if len(want) == 1 else 'axes'}"
                                   if len(want) != arr.ndim and spec.shape is not None else
                                   "give --input_shape the data's shape, or re-export the data" if given else
                                   "re-export the data or pass --input_shape"))
        # np.ascontiguousarray would turn a 0-d sample (a scalar input) into shape (1,)
        return np.require(arr, requirements="C")


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif")


def _layout_hint(folder: Path, names: list[str]) -> str:
    """What a folder that misses the expected sample files holds instead, for the error line:
    images (the data must be the model's input tensors, preprocessed) or sample files named
    otherwise (img_000.npy)."""
    images = [k for k in names if k.lower().endswith(IMAGE_SUFFIXES)]
    if images:
        return (f"{len(images)} image file{'s' if len(images) > 1 else ''} such as {images[0]} in {folder}: "
                "the data are the model's input tensors after its preprocessing, one .npy (numpy.save) or "
                "raw .bin per sample, not images")
    samples = [k for k in names if k.endswith((".npy", ".bin"))]
    if samples and all(k[:-4].isdigit() for k in samples):   # 0001.npy ... or 1.npy ...: numbered otherwise
        return (f"its samples are numbered {samples[0]} ... {samples[-1]}: name them 0.npy ... "
                f"{len(samples) - 1}.npy, without leading zeros, from 0")
    if samples:
        return (f"{', '.join(samples[:2])}{' ...' if len(samples) > 2 else ''} in {folder}: name the samples "
                "0.npy, 1.npy ... (or 0.bin ...)")
    return ""


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``: a write the disk cut short (full, then freed again)
    had left a hole that read back as zeros, and the next write went on past it (found by a
    hunt with a small $TMPDIR)."""
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        if done <= 0:
            import errno

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[done:], offset + done


class _Rows:
    """An uncompressed ``[N, ...]`` .npz member in C order, read one row per access from its offset
    in the file. A memory map of the member (the first design) kept every page it had read
    resident: peak RSS grew with -N (the classifier's 512 crops from one .npz: 125 -> 178 MB,
    against 122 MB either way from a folder of .npy files)."""

    def __init__(self, path: Path, offset: int, shape: tuple, dtype: np.dtype):
        self.path, self.offset, self.shape, self.dtype = path, offset, tuple(shape), dtype
        self.ndim = len(self.shape)
        self.row_bytes = dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))

    def __getitem__(self, i) -> np.ndarray:
        i = int(i)
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"row {i} of {self.shape[0]}")
        with open(self.path, "rb") as f:
            f.seek(self.offset + i * self.row_bytes)
            buf = f.read(self.row_bytes)
        if len(buf) != self.row_bytes:
            raise DataError(f"{self.path} ends inside row {i} of {self.shape[0]}: the .npz was truncated while "
                            f"it was read; save it again with numpy.savez")
        return np.frombuffer(buf, dtype=self.dtype).reshape(self.shape[1:])


class _TempRows:
    """An ``[N, ...]`` .npz member copied into an unlinked temporary file that holds each row's
    values together, read back a row at a time (as :class:`_Rows` reads a plain member).

    Two kinds of member need the copy. A Fortran-order member (``numpy.savez`` of a transposed
    array) spreads every row's values over the whole member: a memory map of it held every page
    any row had touched (peak RSS 148.9 MB against 100.8 MB for the same 48 MB of samples in C
    order). A compressed member (``numpy.savez_compressed``) has no offset for a row at all: it
    was read whole, so memory grew with -N. Both are streamed through, 1 MB at a time; the
    temporary file goes with the process, whatever ends it. Nothing is copied before the first
    row is read, so arrays of the .npz that no model input reads are never copied. A compressed
    C-order member is copied only as far as the rows read so far reach (its stream stays open
    between reads): ``-N 32`` on a file of 10,000 samples inflates the first 32, not all of them.
    zipfile checks a member's CRC-32 at its end, so a member read only in part is not checked:
    damage that still inflates goes unseen there, as it does in a .npy or .bin.
    A Fortran-order member holds the last row's values at the end of the member, so it is
    copied whole on the first read."""

    BLOCK_BYTES = 2 ** 20      # 4 MB blocks left up to 20 MB of freed heap behind (glibc keeps it)

    def __init__(self, path: Path, opener, shape: tuple, dtype: np.dtype, fortran: bool, compressed: bool):
        """``opener()``: a binary stream positioned at the member's first value."""
        self.path, self._opener, self.fortran, self.compressed = Path(path), opener, fortran, compressed
        self.shape, self.dtype, self.ndim = tuple(shape), dtype, len(shape)
        self.row_bytes = dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        self.fd = None
        self._stream = None        # the open member of a C-order copy (closed by self._stack)
        self._stack = contextlib.ExitStack()
        self._rows = 0             # rows on the temporary file so far

    def _kind(self) -> str:
        return "compressed" if self.compressed else "Fortran-order"

    def _open(self):
        import tempfile

        try:
            fd, name = tempfile.mkstemp(prefix="dipoorlet-npz-")
        except OSError as exc:
            raise DataError(f"{self.path}: no temporary file for its {self._kind()} array in "
                            f"{tempfile.gettempdir()} ({exc.strerror or exc}); set TMPDIR to a writable folder, "
                            "or save the data with numpy.savez of C-ordered arrays, which needs no copy") from exc
        os.unlink(name)                  # gone with the process, whatever ends it
        self.fd = fd
        log.info("%s: a %s array %s is copied to a temporary file %s, to be read a sample at a time "
                 "(numpy.savez of numpy.ascontiguousarray(arr) saves that step)", self.path, self._kind(),
                 list(self.shape), f"of {self.shape[0] * self.row_bytes / 2 ** 20:.3g} MB" if self.fortran else
                 f"as far as the rows read reach (at most {self.shape[0] * self.row_bytes / 2 ** 20:.3g} MB)")

    def _copy_to(self, row: int):
        """Copy the member onto the temporary file up to and including ``row``."""
        import tempfile

        if self.fd is None:
            self._open()
        n, rest = self.shape[0], int(np.prod(self.shape[1:], dtype=np.int64))
        item = self.dtype.itemsize
        truncated = DataError(f"{self.path} ends inside its array of {list(self.shape)}: save it again with "
                              "numpy.savez")
        try:
            if not self.fortran:
                # C order: the member is the rows one after another; copy on from where the last
                # read stopped, whole blocks (at least one row each) until ``row`` is on the file
                if self._stream is None:
                    self._stream = self._stack.enter_context(self._opener())
                f = self._stream
                total = n * self.row_bytes
                at = self._rows * self.row_bytes
                # whole rows only: the stream moves on past what is copied, so a copy that ended
                # inside a row restarted at that row's start, shifting every later row (a bug of
                # this very change, found by a memory hunt before it shipped)
                end = max((row + 1) * self.row_bytes, at + self.BLOCK_BYTES)
                end = min(total, -(-end // self.row_bytes) * self.row_bytes)
                while at < end:
                    chunk = _read_exactly(f, min(self.BLOCK_BYTES, end - at))
                    if chunk is None:
                        raise truncated
                    _pwrite_all(self.fd, chunk, at)
                    at += len(chunk)
                self._rows = at // self.row_bytes
                if self._rows >= n:
                    # the whole member read: one more read reaches its end, where zipfile checks
                    # the CRC (a member read only in part is not checked: it covers the whole)
                    if f.read(1):
                        raise truncated
                    self._close_stream()
            else:
                # Fortran order: the member is the C-order [rest, n] matrix; a block of its rows
                # is every sample's values at those positions
                # at least 256 values per write (one write per sample per block), in at most 16 MB
                block = min(16 * 2 ** 20, max(self.BLOCK_BYTES, 256 * n * item))
                step = max(1, block // max(1, n * item))
                with self._opener() as f:
                    for r0 in range(0, rest, step):
                        k = min(step, rest - r0)
                        raw = _read_exactly(f, k * n * item)
                        if raw is None:
                            raise truncated
                        cols = np.ascontiguousarray(np.frombuffer(raw, dtype=self.dtype).reshape(k, n).T)
                        for i in range(n):
                            _pwrite_all(self.fd, cols[i].tobytes(), i * self.row_bytes + r0 * item)
                self._rows = n
        except Exception as exc:
            self._close()
            if isinstance(exc, DataError):
                raise
            if isinstance(exc, OSError):
                raise DataError(f"{self.path}: cannot copy its {self._kind()} array ({n * self.row_bytes / 2 ** 20:.0f} "
                                f"MB) to a temporary file in {tempfile.gettempdir()} ({exc.strerror or exc}); set "
                                "TMPDIR to a folder with room, or save the data with numpy.savez of C-ordered arrays, "
                                "which needs no copy") from exc
            # a compressed member that fails its CRC or does not inflate
            raise DataError(f"{self.path} is not a readable .npz file ({type(exc).__name__}: {exc}); save it "
                            "again with numpy.savez") from exc

    def __getitem__(self, i) -> np.ndarray:
        i = int(i)
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"row {i} of {self.shape[0]}")
        if self.row_bytes == 0:          # rows of a zero-length dimension hold nothing to copy
            return np.empty(self.shape[1:], self.dtype)
        if i >= self._rows:
            self._copy_to(i)
        buf = os.pread(self.fd, self.row_bytes, i * self.row_bytes)
        # .copy, not ascontiguousarray: that gives a scalar row (an [N] member) shape (1,)
        return np.frombuffer(buf, dtype=self.dtype).reshape(
            self.shape[1:], order="F" if self.fortran else "C").copy(order="C")

    def _close_stream(self):
        self._stream = None
        try:
            self._stack.close()
        except Exception:  # noqa: BLE001 - closing a member that failed: nothing more to say
            pass

    def _close(self):
        """Drop the copy (after a failed one: the next read starts again, and fails the same way)."""
        self._close_stream()
        fd, self.fd, self._rows = self.fd, None, 0
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self):
        try:
            self._close()
        except AttributeError:
            pass


def _read_exactly(f, size: int) -> bytes | None:
    """``size`` bytes from the stream ``f`` (a zip member may return fewer per read), None at its end."""
    parts, got = [], 0
    while got < size:
        b = f.read(size - got)
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _npz_arrays(path: Path) -> dict:
    """The arrays of an .npz, read a row at a time.

    ``np.load(npz)[name]`` reads the whole ``[N, ...]`` array on every access. A plain member
    (``numpy.savez`` of a C-ordered array) is read a row at a time at the row's offset inside the
    zip (:class:`_Rows`), so only the samples a process uses are read and one is held at a time.
    A Fortran-order or compressed member (``numpy.savez_compressed``) is first streamed into a
    temporary file that holds each row together (:class:`_TempRows`).
    """
    import zipfile

    arrays = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as raw:
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                continue
            name = info.filename[:-4]
            stored = info.compress_type == zipfile.ZIP_STORED
            if stored:
                raw.seek(info.header_offset)
                header = raw.read(30)
                n_name, n_extra = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
                start = info.header_offset + 30 + n_name + n_extra
                raw.seek(start)
                version = np.lib.format.read_magic(raw)
                if version in _HEADER_READERS:
                    shape, fortran, dtype = _HEADER_READERS[version](raw)
                    first, size = raw.tell(), info.file_size - (raw.tell() - start)
            else:
                with zf.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    if version in _HEADER_READERS:
                        shape, fortran, dtype = _HEADER_READERS[version](member)
                        first, size = member.tell(), info.file_size - member.tell()
            if version not in _HEADER_READERS:
                with zf.open(info) as member:
                    arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
                continue
            if dtype.hasobject:
                raise ValueError(f"array {name!r} holds Python objects")
            # a header that claims more than the member stores would read the zip's own records as samples
            if dtype.itemsize * int(np.prod(shape, dtype=np.int64)) > size:
                raise ValueError(f"array {name!r} is truncated: its header says {list(shape)} but the member "
                                 f"stores {size} bytes")
            if not shape:
                with zf.open(info) as member:
                    arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
            elif stored and not fortran:
                arrays[name] = _Rows(Path(path), first, shape, dtype)
            else:
                arrays[name] = _TempRows(Path(path), _member_opener(Path(path), info, first, stored), shape, dtype,
                                         fortran, not stored)
    return arrays


def _member_opener(path: Path, info, first: int, stored: bool):
    """A function that opens the .npz member ``info`` as a stream positioned at its first value
    (a context manager)."""
    import zipfile

    @contextlib.contextmanager
    def open_plain():
        with open(path, "rb") as f:
            f.seek(first)
            yield f

    @contextlib.contextmanager
    def open_compressed():
        with zipfile.ZipFile(path) as zf, zf.open(info.filename) as member:
            if _read_exactly(member, first) is None:       # past the .npy header
                raise ValueError(f"member {info.filename!r} ends inside its header")
            yield member

    return open_plain if stored else open_compressed


def _odd_share(raw: np.ndarray, big: float = 1e20, small: float = 1e-20) -> float:
    """The share of values beyond ``big``, below ``small`` (but not 0), or not finite."""
    with np.errstate(all="ignore"):
        a = np.abs(raw.astype(np.float64))
        return float(np.mean((a > big) | ((a > 0) & (a < small)) | ~np.isfinite(a)))


# raw dtype -> (the dtype twice as wide, the bits of a wide value's low word that a value of
# half the mantissa leaves 0, the magnitudes beyond which a value read is absurd): float16's high
# words of float32 data hold the top 5 bits of its exponent, so they fall in about 1/256..256
_WIDER = {"float32": ("float64", 29, 1e20, 1e-20), "float16": ("float32", 13, 256.0, 1 / 256),
          "bfloat16": ("float32", 13, 1e20, 1e-20)}


def _looks_wider(raw: np.ndarray) -> tuple[str, str] | None:
    """Raw values that are data of twice the width read with the input's dtype (float64 files for
    a float32 input, float32 files for a float16 one): (that dtype, what gives it away), or None.
    Read so, every other value (little-endian: the even places) is the low word of a wide value's
    mantissa, the others its sign, exponent and top mantissa bits, which read as ordinary values;
    the wide values themselves are ordinary. The low words give it away:
    - full mantissas: random words, so many even places lie at absurd magnitudes on both sides
      (beyond ``big`` and below ``small``), which measured data, a column of large values
      interleaved with small ones included, does not do;
    - values that came from the narrower dtype (x.astype(np.float64) of float32 data): only the
      words' top 3 bits can be set, so the even places take a few of 0, +-2, +-1e-19, +-4e19
      (float32), three kinds of them or more, where data of 0s and 2s takes two;
    - whole numbers (pixels), or values of 16 significant bits or fewer (int16 audio / 32768):
      every even place 0, and the wide values whole numbers, or their words' last 4 bits 0 too,
      which the pairs of measured data (0, v) almost never make.
    float64 0/1 masks are not told from an interleaved silent channel, and pass."""
    spec = _WIDER.get(raw.dtype.name)
    if spec is None or raw.size < 16 or raw.size % 2:
        return None
    wide_name, zero_bits, big, small = spec
    with np.errstate(all="ignore"):
        wide = np.abs(raw.view(np.dtype(wide_name)).astype(np.float64))
    nonzero = wide[wide > 0]
    if not (np.isfinite(wide).all() and wide.max() < 1e10 and (nonzero.size == 0 or nonzero.min() > 1e-10)):
        return None
    if _odd_share(raw[1::2], big, small) > 0.01:
        return None
    with np.errstate(all="ignore"):
        even = np.abs(raw[0::2].astype(np.float64))
        above, below = float(np.mean(even > big)), float(np.mean((even > 0) & (even < small)))
    if above + below >= 0.10 and min(above, below) >= 0.02:
        return wide_name, (f"{above + below:.0%} of every other value lies beyond {big:g} or below {small:g}, "
                           "on both sides")
    words = raw.view(np.uint32 if raw.dtype.itemsize == 4 else np.uint16)
    low = np.array((1 << zero_bits) - 1, words.dtype)
    bits = words[0::2]
    # ... and the odd places mostly not so (a constant 2.0, a sparse input: both places alike)
    if np.any(bits & low) or np.mean((words[1::2] & low) == 0) >= 0.5:
        return None
    kinds = np.unique(bits[bits != 0])
    if kinds.size >= 3:
        return wide_name, "every other value is 0 or one of " + ", ".join(
            f"{v:.2g}" for v in kinds.view(raw.dtype).astype(float)[:4])
    if not np.any(bits) and wide.max() > 1 and np.all(wide == np.round(wide)):
        return wide_name, "every other value is 0, and the pairs make whole numbers"
    if not np.any(bits) and raw.dtype.itemsize == 4 and not np.any(words[1::2] & np.uint32(0xF)):
        # float64 of 16-bit samples (int16 audio / 32768, soundfile's default float64): each
        # value's significant bits end in its high word, whose last 4 bits are then 0 too, where
        # measured float32 data beside a silent channel has about 1 in 16 such (found by a review)
        return wide_name, "every other value is 0, and the pairs make values of 16 significant bits or fewer"
    return None


def _safe(name: str) -> str:
    return name.replace("/", "_").replace(":", "_").replace("\\", "_")


def _example_dims(shape) -> str:
    """The shape with its dynamic dims named D1, D2... (what --input_shape wants filled in)."""
    if not shape:
        return "D1,D2"
    k = iter(range(1, len(shape) + 1))
    return ",".join(str(d) if d is not None else f"D{next(k)}" for d in shape)


def _fmt(shape) -> str:
    if shape is None:
        return "[?]"
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"
