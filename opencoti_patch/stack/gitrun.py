"""git outside a managed tree (a clone, a checkout to check, an export), isolated like ``Tree.git``:
the user's and system config ignored, no prompts, the C locale, fixed identity and dates."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..config import COMMITTER, FIXED_DATE
from ..errors import OpencotiError


@dataclass(frozen=True)
class GitResult:
    rc: int
    out: str | bytes
    err: str

    @property
    def text(self) -> str:
        return self.out if isinstance(self.out, str) else self.out.decode("utf-8", "replace")


def isolated_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """git with the user's and system config ignored, fixed identity and dates."""
    name, email = COMMITTER
    env = {
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "LC_ALL": "C",
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_COMMITTER_DATE": FIXED_DATE,
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": FIXED_DATE,
    }
    env.update(extra or {})
    return env


def run_git(path: Path, *args: str, check: bool = False, env: dict[str, str] | None = None) -> GitResult:
    """git in any folder (not only a managed tree) with the same isolation as ``Tree.git``; bytes out."""
    proc = subprocess.run(["git", "-C", str(path), *args], capture_output=True,
                          env={**os.environ, **(env or {}), **isolated_env()})
    result = GitResult(proc.returncode, proc.stdout, proc.stderr.decode("utf-8", "replace"))
    if check and result.rc != 0:
        last = (result.err.strip().splitlines() or ["(no message)"])[-1]
        raise OpencotiError(f"git {' '.join(args[:3])} failed in {path}: {last}")
    return result
