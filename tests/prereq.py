"""Missing prerequisites (a source tree, a model, a compiler): a skip, except where every check must run.

``ci/test.sh`` (the full run) sets ``OPENCOTI_REQUIRE_ALL=1``: then no test may skip. :func:`unavailable`
fails instead of skipping, and :func:`pytest_runtest_makereport` (registered by ``conftest.py``) turns any
other skip (a ``skipif`` marker, ``importorskip``) into a failure that names the reason.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any, NoReturn

import pytest

REQUIRE_ALL = os.environ.get("OPENCOTI_REQUIRE_ALL") == "1"


def unavailable(reason: str) -> NoReturn:
    """Skip, or fail where every check must run (OPENCOTI_REQUIRE_ALL=1, set by ci/test.sh)."""
    if REQUIRE_ALL:
        pytest.fail(f"{reason} (OPENCOTI_REQUIRE_ALL=1: every check must run)")
    pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    """Under OPENCOTI_REQUIRE_ALL=1 a skipped test is a failed one (xfail stays xfail)."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"skipped under OPENCOTI_REQUIRE_ALL=1 (every check must run): {reason}"
