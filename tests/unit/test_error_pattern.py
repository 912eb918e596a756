"""Failures group by a normalised message: ids, numbers and quoted values folded."""

from __future__ import annotations

import pytest

from django_dbworker.errortext import error_pattern


@pytest.mark.parametrize(
    ("message", "pattern"),
    [
        ("LookupError: Order 1234 not found", "LookupError: Order <n> not found"),
        ("ValueError: amount -12.50 exceeds 100", "ValueError: amount -<n> exceeds <n>"),
        (
            "DoesNotExist: Customer 6f1c2b7e-9a41-4c3e-8d2f-0b9e6a7c5d10 is gone",
            "DoesNotExist: Customer <uuid> is gone",
        ),
        ("RuntimeError: object at 0x7f3a9c2e4d10 closed", "RuntimeError: object at <hex> closed"),
        ("GitError: commit 9fceb02d0ae598e95dc970b74767f19372d61af8", "GitError: commit <hex>"),
        ("KeyError: 'user_id'", "KeyError: '<s>'"),
        ('IntegrityError: duplicate key "orders_pkey"', 'IntegrityError: duplicate key "<s>"'),
        (
            "FileNotFoundError: [Errno 2] No such file: '/tmp/x-7.csv'",
            "FileNotFoundError: [Errno <n>] No such file: '<s>'",
        ),
        ("ValueError: \"it's 3 o'clock\" is no time", 'ValueError: "<s>" is no time'),
        # A first line cut in the database may end inside a quoted value.
        ("KeyError: 'a very long key that the database cut", "KeyError: '<s>"),
    ],
)
def test_ids_numbers_and_quoted_values_fold_to_placeholders(message: str, pattern: str) -> None:
    assert error_pattern(message) == pattern


def test_messages_that_differ_only_in_ids_share_a_pattern() -> None:
    messages = [f"LookupError: Order {n} not found for customer {n * 7}" for n in (1, 42, 99_999)]
    assert len({error_pattern(m) for m in messages}) == 1


@pytest.mark.parametrize(
    "message",
    [
        "ValueError: bad input",
        "Http404: no page",  # digits inside a name stay: they name, not count
        "TimeoutError: can't reach the server's API",  # apostrophes are not quotes
        "OAuth2Error: invalid_grant",
        "",
    ],
)
def test_words_names_and_apostrophes_stay(message: str) -> None:
    assert error_pattern(message) == message


def test_different_errors_stay_apart() -> None:
    assert error_pattern("KeyError: 'x'") != error_pattern("ValueError: 'x'")
    assert error_pattern("Order 1 not found") != error_pattern("Order 1 refunded")
