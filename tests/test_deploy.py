"""docker-compose.yml without a Docker engine: it parses, its configuration is valid, and
every command it runs exists in the package with the options it passes."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import yaml
from celery.app.utils import find_app
from celery.bin.celery import celery as celery_cli
from click.testing import CliRunner

from merchant_tasks.cli import main
from merchant_tasks.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
APP_SERVICES = ["sandbox", "worker", "beat", "flower"]


def _env_file() -> dict[str, str]:
    lines = (ROOT / "deploy" / "sandbox.env").read_text().splitlines()
    pairs = [line.split("=", 1) for line in lines if line.strip() and not line.startswith("#")]
    return {key: value for key, value in pairs}


def test_compose_has_every_service_of_the_system() -> None:
    assert set(COMPOSE["services"]) == {"redis", *APP_SERVICES}


def test_redis_never_evicts_and_has_a_healthcheck() -> None:
    redis_service = COMPOSE["services"]["redis"]
    assert "noeviction" in redis_service["command"]
    assert redis_service["healthcheck"]["test"][-1] == "ping"


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_services_take_configuration_from_the_env_file_and_the_secret_from_a_file(
    name: str,
) -> None:
    service = COMPOSE["services"][name]
    assert service["env_file"].endswith("deploy/sandbox.env}")
    assert service["secrets"] == ["merchant_api_secret"]
    assert (ROOT / "deploy" / "sandbox-api-secret").is_file()
    assert "MERCHANT_API_SECRET" not in _env_file()


def test_the_env_file_is_a_valid_configuration(tmp_path: Path) -> None:
    env = _env_file()
    secret = tmp_path / "secret"
    secret.write_text((ROOT / "deploy" / "sandbox-api-secret").read_text())
    env["MERCHANT_API_SECRET_FILE"] = str(secret)  # where compose mounts it, here
    settings = Settings.from_env(env)
    assert settings.base_url == "http://sandbox:8480"
    assert settings.redis_url == "redis://redis:6379/0"


def _command(name: str) -> list[str]:
    command: list[str] = COMPOSE["services"][name]["command"]
    return command


def test_the_sandbox_command_exists_with_its_options() -> None:
    command = _command("sandbox")
    assert command[0] == "merchant-tasks"
    result = CliRunner().invoke(main, [*command[1:], "--help"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", ["worker", "beat", "flower"])
def test_celery_commands_find_the_app_and_the_subcommand(name: str) -> None:
    command = _command(name)
    assert command[:3] == ["celery", "-A", "merchant_tasks"]
    assert find_app("merchant_tasks").main == "merchant_tasks"
    subcommand = command[3]
    plugins: set[str] = {ep.name for ep in entry_points(group="celery.commands")}
    assert subcommand in set(celery_cli.commands) | plugins


def test_the_dockerfile_installs_the_package_and_the_celery_configuration() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY merchant_tasks ./merchant_tasks" in dockerfile
    assert "celeryconfig.py" in dockerfile
    assert "pip install" in dockerfile


def test_flower_is_only_published_on_loopback() -> None:
    ports: list[Any] = COMPOSE["services"]["flower"]["ports"]
    assert all(str(p).startswith("127.0.0.1:") for p in ports)
