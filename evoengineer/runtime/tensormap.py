"""Tensor maps of kernels that load by TMA: the one encoder of the codebase.

A kernel that declares ``// TENSOR_MAP`` lines takes one ``const __grid_constant__ CUtensorMap``
per line after the common arguments: a 4-D map over the named tensor as (head_dim, seq, heads,
batch), innermost first, with the tensor's own strides. ``map_geometry`` computes and checks
what ``cuTensorMapEncodeTiled`` takes (pure); ``Driver`` calls the CUDA driver through ctypes on
``libcuda.so.1`` (no extra dependency); ``MapStorage`` holds maps 64-byte aligned, as the driver
requires. A map encodes the tensor's address, so a call with other tensors of the same shape
and strides re-points it (``cuTensorMapReplaceAddress``) instead of encoding again.

Used by the search's launcher and by every exported module (this file is copied into exports).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Protocol, Sequence

MAP_BYTES = 128
MAP_ALIGN = 64
DATA_TYPES = {"fp16": 6, "bf16": 9}
"""``CU_TENSOR_MAP_DATA_TYPE_FLOAT16`` and ``_BFLOAT16``."""
SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}
"""Swizzle span in bytes -> ``CU_TENSOR_MAP_SWIZZLE_NONE``, ``_32B``, ``_64B``, ``_128B``."""
INTERLEAVE_NONE = 0
L2_PROMOTION_256B = 3
OOB_FILL_ZEROS = 0
"""``CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE``: elements outside the tensor arrive as zeros."""
ELEMENT_BYTES = 2


class TensorMapError(ValueError):
    """The tensor cannot be described by the kernel's tensor map, or the driver refused it."""


class MapSpec(Protocol):
    """What a tensor map declares: its kernel argument, the tensor it maps (q, k, v, out, do, or
    flat: lse, dsum), the box (columns, rows) copied per load and the swizzle span in bytes."""

    @property
    def arg(self) -> str: ...
    @property
    def tensor(self) -> str: ...
    @property
    def box(self) -> Sequence[int]: ...
    @property
    def swizzle(self) -> int: ...



@dataclass(frozen=True)
class MapGeometry:
    """The arguments of ``cuTensorMapEncodeTiled`` besides the address, innermost dimension first."""

    data_type: int
    dims: tuple[int, ...]                    # elements: head_dim, seq, heads, batch (flat: the floats)
    strides: tuple[int, ...]                 # bytes between consecutive seq rows, heads, batches (flat: none)
    box: tuple[int, ...]                     # elements copied per dimension
    swizzle: int                             # CUtensorMapSwizzle

    @property
    def rank(self) -> int:
        return len(self.dims)

    def describe(self) -> str:
        return f"dims {self.dims}, byte strides {self.strides}, box {self.box}"


def map_geometry(spec: MapSpec, shape: Sequence[int], strides: Sequence[int], dtype: str) -> MapGeometry:
    """The map of ``spec`` over a (batch, heads, seq, head_dim) tensor with these element strides.

    A dimension of extent 1 is never stepped, so its stride is replaced by the one a contiguous
    tensor would have (views may carry any stride there). TensorMapError when the tensor or the
    box breaks a rule of the driver: rows and strides multiples of 16 bytes and non-zero, the
    box's columns a multiple of 16 bytes within the swizzle span, box dimensions 1..256. The
    boxes may run past head_dim (a head dim not a multiple of the box's columns): the TMA reads
    zeros there and clips stores."""
    if len(shape) != 4 or len(strides) != 4:
        raise TensorMapError(f"tensor map {spec.arg}: expected a 4-D (batch, heads, seq, head_dim) tensor, got shape {tuple(shape)}")
    if dtype not in DATA_TYPES:
        raise TensorMapError(f"tensor map {spec.arg}: no TMA data type for {dtype!r}")
    batch, heads, seq, head_dim = (int(x) for x in shape)
    if strides[3] != 1:
        raise TensorMapError(f"tensor map {spec.arg}: {spec.tensor}'s last dimension must be contiguous, got strides {tuple(strides)}")
    if min(batch, heads, seq, head_dim) < 1 or max(batch, heads, seq, head_dim) > 2**32:
        raise TensorMapError(f"tensor map {spec.arg}: {spec.tensor} of shape {tuple(shape)} has an extent outside 1..2^32")
    columns, rows = spec.box
    if not (1 <= columns <= 256 and 1 <= rows <= 256):
        raise TensorMapError(f"tensor map {spec.arg}: box {spec.box} has a dimension outside 1..256")
    if (columns * ELEMENT_BYTES) % 16 or (spec.swizzle and columns * ELEMENT_BYTES > spec.swizzle):
        raise TensorMapError(f"tensor map {spec.arg}: a box row of {columns * ELEMENT_BYTES} bytes must be a multiple "
                             f"of 16 bytes and fit the {spec.swizzle}-byte swizzle")
    if (head_dim * ELEMENT_BYTES) % 16:
        raise TensorMapError(f"tensor map {spec.arg}: a row of head_dim {head_dim} ({head_dim * ELEMENT_BYTES} bytes) "
                             "must be a multiple of 16 bytes")
    contiguous = (heads * seq * head_dim, seq * head_dim, head_dim)   # batch, heads, seq
    byte_strides = []
    for extent, stride, natural, name in zip((batch, heads, seq), strides[:3], contiguous, ("batch", "heads", "seq")):
        step = (natural if extent == 1 else int(stride)) * ELEMENT_BYTES
        if step <= 0 or step % 16 or step >= 2**40:
            raise TensorMapError(f"tensor map {spec.arg}: {spec.tensor}'s {name} stride {stride} ({step} bytes) must be "
                                 "positive, a multiple of 16 bytes and below 2^40 bytes for TMA (pass a .contiguous() copy)")
        byte_strides.append(step)
    b_stride, h_stride, s_stride = byte_strides
    return MapGeometry(DATA_TYPES[dtype], (head_dim, seq, heads, batch), (s_stride, h_stride, b_stride),
                       (columns, rows, 1, 1), SWIZZLES[spec.swizzle])


def check_address(spec: MapSpec, address: int) -> None:
    """TensorMapError unless ``address`` is 16-byte aligned, as TMA requires."""
    if address % 16:
        raise TensorMapError(f"tensor map {spec.arg}: {spec.tensor}'s data pointer {address:#x} is not 16-byte aligned")


# -- the CUDA driver ----------------------------------------------------------------------------

_ENCODE = ctypes.CFUNCTYPE(
    ctypes.c_int,                                   # CUresult
    ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,   # map, data type, rank, address
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),  # globalDim, globalStrides
    ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),  # boxDim, elementStrides
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,            # interleave, swizzle, l2, oob fill
)
_REPLACE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class Driver:
    """``cuTensorMapEncodeTiled`` and ``cuTensorMapReplaceAddress`` from their addresses."""

    def __init__(self, encode_address: int, replace_address: int) -> None:
        self._encode = _ENCODE(encode_address)
        self._replace = _REPLACE(replace_address)

    @classmethod
    def load(cls, name: str | None = None) -> "Driver":
        """The driver library of this machine (``libcuda.so.1``); TensorMapError without one."""
        candidates = [name] if name else ["libcuda.so.1", ctypes.util.find_library("cuda"), "nvcuda.dll"]
        for candidate in filter(None, candidates):
            try:
                lib = ctypes.CDLL(candidate)
            except OSError:
                continue
            try:
                return cls(ctypes.cast(lib.cuTensorMapEncodeTiled, ctypes.c_void_p).value or 0,
                           ctypes.cast(lib.cuTensorMapReplaceAddress, ctypes.c_void_p).value or 0)
            except AttributeError as exc:
                raise TensorMapError(f"{candidate} has no tensor-map functions (a CUDA 12 driver or newer is needed)") from exc
        raise TensorMapError("TMA kernels need the CUDA driver library (libcuda.so.1), which is not on this machine")

    def encode(self, out: int, geometry: MapGeometry, address: int) -> None:
        """Encode the map of ``geometry`` at ``address`` into the 128 bytes at ``out`` (64-byte aligned)."""
        rank = geometry.rank
        dims = (ctypes.c_uint64 * rank)(*geometry.dims)
        strides = (ctypes.c_uint64 * max(rank - 1, 1))(*geometry.strides)
        box = (ctypes.c_uint32 * rank)(*geometry.box)
        ones = (ctypes.c_uint32 * rank)(*([1] * rank))
        status = self._encode(out, geometry.data_type, rank, address, dims, strides, box, ones,
                              INTERLEAVE_NONE, geometry.swizzle, L2_PROMOTION_256B, OOB_FILL_ZEROS)
        if status:
            raise TensorMapError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for {geometry.describe()}, address {address:#x}")

    def replace_address(self, out: int, address: int) -> None:
        """Point the encoded map at ``out`` to another tensor of the same shape and strides."""
        status = self._replace(out, address)
        if status:
            raise TensorMapError(f"cuTensorMapReplaceAddress failed (CUresult {status}) for address {address:#x}")


_DRIVER: list[Driver] = []


def driver() -> Driver:
    """The process's ``Driver``, loaded at first use."""
    if not _DRIVER:
        _DRIVER.append(Driver.load())
    return _DRIVER[0]


class MapStorage:
    """Host memory for ``count`` tensor maps, each 128 bytes at a 64-byte aligned address."""

    def __init__(self, count: int) -> None:
        self._raw = ctypes.create_string_buffer(MAP_BYTES * max(count, 1) + MAP_ALIGN)
        base = (ctypes.addressof(self._raw) + MAP_ALIGN - 1) & ~(MAP_ALIGN - 1)
        self.addresses = [base + MAP_BYTES * i for i in range(count)]

    def read(self, index: int) -> bytes:
        return ctypes.string_at(self.addresses[index], MAP_BYTES)
