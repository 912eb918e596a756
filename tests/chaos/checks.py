"""The invariants a chaos run must keep, checked from the database, logs and metrics.

Everything is read after the run: rows of ``WorkItem`` and the Effect side
table, each worker's log, and each worker's multiprocess metrics file. An
item whose lifetime overlapped an injected fault may legitimately have lost
attempts to it (a killed or frozen run counts as an attempt); an item no
fault touched must have run exactly as its handler dictates.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.chaos.faults import Injected
from tests.chaos.processes import WorkerProc
from tests.chaos.workload import (
    ATOMIC_HANDLERS,
    KEYED_HANDLER,
    Expectation,
    expect,
    stale_exhausted,
)

#: A fault's effects may start just before its recorded start and reach a bit
#: past its end (a reload signal, a reply in flight): its window is widened by these.
WINDOW_BEFORE = 0.2
WINDOW_AFTER = 1.0
FENCED_LINE = "Discarded the outcome of work item"
ITEM_IN_LOG = re.compile(r"work item (\d+) \(")


@dataclass
class Check:
    name: str
    violations: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass
class Outcome:
    checks: list[Check]
    statuses: Counter[str]
    observations: list[str]
    exempt: list[str]

    @property
    def violated(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


@dataclass
class Row:
    pk: int
    handler: str
    status: str
    attempts: int
    max_attempts: int
    payload: dict[str, Any]
    result: Any
    last_error: str
    claimed_by: str
    created_at: datetime
    finished_at: datetime | None
    expected: Expectation
    faults: list[Injected]
    #: Runs of this item that raised a database error: a fault's symptom by
    #: construction (the workload's handlers raise none of their own).
    db_error_runs: int = 0
    #: The row's claim token (its latest attempt's), as text.
    claim_token: str = ""

    @property
    def touched(self) -> bool:
        return bool(self.faults or self.db_error_runs)

    @property
    def fault_costs(self) -> int:
        """Attempts faults may have cost this item, at most."""
        return len(self.faults) + self.db_error_runs

    @property
    def n(self) -> int:
        return int(self.payload["n"])


class Evidence:
    """Log lines and handler runs that mention an item."""

    def __init__(self, procs: list[WorkerProc], run_dir: Path) -> None:
        self.lines: dict[int, list[str]] = defaultdict(list)
        for proc in procs:
            for line in proc.log().splitlines():
                match = ITEM_IN_LOG.search(line)
                if match:
                    self.lines[int(match.group(1))].append(f"[{proc.role}-{proc.seq}] {line}")
        self.runs: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for path in sorted((run_dir / "runs").glob("log-*.jsonl")):
            for text in path.read_text().splitlines():
                try:
                    event = json.loads(text)
                except ValueError:  # a line cut by SIGKILL
                    continue
                self.runs[(event["handler"], int(event["n"]))].append(event)
        self.pid_names = {p.pid: f"{p.role}-{p.seq}" for p in procs}

    def describe(self, row: Row, log_lines: int = 4) -> str:
        first = row.last_error.splitlines()[0] if row.last_error else ""
        extra = {k: v for k, v in row.payload.items() if k != "n"}
        out = [
            f"item {row.pk} ({row.handler} n={row.n}{' ' + json.dumps(extra) if extra else ''}): "
            f"{row.status}, attempts {row.attempts}/{row.max_attempts}"
            + (f", last_error {first[:160]!r}" if first else "")
            + (f", claimed_by {row.claimed_by}" if row.status == "claimed" else "")
            + (
                f"; faults during its life: {', '.join(f.fault for f in row.faults)}"
                if row.faults
                else ""
            )
            + (f"; {row.db_error_runs} run(s) raised a database error" if row.db_error_runs else "")
        ]
        runs = self._runs(row)
        if runs:
            out.append(f"    runs: {runs}")
        for line in self.lines.get(row.pk, [])[-log_lines:]:
            out.append(f"    log: {line[:300]}")
        return "\n".join(out)

    def _runs(self, row: Row) -> str:
        events = sorted(self.runs.get((row.handler, row.n), []), key=lambda e: e["t"])
        runs: dict[int, list[str]] = {}
        for e in events:
            stamp = datetime.fromtimestamp(e["t"]).strftime("%H:%M:%S.%f")[:-3]
            who = self.pid_names.get(e["pid"], str(e["pid"]))
            runs.setdefault(e["run"], []).append(f"{e['event']} {stamp} {who}")
        return "; ".join(f"#{n} " + ", ".join(parts) for n, parts in sorted(runs.items()))


def overlapping(created: float, finished: float, faults: list[Injected]) -> list[Injected]:
    return [
        f for f in faults if f.start - WINDOW_BEFORE <= finished and f.end + WINDOW_AFTER >= created
    ]


#: Exception class names of database errors (Django's, as handlers see them).
DB_ERRORS = frozenset(
    {"OperationalError", "InterfaceError", "InternalError", "DatabaseError", "ProgrammingError"}
)


def db_error(last_error: str) -> bool:
    """Whether a failure's first line names a database error (a fault's symptom here)."""
    first = last_error.split(":", 1)[0]
    return first.rsplit(".", 1)[-1] in DB_ERRORS


def load_rows(faults: list[Injected], now: float, evidence: Evidence) -> list[Row]:
    from django_dbworker.models import WorkItem

    rows = []
    for item in WorkItem.objects.order_by("pk"):
        created = item.created_at.timestamp()
        finished = item.finished_at.timestamp() if item.finished_at else now
        rows.append(
            Row(
                pk=item.pk,
                handler=item.handler,
                status=item.status,
                attempts=item.attempts,
                max_attempts=item.max_attempts,
                payload=item.payload,
                result=item.result,
                last_error=item.last_error,
                claimed_by=item.claimed_by,
                created_at=item.created_at,
                finished_at=item.finished_at,
                expected=expect(item.handler, item.payload, item.max_attempts),
                faults=overlapping(created, finished, faults),
                claim_token=str(item.claim_token),
                db_error_runs=sum(
                    1
                    for e in evidence.runs.get((item.handler, int(item.payload["n"])), [])
                    if e["event"] == "raised" and e.get("error") in DB_ERRORS
                ),
            )
        )
    return rows


def fenced_by_pid(metrics_dir: Path) -> dict[int, float]:
    """``worker_fenced_total`` per process, from the multiprocess counter files."""
    from prometheus_client.mmap_dict import MmapedDict

    totals: dict[int, float] = {}
    for path in metrics_dir.glob("counter_*.db"):
        pid = int(path.stem.split("_")[-1])
        total = 0.0
        for key, value, _timestamp, _pos in MmapedDict.read_all_values_from_file(str(path)):
            _metric, sample, _labels, _help = json.loads(key)
            if sample == "worker_fenced_total":
                total += value
        totals[pid] = total
    return totals


def check_all(
    *,
    enqueued: dict[int, int],
    faults: list[Injected],
    procs: list[WorkerProc],
    run_dir: Path,
    now: float,
) -> Outcome:
    from tests.chaos.models import Effect

    evidence = Evidence(procs, run_dir)
    rows = load_rows(faults, now, evidence)
    effects = Counter(Effect.objects.values_list("handler", "item_no"))
    checks: list[Check] = []
    exempt: list[str] = []

    present = Check("every enqueued item is in the table, and nothing else")
    in_table = {r.pk: r.n for r in rows}
    for pk, n in sorted(enqueued.items()):
        if in_table.get(pk) != n:
            present.violations.append(f"item {pk} (n={n}) enqueued but missing or changed")
    for pk in sorted(set(in_table) - set(enqueued)):
        present.violations.append(f"item {pk} in the table but never enqueued")
    checks.append(present)

    claimed = Check("no row is left claimed")
    unfinished = Check("every item reached a terminal status (no row left pending)")
    status = Check("every item ends with the status and reason its handler dictates")
    result = Check("every succeeded row holds its own handler's result")
    for row in rows:
        if row.status == "claimed":
            claimed.violations.append(evidence.describe(row))
            continue
        if row.status not in ("succeeded", "failed"):
            unfinished.violations.append(evidence.describe(row))
            continue
        exp = row.expected
        if exp.status == "succeeded":
            if row.status != "succeeded":
                if row.fault_costs + exp.designed_failures >= row.max_attempts:
                    exempt.append(f"lost to faults: {evidence.describe(row, 0)}")
                else:
                    status.violations.append(evidence.describe(row))
            elif row.result != exp.result:
                result.violations.append(
                    f"{evidence.describe(row, 0)}; result {row.result!r} != {exp.result!r}"
                )
        elif row.status != "failed":
            status.violations.append(evidence.describe(row))
        elif not row.last_error.startswith(exp.error_prefix):
            if row.touched and (stale_exhausted(row.last_error) or db_error(row.last_error)):
                exempt.append(f"lost to faults: {evidence.describe(row, 0)}")
            else:
                status.violations.append(
                    f"{evidence.describe(row)}\n    expected last_error to start with "
                    f"{exp.error_prefix!r}"
                )
    checks += [claimed, unfinished, status, result]

    atomic = Check("atomic handlers: exactly one effect row per succeeded item, none otherwise")
    for row in rows:
        count = effects.pop((row.handler, row.n), 0)
        wanted = 1 if row.handler in ATOMIC_HANDLERS and row.status == "succeeded" else 0
        if count != wanted:
            atomic.violations.append(
                f"{count} effect rows, expected {wanted}: {evidence.describe(row)}"
            )
    for (handler, n), count in sorted(effects.items()):
        atomic.violations.append(f"{count} effect rows for {handler} n={n}, which has no item")
    checks.append(atomic)

    bounded = Check("attempts never exceed max_attempts")
    for row in rows:
        if row.attempts > row.max_attempts:
            bounded.violations.append(evidence.describe(row))
    checks.append(bounded)

    exact = Check(
        "an item no fault touched ran exactly its designed attempts",
        note=f"fault windows widened by {WINDOW_BEFORE}s before and {WINDOW_AFTER}s after; "
        "a run that raised a database error counts as touched",
    )
    untouched = 0
    for row in rows:
        if row.touched or row.status not in ("succeeded", "failed"):
            continue
        untouched += 1
        wanted = row.expected.attempts
        if wanted is None:
            if not 1 <= row.attempts <= row.max_attempts:
                exact.violations.append(evidence.describe(row))
        elif row.attempts != wanted:
            exact.violations.append(f"{evidence.describe(row)}\n    designed attempts: {wanted}")
    exact.note += f"; {untouched} items checked"
    checks.append(exact)

    if any(row.handler == KEYED_HANDLER for row in rows):
        checks += _check_keys(rows, evidence, procs)
    checks.append(_check_fenced(procs, run_dir))
    checks += _check_processes(procs)

    statuses = Counter(r.status for r in rows)
    return Outcome(checks, statuses, observations(procs, faults), exempt)


def _check_keys(rows: list[Row], evidence: Evidence, procs: list[WorkerProc]) -> list[Check]:
    """Keyed mode: each item succeeded by one run; the runs holding one key's slot never overlap.

    A run held its key's slot from its start until it returned, if it was
    the attempt the row succeeded with (the row's claim token), or until
    its worker died, if it never returned (SIGKILL). Other runs (an attempt
    fenced out after stale recovery while it still ran) held no slot:
    recovery had freed it, by design.
    """
    once = Check("keyed: every item succeeded, by exactly one run of its final attempt")
    overlap = Check("keyed: runs that held one key's slot never overlap in time")
    died = {p.pid: p.ended for p in procs if p.ended is not None}
    slots: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for row in rows:
        if row.handler != KEYED_HANDLER:
            continue
        events = evidence.runs.get((row.handler, row.n), [])
        by_run: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
        for event in events:
            by_run[int(event["run"])][event["event"]] = event
        final = [
            r
            for r in by_run.values()
            if "returned" in r and r["returned"]["token"] == row.claim_token
        ]
        if row.status != "succeeded" or len(final) != 1:
            once.violations.append(
                f"{evidence.describe(row)}\n    {len(final)} returned run(s) of its final attempt"
            )
        key = str(row.payload["key"])
        for run, parts in sorted(by_run.items()):
            start = parts.get("start")
            if start is None:
                continue
            label = (
                f"item {row.pk} run {run} ({evidence.pid_names.get(start['pid'], start['pid'])})"
            )
            if "returned" in parts and parts["returned"]["token"] == row.claim_token:
                slots[key].append((float(start["t"]), float(parts["returned"]["t"]), label))
            elif not ({"returned", "raised"} & set(parts)) and start["pid"] in died:
                slots[key].append((float(start["t"]), float(died[start["pid"]] or 0), label))
    for key, spans in sorted(slots.items()):
        spans.sort()
        latest_end, holder = float("-inf"), ""
        for start, end, label in spans:
            if start < latest_end:
                overlap.violations.append(
                    f"key {key}: {label} started {latest_end - start:.3f}s before {holder} ended"
                )
            if end > latest_end:
                latest_end, holder = end, label
    overlap.note = f"{sum(len(v) for v in slots.values())} slot-holding runs over {len(slots)} keys"
    return [once, overlap]


def _check_fenced(procs: list[WorkerProc], run_dir: Path) -> Check:
    check = Check("worker_fenced_total equals the 'Discarded the outcome' log lines")
    metrics = fenced_by_pid(run_dir / "metrics")
    total_metric = total_lines = 0.0
    for proc in procs:
        lines = proc.log().count(FENCED_LINE)
        counted = metrics.get(proc.pid, 0.0)
        total_metric += counted
        total_lines += lines
        if lines == counted:
            continue
        # SIGKILL may land between the log line and the increment that follows it.
        if proc.ending == "sigkill" and lines - counted == 1:
            continue
        fenced = [ln for ln in proc.log().splitlines() if FENCED_LINE in ln]
        check.violations.append(
            f"{proc.name}: {lines} log lines, worker_fenced_total {counted:g}"
            + "".join(f"\n    log: {ln[:300]}" for ln in fenced[-6:])
        )
    check.note = f"total: {total_lines:g} log lines, worker_fenced_total {total_metric:g}"
    return check


def _check_processes(procs: list[WorkerProc]) -> list[Check]:
    stops = Check("workers exit on SIGTERM within SHUTDOWN_TIMEOUT (plus margin)")
    burst = Check("run_workers --burst exits by itself once nothing is claimable")
    for proc in procs:
        if proc.role == "worker" and proc.ending == "forced":
            stops.violations.append(f"{proc.name} still ran; log tail:\n{_indent(proc.log_tail())}")
        if proc.role == "burst" and proc.ending in ("sigterm", "forced"):
            burst.violations.append(
                f"{proc.name} was still running at its deadline and was stopped with SIGTERM "
                f"(exit {proc.returncode}); log tail:\n{_indent(proc.log_tail())}"
            )
    return [stops, burst]


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())


KILLED_CONNECTION = "terminating connection due to administrator command"


def observations(procs: list[WorkerProc], faults: list[Injected]) -> list[str]:
    """What the logs say about the workers' health: facts for the report, not verdicts."""
    notes = []
    kills = sorted(f.end for f in faults if f.fault == "kill_connections")
    for proc in procs:
        lines = proc.log().splitlines()
        stale_conn = [ln for ln in lines if "failed attempt" in ln and KILLED_CONNECTION in ln]
        if stale_conn:
            delays = [_since_last(ln, kills) for ln in stale_conn]
            known = [d for d in delays if d is not None]
            notes.append(
                f"{proc.name}: {len(stale_conn)} handler attempt(s) failed with "
                f"{KILLED_CONNECTION!r} (a connection killed while idle, then handed to a job)"
                + (f", up to {max(known):.1f}s after the kill" if known else "")
            )
        for i, line in enumerate(lines):
            if line.startswith("Exception in thread"):
                error = _exception_line(lines, i + 1)
                notes.append(f"{proc.name}: {line.rstrip(':')}: {error}")
        unexpected = [
            i for i, ln in enumerate(lines) if "Unexpected error in a worker thread" in ln
        ]
        if unexpected:
            errors = Counter(_exception_line(lines, i + 1) for i in unexpected)
            notes.append(
                f"{proc.name}: {len(unexpected)} x 'Unexpected error in a worker thread': "
                + "; ".join(f"{n} x {e}" for e, n in errors.most_common(3))
            )
        lost = sum("Lost the claim on work item" in ln for ln in lines)
        released = [ln.split(": ", 1)[-1] for ln in lines if "unfinished work item(s)" in ln]
        if lost:
            notes.append(f"{proc.name}: {lost} x 'Lost the claim on work item'")
        for text in released:
            notes.append(f"{proc.name}: {text}")
    return notes


def _since_last(line: str, kills: list[float]) -> float | None:
    """Seconds from the last kill_connections before a log line (logs show HH:MM:SS.mmm)."""
    try:
        clock = datetime.strptime(line.split(" ", 1)[0], "%H:%M:%S.%f").time()
    except ValueError:
        return None
    for end in reversed(kills):
        when = datetime.combine(datetime.fromtimestamp(end).date(), clock).timestamp()
        if when >= end:
            return when - end
    return None


LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} pid=")
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Exit|Interrupt|Warning|Fail\w*)\b.*: ")


def _exception_line(lines: list[str], start: int) -> str:
    """The last ``Type: message`` line of the traceback that starts at ``start``.

    The last one is what was finally raised ("During handling of the above
    exception, another exception occurred" puts the original first).
    """
    found = "(no exception line found)"
    for line in lines[start : start + 400]:
        if LOG_LINE.match(line) or line.startswith("Exception in thread"):
            break
        if EXCEPTION_LINE.match(line):
            found = line[:200]
    return found
