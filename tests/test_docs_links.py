"""What the README and the docs cite exists: every relative Markdown link, and every repository path
written in backticks, names a file tracked by git (a folder: one with a tracked file in it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"`([^`\n]+)`")
# repository paths as the docs write them; llama.cpp's own tests/, docs/ and ci/ are spelled otherwise
# (tests/test-*.cpp, the pinned tree's docs/)
REPO_PATH = re.compile(r"(?:docs/|ci/|opencoti_patch/|patches/|\.github/|tests/test_|tests/data/)[\w./-]*"
                       r"|(?:README|CHANGELOG)\.md|pyproject\.toml")
PLACEHOLDER = re.compile(r"[*<>{}$|]|\.\.\.|NNNN")
CREATED = ("patches/skipped",)   # folders the tools make when needed (a rebase's skipped patches)


def tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    return {f for f in out.stdout.split("\0") if f}


FILES = tracked()
FOLDERS = {str(p) for f in FILES for p in PurePosixPath(f).parents if str(p) != "."}
DOCS = sorted(f for f in FILES if f in ("README.md", "CHANGELOG.md")
              or (f.startswith("docs/") and f.endswith(".md")))


def exists(path: str) -> bool:
    path = path.rstrip("/")
    return path in FILES or path in FOLDERS or path.startswith(CREATED)


def links(doc: str, text: str) -> list[str]:
    """Relative link targets of a Markdown file, as repository paths (anchors dropped)."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-zA-Z][\w+.-]*:", target) or target.startswith("#"):
            continue                                    # https:, mailto:, an anchor in the same file
        path = target.split("#", 1)[0]
        base = PurePosixPath(doc).parent
        parts: list[str] = []
        for part in (base / path).parts:
            if part == "..":
                parts = parts[:-1]
            elif part != ".":
                parts.append(part)
        out.append("/".join(parts))
    return out


def code_paths(text: str) -> list[str]:
    """Repository paths written in backticks; `tests/x.py::test_y` counts as tests/x.py. A path behind a
    commit (`be56fcb:docs/...`, what git history holds) or with a placeholder (`<name>`, `*`) is not one."""
    out = []
    for span in CODE.findall(text):
        for word in span.split():
            word = word.split("::", 1)[0].rstrip(".,;:)")
            if PLACEHOLDER.search(word) or re.match(r"[0-9a-f]{7,40}:", word):
                continue
            m = REPO_PATH.fullmatch(word)
            if m:
                out.append(word)
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve_to_tracked_files(doc: str) -> None:
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = [t for t in links(doc, text) if not exists(t)]
    assert not missing, f"{doc} links to what is not tracked: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_repository_paths_in_backticks_exist(doc: str) -> None:
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = sorted({p for p in code_paths(text) if not exists(p)})
    assert not missing, f"{doc} names what is not tracked: {missing}"


def test_the_checks_can_fail() -> None:
    """A missing link, a link outside its folder, a missing backticked path: each is found."""
    doc = "docs/results/README.md"
    assert links(doc, "[a](decode.md#x) [b](../usage.md) [c](https://x.org) [d](#top)") == [
        "docs/results/decode.md", "docs/usage.md"]
    assert not exists("docs/results/no-such.md") and exists("docs/results") and exists("docs/results/")
    text = ("`docs/gone.md`, `tests/test_x.py::test_y` and `be56fcb:docs/old.md`, `docs/results/<folder>`, "
            "`tests/test-sparse-attn.cpp`")
    assert code_paths(text) == ["docs/gone.md", "tests/test_x.py"]
