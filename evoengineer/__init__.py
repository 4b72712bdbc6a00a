"""EvoEngineer: search a space of templated CUDA kernels for the fastest correct one."""
from __future__ import annotations

__version__ = "0.1.0"
