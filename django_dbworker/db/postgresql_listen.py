"""PostgreSQL wake-ups: the LISTEN connection, and the probe that tells whether it hears.

A ``PostgresSubscription`` is one autocommit connection of its own that
LISTENs on the wake-up channel (``postgresql_sql.LISTEN``). LISTEN is
session state: through a pooler in transaction mode (PgBouncer's
``pool_mode = transaction``) the statement succeeds, but the server session
it ran in goes to other clients, and nothing notified ever reaches this
connection. The probe finds that out: a NOTIFY on a channel of its own
(``postgresql_sql.NOTIFY_PROBE``; the subscription runs ``LISTEN_PROBE``
too), sent on the work table's alias on a fresh connection
(never the listener's own: through a pooler it may share a server session
with the LISTEN). A channel of its own, so that nothing that listens for
wake-ups takes a probe for one. This module runs statements of
``postgresql_sql.py`` only; it writes none.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.db import connections

from django_dbworker.db.postgresql_sql import LISTEN, LISTEN_PROBE, NOTIFY_PROBE

#: The probes' channel (``NOTIFY_PROBE``, ``LISTEN_PROBE``).
PROBE_CHANNEL = "django_dbworker_probe"


class PostgresSubscription:
    """A dedicated autocommit connection LISTENing for wake-ups (and for its probes).

    Outside Django's per-thread connections: it lives as long as the
    listener thread, and LISTEN only works outside a transaction block.
    """

    def __init__(self, wrapper: Any) -> None:
        self._conn = wrapper.get_new_connection(wrapper.get_connection_params())
        self._probes: set[str] = set()
        try:
            self._conn.autocommit = True
            # The wake-ups' LISTEN last: pg_stat_activity then shows it (tests look).
            self._conn.execute(LISTEN_PROBE.sql)
            self._conn.execute(LISTEN.sql)
        except BaseException:
            self._conn.close()
            raise

    def receive(self, timeout: float) -> Iterator[str]:
        # psycopg 3's notifies() yields each notification as it arrives and
        # returns after ``timeout`` seconds in all.
        for note in self._conn.notifies(timeout=timeout):
            if note.channel == PROBE_CHANNEL:  # this listener's probe, or another's
                self._probes.add(note.payload)
            else:
                yield note.payload

    def probe(self, token: str, via: str) -> None:
        wrapper = connections[via]
        conn = wrapper.get_new_connection(wrapper.get_connection_params())
        try:
            conn.autocommit = True
            conn.execute(NOTIFY_PROBE.sql, {"wake": token})
        finally:
            conn.close()

    def probed(self, token: str) -> bool:
        return token in self._probes

    def close(self) -> None:
        self._conn.close()
