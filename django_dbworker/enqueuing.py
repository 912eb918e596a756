"""Putting work in the table: validation, transactional insert, wake-up.

Enqueue writes through the caller's connection, so inside
``transaction.atomic()`` the row exists if and only if that transaction
commits; the PostgreSQL wake-up NOTIFY is transactional too. Every input
is validated before anything is written, and problems raise
``EnqueueError`` naming the problem (the options' checks are
``enqueue_options.EnqueueOptions``'s), never quoting the payload: that
includes the text no database stores (NUL, lone surrogates), which would
otherwise come back as a database error quoting the row. For a
``sensitive`` handler, a database error of the write itself reaches the
caller and the span with its text withheld. The row goes to the routers'
write alias unless ``using`` says otherwise (``routing.py``).

The public functions take the options as keywords and pass one
``EnqueueOptions`` on: ``insert_one`` and ``insert_many`` are what the
``WorkItemHandler`` class methods (through the port in ``handlers.py``) and
the Tasks backend call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, IntegrityError, connections, transaction
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init

from django_dbworker import tracing
from django_dbworker.batches import dependencies
from django_dbworker.batches.context import current_batch_id
from django_dbworker.db import operations, setup_problem
from django_dbworker.enqueue_options import EnqueueOptions
from django_dbworker.errors import DatabaseNotReady, EnqueueError
from django_dbworker.errortext import exception_class_path
from django_dbworker.flow.fair import register_key
from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import ACTIVE_STATUSES, Status, WorkItem
from django_dbworker.payloads import encode_payload
from django_dbworker.registry import registry
from django_dbworker.routing import warn_if_outside_transaction, work_db_for_write

#: A unique_key conflict whose holder finishes before we can read it is retried this often.
UNIQUE_RETRIES = 5


def _handler_class(name: str | type[WorkItemHandler]) -> type[WorkItemHandler]:
    if isinstance(name, type) and issubclass(name, WorkItemHandler):
        name = name.name
    if not isinstance(name, str):
        raise EnqueueError(f"Handler must be a registered name, got {type(name).__name__}.")
    cls = registry.get(name)
    if cls is None:
        known = ", ".join(sorted(registry)) or "none"
        raise EnqueueError(f"Unknown handler {name!r}. Registered handlers: {known}.")
    if not issubclass(cls, WorkItemHandler):
        raise EnqueueError(
            f"Handler {name!r} is a {cls.__mro__[1].__name__}, not a WorkItemHandler; "
            "only WorkItemHandlers take enqueued work."
        )
    return cls


#: Per concrete field, in order: its attname, and its default as a value to
#: share or as a function to call per instance. Built on first use.
_DEFAULTS: list[tuple[str, Any, Callable[[], Any] | None]] | None = None


def _defaults() -> list[tuple[str, Any, Callable[[], Any] | None]]:
    global _DEFAULTS
    if _DEFAULTS is None:
        plan: list[tuple[str, Any, Callable[[], Any] | None]] = []
        for field in WorkItem._meta.concrete_fields:
            if field.has_default() and callable(field.default):
                # trace_context's dict: each instance gets its own, as in Model.__init__.
                plan.append((field.attname, None, field.get_default))
            else:
                # A plain default is one shared object in Model.__init__ too. A
                # db_default is a DatabaseDefault expression, new per instance
                # there; one per field is shared here: Django copies expressions
                # when it compiles them and never changes them in place, and
                # enqueue replaces them (with the inserted values, or by
                # deferring the field) before the item is returned.
                plan.append((field.attname, field.get_default(), None))
        _DEFAULTS = plan  # one assignment: threads racing here build equal plans
    return _DEFAULTS


def _new_item(values: dict[str, Any]) -> WorkItem:
    """``WorkItem(**values)`` for a fraction of the cost; see ``_item_maker``."""
    item = WorkItem.__new__(WorkItem)
    item._state = ModelState()
    attributes = item.__dict__
    for attname, default, make_default in _defaults():
        if attname in values:
            attributes[attname] = values[attname]
        elif make_default is not None:
            attributes[attname] = make_default()
        else:
            attributes[attname] = default
    return item


def _model_constructor(values: dict[str, Any]) -> WorkItem:
    return WorkItem(**values)


def _item_maker() -> Callable[[dict[str, Any]], WorkItem]:
    """How to build unsaved items now: ``WorkItem(**values)`` or its fast twin.

    ``Model.__init__`` takes about 13 µs for this model (a keyword lookup and
    a default per field), the largest Python cost per item of
    ``enqueue_many``; ``_new_item`` sets the same attributes in the same
    order in about 2 µs. With a listener on ``pre_init`` or ``post_init``
    the real constructor runs, so the signals still fire.
    """
    if pre_init.has_listeners(WorkItem) or post_init.has_listeners(WorkItem):
        return _model_constructor
    return _new_item


def _build(
    cls: type[WorkItemHandler], payload: Any, options: EnqueueOptions, db: str
) -> tuple[WorkItem, str, dict[str, Any]]:
    """A validated, unsaved item, its payload as JSON text, and its values but the payload.

    ``enqueue_many`` builds the other items of a batch from those values
    (``_sibling``): the options every item shares are validated once.
    """
    encoded = encode_payload(payload, max_depth=operations(db).max_json_depth)
    values = {"handler": cls.name, **options.columns(cls)}
    item = _item_maker()({**values, "payload": payload})
    value = options.run_after_value()
    if value is not None:
        item.run_after = value
    return item, encoded, values


def _sibling(
    make: Callable[[dict[str, Any]], WorkItem],
    values: dict[str, Any],
    payload: Any,
    options: EnqueueOptions,
) -> WorkItem:
    """What ``_build`` makes for ``payload`` with the ``values`` it returned for the first."""
    item = make({**values, "payload": payload, "unique_key": None})
    value = options.run_after_value()
    if value is not None:
        item.run_after = value
    return item


@contextmanager
def _autocommit(using: str) -> Iterator[None]:
    """What ``atomic()`` is for one statement in autocommit: nothing to open or commit."""
    yield


def _forget_expressions(item: WorkItem) -> None:
    """Turn fields saved from SQL expressions into deferred fields.

    After ``save()`` such attributes still hold the expression, not the value
    the database computed; deferring them makes the first access load it.
    """
    for name in ("run_after", "created_at", "updated_at"):
        if not isinstance(item.__dict__.get(name), datetime):
            item.__dict__.pop(name, None)


def enqueue(
    handler: str | type[WorkItemHandler],
    payload: Any = None,
    *,
    run_after: datetime | timedelta | None = None,
    priority: int = 0,
    queue: str | None = None,
    unique_key: str | None = None,
    max_attempts: int | None = None,
    concurrency_key: str | None = None,
    fair_key: str | None = None,
    using: str | None = None,
    after: Iterable[WorkItem | int] | None = None,
) -> WorkItem:
    """Insert one work item; returns it (or, for a live ``unique_key``, the existing row).

    ``max_attempts`` overrides the handler's for this item; ``after``: it runs
    once these items (or ids) succeeded. The options are described in
    ``enqueue_options.EnqueueOptions``.
    """
    options = EnqueueOptions(
        run_after=run_after,
        priority=priority,
        queue=queue,
        unique_key=unique_key,
        max_attempts=max_attempts,
        concurrency_key=concurrency_key,
        fair_key=fair_key,
        using=using,
        after=after,
    )
    return insert_one(handler, payload, options)[0]


async def aenqueue(
    handler: str | type[WorkItemHandler],
    payload: Any = None,
    *,
    run_after: datetime | timedelta | None = None,
    priority: int = 0,
    queue: str | None = None,
    unique_key: str | None = None,
    max_attempts: int | None = None,
    concurrency_key: str | None = None,
    fair_key: str | None = None,
    using: str | None = None,
    after: Iterable[WorkItem | int] | None = None,
) -> WorkItem:
    """``enqueue`` from async code, with the same arguments.

    The insert runs on Django's thread for sync database work
    (``sync_to_async``): an async view has no transaction of its own to
    join, so the row commits at once (docs/topics/async.md).
    """
    from asgiref.sync import sync_to_async

    return await sync_to_async(enqueue)(
        handler,
        payload,
        run_after=run_after,
        priority=priority,
        queue=queue,
        unique_key=unique_key,
        max_attempts=max_attempts,
        concurrency_key=concurrency_key,
        fair_key=fair_key,
        using=using,
        after=after,
    )


def insert(
    handler: str | type[WorkItemHandler],
    payload: Any = None,
    *,
    run_after: datetime | timedelta | None = None,
    priority: int = 0,
    queue: str | None = None,
    unique_key: str | None = None,
    max_attempts: int | None = None,
    concurrency_key: str | None = None,
    fair_key: str | None = None,
    using: str | None = None,
    after: Iterable[WorkItem | int] | None = None,
) -> tuple[WorkItem, bool]:
    """``enqueue``, also saying whether a row was added (False: a live ``unique_key``'s row)."""
    options = EnqueueOptions(
        run_after=run_after,
        priority=priority,
        queue=queue,
        unique_key=unique_key,
        max_attempts=max_attempts,
        concurrency_key=concurrency_key,
        fair_key=fair_key,
        using=using,
        after=after,
    )
    return insert_one(handler, payload, options)


def insert_one(
    handler: str | type[WorkItemHandler], payload: Any, options: EnqueueOptions
) -> tuple[WorkItem, bool]:
    """``insert`` with its options in one object: what the layers above pass on."""
    cls = _handler_class(handler)
    db = work_db_for_write(options.using)
    item, payload_json, _ = _build(cls, payload, options, db)
    parents = dependencies.parent_ids(options.after, db)
    if parents and options.unique_key is not None:
        raise EnqueueError(
            "unique_key and after= cannot be combined: an enqueue that finds the key's live "
            "row returns that row, which does not wait for these parents."
        )
    if parents and options.run_after is not None:
        raise EnqueueError(
            "run_after and after= cannot be combined: an item with parents runs as soon as "
            "the last of them succeeds."
        )
    run_after = options.run_after
    item.batch_id = current_batch_id(db)
    if item.batch_id is not None and item.unique_key is not None:
        raise EnqueueError(
            "unique_key cannot be used inside a batch() block: an enqueue that finds the "
            "key's live row returns that row, which is not the batch's."
        )
    warn_if_outside_transaction(db)
    encoded = None if payload is None else payload_json
    with tracing.sending(item.queue, cls.name) as send:
        item.trace_context = send.context
        try:
            if item.fair_key is not None:
                register_key(item.fair_key, using=db)
            if parents:
                return _save_after(cls, item, send, db, parents, encoded)
            return _save(cls, item, send, db, run_after, encoded)
        except DatabaseError as exc:
            _raise_setup_problem(db, exc)
            if cls.sensitive:
                raise _withheld(exc, cls) from None
            raise


def _save_after(
    cls: type[WorkItemHandler],
    item: WorkItem,
    send: Any,
    db: str,
    parents: list[int],
    payload_json: str | None,
) -> tuple[WorkItem, bool]:
    """``_save`` for an item with parents: locked, checked and linked in one transaction."""
    with transaction.atomic(using=db):
        state = dependencies.lock_parents(parents, db)
        dependencies.shape(item, state)
        saved, added = _save(cls, item, send, db, None, payload_json)
        if added:
            dependencies.link(saved.pk, state, db)
    if not isinstance(saved.__dict__.get("finished_at"), (datetime, type(None))):
        saved.__dict__.pop("finished_at", None)  # Now(): loaded on first access
    return saved, added


def _raise_setup_problem(db: str, exc: DatabaseError) -> None:
    """Raise ``DatabaseNotReady`` (chained) if ``exc`` is a setup mistake: not migrated, no folder.

    One line that says the fix, where the database's words ("no such table")
    would end a long traceback. They quote no row, so sensitive or not.
    """
    problem = setup_problem(db, exc)
    if problem is not None:
        raise DatabaseNotReady(problem) from exc


def _withheld(exc: DatabaseError, cls: type[WorkItemHandler]) -> DatabaseError:
    """``exc`` without its text, for a sensitive handler's caller, span and logs.

    The database's words may quote the row: PostgreSQL's ``DETAIL: Failing
    row contains (...)`` of a constraint, the ``CONTEXT`` of a JSON error.
    The class stays, so callers that catch ``IntegrityError`` or
    ``OperationalError`` still do; the caller raises it ``from None``, so
    the original is not chained in (nor in the span's stack trace).
    """
    kind = type(exc)
    message = (
        f"{exception_class_path(exc)} while enqueueing {cls.name!r}: the database's message is "
        "withheld because the handler is sensitive (it may quote the row, payload included)."
    )
    try:
        return kind(message)
    except Exception:  # a driver's class that takes other arguments
        return DatabaseError(message)


def _save(
    cls: type[WorkItemHandler],
    item: WorkItem,
    send: Any,
    db: str,
    run_after: datetime | timedelta | None,
    payload_json: str | None,
) -> tuple[WorkItem, bool]:
    """Write ``item`` (a validated one) and its wake-up; ``insert``'s answer."""
    ops = operations(db)
    unique_key = item.unique_key
    plain = unique_key is None and item.batch_id is None and item.status == Status.PENDING
    if (
        plain
        and not item.waiting
        and ops.insert_item(item, run_after=run_after, payload_json=payload_json)
    ):
        # One statement: the insert and its wake-up (the common case).
        send.set_message_id(item.pk)
        return item, True
    # Inside the caller's transaction (an atomic block, or a connection
    # with AUTOCOMMIT off) a savepoint, so that a unique_key conflict does
    # not poison it. Where the wake-up is a statement of its own
    # (PostgreSQL's NOTIFY), a transaction, so that the row and its
    # wake-up commit together. Otherwise, in autocommit, the INSERT is
    # its own transaction: atomic() would only add round trips (four on
    # MySQL).
    conn = connections[db]
    in_transaction = conn.in_atomic_block or not conn.get_autocommit()
    guard = transaction.atomic if in_transaction or ops.supports_notify else _autocommit

    def save() -> None:
        with guard(using=db):
            item.save(using=db, force_insert=True)
            ops.notify([item.queue], item.priority)

    for _ in range(UNIQUE_RETRIES):
        try:
            # MySQL: inserts of one live key queue on its unique index;
            # when the holder finishes, all but one of them can be chosen
            # as deadlock victims. In a transaction of its own, the
            # insert is simply run again (inside the caller's, InnoDB
            # rolled all of it back, and the error is the caller's).
            ops.retrying(save, "enqueueing")
        except IntegrityError:
            if unique_key is None:
                raise
            existing = (
                WorkItem.objects.using(db)
                .filter(handler=cls.name, unique_key=unique_key, status__in=ACTIVE_STATUSES)
                .first()
            )
            if existing is not None:
                send.set_message_id(existing.pk)
                return existing, False
            # The holder finished between our insert and our read: try again.
            item.pk = None
            item._state.adding = True
            continue
        send.set_message_id(item.pk)
        _forget_expressions(item)
        return item, True
    raise EnqueueError(
        f"Could not enqueue {cls.name!r} with unique_key {unique_key!r}: the key kept "
        "changing hands; try again."
    )


def enqueue_many(
    handler: str | type[WorkItemHandler],
    payloads: Iterable[Any],
    *,
    run_after: datetime | timedelta | None = None,
    priority: int = 0,
    queue: str | None = None,
    concurrency_key: str | None = None,
    fair_key: str | None = None,
    using: str | None = None,
) -> list[WorkItem]:
    """Insert one work item per payload in one bulk INSERT (or COPY); all or nothing.

    The options every item shares are validated with the first payload, so an
    invalid queue reads "Payload #0: ..." as it always did. ``concurrency_key``
    is every item's.
    """
    options = EnqueueOptions(
        run_after=run_after,
        priority=priority,
        queue=queue,
        concurrency_key=concurrency_key,
        fair_key=fair_key,
        using=using,
    )
    return insert_many(handler, payloads, options)


def insert_many(
    handler: str | type[WorkItemHandler], payloads: Iterable[Any], options: EnqueueOptions
) -> list[WorkItem]:
    """``enqueue_many`` with its options in one object (``unique_key`` and
    ``max_attempts`` left unset: a batch takes neither)."""
    if isinstance(payloads, (str, bytes, dict)):
        raise EnqueueError("enqueue_many takes an iterable of payloads, not a single payload.")
    cls = _handler_class(handler)
    db = work_db_for_write(options.using)
    depth = operations(db).max_json_depth
    items: list[WorkItem] = []
    encoded: list[str | None] = []
    make = _item_maker()
    values: dict[str, Any] = {}
    for index, payload in enumerate(payloads):
        try:
            if items:
                payload_json = encode_payload(payload, max_depth=depth)
                item = _sibling(make, values, payload, options)
            else:
                item, payload_json, values = _build(cls, payload, options, db)
        except EnqueueError as exc:
            raise EnqueueError(f"Payload #{index}: {exc}") from None
        items.append(item)
        encoded.append(None if payload is None else payload_json)
    if not items:
        return []
    run_after = options.run_after
    warn_if_outside_transaction(db)
    batch_id = current_batch_id(db)
    if batch_id is not None:
        for item in items:
            item.batch_id = batch_id
    with tracing.sending(items[0].queue, cls.name, batch_size=len(items)) as send:
        for item in items:
            item.trace_context = send.context
        try:
            if items[0].fair_key is not None:
                register_key(items[0].fair_key, using=db)
            return _save_many(items, db, run_after, encoded)
        except DatabaseError as exc:
            _raise_setup_problem(db, exc)
            if cls.sensitive:
                raise _withheld(exc, cls) from None
            raise


def _save_many(
    items: list[WorkItem],
    db: str,
    run_after: datetime | timedelta | None,
    encoded: list[str | None],
) -> list[WorkItem]:
    """Write validated ``items`` and one wake-up; ``enqueue_many``'s answer."""
    plain = items[0].batch_id is None
    if plain and operations(db).insert_items(items, run_after=run_after, payloads_json=encoded):
        return items
    with transaction.atomic(using=db):
        created = WorkItem.objects.using(db).bulk_create(items)
        operations(db).notify([items[0].queue], items[0].priority)
    for item in created:
        _forget_expressions(item)
    return created
