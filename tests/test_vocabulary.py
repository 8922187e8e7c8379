"""The repository speaks of the product only: no tracker numbers ("issue 10"), no words of how the work was
organised (a "lease" of a machine, "run V" / "runs R-V", "this session", notebooks). A dated record cites the
document and section that hold it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCOPE = ("opencoti_patch/", "tests/", "ci/", "docs/", ".github/", "README.md", "CHANGELOG.md")
PATTERNS = {
    "issue number": re.compile(r"\bissues?\s*[-#]?\s*\d+|\bissue\s*«", re.IGNORECASE),
    "lease": re.compile(r"\blease", re.IGNORECASE),
    "run letter": re.compile(r"\b[Rr]uns?\s+[A-Z](?:\s*[–-]\s*[A-Z])?\b(?![/'’\w])"),
    # a "session" of work; a pytest session fixture, a process session (setsid) or llama.cpp's session file
    # (LLAMA_SESSION_VERSION) are the product's words
    "session": re.compile(r"\bsessions\b|\bsession's|\b(?:this|that|next|previous|last|earlier|later|each"
                          r"|every|a|one|the|same|first|second|third|fourth|fifth|sixth)\s+session\b"
                          r"(?!\s+(?:leader|fixture|version))", re.IGNORECASE),
    "notebook": re.compile(r"\bnotebooks?\b", re.IGNORECASE),
}


def files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *SCOPE], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return sorted(f for f in out.split("\0") if f and f != "tests/test_vocabulary.py")


def hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, pattern name, the words) for each hit."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for name, pattern in PATTERNS.items():
            found += [(n, name, m.group(0)) for m in pattern.finditer(line)]
    return found


def test_no_insider_vocabulary() -> None:
    bad = []
    for f in files():
        try:
            text = (ROOT / f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue                                   # binary, or deleted in the working tree
        bad += [f"{f}:{n}: {name}: {words!r}" for n, name, words in hits(text)]
    assert not bad, "insider vocabulary (name the document and section instead):\n" + "\n".join(bad)


@pytest.mark.parametrize("text", [
    "as issue 10 asks", "issues 10–13", "see issue-16", "Issue «Decode speed»", "the second lease", "lease3/",
    "run V of decode.md", "runs R–V", "runs E-R", "Run T: the block size", "this session's device time",
    "between sessions", "the fifth session", "a notebook cell",
])
def test_each_pattern_can_fail(text: str) -> None:
    assert hits(text), text


@pytest.mark.parametrize("text", [
    '@pytest.fixture(scope="session")', "the detached run's session leader", "in its own session",
    "#define LLAMA_SESSION_VERSION 10", "touch the session version", "start_new_session=True", "a release",
    "please", "run A/B", "the runs' spread", "each run of the stages", "tissue 3",
])
def test_the_product_words_pass(text: str) -> None:
    assert not hits(text), hits(text)
