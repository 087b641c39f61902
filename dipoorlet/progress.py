"""Progress bars on rank 0 only; silent elsewhere and when not attached to a terminal log.

``DIPOORLET_PROGRESS=1`` shows them where stderr is not a terminal (under ``mpirun``, whose ranks
write into pipes it forwards to the terminal), ``0`` hides them everywhere."""
from __future__ import annotations

import os
import sys

from tqdm import tqdm


def progress(iterable, desc: str, comm=None, total: int | None = None):
    forced = os.environ.get("DIPOORLET_PROGRESS", "").strip()
    shown = forced == "1" if forced in ("0", "1") else sys.stderr.isatty()
    disable = (comm is not None and comm.rank != 0) or not shown
    return tqdm(iterable, desc=desc, total=total, disable=disable, leave=False,
                dynamic_ncols=True, unit="sample")
