"""``run_workers --reload``: Django's autoreloader, with every restart and stop a drain.

Django's ``autoreload`` (runserver's) runs the command again in a child
process (``RUN_MAIN=true``) whose main thread watches the modules' files
while the command runs on a daemon thread; a change exits the child with
status 3 (``trigger_reload``), and the parent starts a new one. Two of its
habits would lose work, and are replaced here:

- ``run_with_reloader``'s parent exits on SIGTERM through
  ``subprocess.run``, which kills the child with SIGKILL: the items it
  claimed would wait for stale recovery. ``supervise`` is that parent
  loop (Django's child arguments, environment and status 3) with stop
  signals forwarded to the child instead, which drains as it does without
  ``--reload``.
- The child's daemon thread dies, mid-item, when the main thread exits for
  a change (``sys.exit(3)``). ``run_in_child`` catches that exit, drains
  the worker, and only then lets the process end.

The file watching itself is Django's: in the child, ``run_with_reloader``.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import threading
from types import FrameType
from typing import Any, Protocol

from django.db import connections
from django.utils import autoreload

from django_dbworker.worker.runtime import Worker

logger = logging.getLogger("django_dbworker")

#: The status by which a child asks to be started again (``autoreload.trigger_reload``).
RESTART = 3


class StopSignals(Protocol):
    """What the child needs of ``run_workers``' stop-signal handling."""

    def listen(self) -> None: ...

    def handle(self, signum: int) -> None: ...


def in_child() -> bool:
    """Whether this process is the child the parent (``supervise``) started."""
    return os.environ.get(autoreload.DJANGO_AUTORELOAD_ENV) == "true"


def supervise() -> int:
    """The parent: run the child until it exits with another status than ``RESTART``.

    SIGTERM and SIGINT reach the child as SIGTERM, once per signal received
    here (the second one makes it release at once), and no child starts
    after one. The child starts with SIGINT ignored: a terminal's Ctrl-C
    reaches every process of the group, and a child that took it besides
    the SIGTERM forwarded here would count two stops and release at once.
    Returns the status for this process: the child's (128 + N when killed by
    signal N), 0 when a stop signal ended a child that was restarting or had
    not yet set up its handlers (it had claimed nothing).
    """
    args = autoreload.get_child_arguments()
    env = {**os.environ, autoreload.DJANGO_AUTORELOAD_ENV: "true"}
    forwarder = _Forwarder()
    try:
        while True:
            with forwarder.lock:
                if forwarder.stopping:
                    return 0
                default = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the child
                try:
                    forwarder.child = subprocess.Popen(args, env=env, close_fds=False)
                finally:
                    signal.signal(signal.SIGINT, default)
            code = forwarder.child.wait()
            if forwarder.stopping and code in (0, RESTART, -signal.SIGTERM):
                return 0  # stopped, restarting or not yet started: a clean stop
            if code != RESTART:
                return 128 - code if code < 0 else code
    finally:
        forwarder.close()


class _Forwarder:
    """Hands each stop signal, from a handler that takes no lock, to a thread that forwards it.

    The lock makes "no child starts after a stop signal" and "the child of
    the moment gets the signal" one decision (see ``_StopOnSignal`` in
    ``run_workers`` for why a handler takes no lock).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopping = False
        self.child: subprocess.Popen[bytes] | None = None
        self._arrived: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="dbworker-reload", daemon=True)
        self._thread.start()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._arrived.put(signum)

    def _serve(self) -> None:
        while self._arrived.get() is not None:
            with self.lock:
                self.stopping = True
                if self.child is not None:
                    self.child.send_signal(signal.SIGTERM)  # nothing if it has exited

    def close(self) -> None:
        self._arrived.put(None)


def run_in_child(worker: Worker, signals: StopSignals) -> bool:
    """Run ``worker`` under Django's file watcher; return whether a change ended it.

    Returns once the worker has stopped, whatever stopped it: a change (the
    caller then exits ``RESTART``), a stop signal, or the worker itself
    (unhealthy). The watcher has the main thread, so the worker runs on
    Django's thread; its own stop ends the watcher (``reloader.stop()``).
    Django's watcher sets SIGTERM to exit the main thread: once it watches,
    ``signals`` take SIGTERM back, so a stop signal is the usual drain.
    """
    finished = threading.Event()
    reloaders: list[autoreload.BaseReloader] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:  # raised on the main thread below, once
            errors.append(exc)
        finally:
            finished.set()
            for reloader in reloaders:
                reloader.stop()

    def watching(sender: autoreload.BaseReloader, **kwargs: Any) -> None:
        signals.listen()
        reloaders.append(sender)
        if finished.is_set():
            sender.stop()

    # The start's connections, on this thread, would sit idle until the restart: the
    # worker's threads open their own.
    connections.close_all()
    autoreload.autoreload_started.connect(watching)
    changed = False
    try:
        autoreload.run_with_reloader(run)
    except SystemExit as exc:
        signals.listen()
        if exc.code == RESTART:
            changed = True
            logger.info("Code changed: finishing running items, then restarting.")
            worker.stop()
        else:  # SIGTERM before the watcher started: Django's handler exited
            signals.handle(signal.SIGTERM)
    except BaseException:  # the watcher failed: its error, after a drain
        worker.stop()
        finished.wait()
        raise
    else:
        if not finished.is_set():  # SIGINT (a child started by hand): Django's watcher returned
            signals.handle(signal.SIGINT)
    finally:
        autoreload.autoreload_started.disconnect(watching)
    finished.wait()
    if errors:
        raise errors[0]
    return changed
