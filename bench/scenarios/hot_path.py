"""3. Hot path: MerchantClient.request against a raw requests.Session with a fixed bearer
header, interleaved rounds in one thread, first against ``SandboxServer`` (werkzeug, a new
connection per call), then against the same app behind Tornado's keep-alive server; Redis
commands per call from INFO commandstats."""

from __future__ import annotations

import cProfile
import io
import pstats
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import requests

from harness import (
    LONG_LIFETIME,
    PING,
    Bench,
    commands_processed,
    median,
    progress,
    sandbox_process,
)
from merchant_tasks.settings import DEFAULT_TIMEOUTS
from scenarios.scenario import Goal, Result, Scenario, Table, fmt

HOT_PATH_GOAL = 0.97  # calls/s, ours / raw
REDIS_OPS_GOAL = 1.0  # Redis commands per call of ours
SERVERS = ("", "_keepalive")  # each emulator's suffix in the JSON keys: werkzeug, tornado


@dataclass
class HotPathRun:
    server: str
    ours_rate: float
    raw_rate: float
    ratios: list[float]
    redis_per_call: float
    ours_cpu_us: float  # this thread's CPU time per call: the client's own cost
    raw_cpu_us: float

    @property
    def ratio(self) -> float:
        return median(self.ratios)

    @property
    def added_us(self) -> float:
        return (1 / self.ours_rate - 1 / self.raw_rate) * 1e6

    def json(self, server: str) -> dict[str, Any]:
        """This run's keys, each ending in ``server`` (which emulator it measured)."""
        return {
            f"hot_path_ratio{server}": round(self.ratio, 3),
            f"hot_path_ratios{server}": [round(r, 3) for r in self.ratios],
            f"hot_path_ours_calls_per_s{server}": round(self.ours_rate),
            f"hot_path_raw_calls_per_s{server}": round(self.raw_rate),
            f"hot_path_added_us_per_call{server}": round(self.added_us, 1),
            f"redis_ops_per_call{server}": round(self.redis_per_call, 4),
            f"hot_path_client_cpu_us_ours{server}": round(self.ours_cpu_us, 1),
            f"hot_path_client_cpu_us_raw{server}": round(self.raw_cpu_us, 1),
        }


@dataclass(frozen=True)
class HotPath(Scenario):
    """MerchantClient.request against a raw requests.Session with a fixed bearer header,
    interleaved rounds in one thread; Redis commands per call from INFO commandstats."""

    rounds: int
    calls: int
    profile_path: Path | None = None  # also profile one extra round into this file
    name: ClassVar[str] = "hot path"

    def measure(self, bench: Bench) -> Result:
        if self.profile_path is not None:
            self.profile_path.write_text("")
        bench.control.configure(lifetime=LONG_LIFETIME, revoke_on_issue=False)
        runs = [self.run(bench, bench.sandbox_url, "SandboxServer (werkzeug)")]
        with sandbox_process(bench.workdir, bench.sandbox_env, "tornado") as (url, child):
            bench.children.append(child)
            runs.append(self.run(bench, url, "same app, keep-alive (tornado)"))
        main, keepalive = runs
        found = {**main.json(SERVERS[0]), **keepalive.json(SERVERS[1])}
        rows: list[list[str]] = []
        for run in runs:
            progress(
                f"hot path, {run.server}: ratio {run.ratio:.3f}, "
                f"{run.redis_per_call:.3f} Redis commands per call"
            )
            rows += [
                [
                    run.server,
                    "ours: MerchantClient.request",
                    fmt(run.ours_rate),
                    fmt(1e6 / run.ours_rate, 1),
                    fmt(run.ours_cpu_us, 1),
                    f"{run.redis_per_call:.3f}",
                ],
                [
                    "",
                    "raw requests.Session, fixed bearer",
                    fmt(run.raw_rate),
                    fmt(1e6 / run.raw_rate, 1),
                    fmt(run.raw_cpu_us, 1),
                    "0",
                ],
                [
                    "",
                    "**ours / raw** (median of rounds)",
                    f"**{run.ratio:.3f}**",
                    f"{run.added_us:+.1f}",
                    f"{run.ours_cpu_us - run.raw_cpu_us:+.1f}",
                    "",
                ],
            ]
        goals = [
            Goal(
                f"hot path calls/s, ours / raw{label}",
                f">= {HOT_PATH_GOAL}",
                f"{run.ratio:.3f}",
                run.ratio >= HOT_PATH_GOAL,
            )
            for run, label in ((main, ""), (keepalive, ", keep-alive emulator"))
        ]
        goals.append(
            Goal(
                "Redis commands per call (hot path)",
                f"<= {REDIS_OPS_GOAL:g}",
                f"{main.redis_per_call:.3f}",
                main.redis_per_call <= REDIS_OPS_GOAL,
            )
        )
        header = ["emulator served by", "", "calls/s (median round)", "us per call"]
        header += ["client CPU us per call", "Redis cmds/call"]
        return Result(
            title=f"3. Hot path: one thread, {self.rounds} interleaved rounds x "
            f"{self.calls} calls of GET {PING}",
            table=Table(header, rows),
            json=found,
            goals=goals,
            notes=[
                f"per-round ratios, {run.server}: {', '.join(f'{r:.3f}' for r in run.ratios)}"
                for run in runs
            ],
        )

    def run(self, bench: Bench, base_url: str, server: str) -> HotPathRun:
        """Interleaved rounds of ours and raw in this thread, against the emulator at base_url."""
        client = bench.client(f"bench-hot-{uuid.uuid4().hex[:8]}", base_url)
        token = client.manager.token().value  # valid for 7200 s: no renewal during the rounds
        raw = requests.Session()
        raw.headers.update({"accept": "application/json", "authorization": f"Bearer {token}"})
        url = base_url + PING

        def ours(n: int) -> None:
            for _ in range(n):
                client.request("GET", PING)

        def baseline(n: int) -> None:
            for _ in range(n):
                response = raw.get(url, timeout=DEFAULT_TIMEOUTS, allow_redirects=False)
                response.raise_for_status()
                response.json()

        ours(50)  # warm both connections and caches
        baseline(50)
        ours_rates: list[float] = []
        raw_rates: list[float] = []
        ratios: list[float] = []
        cpu: dict[str, list[float]] = {"ours": [], "raw": []}
        redis_commands = 0
        for i in range(self.rounds):
            rates: dict[str, float] = {}
            for which in ("ours", "raw") if i % 2 == 0 else ("raw", "ours"):
                counted = commands_processed(bench.store) if which == "ours" else 0
                cpu0, t0 = time.thread_time(), time.perf_counter()
                (ours if which == "ours" else baseline)(self.calls)
                elapsed = time.perf_counter() - t0
                cpu[which].append((time.thread_time() - cpu0) / self.calls * 1e6)
                if which == "ours":
                    redis_commands += commands_processed(bench.store) - counted
                rates[which] = self.calls / elapsed
            ours_rates.append(rates["ours"])
            raw_rates.append(rates["raw"])
            ratios.append(rates["ours"] / rates["raw"])
        if self.profile_path is not None:
            profiler = cProfile.Profile()
            profiler.enable()
            ours(self.calls)
            profiler.disable()
            text = io.StringIO()
            text.write(f"# {self.calls} calls of MerchantClient.request, {server}\n")
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(45)
            with self.profile_path.open("a") as out:
                out.write(text.getvalue())
            progress(f"hot path profile ({server}) appended to {self.profile_path}")
        raw.close()
        return HotPathRun(
            server,
            median(ours_rates),
            median(raw_rates),
            ratios,
            redis_commands / (self.calls * self.rounds),
            median(cpu["ours"]),
            median(cpu["raw"]),
        )
