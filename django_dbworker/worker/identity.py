"""Worker identity as stored in ``WorkItem.claimed_by`` (``host:pid:thread``) and in the
register of live workers (``host:pid``, ``LiveWorker.name``)."""

from __future__ import annotations

import os
import socket
import threading
from functools import cache


@cache
def _host() -> str:
    return socket.gethostname()


def process_id() -> str:
    """Identity of this process, ``host:pid``: the prefix of its threads' ``worker_id``."""
    return f"{_host()}:{os.getpid()}"[:255]


def worker_id() -> str:
    """Identity of the calling thread, unique across hosts and processes."""
    return f"{_host()}:{os.getpid()}:{threading.current_thread().name}"[:255]
