"""Which database errors are worth retrying: the one place that reads vendor error codes.

Outcome writes, heartbeats and claims retry an error that says "not now"
(the connection dropped, the server is read-only during a failover, a
deadlock or lock timeout picked us) and give up on one that says "never"
(the database refuses this value). Django's exception classes do not tell
them apart: PostgreSQL reports a read-only transaction as ``InternalError``
and a value over a size limit as ``OperationalError``. Where the driver
gives a SQLSTATE, it decides; otherwise (SQLite, a connection that died
before the server answered) the exception class does.
"""

from __future__ import annotations

from django.db import DatabaseError, InterfaceError, OperationalError

#: SQLSTATE classes that mean "try again later"
#: (https://www.postgresql.org/docs/current/errcodes-appendix.html):
#: connection exception, transaction rollback (serialization, deadlock),
#: insufficient resources, operator intervention (shutdown, cancel), system error.
TRANSIENT_SQLSTATE_CLASSES = frozenset({"08", "40", "53", "57", "58"})
#: Single SQLSTATEs of other classes that mean the same.
TRANSIENT_SQLSTATES = frozenset(
    {
        "25006",  # read_only_sql_transaction: a standby, or a read-only window in a failover
        "55P03",  # lock_not_available
        "55006",  # object_in_use
    }
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a database error that may go away if the write is retried."""
    if not isinstance(exc, DatabaseError):
        return False
    code = getattr(exc.__cause__, "sqlstate", None)
    if isinstance(code, str) and len(code) == 5:
        return code[:2] in TRANSIENT_SQLSTATE_CLASSES or code in TRANSIENT_SQLSTATES
    return isinstance(exc, (OperationalError, InterfaceError))
