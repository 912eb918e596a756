"""``Worker``: the process-level runtime behind ``manage.py run_workers``, wired.

This module only builds the parts and connects them; each concern lives in
a module of its own:

- ``config.py``: what the worker is told; ``parts.py``: threaded or inline;
- ``claim_loop.py``: claim sizing, prefetch, shedding and dispatch, on the
  calling (main) thread; ``claim.py``: the one claim route (which rows, by
  which statement: rate limits, concurrency keys, paused queues);
- ``running.py``: one attempt on a pool thread (start-time fence check,
  ``execution.py``, hand-off to ``success_writer.py``);
- ``attempts.py``: the ledger of attempts in flight;
- ``settle.py``: the one place an attempt's ending is accounted for;
- ``recovery.py``: when stale recovery runs; ``heartbeat.py`` (and ``presence.py``);
- ``shutdown.py``: drain and release; ``watchdog.py``; ``slow_checks.py``.

Handler code never runs on the main thread and never inside the claim
transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from django_dbworker.db import operations
from django_dbworker.handlers import Handler, WorkItemHandler
from django_dbworker.metrics import WorkerMetrics, default_metrics
from django_dbworker.models import WorkItem
from django_dbworker.transitions import AttemptKey
from django_dbworker.worker.abandoned import AbandonedThreads
from django_dbworker.worker.attempts import Attempt, Ledger
from django_dbworker.worker.claim_loop import ClaimLoop
from django_dbworker.worker.clock import SYSTEM_CLOCK, Clock
from django_dbworker.worker.config import HOOK_GRACE, WorkerConfig
from django_dbworker.worker.connections import close_thread_connections
from django_dbworker.worker.control import Control
from django_dbworker.worker.handler_loop import HandlerLoop
from django_dbworker.worker.health_file import HEALTH_FILE_INTERVAL, HealthFile, worker_problem
from django_dbworker.worker.heartbeat import Heartbeat
from django_dbworker.worker.parts import parts_for
from django_dbworker.worker.pool import Pool
from django_dbworker.worker.prefetch import Prefetch
from django_dbworker.worker.presence import Presence
from django_dbworker.worker.recovery import Recovery
from django_dbworker.worker.running import AttemptRunner
from django_dbworker.worker.scheduler import Scheduler, start_scheduler
from django_dbworker.worker.settle import Settler
from django_dbworker.worker.shutdown import Shutdown
from django_dbworker.worker.slow_checks import Watcher
from django_dbworker.worker.success_writer import SuccessWriter
from django_dbworker.worker.wakeup import Listener, LocalWaker
from django_dbworker.worker.watchdog import Watchdog

__all__ = ["Worker", "WorkerConfig"]

logger = logging.getLogger("django_dbworker.worker")


class Worker:
    """Runs the given handler classes until stopped (or, in burst mode, until idle)."""

    def __init__(
        self,
        handlers: Sequence[type[Handler[Any]]],
        config: WorkerConfig | None = None,
        *,
        metrics: WorkerMetrics | None = None,
        clock: Clock | None = None,
        watchers: Sequence[Watcher] = (),
    ) -> None:
        self.config = cfg = config or WorkerConfig()
        self.metrics = metrics or default_metrics()
        self.clock = clock or SYSTEM_CLOCK
        self.parts = parts_for(cfg)
        self.work_item_handlers: dict[str, WorkItemHandler] = {}
        self.own_table_handlers: list[Handler[Any]] = []
        for cls in handlers:
            instance = cls()
            if isinstance(instance, WorkItemHandler):
                self.work_item_handlers[cls.name] = instance
            else:
                self.own_table_handlers.append(instance)
        self.ops = operations(cfg.using)
        self.control = control = Control()
        self.abandoned = AbandonedThreads(self.metrics)
        self.ledger = Ledger(on_retired=self._retired)
        self.watchdog = Watchdog(control=control, abandoned=self.abandoned, cap=cfg.abandoned_cap)
        self.settler = Settler(
            ledger=self.ledger,
            metrics=self.metrics,
            hooks=self.parts.make_hooks(),
            aborting=control.aborting,
        )
        self.recovery = Recovery(
            config=cfg,
            metrics=self.metrics,
            settler=self.settler,
            clock=self.clock,
            handlers=lambda: self.work_item_handlers,
        )
        self.event_loop = self.parts.make_event_loop()  # async handlers' (threaded only)
        self.shutdown = Shutdown(
            config=cfg, control=control, ledger=self.ledger, clock=self.clock, aio=self.event_loop
        )
        self.prefetch = Prefetch(concurrency=cfg.concurrency, horizon=self.parts.prefetch_horizon)
        self.watchers = list(watchers)
        self.listener: Listener | None = None
        #: Built by ``run()`` when there are WorkItem handlers.
        self.pool: Pool | None = None
        self.writer: SuccessWriter | None = None
        self.claim_loop: ClaimLoop | None = None

    # -- what tests, the command and run_until_empty read --------------------------

    # The control events (``control.py``), as the tests and the command name them.
    stopping = property(lambda self: self.control.stopping)
    draining = property(lambda self: self.control.draining)
    aborting = property(lambda self: self.control.aborting)
    wake = property(lambda self: self.control.wake)
    idle = property(lambda self: self.control.idle)

    @property
    def outcomes(self) -> Any:
        """How this process's attempts ended (final outcomes), by outcome."""
        return self.settler.outcomes

    @property
    def claimed(self) -> int:
        """Rows claimed so far."""
        return self.claim_loop.claimed if self.claim_loop is not None else 0

    @property
    def claims(self) -> int:
        """Claim statements that found rows."""
        return self.claim_loop.claims if self.claim_loop is not None else 0

    @property
    def given_back(self) -> int:
        """Buffered rows handed back because jobs got too long to start them soon."""
        return self.claim_loop.given_back if self.claim_loop is not None else 0

    @property
    def released(self) -> int:
        """Rows handed back to pending at shutdown."""
        return self.shutdown.released

    @property
    def unhealthy(self) -> str | None:
        """Why the process stopped itself (watchdog), or None; exit non-zero if set."""
        return self.watchdog.unhealthy

    def in_flight(self) -> list[WorkItem]:
        """Rows of attempts not yet recorded (running, buffered or being written)."""
        return self.ledger.items()

    # -- control -----------------------------------------------------------------

    def stop(self, *, immediate: bool = False) -> None:
        """Stop claiming; with ``immediate`` also stop waiting for running items."""
        self.control.stop(immediate=immediate)

    def add_handlers(self, classes: Sequence[type[WorkItemHandler]]) -> None:
        """Claim for these WorkItem handlers too, from the next claim on.

        For ``@task`` functions found after start-up (``watchers.TaskDiscovery``).
        The claim loop, heartbeat and recovery read ``work_item_handlers``
        from other threads: it is replaced, never changed in place.
        """
        added = {cls.name: cls() for cls in classes if cls.name not in self.work_item_handlers}
        if added:
            self.work_item_handlers = {**self.work_item_handlers, **added}
            self.control.wake.set()

    def run_once(self) -> int:
        """One claim-and-dispatch step (``ClaimLoop.run_once``), for tests that step by hand."""
        assert self.claim_loop is not None
        return self.claim_loop.run_once()

    # -- the run ----------------------------------------------------------------

    def run(self) -> None:
        """Run until ``stop()`` (or idle, in burst mode); release unfinished rows.

        If a helper thread dies or abandoned threads reach their cap, the
        worker stops claiming, drains like on SIGTERM and sets ``unhealthy``
        (``run_workers`` then exits non-zero so a supervisor restarts it).
        """
        cfg, parts, control = self.config, self.parts, self.control
        # Inline, only WorkItem handlers run: an own-table loop needs threads.
        loops = [
            HandlerLoop(
                h, stopping=control.stopping, burst=cfg.burst, using=cfg.using, metrics=self.metrics
            )
            for h in (self.own_table_handlers if parts.threaded else [])
        ]
        if self.work_item_handlers:
            self._build_claiming()
        helpers = self._start_helpers() if parts.threaded else []
        for watcher in self.watchers:
            watcher.attach(stopping=control.stopping, add_handlers=self.add_handlers)
            watcher.start()
            self.watchdog.watch(watcher.what, watcher, ends_on_stop=True)
        for loop in loops:
            loop.start()
        try:
            if self.claim_loop is not None:
                self.claim_loop.run()
            # Own-table loops end by themselves in burst mode; otherwise they
            # run until a stop is requested.
            while any(loop.is_alive() for loop in loops) and not control.stopping.is_set():
                self.clock.wait(control.stopping, 0.2)
            control.stopping.set()
            self.shutdown.drain(pool=self.pool, writer=self.writer, loops=loops)
        finally:
            control.stopping.set()
            for helper in helpers:
                helper.stop()
            if self.pool is not None:
                self.pool.shutdown()
            if self.writer is not None and self.writer.is_alive():
                self.writer.close()
                self.writer.join(10)
            self.settler.hooks.close(HOOK_GRACE)  # after the writer: it hands hooks over
            if parts.threaded:  # inline, the connection is the caller's
                close_thread_connections()

    def _build_claiming(self) -> None:
        cfg, parts = self.config, self.parts
        self.writer = writer = parts.make_writer(self.control.aborting)
        writer.start()
        self.pool = pool = parts.make_pool(self._maybe_wake)
        runner = AttemptRunner(
            config=cfg,
            control=self.control,
            ledger=self.ledger,
            settler=self.settler,
            writer=writer,
            prefetch=self.prefetch,
            metrics=self.metrics,
            abandoned=self.abandoned,
            clock=self.clock,
            enforce_timeout=parts.enforce_timeout,
            healthy=self.watchdog.healthy,
            on_started=self._maybe_wake,  # the buffer shrank
            event_loop=self.event_loop,
        )
        self.claim_loop = ClaimLoop(
            config=cfg,
            control=self.control,
            ops=self.ops,
            pool=pool,
            event_loop=self.event_loop,
            ledger=self.ledger,
            prefetch=self.prefetch,
            recovery=self.recovery,
            shutdown=self.shutdown,
            metrics=self.metrics,
            clock=self.clock,
            handlers=lambda: self.work_item_handlers,
            run_next=runner.run_next,
            healthy=self.watchdog.check,
            raise_errors=parts.raise_claim_errors,
            # Wake-ups say what they announce: a listener whose probe came back.
            priorities_arrive=lambda: self.listener is not None and self.listener.reached,
        )
        runner.may_start, runner.give_back = self.claim_loop.route.start, self.claim_loop.give_back

    def _start_helpers(self) -> list[Heartbeat | Scheduler | Listener | LocalWaker]:
        """The heartbeat (alone for own-table handlers: the register row), wake-ups, scheduler."""
        cfg, control = self.config, self.control
        started: list[Heartbeat | Scheduler | Listener | LocalWaker] = []
        own = [h.name for h in self.own_table_handlers]  # work_item_handlers may grow
        heartbeat = Heartbeat(
            interval=cfg.heartbeat_interval,
            snapshot=self.ledger.to_heartbeat,
            on_lost=self._lost,
            on_held=self.ledger.mark_held,
            on_cancel_requested=self.ledger.mark_cancel_requested,
            using=cfg.using,
            observe=self.recovery.observe_write,
            clock=self.clock,
            presence=Presence.of(cfg, lambda: [*self.work_item_handlers, *own]),
        )
        heartbeat.start()
        started.append(heartbeat)
        self.watchdog.watch("heartbeat", heartbeat)
        if self.writer is None:  # no WorkItem handlers
            return started
        self.watchdog.watch("success writer", self.writer)
        if not cfg.burst:
            if self.ops.supports_notify and cfg.wakeups:
                self.listener = Listener.of(cfg, wake=self._announced, claimer=self.claim_loop)
                self.listener.start()
                started.append(self.listener)
            else:
                waker = LocalWaker(queues=cfg.queues, wake=control.wake.set)
                waker.start()
                started.append(waker)
        # Periodic handlers' slots (worker/scheduler.py); None without any.
        scheduler = start_scheduler(
            self.work_item_handlers.values(),
            using=cfg.using,
            queues=cfg.queues,
            burst=cfg.burst,
            metrics=self.metrics,
            on_enqueued=control.wake.set,
        )
        if scheduler is not None:
            started.append(scheduler)
            self.watchdog.watch("periodic scheduler", scheduler)
        if cfg.health_file is not None:
            health = HealthFile(
                cfg.health_file,
                interval=min(cfg.heartbeat_interval, HEALTH_FILE_INTERVAL),
                problem=worker_problem(self.watchdog, self.claim_loop, cfg, self.clock),
                stopping=control.stopping,
            )
            health.start()
            self.watchdog.watch("health file", health, ends_on_stop=True)
        return started

    def _lost(self, keys: set[AttemptKey]) -> None:
        """The heartbeat found these claims gone (recovered as stale meanwhile)."""
        for attempt in self.ledger.mark_lost(keys):
            logger.warning(
                "Lost the claim on work item %s (%s): it was recovered as stale. "
                "Its outcome will be discarded.",
                attempt.key[0],
                attempt.handler.name,
            )

    def _announced(self, priority: int | None) -> None:
        """A wake-up from another process (``Listener``), with the priority it announced."""
        if self.claim_loop is None:
            self.control.wake.set()
        else:
            self.claim_loop.announce(priority)

    def _retired(self, attempt: Attempt) -> None:
        """An attempt left the ledger: the claim loop may claim (``ClaimLoop.retired``)."""
        if self.claim_loop is None:
            self.control.wake.set()
        else:
            self.claim_loop.retired(attempt)

    def _maybe_wake(self) -> None:
        """Wake the claim loop if its buffer is down to the refill mark (room to claim)."""
        if self.claim_loop is None:
            self.control.wake.set()
        else:
            self.claim_loop.maybe_wake()
