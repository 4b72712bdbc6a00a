"""The README's quick start, run as typed on a GPU (the install and test lines aside): search
the built-in L4 space, leaderboard, report, export, then the PyTorch snippet. Takes minutes:
the search spends the space's own budget (60 evaluations or 10 minutes)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_readme import REPO, quick_start  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(1800)
def test_quick_start_as_typed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the report needs matplotlib (the quick start installs .[test])")
    lines, python = quick_start()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = None
    for line in lines:
        if not line.startswith("evoengineer "):
            continue  # pip install, pytest: not from inside the tests
        if "<run>" in line:
            assert run is not None, "the quick start uses runs/<run> before a search made one"
            line = line.replace("runs/<run>", str(run.relative_to(tmp_path)))
        argv = [sys.executable, "-m", "evoengineer", *shlex.split(line)[1:]]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1500)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if shlex.split(line)[1] == "search":
            runs = sorted(p.parent for p in (tmp_path / "runs").glob("*/run.json"))
            assert len(runs) == 1
            run = runs[0]
            assert str(run.relative_to(tmp_path)) in proc.stdout  # search printed the directory the README refers to
    assert run is not None and (run / "report.html").exists() and (tmp_path / "best" / "evo_attention" / "__init__.py").exists()
    snippet = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert snippet.returncode == 0, snippet.stderr
