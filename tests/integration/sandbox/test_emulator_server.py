"""The sandbox emulator's real server on loopback: it serves and stops, answers concurrent
clients, logs no body, cannot start twice, and stops cleanly on Ctrl-C."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import requests

from merchant_tasks.sandbox.emulator import TOKEN_PATH, SandboxControl, SandboxServer
from merchant_tasks.sandbox.processes import spawn
from support.emulator_app import GOOD_BODY, SECRET, make_app
from support.paths import ROOT
from support.routes import PING

pytestmark = pytest.mark.integration


# --- the real server on loopback ----------------------------------------------------------


def test_real_server_serves_on_loopback_and_stops() -> None:
    app = make_app()
    with SandboxServer(app) as server, requests.Session() as session:
        assert server.url.startswith("http://127.0.0.1:")
        assert not server.url.endswith("/")
        response = session.post(server.url + TOKEN_PATH, json=GOOD_BODY, timeout=5)
        assert response.status_code == 200
        token = response.json()["access_token"]
        ping = session.get(
            server.url + PING, headers={"Authorization": f"Bearer {token}"}, timeout=5
        )
        assert ping.json() == {"ok": True}
        denied = session.get(server.url + PING, timeout=5)
        assert denied.status_code == 401
        assert denied.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"'
        assert SECRET not in response.text + str(response.headers)
    with pytest.raises(requests.ConnectionError):
        requests.get(server.url + PING, timeout=5)


def test_real_server_answers_concurrent_clients() -> None:
    app = make_app(rate_limit=5)
    statuses: list[int] = []

    def worker(url: str) -> None:
        with requests.Session() as session:
            statuses.append(session.post(url + TOKEN_PATH, json=GOOD_BODY, timeout=5).status_code)

    with SandboxServer(app) as server:
        threads = [threading.Thread(target=worker, args=(server.url,)) for _ in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(statuses) == [200] * 5 + [429] * 7


def test_real_server_is_quiet_unless_asked_and_never_logs_bodies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="werkzeug")
    for log_requests in (False, True):
        with SandboxServer(make_app(), log_requests=log_requests) as server:
            requests.post(server.url + TOKEN_PATH, json=GOOD_BODY, timeout=5).close()
        logged = [r.getMessage() for r in caplog.records if r.name == "werkzeug"]
        assert bool(logged) is log_requests
    assert any(f"POST {TOKEN_PATH}" in line for line in logged)
    assert all(SECRET not in line for line in logged)


def test_real_server_cannot_start_twice() -> None:
    server = SandboxServer(make_app()).start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            server.start()
    finally:
        server.stop()
    server.stop()  # a second stop is harmless


# Run in a child process so that SIGINT reaches serve_forever as Ctrl-C would. A process
# started in the background by a non-interactive shell (as CI runners may start the suite)
# inherits SIGINT ignored, and then Python raises no KeyboardInterrupt: the child restores
# the handler a terminal session would have.
FOREGROUND_SCRIPT = """
import signal, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig, SandboxServer
server = SandboxServer(SandboxApp(SandboxConfig("key", "secret")))
def announce():
    while not server.url:
        time.sleep(0.01)
    print(server.url, flush=True)
threading.Thread(target=announce, daemon=True).start()
server.serve_forever()
print("stopped", flush=True)
"""


def test_foreground_server_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", FOREGROUND_SCRIPT]
    child = spawn("the sandbox", argv, tmp_path / "sandbox.log", env=env, stdout_pipe=True)
    try:
        url = child.read_line()
        assert requests.get(url + "/_sandbox/counters", timeout=5).status_code == 200
        child.send_signal(signal.SIGINT)
        assert child.output(timeout=10) == "stopped\n", child.log_tail()
        assert child.process.returncode == 0
    finally:
        child.stop()


def test_the_control_client_drives_an_emulator_over_http() -> None:
    """``SandboxControl``, as the bench and the tests drive an emulator in another process:
    configure, counters and revoke-all reach the app; an unknown field is refused as the
    endpoint refuses it; its repr names the URL only."""
    app = make_app()
    with SandboxServer(app) as server, requests.Session() as session:
        control = SandboxControl(server.url + "/")
        try:
            assert control.configure(token_latency=0.0)["token_latency"] == 0.0
            token = session.post(server.url + TOKEN_PATH, json=GOOD_BODY, timeout=5).json()
            bearer = {"Authorization": f"Bearer {token['access_token']}"}
            assert session.get(server.url + PING, headers=bearer, timeout=5).status_code == 200
            assert control.counters() == app.counters()
            assert control.counters()["exchanges"]["ok"] == 1
            control.revoke_all()
            assert session.get(server.url + PING, headers=bearer, timeout=5).status_code == 401
            with pytest.raises(requests.HTTPError):
                control.configure(no_such_field=1)
            assert repr(control) == f"SandboxControl(base_url={server.url!r})"
        finally:
            control.close()
