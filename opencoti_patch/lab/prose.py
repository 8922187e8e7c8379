"""Real prose for the lab: paragraphs of running text from documentation folders (the selector tools' corpus,
and the text the load test's prompts are cut from).

A selector is judged on text whose blocks differ from each other. A filler that repeats one sentence
makes every block look alike, so any selector finds the needle; real paragraphs do not.

Sources (files, folders or glob patterns), read in sorted path order so that the corpus is the same on every
machine:
- HTML (e.g. the Python documentation, Debian's ``python3-doc``: ``/usr/share/doc/python3/html``):
  the text of ``<p>`` elements outside ``<pre>``/``<code>``-only blocks, tables and navigation;
- Markdown (e.g. the ``docs/`` of the pinned llama.cpp tree, which every run fetches): paragraphs
  outside code fences, tables, headings, lists of links and HTML;
- a **bundle** (``.txt`` or ``.txt.gz``, :func:`write_bundle`): one paragraph per line, exactly as extracted
  from the sources above. It is small enough to carry to a machine that has no documentation installed
  (the Python HTML documentation: about 1.4 MB gzipped) and gives that machine the same corpus.

Only paragraphs of at least ``min_words`` words that read as sentences (end with ``.``, ``!``, ``?``
or ``:``) are kept, and each paragraph once (the first occurrence), so nothing repeats.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import html
import re
from collections.abc import Iterable, Iterator
from html.parser import HTMLParser
from pathlib import Path

from ..errors import OpencotiError

MIN_WORDS = 25
_SPACE = re.compile(r"\s+")
_MD_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_MD_MARKUP = re.compile(r"[*`]+")


class _ParagraphParser(HTMLParser):
    """Collects the text of each <p> element; text inside <pre>, <table>, <nav> and scripts is dropped."""

    _SKIP = {"pre", "table", "nav", "script", "style", "footer", "header"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._skip = 0
        self._in_p = False
        self._buf: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self._skip += 1
        elif tag == "p" and not self._skip:
            self._in_p, self._buf = True, []

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP and self._skip:
            self._skip -= 1
        elif tag == "p" and self._in_p:
            self._in_p = False
            self.paragraphs.append("".join(self._buf))

    def handle_data(self, data: str) -> None:
        if self._in_p and not self._skip:
            self._buf.append(data)


def _clean(text: str) -> str:
    return _SPACE.sub(" ", html.unescape(text)).strip()


def _html_paragraphs(text: str) -> list[str]:
    parser = _ParagraphParser()
    parser.feed(text)
    parser.close()
    return [_clean(p) for p in parser.paragraphs]


def _markdown_paragraphs(text: str) -> list[str]:
    out: list[str] = []
    buf: list[str] = []
    fenced = False

    def flush() -> None:
        if buf:
            out.append(_clean(_MD_MARKUP.sub("", _MD_LINK.sub(r"\1", " ".join(buf)))))
            buf.clear()

    for line in text.splitlines():
        s = line.strip()
        if s.startswith(("```", "~~~")):
            fenced = not fenced
            flush()
            continue
        if fenced or not s or s.startswith(("#", "|", "<", ">", "- ", "* ", "+ ", "    ", "\t")) \
                or re.match(r"^\d+\. ", s) or line.startswith(("    ", "\t")):
            flush()
            continue
        buf.append(s)
    flush()
    return out


BUNDLE_SUFFIXES = (".txt", ".txt.gz")
DOC_SUFFIXES = (".html", ".htm", ".md")  # what a folder's files are read for


def _is_bundle(path: Path) -> bool:
    return path.name.lower().endswith(BUNDLE_SUFFIXES)


def _bundle_paragraphs(path: Path) -> list[str]:
    raw = path.read_bytes()
    if path.name.lower().endswith(".gz"):
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace").splitlines()


def write_bundle(paragraphs: Iterable[str], path: Path) -> str:
    """Write ``paragraphs`` as a bundle (one a line; gzip without a time stamp or name when ``path`` ends in
    ``.gz``, so the same corpus gives the same bytes); returns the file's sha256."""
    lines = []
    for p in paragraphs:
        if "\n" in p or "\r" in p:  # extraction collapses whitespace: a paragraph is one line
            raise OpencotiError("a prose paragraph holds a line break: it cannot go into a bundle")
        lines.append(p + "\n")
    data = "".join(lines).encode("utf-8")
    if path.name.lower().endswith(".gz"):
        data = gzip.compress(data, compresslevel=9, mtime=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def is_prose(paragraph: str, min_words: int = MIN_WORDS) -> bool:
    words = paragraph.split()
    return len(words) >= min_words and paragraph.rstrip().endswith((".", "!", "?", ":"))


def source_files(root: Path) -> list[Path]:
    """The files of one source: the file itself (read alone: HTML, Markdown or a bundle), every .html/.md file
    under a folder, or what a glob pattern (``docs/**/*.md``) names; in sorted path order."""
    if root.is_file():
        return [root]
    if root.is_dir():
        return sorted(p for p in root.rglob("*") if p.suffix.lower() in DOC_SUFFIXES and p.is_file())
    return sorted(Path(p) for p in glob.glob(str(root), recursive=True) if Path(p).is_file())


def iter_paragraphs(roots: Iterable[Path], min_words: int = MIN_WORDS) -> Iterator[str]:
    """Distinct prose paragraphs of every source in ``roots`` (:func:`source_files`), in sorted path order."""
    seen: set[str] = set()
    for root in roots:
        for path in source_files(root):
            if _is_bundle(path):
                paras = _bundle_paragraphs(path)
            else:
                text = path.read_text(encoding="utf-8", errors="replace")
                paras = _html_paragraphs(text) if path.suffix.lower() in (".html", ".htm") \
                    else _markdown_paragraphs(text)
            for p in paras:
                if is_prose(p, min_words) and p not in seen:
                    seen.add(p)
                    yield p


def load_corpus(sources: Iterable[Path | str], min_words: int = MIN_WORDS) -> list[str]:
    """The prose paragraphs of ``sources`` (files, folders, glob patterns): the one corpus of the lab (the
    selector tools read it as paragraphs, the load test as one text)."""
    roots = [Path(s) for s in sources]
    missing = [str(r) for r in roots if not r.exists() and not source_files(r)]  # a pattern: what it names
    if missing:
        raise OpencotiError(f"prose source not found: {', '.join(missing)} (`apt-get install python3-doc` "
                            "gives /usr/share/doc/python3/html; the llama.cpp tree's docs/ also works)")
    paras = list(iter_paragraphs(roots, min_words))
    if not paras:
        raise OpencotiError(f"no prose paragraphs found under {', '.join(map(str, roots))}")
    return paras


def take_text(paragraphs: list[str], start: int, n_chars: int) -> str:
    """Consecutive paragraphs from index ``start`` (wrapping around) until ``n_chars`` characters."""
    if not paragraphs:
        raise OpencotiError("empty prose corpus")
    out: list[str] = []
    size = 0
    i = start % len(paragraphs)
    while size < n_chars:
        out.append(paragraphs[i])
        size += len(paragraphs[i]) + 2
        i = (i + 1) % len(paragraphs)
        if i == start % len(paragraphs) and size < n_chars:
            raise OpencotiError(f"the prose corpus holds only {size} characters, {n_chars} needed")
    return "\n\n".join(out)
