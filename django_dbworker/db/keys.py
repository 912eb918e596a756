"""The keyed claim's decisions that the vendors share (per-key concurrency limits).

A candidate row of a keyed claim fits while its (handler, concurrency_key) holds fewer
claimed rows than its handler's current limit; the MySQL claim locks a ``FlowLock`` row
per key, named here. Plain Python over the rows a vendor's statements read: no SQL.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

#: A claim candidate of the keyed claim: ``(id, handler, concurrency_key,
#: concurrency_limit)``, as the vendors' candidate statements return it.
Candidate = tuple[int, str, str | None, int | None]

FLOW_LOCK_NAME_MAX = 255  # FlowLock.name's width


def flow_lock_name(handler: str, key: str) -> str:
    """The ``FlowLock`` row that serialises the claims of one (handler, concurrency_key).

    Readable when it fits the column, a digest otherwise. Pairs that share a
    name (``"a:b"``/``"c"``, ``"a"``/``"b:c"``) only share a lock, not counts.
    """
    name = f"key:{handler}:{key}"
    if len(name) <= FLOW_LOCK_NAME_MAX:
        return name
    digest = hashlib.sha256(f"{handler}\0{key}".encode()).hexdigest()
    return f"key#{digest}"


def current_limits(candidates: Sequence[Candidate], limits: Mapping[str, int]) -> list[Candidate]:
    """``candidates`` with each keyed row's limit its handler's current one (None: unlimited)."""
    return [(pk, h, key, None if key is None else limits.get(h)) for pk, h, key, _ in candidates]


def within_limits(
    candidates: Sequence[Candidate],
    held: dict[tuple[str, str], int],
    keyed_cap: int | None = None,
) -> tuple[list[int], int]:
    """The ids to claim of ``candidates`` (in claim order), and how many are held back.

    ``held``: claimed rows per (handler, key), counted under the keys' locks.
    A candidate without a limit is taken; one with a limit (its handler's
    current one) while its key holds fewer rows, counting those taken before,
    and while fewer than ``keyed_cap`` such rows were taken (None: no cap).
    """
    taken: dict[tuple[str, str], int] = {}
    ids: list[int] = []
    throttled = keyed = 0
    for pk, handler, key, limit in candidates:
        if key is None or limit is None:
            ids.append(pk)
            continue
        slot = (handler, key)
        used = held.get(slot, 0) + taken.get(slot, 0)
        if used < limit and (keyed_cap is None or keyed < keyed_cap):
            taken[slot] = taken.get(slot, 0) + 1
            keyed += 1
            ids.append(pk)
        else:
            throttled += 1
    return ids, throttled


def capped(candidates: Sequence[Candidate], keyed_cap: int | None) -> list[Candidate]:
    """``candidates`` without the keyed ones past the first ``keyed_cap`` (None: all)."""
    if keyed_cap is None:
        return list(candidates)
    kept: list[Candidate] = []
    keyed = 0
    for candidate in candidates:
        if candidate[2] is not None and candidate[3] is not None:
            if keyed >= keyed_cap:
                continue
            keyed += 1
        kept.append(candidate)
    return kept
