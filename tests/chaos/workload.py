"""What the chaos runner enqueues, and what each item must end as.

Pure data and arithmetic (no Django): the runner draws items from a seeded
``random.Random``, so a seed reproduces the same workload. ``expect`` is the
contract the checks hold every item to.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

#: The refused result's reason, as the issue words it.
REFUSED_REASON = "result could not be stored"
#: How stale recovery words an item whose attempts it used up.
STALE_EXHAUSTED = ("Recovered as stale", "attempts used up")


@dataclass(frozen=True)
class Kind:
    handler: str
    weight: int
    #: The item's rows are written in the handler's transaction (Effect rows).
    atomic: bool = False


KINDS = (
    Kind("chaos_atomic", 24, atomic=True),
    Kind("chaos_sleep", 24),
    Kind("chaos_flaky", 12),
    Kind("chaos_timeout_short", 6),
    Kind("chaos_timeout_long", 4),
    Kind("chaos_always_fail", 8),
    Kind("chaos_no_retry", 8),
    Kind("chaos_refused", 6),
    Kind("chaos_refused_atomic", 3, atomic=True),
)
HANDLERS = tuple(k.handler for k in KINDS)
ATOMIC_HANDLERS = frozenset(k.handler for k in KINDS if k.atomic)
#: The keyed mode's one handler (``--keyed``): concurrency_limit = 1 per key.
KEYED_HANDLER = "chaos_keyed"


def duration(rng: random.Random, stale_after: float) -> float:
    """Milliseconds mostly, seconds often, longer than STALE_AFTER sometimes."""
    roll = rng.random()
    if roll < 0.6:
        seconds = rng.uniform(0.005, 0.2)
    elif roll < 0.85:
        seconds = rng.uniform(0.3, 2.0)
    else:
        seconds = rng.uniform(stale_after + 0.5, stale_after + 2.0)
    return round(seconds, 3)


def make_item(rng: random.Random, n: int, stale_after: float) -> tuple[str, dict[str, Any]]:
    """The handler and payload of item number ``n``."""
    kind = rng.choices(KINDS, weights=[k.weight for k in KINDS])[0]
    payload: dict[str, Any] = {"n": n}
    if kind.handler in ("chaos_atomic", "chaos_sleep"):
        payload["seconds"] = duration(rng, stale_after)
    elif kind.handler == "chaos_flaky":
        payload["fail_times"] = rng.randint(1, 3)
    elif kind.handler.startswith("chaos_timeout"):
        payload["late"] = rng.choice(["succeed", "fail"])
    return kind.handler, payload


def make_keyed_item(
    rng: random.Random, n: int, stale_after: float, keys: int
) -> tuple[str, dict[str, Any]]:
    """The keyed mode's item number ``n``: a key of ``keys``, and a duration."""
    payload = {"n": n, "key": f"k{rng.randrange(keys)}", "seconds": duration(rng, stale_after)}
    return KEYED_HANDLER, payload


@dataclass(frozen=True)
class Expectation:
    status: str
    #: For ``failed``: what ``last_error`` must start with.
    error_prefix: str = ""
    #: Attempts of an item that no fault touched; None: anything up to max_attempts.
    attempts: int | None = 1
    #: Attempts the handler fails by design before its final outcome.
    designed_failures: int = 0
    #: For ``succeeded``: the result the row must hold.
    result: Any = None


def expect(handler: str, payload: dict[str, Any], max_attempts: int) -> Expectation:
    n = payload["n"]
    ok = {"n": n}
    if handler in ("chaos_atomic", "chaos_sleep", KEYED_HANDLER):
        return Expectation("succeeded", result=ok)
    if handler == "chaos_flaky":
        fails = int(payload["fail_times"])
        return Expectation("succeeded", attempts=fails + 1, designed_failures=fails, result=ok)
    if handler.startswith("chaos_timeout"):
        return Expectation("succeeded", attempts=2, designed_failures=1, result=ok)
    if handler == "chaos_always_fail":
        return Expectation(
            "failed",
            "ValueError: always fails",
            attempts=max_attempts,
            designed_failures=max_attempts,
        )
    if handler == "chaos_no_retry":
        return Expectation("failed", "ValueError: not retryable", designed_failures=1)
    if handler in ("chaos_refused", "chaos_refused_atomic"):
        # Whether a refused result is retried is the worker's choice; how it ends is not.
        return Expectation("failed", REFUSED_REASON, attempts=None, designed_failures=1)
    raise ValueError(f"no expectation for handler {handler!r}")


def stale_exhausted(last_error: str) -> bool:
    return last_error.startswith(STALE_EXHAUSTED[0]) and STALE_EXHAUSTED[1] in last_error
