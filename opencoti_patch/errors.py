"""Error types with documented exit codes (see docs/usage.md).

Every failure the user can cause is one of these. They carry no CLI dependency: ``cli/main.py``
turns them into a one-line message and the exit code below, never a traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1  # bad input, missing tree, dirty tree, sha256 mismatch, hostile archive, ...
EXIT_USAGE = 2  # usage error (unknown option, missing argument, exclusive options)
EXIT_PATCH_FAILED = 3  # a patch did not apply (apply/prepare) or conflicted (rebase)
EXIT_CHECK_FAILED = 4  # a check found a difference: snapshot --check, backup --verify, markers, round trip
EXIT_LOCKED = 5  # another opencoti-patch run holds the tree lock
EXIT_INTERRUPTED = 130  # Ctrl-C (the tree was rolled back to the last good patch)


class OpencotiError(Exception):
    """A clear one-line error (exit code 1)."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageProblem(OpencotiError):
    """Options that do not go together (exit code 2)."""

    exit_code = EXIT_USAGE


class PatchFailed(OpencotiError):
    """A patch of the series did not apply (exit code 3); ``report`` holds what was done."""

    exit_code = EXIT_PATCH_FAILED

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class CheckFailed(OpencotiError):
    """A verification found a difference (exit code 4)."""

    exit_code = EXIT_CHECK_FAILED


class LockBusy(OpencotiError):
    """Another run holds the lock (exit code 5)."""

    exit_code = EXIT_LOCKED


class Interrupted(OpencotiError):
    """Ctrl-C (exit code 130)."""

    exit_code = EXIT_INTERRUPTED
