"""docker-compose.yml without a Docker engine: it is valid against the Compose
specification's JSON schema, its configuration is valid, every command and healthcheck it
runs exists in the package with the options it passes, and it is hardened as an operator
reviews it (capabilities, privileges, users able to read their secrets, pinned tags)."""

from __future__ import annotations

import json
import re
import runpy
import shlex
import tomllib
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from celery.app.utils import find_app
from celery.bin.celery import celery as celery_cli
from click.testing import CliRunner

from merchant_tasks.ops.cli import main
from merchant_tasks.settings import Settings
from support.compose import COMPOSE, COMPOSE_SCHEMA
from support.paths import ROOT

APP_SERVICES = ["sandbox", "worker", "beat", "flower", "metrics"]
MONITORING_SERVICES = ["prometheus", "grafana"]  # images of their own, no merchant secret
NEEDS_THE_SECRET = {"sandbox", "worker"}  # the worker exchanges it, the emulator checks it


def _env_file() -> dict[str, str]:
    lines = (ROOT / "deploy" / "sandbox.env").read_text().splitlines()
    pairs = [line.split("=", 1) for line in lines if line.strip() and not line.startswith("#")]
    return {key: value for key, value in pairs}


def test_compose_has_every_service_of_the_system() -> None:
    assert set(COMPOSE["services"]) == {"redis", *APP_SERVICES, *MONITORING_SERVICES}


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
    secrets = service.get("secrets") or []
    assert ("merchant_api_secret" in secrets) == (name in NEEDS_THE_SECRET)
    assert (ROOT / "deploy" / "sandbox-api-secret").is_file()
    assert "MERCHANT_API_SECRET" not in _env_file()


def test_one_image_is_built_once_tagged_with_the_packages_version_and_run_by_every_service() -> (
    None
):
    services = COMPOSE["services"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert [name for name in APP_SERVICES if "build" in services[name]] == ["worker"]
    assert {services[name]["image"] for name in APP_SERVICES} == {f"merchant-tasks:{version}"}
    assert {services[name]["pull_policy"] for name in APP_SERVICES} == {"never"}


def test_the_image_context_leaves_out_secrets_and_local_state() -> None:
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignored[ignored.index("*") :][:1] == ["*"]  # everything, then the exceptions
    allowed = {line[1:].rstrip("/") for line in ignored if line.startswith("!")}
    assert allowed == {
        "pyproject.toml",
        "README.md",
        "merchant_tasks",
        "celeryconfig.py",
        "deploy/flowerconfig.py",
    }
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


def test_the_image_runs_the_top_level_celeryconfig_and_flowerconfig_from_its_workdir() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY merchant_tasks ./merchant_tasks" in dockerfile
    assert "WORKDIR /app" in dockerfile
    assert "COPY celeryconfig.py deploy/flowerconfig.py ./" in dockerfile
    assert "pip install" in dockerfile
    assert not (ROOT / "deploy" / "celeryconfig.py").exists()


@pytest.mark.parametrize("name", ["flower", "metrics", *MONITORING_SERVICES])
def test_flower_metrics_and_monitoring_are_only_published_on_loopback(name: str) -> None:
    ports: list[Any] = COMPOSE["services"][name]["ports"]
    assert all(str(p).startswith("127.0.0.1:") for p in ports)


def test_flower_asks_for_basic_auth_from_its_secret_file_on_pages_and_api() -> None:
    flower = COMPOSE["services"]["flower"]
    options = dict(o.lstrip("-").split("=", 1) for o in flower["command"][4:])
    assert {"args", "kwargs", "result"} <= set(options["tasks_columns"].split(","))
    assert options["conf"] == "/app/flowerconfig.py"  # where the Dockerfile copies it
    assert (options["address"], options["port"]) == ("0.0.0.0", "5555")  # noqa: S104
    assert "FLOWER_UNAUTHENTICATED_API" not in flower.get("environment", {})
    assert flower["secrets"] == ["flower_basic_auth"]
    assert flower["environment"]["FLOWER_BASIC_AUTH_FILE"] == "/run/secrets/flower_basic_auth"
    assert COMPOSE["secrets"]["flower_basic_auth"]["file"].endswith(
        "deploy/sandbox-flower-basic-auth}"
    )


def _flowerconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str | None) -> Any:
    path = tmp_path / f"flower-auth-{len(list(tmp_path.iterdir()))}"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    monkeypatch.setenv("FLOWER_BASIC_AUTH_FILE", str(path))
    return runpy.run_path(str(ROOT / "deploy" / "flowerconfig.py"))["basic_auth"]


def test_flowerconfig_reads_user_password_lines_and_stops_flower_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _flowerconfig(tmp_path, monkeypatch, "ops:pw-1\n\nauditor:pw:2\n") == [
        "ops:pw-1",
        "auditor:pw:2",
    ]
    for text, message in [
        (None, "cannot read"),
        ("", "must hold user:password lines"),
        ("ops\n", "must hold user:password lines"),
        ("ops:\n", "must hold user:password lines"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            _flowerconfig(tmp_path, monkeypatch, text)
        assert str(stopped.value).startswith("error: FLOWER_BASIC_AUTH_FILE: "), text
        assert message in str(stopped.value)
        assert "pw" not in str(stopped.value)


def test_the_compose_file_is_valid_against_the_compose_specification() -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(COMPOSE)]
    assert errors == []
    broken = {**COMPOSE, "services": {"worker": {**COMPOSE["services"]["worker"], "cap_drops": []}}}
    assert not validator.is_valid(broken)  # the schema does catch a misspelt key


@pytest.mark.parametrize("name", ["redis", *APP_SERVICES, *MONITORING_SERVICES])
def test_every_container_drops_all_capabilities_and_gains_no_privilege(name: str) -> None:
    service = COMPOSE["services"][name]
    assert service["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in service["security_opt"]
    assert service["read_only"] is True
    assert "user" in service  # no root step at start: capabilities are gone


def test_images_are_pinned_to_a_full_version() -> None:
    images = {service["image"] for service in COMPOSE["services"].values()}
    [base] = re.findall(r"^FROM (\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    for image in [*images, base]:
        assert re.search(r":v?\d+\.\d+\.\d+(-[a-z0-9-]+)?$", image), image


def _image_user() -> str:
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = re.search(r"useradd .*--uid (\d+)", dockerfile)
    gid = re.search(r"groupadd .*--gid (\d+)", dockerfile)
    assert uid
    assert gid
    assert f"USER {uid[1]}:{gid[1]}" in dockerfile
    return f"{uid[1]}:{gid[1]}"


@pytest.mark.parametrize("name", APP_SERVICES)
def test_services_run_as_the_images_user_whom_the_secret_files_must_be_readable_by(
    name: str,
) -> None:
    user = _image_user()
    assert COMPOSE["services"][name]["user"] == user
    # the compose file tells operators which owner their secret files need (a bind mount
    # keeps the host's owner and mode)
    uid, gid = user.split(":")
    header = (ROOT / "docker-compose.yml").read_text()
    assert f"install -m 0400 -o {uid} -g {gid} " in header
    assert f"uid {uid}, gid {gid}" in header
    for secret in COMPOSE["secrets"].values():  # the sandbox defaults: readable by that user
        path = ROOT / secret["file"].split(":-", 1)[1].rstrip("}")
        assert path.stat().st_mode & 0o004, path


HEALTHCHECKED = ["redis", "sandbox", "worker", "beat", "flower", "metrics", *MONITORING_SERVICES]


@pytest.mark.parametrize("name", HEALTHCHECKED)
def test_every_service_has_a_healthcheck_that_runs_in_the_image(name: str) -> None:
    test: list[str] = COMPOSE["services"][name]["healthcheck"]["test"]
    if test[:2] == ["CMD", "python"]:
        assert test[2] == "-c"
        compile(test[3], f"{name} healthcheck", "exec")  # valid Python
    elif test[0] == "CMD-SHELL":
        argv = shlex.split(test[1].replace("$$HOSTNAME", "HOST"))
        assert argv[:5] == ["celery", "-A", "merchant_tasks", "inspect", "ping"]
        assert find_app("merchant_tasks").main == "merchant_tasks"
        inspect = celery_cli.commands["inspect"]
        known = {opt for param in inspect.params for opt in param.opts}
        assert {a for a in argv[5:] if a.startswith("-")} <= known
        assert "celery@HOST" in argv  # this container's node, by its default name
    elif name in MONITORING_SERVICES:  # busybox's wget, in both images
        assert test[:5] == ["CMD", "wget", "-q", "-O", "/dev/null"]
        port = COMPOSE["services"][name]["ports"][0].rsplit(":", 1)[1]
        assert test[5].startswith(f"http://127.0.0.1:{port}/")
    else:
        assert test == ["CMD", "redis-cli", "ping"]


def _mounts(name: str) -> dict[str, Path]:
    """The service's read-only bind mounts: container path -> path in this checkout."""
    mounts: dict[str, Path] = {}
    for volume in COMPOSE["services"][name]["volumes"]:
        source, target, *mode = volume.split(":")
        if source.startswith("./"):
            assert mode == ["ro"], volume
            mounts[target] = ROOT / source
    return mounts


def test_prometheus_loads_the_shipped_config_rules_and_scrapes_the_metrics_service() -> None:
    prometheus = COMPOSE["services"]["prometheus"]
    assert "secrets" not in prometheus
    options = dict(o.lstrip("-").split("=", 1) for o in prometheus["command"])
    config_dir = _mounts("prometheus")["/etc/prometheus"]
    assert config_dir == ROOT / "deploy" / "prometheus"
    config_path = Path(options["config.file"])
    assert config_path.parent == Path("/etc/prometheus")
    config = yaml.safe_load((config_dir / config_path.name).read_text())
    for rule_file in config["rule_files"]:  # relative to the config file
        assert (config_dir / rule_file).is_file(), rule_file
    [job] = config["scrape_configs"]
    assert job["job_name"] == "merchant-tasks"  # what the alerts' up{job=...} names
    metrics_port = _command("metrics")[_command("metrics").index("--port") + 1]
    assert job["static_configs"][0]["targets"] == [f"metrics:{metrics_port}"]
    assert options["storage.tsdb.path"] in {v.split(":")[1] for v in prometheus["volumes"]}


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard() -> None:
    grafana = COMPOSE["services"]["grafana"]
    mounts = _mounts("grafana")
    provisioning = mounts["/etc/grafana/provisioning"]
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    [datasource] = datasources["datasources"]
    assert datasource["type"] == "prometheus"
    prometheus_port = COMPOSE["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert datasource["url"] == f"http://prometheus:{prometheus_port}"
    providers = yaml.safe_load((provisioning / "dashboards" / "merchant-tasks.yml").read_text())
    [provider] = providers["providers"]
    dashboards = mounts[provider["options"]["path"]]
    dashboard = json.loads((dashboards / "merchant-tasks.json").read_text())
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    assert uids == {datasource["uid"]}
    # the admin password from a secret file, never in the compose file or the environment
    assert grafana["secrets"] == ["grafana_admin_password"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == (
        "/run/secrets/grafana_admin_password"
    )
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana["environment"]
