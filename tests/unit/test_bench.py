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

from scenarios.scenario import Result, Table  # noqa: E402

# The keys each scenario emits when it ran, as the JSON line of the quick run at c1ad687
# had them (and the ones added since, marked); the fleet's figures come per contender and
# revoke-on-issue mode.
FLEET_RUNS = [
    f"{contender}{mode}"
    for mode in ("", "_revoke_on_issue")
    for contender in ("ours", "peer_per_process", "peer_shared_nolock")
]
SCENARIO_KEYS = {
    "fleet": [
        "exchanges_minimum",
        *(
            f"{figure}_{fleet_run}"
            for fleet_run in FLEET_RUNS
            for figure in ("exchanges", "unauthorized", "failed_calls", "calls_ok")
        ),
    ],
    "storm": [
        "storm_exchanges",
        "storm_exchanges_per_round",
        "storm_slow_exchange_exchanges_per_round",
        "storm_rounds",
        "storm_processes",
        "storm_unauthorized",
        "storm_failed_calls",
        "storm_p50_ms",
        "storm_p99_ms",
        "storm_calm_p50_ms",
        "storm_calm_p99_ms",
        "storm_p50_added_ms",
        "storm_p99_added_ms",
        "storm_exchange_ms",
        "storm_overhead_p99_ms",
        "storm_slow_exchange_p99_ms",
        "storm_slow_exchange_calm_p99_ms",
        "storm_slow_exchange_ms",
        "storm_slow_exchange_overhead_p99_ms",
        "storm_redis_cmds_per_waiter",
        "storm_slow_exchange_redis_cmds_per_waiter",
        "storm_after_renewal_exchanges_per_round",
        "storm_after_renewal_unauthorized",
        "storm_after_renewal_failed_calls",
        "storm_repeated_exchanges_per_revoke",
        "storm_repeated_p99_ms",
        "storm_repeated_overhead_p99_ms",
        "storm_repeated_failed_calls",
    ],
    "hot path": [
        "hot_path_ratio",
        "hot_path_ratios",
        "hot_path_ours_calls_per_s",
        "hot_path_raw_calls_per_s",
        "hot_path_added_us_per_call",
        "redis_ops_per_call",
        "hot_path_client_cpu_us_ours",
        "hot_path_client_cpu_us_raw",
        "hot_path_ratio_keepalive",
        "hot_path_ratios_keepalive",
        "hot_path_ours_calls_per_s_keepalive",
        "hot_path_raw_calls_per_s_keepalive",
        "hot_path_added_us_per_call_keepalive",
        "redis_ops_per_call_keepalive",
        "hot_path_client_cpu_us_ours_keepalive",
        "hot_path_client_cpu_us_raw_keepalive",
    ],
    "celery": [
        "celery_ratio",
        "celery_ratios",
        "celery_ours_tasks_per_s",
        "celery_bare_tasks_per_s",
        "celery_failed_tasks",
    ],
    "accounts check": [
        "accounts_check_accounts",
        "accounts_check_ms",
        "accounts_check_redis_roundtrips",
        "accounts_check_old_loop_ms",
        "accounts_check_old_loop_redis_roundtrips",
        "accounts_check_old_loop_first_ms",
        "accounts_check_old_loop_first_redis_roundtrips",
    ],
    "cold start": [
        "cold_start_max_exchanges_per_s",
        "cold_start_seconds",
        "cold_start_call_wait_s",
        "cold_start_call_account_unserved",
        "cold_start_cap_per_s",
        "accounts_cold_start_accounts",
        "accounts_cold_start_max_exchanges_per_s",
        "accounts_cold_start_first_burst_max_exchanges_per_s",
        "accounts_cold_start_renewals_spread_s",
        "accounts_cold_start_renewed_before_mandatory",
        "accounts_cold_start_exchanges",
        "accounts_cold_start_one_exchange_each",
        "accounts_cold_start_scheduled_exchanges",
    ],
    "sealing": [
        "sealing_hot_path_ratio",
        "sealing_hot_path_ratios",
        "sealing_hot_path_clear_us",
        "sealing_hot_path_sealed_us",
        "sealing_hot_path_clear_cpu_us",
        "sealing_hot_path_sealed_cpu_us",
        "sealing_open_us",
    ],
    "10k accounts": [
        "accounts_10k_check_ms",
        "accounts_10k_check_roundtrips",
        "accounts_10k_status_s",
        "accounts_10k_status_roundtrips",
        "accounts_10k_worker_rss_mb",
        "accounts_10k_call_s",
        "accounts_10k_call_ok",
    ],
    # added by issue 35: the asyncio client
    "asyncio": [
        "async_hot_path_ratio",
        "async_hot_path_ratios",
        "async_ours_calls_per_s",
        "async_raw_calls_per_s",
        "async_awaits_redis_commands_each",
        "async_awaits_exchanges",
        "async_awaits_failed",
        "async_loop_lag_p99_ms",
        "async_loop_lag_max_ms",
        "async_loop_lag_p99_ms_bare",
        "async_loop_lag_max_ms_bare",
        "async_loop_threads_max",
        "async_loop_calls_ok",
        "async_loop_calls_failed",
        "async_loop_exchanges",
    ],
}
# emitted only when something went wrong: errors by kind, refused exchanges
OPTIONAL_KEYS = {
    "fleet": [
        *(
            f"{figure}_{fleet_run}"
            for fleet_run in FLEET_RUNS
            for figure in ("exchanges_refused", "errors")
        ),
        "beat_errors",
        "beat_errors_revoke_on_issue",
    ],
    "storm": ["storm_errors", "storm_after_renewal_errors"],
}
RUN_KEYS = [
    "load_average_1min",
    "commit_at_start",
    "mode",
    "parameters",
    "goals_missed",
    "errors",
    "leftover_processes",
    "elapsed_s",
    "machine",
]
NESTED_KEYS = {
    "parameters": {"P", "T", "D", "L", "R", "mandatory", "beat_interval", "storm_callers"},
    "machine": {"nproc", "cpu", "python", "date", "commit"},
}


@pytest.mark.parametrize("plan", [run.QUICK, run.FULL], ids=lambda plan: plan.name)
def test_each_scenario_declares_the_keys_its_json_has_always_had(plan: run.Plan) -> None:
    assert {s.name: sorted(s.keys) for s in plan.scenarios} == {
        name: sorted(keys) for name, keys in SCENARIO_KEYS.items()
    }
    assert {s.name: sorted(s.optional_keys) for s in plan.scenarios if s.optional_keys} == {
        name: sorted(keys) for name, keys in OPTIONAL_KEYS.items()
    }


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
