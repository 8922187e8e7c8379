"""Paths and settings shared by every command (layer 1: imports nothing from the package but errors).

Resolution order for each path: explicit option > environment variable > default.

- project root: ``--root`` / ``OPENCOTI_ROOT`` / the nearest parent of the cwd holding ``patches/``
  (falls back to the cwd).
- patches dir: ``--patches-dir`` / ``OPENCOTI_PATCHES`` / ``<root>/patches`` (holds ``series``,
  ``upstream.toml`` and the ``NNNN-name.patch`` files).
- work dir: ``--work-dir`` / ``OPENCOTI_WORK`` / ``<root>/work``.
- vendored tree: ``--tree`` / ``OPENCOTI_TREE`` / ``<work>/llama.cpp``.
- download cache: ``OPENCOTI_CACHE`` / ``$XDG_CACHE_HOME/opencoti-patch`` / ``~/.cache/opencoti-patch``.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .errors import OpencotiError

SERIES_FILE = "series"
UPSTREAM_FILE = "upstream.toml"
STATE_DIR = "opencoti"  # inside the tree's .git: manifest, state, rebase progress
BRANCH = "opencoti"  # branch of the tree repo carrying the patch commits
TAG_PREFIX = "upstream/"  # the pristine commit is tagged upstream/<pin>
PATCH_TRAILER = "Opencoti-Patch"
HASH_TRAILER = "Opencoti-Patch-Sha256"
# Fixed identity and date: the same upstream + series gives the same commit ids everywhere.
FIXED_DATE = "2001-09-09T01:46:40+00:00"
COMMITTER = ("opencoti-patch", "opencoti-patch@invalid")
UPSTREAM_AUTHOR = ("llama.cpp upstream", "upstream@invalid")
DEFAULT_AUTHOR = "opencoti <patches@opencoti.invalid>"
SHIPPED_TEMPLATES = Path(__file__).resolve().parent / "templates"
SHIPPED_HARNESS = Path(__file__).resolve().parent / "harness"


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def find_root(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` holding a ``patches/`` folder (else ``start``)."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "patches").is_dir():
            return candidate
    return here


def require_patches_dir(patches_dir: Path) -> None:
    """A project's patches folder exists: a missing one is the wrong folder (run from elsewhere without
    --patches-dir), never an empty series."""
    if not patches_dir.is_dir():
        raise OpencotiError(
            f"no patches folder at {patches_dir}: run from the project (the folder holding patches/, or "
            "below it), or give --patches-dir (OPENCOTI_PATCHES) or OPENCOTI_ROOT"
        )


def portable(text: str, root: Path | None = None) -> str:
    """``text`` (a report, a manifest) without this machine's paths: paths under the project root
    become relative to it, paths under the home folder start with ``~``."""
    for prefix, short in ((root or find_root(), "."), (Path.home(), "~")):
        base = str(prefix).rstrip("/")
        if not base:
            continue
        pattern = re.compile(r"(?<![\w./-])" + re.escape(base) + r"(?=/|(?![\w.-]))(/)?")
        text = pattern.sub(lambda m, s=short: "" if m.group(1) and s == "." else s + (m.group(1) or ""), text)
    return text


def write_report(path: Path, text: str, root: Path | None = None) -> None:
    """Write a report or manifest with ``portable`` paths."""
    path.write_text(portable(text, root), encoding="utf-8")


def default_cache_dir() -> Path:
    explicit = _env_path("OPENCOTI_CACHE")
    if explicit:
        return explicit
    xdg = _env_path("XDG_CACHE_HOME")
    return (xdg or Path.home() / ".cache") / "opencoti-patch"


@dataclass(frozen=True)
class Settings:
    root: Path
    patches_dir: Path
    work_dir: Path
    tree: Path
    cache_dir: Path
    lock_wait: float = 0.0
    # the path options as given (``--tree X`` ...): printed recovery commands repeat them
    path_args: tuple[str, ...] = ()

    @classmethod
    def resolve(
        cls,
        root: Path | None = None,
        patches_dir: Path | None = None,
        work_dir: Path | None = None,
        tree: Path | None = None,
        cache_dir: Path | None = None,
        lock_wait: float | None = None,
    ) -> Settings:
        root = (root or _env_path("OPENCOTI_ROOT") or find_root()).resolve()
        patches = (patches_dir or _env_path("OPENCOTI_PATCHES") or root / "patches").resolve()
        work = (work_dir or _env_path("OPENCOTI_WORK") or root / "work").resolve()
        tree_path = (tree or _env_path("OPENCOTI_TREE") or work / "llama.cpp").resolve()
        wait = lock_wait if lock_wait is not None else float(os.environ.get("OPENCOTI_LOCK_WAIT", "0"))
        given = (("--tree", tree), ("--work-dir", work_dir), ("--patches-dir", patches_dir))
        path_args = tuple(a for opt, value in given if value is not None for a in (opt, str(value)))
        return cls(
            root=root,
            patches_dir=patches,
            work_dir=work,
            tree=tree_path,
            cache_dir=(cache_dir or default_cache_dir()).resolve(),
            lock_wait=wait,
            path_args=path_args,
        )

    def command(self, args: str) -> str:
        """``opencoti-patch <args>`` plus the path options this run was given (for messages)."""
        extra = " ".join(shlex.quote(a) for a in self.path_args)
        return f"opencoti-patch {args}" + (f" {extra}" if extra else "")

    @property
    def series_file(self) -> Path:
        return self.patches_dir / SERIES_FILE

    @property
    def upstream_file(self) -> Path:
        return self.patches_dir / UPSTREAM_FILE

    @property
    def results_dir(self) -> Path:
        """Where reports go by default: ``<work>/results`` (git-ignored; docs/results is curated)."""
        return self.work_dir / "results"

    @property
    def rescue_dir(self) -> Path:
        return self.work_dir / "rescue"

    @property
    def lock_file(self) -> Path:
        return self.tree.parent / f".{self.tree.name}.lock"

    @property
    def templates_dirs(self) -> list[Path]:
        """Project templates (an override) first, then the ones shipped inside the package."""
        return [self.root / "templates", SHIPPED_TEMPLATES]
