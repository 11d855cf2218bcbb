"""How the property tests (hypothesis) search: the same examples at every run by default, so that a suite that
passed passes again (CI is no place for a search to come upon a rare bug by chance, failing a change that has
nothing to do with it); `PROPERTY_SEARCH=random` searches afresh at each run, with more examples where a test file
reads its own variable (SIM_EXAMPLES), to look for new bugs."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SEARCH = settings(
    deadline=None,
    database=None,
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
    derandomize=os.environ.get("PROPERTY_SEARCH") != "random",
)
