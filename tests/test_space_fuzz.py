"""A few hundred generated malformed space files thrown at the parser: each one loads or is
refused with one ``SpaceError`` line (under 700 characters), within 2 s, and nothing else
escapes (no other exception, so no traceback from the command). A fixed seed makes every
run the same files; a failure names the case to replay it."""
from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from evoengineer.space import SpaceError, load_space

REPO = Path(__file__).resolve().parent.parent
BASE = json.loads((REPO / "tests" / "data" / "replay_synthetic.jsonl").read_text().splitlines()[0])["header"]["space_inline"]
SEED = 33
CASES = 360
PER_CASE_S = 2.0
NAMES = ["PATH", "BLOCK_M", "BLOCK_N", "WARPS", "VEC", "SCHED", "SMEM_LIMIT", "MAX_HEAD_DIM", "NOPE", "min", "max", "abs",
         "eval", "__import__", "open"]


# -- generators ---------------------------------------------------------------------


def hostile_value(rng: random.Random, depth: int = 0) -> Any:
    choices: list[Callable[[], Any]] = [
        lambda: None, lambda: True, lambda: -1, lambda: 0, lambda: 2 ** rng.choice((31, 63, 70, 200)), lambda: 1e308,
        lambda: float("inf"), lambda: "", lambda: "x" * rng.choice((1, 80, 5000, 100_000)),
        lambda: 'a"""\n{{ 7*7 }}\'\'\'\x00\x1b[31m', lambda: "/../../etc/passwd", lambda: {"expr": "1"},
        lambda: [rng.randint(-5, 300) for _ in range(rng.randint(0, 6))], lambda: [1, "a", None, [2]],
    ]
    if depth < 3:
        choices += [lambda: {str(rng.random()): hostile_value(rng, depth + 1)},
                    lambda: [hostile_value(rng, depth + 1) for _ in range(rng.randint(1, 3))]]
    if depth == 0:
        choices.append(lambda: nested(rng.randint(20, 120)))
    return rng.choice(choices)()


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def expression(rng: random.Random, depth: int = 0) -> str:
    """A random expression over the grammar and beyond it (calls, attributes, lambdas...)."""
    if depth > rng.choice((2, 4, 8)) or rng.random() < 0.25:
        return rng.choice([*NAMES, "0", "1", "16", "9**64", "1e308", "'mma'", "[1, 2]", "(1,)", "None", "True",
                           "x.__class__", "()", "{}", "f'{1}'", "b'x'", "1j", "...", "9" * 50])
    a, b = expression(rng, depth + 1), expression(rng, depth + 1)
    return rng.choice([
        f"({a}) ** {rng.choice((0, 2, 64, 65, -1))}", f"({a}) ** ({b})", f"{a} * {b}", f"{a} / {b}", f"{a} // 0",
        f"{a} % {b}", f"{a} + {b}", f"-{a}", f"not {a}", f"{a} and {b}", f"{a} or {b}", f"{a} <= {b}",
        f"{a} in [{b}]", f"{a} if {b} else {a}", f"min({a}, {b})", f"max({a})", f"abs({a}, {b})", f"{a}.real",
        f"{a}[0]", f"lambda: {a}", f"[x for x in {a}]", f"({a})", f"{a} << 3", f"{a} @ {b}", f"{a} := 1",
        f"__import__('os').system({a})", f"'{a}' * 10**9", "-(" * rng.randint(1, 200) + a + ")" * rng.randint(1, 200),
    ])


def laughs(rng: random.Random) -> str:
    width, levels = rng.randint(2, 12), rng.randint(2, 12)
    lines = ["l0: &l0 [" + ", ".join(["1"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join("  " + line for line in lines) + f"\n  BLOCK_M: *l{levels - 1}\n"


def mutate_document(rng: random.Random, doc: dict) -> str:
    """A structural change (a key set to a hostile value, dropped, or a constraint replaced),
    dumped as YAML."""
    kind = rng.choice(("value", "value", "drop", "constraint", "constraint", "name", "seed"))
    if kind == "constraint":
        doc["constraints"] = [*doc["constraints"][: rng.randint(0, 3)], expression(rng)]
    elif kind == "name":
        doc["name"] = rng.choice(["/../../tmp/x", "a/b", ".", "..", "", "*", "x" * 300, "\n", "ok name ü", 7])
    elif kind == "seed":
        doc["search"]["seeds"] = [hostile_value(rng) for _ in range(rng.randint(1, 3))]
    else:
        node, path = doc, []
        while isinstance(node, dict) and node and rng.random() < 0.7:
            key = rng.choice(list(node))
            path.append(key)
            if not isinstance(node[key], dict):
                break
            node = node[key]
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if path:
            if kind == "drop":
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = hostile_value(rng)
        else:
            doc[rng.choice(["params", "target", "problem", "surprise"])] = hostile_value(rng)
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=rng.random() < 0.5)


def mutate_text(rng: random.Random, text: str) -> str:
    """A change to the YAML text itself: cut, a stray character, a swapped line, aliases."""
    kind = rng.choice(("cut", "insert", "lines", "laughs", "bytes"))
    if kind == "cut":
        return text[: rng.randint(0, len(text))]
    if kind == "insert":
        for _ in range(rng.randint(1, 5)):
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(list("{}[]:&*!|>'\"\t\n#%@-?,`") + ["&a ", "*a", "!!python/object:os.system ", "<<: "]) + text[at:]
        return text
    if kind == "lines":
        lines = text.splitlines()
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines)
    if kind == "laughs":
        return text.replace("params:\n", "params:\n" + laughs(rng), 1)
    return text + "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(1, 40)))


def case(index: int) -> tuple[str, str]:
    """The ``index``-th file of the run: (what it is, its text)."""
    rng = random.Random(f"{SEED}:{index}")
    doc = json.loads(json.dumps(BASE))
    if rng.random() < 0.55:
        return "document", mutate_document(rng, doc)
    return "text", mutate_text(rng, yaml.safe_dump(doc, sort_keys=False))


# -- the test --------------------------------------------------------------------------


class _Slow(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Slow()


def test_malformed_space_files_give_one_line_each_within_bounds(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGALRM, _alarm)
    outcomes = {"loaded": 0, "refused": 0}
    started = time.perf_counter()
    try:
        for index in range(CASES):
            what, text = case(index)
            path = tmp_path / f"fuzz{index}.yaml"
            path.write_text(text, encoding="utf-8", errors="surrogateescape")
            began = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, PER_CASE_S * 3)  # a hang is cut and reported, not waited for
            try:
                space = load_space(path)
            except SpaceError as exc:
                message = str(exc)
                assert "\n" not in message and len(message) < 700, f"case {index} ({what}): {message[:1000]!r}"
                assert message.startswith(str(path)) or message.startswith(path.name), f"case {index}: {message[:300]!r}"
                outcomes["refused"] += 1
            except _Slow:
                pytest.fail(f"case {index} ({what}) took over {PER_CASE_S * 3} s: {text[:300]!r}")
            except Exception as exc:  # noqa: BLE001 - the finding: anything but a SpaceError is a traceback
                pytest.fail(f"case {index} ({what}) raised {type(exc).__name__}: {str(exc)[:300]} for {text[:300]!r}")
            else:
                assert "/" not in space.name and not space.name.startswith("."), f"case {index}: name {space.name!r}"
                outcomes["loaded"] += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            elapsed = time.perf_counter() - began
            assert elapsed < PER_CASE_S, f"case {index} ({what}) took {elapsed:.2f} s"
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert outcomes["refused"] > CASES // 2  # the generator does produce broken files
    assert time.perf_counter() - started < 60
