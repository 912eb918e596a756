"""Which database errors are worth retrying: the one place that reads vendor error codes.

Outcome writes, heartbeats and claims retry an error that says "not now"
(the connection dropped, the server is read-only during a failover, a
deadlock or lock timeout picked us) and give up on one that says "never"
(the database refuses this value). Django maps most "not now" errors to
``OperationalError``/``InterfaceError``, but PostgreSQL reports a read-only
transaction, a serialization failure and a deadlock as ``InternalError`` or
``DatabaseError`` subclasses, so their SQLSTATE decides.
"""

from __future__ import annotations

from django.db import DatabaseError, InterfaceError, OperationalError

#: SQLSTATEs (PostgreSQL, https://www.postgresql.org/docs/current/errcodes-appendix.html)
#: that mean "try again later".
TRANSIENT_SQLSTATES = frozenset(
    {
        "25006",  # read_only_sql_transaction: a standby, or a read-only window in a failover
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available
        "57014",  # query_canceled (statement_timeout, pg_cancel_backend)
    }
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a database error that may go away if the write is retried."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    if not isinstance(exc, DatabaseError):
        return False
    code = getattr(exc.__cause__, "sqlstate", None)
    return code in TRANSIENT_SQLSTATES
