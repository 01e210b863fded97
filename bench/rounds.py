"""What every side-by-side benchmark here shares: rows take turns, and ratios are per round.

Each benchmark runs its rows in rounds, the order rotating from one round to the next, so that a
burst of outside load hits every row alike; a ratio is the median of the per-round ratios of a
row to its baseline, never the ratio of two medians taken at different moments.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def rotation(rows: Sequence[T], round_no: int) -> list[T]:
    """``rows`` in the order of round ``round_no``: each round starts one row later."""
    shift = round_no % len(rows)
    return [*rows[shift:], *rows[:shift]]


def median_ratio(mine: Sequence[float], baseline: Sequence[float], digits: int = 3) -> float:
    """The median of the per-round ratios ``mine[i] / baseline[i]``."""
    pairs = zip(mine, baseline, strict=True)
    return round(statistics.median(a / b for a, b in pairs), digits)
