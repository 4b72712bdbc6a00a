"""Hostile and broken space files: each is refused in one line naming the file and key,
fast, with exit code 2 and before any run directory exists; a space's name never leaves
``runs/``. Real files, the real command in a subprocess."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from evoengineer.space import SpaceError, load_space

REPO = Path(__file__).resolve().parent.parent
RECORDING = REPO / "recordings" / "h100_mma_seed.jsonl"
SEED_SPACE = REPO / "recordings" / "h100_mma_seed.yaml"


def _limit_memory() -> None:
    """The child may use at most 2 GiB of address space: a blow-up fails it, not the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def search(space: Path, cwd: Path, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoengineer", "search", "--space", str(space), "--replay", str(RECORDING),
                           "--trials", "3", "--quiet", *extra], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          preexec_fn=_limit_memory)


def one_line_refusal(proc: subprocess.CompletedProcess, *words: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr and err.count("\n") == 0, err
    assert err.startswith("error: ") and len(err) < 700, err
    for word in words:
        assert word in err, err
    return err


def seed_space_with(tmp_path: Path, edit) -> Path:
    doc = yaml.safe_load(SEED_SPACE.read_text())
    edit(doc)
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("expr, key, words", [
    ("((((9**64)**64)**64)**64)**64 > 0", "constraints[0]", "1024 bits"),
    ("BLOCK_M * ((((9**64)**64)**64)**64) > 0", "constraints[0]", "1024 bits"),
    ("BLOCK_M / 0 > 1", "constraints[0]", "division by zero"),
    ("BLOCK_M % (WARPS - WARPS) == 0", "constraints[0]", "by zero"),  # a divisor 0 for every value: the load-time probe
    ("BLOCK_M // (WARPS - 2) > 1", "constraints[0]", "WARPS=2"),     # 0 only when WARPS is 2: the probe finds that value
    ("'x' * 999999999 == PATH", "constraints[0]", "numbers only"),
    ("-" * 100_000 + "BLOCK_M > 0", "constraints[0]", "at most 2000"),
    ("-(" * 150 + "BLOCK_M" + ")" * 150 + " > 0", "constraints[0]", "nested too deeply"),
    ("1e300 ** 64 > BLOCK_M", "constraints[0]", "constraints[0]"),
    ("PATH < 3", "constraints[0]", "not supported"),
], ids=["pow-chain", "pow-chain-times-name", "div-zero", "mod-zero-always", "div-zero-at-one-value", "string-repeat",
        "100k-deep", "150-deep", "float-overflow", "str-lt-int"])
def test_constraints_that_cannot_be_evaluated_fail_at_load_in_one_line(tmp_path: Path, expr: str, key: str, words: str) -> None:
    path = seed_space_with(tmp_path, lambda d: d.update(constraints=[expr, *d["constraints"]]))
    started = time.perf_counter()
    with pytest.raises(SpaceError) as err:
        load_space(path)
    assert time.perf_counter() - started < 10
    assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value)
    assert len(str(err.value)) < 700

    proc = search(path, tmp_path, timeout=60)
    one_line_refusal(proc, f"{path.name}: {key}: ")
    assert not (tmp_path / "runs").exists()  # refused before any run directory


BILLION_LAUGHS = """\
target: {name: x, arch: sm_90, sms: 132, smem_per_block: 232448}
problem: {shapes: [{B: 1, H: 8, S: 512, D: 64}]}
template: flash_attention
params:
  a: &a [1,1,1,1,1,1,1,1,1,1]
  b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]
  c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]
  d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]
  e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]
  f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]
  g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f]
  h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g,*g]
  i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h,*h]
  BLOCK_M: *i
"""


def test_billion_laughs_is_refused_fast_in_one_line(tmp_path: Path) -> None:
    """A 10^9-item structure in ~600 bytes under ``params``: refused by counting the
    expanded nodes, not by building or printing them (the child has 2 GiB at most)."""
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    assert path.stat().st_size < 1200
    started = time.perf_counter()
    proc = search(path, tmp_path, timeout=60)
    assert time.perf_counter() - started < 30
    one_line_refusal(proc, path.name, "aliases expand to more than")
    assert "MemoryError" not in proc.stderr and not (tmp_path / "runs").exists()


def test_a_few_aliases_still_work(tmp_path: Path) -> None:
    doc = SEED_SPACE.read_text().replace("  BLOCK_N: [32, 64, 128]", "  BLOCK_N: &tiles [32, 64, 128]")
    doc = doc.replace("  KV_GROUPS: [1, 2, 4]", "  KV_GROUPS: [1, 2, 4]\n  OTHER: *tiles")
    path = tmp_path / "aliases.yaml"
    path.write_text(doc)
    assert load_space(path).param("OTHER").values == (32, 64, 128)


@pytest.mark.parametrize("text, words", [
    ("params:\n" + "  " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    ("name: x\n" + "a" * (2 << 20), "larger than"),
    ("name: \xff\xfe\n", "UTF-8"),
], ids=["100k-deep-yaml", "2MiB", "latin-1"])
def test_deep_huge_or_binary_yaml_is_one_line(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_bytes(text.encode("latin-1") if "\xff" in text else text.encode())
    with pytest.raises(SpaceError) as err:
        load_space(path)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_error_messages_quote_at_most_a_few_hundred_characters(tmp_path: Path) -> None:
    huge = list(range(50_000))
    for edit in (lambda d: d["params"].update(BLOCK_M=[huge]), lambda d: d["target"].update(sms=huge),
                 lambda d: d["params"].update({"bad\nname" * 1000: [1]}), lambda d: d.update(template="x" * 100_000)):
        path = seed_space_with(tmp_path, edit)
        with pytest.raises(SpaceError) as err:
            load_space(path)
        assert len(str(err.value)) < 700 and "\n" not in str(err.value), str(err.value)[:2000]


def test_space_name_becomes_one_path_component_under_runs(tmp_path: Path) -> None:
    """``name: /../../tmp/x`` (and a name with newlines, quotes, glob characters) names a
    run directory inside ``runs/``, one component, nothing written outside it."""
    outside = tmp_path / "tmp"
    path = seed_space_with(tmp_path, lambda d: d.update(name="/../../tmp/x\n\"\"\"*[?]"))
    assert load_space(path).name == "tmp-x"
    work = tmp_path / "work"
    work.mkdir()
    proc = search(path, work, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    runs = list((work / "runs").iterdir())
    assert len(runs) == 1 and runs[0].parent == work / "runs"
    name = runs[0].name
    assert "/" not in name and ".." not in name and "\n" not in name and not set('"*?[]') & set(name)
    assert not outside.exists()
    assert json.loads((runs[0] / "run.json").read_text())["space"] == load_space(path).name
