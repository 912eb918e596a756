"""The deployment recipes in deploy/ (shown in docs/topics/deployment.md), checked.

What a recipe must get right, and what these tests pin:

- the commands it runs are real: every ``run_workers`` command line is
  parsed by the command's own parser (an unknown or bad flag fails here);
- its stop timeout leaves the worker time to stop gracefully: above the
  longest a stopping worker may take by default (``SHUTDOWN_TIMEOUT`` for
  running items, ``RECORD_GRACE`` to write finished outcomes while the
  database is away, ``HOOK_GRACE`` for task_finished receivers) with a margin;
- it stops the worker with SIGTERM and restarts it on a non-zero exit;
- the systemd unit passes ``systemd-analyze verify`` (where systemd-analyze
  exists); the compose file and the Kubernetes manifest parse as YAML
  with the expected keys.

No database: these read files and parse command lines only.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from django_dbworker.conf import SHUTDOWN_TIMEOUT
from django_dbworker.management.commands.run_workers import Command as RunWorkers
from django_dbworker.worker.config import HOOK_GRACE, RECORD_GRACE

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "systemd" / "mysite-worker@.service"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
COMPOSE = DEPLOY / "docker" / "compose.yaml"
K8S = DEPLOY / "kubernetes" / "worker.yaml"
PROCFILE = DEPLOY / "procfile" / "Procfile"

#: The longest a stopping worker takes with the default settings.
LONGEST_STOP = SHUTDOWN_TIMEOUT + RECORD_GRACE + HOOK_GRACE
#: What a recipe's stop timeout must leave beyond that (process exit, release).
MARGIN = 10.0
#: Heroku-style platforms send SIGKILL this long after SIGTERM, whatever the app says.
PLATFORM_GRACE = 30.0


def run_workers_options(argv: list[str]) -> dict[str, Any]:
    """``argv`` (a recipe's command) parsed by run_workers's own parser."""
    assert "manage.py" in argv, argv
    rest = argv[argv.index("manage.py") + 1 :]
    assert rest[:1] == ["run_workers"], argv
    parser = RunWorkers().create_parser("manage.py", "run_workers")
    # A bad flag raises CommandError (the parser is not called from a command line).
    return vars(parser.parse_args(rest[1:]))


def test_the_parser_refuses_a_flag_that_does_not_exist() -> None:
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="unrecognized arguments"):
        run_workers_options(["python", "manage.py", "run_workers", "--concurency", "8"])


# -- systemd -------------------------------------------------------------------


def unit_entries(text: str) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections and their ``key=value`` entries, repeated keys kept."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"entry outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not key=value: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def systemd_seconds(value: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60}
    match = re.fullmatch(r"(\d+)\s*(s|sec|m|min)?", value)
    assert match, f"unexpected time span {value!r}"
    return float(match[1]) * units[match[2] or ""]


def test_systemd_unit_stops_gracefully_and_restarts_on_failure() -> None:
    service = dict(unit_entries(UNIT.read_text())["Service"])
    assert service["Type"] in {"simple", "exec"}
    assert service["KillSignal"] == "SIGTERM"
    assert systemd_seconds(service["TimeoutStopSec"]) >= LONGEST_STOP + MARGIN
    assert service["Restart"] == "on-failure"
    # A usage error (a bad flag or setting) is not restarted: no restart can fix it.
    assert "2" in service["RestartPreventExitStatus"].split()
    options = run_workers_options(shlex.split(service["ExecStart"]))
    assert options["shutdown_timeout"] is None  # the default, which the timeout above covers


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        reason = "systemd-analyze is not installed here (no systemd): the unit was only parsed"
        print(reason)
        pytest.skip(reason)
    # An instance of the template, running this interpreter: verify checks
    # that ExecStart's program exists, and /srv/mysite is the reader's.
    text = UNIT.read_text().replace("/srv/mysite/.venv/bin/python", sys.executable)
    instance = tmp_path / "mysite-worker@1.service"
    instance.write_text(text)
    proc = subprocess.run(
        [analyze, "verify", str(instance)], capture_output=True, text=True, timeout=60
    )
    # verify exits 0 on unknown keys too, but says so: any output is a finding.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr


# -- containers ----------------------------------------------------------------


def yaml_load(path: Path) -> Any:
    yaml = pytest.importorskip("yaml", reason="PyYAML (the dev extra brings it) is not installed")
    return yaml.safe_load(path.read_text())


def test_dockerfile_signals_the_process_itself() -> None:
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    assert "STOPSIGNAL SIGTERM" in lines
    (cmd,) = [line for line in lines if line.startswith("CMD ")]
    # Exec form (a JSON array): no shell in between that would swallow SIGTERM.
    assert cmd.startswith("CMD ["), cmd


def test_dockerfile_collects_the_static_files_the_admin_needs() -> None:
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    assert "RUN python manage.py collectstatic --no-input" in lines


def compose_seconds(value: str) -> float:
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value):
        total += float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    assert total > 0, f"unexpected duration {value!r}"
    return total


def test_compose_runs_web_worker_and_postgresql() -> None:
    compose = yaml_load(COMPOSE)
    services = compose["services"]
    assert {"web", "worker", "db"} <= set(services)
    assert services["db"]["image"].startswith("postgres:")
    worker = services["worker"]
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert compose_seconds(worker["stop_grace_period"]) >= LONGEST_STOP + MARGIN
    assert worker["restart"] in {"on-failure", "always", "unless-stopped"}
    options = run_workers_options(worker["command"])
    assert options["shutdown_timeout"] is None
    # The app's environment reaches both processes (the YAML anchor).
    assert services["web"]["environment"] == worker["environment"]
    assert worker["environment"]["PGHOST"] == "db"


def test_kubernetes_deployment_gives_the_drain_its_time() -> None:
    manifest = yaml_load(K8S)
    assert manifest["apiVersion"] == "apps/v1"
    assert manifest["kind"] == "Deployment"
    pod = manifest["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= LONGEST_STOP + MARGIN
    (container,) = pod["containers"]
    options = run_workers_options(container["command"])
    assert options["shutdown_timeout"] is None
    assert options["metrics_port"] == container["ports"][0]["containerPort"]
    labels = manifest["spec"]["template"]["metadata"]["labels"]
    assert manifest["spec"]["selector"]["matchLabels"].items() <= labels.items()


# -- Procfile ------------------------------------------------------------------


def test_procfile_drains_within_the_platforms_grace() -> None:
    processes = dict(
        line.split(":", 1) for line in PROCFILE.read_text().splitlines() if line.strip()
    )
    assert {"web", "worker"} <= set(processes)
    options = run_workers_options(shlex.split(processes["worker"]))
    # The platform kills 30 s after SIGTERM, whatever the app asks: the drain
    # must end before, with time to release the unfinished rows.
    assert options["shutdown_timeout"] is not None
    assert options["shutdown_timeout"] + MARGIN <= PLATFORM_GRACE


# -- the liveness probe --------------------------------------------------------


def probe_commands() -> list[list[str]]:
    """The health probes of the container recipes, as they run them."""
    compose = yaml_load(COMPOSE)["services"]["worker"]["healthcheck"]["test"]
    assert compose[0] == "CMD"
    (container,) = yaml_load(K8S)["spec"]["template"]["spec"]["containers"]
    return [compose[1:], container["livenessProbe"]["exec"]["command"]]


def test_the_recipes_probes_answer_from_the_file_without_django(tmp_path: Path) -> None:
    """Each recipe's probe, run as the recipe runs it but without DJANGO_SETTINGS_MODULE
    (Django set up would fail without it): fresh is 0, stale or missing is 1, a bad
    --max-age is a usage error, and ``dbworker_health`` says the same."""
    import json
    import os
    import socket
    import time

    health = tmp_path / "worker-health"
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = str(DEPLOY.parent)
    for command in probe_commands():
        assert command[:3] == ["python", "-m", "django_dbworker.probe"], command
        argv = [sys.executable, *command[1:]]
        argv[argv.index("--file") + 1] = str(health)

        def run(args: list[str] = argv) -> subprocess.CompletedProcess[str]:
            return subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)

        health.unlink(missing_ok=True)
        missing = run()
        assert missing.returncode == 1 and "does not exist" in missing.stderr, missing
        health.write_text(json.dumps({"pid": 7, "host": socket.gethostname()}))
        fresh = run()
        assert fresh.returncode == 0 and fresh.stdout.startswith("Healthy: pid 7"), fresh
        old = time.time() - 120
        os.utime(health, (old, old))
        stale = run()
        assert stale.returncode == 1 and "more than 30 s" in stale.stderr, stale
        command_env = {**env, "DJANGO_SETTINGS_MODULE": "tests.settings"}
        said = subprocess.run(
            [sys.executable, "-m", "django", "dbworker_health", *argv[3:]],
            env=command_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert said.returncode == 1, said

        def line(text: str) -> str:  # the age is read again: a second may have passed
            return re.sub(r"\d+ s ago", "N s ago", text.strip())

        assert line(said.stderr) == f"CommandError: {line(stale.stderr)}", said
        bad = run([*argv[:-1], "soon"])
        assert bad.returncode == 2 and "not a number of seconds" in bad.stderr, bad
