"""One verdict type for every check the project runs.

A :class:`Check` is one comparison with its evidence: passed (True), failed (False) or not checked
(None: skipped, or nothing it could prove). :func:`verdict_of` turns a list of checks into a
:class:`Verdict`:

- FAIL: some check failed;
- INCOMPLETE: nothing failed, but a check proved nothing, a required stage has no passed check, or
  there is no check at all (absent evidence is never a pass);
- PASS: every check ran and passed, and every required stage has at least one passed check.

:func:`evidence_problem` is the shared test that there is something to compare (non-empty, finite,
not constant), so that a check never passes on an empty sample or on NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PASS = "PASS"
FAIL = "FAIL"
INCOMPLETE = "INCOMPLETE"


@dataclass
class Check:
    name: str
    stage: str
    passed: bool | None  # None = not checked (skipped, or nothing it could prove)
    summary: str
    evidence: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "not checked" if self.passed is None else ("pass" if self.passed else "FAIL")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"status": self.status}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Check:
        """The check :meth:`as_dict` wrote (its derived ``status`` is dropped)."""
        return cls(d["name"], d["stage"], d["passed"], d["summary"], list(d.get("evidence", [])))


@dataclass(frozen=True)
class Verdict:
    verdict: str  # PASS, FAIL or INCOMPLETE
    failed: tuple[str, ...]  # names of the checks that failed
    missing_stages: tuple[str, ...]  # required stages without a passed check
    not_checked: tuple[str, ...]  # "<stage>: <name>" of every check that proved nothing

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def reasons(self) -> list[str]:
        """What keeps the verdict from PASS, one phrase each."""
        out = list(self.failed)
        out += [f"no passed {st} check" for st in self.missing_stages]
        out += [f"not checked: {n}" for n in self.not_checked]
        return out or ([] if self.passed else ["no check ran"])

    def accepts(self, not_checked_stages: Iterable[str]) -> bool:
        """True for PASS, or INCOMPLETE where only checks of ``not_checked_stages`` proved nothing. A
        required stage without a passed check is accepted only when it is named and a check of it says
        "not checked" (skipped on purpose); a stage that never ran is never accepted."""
        if self.verdict == PASS:
            return True
        if self.verdict == FAIL:
            return False
        accepted = set(not_checked_stages)
        skipped = {n.split(": ", 1)[0] for n in self.not_checked}
        if any(st not in accepted or st not in skipped for st in self.missing_stages):
            return False
        return bool(skipped) and skipped <= accepted


def verdict_of(checks: Sequence[Check], required_stages: Iterable[str] = ()) -> Verdict:
    """The verdict of ``checks``; see the module docstring. No check at all is INCOMPLETE."""
    required = tuple(dict.fromkeys(required_stages))
    failed = tuple(c.name for c in checks if c.passed is False)
    missing = tuple(st for st in required if not any(c.passed for c in checks if c.stage == st))
    not_checked = tuple(f"{c.stage}: {c.name}" for c in checks if c.passed is None)
    if failed:
        verdict = FAIL
    elif missing or not_checked or not checks:
        verdict = INCOMPLETE
    else:
        verdict = PASS
    return Verdict(verdict, failed, missing, not_checked)


def evidence_problem(values: Iterable[float], *, what: str = "values", min_count: int = 1,
                     allow_constant: bool = False) -> str | None:
    """Why ``values`` cannot serve as evidence (None when they can): fewer than ``min_count``, a NaN
    or an infinity, or (unless ``allow_constant``) every value the same."""
    vals = [float(v) for v in values]
    if len(vals) < max(min_count, 1):
        return f"{len(vals)} {what}, at least {max(min_count, 1)} needed"
    bad = sum(1 for v in vals if not math.isfinite(v))
    if bad:
        return f"{bad} of {len(vals)} {what} are NaN or infinite"
    if not allow_constant and len(vals) > 1 and min(vals) == max(vals):
        return f"all {len(vals)} {what} equal {vals[0]!r}: nothing to compare"
    return None
