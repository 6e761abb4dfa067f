"""The bench's JSON line and layout, checked without running a benchmark: scripts outside
the project read the keys of its last line, so a key renamed or dropped fails here; and
its modules import one another without a circle."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # its modules import each other as `bench/run.py` runs them

import run  # noqa: E402

from scenarios.scenario import JSON_KEYS, Result, Table  # noqa: E402

# The keys of the JSON line (bench/json_keys.json), as the quick run at c1ad687 had them
# and with the ones added since (the asyncio scenario's: issue 35; accounts_10k_status_cpu_s
# and accounts_10k_status_floor_s: issue 36): scripts outside the project read them, so the
# record changes only on purpose. The scenarios take their keys from it (``keys``, and
# ``optional_keys``: emitted only when something went wrong), and the bench reports a
# scenario whose JSON differs; these tests hold the record and the plans to each other.
RECORD = json.loads(JSON_KEYS.read_text())
SCENARIO_KEYS: dict[str, list[str]] = {
    name: keys["keys"] for name, keys in RECORD["scenarios"].items()
}
OPTIONAL_KEYS: dict[str, list[str]] = {
    name: keys["optional_keys"]
    for name, keys in RECORD["scenarios"].items()
    if "optional_keys" in keys
}
RUN_KEYS: list[str] = RECORD["run"]
NESTED_KEYS: dict[str, set[str]] = {key: set(keys) for key, keys in RECORD["nested"].items()}


def test_the_record_of_keys_still_holds_every_key_scripts_read() -> None:
    """The record guards the declarations; this guards the record against a key dropped
    from both: its counts, and keys from each part of it, as the line has them."""
    assert {name: len(keys) for name, keys in SCENARIO_KEYS.items()} == {
        "fleet": 25,
        "storm": 28,
        "hot path": 16,
        "celery": 5,
        "accounts check": 7,
        "cold start": 13,
        "sealing": 7,
        "10k accounts": 9,
        "asyncio": 15,
    }
    assert {name: len(keys) for name, keys in OPTIONAL_KEYS.items()} == {"fleet": 14, "storm": 2}
    assert len(RUN_KEYS) == 9
    assert {"storm_p99_ms", "exchanges_ours", "hot_path_ratio", "celery_ratio"} <= {
        key for keys in SCENARIO_KEYS.values() for key in keys
    }


@pytest.mark.parametrize("plan", [run.QUICK, run.FULL], ids=lambda plan: plan.name)
def test_each_scenario_of_a_plan_has_its_keys_in_the_record_and_no_other_has(
    plan: run.Plan,
) -> None:
    assert {s.name: list(s.keys) for s in plan.scenarios} == SCENARIO_KEYS
    assert {s.name: list(s.optional_keys) for s in plan.scenarios if s.optional_keys} == (
        OPTIONAL_KEYS
    )


def test_no_two_scenarios_emit_the_same_key() -> None:
    keys = [key for s in run.QUICK.scenarios for key in (*s.keys, *s.optional_keys)]
    assert len(keys) == len(set(keys))


def test_the_headline_keys_are_each_a_scenario_s() -> None:
    declared = {key for s in run.QUICK.scenarios for key in s.keys}
    assert set(run.HEADLINE_KEYS) <= declared


def test_a_run_that_found_nothing_still_writes_the_headline_and_run_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_facts = {"load_average_1min": [0.5, 0.5], "commit_at_start": "c1ad687"}
    status = run.report(run.QUICK, run.Findings(), run_facts, elapsed=1.0)
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert status == 0
    assert set(line) == set(run.HEADLINE_KEYS) | set(RUN_KEYS)
    assert list(line)[: len(run.HEADLINE_KEYS)] == list(run.HEADLINE_KEYS)
    assert {key: set(line[key]) for key in NESTED_KEYS} == NESTED_KEYS


def test_a_scenario_that_emits_an_undeclared_key_or_misses_one_is_reported() -> None:
    storm = next(s for s in run.QUICK.scenarios if s.name == "storm")
    found: dict[str, object] = dict.fromkeys(storm.keys, 0)

    def result(json: dict[str, object], errors: list[str]) -> Result:
        return Result("storm", Table([], []), json, errors=errors)

    assert storm.undeclared_keys(result({**found, "storm_errors": {}}, [])) is None
    assert "storm_p99_msec" in str(
        storm.undeclared_keys(result({**found, "storm_p99_msec": 1}, []))
    )
    del found["storm_p99_ms"]
    assert "storm_p99_ms" in str(storm.undeclared_keys(result(found, [])))
    # a part that could not run leaves its keys out, and says so in its errors
    assert storm.undeclared_keys(result(found, ["storm: slow rounds: ScenarioError"])) is None


def test_the_bench_modules_import_one_another_without_a_circle() -> None:
    """Every import counts: at the top, inside functions and under TYPE_CHECKING."""
    modules = {
        ".".join(path.relative_to(BENCH).with_suffix("").parts).removesuffix(".__init__"): path
        for path in BENCH.rglob("*.py")
    }
    imports: dict[str, set[str]] = {}
    for module, path in modules.items():
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, level - 1 up
                    package = module.split(".")[: None if path.name == "__init__.py" else -1]
                    base = ".".join([*package[: len(package) - node.level + 1], base]).strip(".")
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in node.names)
        imports[module] = {name for name in names if name in modules} - {module}

    def circle_from(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        return next(
            (c for name in imports[module] if (c := circle_from(name, [*path, module]))), None
        )

    assert {module: circle_from(module, []) for module in modules} == dict.fromkeys(modules)
    assert "scenarios.fleet" in modules  # the walk found the scenario package
