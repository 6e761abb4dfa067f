"""The emulator in a process of its own (``merchant-tasks sandbox``), driven over its control
endpoints, for the tests that send hundreds of concurrent requests: served from the test's
own process, the API's side would share the test's interpreter lock with the callers under
test, and on a loaded two-core machine the callers' event loop then waits seconds for its
turn (connections and answers time out that a real API, another machine, would have served).

It serves the test's account: ``merchant_sandbox``'s API key and secret file.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from merchant_tasks.sandbox.emulator import CONTROL_ROOT, SandboxControl
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import Child, free_port, running
from merchant_tasks.settings import PREFIX

CONTROL_TIMEOUT = 30.0  # seconds for a control request on a busy machine


@dataclass
class EmulatorProcess:
    """A running ``merchant-tasks sandbox`` and its control endpoints."""

    child: Child
    url: str
    control: SandboxControl

    def exchanges(self) -> int:
        """Token exchanges that issued a token."""
        return int(self.control.counters()["exchanges"].get("ok", 0))


def _answers(url: str) -> bool:
    try:
        return requests.get(f"{url}{CONTROL_ROOT}/counters", timeout=1.0).ok
    except requests.RequestException:
        return False


@contextlib.contextmanager
def emulator_process(
    sandbox: MerchantSandbox, workdir: Path, *options: str
) -> Iterator[EmulatorProcess]:
    """``merchant-tasks sandbox`` on a free loopback port for the ``with`` block, serving
    ``sandbox``'s account, with the command's ``options`` (``--token-latency``, ...)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "merchant_tasks.ops.cli", "sandbox",
        "--port", str(port),
        "--api-key", sandbox.api_key,
        "--secret-file", str(sandbox.secret_file),
        *options,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    log = workdir / "emulator-process.log"
    with running("the emulator's process", argv, log, lambda: _answers(url), env=env) as child:
        control = SandboxControl(url, timeout=CONTROL_TIMEOUT)
        try:
            yield EmulatorProcess(child, url, control)
        finally:
            control.close()
