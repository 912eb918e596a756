"""What a cross-process wake-up says: the queue of the committed rows, and their priority.

PostgreSQL's NOTIFY carries a text payload: the queue name alone for rows
of priority 0 (what every version of this package has sent), else
``"<queue> <priority>"`` (a queue name holds no space). Workers use the
priority to claim an urgent row ahead of the bulk work they have
buffered (``worker/claim_loop.py``). Held here, once, for both ends.
"""

from __future__ import annotations


def wake_payload(queue: str, priority: int = 0) -> str:
    return queue if priority == 0 else f"{queue} {priority}"


def parse_wake_payload(payload: str) -> tuple[str, int]:
    """``(queue, priority)``; a payload that names no valid priority announces 0."""
    queue, _, priority = payload.partition(" ")
    try:
        return queue, int(priority) if priority else 0
    except ValueError:
        return queue, 0
