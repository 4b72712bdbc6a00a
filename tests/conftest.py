from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken torch install means no GPU here
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def space_file(tmp_path: Path):
    """Write a variant of the built-in l4 space with edits applied; returns its path."""
    import yaml

    base = yaml.safe_load((REPO / "search_spaces" / "l4.yaml").read_text())

    def make(edit=None, text: str | None = None, name: str = "space.yaml") -> Path:
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        else:
            data = yaml.safe_load(yaml.safe_dump(base))
            if edit:
                edit(data)
            path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return make
