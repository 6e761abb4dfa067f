"""Local child processes for the demo (and the tests and benchmarks that reuse them).

A private ``redis-server`` on a free loopback port, and child process groups that are
stopped whole, so that nothing started here outlives its owner.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis

STOP_TIMEOUT = 10.0  # seconds a child gets to exit after SIGTERM before SIGKILL
START_TIMEOUT = 10.0  # seconds a redis-server gets to answer


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


def stop_group(process: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM a child's whole process group, SIGKILL whatever is left after ``timeout``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # prefork children left behind, if any
    process.wait()


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
    probe = redis.Redis(port=port, password=password, socket_connect_timeout=0.2)
    try:
        return bool(probe.ping())
    except redis.RedisError:
        return False
    finally:
        probe.close()


class RedisServer:
    """A private redis-server that its owner may start, kill and start again on one port."""

    def __init__(self, workdir: Path, *options: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.argv = redis_server_command(self.port, workdir, *options)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, ready: Callable[[], bool] | None = None) -> RedisServer:
        """Start it and wait until it answers (or until ``ready`` holds)."""
        with (self.workdir / "redis-server.log").open("ab") as log:
            self.process = subprocess.Popen(  # noqa: S603 - our own argv
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_until(ready or (lambda: redis_answers(self.port)), "the private redis-server")
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save; only what was fsynced survives."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process)
            self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
