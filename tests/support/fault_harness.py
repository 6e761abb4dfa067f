"""The fault suite's harness: what a test saw (``Evidence``, searched for secrets and tokens
when the test ends), caller processes (``Callers``) and calling threads (``CallLoop``).

faults/test_faults.py uses it (docs/reliability.md maps each fault row to its test), and
integration/store/test_redis_sentinel.py its calling threads and evidence.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, cast

import redis

from merchant_tasks.accounts import FleetClient
from merchant_tasks.exceptions import MerchantError
from merchant_tasks.sandbox.emulator import SandboxApp
from merchant_tasks.sandbox.processes import Child, spawn, wait_all_ready
from support.leaks import redis_value, shows
from support.routes import PING

CALLER = Path(__file__).with_name("fault_caller.py")
START_TIMEOUT = 60.0  # a process's start on a busy two-core machine
STOP_TIMEOUT = 60.0  # a caller's report after it was told to stop, on a busy machine
# seconds between two calls of one CallLoop thread: 20 a second meet every phase of a fault,
# and a faster loop only takes the CPU from the processes under test
CALL_PAUSE = 0.05


@dataclass
class Evidence:
    """Everything a fault test saw, and what must never appear in it.

    Each test has its own (the ``evidence`` fixture, conftest's, with more needles in
    faults/test_faults.py), searched by ``assert_no_leak`` when the test ends, so the
    search holds for a test run alone (``-k``) or on any xdist worker.
    """

    texts: dict[str, bytes] = field(default_factory=dict)
    needles: dict[str, str] = field(default_factory=dict)

    def add(self, where: str, text: str | bytes) -> None:
        key, n = where, 1
        while key in self.texts:
            n += 1
            key = f"{where} ({n})"
        self.texts[key] = text.encode("utf-8", "replace") if isinstance(text, str) else text

    def exception(self, where: str, exc: BaseException) -> None:
        self.add(where, f"{exc!r}\n{exc}\n{''.join(traceback.format_exception(exc))}")

    def needle(self, what: str, value: str) -> None:
        self.needles[what] = value

    def emulator(self, where: str, app: SandboxApp) -> None:
        """The emulator's current secret and every token it ever issued."""
        self.needle(f"{where}: emulator secret", app.config.secret)
        for n, token in enumerate(app.issued_tokens()):
            self.needle(f"{where}: token #{n}", token)

    def redis_keys(self, where: str, client: redis.Redis, match: str = "*") -> None:
        """Every key matching ``match`` except token keys, the one place a token may be."""
        for key in client.scan_iter(match=match, count=1000):
            if not key.endswith(b":token"):
                self.add(f"{where}: Redis key {key!r}", redis_value(client, key))

    def include(self, other: Evidence) -> None:
        """Another record's texts and needles too (a shared fixture's, for each test)."""
        for where, text in other.texts.items():
            self.add(where, text)
        self.needles.update(other.needles)

    def leaks(self) -> list[str]:
        return [
            f"{what} in {where}"
            for what, needle in self.needles.items()
            for where, text in self.texts.items()
            if shows(needle, text)
        ]

    def assert_no_leak(self) -> None:
        """Fails, naming each needle and where it showed, if any text shows any needle."""
        leaks = self.leaks()
        assert not leaks, f"secrets or tokens in what the test saw: {leaks}"


class LogLines(logging.Handler):
    """Formats every record as it is emitted, tracebacks included."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:
            self.handleError(record)


@dataclass
class Callers:
    """Processes running support/fault_caller.py for one account, started and stopped together."""

    control: redis.Redis
    control_url: str
    key: str
    workdir: Path
    evidence: Evidence
    name: str
    processes: list[Child] = field(default_factory=list, init=False)

    def start(self, env: Mapping[str, str], each: Sequence[Mapping[str, str]]) -> None:
        """One process per entry of ``each`` (its extra variables); returns once all wait."""
        for extra in each:
            n = len(self.processes)
            caller_env = {
                **env,
                **extra,
                "FAULT_KEY": self.key,
                "FAULT_CONTROL_URL": self.control_url,
            }
            self.processes.append(
                spawn(
                    f"caller {n}",
                    [sys.executable, str(CALLER)],
                    self.workdir / f"caller-{n}.log",
                    env=caller_env,
                    stdout_pipe=True,
                )
            )

        def all_ready() -> bool:
            ready = int(cast(bytes, self.control.get(f"{self.key}:ready") or 0))
            return ready >= len(self.processes)

        wait_all_ready(self.processes, all_ready, "caller processes ready", START_TIMEOUT)

    @property
    def pids(self) -> list[int]:
        return [child.process.pid for child in self.processes]

    def go(self) -> None:
        self.control.set(f"{self.key}:go", 1)

    def phase(self, label: str) -> None:
        self.control.set(f"{self.key}:phase", label)

    def counts(self) -> Counter[tuple[int, str, str]]:
        """Outcomes so far, by (pid, phase, outcome)."""
        raw = cast(dict[bytes, bytes], self.control.hgetall(f"{self.key}:progress"))
        counts: Counter[tuple[int, str, str]] = Counter()
        for name, value in raw.items():
            pid, phase, outcome = name.decode().split(":", 2)
            counts[int(pid), phase, outcome] = int(value)
        return counts

    def each_has(self, phase: str, outcome: str | None = None, at_least: int = 1) -> bool:
        """Whether every process counted ``at_least`` outcomes (of that kind) in ``phase``."""
        counts = self.counts()
        return all(
            sum(
                n
                for (p, ph, out), n in counts.items()
                if p == pid and ph == phase and outcome in (None, out)
            )
            >= at_least
            for pid in self.pids
        )

    def stop(self) -> list[dict[str, Any]]:
        """Stop every process; their reports. A process that did not exit 0 crashed."""
        self.control.set(f"{self.key}:stop", 1)
        reports = []
        for child in self.processes:
            process = child.process
            try:
                out = child.output(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                child.kill()
                raise AssertionError(f"caller {process.pid} did not stop") from None
            self.evidence.add(f"{self.name}: caller {process.pid} output", out)
            self.evidence.add(f"{self.name}: caller {process.pid} DEBUG log", child.log_text())
            assert process.returncode == 0, f"caller {process.pid} crashed:\n{child.log_tail(60)}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
        self.processes.clear()
        return reports

    def kill(self) -> None:
        """SIGKILL every process still running (no report)."""
        for child in self.processes:
            child.kill()
            self.evidence.add(f"{self.name}: killed caller {child.process.pid}", child.log_text())
        self.processes.clear()


def report_outcomes(report: Mapping[str, Any], phase: str) -> list[str]:
    """A caller report's outcomes in ``phase``, expanded from their run-length code."""
    return [outcome for outcome, n in report["phases"].get(phase, []) for _ in range(n)]


class CallingThreads:
    """Threads that call until stopped: started on entering the ``with`` block, told to stop
    and joined on leaving it."""

    _threads: list[threading.Thread]
    _stop: threading.Event

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60.0)


class Calling(CallingThreads):
    """Threads calling PING in a loop, every outcome kept with its (monotonic) time; a thread
    pauses ``pause`` after each call, or ``pause_after_error`` after a failed one."""

    def __init__(
        self,
        client: FleetClient,
        threads: int,
        *,
        pause: float = 0.0,
        pause_after_error: float = 0.05,
    ) -> None:
        self.client = client
        self.outcomes: list[tuple[float, str]] = []
        self.pause, self.pause_after_error = pause, pause_after_error
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop) for _ in range(threads)]

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.request("GET", PING)
                outcome = "ok"
            except MerchantError as exc:
                outcome = type(exc).__name__
            with self._lock:
                self.outcomes.append((time.monotonic(), outcome))
            time.sleep(self.pause if outcome == "ok" else max(self.pause, self.pause_after_error))

    def counts(self) -> Counter[str]:
        """How many calls ended each way so far."""
        with self._lock:
            return Counter(outcome for _, outcome in self.outcomes)

    def first_success_after(self, moment: float) -> float | None:
        with self._lock:
            return min((t for t, o in self.outcomes if o == "ok" and t > moment), default=None)

    def successes_after(self, moment: float) -> int:
        """How many calls succeeded after ``moment`` (monotonic)."""
        with self._lock:
            return sum(o == "ok" and t > moment for t, o in self.outcomes)


class CallLoop(CallingThreads):
    """Threads calling PING through one client until stopped; every outcome kept with its
    phase, thread and start time. Thread ``n`` sends ``X-Caller: thread-n``, so that an
    emulator can tell the callers apart; each distinct failure goes to the evidence."""

    def __init__(
        self,
        client: FleetClient,
        threads: int,
        evidence: Evidence,
        where: str,
        pause: float = CALL_PAUSE,
    ) -> None:
        self.client = client
        self.evidence = evidence
        self.where = where
        self.pause = pause
        self.phase = "0"
        self.outcomes: list[tuple[str, int, str, float]] = []  # (phase, thread, outcome, start)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(threads)
        ]

    def _run(self, n: int) -> None:
        seen: set[str] = set()
        deadline = time.monotonic() + 300  # never outlive a test that forgot to stop
        while not self._stop.is_set() and time.monotonic() < deadline:
            phase, started = self.phase, time.monotonic()
            try:
                self.client.request("GET", PING, headers={"x-caller": f"thread-{n}"})
                outcome = "ok"
            except Exception as exc:  # a typed error, or a crash: the test says which may occur
                kind = type(exc).__name__
                outcome = kind if isinstance(exc, MerchantError) else f"crash {kind}: {exc}"
                text = f"{exc!r} {exc} {exc.__cause__!r} {exc.__context__!r}"
                if text not in seen:
                    seen.add(text)
                    self.evidence.exception(f"{self.where}: thread {n}", exc)
            self.outcomes.append((phase, n, outcome, started))
            self._stop.wait(self.pause)

    def of(
        self, phase: str | None = None, thread: int | None = None, since: float = 0.0
    ) -> list[str]:
        """Outcomes in ``phase`` of ``thread`` (all if None) of calls started after ``since``."""
        return [
            outcome
            for ph, n, outcome, started in list(self.outcomes)
            if phase in (None, ph) and thread in (None, n) and started >= since
        ]

    def each_thread_ok_in(self, phase: str, at_least: int = 1) -> bool:
        """Whether every thread had ``at_least`` successful calls in ``phase``."""
        return all(self.of(phase, n).count("ok") >= at_least for n in range(len(self._threads)))

    def failures(self, origin: float) -> list[str]:
        """Every failed call: its thread, start (seconds after ``origin``) and outcome."""
        return [
            f"thread {n} at {started - origin:+.2f} s: {outcome}"
            for _, n, outcome, started in list(self.outcomes)
            if outcome != "ok"
        ]
