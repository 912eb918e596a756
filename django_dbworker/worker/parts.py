"""The one factory that decides how a worker runs: on threads, or inline.

A threaded worker (``run_workers``) has a thread pool, an event loop for
async handlers, a batched success writer, a hook thread, the heartbeat,
wake-ups, the periodic scheduler and own-table loops, enforces timeouts and
prefetches. An inline worker
(``testing.run_until_empty``) runs each item in the calling thread and its
transaction, one at a time, with none of those threads: another thread's
connection would not see the caller's uncommitted rows. Everything that
differs between the two is decided here, once, instead of by a flag read
in every class.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from django_dbworker.worker.config import WorkerConfig
from django_dbworker.worker.event_loop import EventLoop
from django_dbworker.worker.hooks import HookRunner, InlineHookRunner
from django_dbworker.worker.pool import InlinePool, Pool
from django_dbworker.worker.success_writer import InlineSuccessWriter, SuccessWriter


@dataclass(frozen=True)
class Parts:
    #: Heartbeat, wake-ups, scheduler and own-table loops run beside the claim loop.
    threaded: bool
    #: Handlers' timeouts are enforced (they need a second thread).
    enforce_timeout: bool
    #: Seconds of work to buffer beyond the running items.
    prefetch_horizon: float
    #: A claim error propagates (inline: the caller's connection and transaction).
    raise_claim_errors: bool
    make_pool: Callable[[Callable[[], None]], Pool]
    make_writer: Callable[[threading.Event], SuccessWriter]
    make_hooks: Callable[[], HookRunner]
    #: Where async handlers run; inline, none: each runs to its end in the caller's thread.
    make_event_loop: Callable[[], EventLoop | None]


def parts_for(config: WorkerConfig) -> Parts:
    using = config.using
    if config.inline:
        return Parts(
            threaded=False,
            enforce_timeout=False,
            prefetch_horizon=0.0,
            raise_claim_errors=True,
            make_pool=lambda on_done: InlinePool(),
            make_writer=lambda give_up: InlineSuccessWriter(using, give_up=give_up),
            make_hooks=InlineHookRunner,
            make_event_loop=lambda: None,
        )
    return Parts(
        threaded=True,
        enforce_timeout=True,
        prefetch_horizon=config.prefetch_horizon,
        raise_claim_errors=False,
        make_pool=lambda on_done: Pool(config.concurrency, name="dbworker", on_done=on_done),
        make_writer=lambda give_up: SuccessWriter(using, give_up=give_up),
        make_hooks=HookRunner,
        make_event_loop=lambda: EventLoop(config.async_concurrency),
    )
