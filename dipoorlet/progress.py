"""Progress bars on rank 0 only; silent elsewhere and when not attached to a terminal log."""
from __future__ import annotations

import sys

from tqdm import tqdm


def progress(iterable, desc: str, comm=None, total: int | None = None):
    disable = (comm is not None and comm.rank != 0) or not sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, disable=disable, leave=False,
                dynamic_ncols=True, unit="sample")
