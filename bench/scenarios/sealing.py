"""7. Hot path, sealed vs clear: MerchantClient.request against the keep-alive (Tornado)
emulator, one client with ``MERCHANT_TOKEN_KEY_FILE`` and one without, interleaved rounds;
and the cost of opening one sealed value."""

from __future__ import annotations

import base64
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from harness import LONG_LIFETIME, PING, Bench, SandboxControl, median, sandbox_process
from merchant_tasks.accounts import FleetClient, client_for
from merchant_tasks.settings import FleetSettings, Secret, Settings
from scenarios.scenario import Result, Scenario, Table


@dataclass(frozen=True)
class Sealing(Scenario):
    """The hot path with the token sealed at rest, against the same in clear."""

    rounds: int
    calls: int  # per round
    name: ClassVar[str] = "sealing"

    def measure(self, bench: Bench) -> Result:
        key_file = bench.workdir / "token-key"
        key_file.write_text(base64.urlsafe_b64encode(os.urandom(32)).decode())
        key_file.chmod(0o600)
        # the emulator behind a keep-alive server: a new connection per call would hide the
        # client's own cost (as in scenario 3's keep-alive variant)
        with sandbox_process(bench.workdir, bench.sandbox_env, "tornado") as (url, child):
            bench.children.append(child)
            SandboxControl(url).configure(lifetime=LONG_LIFETIME, revoke_on_issue=False)
            clients = {"clear": _client(bench, url, None), "sealed": _client(bench, url, key_file)}
            wall: dict[str, list[float]] = {"clear": [], "sealed": []}
            cpu: dict[str, list[float]] = {"clear": [], "sealed": []}
            for client in clients.values():
                client.request("GET", PING)  # token and connection first
            for i in range(self.rounds):
                for which in ("clear", "sealed") if i % 2 == 0 else ("sealed", "clear"):
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(self.calls):
                        clients[which].request("GET", PING)
                    wall[which].append((time.perf_counter() - t0) / self.calls * 1e6)
                    cpu[which].append((time.process_time() - c0) / self.calls * 1e6)
        # the cost a call pays when it meets a token it has not opened yet (once per process
        # and renewal: the parsed token is reused until the stored value changes)
        store = clients["sealed"].manager.store
        opens = []
        for _ in range(200):
            stored = store.codec.seal("a-token-value-of-typical-length-0123456789", store.namespace)
            t0 = time.perf_counter()
            store.codec.open(stored, store.namespace)
            opens.append((time.perf_counter() - t0) * 1e6)
        clear_us, sealed_us = median(wall["clear"]), median(wall["sealed"])
        clear_cpu, sealed_cpu = median(cpu["clear"]), median(cpu["sealed"])
        ratios = [c / s for c, s in zip(wall["clear"], wall["sealed"], strict=True)]
        ratio = median(ratios)
        return Result(
            title=f"7. Hot path with the token sealed at rest: MerchantClient.request against the "
            f"keep-alive emulator, {self.rounds} interleaved rounds of "
            f"{self.calls} calls",
            table=Table(
                ["", "µs per call (median round)", "client CPU µs per call"],
                [
                    ["token in clear", f"{clear_us:.1f}", f"{clear_cpu:.1f}"],
                    [
                        "token sealed (MERCHANT_TOKEN_KEY_FILE)",
                        f"{sealed_us:.1f}",
                        f"{sealed_cpu:.1f}",
                    ],
                    ["clear / sealed, median of rounds (1.0 = no cost)", f"{ratio:.3f}", ""],
                    ["opening one sealed value (median of 200)", f"{median(opens):.1f}", ""],
                ],
            ),
            json={
                "sealing_hot_path_ratio": round(ratio, 3),
                "sealing_hot_path_ratios": [round(r, 3) for r in ratios],
                "sealing_hot_path_clear_us": round(clear_us, 1),
                "sealing_hot_path_sealed_us": round(sealed_us, 1),
                "sealing_hot_path_clear_cpu_us": round(clear_cpu, 1),
                "sealing_hot_path_sealed_cpu_us": round(sealed_cpu, 1),
                "sealing_open_us": round(median(opens), 1),
            },
        )


def _client(bench: Bench, url: str, key_file: Path | None) -> FleetClient:
    settings = Settings(
        api_key=bench.env()["MERCHANT_API_KEY"],
        secret=Secret(path=bench.secret_file),
        base_url=url,
        fleet=FleetSettings(
            redis_url=bench.redis_url,
            key_prefix=f"bench-sealing-{uuid.uuid4().hex[:8]}",
            token_key_file=str(key_file) if key_file is not None else None,
        ),
    )
    return client_for(settings)
