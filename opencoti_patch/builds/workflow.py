"""The GitHub Actions workflow of the rebuild pipeline, rendered from templates/github-workflow.yml.j2.

Both jobs run the stages of ``ci/rebuild.sh`` (fetch -> backup -> apply -> markers ->
verify-identical -> rebuild + stamp -> op tests -> publish), so a maintainer can run locally what CI
runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import CheckFailed
from ..report import render

WORKFLOW_TEMPLATE = "github-workflow.yml.j2"
WORKFLOW_OUT = ".github/workflows/rebuild.yml"
STAGES = ("fetch", "backup", "apply", "markers", "verify", "rebuild", "optests", "publish")


def render_workflow(template_dirs: Sequence[Path], cuda_arch: str = "90-real", python: str = "3.11",
                    cpu_timeout: int = 90, gpu_labels: Sequence[str] = ("self-hosted", "linux", "gpu"),
                    ) -> str:
    return render(template_dirs, WORKFLOW_TEMPLATE, stages=STAGES, cuda_arch=cuda_arch, python=python,
                  cpu_timeout=cpu_timeout, gpu_labels=list(gpu_labels), gh=github_expr)


def github_expr(expr: str) -> str:
    """``${{ expr }}`` for the workflow (jinja2 and GitHub share the braces)."""
    return "${{ " + expr + " }}"


def write_workflow(path: Path, template_dirs: Sequence[Path], cuda_arch: str = "90-real",
                   check: bool = False) -> bool:
    """Write the workflow; returns whether it changed. ``check``: write nothing, fail when stale."""
    text = render_workflow(template_dirs, cuda_arch=cuda_arch)
    old = path.read_text(encoding="utf-8") if path.is_file() else None
    changed = old != text
    if check:
        if changed:
            raise CheckFailed(f"{path} is not what {WORKFLOW_TEMPLATE} renders: "
                              "run opencoti-patch ci-workflow")
        return False
    if changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return changed
