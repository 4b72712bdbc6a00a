"""The search command end to end on a recording (no GPU): run, kill -9, resume,
leaderboard, export, plot. Real subprocesses, real SQLite."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from run_fixtures import recorded_keys  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
RECORDING = DATA / "replay_synthetic.jsonl"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", *args], capture_output=True, text=True, cwd=cwd, timeout=300)




def test_search_killed_with_sigkill_resumes_without_losing_or_repeating(tmp_path: Path, space_yaml: Path) -> None:
    run = tmp_path / "run"
    args = ["search", "--space", str(space_yaml), "--replay", str(RECORDING), "--trials", "40", "--strategy", "evo",
            "--run-dir", str(run), "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "evoengineer", *args, "--replay-delay", "0.1"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        results = run / "results.jsonl"
        if results.exists() and len(results.read_text().splitlines()) >= 12:
            break
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = recorded_keys(run)
    assert 12 <= len(before) < 40

    resumed = cli(*args, "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    after = recorded_keys(run)
    assert after[: len(before)] == before  # nothing lost
    assert len(after) == len(set(after)) == 40  # nothing repeated, budget honoured

    study = optuna.load_study(study_name=run.name, storage=f"sqlite:///{run / 'study.db'}")
    done = [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
            and t.user_attrs.get("status") != "interrupted"]
    assert len(done) == 40
    assert {t.user_attrs["config_key"] for t in done} == set(after)


def test_leaderboard_and_export_from_a_run(tmp_path: Path, space_yaml: Path) -> None:
    run = tmp_path / "run"
    done = cli("search", "--space", str(space_yaml), "--replay", str(RECORDING), "--trials", "25", "--strategy", "random",
               "--run-dir", str(run), "--top-k", "3", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "evaluations per minute" in done.stdout

    board = json.loads(cli("leaderboard", str(run), "--json", cwd=tmp_path).stdout)
    times = [e["geomean_us"] for e in board["entries"]]
    assert len(times) == 3 and times == sorted(times)
    recorded = sorted(json.loads(l)["objective_us"] for l in (run / "results.jsonl").read_text().splitlines()
                      if json.loads(l)["status"] == "ok")
    assert times[0] == pytest.approx(recorded[0])
    csv_text = cli("leaderboard", str(run), "--csv", cwd=tmp_path).stdout
    assert csv_text.splitlines()[0].startswith("rank,config,geomean_us")

    listed = json.loads(cli("runs", "--root", str(tmp_path), "--json", cwd=tmp_path).stdout)
    assert listed and listed[0]["evaluations"] == 25

    out = tmp_path / "best"
    exported = cli("export", str(run), "--rank", "1", "--out", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    info = json.loads((out / "kernel.json").read_text())
    assert info["config"] == board["entries"][0]["config"]
    assert {(k["head_dim"], k["causal"]) for k in info["kernels"]} == {(64, False), (64, True)}
    # the module stands alone: import it from another directory with only torch and cupy
    check = subprocess.run(
        [sys.executable, "-c",
         "import sys, torch; sys.path.insert(0, sys.argv[1]); from evo_attention import attention, CONFIGS\n"
         "q = torch.zeros(1, 2, 8, 64, dtype=torch.float16)\n"
         "try:\n    attention(q, q, q)\nexcept ValueError as e:\n    print('rejected:', e)\n"
         "try:\n    attention(q.float(), q, q)\nexcept TypeError as e:\n    print('rejected:', e)\n",
         str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "rejected: attention: q, k and v must be CUDA tensors, got device cpu" in check.stdout, check.stderr
    assert "rejected: attention: q, k and v must have one dtype, got q torch.float32" in check.stdout

    # without --rank: per-case winners; a replayed run records no per-case times, so its rank 1 serves every call
    per_shape = cli("export", str(run), "--out", str(tmp_path / "per-shape"), cwd=tmp_path)
    assert per_shape.returncode == 0, per_shape.stderr
    info = json.loads((tmp_path / "per-shape" / "kernel.json").read_text())
    assert info["mode"] == "per-shape" and info["dispatch"]["table"] == [] and list(info["configs"]) == [board["entries"][0]["key"]]

    # last, what needs the optional matplotlib (evoengineer[plot]): skipped, not failed, without it
    pytest.importorskip("matplotlib", reason="evoengineer plot needs matplotlib: pip install 'evoengineer[plot]'")
    plotted = cli("plot", str(run), "--out", str(tmp_path / "progress.png"), cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_search_without_gpu_points_to_check(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = cli("search", "--space", "spaces/l4.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    assert "evoengineer check" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # a search that could not start leaves no run directory
    named = cli("search", "--space", "l4", "--run-dir", str(tmp_path / "mine"), cwd=tmp_path)
    assert named.returncode == 2 and not (tmp_path / "mine").exists()


def test_two_searches_share_one_study(tmp_path: Path, space_yaml: Path) -> None:
    """Scale-out: two processes, one SQLite storage and study name, separate run directories:
    one budget, no configuration evaluated twice."""
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    procs = [
        subprocess.Popen([sys.executable, "-m", "evoengineer", "search", "--space", str(space_yaml), "--replay", str(RECORDING),
                          "--trials", "40", "--strategy", "evo", "--seed", str(i), "--run-dir", str(tmp_path / f"run{i}"),
                          "--storage", storage, "--study", "shared", "--quiet", "--replay-delay", "0.2"],
                         cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for i in (1, 2)
    ]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    keys = recorded_keys(tmp_path / "run1") + recorded_keys(tmp_path / "run2")
    assert len(keys) == len(set(keys)), "a configuration was evaluated twice"
    assert len(keys) == 40  # the budget is shared exactly
    # both take part (how evenly depends on when each process got going: they start seconds apart here)
    assert len(recorded_keys(tmp_path / "run1")) >= 8 and len(recorded_keys(tmp_path / "run2")) >= 8
    study = optuna.load_study(study_name="shared", storage=storage)
    done = [t for t in study.trials if t.user_attrs.get("status") in ("ok", "invalid", "compile_failed", "launch_failed",
                                                                       "incorrect", "crashed", "timeout")]
    assert sorted(t.user_attrs["config_key"] for t in done) == sorted(keys)


def _summary(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())["summary"]


def test_one_search_on_several_devices(tmp_path: Path, space_yaml: Path) -> None:
    """--devices: one search process, one lane per (simulated) device, N evaluations in
    flight. With 1 s per evaluation, 2 devices evaluate >= 1.8x and 4 devices >= 3.5x as
    many per minute as one; the budget is met exactly and no configuration repeats."""
    delay = 1.0
    rates = {}
    for devices, trials in (("0", 8), ("0,1", 32), ("0,1,2,3", 48)):
        run = tmp_path / f"run-{devices.replace(',', '')}"
        done = cli("search", "--space", str(space_yaml), "--replay", str(RECORDING), "--trials", str(trials), "--strategy", "evo",
                   "--devices", devices, "--replay-delay", str(delay), "--run-dir", str(run), "--quiet", cwd=tmp_path)
        assert done.returncode == 0, done.stderr + done.stdout
        keys = recorded_keys(run)
        assert len(keys) == len(set(keys)) == trials, f"{devices}: {len(keys)} records, {len(set(keys))} distinct"
        summary = _summary(run)
        n = len(devices.split(","))
        assert summary["devices"] == n and summary["evaluated"] == trials
        assert sorted(summary["per_device"]) == devices.split(",")
        assert min(summary["per_device"].values()) >= trials / n - 2, summary["per_device"]
        records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
        assert {str(r["device"]) for r in records} == set(devices.split(","))
        rates[n] = summary["evaluations_per_minute"]
    assert rates[1] <= 60 / delay * 1.01
    assert rates[2] >= 1.8 * rates[1], rates
    assert rates[4] >= 3.5 * rates[1], rates


def test_devices_argument_errors(tmp_path: Path, space_yaml: Path) -> None:
    base = ["search", "--space", str(space_yaml), "--replay", str(RECORDING), "--quiet", "--trials", "2"]
    for devices, needle in (("0,0", "distinct"), ("a,b", "device indices"), ("all", "replay")):
        proc = cli(*base, "--devices", devices, "--run-dir", str(tmp_path / devices.replace(",", "")), cwd=tmp_path)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    both = cli(*base, "--devices", "0,1", "--device", "1", "--run-dir", str(tmp_path / "both"), cwd=tmp_path)
    assert both.returncode == 2 and "--device and --devices" in both.stderr
    gone = cli("search", "--space", str(space_yaml), "--replay", str(tmp_path / "gone.jsonl"), "--run-dir", str(tmp_path / "g"), cwd=tmp_path)
    assert gone.returncode == 2 and "--replay" in gone.stderr and "gone.jsonl" in gone.stderr and "Traceback" not in gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1 and not (tmp_path / "g").exists()


def test_candidates_compile_ahead_and_their_sources_are_kept(tmp_path: Path, space_yaml: Path) -> None:
    """The search loop compiles the next candidates in other processes (real NVRTC) and keeps
    each candidate's source in the run directory; the recording answers for the GPU."""
    from evoengineer.search import ReplayCandidates, RunDir, open_study, run_search
    from evoengineer.search.loop import SWITCH_INTERVAL_S
    from evoengineer.space import load_space

    space = load_space(space_yaml)
    run = RunDir.create(tmp_path / "runs", space)
    study = open_study(space, run, strategy="random", seed=3, storage=None, study_name=None, resume=False)
    replay = ReplayCandidates(RECORDING)
    intervals: list[float] = []

    class Recording:
        def evaluate(self, config, report=None):
            intervals.append(sys.getswitchinterval())
            return replay.evaluate(config, report)

    before = sys.getswitchinterval()
    stats = run_search(space, Recording(), run, study, arch="sm_90", trials=4, build=True, compile_workers=2)
    assert stats.evaluated == 4 and sum(stats.counts.values()) == 4
    # lanes get the interpreter back within SWITCH_INTERVAL_S while the search runs, and only then
    assert intervals == [pytest.approx(min(before, SWITCH_INTERVAL_S))] * 4
    assert sys.getswitchinterval() == before
    keys = recorded_keys(run.path)
    sources = sorted(p.name for p in (run.path / "sources").iterdir())
    assert sources == sorted(f"{k}-{v.label()}.cu" for k in keys for v in space.variants)
    assert all("LAUNCH" in (run.path / "sources" / name).read_text() for name in sources)


def test_one_warmed_compile_pool_serves_every_partition(tmp_path: Path, space_yaml: Path) -> None:
    """``compile_pool`` starts its processes at once (each first imports the builds' modules and
    loads NVRTC), and ``run_search`` given it compiles with it and leaves it running for the next
    partition."""
    from evoengineer.search import ReplayCandidates, RunDir, open_study, run_search
    from evoengineer.search.loop import compile_pool
    from evoengineer.space import load_space

    space = load_space(space_yaml)
    pool = compile_pool(2)
    try:
        assert pool.submit(os.getpid).result() != os.getpid()
        for name in ("first", "second"):
            run = RunDir.create(tmp_path / name, space)
            study = open_study(space, run, strategy="random", seed=3, storage=None, study_name=None, resume=False)
            stats = run_search(space, ReplayCandidates(RECORDING), run, study, arch="sm_90", trials=3, build=True,
                               compile_workers=2, pool=pool)
            assert stats.evaluated == 3
            assert len(list((run.path / "sources").iterdir())) == 3 * len(space.variants)   # compiled, sources kept
        assert pool.submit(sum, (1, 2)).result() == 3   # not shut down by either search
    finally:
        pool.shutdown(wait=True)


def test_compile_processes_run_below_the_search() -> None:
    """The search's compile pool lowers its own priority, so GPU workers and the search
    thread get a core when every compile process is busy."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from evoengineer.search.loop import COMPILE_NICENESS, _compile_process_init

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_compile_process_init) as pool:
        assert pool.submit(os.nice, 0).result() == min(19, os.nice(0) + COMPILE_NICENESS)


def test_search_restricted_to_one_shape_records_it_and_resumes_with_it(tmp_path: Path, space_yaml: Path) -> None:
    doc = yaml.safe_load(space_yaml.read_text())
    doc["problem"]["shapes"].append({"B": 2, "H": 4, "S": 256, "D": 64, "causal": [False, True]})
    two = tmp_path / "two_shapes.yaml"
    two.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = tmp_path / "run"
    base = ["search", "--space", str(two), "--replay", str(RECORDING), "--strategy", "random", "--run-dir", str(run), "--quiet"]

    done = cli(*base, "--trials", "6", "--shape", "2,4,256,64", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    meta = json.loads((run / "run.json").read_text())
    assert meta["shapes"] == ["2,4,256,64"]
    assert sorted(meta["case_flops"]) == ["B2 H4 S256 D64", "B2 H4 S256 D64 causal"]

    other = cli(*base, "--trials", "8", "--resume", "--shape", "1,8,512,64", cwd=tmp_path)
    assert other.returncode == 2 and "--resume" in other.stderr and "Traceback" not in other.stderr
    resumed = cli(*base, "--trials", "8", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert json.loads((run / "run.json").read_text())["shapes"] == ["2,4,256,64"]
    assert len(recorded_keys(run)) == 8

    missing = cli("search", "--space", str(two), "--replay", str(RECORDING), "--shape", "9,9,9,64", "--quiet",
                  "--run-dir", str(tmp_path / "other"), cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "no shape 9,9,9,64" in missing.stderr


def test_search_adds_a_shape_the_space_does_not_list_and_resumes_with_it(tmp_path: Path, space_yaml: Path) -> None:
    run = tmp_path / "run"
    base = ["search", "--space", str(space_yaml), "--replay", str(RECORDING), "--strategy", "random", "--run-dir", str(run),
            "--quiet"]
    done = cli(*base, "--trials", "4", "--add-shape", "2,4,300,64", "--add-shape", "2,4,1/333,64", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    meta = json.loads((run / "run.json").read_text())
    assert meta["added_shapes"] == ["2,4,300,64", "2,4,1/333,64"] and meta["shapes"] is None
    assert sorted(meta["case_flops"]) == ["B2 H4 S1/333 D64", "B2 H4 S300 D64", "B2 H4 S300 D64 causal"]
    refused = cli(*base, "--trials", "6", "--resume", "--add-shape", "2,4,300,64", cwd=tmp_path)
    assert refused.returncode == 2 and "--add-shape" in refused.stderr and "Traceback" not in refused.stderr
    resumed = cli(*base, "--trials", "6", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert len(recorded_keys(run)) == 6
    listed = yaml.safe_load(space_yaml.read_text())["problem"]["shapes"][0]
    for shape, words in ((f"{listed['B']},{listed['H']},{listed['S']},{listed['D']}", "already"), ("2,4,300,256", "head dim 256")):
        bad = cli(*base[:-3], "--add-shape", shape, "--run-dir", str(tmp_path / "bad"), "--quiet", cwd=tmp_path)
        assert bad.returncode == 2 and words in bad.stderr and bad.stderr.strip().count("\n") == 0, bad.stderr


def test_search_reports_where_the_time_went(tmp_path: Path, space_yaml: Path) -> None:
    """Each record carries its phase times; the summary (--json, run.json) sums them and
    --profile prints them as a table."""
    run = tmp_path / "run"
    done = cli("search", "--space", str(space_yaml), "--replay", str(RECORDING), "--trials", "6", "--strategy", "random",
               "--run-dir", str(run), "--replay-delay", "0.05", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["run"] == str(run) and out["summary"]["evaluated"] == 6
    phases = out["summary"]["phases"]
    assert phases["timing"]["total_s"] >= 6 * 0.05 and phases["timing"]["mean_ms"] >= 50
    assert phases["strategy"]["total_s"] > 0 and phases["storage"]["total_s"] > 0
    from evoengineer.gpu.evaluate import SUB_PHASES
    from evoengineer.search.loop import DEVICE_PHASES

    # the devices' phases share the devices' time, the search thread's the wall time
    assert 0.9 <= sum(p["share"] for name, p in phases.items() if name in DEVICE_PHASES and name not in SUB_PHASES) <= 1.05
    assert 0 < sum(p["share"] for name, p in phases.items() if name not in DEVICE_PHASES) <= 1.05
    assert json.loads((run / "run.json").read_text())["summary"]["phases"] == phases
    records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    assert all(r["phases"]["timing"] >= 0.05 and r["phases"]["strategy"] > 0 for r in records)

    profiled = cli("search", "--space", str(space_yaml), "--replay", str(RECORDING), "--trials", "3", "--strategy", "random",
                   "--run-dir", str(tmp_path / "run2"), "--quiet", "--profile", cwd=tmp_path)
    assert profiled.returncode == 0, profiled.stderr
    assert "where the time went" in profiled.stdout
    for phase in ("strategy", "compile", "timing", "storage"):
        assert phase in profiled.stdout


def test_the_command_keeps_blas_to_one_thread_unless_told() -> None:
    """The strategy's small matrix work runs on one BLAS thread (the command sets it before
    numpy loads); a value the user set stays."""
    probe = "import sys, evoengineer.cli, os; print(os.environ['OPENBLAS_NUM_THREADS'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    unset = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert unset.stdout.split() == ["1"], unset.stderr
    told = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env={**env, "OPENBLAS_NUM_THREADS": "4"},
                          timeout=60)
    assert told.stdout.split() == ["4"], told.stderr


def test_help_fits_an_80_column_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """``evoengineer --help`` and every command's ``--help``, as argparse prints them at 80 columns."""
    import argparse

    from evoengineer.cli.main import build_parser

    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert len(commands) >= 10
    for name, sub in [("evoengineer", parser), *commands.items()]:
        wide = [line for line in sub.format_help().splitlines() if len(line) > 80]
        assert not wide, f"{name} --help: {wide}"


# -- a first result without a GPU: the shipped recording ------------------------------------------


def test_demo_replays_the_shipped_recording_with_every_column_it_can_fill(tmp_path: Path) -> None:
    """``evoengineer demo``: the shipped H100 recording on its own space; the leaderboard has
    × SDPA and TF/s, --per-shape has per-case winners, export dispatches per case; at 80
    columns the footer's commands stay whole on their own lines; Optuna's log only with --verbose."""
    env = {**os.environ, "COLUMNS": "80"}
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "evoengineer", "demo", "--trials", "24", "--run-dir", str(run), "--quiet"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "A new study created" not in done.stderr and "[I " not in done.stderr
    lines = done.stdout.splitlines()
    storage = f"sqlite:///{(run / 'study.db').resolve()}"
    for line in (f"dashboard: optuna-dashboard {storage}", f"export:      evoengineer export {run} --rank 1 --out best/",
                 f"leaderboard: evoengineer leaderboard {run}", f"report:      evoengineer report {run}"):
        assert any(l.strip() == line for l in lines), (line, done.stdout)
    meta = json.loads((run / "run.json").read_text())
    assert meta["space"] == "h100_mma_seed" and meta["gpu"]["gpu"] == "NVIDIA H100 80GB HBM3 (replay)"

    board = json.loads(cli("leaderboard", str(run), "--json", cwd=tmp_path).stdout)
    assert [row["backend"] for row in board["sdpa"]] == ["cudnn"]  # the recording's fastest backend per case
    for entry in board["entries"]:
        assert {c["label"] for c in entry["cases"]} == {"B1 H8 S512 D64", "B1 H8 S512 D64 causal"}
        assert entry["speedup"]["cudnn"] > 1 and entry["tflops"] > 10
        assert entry["spread"] is None and entry["max_abs_err"] is None  # not in the recording: "-"
    table = cli("leaderboard", str(run), cwd=tmp_path).stdout
    first = next(l for l in table.splitlines() if l.strip().startswith("1 "))
    assert first.split()[-4:-1] != ["-", "-", "-"] and "NVIDIA H100 80GB HBM3 (replay)" in table

    per = json.loads(cli("leaderboard", str(run), "--per-shape", "--json", cwd=tmp_path).stdout)
    assert sorted(c["label"] for c in per["cases"]) == ["B1 H8 S512 D64", "B1 H8 S512 D64 causal"]
    assert all(c["speedup_vs_sdpa"] > 1 and c["sdpa_backend"] == "cudnn" for c in per["cases"])
    assert "no per-case timings" not in cli("leaderboard", str(run), "--per-shape", cwd=tmp_path).stdout

    exported = cli("export", str(run), "--out", str(tmp_path / "best"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    info = json.loads((tmp_path / "best" / "kernel.json").read_text())
    assert info["mode"] == "per-shape" and len(info["dispatch"]["table"]) == 2

    verbose = subprocess.run([sys.executable, "-m", "evoengineer", "demo", "--trials", "2", "--run-dir", str(tmp_path / "v"),
                              "--quiet", "--verbose"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert verbose.returncode == 0 and "A new study created" in verbose.stderr, verbose.stderr

    pytest.importorskip("matplotlib", reason="evoengineer report needs matplotlib: pip install 'evoengineer[plot]'")
    report = cli("report", str(run), cwd=tmp_path)
    assert report.returncode == 0 and (run / "report.html").stat().st_size > 10_000, report.stderr


def test_replay_demo_takes_the_recordings_own_space_and_a_results_file_replays_its_cases(tmp_path: Path) -> None:
    """``--replay demo`` needs no --space; a run's results.jsonl replays with its per-case
    times; a replay of some of the recorded cases has their geometric mean as objective."""
    from evoengineer.search import ReplayCandidates
    from evoengineer.space import Config

    first = tmp_path / "first"
    done = cli("search", "--replay", "demo", "--trials", "6", "--strategy", "grid", "--run-dir", str(first), "--quiet",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    space = Path(json.loads((first / "run.json").read_text())["space_path"])
    again = tmp_path / "again"
    done = cli("search", "--space", str(space), "--replay", str(first / "results.jsonl"), "--strategy", "grid",
               "--trials", "6", "--run-dir", str(again), "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    before = [json.loads(line) for line in (first / "results.jsonl").read_text().splitlines()]
    after = [json.loads(line) for line in (again / "results.jsonl").read_text().splitlines()]
    assert [(r["key"], r["objective_us"], r["cases"]) for r in after] == [(r["key"], r["objective_us"], r["cases"]) for r in before]

    causal = ReplayCandidates(first / "results.jsonl", labels=["B1 H8 S512 D64 causal"])
    record = before[0]
    result = causal.evaluate(Config(record["config"]))
    assert [c["label"] for c in result.cases] == ["B1 H8 S512 D64 causal"]
    assert result.objective_us == pytest.approx(record["cases"][1]["time"]["median_us"])


@pytest.mark.parametrize("space, recording, words", [
    ("recordings/h100_mma_seed.yaml", "benchmarks/recordings/h100_mma_d128.jsonl", ["h100_mma_d128.jsonl", "'B1 H8 S512 D64'"]),
    ("h100", "demo", ["h100_mma_seed.jsonl", "'B4 H16 S2048 D64'"]),
    ("tests/data/replay_small_space.yaml", "demo", ["replay_small", "KV_GROUPS"]),
])
def test_replay_on_a_space_it_does_not_match_stops_at_once(tmp_path: Path, space: str, recording: str,
                                                           words: list[str]) -> None:
    repo = Path(__file__).resolve().parent.parent
    path = str(repo / space) if "/" in space else space
    replay = str(repo / recording) if "/" in recording else recording
    proc = cli("search", "--space", path, "--replay", replay, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and all(w in proc.stderr for w in words), proc.stderr
    assert not (tmp_path / "runs").exists()  # no stub run directory


def test_a_recording_of_a_space_of_several_paths_replays(tmp_path: Path) -> None:
    """Each record holds its own path's parameters (as a run's results.jsonl does): the recording
    matches its space of several paths, and a record missing one of its path's parameters does not."""
    from evoengineer.space import load_space

    space = load_space("h100-backward")
    valid = list(space.valid_configs())
    assert len({c.to_dict()["PATH"] for c in valid}) == 2
    lines = [json.dumps({"header": {"space": "h100-backward"}})]
    lines += [json.dumps({"config": c.to_dict(), "key": c.key(), "status": "ok", "objective_us": 100.0 + i})
              for i, c in enumerate(valid)]
    recording = tmp_path / "rec.jsonl"
    recording.write_text("\n".join(lines) + "\n")
    done = cli("search", "--space", "h100-backward", "--replay", str(recording), "--trials", "6", "--json",
               "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["counts"]["ok"] == 6

    first = json.loads(lines[1])
    del first["config"][sorted(k for k in first["config"] if k != "PATH")[0]]
    recording.write_text("\n".join([lines[0], json.dumps(first), *lines[2:]]) + "\n")
    proc = cli("search", "--space", "h100-backward", "--replay", str(recording), cwd=tmp_path)
    assert proc.returncode == 2 and "that it does not record" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, words", [
    (["search", "--replay", "demo", "--trials", "0"], "--trials: expected a whole number >= 1, got 0"),
    (["search", "--replay", "demo", "--trials", "-5"], "--trials: expected a whole number >= 1, got -5"),
    (["search", "--replay", "demo", "--trials", "many"], "--trials: expected a whole number >= 1, got 'many'"),
    (["search", "--replay", "demo", "--top-k", "-1"], "--top-k: expected a whole number >= 1"),
    (["search", "--replay", "demo", "--time", "-5m"], "--time: expected a positive duration such as 90s"),
    (["search", "--replay", "demo", "--time", "0s"], "--time: expected a positive duration"),
    (["search", "--replay", "demo", "--heartbeat", "0"], "--heartbeat: expected a whole number >= 1"),
    (["search", "--replay", "demo", "--replay-delay", "-1"], "--replay-delay: expected a number >= 0"),
    (["search", "--replay", "demo", "--retime-rounds", "-1"], "--retime-rounds: expected a whole number >= 0"),
    (["search", "--replay", "demo", "--seed", "-1"], "--seed: expected a whole number >= 0"),
    (["search", "--replay", "demo", "--device", "-2"], "--device: expected a whole number >= 0"),
    (["check", "--space", "l4", "--limit", "0"], "--limit: expected a whole number >= 1, got 0"),
    (["check", "--space", "l4", "--limit", "-3"], "--limit: expected a whole number >= 1, got -3"),
    (["check", "--space", "l4", "--jobs", "0"], "--jobs: expected a whole number >= 1"),
    (["leaderboard", "runs/x", "--top", "0"], "--top: expected a whole number >= 1"),
    (["export", "runs/x", "--rank", "0", "--out", "o"], "--rank: expected a whole number >= 1"),
    (["bench", "--space", "l4", "--config", "PATH=wmma", "--trials", "0"], "--trials: expected a whole number >= 1"),
    (["baseline", "--space", "l4", "--device", "-1"], "--device: expected a whole number >= 0"),
    (["demo", "--trials", "0"], "--trials: expected a whole number >= 1"),
    (["search"], "--space: required"),
])
def test_numeric_flags_are_range_checked_in_one_line(argv: list[str], words: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from evoengineer.cli.main import main

    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_a_replay_search_stops_at_its_budget_not_at_zero(tmp_path: Path, space_yaml: Path) -> None:
    """--trials N is N evaluations (N >= 1; 0 is refused above), --top-k N finalists."""
    run = tmp_path / "run"
    done = cli("search", "--space", str(space_yaml), "--replay", str(RECORDING), "--trials", "3", "--top-k", "2",
               "--strategy", "random", "--run-dir", str(run), "--quiet", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["summary"]["evaluated"] == 3 and len(out["leaderboard"]) == 2
