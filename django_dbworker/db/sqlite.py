"""SQLite: claims by one conditional UPDATE ... RETURNING, no cross-process wake-ups.

SQLite has no row locks; a single UPDATE statement takes the database write
lock for its whole duration, so the "select ready ids, mark them claimed"
step is atomic across threads and processes. Busy waits are bounded by the
connection's ``timeout`` option (see the system check).
"""

from __future__ import annotations

import sqlite3
from typing import Any
from uuid import UUID

from django_dbworker.db.base import UnsupportedDatabase, VendorOperations
from django_dbworker.models import Status, WorkItem

#: UPDATE ... RETURNING arrived in SQLite 3.35.
MIN_VERSION = (3, 35, 0)


class SQLiteOperations(VendorOperations):
    vendor = "sqlite"
    supports_notify = False

    def check_version(self) -> None:
        if sqlite3.sqlite_version_info < MIN_VERSION:
            raise UnsupportedDatabase(
                "django-dbworker needs SQLite 3.35 or newer (UPDATE ... RETURNING); "
                f"this Python links SQLite {sqlite3.sqlite_version}."
            )

    def _claim_sql(self, ready_ids_sql: str) -> str:
        q = self.connection.ops.quote_name
        table = q(WorkItem._meta.db_table)
        # Django stores UUIDField as 32 hex characters on SQLite, which is
        # exactly what hex(randomblob(16)) yields: a fresh token per row.
        # The status test repeats the subquery's condition so that the
        # statement stays a conditional UPDATE even if the plan changes.
        return (
            f"UPDATE {table} SET {self._claim_set_clause('lower(hex(randomblob(16)))')} "
            f"WHERE {q('id')} IN ({ready_ids_sql}) AND {q('status')} = '{Status.PENDING.value}' "
            f"RETURNING {self._returning_columns()}"
        )

    def _token_param(self, token: UUID) -> Any:
        return token.hex  # UUIDField's storage on SQLite
