"""Which database errors are worth retrying: the one place that reads vendor error codes.

(And which one says a table is missing: ``migrate`` has not run.)

Outcome writes, heartbeats and claims retry an error that says "not now"
(the connection dropped, the server is read-only during a failover, a
deadlock or lock timeout picked us) and give up on one that says "never"
(the database refuses this value). Django's exception classes do not tell
them apart: PostgreSQL reports a read-only transaction as ``InternalError``
and a value over a size limit as ``OperationalError``. Where the driver
gives a SQLSTATE, it decides; MySQL's driver gives an error number
instead (``mysql_error_code``); otherwise (SQLite, a connection that died
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

#: MySQL and MariaDB server error numbers that mean "try again later"
#: (https://dev.mysql.com/doc/mysql-errors/8.0/en/server-error-reference.html,
#: https://mariadb.com/kb/en/mariadb-error-code-reference/). The driver maps
#: most server errors, "never" ones included (an unknown column), to
#: ``OperationalError``, so the class cannot decide there.
TRANSIENT_MYSQL_ERRORS = frozenset(
    {
        1040,  # ER_CON_COUNT_ERROR: too many connections
        1053,  # ER_SERVER_SHUTDOWN
        1152,  # ER_ABORTING_CONNECTION
        1158,  # ER_NET_READ_ERROR
        1159,  # ER_NET_READ_INTERRUPTED
        1160,  # ER_NET_ERROR_ON_WRITE
        1161,  # ER_NET_WRITE_INTERRUPTED
        1205,  # ER_LOCK_WAIT_TIMEOUT
        1213,  # ER_LOCK_DEADLOCK
        1290,  # ER_OPTION_PREVENTS_STATEMENT: --read-only during a failover
        1317,  # ER_QUERY_INTERRUPTED
        1792,  # ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION
        1927,  # ER_CONNECTION_KILLED (MariaDB)
        4031,  # ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8.0.24+: idle disconnect)
    }
)


def mysql_error_code(exc: BaseException) -> int | None:
    """The MySQL/MariaDB error number behind a Django database error, or None.

    mysqlclient's exceptions carry ``(errno, message)`` as their args; Django
    keeps the driver's exception as ``__cause__``.
    """
    cause = exc.__cause__ if isinstance(exc, DatabaseError) else exc
    if type(cause).__module__.split(".")[0] != "MySQLdb":
        return None
    args = getattr(cause, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


#: "The table does not exist": PostgreSQL's undefined_table SQLSTATE and
#: MySQL's ER_NO_SUCH_TABLE; SQLite says it in words only.
MISSING_TABLE_SQLSTATE = "42P01"
MISSING_TABLE_MYSQL_ERROR = 1146
MISSING_TABLE_SQLITE_TEXT = "no such table"


def is_missing_table(exc: BaseException) -> bool:
    """Whether ``exc`` says that a table does not exist (``migrate`` has not run)."""
    if not isinstance(exc, DatabaseError):
        return False
    code = getattr(exc.__cause__, "sqlstate", None)
    if isinstance(code, str) and len(code) == 5:
        return code == MISSING_TABLE_SQLSTATE
    errno = mysql_error_code(exc)
    if errno:
        return errno == MISSING_TABLE_MYSQL_ERROR
    return isinstance(exc, OperationalError) and str(exc).startswith(MISSING_TABLE_SQLITE_TEXT)


#: SQLSTATEs of "the server went away" outside class 08 (connection
#: exception): admin_shutdown, crash_shutdown, cannot_connect_now.
CONNECTION_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})
#: MySQL/MariaDB server errors of the same meaning (the client library's
#: own, 2000-2999, all are).
CONNECTION_MYSQL_ERRORS = frozenset({1053, 1152, 1158, 1159, 1160, 1161, 1927, 4031})


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached (not: refused this statement).

    The connection failed, broke or was closed by the server (a restart, a
    failover, a network cut). Django's wrapped errors and the drivers' own
    (the PostgreSQL wake-up listener uses psycopg directly) both count. A
    deadlock or a lock timeout is transient but not this: the server answered.
    """
    if isinstance(exc, InterfaceError):
        return True
    cause = exc.__cause__ if isinstance(exc, DatabaseError) else exc
    module = type(cause).__module__.split(".")[0]
    code = getattr(cause, "sqlstate", None)
    if isinstance(code, str) and len(code) == 5:
        return code[:2] == "08" or code in CONNECTION_SQLSTATES
    errno = mysql_error_code(exc)
    if errno:
        return 2000 <= errno < 3000 or errno in CONNECTION_MYSQL_ERRORS
    if module == "psycopg":
        # No SQLSTATE: the client library's own error (connection refused,
        # server closed the connection, the connection is closed).
        import psycopg

        return isinstance(cause, (psycopg.OperationalError, psycopg.InterfaceError))
    # SQLite has no server; only a file that cannot be opened is "unreachable".
    return isinstance(exc, OperationalError) and "unable to open database file" in str(exc)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a database error that may go away if the write is retried."""
    if not isinstance(exc, DatabaseError):
        return False
    code = getattr(exc.__cause__, "sqlstate", None)
    if isinstance(code, str) and len(code) == 5:
        return code[:2] in TRANSIENT_SQLSTATE_CLASSES or code in TRANSIENT_SQLSTATES
    errno = mysql_error_code(exc)
    if errno:
        # 2000-2999 are the client library's own: the connection failed or was lost.
        return errno in TRANSIENT_MYSQL_ERRORS or 2000 <= errno < 3000
    return isinstance(exc, (OperationalError, InterfaceError))
