"""`merchant-tasks demo`, the README's main job, run as a user runs it: a real command, a
real worker and beat, on a Redis that another fleet also uses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from merchant_tasks.ops.cli import EXIT_INTERRUPTED
from merchant_tasks.sandbox.processes import RedisServer, spawn

pytestmark = pytest.mark.integration

DEMO_TIMEOUT = 180.0  # seconds for a 6 s demo: start-up, drain and stop on a loaded machine
# a call_api message as another fleet's app would have queued it, on Celery's default queue
FOREIGN_MESSAGE = json.dumps(
    {
        "body": "W1siR0VUIiwgIi9vcGVuLWFwaS92MS9waW5nIl0sIHt9LCB7fV0=",
        "headers": {"task": "merchant_tasks.call_api", "id": "foreign-1"},
        "properties": {"delivery_tag": "foreign-1", "body_encoding": "base64"},
        "content-type": "application/json",
        "content-encoding": "utf-8",
    }
)


def _processes_working_in(directory: Path) -> list[int]:
    """Pids whose working directory is ``directory`` or below it (deleted or not): the
    demo's children run in its work directory, made under this test's TMPDIR, so other
    tests' and other runs' demos are not counted."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd.startswith(str(directory)):
            found.append(int(entry.name))
    return found


@pytest.mark.long
def test_the_demo_succeeds_beside_another_fleet_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    demo_tmp = tmp_path / "tmp"  # where the demo makes its work directory
    demo_tmp.mkdir()
    with RedisServer(tmp_path / "redis") as server, redis.Redis.from_url(server.url) as shared:
        # another fleet on the same Redis: a queued call and its queue binding
        shared.lpush("celery", FOREIGN_MESSAGE)
        shared.sadd("_kombu.binding.celery", "celery\x06\x16\x06\x16celery")
        foreign = {key: shared.dump(key) for key in shared.scan_iter()}
        # neither a celeryconfig.py in the current directory nor Celery's variables in the
        # environment may send the demo's calls elsewhere or change how they run
        (tmp_path / "celeryconfig.py").write_text(
            'broker_url = "redis://127.0.0.1:1/0"\ntask_default_queue = "payments"\n'
        )

        env = {k: v for k, v in os.environ.items() if not k.startswith(("MERCHANT_", "CELERY_"))}
        options = ["--duration", "6", "--rate", "5", "--lifetime", "8", "--workers", "2"]
        finished = subprocess.run(
            [sys.executable, "-m", "merchant_tasks.ops.cli", "demo", *options],
            env={
                **env,
                "TMPDIR": str(demo_tmp),
                "MERCHANT_REDIS_URL": server.url,
                "CELERY_BROKER_URL": "redis://127.0.0.1:1/0",
                "CELERY_RESULT_BACKEND": "redis://127.0.0.1:1/0",
            },
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=DEMO_TIMEOUT,
            check=False,
        )
        assert finished.returncode == 0, finished.stdout + finished.stderr
        out = finished.stdout
        assert "(MERCHANT_REDIS_URL)" in out
        summary = dict(
            re.findall(r"^  (calls [a-z]+(?: [a-z]+)*|result) {2,}(\S+)", out, re.MULTILINE)
        )
        assert int(summary["calls enqueued"]) >= 25  # 5 a second for 6 s
        assert summary["calls ok"] == summary["calls enqueued"]
        assert summary["calls failed"] == summary["calls not finished"] == "0"
        assert summary["result"] == "OK"
        assert "revoke-all" in out

        # the other fleet's keys are as they were, and the demo left none of its own
        assert {key: shared.dump(key) for key in shared.scan_iter()} == foreign

    assert _processes_working_in(demo_tmp) == []  # worker, its pool and beat all stopped


@pytest.mark.long
def test_a_demo_stopped_with_ctrl_c_removes_its_processes_and_keys(tmp_path: Path) -> None:
    demo_tmp = tmp_path / "tmp"
    demo_tmp.mkdir()
    with RedisServer(tmp_path / "redis") as server, redis.Redis.from_url(server.url) as shared:
        shared.set("another-fleet:token", "kept")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MERCHANT_", "CELERY_"))}
        env |= {"TMPDIR": str(demo_tmp), "MERCHANT_REDIS_URL": server.url}
        options = ["--duration", "600", "--rate", "5", "--lifetime", "8", "--workers", "1"]
        demo = spawn(
            "demo",
            [sys.executable, "-m", "merchant_tasks.ops.cli", "demo", *options],
            tmp_path / "demo.log",
            env=env,
            cwd=tmp_path,
            stdout_pipe=True,
        )
        try:
            while not re.search(r"calls ok +[1-9]", line := demo.read_line()):
                assert line or demo.process.poll() is None, demo.log_tail()
            assert any(key.startswith(b"mt-demo-") for key in shared.scan_iter())
            demo.send_signal(signal.SIGINT)  # the demo alone: its children have their own
            demo.output(timeout=DEMO_TIMEOUT)
        finally:
            demo.stop()
        assert demo.process.returncode == EXIT_INTERRUPTED, demo.log_tail()
        assert list(shared.scan_iter()) == [b"another-fleet:token"]
    assert _processes_working_in(demo_tmp) == []
