"""PostgreSQL wake-ups: the LISTEN connection, the probe that tells whether it hears, the turn.

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

The turn: a NOTIFY reaches every session that LISTENs, and each woken
worker ran a claim, one of which found the row (8 idle processes: 7 empty
claims, 9.5 commits per streamed job). So among the workers that claim alike
(the same queues and handlers: a ``group``), one at a time holds the turn, a
session advisory lock on its listening connection (``WAIT_TURN``), and only
it LISTENs for every wake-up; the others' connections wait in the lock's
queue, not listening (``UNLISTEN *``: a session that listens and does not
read holds back the server's notification queue). One wake-up, one claim.
The holder passes the turn (``PASS_TURN``) when it cannot take more work; the
next waiter, granted it, claims once, for what was announced meanwhile. A
holder that dies frees it with its session, failover with the server: the
next waiter claims. Peers (River, Oban, GoodJob, pgqueuer, procrastinate)
wake every listener and let each fetch; a ticket counted in a table or per
wake-up would cost a statement per woken worker, the lock's queue costs
nothing while it waits. Only on a connection whose probe arrived: one of
its own (through a pooler in transaction mode the lock would stay behind on
a server session that other clients get).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import psycopg
from django.db import connections

from django_dbworker.db.postgresql_sql import (
    LISTEN,
    LISTEN_PROBE,
    NOTIFY_PROBE,
    PASS_TURN,
    UNLISTEN_ALL,
    WAIT_TURN,
)

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

    def wait_turn(self, group: str) -> bool:
        """Wait for ``group``'s turn, not listening; then LISTEN again.

        False if the wait was cancelled: by ``interrupt`` (a stop), or by a
        ``statement_timeout`` of the server or the role (the caller waits again).
        """
        self._conn.execute(UNLISTEN_ALL.sql)
        try:
            self._conn.execute(WAIT_TURN.sql, {"group": _key(group)})
        except psycopg.errors.QueryCanceled:
            granted = False
        else:
            granted = True
        self._conn.execute(LISTEN.sql)
        return granted

    def pass_turn(self, group: str) -> None:
        """Give ``group``'s turn to the next waiter (still listening: urgent wake-ups)."""
        self._conn.execute(PASS_TURN.sql, {"group": _key(group)})

    def interrupt(self) -> None:
        """Cancel a ``wait_turn`` under way (from another thread: a stop)."""
        self._conn.cancel_safe()

    def close(self) -> None:
        self._conn.close()


def _key(group: str) -> int:
    """A group's turn: the lock's second number (an int4), from a digest of its name."""
    return int.from_bytes(hashlib.sha256(group.encode()).digest()[:4], "big", signed=True)
