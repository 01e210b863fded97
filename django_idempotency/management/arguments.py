"""Arguments shared by the management commands that work in bounded batches: their types
(argparse ``type=`` functions) and ``--batch-size`` with ``--max-seconds``."""

from __future__ import annotations

from argparse import ArgumentParser, ArgumentTypeError

from django_idempotency.conf import MAX_BATCH_SIZE, MAX_SECONDS


def batch_size(text: str) -> int:
    """A number of rows per transaction, from 1 to ``MAX_BATCH_SIZE``."""
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if not 1 <= value <= MAX_BATCH_SIZE:
        raise ArgumentTypeError(f"must be from 1 to {MAX_BATCH_SIZE}, not {text}")
    return value


def seconds(text: str, *, zero: str = "0") -> float:
    """A number of seconds, from 0 (``zero`` says what it means) to ``MAX_SECONDS``."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"must be a number of seconds, not {text!r}") from None
    if not 0 <= value <= MAX_SECONDS:  # NaN and infinity fail this too
        raise ArgumentTypeError(f"must be from {zero} to {MAX_SECONDS:.0f}, not {text}")
    return value


def budget_seconds(text: str) -> float:
    """A time budget in seconds, from 0 (no limit) to ``MAX_SECONDS``."""
    return seconds(text, zero="0 (no limit)")


def add_batch_arguments(
    parser: ArgumentParser, *, seconds_default: float | None, seconds_help: str
) -> None:
    """``--batch-size N`` (default: ``IDEMPOTENCY["PURGE_BATCH_SIZE"]``, read by the command's
    work) and ``--max-seconds S``, whose default and help the command gives."""
    parser.add_argument(
        "--batch-size",
        type=batch_size,
        default=None,
        metavar="N",
        help='Rows per transaction (default: IDEMPOTENCY["PURGE_BATCH_SIZE"]).',
    )
    parser.add_argument(
        "--max-seconds",
        type=budget_seconds,
        default=seconds_default,
        metavar="S",
        help=seconds_help,
    )
