"""Errors a user can act on.

Every error raised for bad input is a :class:`DipoorletError`: its message is one line that names
the thing, what was expected, what was found and what to do. The CLI prints it and exits with
code 2; a traceback only appears with ``--debug``.
"""
from __future__ import annotations


class DipoorletError(Exception):
    """A problem with the user's input or environment, reported as one line."""

    exit_code = 2


class ModelError(DipoorletError):
    """The model cannot be read, checked or run."""


class DataError(DipoorletError):
    """Calibration data is missing, mis-shaped or not finite."""


class ConfigError(DipoorletError):
    """A flag, option or platform spec is invalid."""


class OutputError(DipoorletError):
    """The output folder cannot be written."""


class BelowTargetError(DipoorletError):
    """The run finished and wrote its outputs, but a judged output scored below ``fail_below``
    (--fail_below; the CLI exits with code 3). ``result`` is the run's Result."""

    exit_code = 3

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result
