"""Local child processes for the demo (and the tests and benchmarks that reuse them).

One way to run a child: ``spawn`` starts it in its own session (so it leads its own process
group) with its output in a log file, ``Child.wait_ready`` waits until it answers, and
``Child.stop`` stops the whole group, so that nothing started here outlives its owner.
``running`` does all three around a ``with`` block. ``RedisServer`` is a private
``redis-server`` on a free loopback port, run that way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from merchant_tasks.store.topology import probe_redis

STOP_TIMEOUT = 10.0  # seconds a child gets to exit after SIGTERM before SIGKILL
START_TIMEOUT = 10.0  # seconds a redis-server gets to answer
LAST_WORDS_LINES = 200  # of a child's log shown when it dies at start: a whole traceback
PROBE_CONNECT_TIMEOUT = 0.2  # a redis-server on this host that is up accepts at once


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
    """Poll ``ready`` until it holds; TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(0.02)


def wait_all_ready(
    children: Sequence[Child], ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT
) -> None:
    """``wait_until(ready)``, failing at once (with its log's tail) if any child exits."""

    def answers() -> bool:
        for child in children:
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited; its log ends:\n{child.last_words()}")
        return ready()

    wait_until(answers, what, timeout)


def stop_groups(
    processes: Sequence[subprocess.Popen[bytes]], timeout: float = STOP_TIMEOUT
) -> None:
    """SIGTERM each child's whole process group, SIGKILL whatever is left after ``timeout``.
    Every child is asked before any is waited for, so their shutdowns (a Celery worker's
    takes about a second) overlap."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # prefork children left behind, if any
        process.wait()


@dataclass
class Child:
    """A child process leading its own process group, with its output in a log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def last_words(self, lines: int = LAST_WORDS_LINES) -> str:
        """How the log ends, whole: from its last traceback's first line (within ``lines``
        of the end), else its last ``lines`` lines, for a child that died."""
        tail = self.log_text().splitlines()[-lines:]
        starts = [n for n, line in enumerate(tail) if line.startswith("Traceback (most recent")]
        return "\n".join(tail[starts[-1] :] if starts else tail)

    def wait_ready(
        self, ready: Callable[[], bool], what: str = "", timeout: float = START_TIMEOUT
    ) -> None:
        """``wait_until(ready)``, failing at once (with the log's tail) if the child exits."""
        wait_all_ready([self], ready, what or self.name, timeout)

    def read_line(self) -> str:
        """The next line the child prints (spawned with ``stdout_pipe``), without its newline."""
        assert self.process.stdout is not None, f"{self.name}: spawned without stdout_pipe"
        return self.process.stdout.readline().decode(errors="replace").rstrip("\n")

    def output(self, timeout: float = STOP_TIMEOUT) -> str:
        """Wait for the child to exit; what it printed (``stdout_pipe``) that was not read yet.

        Raises ``subprocess.TimeoutExpired`` if it is still running after ``timeout`` s.
        """
        out, _ = self.process.communicate(timeout=timeout)
        return out.decode(errors="replace") if out is not None else ""

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the whole group, as a terminal sends Ctrl-C (SIGINT)."""
        os.killpg(self.process.pid, signum)

    def group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or the id is not ours any more
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the whole group at once (no shutdown, no save) and reap the leader."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._close_pipe()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        stop_all([self], timeout)

    def _close_pipe(self) -> None:
        if self.process.stdout is not None:
            self.process.stdout.close()


def stop_all(children: Sequence[Child], timeout: float = STOP_TIMEOUT) -> None:
    """``Child.stop`` for several children at once (see ``stop_groups``)."""
    stop_groups([child.process for child in children], timeout)
    for child in children:
        child._close_pipe()


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdout_pipe: bool = False,
) -> Child:
    """Start ``argv`` in a new session; stderr (and stdout unless piped) go to ``log``."""
    with log.open("wb") as out:  # the child holds its own descriptor
        process = subprocess.Popen(  # noqa: S603 - our own argv
            list(argv),
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else out,
            stderr=out,
            start_new_session=True,
        )
    return Child(name, process, log)


@contextlib.contextmanager
def running(
    name: str,
    argv: Sequence[str],
    log: Path,
    ready: Callable[[], bool] | None = None,
    *,
    timeout: float = START_TIMEOUT,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[Child]:
    """A child for the ``with`` block: spawned, waited for until ``ready``, stopped whole."""
    child = spawn(name, argv, log, env=env, cwd=cwd)
    try:
        if ready is not None:
            child.wait_ready(ready, name, timeout)
        yield child
    finally:
        child.stop()


def redis_server_command(port: int, workdir: Path, *options: str) -> list[str]:
    """argv of a redis-server on 127.0.0.1:``port`` that persists nothing (``options`` win)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not on PATH")
    return [
        binary,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(workdir),
        *options,
    ]  # fmt: skip


def redis_answers(port: int, password: str | None = None) -> bool:
    """Whether a Redis on this host's ``port`` answers (a private one starting, say)."""
    credentials = f":{quote(password, safe='')}@" if password else ""
    url = f"redis://{credentials}localhost:{port}"
    return probe_redis(url, connect_timeout=PROBE_CONNECT_TIMEOUT)


class RedisServer:
    """A private redis-server that its owner may start, kill and start again on one port."""

    def __init__(self, workdir: Path, *options: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.argv = redis_server_command(self.port, workdir, *options)
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, ready: Callable[[], bool] | None = None) -> RedisServer:
        """Start it and wait until it answers (or until ``ready`` holds)."""
        self.child = spawn("redis-server", self.argv, self.workdir / "redis-server.log")
        self.child.wait_ready(
            ready or (lambda: redis_answers(self.port)), "the private redis-server"
        )
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save; only what was fsynced survives."""
        assert self.child is not None
        self.child.kill()
        self.child = None

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
            self.child = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
