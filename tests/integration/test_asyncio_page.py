"""docs/asyncio.md, run: its service snippets joined into one module and served by a real
uvicorn against the emulator (and a Celery worker for the enqueue), its scripts run alone.
Every Python snippet of the page is marked as one or the other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from merchant_tasks.pytest_plugin import MerchantSandbox, MerchantWorker
from merchant_tasks.sandbox.processes import free_port, spawn, wait_until
from merchant_tasks.settings import Settings, child_env
from support.doc_blocks import Block, fenced_blocks
from support.paths import ROOT

pytestmark = pytest.mark.integration

PAGE = ROOT / "docs" / "asyncio.md"
SERVICE, SCRIPT = "run: service", "run: script"  # the markers of the page's snippets
START_TIMEOUT = 60.0  # seconds for uvicorn to start the service on a busy machine
WAIT = 60.0  # seconds for a request, a queued payment or a script on a busy machine


def _python_blocks() -> list[Block]:
    return [block for block in fenced_blocks(PAGE.read_text()) if block.language == "python"]


SCRIPTS = [block.code for block in _python_blocks() if block.marker == SCRIPT]


def test_every_python_snippet_of_the_page_is_marked_to_run() -> None:
    blocks = _python_blocks()
    unmarked = [
        block.code.splitlines()[0] for block in blocks if block.marker not in (SERVICE, SCRIPT)
    ]
    assert not unmarked, f"docs/asyncio.md: Python snippets not run by this test: {unmarked}"
    assert [block.marker for block in blocks].count(SERVICE) >= 5
    assert len(SCRIPTS) >= 2


def test_the_pages_service_snippets_make_one_service_that_serves_and_stops_cleanly(
    merchant_settings: Settings,
    merchant_sandbox: MerchantSandbox,
    merchant_worker: MerchantWorker,
    tmp_path: Path,
) -> None:
    service = [block.code for block in _python_blocks() if block.marker == SERVICE]
    (tmp_path / "page_service.py").write_text("\n\n".join(service))
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "page_service:app", "--host", "127.0.0.1"]
    server = spawn(
        "uvicorn",
        [*argv, "--port", str(port)],
        tmp_path / "uvicorn.log",
        env=child_env(merchant_settings),
        cwd=tmp_path,
    )
    try:
        server.wait_ready(
            # bound and listening: "Application startup complete." comes before the bind
            lambda: "Uvicorn running on" in server.log_text(),
            timeout=START_TIMEOUT,
        )
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=WAIT) as http:
            first, again = (
                http.post("/orders/1017/payment", json={"amount": 1200}) for _ in range(2)
            )
            assert (first.status_code, again.status_code) == (201, 201), first.text
            assert first.json() == again.json()  # one payment for the order
            assert http.get(f"/payments/{first.json()['id']}").json()["amount"] == 1200
            missing = http.get("/payments/pay_missing")
            assert (missing.status_code, missing.json()["code"]) == (404, "not_found")
            assert http.get("/merchant").json()["appid"] == merchant_sandbox.api_key
            assert http.get("/health").status_code == 200
            queued = http.post("/orders/1018/payment/queued", json={"amount": 700})
            assert queued.status_code == 202, queued.text
            task = f"/tasks/{queued.json()['task']}"
            wait_until(lambda: http.get(task).status_code != 202, "the queued payment", WAIT)
            assert http.get(task).json()["amount"] == 700
        assert len(merchant_sandbox.app.payments()) == 2
    finally:
        server.stop()
    log = server.log_text()
    assert "Application shutdown complete." in log, log
    assert "Traceback" not in log, log


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda code: code.splitlines()[0])
def test_each_script_of_the_page_runs_alone(
    script: str, merchant_settings: Settings, merchant_sandbox: MerchantSandbox, tmp_path: Path
) -> None:
    (tmp_path / "page_script.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "page_script.py"],
        env=child_env(merchant_settings),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(merchant_sandbox.api_key) == 2  # two calls, each its profile
