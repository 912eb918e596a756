"""The events by which a worker's parts tell each other to stop, drain or wake.

One object, shared by the claim loop, the attempt runner, shutdown and the
watchdog, so that "stopping" means the same thing everywhere. Events, not
flags: a stop signal sets them (from run_workers' signal thread: a signal
handler that took their locks could interrupt a holder of one and wait for
it forever) and helper threads wait on them.
"""

from __future__ import annotations

import threading


class Control:
    def __init__(self) -> None:
        #: Stop claiming.
        self.stopping = threading.Event()
        #: Stopping on a signal (or the watchdog): buffered rows that have not
        #: started are released at once instead of run.
        self.draining = threading.Event()
        #: A second signal: stop waiting for running items, release them now.
        self.aborting = threading.Event()
        #: Wakes the claim loop (a NOTIFY, a buffer running low, a stop).
        self.wake = threading.Event()
        #: Set while the claim loop sleeps with nothing to claim (tests wait on it).
        self.idle = threading.Event()

    def stop(self, *, immediate: bool = False) -> None:
        """Stop claiming; with ``immediate`` also stop waiting for running items."""
        if immediate:
            self.aborting.set()
        self.draining.set()
        self.stopping.set()
        self.wake.set()
