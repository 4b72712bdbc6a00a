from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _gpu_capability() -> tuple[int, int] | None:
    """The first CUDA device's compute capability; None where there is no GPU."""
    try:
        import torch

        return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken torch install means no GPU here
        return None


CAPABILITY = _gpu_capability()
HAS_GPU = CAPABILITY is not None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow (whole spaces compiled, many kernels, long searches); "
                          "`-m slow` runs only those")


SLOW_TESTS: dict[str, str] = {
    # every valid path of l4 and h100 for sm_89, sm_90 and sm_90a; the fast suite: l4 for sm_89
    "tests/test_check.py::test_every_path_of_shipped_spaces_compiles": "first",
    "tests/test_check.py::test_check_shape_narrows_the_space_as_search_does": "all",
    # module fixtures that compile every case for every arch at once
    "tests/test_templates_cpu.py::test_compiles": "all",
    "tests/test_dtype_gqa.py::test_bf16_paths_compile": "all",
    "tests/test_dtype_gqa.py::test_bf16_costs_no_more_registers_than_fp16": "all",
    "tests/test_dtype_gqa.py::test_bf16_tensor_core_paths_run_bf16_hmma": "all",
    "tests/test_wgmma_bf16.py::test_bf16_wgmma_compiles_for_sm_90a_without_spills": "all",
    # one wgmma kernel per SASS check in the fast suite, every configuration and variant in the slow run
    "tests/test_tma.py::test_tma_configurations_compile_for_sm_90a_without_spills": "first",
    "tests/test_tma.py::test_overlap_2_runs_the_exponentials_while_p_v_is_in_flight": "first",
    "tests/test_tma.py::test_wgmma_stays_asynchronous_and_nothing_spills": "first",
    "tests/test_tma.py::test_softmax_pin_keeps_the_softmax_before_the_wait_for_p_v": "first",
    "tests/test_tma.py::test_softmax_pin_2_and_3_keep_the_row_maximum_and_half_the_exponentials_before_the_wait": "first",
    "tests/test_tma.py::test_o_tma_stores_o_through_shared_memory_by_a_fourth_map": "first",
    "tests/test_tma.py::test_a_tile_counter_kernel_declares_its_counter_and_takes_tiles_by_atomics": "first",
    "tests/test_tma.py::test_a_split_tail_kernel_declares_the_workspace_of_its_cut_tiles": "first",
    "tests/test_tma.py::test_q_in_regs_feeds_q_k_from_registers_and_reads_k_alone_from_shared_memory": "first",
    # every backward configuration compiled for sm_80 and sm_90, fp16 and bf16, full and causal
    "tests/test_backward_cpu.py::test_backward_config_compiles_for_sm80_and_sm90_within_its_spill_allowance": "first",
    # the model-family spaces' seeds at their head dims (96, 256), every feature variant
    "tests/test_head_dims.py::test_the_family_seeds_compile_for_sm_90a_without_spills": "first",
    # enumerate the whole h100 space
    "tests/test_tma.py::test_persistent_varies_where_a_tma_producer_loads_and_each_has_its_twin": "all",
    "tests/test_tma.py::test_load_varies_on_the_wgmma_path_only_and_no_configuration_repeats": "all",
    "tests/test_decode.py::test_the_decode_seeds_compile_without_spills_for_sm_90a": "all",
    "tests/test_dtype_gqa.py::test_check_command_on_the_bf16_space": "all",
    "tests/test_space.py::test_wgmma_needs_sm_90a_and_other_archs_drop_it": "all",
    # the evolutionary strategy's model refitted over every configuration of a recording (208, 244)
    "tests/test_strategies.py::test_budget_equal_to_space_covers_it_once[replay_small_h100-evo]": "all",
    "tests/test_strategies.py::test_budget_equal_to_space_covers_it_once[replay_synthetic-evo]": "all",
    # seconds of simulated GPU time per device count, and rates that need idle cores
    "tests/test_search_cli.py::test_one_search_on_several_devices": "all",
    "tests/test_benchmarks_cpu.py::test_scaling_benchmark_on_simulated_devices": "all",
    # end-to-end command sequences of 7 s or more each (several CLI processes, or many compiles); the
    # fast suite keeps a shorter test of each behaviour (README's commands, resume, damage, export)
    "tests/test_search_cli.py::test_demo_replays_the_shipped_recording_with_every_column_it_can_fill": "all",
    "tests/test_search_cli.py::test_leaderboard_and_export_from_a_run": "all",
    "tests/test_search_cli.py::test_search_adds_a_shape_the_space_does_not_list_and_resumes_with_it": "all",
    "tests/test_search_cli.py::test_two_searches_share_one_study": "all",
    "tests/test_partition.py::test_a_search_killed_mid_way_resumes_every_partitions_budget": "all",
    "tests/test_markers.py::test_slow_tests_run_only_when_asked_for": "all",
    "tests/test_run_damage.py::test_a_full_disk_stops_the_search_in_one_line_and_resume_finishes_the_budget": "all",
    "tests/test_run_damage.py::test_leaderboard_and_export_say_when_results_and_study_disagree": "all",
    "tests/test_run_damage.py::test_truncated_json_files_give_one_line": "first",
    "tests/test_run_damage.py::test_a_record_of_the_wrong_schema_stops_resume_before_any_evaluation": "all",
    "tests/test_tables.py::test_spaces_and_check_fit_80_columns": "all",
    "tests/test_tables.py::test_search_runs_and_leaderboard_commands_fit_80_columns": "all",
    "tests/test_postgres.py::test_four_workers_one_killed_share_a_postgres_study": "all",
    "tests/test_resume.py::test_resume_refuses_a_missing_empty_or_foreign_study": "all",
    "tests/test_export.py::test_cli_leaderboard_per_shape_and_export": "all",
    "tests/test_check.py::test_a_spilling_kernel_is_reported_as_spilling": "all",
    "tests/test_check.py::test_a_spilling_configuration_is_flagged_by_check": "all",
    "tests/test_untrusted_space.py::test_error_messages_quote_at_most_a_few_hundred_characters": "all",
    "tests/test_backward_cpu.py::test_lse_forward_compiles_without_spills": "all",
    "tests/test_report.py::test_report_of_a_replayed_search": "all",
    "tests/test_space.py::test_valid_configs_match_brute_force": "all",
    "tests/test_strategy_benchmark.py::test_record_run_on_two_workers_times_each_configuration_once": "all",
    "tests/test_backward_space.py::test_a_backward_search_replays_on_two_devices_and_resumes_as_a_forward_one": "first",
    # three NVRTC compiles and disassemblies of a scalar kernel (about 18 s on two busy cores)
    "tests/test_sass_sample.py::test_a_comment_leaves_the_sass_identical_and_a_code_change_does_not": "all",
}
"""Tests that are slow as a whole (``"all"``), or whose parametrizations but the first are
(``"first"``: the fast suite checks one kernel, the slow run every one), by node id without
parameters (or with them: that parametrization alone). A test file may also mark a test
``@pytest.mark.slow`` itself."""


def _mark_slow(items: list[pytest.Item]) -> None:
    seen: set[str] = set()
    for item in items:
        name = item.nodeid.split("[")[0]
        rule = SLOW_TESTS.get(item.nodeid) or SLOW_TESTS.get(name)
        if rule == "all" or (rule == "first" and name in seen):
            item.add_marker(pytest.mark.slow)
        seen.add(name)
    modules = {item.nodeid.split("::")[0]: getattr(item, "module", None) for item in items}
    stale = [name for name in SLOW_TESTS if name.split("::")[0] in modules
             and not hasattr(modules[name.split("::")[0]], name.split("[")[0].split("::")[-1])]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py: SLOW_TESTS names {stale[0]}, which is no test (renamed?)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out, at collection and with one summary line each: the slow tests unless --slow
    (or a -m expression that names slow), the GPU tests where there is no GPU. Tests marked
    sm90 skip on a GPU other than sm_90."""
    _mark_slow(items)
    run_slow = config.getoption("--slow") or "slow" in (config.getoption("markexpr") or "")
    left_out: dict[str, list[pytest.Item]] = {}
    keep = []
    for item in items:
        if item.get_closest_marker("slow") and not run_slow:
            left_out.setdefault("slow", []).append(item)
        elif item.get_closest_marker("gpu") and not HAS_GPU:
            left_out.setdefault("gpu", []).append(item)
        else:
            keep.append(item)
            if item.get_closest_marker("timing") and _shared_gpu_workers() > 1:
                item.add_marker(pytest.mark.skip(reason="measures GPU time: run alone (pytest -m timing), not beside "
                                                        f"{_shared_gpu_workers() - 1} other test processes (-n)"))
            if item.get_closest_marker("sm90") and CAPABILITY is not None and CAPABILITY[0] != 9:
                item.add_marker(pytest.mark.skip(reason=f"needs an sm_90 GPU (H100, H200); this one is "
                                                        f"sm_{CAPABILITY[0]}{CAPABILITY[1]}"))
    if left_out:
        config.hook.pytest_deselected(items=[i for group in left_out.values() for i in group])
        items[:] = keep
    config.stash[_LEFT_OUT] = {name: len(group) for name, group in left_out.items()}


def _shared_gpu_workers() -> int:
    """How many test processes share the GPU (pytest-xdist's workers; 1 without it)."""
    import os

    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)


_LEFT_OUT = pytest.StashKey[dict]()
_WHY = {"slow": "marked slow (--slow runs them too, -m slow only them)",
        "gpu": "need a CUDA GPU, none here"}


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    for name, n in config.stash.get(_LEFT_OUT, {}).items():
        terminalreporter.write_line(f"not run: {n} tests {_WHY[name]}")


@pytest.fixture
def space_file(tmp_path: Path):
    """Write a variant of the l4 space, written flat (tests/data/l4_flat.yaml), with edits applied; returns its path."""
    import yaml

    base = yaml.safe_load((REPO / "tests" / "data" / "l4_flat.yaml").read_text())

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


# -- a real PostgreSQL server for the tests that share a study across processes ----------------


def _postgres_bin(name: str) -> str | None:
    import glob
    import shutil

    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return candidates[0] if candidates else None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_url():
    """``postgresql://...`` of a throwaway server (initdb + pg_ctl in a temp dir, a free port,
    its socket in the temp dir); skipped where no server binaries or no driver exist. As
    root, the server runs as an unprivileged user (initdb refuses root)."""
    import os
    import pwd
    import shutil
    import subprocess
    import tempfile

    initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    driver = _postgres_driver()
    if driver is None:
        pytest.skip("no PostgreSQL driver: pip install 'psycopg[binary]' (the test extra has it)")
    root = tempfile.mkdtemp(prefix="evoengineer-pg-")
    as_user: list[str] = []
    if os.geteuid() == 0:
        user = next((u for u in ("postgres", "nobody") if _has_user(u)), None)
        runner = shutil.which("runuser") or shutil.which("setpriv")
        if user is None or runner is None:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip("running as root with no unprivileged user or no runuser/setpriv to start PostgreSQL as")
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
        as_user = [runner, "-u", user, "--"] if runner.endswith("runuser") else \
            [runner, f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups"]
    data, log, port = os.path.join(root, "data"), os.path.join(root, "server.log"), _free_port()
    try:
        subprocess.run([*as_user, initdb, "-D", data, "-U", "evo", "--auth=trust", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, text=True, timeout=120)
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        subprocess.run([*as_user, pg_ctl, "-D", data, "-l", log, "-o", options, "-w", "-t", "60", "start"],
                       check=True, capture_output=True, text=True, timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        detail = getattr(exc, "stderr", "") or ""
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"PostgreSQL did not start: {detail.strip().splitlines()[-1] if detail.strip() else exc}")
    try:
        yield f"postgresql+{driver}://evo@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", data, "-m", "immediate", "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def _has_user(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _postgres_driver() -> str | None:
    """The SQLAlchemy driver name of an installed PostgreSQL driver (psycopg 3 first)."""
    import importlib.util

    for module, name in (("psycopg", "psycopg"), ("psycopg2", "psycopg2")):
        if importlib.util.find_spec(module) is not None:
            return name
    return None


SYNTHETIC_RECORDING = REPO / "tests" / "data" / "replay_synthetic.jsonl"
"""A recorded search (a synthetic space) that replay searches answer from without a GPU."""


@pytest.fixture
def space_yaml(tmp_path: Path) -> Path:
    """The synthetic recording's own space, written out as a YAML file."""
    import json

    import yaml

    header = json.loads(SYNTHETIC_RECORDING.read_text().splitlines()[0])["header"]
    path = tmp_path / "synthetic.yaml"
    path.write_text(yaml.safe_dump(header["space_inline"], sort_keys=False))
    return path
