"""1. Fleet economy: P processes x T threads calling for D seconds with token lifetime L and
advisory window R; ours (plus a beat process) against authlib's per-process cache and a
lock-free shared Redis cache, with the emulator's revoke-on-issue off and on. Each process
is ``bench/fleet_worker.py``; the peers are ``bench/peers.py``."""

from __future__ import annotations

import logging
import math
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from harness import (
    BENCH_DIR,
    Bench,
    ScenarioError,
    counter_delta,
    last_json_line,
    progress,
    wait_until,
)
from scenarios.scenario import Goal, Result, Scenario, Table, compact

CONTENDERS = (
    ("ours", "ours (MerchantClient + beat)"),
    ("authlib", "per-process cache (authlib OAuth2Session)"),
    ("nolock", "shared Redis cache, no lock"),
)
JSON_NAMES = {"ours": "ours", "authlib": "peer_per_process", "nolock": "peer_shared_nolock"}
# each contender's name in the JSON keys, before the emulator's mode (FleetRun.json)

log = logging.getLogger("bench")


@dataclass
class FleetRun:
    contender: str
    revoke_on_issue: bool
    exchanges: int
    exchange_refusals: int
    unauthorized: int
    failed: int
    ok: int
    server_ok: int
    errors: dict[str, int]
    beat_errors: dict[str, int]

    def json(self) -> dict[str, Any]:
        """This run's keys: the contender's JSON name, then the emulator's mode."""
        mode = "_revoke_on_issue" if self.revoke_on_issue else ""
        name = JSON_NAMES[self.contender] + mode
        found: dict[str, Any] = {
            f"exchanges_{name}": self.exchanges,
            f"unauthorized_{name}": self.unauthorized,
            f"failed_calls_{name}": self.failed,
            f"calls_ok_{name}": self.ok,
        }
        if self.exchange_refusals:
            found[f"exchanges_refused_{name}"] = self.exchange_refusals
        if self.errors:
            found[f"errors_{name}"] = self.errors
        if self.beat_errors:
            found[f"beat_errors{mode}"] = self.beat_errors
        return found


@dataclass(frozen=True)
class Fleet(Scenario):
    """P processes x T threads calling for D seconds with token lifetime L and advisory
    window R, each contender in turn, with the emulator's revoke-on-issue off and on."""

    processes: int  # P
    threads: int  # T
    duration: float  # D, seconds
    lifetime: float  # L, seconds
    advisory: float  # R, seconds
    name: ClassVar[str] = "fleet"

    @property
    def mandatory(self) -> float:
        return round(self.advisory / 3, 3)

    @property
    def renew_interval(self) -> float:
        return round(self.lifetime / 10, 3)

    @property
    def minimum_exchanges(self) -> int:
        return math.ceil(self.duration / (self.lifetime - self.advisory))

    def measure(self, bench: Bench) -> Result:
        minimum = self.minimum_exchanges
        found: dict[str, Any] = {"exchanges_minimum": minimum}
        runs: list[FleetRun] = []
        errors: list[str] = []
        for revoke in (False, True):
            for contender, _ in CONTENDERS:
                started = time.monotonic()
                try:
                    run = self.run(bench, contender, revoke)
                except Exception as exc:  # one contender that cannot run does not stop the rest
                    log.exception(
                        "fleet run %s (revoke_on_issue=%s) could not run", contender, revoke
                    )
                    what = f"fleet {contender} revoke_on_issue={revoke}"
                    errors.append(compact(f"{what}: {type(exc).__name__}: {exc}"))
                    continue
                runs.append(run)
                progress(
                    f"fleet {contender} revoke_on_issue={revoke}: {run.exchanges} exchanges, "
                    f"{run.unauthorized} 401s, {run.failed} failed, {run.ok} ok "
                    f"({time.monotonic() - started:.1f} s)"
                )
                found.update(run.json())
        labels = dict(CONTENDERS)
        rows = [
            [
                labels[r.contender],
                "on" if r.revoke_on_issue else "off",
                str(r.exchanges),
                f"{r.exchanges / minimum:.2f}",
                str(r.unauthorized),
                str(r.failed),
                f"{r.ok:,}",
                f"{r.ok / self.duration:,.0f}",
            ]
            for r in runs
        ]
        header = ["contender", "revoke-on-issue", "exchanges", "x minimum", "401s"]
        header += ["failed calls", "calls ok", "calls/s"]
        goals: list[Goal] = []
        for r in runs:
            if r.contender == "ours":
                mode = f"ours, revoke-on-issue {'on' if r.revoke_on_issue else 'off'}"
                goals.append(
                    Goal(
                        f"fleet exchanges, {mode}",
                        f"<= {minimum}",
                        str(r.exchanges),
                        r.exchanges <= minimum,
                    )
                )
                goals.append(Goal(f"fleet failed calls, {mode}", "0", str(r.failed), r.failed == 0))
        return Result(
            title=f"1. Fleet economy: {self.processes} processes x {self.threads} threads, "
            f"{self.duration:g} s, lifetime L={self.lifetime:g} s, advisory R={self.advisory:g} s "
            f"(mandatory {self.mandatory:g} s, beat every {self.renew_interval:g} s)",
            table=Table(header, rows),
            json=found,
            goals=goals,
            notes=[f"minimum exchanges = ceil(D / (L - R)) = {minimum}"],
            errors=errors,
        )

    def run(self, bench: Bench, contender: str, revoke_on_issue: bool) -> FleetRun:
        bench.control.configure(lifetime=self.lifetime, revoke_on_issue=revoke_on_issue)
        bench.control.revoke_all()  # nothing issued for an earlier run stays usable
        tag = uuid.uuid4().hex[:8]
        ready_key, go_key = f"bench:{tag}:ready", f"bench:{tag}:go"
        windows = bench.settings(
            f"bench-{tag}",
            token_lifetime=self.lifetime,
            renew_before=self.advisory,
            renew_mandatory=self.mandatory,
            renew_interval=self.renew_interval,
        )
        env = bench.env(
            windows,
            BENCH_REDIS_URL=bench.redis_url,
            BENCH_READY_KEY=ready_key,
            BENCH_GO_KEY=go_key,
            BENCH_ADVISORY=repr(self.advisory),
            BENCH_SHARED_KEY=f"bench:{tag}:shared-token",
        )
        roles = [contender] * self.processes + (["beat"] if contender == "ours" else [])
        worker = str(BENCH_DIR / "fleet_worker.py")
        children = [
            bench.spawn(
                f"fleet-{contender}-{'revoke' if revoke_on_issue else 'keep'}-{i}-{role}",
                [sys.executable, worker, role, str(self.threads), repr(self.duration)],
                env=env,
                stdout_pipe=True,
            )
            for i, role in enumerate(roles)
        ]
        try:

            def all_ready() -> bool:
                for child in children:
                    if child.process.poll() is not None:
                        raise ScenarioError(f"{child.name} exited early: {child.log_tail()}")
                return int(bench.store.get(ready_key) or 0) == len(children)

            wait_until(all_ready, f"{len(children)} fleet processes", timeout=60)
            before = bench.control.counters()
            bench.store.set(go_key, repr(time.time() + 0.3))
            outputs: list[dict[str, Any]] = []
            for child in children:
                try:
                    out, _ = child.process.communicate(timeout=self.duration + 60)
                except Exception as exc:
                    raise ScenarioError(f"{child.name} did not finish: {child.log_tail()}") from exc
                if child.process.returncode != 0:
                    raise ScenarioError(f"{child.name} failed: {child.log_tail()}")
                outputs.append(last_json_line(out.decode(errors="replace")))
            after = bench.control.counters()
        finally:
            for child in children:
                child.stop()
                if child.process.stdout is not None:
                    child.process.stdout.close()
        delta = counter_delta(before, after)
        callers = [o for o in outputs if o["role"] != "beat"]
        errors: Counter[str] = Counter()
        beat_errors: Counter[str] = Counter()
        for output in outputs:
            (beat_errors if output["role"] == "beat" else errors).update(output["errors"])
        return FleetRun(
            contender=contender,
            revoke_on_issue=revoke_on_issue,
            exchanges=delta["exchanges.ok"],
            exchange_refusals=sum(v for k, v in delta.items() if k.startswith("exchanges."))
            - delta["exchanges.ok"],
            unauthorized=delta["calls.unauthorized"],
            failed=sum(int(o["failed"]) for o in callers),
            ok=sum(int(o["ok"]) for o in callers),
            server_ok=delta["calls.ok"],
            errors=dict(errors),
            beat_errors=dict(beat_errors),
        )
