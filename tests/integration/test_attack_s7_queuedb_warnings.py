"""Attack (session 7) on the enqueue-time RuntimeWarning of a queue database of its own.

The warning is meant to point at "the enqueuing line" (``routing._caller_level``:
the first frame outside django-dbworker and Django), so that Python shows it
once per line of the project's code. Frames are told apart by a plain string
prefix of their file name: Django's folder ``.../site-packages/django`` is a
prefix of every sibling package whose name starts with "django" (django_myapp,
django_extensions, django_celery_beat...), and the app's own folder of every
``django_dbworker<suffix>`` sibling. Code in such a package is taken for
Django's, and the warning is attributed to whoever called it.
"""

from __future__ import annotations

from pathlib import Path

import django
import pytest
from django.db import transaction
from django.test import override_settings

from tests.routers import WORK_ALIAS
from tests.testapp.workers import Noop

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", WORK_ALIAS])


def _run_as(filename: str) -> None:
    """Enqueue inside atomic() on default from code whose file is ``filename``."""
    source = "def place_order():\n    Noop.enqueue({'n': 1})\n"
    namespace = {"Noop": Noop}
    exec(compile(source, filename, "exec"), namespace)
    with transaction.atomic():
        namespace["place_order"]()  # type: ignore[operator]


@pytest.mark.parametrize(
    "package",
    [
        # A project's app or a third-party app installed next to Django.
        str(Path(django.__file__).resolve().parent) + "_myapp",
        str(Path(django.__file__).resolve().parent) + "_celery_beat",
    ],
    ids=["django_myapp", "django_celery_beat"],
)
def test_the_warning_points_at_an_enqueue_in_a_package_named_django_something(
    routed: None, package: str
) -> None:
    views = f"{package}/views.py"
    with pytest.warns(RuntimeWarning, match="writes to database 'work'") as record:
        _run_as(views)
    assert record[0].filename == views, record[0].filename


def test_control_an_enqueue_in_any_other_package_is_pointed_at(routed: None) -> None:
    views = str(Path(django.__file__).resolve().parent.parent / "myapp" / "views.py")
    with pytest.warns(RuntimeWarning) as record:
        _run_as(views)
    assert record[0].filename == views


# -- held: a view under ATOMIC_REQUESTS, on_commit callbacks, threads ------------------


def _enqueuing_view(request: object) -> object:
    from django.http import HttpResponse

    Noop.enqueue({"n": "view"})  # the line the warning must name
    return HttpResponse("ok")


urlpatterns = [__import__("django.urls").urls.path("enqueue/", _enqueuing_view)]


def test_a_view_under_atomic_requests_is_warned_at_its_enqueue(routed: None) -> None:
    from django.db import connections
    from django.test import Client

    default = connections["default"]
    default.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        with (
            override_settings(ROOT_URLCONF=__name__),
            pytest.warns(RuntimeWarning, match="open on 'default'") as record,
        ):
            assert Client().get("/enqueue/").status_code == 200
    finally:
        default.settings_dict["ATOMIC_REQUESTS"] = False
    assert record[0].filename == __file__
    assert record[0].lineno == _enqueuing_view.__code__.co_firstlineno + 3


def test_no_warning_in_an_on_commit_callback_or_another_thread(routed: None) -> None:
    import threading
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with transaction.atomic():
            transaction.on_commit(lambda: Noop.enqueue({"n": "later"}))
            errors: list[BaseException] = []

            def elsewhere() -> None:
                try:
                    Noop.enqueue({"n": "thread"})
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    from django.db import connections

                    connections.close_all()

            thread = threading.Thread(target=elsewhere)
            thread.start()
            thread.join(30)
            assert errors == []
