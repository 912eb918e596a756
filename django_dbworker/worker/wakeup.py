"""Wake-ups: an idle worker starts new work within milliseconds of an enqueue.

A thread keeps a subscription to the database's wake-up notifications
(``operations(using).listen()``: on PostgreSQL, LISTEN on a connection of
its own) and wakes the claim loop for each notified queue it serves. This
module holds the thread, its reconnects and backoff; it holds no SQL and no
driver API. Losing the subscription only costs latency: the claim loop
still polls at POLL_INTERVAL.

One wake-up, one claimer: among the workers that claim alike (the same
queues and handlers, ``Listener.group``), one at a time holds the turn
(``Subscription.wait_turn``: on PostgreSQL a session advisory lock, see
``db/postgresql_listen.py``) and acts on every wake-up; the others wait for
it without listening. The holder passes it on when its claims come back
full (``saturated``: it cannot take all that is ready), and then listens
for wake-ups meanwhile: it claims an urgent row ahead of its buffer (as
before), other rows only once it has room; once a claim of its comes back
short it queues for the turn again. A worker granted the turn claims once: wake-ups of the
meantime reached nobody. A worker woken that finds nothing wakes no one.

With WAKEUP_WINDOW above 0, enqueuers send at most one wake-up per queue per
window (``db/wake_window.py``); the listener then wakes the loop once more
that long after the last wake-up it received (the trailing claim), which
finds the rows whose wake-ups were skipped. With WAKEUPS off nothing is
listened for: the loop polls adaptively, as on MySQL.

The listener connects with WAKEUP_DATABASE's alias (default: the work
table's). LISTEN is session state, which a pooler in transaction mode
(PgBouncer) does not keep: there the LISTEN succeeds and nothing ever
arrives. So once subscribed, the listener sends a probe on the work table's
alias (as an enqueuer sends a wake-up) and waits a bounded time for it; if
it does not arrive, a WARNING says that wake-ups cannot reach this worker,
that it polls every POLL_INTERVAL, and what to set.

Where the database has no such notifications (SQLite, MySQL), an enqueue
committed in the worker's own process wakes it at once (``LocalWaker``);
on MySQL the claim loop also polls adaptively (``AdaptivePoll``: often for
a moment after a claim that found work, backing off to POLL_INTERVAL when
idle). Not on SQLite, where every poll takes the database's write lock.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from django_dbworker.db import (
    Subscription,
    VendorOperations,
    add_local_waker,
    operations,
    parse_wake_payload,
    remove_local_waker,
)
from django_dbworker.worker.config import WorkerConfig
from django_dbworker.worker.connections import Backoff, outage, report_error

logger = logging.getLogger("django_dbworker.worker")

#: Seconds between polls while work keeps coming: for BUSY_WINDOW seconds
#: after a claim that found work, then doubling up to POLL_INTERVAL.
FIRST_POLL = 0.01
#: How long after the last claim that found work the loop keeps polling at
#: FIRST_POLL, in seconds.
BUSY_WINDOW = 1.0
#: Seconds the listener waits for its probe before it warns that wake-ups
#: cannot reach it. On a direct connection the probe arrives within
#: milliseconds; the margin is for a loaded server, so that a working
#: connection is not reported as broken.
PROBE_TIMEOUT = 5.0
#: Seconds between two looks, by a listener taking turns, at whether its
#: claim loop became saturated (or stopped being so): what it receives meanwhile
#: is acted on as it arrives. A client-side wait: no statement.
TURN_CHECK = 0.05


class AdaptivePoll:
    """How long the idle claim loop waits before it polls again, without notifications.

    Work tends to come in bursts: right after a claim found rows, more are
    likely to arrive, and short waits find them with little latency. For
    ``window`` seconds after the last claim that found work the loop polls
    every ``first`` seconds (each poll is one indexed query that usually
    finds nothing: cheap, and only while work is flowing); after that the
    wait doubles at each empty poll up to POLL_INTERVAL, so a quiet queue
    costs one query per interval per worker. Where notifications wake the
    loop, or polls are not cheap (``enabled`` False:
    ``VendorOperations.poll_adaptively``), it always waits POLL_INTERVAL.
    """

    def __init__(
        self,
        cap: float,
        *,
        enabled: bool,
        first: float = FIRST_POLL,
        window: float = BUSY_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap = cap
        self.enabled = enabled
        self.first = min(first, cap)
        self.window = window
        self.clock = clock
        self.delay = cap
        self.last_work = -math.inf

    def found_work(self) -> None:
        if self.enabled:
            self.last_work = self.clock()
            self.delay = self.first

    def next(self) -> float:
        """The wait before the next poll (a wake-up may end it sooner)."""
        if not self.enabled:
            return self.cap
        if self.clock() - self.last_work < self.window:
            return self.first
        delay = self.delay
        self.delay = min(self.cap, delay * 2)
        return delay


def polls_adaptively(ops: VendorOperations, wakeups: bool) -> bool:
    """Whether the idle loop polls adaptively: where the vendor asks, or LISTEN is off."""
    return ops.poll_adaptively or (ops.supports_notify and not wakeups)


class Claimer(Protocol):
    """What the listener asks of the claim loop it wakes (``ClaimLoop``)."""

    @property
    def saturated(self) -> bool:
        """More may be ready than it takes now, or it is stopping: it passes the turn on."""
        ...

    def handlers(self) -> Mapping[str, Any]: ...


def claim_group(queues: Sequence[str] | None, handlers: Sequence[str]) -> str:
    """The name of the workers that claim alike: the wake-up turn they share.

    A wake-up names its queue, not its handler: workers that serve other
    handlers (another release of the code, ``run_workers`` given names)
    take turns apart, so that a wake-up never goes to a worker that cannot
    claim its row.
    """
    return json.dumps([sorted(queues) if queues else None, sorted(handlers)])


class LocalWaker:
    """Wakes the claim loop when this process commits an enqueue for one of its queues.

    The database cannot tell other processes; this process knows of its own
    enqueues (``VendorOperations.notify``), for instance a handler enqueueing
    follow-up work.
    """

    def __init__(self, *, queues: Sequence[str] | None, wake: Callable[[], None]) -> None:
        self.queues = set(queues) if queues else None
        self.wake = wake

    def __call__(self, queues: Sequence[str]) -> None:
        if self.queues is None or not self.queues.isdisjoint(queues):
            self.wake()

    def start(self) -> None:
        add_local_waker(self)

    def stop(self) -> None:
        remove_local_waker(self)


class Listener(threading.Thread):
    """Wakes the claim loop for each wake-up of a queue it serves, with the row's priority.

    ``wake(priority)``: the priority the wake-up announced (0 when it names
    none), or None after a reconnect, when wake-ups may have been missed and
    nothing is known of what is pending. With a ``window`` (WAKEUP_WINDOW),
    ``window`` seconds after the last wake-up received it wakes the loop
    once more with the highest priority announced since (the trailing
    claim): an enqueuer skips wake-ups for that long after one it sent.

    With ``group`` (the name of what this worker claims: its queues and
    handlers) and once its probe came back, it takes turns (the module's
    docstring): it waits for the turn, acts on every wake-up while it holds
    it, and passes it on while ``saturated()`` (its claims come back full),
    still listening (its loop claims an urgent row at once, others once it
    has room).

    ``using`` is the alias it LISTENs with (WAKEUP_DATABASE, or the work
    table's), ``probe_using`` the alias enqueuers notify on (the work
    table's): the probe goes from the one to the other, as wake-ups do, so
    it also finds a WAKEUP_DATABASE that reaches another database.
    """

    def __init__(
        self,
        *,
        using: str,
        queues: Sequence[str] | None,
        wake: Callable[[int | None], None],
        window: float = 0.0,
        probe_using: str | None = None,
        probe_timeout: float = PROBE_TIMEOUT,
        poll_interval: float | None = None,
        wakeup_database: str | None = None,
        group: Callable[[], str] | None = None,
        saturated: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="dbworker-listener", daemon=True)
        self.using = using
        self.queues = set(queues) if queues else None
        self.wake = wake
        self.window = window
        self.probe_using = probe_using or using
        self.probe_timeout = probe_timeout
        self.poll_interval = poll_interval
        self.wakeup_database = wakeup_database
        self.group = group
        self.saturated = saturated
        self.clock = clock
        #: This listener holds its group's turn (or takes no turns: None).
        self.holding: bool | None = None
        #: The group whose turn it holds: the group's name changes when a task is found
        #: after start, and the turn to give back is the one taken.
        self._held = ""
        #: The subscription of a ``wait_turn`` under way (``stop`` interrupts it).
        self._waiting: Subscription | None = None
        self._waiting_lock = threading.Lock()
        #: When the trailing claim is due, and the priority it announces.
        self._trailing: tuple[float, int] | None = None
        #: The probe in flight (its token, when it is overdue), if any.
        self._probe: tuple[str, float] | None = None
        #: Not before this time is a probe sent again (one could not be sent).
        self._next_probe = -math.inf
        self.stopped = threading.Event()
        self.listening = threading.Event()
        #: Set once the probe arrived (``reached``) or was given up on (warned).
        self.checked = threading.Event()
        self.reached = False

    @classmethod
    def of(
        cls, config: WorkerConfig, *, wake: Callable[[int | None], None], claimer: Claimer | None
    ) -> Listener:
        """The listener of a worker told ``config``: its aliases, queues and WAKEUP_WINDOW,
        taking turns for ``claimer`` (its claim loop)."""
        return cls(
            group=None
            if claimer is None
            else lambda: claim_group(config.queues, list(claimer.handlers())),
            saturated=(lambda: False) if claimer is None else lambda: claimer.saturated,
            using=config.listen_using,
            queues=config.queues,
            wake=wake,
            window=config.wakeup_window,
            probe_using=config.using,
            poll_interval=config.poll_interval,
            wakeup_database=config.wakeup_database,
        )

    def run(self) -> None:
        try:
            ops = operations(self.using)
            usable = ops.supports_notify
        except Exception as exc:  # an alias not in DATABASES (system check W005)
            usable, ops = False, None
            logger.debug("No operations for %r: %s", self.using, exc)
        if not usable or ops is None:
            logger.warning(
                "Wake-ups cannot reach this worker: WAKEUP_DATABASE %r is not a PostgreSQL "
                "alias of DATABASES; the worker polls every POLL_INTERVAL (%ss).",
                self.using,
                "?" if self.poll_interval is None else f"{self.poll_interval:g}",
            )
            self.checked.set()
            return
        backoff = Backoff(first=0.5, cap=10.0)
        while not self.stopped.is_set():
            subscription: Subscription | None = None
            try:
                subscription = ops.listen()
                # A probe sent to an earlier subscription may have been lost with it.
                self._probe = None
                self.holding = None  # the turn, if held, went with the old session
                self.listening.set()
                backoff.reset()
                outage.back(self.using, reached=True)
                # Wake once after (re)connecting: notifications sent while we
                # were not listening are lost, the rows they announced are not.
                self.wake(None)
                self._check(subscription)  # the probe goes out at once
                while not self.stopped.is_set():
                    self._receive(subscription)
                    self._take_turns(subscription)
            except Exception as exc:
                self.listening.clear()
                if self.stopped.is_set():
                    break
                delay = backoff.next()
                if not report_error(self.using, "wake-up listener", exc):
                    logger.warning(
                        "Wake-up listener lost its connection (%s); reconnecting in %.1fs.",
                        exc,
                        delay,
                    )
                self.stopped.wait(delay)
            finally:
                if subscription is not None:
                    try:
                        subscription.close()
                    except Exception:
                        logger.debug("Ignoring an error closing the listener.", exc_info=True)

    def _receive(self, subscription: Subscription) -> None:
        """Wake the loop for what arrives within a second (or until the trailing claim).

        Taking turns, for TURN_CHECK at most. Without the turn (passed on) it
        still wakes the loop: a saturated loop claims only what outranks its
        buffer (an urgent row), or once it has room again.
        """
        trailing = self._trailing
        timeout = TURN_CHECK if self.holding is not None else 1.0
        if trailing is not None:
            timeout = min(timeout, max(0.0, trailing[0] - self.clock()))
        for payload in subscription.receive(timeout=timeout):
            queue, priority = parse_wake_payload(payload)
            if self.queues is None or queue in self.queues:
                self.wake(priority)
                if self.window > 0:
                    top = priority if trailing is None else max(priority, trailing[1])
                    self._trailing = (self.clock() + self.window, top)
                    break  # wait again, until the new trailing claim at most
        trailing = self._trailing
        if trailing is not None and self.clock() >= trailing[0]:
            self._trailing = None
            self.wake(trailing[1])
        self._check(subscription)

    def _check(self, subscription: Subscription) -> None:
        """Probe once that wake-ups reach this subscription; warn if they do not.

        A probe is a notification on a channel of its own (so that nothing
        takes it for a wake-up), sent on ``probe_using``'s database on a
        fresh connection (``Subscription.probe``), as an enqueuer would wake
        this worker. Not arriving within ``probe_timeout`` means the LISTEN does
        not hold: a pooler in transaction mode, or a WAKEUP_DATABASE that
        reaches another database. The worker still works, polling.
        """
        if self.checked.is_set():
            return
        now = self.clock()
        if self._probe is None:
            if now < self._next_probe:
                return
            token = uuid.uuid4().hex
            try:
                subscription.probe(token, self.probe_using)
            except Exception:
                # The work table's database is away: try again later.
                self._next_probe = now + self.probe_timeout
                logger.debug("Could not send the wake-up probe.", exc_info=True)
                return
            self._probe = (token, now + self.probe_timeout)
            return
        token, deadline = self._probe
        if subscription.probed(token):
            self._probe = None
            self.reached = True
            logger.debug("Wake-ups reach the listener on database %r.", self.using)
            self.checked.set()  # after the log line: the outcome is reported
        elif now >= deadline:
            self._probe = None
            logger.warning(
                "Wake-ups cannot reach this worker: a probe notification sent on database "
                "%r did not arrive within %.0fs at the LISTEN connection of database %r (%s). "
                "LISTEN needs a session of its own, which a connection pooler in transaction "
                "mode (PgBouncer) does not keep, so enqueued work waits for the next poll: "
                "the worker polls every POLL_INTERVAL (%ss). Set DBWORKER['WAKEUP_DATABASE'] "
                "to an alias of DATABASES that connects to PostgreSQL directly, to the same "
                "database.",
                self.probe_using,
                self.probe_timeout,
                self.using,
                f"WAKEUP_DATABASE {self.wakeup_database!r}"
                if self.wakeup_database
                else "WAKEUP_DATABASE is not set",
                "?" if self.poll_interval is None else f"{self.poll_interval:g}",
            )
            self.checked.set()

    def _take_turns(self, subscription: Subscription) -> None:
        """Pass the turn while saturated; wait for it (not listening) while not.

        Only once the probe came back: a LISTEN that holds is a session of
        its own, where the turn's lock stays with this worker. Not while a
        trailing claim is due (WAKEUP_WINDOW): the rows whose wake-up the
        window skipped were announced to no one else. A worker whose
        group changed (a task found after start) gives back the turn it took
        and waits for its new group's.
        """
        if self.group is None or not self.reached:
            return
        saturated = self.saturated()
        group = self.group()
        if self.holding is None:
            self.holding = False  # taking turns from now on: without the turn yet
        if self.holding and (saturated or group != self._held):
            subscription.pass_turn(self._held)
            self.holding = False
            logger.debug(
                "Passed the wake-up turn on: its claims come back full, or its handlers changed."
            )
        elif not self.holding and not saturated and self._trailing is None:
            # A trailing claim owed first: only this worker heard the wake-up it follows.
            with self._waiting_lock:
                if self.stopped.is_set():
                    return
                self._waiting = subscription
            try:
                granted = subscription.wait_turn(group)
            finally:
                with self._waiting_lock:
                    self._waiting = None
            if granted:
                self.holding, self._held = True, group
                logger.debug("Took the wake-up turn: this worker claims for every wake-up.")
                # Wake-ups sent while no one held the turn reached no one.
                self.wake(None)
            elif not self.stopped.is_set():
                self.holding = False  # cancelled by a statement_timeout: waits anew
                logger.debug("The wait for the wake-up turn was cancelled; waiting again.")

    def stop(self) -> None:
        with self._waiting_lock:
            self.stopped.set()
            waiting = self._waiting
        if waiting is not None:
            try:
                waiting.interrupt()
            except Exception:
                logger.debug("Ignoring an error interrupting the turn's wait.", exc_info=True)
