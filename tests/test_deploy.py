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
APP_SERVICES = ["sandbox", "worker", "beat", "flower", "metrics"]
NEEDS_THE_SECRET = {"sandbox", "worker", "metrics"}  # beat and Flower never read it


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
def test_app_services_take_configuration_from_the_env_file_and_the_secret_only_where_used(
    name: str,
) -> None:
    service = COMPOSE["services"][name]
    assert service["env_file"].endswith("deploy/sandbox.env}")
    expected = ["merchant_api_secret"] if name in NEEDS_THE_SECRET else None
    assert service.get("secrets") == expected
    assert (ROOT / "deploy" / "sandbox-api-secret").is_file()
    assert "MERCHANT_API_SECRET" not in _env_file()


def test_one_image_is_built_once_and_run_by_every_service() -> None:
    services = COMPOSE["services"]
    assert [name for name in APP_SERVICES if "build" in services[name]] == ["worker"]
    assert {services[name]["image"] for name in APP_SERVICES} == {"merchant-tasks:latest"}
    assert {services[name]["pull_policy"] for name in APP_SERVICES} == {"never"}


def test_the_image_context_leaves_out_secrets_and_local_state() -> None:
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignored[ignored.index("*") :][:1] == ["*"]  # everything, then the exceptions
    allowed = {line[1:].rstrip("/") for line in ignored if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "merchant_tasks", "deploy/celeryconfig.py"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = {
        part.rstrip("/")
        for line in dockerfile.splitlines()
        if line.startswith("COPY ")
        for part in line.split()[1:-1]
    }
    assert copied <= allowed


def test_the_env_file_is_a_valid_configuration(tmp_path: Path) -> None:
    env = _env_file()
    secret = tmp_path / "secret"
    secret.write_text((ROOT / "deploy" / "sandbox-api-secret").read_text())
    env["MERCHANT_API_SECRET_FILE"] = str(secret)  # where compose mounts it, here
    settings = Settings.from_env(env)
    assert settings.base_url == "http://sandbox:8480"
    assert settings.fleet.redis_url == "redis://redis:6379/0"


def _command(name: str) -> list[str]:
    command: list[str] = COMPOSE["services"][name]["command"]
    return command


@pytest.mark.parametrize("name", ["sandbox", "metrics"])
def test_the_merchant_tasks_commands_exist_with_their_options(name: str) -> None:
    command = _command(name)
    assert command[0] == "merchant-tasks"
    result = CliRunner().invoke(main, [*command[1:], "--help"])
    assert result.exit_code == 0, result.output


def test_the_image_installs_the_extras_its_services_run() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "'.[sandbox,flower,metrics]'" in dockerfile


@pytest.mark.parametrize("name", ["worker", "beat", "flower"])
def test_celery_commands_find_the_app_and_the_subcommand(name: str) -> None:
    command = _command(name)
    assert command[:3] == ["celery", "-A", "merchant_tasks"]
    assert find_app("merchant_tasks").main == "merchant_tasks"
    subcommand = command[3]
    plugins: set[str] = {ep.name for ep in entry_points(group="celery.commands")}
    assert subcommand in set(celery_cli.commands) | plugins
    if subcommand == "flower":  # its options are Flower's own, checked by name
        from flower.options import options

        for option in command[4:]:
            assert option.lstrip("-").split("=")[0] in options, option


def test_the_dockerfile_installs_the_package_and_the_celery_configuration() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY merchant_tasks ./merchant_tasks" in dockerfile
    assert "celeryconfig.py" in dockerfile
    assert "pip install" in dockerfile


@pytest.mark.parametrize("name", ["flower", "metrics"])
def test_flower_and_metrics_are_only_published_on_loopback(name: str) -> None:
    ports: list[Any] = COMPOSE["services"][name]["ports"]
    assert all(str(p).startswith("127.0.0.1:") for p in ports)


def test_flower_shows_arguments_and_results_and_opens_its_api_on_loopback_only() -> None:
    flower = COMPOSE["services"]["flower"]
    [columns] = [o for o in flower["command"] if o.startswith("--tasks_columns=")]
    assert {"args", "kwargs", "result"} <= set(columns.split("=", 1)[1].split(","))
    assert flower["environment"]["FLOWER_UNAUTHENTICATED_API"] == "true"
