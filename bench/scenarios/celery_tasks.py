"""4. Celery: merchant_tasks.call_api against a bare task doing the same GET
(``bench/bare_tasks.py``), on the same worker, interleaved pairs of batches."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import ClassVar

from harness import (
    LONG_LIFETIME,
    PING,
    Bench,
    ScenarioError,
    median,
    progress,
    worker_argv,
)
from merchant_tasks.worker.app import package_defaults
from scenarios.scenario import Goal, Result, Scenario, Table, fmt

CELERY_GOAL = 0.95  # tasks/s, call_api / bare
STATIC_TOKEN_KEY = "bench:static-token"  # the bare Celery task's token, written by the bench

CELERYCONFIG = '''"""The bench's Celery configuration: the package defaults, plus the bare task."""

imports = ("merchant_tasks.tasks", "bare_tasks")
'''


@dataclass(frozen=True)
class CeleryTasks(Scenario):
    """Celery: merchant_tasks.call_api against a bare task doing the same GET, one worker."""

    pairs: int
    tasks: int
    concurrency: int = 2
    name: ClassVar[str] = "celery"

    def measure(self, bench: Bench) -> Result:
        from celery import Celery
        from celery.result import ResultSet

        bench.control.configure(lifetime=LONG_LIFETIME, revoke_on_issue=False)
        prefix = f"bench-celery-{uuid.uuid4().hex[:8]}"
        # the bare task's static token: a valid one, put in Redis before the worker starts
        bench.store.set(STATIC_TOKEN_KEY, bench.client(prefix).manager.token().value)
        celery_dir = bench.workdir / "celery"
        celery_dir.mkdir()
        (celery_dir / "celeryconfig.py").write_text(CELERYCONFIG)
        worker_env = bench.env(bench.settings(prefix), BENCH_STATIC_TOKEN_KEY=STATIC_TOKEN_KEY)
        worker = bench.spawn(
            "celery-worker",
            worker_argv(self.concurrency, "-n", f"bench-{uuid.uuid4().hex[:6]}@%h"),
            env=worker_env,
            cwd=celery_dir,
        )
        # configured as the fleet's workers are: their Celery keys are under the fleet's prefix
        producer = Celery("bench-producer", set_as_current=False)
        producer.conf.update({**package_defaults(worker_env), "imports": ()})
        names = {"ours": "merchant_tasks.call_api", "bare": "bench.bare_call"}

        def batch(which: str, n: int, timeout: float) -> tuple[float, int]:
            t0 = time.perf_counter()
            results = [producer.send_task(names[which], args=["GET", PING]) for _ in range(n)]
            try:
                values = ResultSet(results).get(timeout=timeout, propagate=False)
            except Exception as exc:
                raise ScenarioError(
                    f"{which} tasks did not finish in {timeout:g} s ({type(exc).__name__}); "
                    f"worker log: {worker.log_tail()}"
                ) from exc
            elapsed = time.perf_counter() - t0
            failures = sum(1 for v in values if not (isinstance(v, dict) and v.get("ok") is True))
            return n / elapsed, failures

        try:
            for which in names:  # readiness, and every child warm: connections, token, imports
                _, failures = batch(which, 8 * self.concurrency, timeout=90)
                if failures:
                    raise ScenarioError(f"{which} warm-up tasks failed: {worker.log_tail()}")
            rates: dict[str, list[float]] = {"ours": [], "bare": []}
            ratios: list[float] = []
            failed = {"ours": 0, "bare": 0}
            for i in range(self.pairs):
                pair: dict[str, float] = {}
                for which in ("ours", "bare") if i % 2 == 0 else ("bare", "ours"):
                    pair[which], failures = batch(which, self.tasks, timeout=300)
                    failed[which] += failures
                    rates[which].append(pair[which])
                ratios.append(pair["ours"] / pair["bare"])
        finally:
            producer.close()
            worker.stop()
        ratio = median(ratios)
        ours_rate, bare_rate = median(rates["ours"]), median(rates["bare"])
        found = {
            "celery_ratio": round(ratio, 3),
            "celery_ratios": [round(r, 3) for r in ratios],
            "celery_ours_tasks_per_s": round(ours_rate, 1),
            "celery_bare_tasks_per_s": round(bare_rate, 1),
            "celery_failed_tasks": failed,
        }
        progress(f"celery: ratio {ratio:.3f} ({ours_rate:.0f} vs {bare_rate:.0f} tasks/s)")
        return Result(
            title=f"4. Celery: one worker, --pool=prefork --concurrency={self.concurrency}, "
            f"{self.pairs} interleaved pairs of {self.tasks} tasks",
            table=Table(
                ["", "tasks/s (median batch)", "failed tasks"],
                [
                    ["ours: merchant_tasks.call_api", fmt(ours_rate, 1), str(failed["ours"])],
                    ["bare task, static token", fmt(bare_rate, 1), str(failed["bare"])],
                    ["ours / bare (median of pairs)", f"{ratio:.3f}", ""],
                ],
            ),
            json=found,
            goals=[
                Goal(
                    "Celery tasks/s, call_api / bare",
                    f">= {CELERY_GOAL}",
                    f"{ratio:.3f}",
                    ratio >= CELERY_GOAL,
                )
            ],
            notes=[f"per-pair ratios: {', '.join(f'{r:.3f}' for r in ratios)}"],
        )
