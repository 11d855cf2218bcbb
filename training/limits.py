"""The ranges the retraining job's options must lie in: one definition each, which the job checks and the CLI's
help states (importing this module costs nothing, so `leadtime --help` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """An interval of floats, each end open or closed.

    >>> str(Range(0.0, 0.5, low_open=True, high_open=True)), 0.5 in Range(0.0, 1.0, high_open=True)
    ('(0, 0.5)', True)
    """

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:  # NaN is in no range
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"

    def check(self, field: str, value: float) -> None:
        """Raise `OutOfRange` naming `field` unless `value` lies in the range."""
        if value not in self:
            raise OutOfRange(field, value, self)


class OutOfRange(ValueError):
    """A value outside its range; `field` names it, so that a caller can say it as its user typed it."""

    def __init__(self, field: str, value: float, bounds: Range) -> None:
        super().__init__(f"{field} must be in {bounds}, got {value}")
        self.field = field
        self.value = value
        self.bounds = bounds

    def named(self, name: str) -> str:
        """The message with `name` (an option, say) for the field."""
        return f"{name} must be in {self.bounds}, got {self.value}"


EVAL_SHARE = Range(0.0, 0.5, low_open=True, high_open=True)
"""The most recent share of the rows held out for judging."""
MARGIN = Range(0.0, 1.0, high_open=True)
"""The relative MAPE gain a challenger needs on each target judged."""
MALFORMED_SHARE = Range(0.0, 1.0)
"""The share of a source's rows that may be malformed."""
