"""Tensor maps for kernels that load by TMA, and the packed argument block of a driver launch.

Both live in the runtime (``evoengineer.runtime.tensormap`` and ``.launch``), the one encoder
and packer that the search's launcher and every exported module share; this module names them
for the GPU stage.
"""
from __future__ import annotations

from ..runtime.arguments import CTYPES, PackedArguments, pack_arguments
from ..runtime.tensormap import (
    _ENCODE,
    _REPLACE,
    DATA_TYPES,
    ELEMENT_BYTES,
    INTERLEAVE_NONE,
    L2_PROMOTION_256B,
    MAP_ALIGN,
    MAP_BYTES,
    OOB_FILL_ZEROS,
    SWIZZLES,
    Driver,
    MapGeometry,
    MapSpec,
    MapStorage,
    TensorMapError,
    check_address,
    driver,
    map_geometry,
)

__all__ = [
    "CTYPES", "DATA_TYPES", "ELEMENT_BYTES", "INTERLEAVE_NONE", "L2_PROMOTION_256B", "MAP_ALIGN", "MAP_BYTES",
    "OOB_FILL_ZEROS", "SWIZZLES", "_ENCODE", "_REPLACE", "Driver", "MapGeometry", "MapSpec", "MapStorage",
    "PackedArguments", "TensorMapError", "check_address", "driver", "map_geometry", "pack_arguments",
]
