"""A configuration of template parameters: a frozen, hashable value object."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .. import paths

ParamValue = int | str | bool


@dataclass(frozen=True)
class Config(Mapping[str, ParamValue]):
    """Parameter name -> value, order-independent, hashable like Triton's ``Config``.

    ``Config(BLOCK_M=64, PATH="wmma") == Config(PATH="wmma", BLOCK_M=64)``.
    """

    items_: tuple[tuple[str, ParamValue], ...]
    unused_: tuple[tuple[str, ParamValue], ...] = field(default=(), compare=False)
    """Parameters of the space this configuration's path does not use, at their neutral values
    (``evoengineer.paths.NEUTRAL``): not part of the mapping, only of ``key()``."""

    def __init__(self, values: Mapping[str, ParamValue] | None = None, /, *,
                 unused: Mapping[str, ParamValue] | None = None, **kwargs: ParamValue) -> None:
        merged = {**(dict(values) if values else {}), **kwargs}
        object.__setattr__(self, "items_", tuple(sorted(merged.items())))
        object.__setattr__(self, "unused_", tuple(sorted((k, v) for k, v in (unused or {}).items() if k not in merged)))
        object.__setattr__(self, "_values", dict(self.items_))  # a lookup, not a field: equality and hash use items_
        object.__setattr__(self, "_hash", hash(self.items_))  # computed once: configurations key many sets and dicts

    def __getitem__(self, name: str) -> ParamValue:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self.items_)

    def __len__(self) -> int:
        return len(self.items_)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        """Rebuilt from its values in another process (whose string hashes differ)."""
        return (Config, (self._values,))

    def __repr__(self) -> str:
        return f"Config({self.label()})"

    def replace(self, **changes: ParamValue) -> "Config":
        """The same with ``changes``; a changed parameter its path does not use joins the mapping."""
        return Config({**self._values, **changes}, unused=dict(self.unused_))

    def label(self) -> str:
        """``BLOCK_M=64,BLOCK_N=64,PATH=wmma``: the form ``--config`` accepts."""
        return ",".join(f"{k}={v}" for k, v in self.items_)

    def short_label(self) -> str:
        """A compact label for tables, e.g. ``mma 64x128 w4 st2 q p`` (``--config`` takes ``label()``).

        In order: PATH; BLOCK_MxBLOCK_N; ``w`` WARPS; ``v`` VEC; ``st`` STAGES; SMEM_LAYOUT's
        value; ``q`` for Q_IN_REGS=1, ``p`` for P_IN_REGS=1; ``s`` SPLITS; ``g`` KV_GROUPS. A
        parameter at its neutral value is left out (VEC 8, STAGES 1, SMEM_LAYOUT swizzle,
        Q_IN_REGS and P_IN_REGS 0, SPLITS 1, KV_GROUPS 1, PACK_GQA 0); any other parameter follows as
        ``NAME=value``, in name order. The same configuration always gets the same label.
        On the wgmma path (``wgmma 128x192 st2 r24/240 ovl pp``) WARPS and VEC are unused
        and left out, the consumer warpgroups follow from BLOCK_M, ``pr`` is the producer
        warpgroup, ``r`` the setmaxnreg pair (producer/consumer, with a producer), ``ovl`` the
        intra-warpgroup overlap (``ov2``: INTRA_WG_OVERLAP=2; ``ovq`` and ``oq2`` the same with
        Q_IN_REGS=1, Q K^T reading Q from registers; ``ovl3``, ``ovq2``: with SOFTMAX_PIN 3 or 2,
        the part of the softmax held before the wait for P V), ``pp`` ping-pong,
        ``pin`` SOFTMAX_PIN, ``ot`` O_TMA and ``cut`` SPLIT_TAIL (where they are not in the path's name, below);
        with LOAD=tma (loads by the tensor memory accelerator) the path reads
        ``tma`` (``tma 128x128 st2 r24/240 ovl pp``), which keeps the label as short as its cp.async twin's,
        and ``ptma`` with PERSISTENT=1 as well (``ptma 128x176 st2 r24/240 ovl pp``: persistent CTAs),
        ``ptmao`` with O_TMA=1 too (their O stored by TMA); ``dtma`` and ``dtmao`` with PERSISTENT=2
        (persistent CTAs taking their work tiles from a counter), ``stma`` and ``stmao`` with
        SPLIT_TAIL=1 too (a short last round of tiles cut over every CTA), ``htma`` and ``htmao`` with
        SPLIT_TAIL=2 (a last round up to half full cut). A backward configuration reads ``bwd``
        (``bwdt``: dK/dV in 2-D warp tiles) and ``dq=atomic`` or ``dq=sep64x32``.
        """
        values: dict[str, Any] = dict(self.items_)
        path = paths.label_path(values)
        if path is not None and path.label is not None:  # the path's own tokens (wgmma: warpgroups, loads, overlap)
            path.label(values)
        parts = [str(values.pop("PATH"))] if "PATH" in values else []
        if "BLOCK_M" in values and "BLOCK_N" in values:
            parts.append(f"{values.pop('BLOCK_M')}x{values.pop('BLOCK_N')}")
        for name, prefix, neutral in _SHORT:
            if name not in values:
                continue
            value = values.pop(name)
            if value == neutral:
                continue
            if neutral == 0 and value in (1, True):  # an on/off switch: its letter alone
                parts.append(prefix)
            elif name == "INTRA_WG_OVERLAP":  # ``ov2``: as long as ``ovl``, so labels keep within 33 characters
                parts.append(value if isinstance(value, str) else f"ov{_text(value)}")
            else:
                parts.append(f"{prefix}{_text(value)}")
        parts += [f"{name}={_text(value)}" for name, value in sorted(values.items())]
        return " ".join(parts)

    def canonical(self) -> dict[str, ParamValue]:
        """Every parameter of the space, those the path does not use at their neutral values:
        what ``key()`` hashes."""
        return {**dict(self.unused_), **self._values}

    def key(self) -> str:
        """Stable short hash of the parameters (same on every machine and run); a path's unused
        parameters count at their neutral values, so the key is the one the configuration had
        when every path carried every parameter of its space."""
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.items_)

    @classmethod
    def parse(cls, text: str) -> "Config":
        """Parse ``BLOCK_M=64,PATH=wmma`` (integers become ``int``; true/false become ``bool``)."""
        values: dict[str, ParamValue] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ValueError(f"expected NAME=VALUE, got {part!r}")
            name, raw = (s.strip() for s in part.split("=", 1))
            values[name] = _coerce(raw)
        return cls(values)


_SHORT: tuple[tuple[str, str, ParamValue | None], ...] = (
    # parameter, prefix in ``short_label``, neutral value (left out); None: always shown
    ("WARPS", "w", None),
    ("VEC", "v", 8),
    ("STAGES", "st", 1),
    ("SMEM_LAYOUT", "", "swizzle"),
    ("Q_IN_REGS", "q", 0),
    ("P_IN_REGS", "p", 0),
    ("SPLITS", "s", 1),
    ("KV_GROUPS", "g", 1),
    ("PACK_GQA", "pk", 0),
    ("CONSUMER_WGS", "c", 1),
    ("PRODUCER", "pr", 0),
    ("SETMAXNREG", "r", None),
    ("REG_PRODUCER", "rp", 0),
    ("REG_CONSUMER", "rc", 0),
    ("INTRA_WG_OVERLAP", "ovl", 0),
    ("PINGPONG", "pp", 0),
    ("PERSISTENT", "pers", 0),
    ("SOFTMAX_PIN", "pin", 0),
    ("O_TMA", "ot", 0),
    ("SPLIT_TAIL", "cut", 0),
    ("LOAD", "", "cpasync"),
)


def _text(value: ParamValue) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _coerce(raw: str) -> ParamValue:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(raw)
    except ValueError:
        return raw
