"""The front door, followed: README's "Using it" run line by line as a newcomer runs it
gives one successful call."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from merchant_tasks.sandbox.processes import Child, RedisServer, free_port, spawn
from merchant_tasks.settings import SANDBOX_DEFAULT_BASE_URL, SANDBOX_DEFAULT_PORT
from support.doc_blocks import fenced_blocks
from support.paths import README

pytestmark = pytest.mark.integration


USING_IT = "using-it"  # the marker of README's "Using it" blocks
README_PATH_TIMEOUT = 180.0  # seconds for a worker to start and one call on a loaded machine


def _shell_lines(block: str) -> list[str]:
    """A shell block's commands, one per line, continuations joined, comments left out."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def _port_answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


def test_a_newcomer_following_using_it_line_by_line_gets_one_successful_call(
    tmp_path: Path,
) -> None:
    """README "Using it" as a newcomer runs it, in a fresh directory, on free ports: the
    only changes are the emulator's port (``--port``, and the base URL that
    ``MERCHANT_ENVIRONMENT=sandbox`` otherwise gives) and the Redis URL (a private server)."""
    text = README.read_text()
    said = "`MERCHANT_ENVIRONMENT=sandbox` points at the local\nemulator, `http://127.0.0.1:8480`"
    assert said in text
    assert f"http://127.0.0.1:{SANDBOX_DEFAULT_PORT}" == SANDBOX_DEFAULT_BASE_URL
    blocks = [block for block in fenced_blocks(text) if block.marker == USING_IT]
    assert [block.language for block in blocks] == ["sh", "python"]
    shell, python = (block.code for block in blocks)
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)  # merchant-tasks, celery and python3 as installed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MERCHANT_", "CELERY_"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    children: list[Child] = []
    with RedisServer(tmp_path / "redis") as redis_server, contextlib.ExitStack() as stack:
        for line in _shell_lines(shell):
            line = line.replace("redis://localhost:6379/0", redis_server.url)
            line = line.replace("merchant-tasks sandbox", f"merchant-tasks sandbox --port {port}")
            if line.endswith("&"):  # a process left running, as the shell's job
                name = line.split()[2] if line.startswith("celery") else "emulator"
                child = spawn(
                    name, ["bash", "-c", "exec " + line[:-1]], tmp_path / f"{name}.log",
                    env=env, cwd=tmp_path,
                )  # fmt: skip
                stack.callback(child.stop)
                children.append(child)
                continue
            done = subprocess.run(
                ["bash", "-c", f"set -e\n{line}\nenv -0"],
                env=env, cwd=tmp_path, capture_output=True, check=True,
            )  # fmt: skip
            env = dict(
                entry.split("=", 1) for entry in done.stdout.decode().split("\0") if "=" in entry
            )
            if "MERCHANT_ENVIRONMENT" in env:  # the emulator's address on this run
                env["MERCHANT_BASE_URL"] = f"http://127.0.0.1:{port}"
        emulator, worker, beat = children
        emulator.wait_ready(lambda: _port_answers(port), timeout=README_PATH_TIMEOUT)
        worker.wait_ready(lambda: " ready." in worker.log_text(), timeout=README_PATH_TIMEOUT)
        called = subprocess.run(
            [sys.executable, "-c", python], env=env, cwd=tmp_path, capture_output=True,
            text=True, timeout=README_PATH_TIMEOUT, check=False,
        )  # fmt: skip
        assert called.returncode == 0, called.stderr + worker.log_tail()
        assert "'amount': 1200" in called.stdout
        assert "'status': 'created'" in called.stdout
        assert beat.process.poll() is None, beat.log_tail()
