"""Enqueue from another app's ``ready()``: needs a fresh process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from django_dbworker.models import WorkItem

pytestmark = pytest.mark.django_db(transaction=True)

SCRIPT = """
import sys
from django.apps import AppConfig
from django.conf import settings

import tests.settings as base


class EarlyConfig(AppConfig):
    # An app listed before django_dbworker that enqueues while apps start
    # (its models are loaded: Django calls ready() after importing every model).
    name = "__main__"
    label = "r9early"
    path = {path!r}

    def ready(self):
        from tests.testapp.workers import Record

        item = Record.enqueue({{"key": "early"}})
        print("ENQUEUED", item.pk)


config = {{k: getattr(base, k) for k in dir(base) if k.isupper()}}
config["INSTALLED_APPS"] = ["__main__.EarlyConfig", *base.INSTALLED_APPS]
settings.configure(**config)

import django

django.setup()
"""


def test_enqueue_from_an_earlier_apps_ready(worker_env: dict[str, str], tmp_path: Path) -> None:
    """Before: ``Handler.enqueue`` imported enqueuing lazily and worked as soon as
    models were loaded, e.g. from the ready() of an app listed before
    django_dbworker.

    After: it goes through a port that django_dbworker's own ready()
    connects (handlers.py ``_enqueuer``); until then it raises
    ImproperlyConfigured("django_dbworker is not ready").
    """
    script = tmp_path / "early.py"
    script.write_text(SCRIPT.format(path=str(tmp_path)))
    env = {**worker_env}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ENQUEUED" in done.stdout
    assert WorkItem.objects.filter(handler="record", payload={"key": "early"}).exists()
