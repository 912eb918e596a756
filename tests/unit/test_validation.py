"""The shared validators: one meaning of "positive int", "port", "queue name"."""

from __future__ import annotations

import math
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_dbworker import validation
from django_dbworker.checks import check_settings
from django_dbworker.conf import DEFAULTS
from django_dbworker.worker.runtime import WorkerConfig


@pytest.mark.parametrize(
    ("validator", "good", "bad"),
    [
        (validation.positive_int, [1, 10**6], [0, -1, 1.5, True, "3", None]),
        (validation.non_negative_int, [0, 5], [-1, 0.0, False]),
        (validation.positive_number, [0.1, 3], [0, -0.5, math.nan, "1", True]),
        (validation.non_negative_number, [0, 0.0, 2.5], [-1, math.nan, None]),
        (validation.port, [1, 8000, 65535], [0, 65536, "80", 80.0]),
        (validation.queue_name, ["default", "a.b:c-d_1", "x" * 100], ["", "x" * 101, "a b", 1]),
        (validation.non_empty_str, ["127.0.0.1"], ["", None]),
        (validation.optional(validation.port), [None, 9100], [0]),
    ],
)
def test_validators(validator: Any, good: list[Any], bad: list[Any]) -> None:
    for value in good:
        assert validator(value) == value
    for value in bad:
        with pytest.raises(validation.InvalidValue, match="got"):
            validator(value)


def test_every_setting_has_a_validator_and_every_default_passes_it() -> None:
    assert set(validation.SETTINGS) == set(DEFAULTS)
    for key, validator in validation.SETTINGS.items():
        validator(DEFAULTS[key])


def test_checks_flags_and_worker_config_say_the_same_thing() -> None:
    with override_settings(DBWORKER={"CONCURRENCY": 0}):
        (message,) = check_settings()
    assert message.msg == "DBWORKER['CONCURRENCY'] must be at least 1, got 0."
    with pytest.raises(CommandError, match="--concurrency: must be at least 1, got 0"):
        call_command("run_workers", "--concurrency", "0")
    with pytest.raises(
        validation.InvalidValue, match=r"WorkerConfig\.concurrency must be at least 1"
    ):
        validation.validate_worker_config(WorkerConfig(concurrency=0))


def test_worker_config_validation() -> None:
    validation.validate_worker_config(WorkerConfig())
    validation.validate_worker_config(WorkerConfig(queues=["default", "emails"]))
    bad: list[dict[str, Any]] = [
        {"poll_interval": 0},
        {"batch_size": -1},
        {"heartbeat_interval": math.nan},
        {"shutdown_timeout": -1.0},
        {"poll_interval": math.inf},
        {"shutdown_timeout": 1e10},
        {"max_abandoned_threads": 0},
        {"queues": "default"},
        {"queues": ["bad queue"]},
    ]
    for fields in bad:
        with pytest.raises(validation.InvalidValue, match=r"WorkerConfig\.") as info:
            validation.validate_worker_config(WorkerConfig(**fields))
        assert next(iter(fields)) in str(info.value)
