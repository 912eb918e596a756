"""Where the operator verbs of ``models.py`` reach the layers above them.

``models.py`` imports nothing from the package above its declarations, yet
its verbs need the vendor's row locking (``QuerySet.cancel``), the READ
COMMITTED transaction of an ending, and what an ending sets off
(``completion``, ``dependencies``). ``DBWorkerConfig.ready`` plugs those in
here; until then each part is a no-op (or a plain ``atomic``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction

#: Locks rows of ``ids`` on alias ``using`` in ascending id order, for the
#: length of a ``with`` block (``connect_row_locker``; no-op until connected).
RowLocker = Callable[[str, Collection[int]], AbstractContextManager[None]]
row_locker: list[RowLocker] = [lambda using, ids: nullcontext()]


def connect_row_locker(locker: RowLocker) -> None:
    """Plug in the vendor's ``locked_in_id_order`` (``DBWorkerConfig.ready`` does)."""
    row_locker[:] = [locker]


@dataclass
class Endings:
    """What the operator verbs hand on, plugged in by ``DBWorkerConfig.ready``
    (``connect_endings``): the transaction an ending runs in (READ COMMITTED),
    what rows' endings set off (``completion.settle_rows``), and the parents a
    retried row waits for again (``dependencies.wait_again``)."""

    transaction: Callable[[str], AbstractContextManager[Any]] = field(
        default=lambda using: transaction.atomic(using=using)
    )
    settle: Callable[[str, list[int]], None] = field(default=lambda using, ids: None)
    settle_later: Callable[[str, list[int]], None] = field(default=lambda using, ids: None)
    rewait: Callable[[str, list[int]], None] = field(default=lambda using, ids: None)
    lock_parents: Callable[[str, list[int]], None] = field(default=lambda using, ids: None)


endings = Endings()


def connect_endings(**parts: Any) -> None:
    """Plug in the parts of ``Endings`` (``DBWorkerConfig.ready`` does)."""
    for name, part in parts.items():
        setattr(endings, name, part)


def settle_ended(db: str, linked: list[int], nested: bool) -> None:
    """What the rows an operator's verb ended set off; once more after the commit of a
    caller's transaction (``nested``), whose isolation level may be stricter."""
    if linked:
        endings.settle(db, linked)
        if nested:
            endings.settle_later(db, linked)
