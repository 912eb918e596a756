"""Users with each level of access to the admin."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client


def _staff(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_dbworker", codename=codename)
        )
    return user


@pytest.fixture
def superuser_client(db: None) -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


@pytest.fixture
def viewer_client(db: None) -> Client:
    client = Client()
    client.force_login(_staff("viewer", "view_workitem"))
    return client


@pytest.fixture
def staff_client(db: None) -> Client:
    """Staff without any django_dbworker permission."""
    client = Client()
    client.force_login(_staff("nobody"))
    return client
