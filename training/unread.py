"""Keys of the sources' rows that the retraining job does not read, and the one warning line that names them.

A row may carry keys Leadtime does not read: llm-d's rows ride along with fields of their own, the simulator's log
with `policy` (Leadtime's own, passed by in silence). They are not refused. But an optional field misspelt
(`accelerater`) is such a key too, and the row is then read as if the field were absent: every row of a mixed fleet
taken as the default class, with nothing said. So the job counts the keys it did not read, per source, and says so
in one line, with the field a key may be a slip for.

Counting is per distinct key set (rows of one log nearly all share one), so a row costs one tuple of its keys and a
dictionary look-up; the names are compared with the fields only once per key set.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from leadtime.features.rows import NATIVE_OBSERVATION_FIELDS, ROUTED_BY_FIELD

READ_FIELDS = NATIVE_OBSERVATION_FIELDS
"""Every key the service's parser reads from a training entry (llm-d's row, Leadtime's extras, the actuals, what
had been predicted, the timestamp)."""
KNOWN_UNREAD = frozenset({ROUTED_BY_FIELD})
"""Keys Leadtime's own logs carry that the job has no use for (the simulator's routing policy): not named, so that
the warning speaks only of what may be a slip or another writer's field."""
NEAR_MISS = 0.8
"""How alike (difflib's ratio) a key must be to a field to be named as its likely slip. Higher than difflib's 0.6:
at 0.6 the simulator's own `actual_e2e_ms` would be taken for a slip of `actual_ttft_ms`."""
_LISTED = 12  # keys named in the warning line (all are in the report)


class KeySets:
    """The key sets of a source's rows, each with how many rows had it."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[Any, ...]] = Counter()

    def add(self, entry: Mapping[str, Any]) -> None:
        """Count one row's key set (its keys in their order: rows of one writer share it)."""
        self._counts[tuple(entry)] += 1

    def unread(self) -> dict[str, int]:
        """Each key no field is read from, with the rows that had it (most rows first)."""
        rows: Counter[str] = Counter()
        for keys, n in self._counts.items():
            for key in keys:
                if key not in READ_FIELDS and key not in KNOWN_UNREAD:
                    rows[str(key)] += n
        return dict(rows.most_common())


def near_miss(key: str) -> str | None:
    """The field `key` is likely a slip for, if any.

    >>> near_miss("accelerater"), near_miss("policy"), near_miss("actual_e2e_ms")
    ('accelerator', None, None)
    """
    close = difflib.get_close_matches(key, sorted(READ_FIELDS), n=1, cutoff=NEAR_MISS)
    return close[0] if close else None


class _HasUnread(Protocol):
    unread: dict[str, int]


def unread_keys_warning(sources: Iterable[_HasUnread]) -> str | None:
    """One line naming the keys no source's rows were read for, with how many rows had each, the likely slips
    first; None when every key was read."""
    rows: Counter[str] = Counter()
    for source in sources:
        rows.update(source.unread)
    if not rows:
        return None
    slips = {key: near_miss(key) for key in rows}
    ranked = sorted(rows, key=lambda key: (slips[key] is None, -rows[key], key))
    named = []
    for key in ranked[:_LISTED]:
        hint = f" (did you mean `{slips[key]}`?)" if slips[key] else ""
        named.append(f"`{key}` in {rows[key]} row{'' if rows[key] == 1 else 's'}{hint}")
    more = f", and {len(ranked) - _LISTED} more keys (see the report)" if len(ranked) > _LISTED else ""
    return f"keys the job does not read, left out of every row that has them: {', '.join(named)}{more}"
