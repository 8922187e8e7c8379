"""The one verdict type: no evidence is never PASS."""

from __future__ import annotations

import math

from opencoti_patch.verdict import Check, evidence_problem, verdict_of


def test_no_check_is_incomplete() -> None:
    v = verdict_of([])
    assert v.verdict == "INCOMPLETE" and not v.passed and v.reasons() == ["no check ran"]


def test_fail_wins_over_not_checked_and_missing() -> None:
    v = verdict_of([Check("a", "x", False, "bad"), Check("b", "y", None, "skipped")], ["z"])
    assert v.verdict == "FAIL" and v.failed == ("a",) and v.missing_stages == ("z",)


def test_missing_required_stage_is_incomplete() -> None:
    v = verdict_of([Check("a", "x", True, "ok")], ["x", "y"])
    assert v.verdict == "INCOMPLETE" and v.missing_stages == ("y",)
    assert not v.accepts(["y"])  # a stage that never ran is not accepted as "not checked"


def test_not_checked_is_incomplete_and_accepted_only_by_name() -> None:
    v = verdict_of([Check("a", "x", True, "ok"), Check("b", "repro", None, "skipped")], ["x"])
    assert v.verdict == "INCOMPLETE" and v.not_checked == ("repro: b",)
    assert v.accepts(["repro"]) and not v.accepts(["other"])


def test_pass_needs_every_check_passed() -> None:
    v = verdict_of([Check("a", "x", True, "ok"), Check("b", "y", True, "ok")], ["x", "y"])
    assert v.verdict == "PASS" and v.passed and v.reasons() == [] and v.accepts([])


def test_evidence_problem() -> None:
    assert evidence_problem([]) is not None
    assert "at least 5" in (evidence_problem([1.0, 2.0], min_count=5) or "")
    assert "NaN" in (evidence_problem([1.0, math.nan]) or "")
    assert "NaN" in (evidence_problem([math.inf, 1.0]) or "")
    assert "nothing to compare" in (evidence_problem([0.0, 0.0, 0.0]) or "")
    assert evidence_problem([0.0, 0.0], allow_constant=True) is None
    assert evidence_problem([0.5, 1.5]) is None


def test_a_required_stage_skipped_on_purpose_is_accepted_by_name() -> None:
    # --skip-repro: the reproducibility stage is required, has no passed check, but says "not checked"
    v = verdict_of([Check("a", "x", True, "ok"), Check("b", "repro", None, "skipped")], ["x", "repro"])
    assert v.verdict == "INCOMPLETE" and v.missing_stages == ("repro",)
    assert v.accepts(["repro"]) and not v.accepts([]) and not v.accepts(["x"])
    # a required stage with no check at all stays unaccepted, even named
    v = verdict_of([Check("a", "x", True, "ok"), Check("b", "repro", None, "skipped")], ["x", "repro", "y"])
    assert not v.accepts(["repro", "y"])
