"""Progress output (opencoti_patch.progress): a line per 10 % in a log, nothing when off."""

from __future__ import annotations

import pytest

from opencoti_patch.progress import _LineBar, progress


def test_progress_lines_for_logs(capsys: pytest.CaptureFixture[str]) -> None:
    bar = _LineBar(20, "passkey")
    for _ in range(20):
        bar.update(1)
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("passkey: 20/20 (100%)") and 2 <= len(err) <= 11


def test_progress_off_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with progress(5, "x", show=False) as bar:
        bar.update(5)
    with progress(0, "unknown length", show=True) as bar:  # stderr is not a terminal under pytest
        bar.update(100)
    assert capsys.readouterr().err == ""
