"""Rate limits (SPEC "Flow control"): at most N starts of a handler in any window of its
period, cluster-wide, counted as the handlers start (``flow/rates.py``), whatever the
isolation level, the database clock or the size of the window."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.db.models import Sum
from django.db.models.functions import Now
from prometheus_client import CollectorRegistry

from django_dbworker.db import operations
from django_dbworker.flow.models import FlowLock, RateStart
from django_dbworker.flow.rates import RATE_BUCKETS, take_start
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.metrics import WorkerMetrics
from django_dbworker.models import Status, WorkItem
from django_dbworker.testing import run_until_empty
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.factories import worker_config
from tests.testapp.models import Execution
from tests.testapp.workers import Rated

pytestmark = pytest.mark.django_db(transaction=True)


def take(handler: str = "rated", starts: int = 5, period: float = 60.0) -> float | None:
    """``take_start``: None when the start was taken."""
    return take_start(operations(), handler=handler, starts=starts, period=period)


def most_in_a_window(times: list[datetime], period: float) -> int:
    """The most times in any half-open window of ``period`` seconds."""
    times = sorted(times)
    most = start = 0
    for end, t in enumerate(times):
        while (t - times[start]).total_seconds() >= period:
            start += 1
        most = max(most, end - start + 1)
    return most


def test_a_window_allows_its_starts_then_says_when_it_frees_up() -> None:
    assert [take(starts=2) for _ in range(2)] == [None, None]
    full_for = take(starts=2)
    allowance = operations().rate_allowance
    assert full_for is not None and 59.0 < full_for <= 60.0 * (1 + 1 / RATE_BUCKETS) + allowance
    assert RateStart.objects.aggregate(n=Sum("count"))["n"] == 2  # the refusal took nothing
    # A minute later (the database's clock) the starts have left the window.
    RateStart.objects.update(started_at=Now() - timedelta(seconds=62))
    assert take(starts=2) is None
    assert RateStart.objects.aggregate(n=Sum("count"))["n"] == 1  # the old ones deleted


def test_a_window_counts_only_its_own_handlers_starts() -> None:
    """Handler names are case-sensitive (MySQL: binary collation): "s14_rated" and
    "S14_RATED" have windows of their own, and one's take never clears the other's."""
    assert take("s14_rated", starts=1, period=3600.0) is None
    assert take("S14_RATED", starts=1, period=3600.0) is None, "held by another's start"
    assert take("s14_rated", starts=1, period=3600.0) is not None
    RateStart.objects.filter(handler="s14_rated").update(started_at=Now() - timedelta(seconds=10))
    for _ in range(3):  # "S14_RATED" as "1/s" now: it deletes its own old starts
        take("S14_RATED", starts=1, period=1.0)
    assert take("s14_rated", starts=1, period=3600.0) is not None, (
        "a second start of a '1/h' handler ten seconds after its first"
    )


def test_concurrent_takers_never_start_more_than_n_in_a_window() -> None:
    n, period = 5, 0.5
    taken: list[datetime] = []
    spans: list[tuple[datetime, datetime]] = []  # each take happened between these two
    lock = threading.Lock()
    deadline = time.monotonic() + 2.2
    errors: list[BaseException] = []

    def taker() -> None:
        try:
            while time.monotonic() < deadline:
                before = datetime.now(UTC)
                full_for = take(starts=n, period=period)
                if full_for is None:
                    with lock:
                        taken.append(datetime.now(UTC))
                        spans.append((before, taken[-1]))
                else:
                    time.sleep(min(full_for, 0.05))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=taker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    # About 2.2 s of taking: 4 or 5 full windows of 5 starts (a bucket more of window).
    assert 15 <= len(taken) <= 25, len(taken)
    # Each take happened between the times read around it: the takes that surely fell
    # inside a window (their whole span in it) are at most n in any window of the period
    # less its allowance (20 ms). A loaded host lengthens the spans, never the count.
    for start, _ in spans:
        end = start + timedelta(seconds=period - 0.02)
        inside = [s for s in spans if s[0] >= start and s[1] <= end]
        assert len(inside) <= n, (start, inside)
    # The window keeps a bucket a row: never more than the buckets of one window.
    assert RateStart.objects.filter(handler="rated").count() <= RATE_BUCKETS + 2


@pytest.mark.postgres_only
@pytest.mark.parametrize("level", ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"])
def test_a_taker_counts_the_starts_of_the_lock_holder_before_it(level: str) -> None:
    """A project at REPEATABLE READ (OPTIONS["isolation_level"], or the server's default):
    a taker that waited for the handler's lock sees the starts its previous holder
    committed meanwhile (a snapshot taken before the wait would not)."""
    import psycopg

    starts = 5
    FlowLock.objects.create(name="rate:rated")
    s = connection.settings_dict
    holder = psycopg.connect(
        f"host={s['HOST']} port={s['PORT']} dbname={s['NAME']} user={s['USER']}"
        + (f" password={s['PASSWORD']}" if s.get("PASSWORD") else "")
    )
    holder.execute("SELECT name FROM django_dbworker_flowlock WHERE name = 'rate:rated' FOR UPDATE")
    holder.execute(
        "INSERT INTO django_dbworker_ratestart (handler, started_at, count) "
        "VALUES ('rated', statement_timestamp(), %s)",
        [starts],
    )
    got: list[float | None] = []
    errors: list[BaseException] = []

    def taker() -> None:
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute(
                    f"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {level}"
                )
            got.append(take(starts=starts))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    thread = threading.Thread(target=taker)
    thread.start()

    def waiting() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query ILIKE '%%flowlock%%'"
            )
            return bool(cursor.fetchone()[0])

    from tests.conftest import wait_until

    wait_until(waiting, timeout=10, what="the taker to wait for the lock")
    holder.commit()  # the whole window, committed before the taker gets the lock
    holder.close()
    thread.join(30)
    assert not errors, errors
    assert got[0] is not None, "a start taken beyond a full window"
    assert RateStart.objects.aggregate(n=Sum("count"))["n"] == starts


def test_starts_dated_after_a_clock_step_back_hold_the_window_one_period_at_most() -> None:
    """The database's clock stepped back an hour (an NTP step, a restored VM, a failover):
    the last window's starts are dated an hour ahead. They count as now, and leave the
    window a period later, not when the clock catches up with them."""
    RateStart.objects.create(handler="rated", count=20)
    RateStart.objects.update(started_at=Now() + timedelta(hours=1))
    full_for = take(starts=20, period=1.0)
    assert full_for is not None and full_for <= 1.0 + 2 / RATE_BUCKETS + 0.1, full_for
    RateStart.objects.update(started_at=Now() - timedelta(seconds=2))
    assert take(starts=20, period=1.0) is None


def test_a_large_hourly_window_reads_a_bucket_a_row() -> None:
    """ "3600000/h": the window is counted in at most about a hundred rows, whatever its
    starts (a row per start made every take count millions of them)."""
    bucket = 3600.0 / RATE_BUCKETS  # 36 s of the grid

    def take_300() -> int:
        """The most buckets 300 takes can fill: those their time spans, plus the one
        they began in (a loaded machine takes longer than a bucket)."""
        began = time.monotonic()
        for _ in range(300):
            assert take(starts=3_600_000, period=3600.0) is None
        return int((time.monotonic() - began) // bucket) + 2

    spans = take_300()
    RateStart.objects.filter(handler="rated").update(started_at=Now() - timedelta(seconds=1800))
    spans += take_300()
    rows = RateStart.objects.filter(handler="rated")
    # A row per bucket (a row per start would be 600), and no start lost.
    assert rows.count() <= spans, (rows.count(), spans)
    assert rows.aggregate(n=Sum("count"))["n"] == 600


def test_a_full_window_leaves_rows_pending_without_using_an_attempt() -> None:
    from tests.testapp.workers import RatedSlowly, Record

    RatedSlowly.enqueue_many([{"key": f"r{i}"} for i in range(6)], priority=10)
    Record.enqueue_many([{"key": f"p{i}"} for i in range(20)])
    counts = run_until_empty(["rated_slowly", "record"])
    assert counts["succeeded"] == 22
    assert Execution.objects.filter(kind="rated_slowly").count() == 2
    assert Execution.objects.filter(kind="run").count() == 20
    waiting = WorkItem.objects.filter(handler="rated_slowly", status=Status.PENDING)
    assert waiting.count() == 4
    assert set(waiting.values_list("attempts", flat=True)) == {0}


def test_refused_starts_are_counted(background_worker) -> None:
    from prometheus_client import CollectorRegistry

    from django_dbworker.metrics import WorkerMetrics
    from django_dbworker.worker import Worker
    from tests.factories import worker_config
    from tests.testapp.workers import RatedSlowly

    RatedSlowly.enqueue_many([{"key": str(i)} for i in range(5)])
    reg = CollectorRegistry()
    worker = Worker([RatedSlowly], worker_config(burst=True), metrics=WorkerMetrics(reg))
    worker.run()
    assert Execution.objects.filter(kind="rated_slowly").count() == 2
    held = reg.get_sample_value(
        "worker_throttled_total", {"worker": "rated_slowly", "reason": "rate"}
    )
    assert held is not None and held >= 1
    pending = WorkItem.objects.filter(status=Status.PENDING)
    assert pending.count() == 3 and set(pending.values_list("attempts", flat=True)) == {0}


def test_a_burst_worker_waits_for_a_window_that_frees_up_soon(background_worker) -> None:
    """The loop wakes when the window frees up (not at its next poll only)."""
    from tests.conftest import wait_until
    from tests.testapp.workers import Rated

    Rated.enqueue_many([{"key": str(i)} for i in range(25)])
    background_worker(["rated"], concurrency=2, poll_interval=5.0, burst=True)
    wait_until(
        lambda: Execution.objects.filter(kind="rated").count() == 25,
        timeout=10,
        what="all 25 rated items to run despite a 5 s poll interval",
    )


# -- a busy process ------------------------------------------------------------------------
# A rate limit refuses only starts beyond it (SPEC "Flow control": "starts beyond the limit
# wait pending"), also on a busy worker process.
#
# A start is taken in the window just before the handler runs (``flow/rates.py``). In a
# worker whose other threads run Python code (CPU-bound handlers), each return from the
# database waits for Python's lock, and a take's return took 100-500 ms here: a start that
# is taken must run, however late, never be refused for it (refusing such starts livelocked
# a busy process: none of 10 ran in 15 s).

STOP = threading.Event()


class GenerousRate(WorkItemHandler):
    """Rate-limited far above what the test asks of it: its window never fills."""

    name = "generous_rate"
    rate_limit = "1000/s"

    def handle(self, payload: Any) -> None:
        return None


class Crunch(WorkItemHandler):
    """CPU-bound Python (a parser, a report): holds the GIL between switch intervals."""

    name = "crunch"

    def handle(self, payload: Any) -> None:
        deadline = time.monotonic() + float(payload["seconds"])
        while time.monotonic() < deadline and not STOP.is_set():
            sum(range(2000))


@pytest.fixture
def stopped_crunch() -> Any:
    STOP.clear()
    yield
    STOP.set()


def test_a_rated_handler_with_room_in_its_window_starts_beside_cpu_bound_neighbours(
    stopped_crunch: None,
) -> None:
    Crunch.enqueue_many([{"seconds": 600} for _ in range(3)], priority=10)
    GenerousRate.enqueue_many([{} for _ in range(10)])
    reg = CollectorRegistry()
    worker = Worker(
        [Crunch, GenerousRate], worker_config(concurrency=4), metrics=WorkerMetrics(reg)
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        done = WorkItem.objects.filter(handler=GenerousRate.name, status=Status.SUCCEEDED)

        def refused() -> float:
            return (
                reg.get_sample_value(
                    "worker_throttled_total", {"worker": GenerousRate.name, "reason": "rate"}
                )
                or 0.0
            )

        # The CPU-bound items run until the test ends, so every rated item runs beside
        # them, however slow the machine. A refused start is the fault (a livelocked
        # process refuses them over and over): it ends the wait at once.
        wait_until(
            lambda: done.count() == 10 or refused(),
            timeout=90,
            what="10 rated items (1000/s: room to spare) to run beside CPU-bound ones",
        )
        # Not one start was beyond the limit: none may be refused.
        assert not refused(), f"{refused():.0f} starts refused although the window had room"
    finally:
        STOP.set()
        worker.stop(immediate=True)
        thread.join(15)


# -- rows given back keep their place ------------------------------------------------------
# A rate-limited handler's rows start in claim order (priority, then ``run_after``, then id),
# window after window.
#
# Rate limits count starts (``flow/rates.py``): rows of a rated handler are claimed and
# buffered like any others, and those its full window refuses go back to pending. Going back
# must not move them behind the rows that were never claimed: with ``run_after`` reset to
# "now" at the give-back, the rows a window refused (the oldest of the backlog) wait until
# the whole backlog behind them has run.


def test_rows_refused_by_a_full_window_start_before_the_rows_behind_them(
    background_worker: Callable[..., Worker],
) -> None:
    items = Rated.enqueue_many([{"key": str(n)} for n in range(70)])
    order = [item.pk for item in items]  # one run_after for all: claim order is the id's
    # 20 starts a second; claims of 10 rows at most, so the backlog is claimed window by window.
    background_worker(["rated"], concurrency=2, batch_size=10)
    done = WorkItem.objects.filter(handler="rated", status=Status.SUCCEEDED)
    wait_until(lambda: done.count() == 70, timeout=20, what="the 70 rated rows to run")
    # The handler returns its start time (time.time()): the rows by when they started.
    started = sorted(done.values_list("result", "pk"))
    position = {pk: n for n, (_, pk) in enumerate(started)}
    # Two threads race for each start: one that waited for the start's lock (SQLite's
    # writer lock is not first come, first served; seen: 100 ms) finds the window taken by
    # the other and starts in the next one, up to a window's starts (20) and a claim (10)
    # late. A row given back behind the backlog would start about 50 places late; so would
    # one given back alone while the rows claimed after it stayed buffered and started first,
    # or one a claim skipped while it was being given back (seen: 36 places, PostgreSQL).
    late = {pk: position[pk] - n for n, pk in enumerate(order) if position[pk] - n > 30}
    assert not late, f"rows that started far behind their place in claim order: {late}"


# -- a clock stepped back ------------------------------------------------------------------
# A rate window counts each start once, also after the database's clock stepped back.
#
# ``take_start`` counts starts dated after the database's "now" (the clock stepped back: an
# NTP step, a restored VM, a failover to a lagging replica) as the current bucket's
# (``flow/rates.py``). Several buckets of the last window then share the current bucket's
# time: a start added to "the current bucket" must add one start, not one per row that now
# carries that time.


def _take(starts: int, period: float) -> float | None:
    return take_start(operations(), handler="rated", starts=starts, period=period)


def test_starts_after_a_clock_step_back_are_counted_once_each() -> None:
    # The last window's five buckets, one start each, dated 1 to 5 minutes ahead of the
    # database's clock (it stepped back five minutes; the period is an hour).
    for minutes in range(1, 6):
        row = RateStart.objects.create(handler="rated", count=1)
        RateStart.objects.filter(pk=row.pk).update(started_at=Now() + timedelta(minutes=minutes))
    taken = [_take(starts=100, period=3600.0) for _ in range(30)]
    total = RateStart.objects.filter(handler="rated").aggregate(n=Sum("count"))["n"]
    # 5 + 30 starts in a window of 100: every one taken, each counted once.
    assert taken.count(None) == 30, f"{30 - taken.count(None)} of 30 starts refused"
    assert total == 35, f"the window counts {total} starts for 35"
