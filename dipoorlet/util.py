"""Small helpers shared by several modules: atomic writes, JSON output."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside ``path``; move it into place only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp makes the file private (0600); the output gets the mode any new file gets here
    os.chmod(tmp, 0o666 & ~_umask())
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    """The process umask, read without setting it where Linux says it (os.umask sets it, which
    for a moment gives a thread of a host program that creates a file then a world-writable one)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        # a path holding a byte that is not UTF-8 (mod\xe9l.onnx) reaches the text as a lone
        # surrogate, which strict UTF-8 refuses (the run died writing its report)
        with open(tmp, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(text)
    return Path(path)


def finite_json(obj):
    """``obj`` with every non-finite float as None: JSON has no Infinity or NaN (Python writes
    them, strict parsers such as JavaScript's JSON.parse reject the file)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, obj) -> Path:
    return write_text(path, json.dumps(finite_json(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


class QuietFileHandler(logging.FileHandler):
    """A log file that goes quiet when it cannot be written (a full disk): the run's own error
    says what went wrong, not a '--- Logging error ---' traceback per record, nor one more from
    closing the file. Closing compares what reached the file with what was logged and says on
    stderr when the log is incomplete (a run that succeeded on a nearly full disk had left a log
    cut at 4 KB without a word; a record whose flush failed may still reach the file when the
    disk has room again by then, so failures alone do not decide). A path that is not UTF-8
    (undecodable bytes in a file name) is written escaped: such records had been dropped (both
    found by a hunt)."""

    def __init__(self, filename, mode="a", encoding=None, delay=False, errors="backslashreplace"):
        super().__init__(filename, mode, encoding, delay, errors)
        self.failed, self.why = False, ""
        self.expected = self._size() or 0      # bytes the file should hold

    def _size(self):
        try:
            return os.fstat(self.stream.fileno()).st_size if self.stream is not None else None
        except (OSError, ValueError):
            return None

    def emit(self, record):
        try:
            text = self.format(record) + self.terminator
            self.expected += len(text.encode(self.encoding or "utf-8", self.errors or "strict"))
        except Exception:  # noqa: BLE001 - the record's own problem: logging's emit handles it
            pass
        super().emit(record)

    def handleError(self, record):
        import sys

        self.failed = True
        exc = sys.exc_info()[1]
        if exc is not None and not self.why:
            self.why = getattr(exc, "strerror", None) or str(exc)

    def close(self):
        import sys

        size = None
        if self.stream is not None:
            try:
                self.stream.flush()
            except (OSError, ValueError) as exc:
                self.failed = True
                self.why = self.why or getattr(exc, "strerror", None) or str(exc)
            size = self._size()
        try:
            super().close()
        except OSError:
            pass
        if self.failed and size is not None and size < self.expected:
            self.failed = False
            try:
                # the folder, not the file: the run names its log once it is closed
                print(f"dipoorlet: warning: the log this run wrote into {os.path.dirname(self.baseFilename)} is "
                      f"incomplete: its last {self.expected - size} bytes could not be written ({self.why})",
                      file=sys.stderr, flush=True)
            except (OSError, ValueError):
                pass


def did_you_mean(name: str, choices, aliases: dict) -> list[str]:
    """What an unknown name probably meant: the choices another tool's or vendor's name for it
    stands for (``aliases``, keys lower case without - or _), else up to two close spellings."""
    import difflib

    key = str(name).lower().replace("-", "").replace("_", "")
    if key in aliases:
        return list(aliases[key])
    return difflib.get_close_matches(str(name).lower(), list(choices), n=2, cutoff=0.6)


def sqnr_db(sig: float, err: float, no_signal=float("-inf")) -> float:
    """``10 log10(sig / err)`` for any float inputs, never raising: NaN where either is NaN, +inf
    where there is no error, ``no_signal`` where the signal is 0 (or below), -inf where the ratio
    is 0 (an infinite error: a quantized copy that overflowed float32, e.g. an attention mask's
    float32-lowest constant times a grid step)."""
    import math

    if sig != sig or err != err:
        return math.nan
    if err == 0:
        return math.inf
    if sig <= 0:
        return no_signal
    ratio = sig / err
    if ratio != ratio:          # inf / inf
        return math.nan
    return 10 * math.log10(ratio) if ratio > 0 else -math.inf


def nan_worst(v: float) -> float:
    """A score as a sort key where NaN (a tensor gone NaN or Inf) ranks worst, instead of
    leaving ``sorted`` in an arbitrary order."""
    return float("-inf") if v != v else v
