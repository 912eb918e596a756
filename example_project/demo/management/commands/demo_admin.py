from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create the demo's admin login (admin / admin) unless it exists."

    def handle(self, *args: Any, **options: Any) -> None:
        users = get_user_model()
        if not users.objects.filter(username="admin").exists():
            users.objects.create_superuser("admin", "admin@example.com", "admin")
            self.stdout.write("Created the admin login: admin / admin")
        else:
            self.stdout.write("The admin login exists: admin (password: admin, unless changed)")
