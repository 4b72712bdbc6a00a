"""The ``evoengineer`` command line."""
from __future__ import annotations

import os

# Before numpy loads: the search strategy's Gaussian process factors matrices of at most
# 200 x 200, which one BLAS thread does fastest. A pool of BLAS threads (one per core by
# default) competing with the compile processes for the cores made each proposal 4-10x slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from .main import main  # noqa: E402

__all__ = ["main"]
