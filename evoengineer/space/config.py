"""A configuration of template parameters: a frozen, hashable value object."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

ParamValue = int | str | bool


@dataclass(frozen=True)
class Config(Mapping[str, ParamValue]):
    """Parameter name -> value, order-independent, hashable like Triton's ``Config``.

    ``Config(BLOCK_M=64, PATH="wmma") == Config(PATH="wmma", BLOCK_M=64)``.
    """

    items_: tuple[tuple[str, ParamValue], ...]

    def __init__(self, values: Mapping[str, ParamValue] | None = None, /, **kwargs: ParamValue) -> None:
        merged = {**(dict(values) if values else {}), **kwargs}
        object.__setattr__(self, "items_", tuple(sorted(merged.items())))

    def __getitem__(self, name: str) -> ParamValue:
        for key, value in self.items_:
            if key == name:
                return value
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self.items_)

    def __len__(self) -> int:
        return len(self.items_)

    def __hash__(self) -> int:
        return hash(self.items_)

    def __repr__(self) -> str:
        return f"Config({self.label()})"

    def replace(self, **changes: ParamValue) -> "Config":
        return Config({**dict(self.items_), **changes})

    def label(self) -> str:
        """``BLOCK_M=64,BLOCK_N=64,PATH=wmma``: the form ``--config`` accepts."""
        return ",".join(f"{k}={v}" for k, v in self.items_)

    def key(self) -> str:
        """Stable short hash of the parameters (same on every machine and run)."""
        blob = json.dumps(dict(self.items_), sort_keys=True, separators=(",", ":"))
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


def _coerce(raw: str) -> ParamValue:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(raw)
    except ValueError:
        return raw
