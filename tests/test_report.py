"""``evoengineer report``: one self-contained HTML file about a run. A replayed search (real
subprocesses, a real SQLite study), then the report: well-formed HTML with every section,
no external asset, every embedded image a PNG that matplotlib reads back; opened in a headless
browser where the machine has one."""
from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from h100_data import FINALISTS, LABELS, SDPA_US, h100_baseline, h100_board, h100_cases

from evoengineer.gpu import SDPA_BACKENDS
from evoengineer.results.report import SECTIONS, shape_winners, write_report
from evoengineer.space import Config, load_space

DATA = Path(__file__).resolve().parent / "data"
REPO = DATA.parent.parent
PNG = b"\x89PNG\r\n\x1a\n"
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


class Page(HTMLParser):
    """Reads a page: nesting errors, section ids and headings, images, anything fetched from elsewhere, table rows."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.doctype = ""
        self.sections: dict[str, str] = {}
        self.images: list[str] = []
        self.external: list[str] = []
        self.rows: list[list[str]] = []
        self._section = ""
        self._cell: list[str] | None = None
        self._heading: list[str] | None = None
        self.feed(text)
        self.close()
        if self.stack:
            self.errors.append(f"left open: {self.stack}")

    def handle_decl(self, decl: str) -> None:
        self.doctype = decl

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "section":
            self._section = a.get("id") or ""
        if tag == "h2":
            self._heading = []
        if tag == "tr":
            self.rows.append([])
        if tag in ("td", "th"):
            self._cell = []
        if tag == "img":
            self.images.append(a.get("src") or "")
        if tag in ("script", "link", "iframe", "object", "embed"):
            self.external.append(f"<{tag}>")
        for key in ("src", "href"):
            value = a.get(key)
            if value is not None and not value.startswith(("data:image/png;base64,", "#")):
                self.external.append(value)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()
        if tag == "h2" and self._heading is not None:
            self.sections[self._section] = "".join(self._heading).strip()
            self._heading = None
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._heading is not None:
            self._heading.append(data)
        if self._cell is not None:
            self._cell.append(data)


def check_page(path: Path) -> tuple[Page, str]:
    """Well-formed, every section, nothing external, every image a PNG matplotlib reads back."""
    import matplotlib.image

    text = path.read_text(encoding="utf-8")
    page = Page(text)
    assert page.errors == [], page.errors[:5]
    assert page.doctype.lower() == "doctype html"
    assert list(page.sections) == list(SECTIONS), page.sections
    assert page.external == []
    assert page.images, "no figure"
    for src in page.images:
        blob = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert blob.startswith(PNG) and len(blob) > 1000
        pixels = matplotlib.image.imread(io.BytesIO(blob), format="png")
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert pixels.std() > 0  # not a blank image
    return page, text


def section_text(text: str, anchor: str) -> str:
    start = text.index(f'<section id="{anchor}">')
    return text[start:text.index("</section>", start)]


@pytest.fixture(scope="module")
def replayed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("matplotlib", reason="the report needs matplotlib (pip install 'evoengineer[plot]')")
    root = tmp_path_factory.mktemp("report")
    run = root / "runs" / "replayed"
    done = cli("search", "--space", str(DATA / "replay_small_space.yaml"), "--replay", str(DATA / "replay_small_h100.jsonl"),
               "--strategy", "tpe", "--trials", "24", "--top-k", "5", "--run-dir", str(run), "--quiet", cwd=root)
    assert done.returncode == 0, done.stderr + done.stdout
    return run


def test_report_of_a_replayed_search(replayed_run: Path) -> None:
    run = replayed_run
    made = cli("report", str(run), cwd=run.parent)
    assert made.returncode == 0, made.stderr
    out = run / "report.html"
    assert made.stdout.strip() == f"wrote {out}"
    page, text = check_page(out)
    assert len(page.images) == 4  # best so far over evaluations, over time; every evaluation; importances

    results = [json.loads(l) for l in (run / "results.jsonl").read_text().splitlines()]
    assert ["all", str(len(results)), str(len(results))] in page.rows  # the per-path, per-status counts add up
    for r in results:
        assert Config(r["config"]).short_label() in section_text(text, "evaluations")
    board = json.loads((run / "leaderboard.json").read_text())
    leaderboard = section_text(text, "leaderboard")
    for e in board["entries"]:
        assert f"{e['geomean_us']:.2f}" in leaderboard and Config(e["config"]).label() in leaderboard
    importance = section_text(text, "importance")
    space = load_space(DATA / "replay_small_space.yaml")
    assert all(f">{name}<" in importance for name in space.param_names)
    assert "completion time in the study" in section_text(text, "progress")
    assert "no per-shape timings" in section_text(text, "shapes")  # a replay records one objective per configuration
    environment = section_text(text, "environment")  # the recording's GPU, marked as a replay, and the recording
    assert "(replay)" in environment and "replay_small_h100.jsonl" in environment and "tpe" in environment


def test_report_moves_with_its_run_directory(replayed_run: Path, tmp_path: Path) -> None:
    """The study's SQLite URL is absolute; a run directory copied elsewhere still finds its study."""
    moved = tmp_path / "elsewhere"
    shutil.copytree(replayed_run, moved)
    meta = json.loads((moved / "run.json").read_text())
    meta["storage"] = "sqlite:////nonexistent/dir/study.db"
    (moved / "run.json").write_text(json.dumps(meta))
    _, text = check_page(write_report(moved, tmp_path / "r.html"))
    assert "<img" in section_text(text, "importance")
    assert not Path("/nonexistent/dir/study.db").exists()


def gpu_like_run(root: Path) -> Path:
    """A run directory as a search on an H100 leaves it (per-shape timings, SDPA baseline, a
    re-timed leaderboard), whose study storage is gone."""
    run = root / "runs" / "20250301-101500-h100-3f9a1c"
    (run / "sources").mkdir(parents=True)
    (run / "space.yaml").write_text((REPO / "search_spaces" / "h100.yaml").read_text())
    records = []
    for config, times, err, regs, smem in FINALISTS:
        records.append({"config": config, "key": Config(config).key(), "status": "ok", "reason": "",
                        "resources": {"registers": regs, "smem": smem, "spill_bytes": 0}, "cases": h100_cases(times, err),
                        "objective_us": sum(times) / len(times), "eval_s": 2.5})
    failed = {**FINALISTS[0][0], "BLOCK_N": 128}
    records.insert(2, {"config": failed, "key": Config(failed).key(), "status": "incorrect",
                       "reason": "B4 H16 S2048 D64: max abs error 0.31 > atol 0.02", "resources": {}, "cases": [], "objective_us": None,
                       "eval_s": 1.5})
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "baseline.json").write_text(json.dumps(h100_baseline()))
    (run / "leaderboard.json").write_text(json.dumps(h100_board()))
    env = {"status": "ok", "gpu": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "sms": 132, "memory_gb": 79.2, "l2_mb": 50.0,
           "torch": "2.11.0+cu130", "torch_cuda": "13.0", "cupy": "14.2.0", "cuda_runtime": 13000, "cuda_driver": 13000,
           "python": "3.12.3", "optuna": "4.5.0", "driver": "580.159.04", "sm_clock": "1980 MHz", "max_sm_clock": "1980 MHz"}
    (run / "env.json").write_text(json.dumps(env))
    (run / "run.json").write_text(json.dumps({
        "space": "h100", "strategy": "evo", "seed": 0, "storage": f"sqlite:///{run / 'gone' / 'study.db'}", "study_name": run.name,
        "trials": 7, "top_k": 6, "started": "2025-03-01T10:15:00+0000", "finished": "2025-03-01T10:21:40+0000", "gpu": env,
        "arch": "sm_90", "shapes": None}))
    return run


def test_report_per_shape_winners_against_sdpa_and_a_missing_study(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the report needs matplotlib (pip install 'evoengineer[plot]')")
    run = gpu_like_run(tmp_path)
    made = cli("report", str(run), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    page, text = check_page(run / "report.html")
    assert len(page.images) == 3  # no importances without the study

    shapes = section_text(text, "shapes")
    for i, label in enumerate(LABELS):
        config, times, *_ = min(FINALISTS, key=lambda f: f[1][i])
        fastest = min(SDPA_BACKENDS, key=lambda b: SDPA_US[b][i])
        row = next(r for r in page.rows if r and r[0] == label)
        assert row[1:3] == [Config(config).short_label(), f"{times[i]:.2f}"]
        assert row[5:8] == [fastest, f"{SDPA_US[fastest][i]:.2f}", f"{SDPA_US[fastest][i] / times[i]:.2f}"]
    assert "B4 H16 S2048 D128 causal" in shapes

    assert "does not exist" in section_text(text, "importance")
    assert "durations added up" in section_text(text, "progress")
    leaderboard = section_text(text, "leaderboard")
    assert all(f"× {b}" in leaderboard for b in SDPA_BACKENDS) and "SDPA cudnn" in leaderboard
    assert "re-timed interleaved" in leaderboard
    assert ["PATH", "ok", "incorrect", "all"] in page.rows and ["mma", "4", "1", "5"] in page.rows
    environment = section_text(text, "environment")
    assert "580.159.04" in environment and "NVIDIA H100 80GB HBM3" in environment


def test_shape_winners_take_the_fastest_ok_timed_case() -> None:
    a = {"config": {"PATH": "mma"}, "status": "ok", "cases": [{"label": "S1", "status": "ok", "time": {"median_us": 5.0}},
                                                              {"label": "S2", "status": "ok", "time": {"median_us": 9.0}},
                                                              {"label": "edge", "status": "ok", "max_abs_err": 1e-4}]}
    b = {"config": {"PATH": "wmma"}, "status": "ok", "cases": [{"label": "S1", "status": "ok", "time": {"median_us": 6.0}},
                                                               {"label": "S2", "status": "ok", "time": {"median_us": 8.0}}]}
    c = {"config": {"PATH": "scalar"}, "status": "incorrect", "cases": [{"label": "S1", "status": "ok", "time": {"median_us": 1.0}}]}
    winners = shape_winners([a, b, c])
    assert {k: (v["config"]["PATH"], v["median_us"]) for k, v in winners.items()} == {"S1": ("mma", 5.0), "S2": ("wmma", 8.0)}


def test_report_notes_a_study_too_small_for_importances(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the report needs matplotlib (pip install 'evoengineer[plot]')")
    run = tmp_path / "run"
    done = cli("search", "--space", str(DATA / "replay_small_space.yaml"), "--replay", str(DATA / "replay_small_h100.jsonl"),
               "--strategy", "random", "--trials", "1", "--top-k", "1", "--run-dir", str(run), "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    _, text = check_page(write_report(run))
    importance = section_text(text, "importance")
    assert "could not compute importances" in importance and "<img" not in importance


def test_report_without_matplotlib_says_what_to_install(tmp_path: Path) -> None:
    hidden = tmp_path / "hide"
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    run = gpu_like_run(tmp_path)
    proc = cli("report", str(run), cwd=tmp_path, env={"PYTHONPATH": os.pathsep.join([str(hidden), str(REPO)])})
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "evoengineer[plot]" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "report.html").exists()
    bad = cli("report", str(tmp_path / "nothing"), cwd=tmp_path)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "firefox")


def test_report_opens_in_a_headless_browser(replayed_run: Path, tmp_path: Path) -> None:
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip(f"no headless browser on this machine (looked for {', '.join(BROWSERS)}); the HTML is checked with html.parser")
    out = tmp_path / "report.html"
    assert cli("report", str(replayed_run), "--out", str(out), cwd=tmp_path).returncode == 0
    shot = tmp_path / "shot.png"
    if "firefox" in Path(browser).name:
        proc = subprocess.run([browser, "--headless", "--screenshot", str(shot), "--window-size=1200,2400", out.as_uri()],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
    else:
        common = [browser, "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={tmp_path / 'profile'}"]
        dom = subprocess.run([*common, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=180)
        assert dom.returncode == 0, dom.stderr
        assert all(f'id="{s}"' in dom.stdout for s in SECTIONS)
        proc = subprocess.run([*common, f"--screenshot={shot}", "--window-size=1200,2400", out.as_uri()],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
    assert shot.read_bytes().startswith(PNG)
