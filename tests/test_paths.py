"""The kernel paths' rules (evoengineer/paths) against what the space files said before them.

Before the rules moved into Python, ``search_spaces/h100.yaml`` was one flat product over the
four paths, its constraints pinning the parameters a path does not use to their first value.
These tests load that file from the revision before the move and check that every path keeps
the same valid configurations (less the parameters it does not use) and the same keys.
"""
from __future__ import annotations

import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from evoengineer import paths
from evoengineer.space import Config, load_space, parse_space

REPO = Path(__file__).resolve().parent.parent
BEFORE = "fb5a84c"
"""The last revision whose space files restate every path's rules as YAML constraints."""


def _old_doc(name: str) -> dict:
    try:
        text = subprocess.run(["git", "show", f"{BEFORE}:search_spaces/{name}.yaml"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"revision {BEFORE} is not in this clone's history")
    return yaml.safe_load(text)


def _old_valid_by_path(name: str) -> tuple[dict[str, set[Config]], object]:
    """The old flat space's valid configurations per path, each restricted to its path's
    parameters; the parameters a path does not use enumerated at their neutral value only (the old
    file pins them: checked here on each path's first configuration, value by value)."""
    doc = _old_doc(name)
    new = load_space(name)
    out: dict[str, set[Config]] = defaultdict(set)
    old = None
    for own in new.paths:
        unused = new.unused(own.name)
        narrowed = dict(doc, search={}, params={k: ([own.name] if k == "PATH" else [unused[k]] if k in unused else v)
                                                for k, v in doc["params"].items()})
        old = parse_space(narrowed, f"{BEFORE}:{name}.yaml")
        for config in old.valid_configs():
            out[own.name].add(new.config(config))
        full = parse_space(doc, f"{BEFORE}:{name}.yaml")
        first = next(iter(old.valid_configs()))
        for k in unused:
            for value in full.param(k).values:
                if value != unused[k]:
                    assert full.violations(first.replace(**{k: value})), f"{own.name}: {k}={value} was not pinned"
    return out, old


@pytest.mark.parametrize("name", ["h100", "h100-bf16"])
def test_every_path_keeps_its_valid_configurations_and_their_keys(name: str) -> None:
    new = load_space(name)
    before, _ = _old_valid_by_path(name)
    after: dict[str, set[Config]] = defaultdict(set)
    for config in new.valid_configs():
        after[config["PATH"]].add(config)
    assert set(after) == set(before) == {"scalar", "wmma", "mma", "wgmma"}
    for path in after:
        assert after[path] == before[path], path
    assert sum(map(len, after.values())) == 9566
    # every key as it was: the flat configuration's, with the path's unused parameters at their old first value
    doc = _old_doc(name)
    first = {k: v[0] if not all(isinstance(x, int) for x in v) else min(v) for k, v in doc["params"].items()}
    for config in list(after["wgmma"])[:50] + list(after["scalar"])[:20] + list(after["mma"])[:20]:
        dense = Config({**first, **config})
        assert config.key() == dense.key() and config.canonical() == dict(dense)


@pytest.mark.parametrize("name", ["h100", "h100-bf16"])
def test_seeds_keep_their_keys_without_the_unused_parameters(name: str) -> None:
    doc = _old_doc(name)
    old = parse_space(doc, f"{BEFORE}:{name}.yaml")
    new = load_space(name)
    assert [s.key() for s in new.search.listed_seeds] == [s.key() for s in old.search.listed_seeds]
    assert all("WARPS" not in s and "VEC" not in s for s in new.search.listed_seeds if s["PATH"] == "wgmma")
    text = (REPO / "search_spaces" / f"{name}.yaml").read_text()
    assert "PATH != 'wgmma' or" not in text and "WARPS: 1, VEC: 1" not in text


@pytest.mark.parametrize("name", ["l4", "h100-decode"])
def test_spaces_written_per_path_keep_every_key_and_seed(name: str) -> None:
    """l4 and h100-decode, once flat, enumerate the same configurations (by key) and seeds (besides
    those with SPLITS 0, the split count chosen per call, which came later)."""
    old = parse_space(_old_doc(name), f"{BEFORE}:{name}.yaml")
    new = load_space(name)
    assert new.paths and "PATH" not in _doc(name).get("params", {})
    assert (sorted(c.key() for c in new.valid_configs() if c.get("SPLITS") != 0)
            == sorted(c.key() for c in old.valid_configs()))
    assert ([s.key() for s in new.search.listed_seeds if s.get("SPLITS") != 0]
            == [s.key() for s in old.search.listed_seeds])


def _doc(name: str) -> dict:
    return yaml.safe_load((REPO / "search_spaces" / f"{name}.yaml").read_text())


# -- the space file's shape --------------------------------------------------------------------


def _h100_doc() -> dict:
    return yaml.safe_load((REPO / "search_spaces" / "h100.yaml").read_text())


def test_a_constraint_calls_the_paths_budget_and_nothing_else(tmp_path: Path) -> None:
    doc = _h100_doc()
    doc["search"] = {}
    doc["paths"]["mma"]["constraints"] = [{"expr": "smem_bytes() <= SMEM_LIMIT // 2", "why": "two CTAs a multiprocessor"}]
    doc["constraints"] = ["threads() <= 256"]
    space = parse_space(doc, "h100-half.yaml")
    mma = [c for c in space.valid_configs() if c["PATH"] == "mma"]
    rules = paths.get("mma")
    assert mma and all(rules.smem(c, 128) <= space.target.smem_per_block // 2 for c in mma)
    assert all(rules.threads(rules.scope(c)) <= 256 for c in mma)
    assert len(mma) < sum(1 for c in load_space("h100").valid_configs() if c["PATH"] == "mma")
    for bad, message in (("smem_bytes(BLOCK_M) > 0", "takes no arguments"), ("open() > 0", "only calls to"),
                         ("smem_bytes > 0", "unknown name")):
        doc["constraints"] = [bad]
        with pytest.raises(Exception, match=message):
            parse_space(doc, "bad.yaml")


def test_a_parameter_a_path_does_not_use_is_refused_where_it_is_written() -> None:
    doc = _h100_doc()
    doc["paths"]["wgmma"]["params"]["WARPS"] = [1, 2]
    with pytest.raises(Exception, match=r"paths\.wgmma\.params\.WARPS: the wgmma path does not use WARPS"):
        parse_space(doc, "x.yaml")
    doc = _h100_doc()
    doc["params"]["VEC"] = [8]
    with pytest.raises(Exception, match=r"params\.VEC: the wgmma path does not use VEC"):
        parse_space(doc, "x.yaml")
    doc = _h100_doc()
    doc["paths"]["hgmma"] = {}
    with pytest.raises(Exception, match=r"paths\.hgmma: no kernel path 'hgmma' \(did you mean 'wgmma'\?\)"):
        parse_space(doc, "x.yaml")
    doc = _h100_doc()
    doc["search"]["seeds"] = [{"PATH": "wgmma", "BLOCK_M": 64, "WARPS": 2}]
    with pytest.raises(Exception, match=r"search\.seeds\[0\]\.WARPS: the wgmma path does not use it"):
        parse_space(doc, "x.yaml")


def test_extends_merges_mappings_and_replaces_lists(tmp_path: Path) -> None:
    child = tmp_path / "child.yaml"
    child.write_text("extends: h100\nname: child\nproblem: {dtype: bf16}\n"
                     "paths: {wgmma: {params: {LOAD: [tma]}}}\nsearch: {budget: 7, seeds: []}\n")
    space, base = load_space(child), load_space("h100")
    assert (space.name, space.dtypes, space.search.budget, space.search.strategy) == ("child", ("bf16",), 7, base.search.strategy)
    assert [c.shape for c in space.cases] == [c.shape for c in base.cases]
    assert space.path_space("wgmma").param("LOAD").values == ("tma",) and space.path_space("mma") == base.path_space("mma")
    grandchild = tmp_path / "grandchild.yaml"
    grandchild.write_text("extends: child.yaml\nname: grandchild\n")
    assert load_space(grandchild).path_space("wgmma").param("LOAD").values == ("tma",)
    kept = yaml.safe_load(load_space(grandchild).source_text())  # a run keeps the merged document
    assert "extends" not in kept and load_space(grandchild).path_space("wgmma") == parse_space(kept, "kept.yaml").path_space("wgmma")
    looped = tmp_path / "looped.yaml"
    looped.write_text("extends: looped.yaml\n")
    with pytest.raises(Exception, match="extends: 'looped.yaml' extends back"):
        load_space(looped)


def test_every_path_rule_is_named_and_reads_only_what_it_declares() -> None:
    space = load_space("h100")
    env = space.environment()
    for config in list(space.valid_configs())[::97]:
        rules = paths.path_of(config)
        for rule in rules.rules:
            seen: set[str] = set()

            class Spy(dict):
                def __getitem__(self, name: str):
                    seen.add(name)
                    return dict.__getitem__(self, name)

            rule(Spy(rules.scope(config, env)))
            assert seen - set(env) <= set(rule.needs), (rule.name, seen - set(rule.needs))
            assert rule.name.startswith(f"{rules.name}.") and rule.why
