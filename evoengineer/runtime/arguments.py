"""Kernel arguments: the values of a call by name, packed as ``cuLaunchKernel`` reads them (a
ctypes structure and the ``void*`` array pointing into it; tensor maps by address)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}


@dataclass
class PackedArguments:
    """Argument values in a ctypes structure and the ``void*`` array of a ``cuLaunchKernel`` call."""

    values: Any          # ctypes.Structure with one field per non-map argument
    params: Any          # (c_void_p * n): each argument's address, maps into their storage
    maps: Mapping[str, int]

    @property
    def address(self) -> int:
        return ctypes.addressof(self.params)

    def set(self, name: str, value: int | float) -> None:
        setattr(self.values, name, value)


def pack_arguments(arguments: Sequence[tuple[str, str]], values: Mapping[str, int | float],
                   maps: Mapping[str, int]) -> PackedArguments:
    """Pack ``values`` by name for ``arguments`` ((name, kind), kind one of ``ptr``, ``i32``,
    ``i64``, ``f32``, ``tmap``); a ``tmap`` argument points at the address ``maps`` gives it.
    KeyError names a missing value."""
    fields = tuple((name, kind) for name, kind in arguments if kind != "tmap")
    struct = _structure(fields)()
    for name, _ in fields:
        if name not in values:
            raise KeyError(f"no value for kernel argument {name!r}")
        setattr(struct, name, values[name])
    base = ctypes.addressof(struct)
    pointers = [maps[name] if kind == "tmap" else base + getattr(type(struct), name).offset for name, kind in arguments]
    params = (ctypes.c_void_p * len(arguments))(*pointers)
    return PackedArguments(struct, params, dict(maps))


@lru_cache(maxsize=256)
def _structure(fields: tuple[tuple[str, str], ...]) -> type:
    """The ctypes structure of these (name, kind) fields (one class per argument list, not per call)."""
    return type("KernelArguments", (ctypes.Structure,), {"_fields_": [(name, CTYPES[kind]) for name, kind in fields]})


def scalar_values(batch: int, heads: int, heads_kv: int, seq_q: int, seq_k: int, q_strides: Sequence[int],
                  k_strides: Sequence[int], v_strides: Sequence[int], o_strides: Sequence[int],
                  scale_log2: float) -> dict[str, int | float]:
    """The scalar kernel arguments of a call, by name (pointers are set per call)."""
    return {
        "B": batch, "H": heads, "H_kv": heads_kv, "S_q": seq_q, "S_k": seq_k,
        "q_sb": q_strides[0], "q_sh": q_strides[1], "q_ss": q_strides[2],
        "k_sb": k_strides[0], "k_sh": k_strides[1], "k_ss": k_strides[2],
        "v_sb": v_strides[0], "v_sh": v_strides[1], "v_ss": v_strides[2],
        "o_sb": o_strides[0], "o_sh": o_strides[1], "o_ss": o_strides[2],
        "scale_log2": scale_log2,
    }


def element_strides(t: Any) -> tuple[int, ...]:
    """Strides of the first three dims in elements; a dimension of size 1 gets 0 (never stepped)."""
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape[:3], t.stride()[:3]))
