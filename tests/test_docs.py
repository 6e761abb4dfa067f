"""The front door and the manual: README.md stays short, every link between the pages
lands, and the pages that describe the emulator and the plugin name all they serve."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from merchant_tasks.sandbox import pytest_plugin
from merchant_tasks.sandbox.emulator import _CONTROL_ROUTES
from merchant_tasks.sandbox.processes import Child, RedisServer, free_port, spawn
from merchant_tasks.settings import SANDBOX_DEFAULT_BASE_URL, SANDBOX_DEFAULT_PORT

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 160  # a front door: what it is, the two commands, installing, using it
LINK = re.compile(r"\]\(([^)\s]+)\)")
USING_IT = re.compile(r"<!-- using-it -->\n```(\w+)\n(.*?)```", re.S)  # README's "Using it"
README_PATH_TIMEOUT = 180.0  # seconds for a worker to start and one call on a loaded machine


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, made the way GitHub makes them."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_a_front_door_of_at_most_160_lines() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "Python 3.11" in text
    assert text.count("<!-- test-command -->") == 1


def _lands(page: Path, target: str) -> bool:
    """Whether a relative link of ``page`` names a file that exists, and a heading of it."""
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    if not linked.exists():
        return False
    return not anchor or linked.suffix != ".md" or anchor in _anchors(linked)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands_on_a_file_and_heading(page: Path) -> None:
    targets = LINK.findall(page.read_text())
    relative = [t for t in targets if not t.startswith(("http://", "https://", "mailto:"))]
    missing = [target for target in relative if not _lands(page, target)]
    assert not missing, f"{page.name} links to what is not there: {missing}"


def test_the_testing_page_lists_every_control_endpoint_of_the_emulator() -> None:
    page = (ROOT / "docs" / "testing.md").read_text()
    for rule in _CONTROL_ROUTES.iter_rules():
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            assert f"`{method} {rule.rule}`" in page, (method, rule.rule)


def test_the_testing_page_names_every_fixture_of_the_plugin() -> None:
    page = (ROOT / "docs" / "testing.md").read_text()
    fixtures = [
        name
        for name, value in inspect.getmembers(pytest_plugin)
        if name.startswith("merchant_") and callable(value)
    ]
    assert len(fixtures) >= 10
    for name in fixtures:
        assert f"`{name}`" in page, name


def _shell_lines(block: str) -> list[str]:
    """A shell block's commands, one per line, continuations joined, comments left out."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def _port_answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


@pytest.mark.integration
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
    blocks = USING_IT.findall(text)
    assert [language for language, _ in blocks] == ["sh", "python"]
    (_, shell), (_, python) = blocks
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
