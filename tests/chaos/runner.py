"""The chaos runner: a bounded workload, real workers, injected faults, checked invariants.

    python -m tests.chaos.runner --duration 50 --workers 3 --seed 1234   # short mode
    python -m tests.chaos.runner --duration 1800 --workers 4             # long mode

Starts its own throwaway PostgreSQL (scripts/pgcluster.py), migrates it,
enqueues a seeded workload, starts ``--workers`` ``run_workers`` processes,
injects faults for ``--duration`` seconds (every fault at least once, then
at random), lets a fault-free tail of work run, stops the workers with
SIGTERM, finishes leftovers with ``run_workers --burst``, checks the
invariants (``checks.py``) and prints a report. The cluster is stopped
whatever happens. Exit status: 0 all invariants hold, 1 a violation,
2 the harness itself failed. Logs, run counters and metrics files stay in
``--run-dir`` (default ``.tmp/chaos/<time>-seed<seed>``).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from tests.chaos.faults import FAULTS, WHAT, Cluster, FaultInjector, Injected
from tests.chaos.processes import ROOT, WorkerSet
from tests.chaos.workload import HANDLERS, KEYED_HANDLER, make_item, make_keyed_item

STALE_AFTER = 3.0  # tests.chaos.settings.STALE_AFTER, readable before Django is set up
SHUTDOWN_TIMEOUT = 5.0
RETRY_BACKOFF_MAX = 2.0
STEP = 0.5  # seconds between trickle enqueues and liveness checks


class Interrupted(Exception):
    """SIGTERM or SIGINT reached the runner: clean up and exit."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.runner",
        description="Run django-dbworker workers under injected faults and check invariants.",
    )
    parser.add_argument("--duration", type=float, default=50.0, help="seconds of faults")
    parser.add_argument("--workers", type=int, default=3, help="run_workers processes")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed")
    parser.add_argument("--concurrency", type=int, default=4, help="threads per worker")
    parser.add_argument("--initial", type=int, default=60, help="items enqueued at the start")
    parser.add_argument("--rate", type=float, default=3.0, help="items per second afterwards")
    parser.add_argument(
        "--tail", type=float, default=10.0, help="fault-free seconds of work after the faults"
    )
    parser.add_argument("--gap", type=float, nargs=2, default=(2.0, 4.0), metavar=("MIN", "MAX"))
    parser.add_argument(
        "--faults",
        type=_fault_list,
        default=FAULTS,
        help=f"comma-separated subset of {','.join(FAULTS)}, or 'none' (default: all)",
    )
    parser.add_argument(
        "--keyed",
        type=int,
        default=0,
        metavar="KEYS",
        help="keyed mode: only items of a concurrency_limit = 1 handler over KEYS keys, "
        "checked for runs of one key that overlap (default: 0, the mixed workload)",
    )
    parser.add_argument("--run-dir", type=Path, default=None)
    return parser.parse_args(argv)


def _fault_list(text: str) -> tuple[str, ...]:
    if text == "none":
        return ()
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in FAULTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault(s) {', '.join(unknown)}")
    return names


class Runner:
    def __init__(self, args: argparse.Namespace, seed: int, run_dir: Path) -> None:
        self.args = args
        self.seed = seed
        self.run_dir = run_dir
        self.items_rng = random.Random(f"{seed}-items")
        self.faults_rng = random.Random(f"{seed}-faults")
        self.cluster = Cluster(run_dir / "pg.json")
        self.workers: WorkerSet | None = None
        self.injector: FaultInjector | None = None
        self.injected: list[Injected] = []
        self.enqueued: dict[int, int] = {}  # pk -> item number
        self.next_n = 1
        self.trickle_debt = 0.0
        self.unexpected_exits: list[str] = []
        self.phases: dict[str, float] = {}
        self._phase_started = time.monotonic()

    # -- phases -------------------------------------------------------------------

    def phase(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = now - self._phase_started
        self._phase_started = now

    def run(self) -> int:
        self.setup()
        self.phase("setup")
        self.fault_phase()
        self.phase("faults")
        self.pause(self.args.tail, trickle=True)
        self.phase("tail")
        self.settle()
        self.phase("settle")
        assert self.workers is not None
        self.workers.stop(self.workers.live(), SHUTDOWN_TIMEOUT + 10)
        self.phase("stop")
        self.finish_with_burst()
        self.phase("burst")
        from tests.chaos.checks import check_all

        outcome = check_all(
            enqueued=self.enqueued,
            faults=self.injected,
            procs=self.workers.procs,
            run_dir=self.run_dir,
            now=time.time(),
        )
        self.phase("checks")
        report = self.report(outcome)
        print(report, flush=True)
        (self.run_dir / "report.txt").write_text(report + "\n")
        return 1 if outcome.violated else 0

    def setup(self) -> None:
        url = self.cluster.start()
        env = dict(os.environ)
        env.update(
            DJANGO_SETTINGS_MODULE="tests.chaos.settings",
            CHAOS_DATABASE_URL=url,
            CHAOS_RUN_DIR=str(self.run_dir),
            PROMETHEUS_MULTIPROC_DIR=str(self.run_dir / "metrics"),
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            PYTHONUNBUFFERED="1",
        )
        worker_env = {**env, "CHAOS_ROLE": "worker"}
        runner_env = {**env, "CHAOS_ROLE": "runner"}
        runner_env.pop("PROMETHEUS_MULTIPROC_DIR")
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
            cwd=ROOT,
            env=runner_env,
            check=True,
            timeout=120,
        )
        os.environ.update(runner_env)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        import django

        django.setup()
        from django.conf import settings

        assert float(settings.DBWORKER["STALE_AFTER"]) == STALE_AFTER
        self.workers = WorkerSet(
            handlers=(KEYED_HANDLER,) if self.args.keyed else HANDLERS,
            concurrency=self.args.concurrency,
            env=worker_env,
            log_dir=self.run_dir / "logs",
        )
        self.enqueue(self.args.initial)
        started = [self.workers.start() for _ in range(self.args.workers)]
        self.workers.wait_started(started, timeout=60)
        self.injector = FaultInjector(
            cluster=self.cluster,
            workers=self.workers,
            rng=self.faults_rng,
            stale_after=STALE_AFTER,
            execute_sql=self.sql,
            worker_application_name=settings.WORKER_APPLICATION_NAME,
            on_replaced=lambda old, new: None,
        )

    def fault_phase(self) -> None:
        assert self.injector is not None
        chosen = tuple(self.args.faults)
        mandatory = list(chosen)
        self.faults_rng.shuffle(mandatory)
        end = time.monotonic() + self.args.duration
        while mandatory or time.monotonic() < end:
            self.pause(self.faults_rng.uniform(*self.args.gap), trickle=True)
            if not chosen:
                continue  # --faults none: a baseline run, only the workload
            if not mandatory and time.monotonic() >= end:
                break
            fault = mandatory.pop(0) if mandatory else self.faults_rng.choice(chosen)
            record = self.injector.inject(fault)
            self.injected.append(record)
            print(
                f"[chaos] {_clock(record.start)} {fault}: {record.detail}",
                file=sys.stderr,
                flush=True,
            )

    def settle(self, timeout: float = 40.0, quiet: float = 8.0) -> None:
        """Wait until every item is terminal, or nothing changed for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        last: Any = None
        changed = time.monotonic()
        while time.monotonic() < deadline:
            self.watch_workers()
            signature = self.progress()
            if signature[0] == 0:
                return
            if signature != last:
                last, changed = signature, time.monotonic()
            elif time.monotonic() - changed >= quiet:
                return
            time.sleep(STEP)

    def finish_with_burst(self, budget: float = 45.0, round_timeout: float = 20.0) -> None:
        """Run ``run_workers --burst`` until nothing is left, it hangs, or the budget ends."""
        assert self.workers is not None
        deadline = time.monotonic() + budget
        for _ in range(4):
            if self.progress()[0] == 0 or time.monotonic() >= deadline:
                return
            self.wait_claimable(timeout=STALE_AFTER + RETRY_BACKOFF_MAX + 2)
            burst = self.workers.start("burst", ["--burst"])
            limit = max(1.0, min(round_timeout, deadline - time.monotonic()))
            if burst.wait(limit) is None:
                # It did not finish by itself: stop it in order (releasing its rows)
                # and do not start another that would hang the same way.
                self.workers.stop([burst], SHUTDOWN_TIMEOUT + 10)
                return
            burst.ending = "exited"

    # -- steps --------------------------------------------------------------------

    def pause(self, seconds: float, *, trickle: bool) -> None:
        """The schedule's deliberate pause, spent trickling items and watching workers."""
        end = time.monotonic() + seconds
        while True:
            self.watch_workers()
            left = end - time.monotonic()
            if left <= 0:
                return
            step = min(STEP, left)
            time.sleep(step)
            if trickle:
                self.trickle_debt += self.args.rate * step
                count = int(self.trickle_debt)
                if count:
                    self.trickle_debt -= count
                    self.enqueue(count)

    def enqueue(self, count: int) -> None:
        from django_dbworker import enqueue_many

        keys = self.args.keyed
        by_handler: dict[tuple[str, str | None], list[dict[str, Any]]] = {}
        for _ in range(count):
            if keys:
                handler, payload = make_keyed_item(self.items_rng, self.next_n, STALE_AFTER, keys)
            else:
                handler, payload = make_item(self.items_rng, self.next_n, STALE_AFTER)
            by_handler.setdefault((handler, payload.get("key")), []).append(payload)
            self.next_n += 1
        for (handler, key), payloads in by_handler.items():
            for item in enqueue_many(handler, payloads, concurrency_key=key):
                self.enqueued[item.pk] = int(item.payload["n"])

    def watch_workers(self) -> None:
        """Replace a worker that exited by itself (a crash, or one that gave up)."""
        assert self.workers is not None
        for proc in self.workers.procs:
            if proc.role == "worker" and not proc.ending and proc.poll() is not None:
                proc.ending = "exited"
                self.unexpected_exits.append(
                    f"{proc.name} exited by itself with {proc.returncode} at "
                    f"{_clock(proc.ended or 0)}; log tail:\n{_indent(proc.log_tail(8))}"
                )
                self.workers.start()

    def progress(self) -> tuple[Any, ...]:
        """(non-terminal rows, status counts, attempts, last update): changes while work runs."""
        rows = self.sql(
            "SELECT count(*) FILTER (WHERE status IN ('pending', 'claimed')), "
            "count(*) FILTER (WHERE status = 'succeeded'), "
            "count(*) FILTER (WHERE status = 'failed'), "
            "coalesce(sum(attempts), 0), max(updated_at) FROM django_dbworker_workitem"
        )
        return tuple(rows[0])

    def wait_claimable(self, timeout: float) -> None:
        """Until every unfinished row is due or stale (by the database clock), bounded."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            waiting = self.sql(
                "SELECT count(*) FROM django_dbworker_workitem WHERE "
                "(status = 'pending' AND run_after > now()) OR "
                "(status = 'claimed' AND heartbeat_at >= now() - %s * interval '1 second')",
                (STALE_AFTER,),
            )[0][0]
            if not waiting:
                return
            time.sleep(0.2)

    def sql(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(statement, params)
            return list(cursor.fetchall()) if cursor.description else []

    # -- cleanup and report ------------------------------------------------------------

    def cleanup(self) -> None:
        """Leave nothing running: thaw, writable again, workers killed, cluster stopped."""
        errors = []
        self.cluster.thaw_all()
        if self.workers is not None:
            self.workers.kill_all()
        if self.injector is not None and self.injector.is_read_only:
            try:
                self.injector.set_read_only(False)
            except Exception as exc:  # the cluster is removed next anyway
                errors.append(f"resetting read-only: {exc}")
        try:
            from django.db import connections

            connections.close_all()
        except Exception as exc:
            errors.append(f"closing connections: {exc}")
        self.cluster.stop()
        for error in errors:
            print(f"[chaos] cleanup: {error}", file=sys.stderr)

    def report(self, outcome: Any) -> str:
        assert self.workers is not None
        args = self.args
        lines = [
            f"== chaos run, seed {self.seed}: reproduce with python -m tests.chaos.runner "
            f"--duration {args.duration:g} --workers {args.workers} --seed {self.seed}"
            + (
                ""
                if tuple(args.faults) == FAULTS
                else f" --faults {','.join(args.faults) or 'none'}"
            ),
            f"run dir: {self.run_dir}",
            "phases: "
            + ", ".join(f"{k} {v:.1f}s" for k, v in self.phases.items())
            + f"; total {sum(self.phases.values()):.1f}s",
            "faults injected:",
        ]
        counts = Counter(f.fault for f in self.injected)
        for fault in FAULTS:
            lines.append(f"  {fault:<17} {counts[fault]:>3}  ({WHAT[fault]})")
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(outcome.statuses.items()))
        lines.append(f"items: {len(self.enqueued)} enqueued; {statuses}")
        lines.append("workers:")
        for proc in self.workers.procs:
            lines.append(
                f"  {proc.name:<26} ended by {proc.ending or '?':<8} exit {proc.returncode}"
            )
        for text in self.unexpected_exits:
            lines.append(f"  unexpected: {text}")
        lines.append("invariants:")
        for check in outcome.checks:
            mark = " OK " if check.ok else "FAIL"
            extra = f" ({len(check.violations)} violations)" if check.violations else ""
            note = f" [{check.note}]" if check.note else ""
            lines.append(f"  [{mark}] {check.name}{extra}{note}")
            for violation in check.violations[:12]:
                lines.append(_indent(violation, "      "))
            if len(check.violations) > 12:
                lines.append(f"      ... and {len(check.violations) - 12} more")
        if outcome.exempt:
            handlers = Counter(re.findall(r"\((chaos_\w+) n=", "\n".join(outcome.exempt)))
            lines.append(
                f"items whose attempts faults used up (not violations): {len(outcome.exempt)} ("
                + ", ".join(f"{h} {n}" for h, n in handlers.most_common())
                + ")"
            )
            lines += [_indent(text, "  ") for text in outcome.exempt[:10]]
        if outcome.observations:
            lines.append("observations from the worker logs:")
            lines += [f"  {text}" for text in outcome.observations]
        violated = len(outcome.violated)
        lines.append(
            f"result: {violated} of {len(outcome.checks)} invariants violated (seed {self.seed})"
            if violated
            else f"result: all {len(outcome.checks)} invariants hold (seed {self.seed})"
        )
        return "\n".join(lines)


def _clock(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%H:%M:%S.%f")[:-3]


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (args.run_dir or ROOT / ".tmp" / "chaos" / f"{stamp}-seed{seed}").resolve()
    for sub in ("logs", "runs", "metrics"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    print(f"[chaos] seed {seed}; run dir {run_dir}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    runner = Runner(args, seed, run_dir)
    try:
        return runner.run()
    except Interrupted as exc:
        print(f"[chaos] interrupted by {exc}; cleaning up (seed {seed})", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print(f"[chaos] the harness failed (seed {seed}); logs in {run_dir}", file=sys.stderr)
        return 2
    finally:
        runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
