"""Text rendering from the jinja2 templates (patch headers, reports) and progress notes.

Templates are looked up in the project's ``templates/`` first (an override), then in the ones
shipped inside the package (``opencoti_patch/templates``). Rendering is strict (an undefined
variable is an error) and byte-stable.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jinja2

from .errors import OpencotiError


def environment(dirs: Iterable[Path]) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in dirs if d.is_dir()]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render(dirs: Iterable[Path], name: str, **context: Any) -> str:
    dirs = list(dirs)
    try:
        return environment(dirs).get_template(name).render(**context)
    except jinja2.TemplateNotFound as exc:
        raise OpencotiError(f"template {name} not found in {', '.join(map(str, dirs))}") from exc


def info(message: str) -> None:
    """Progress and notes go to stderr so stdout stays parseable."""
    print(message, file=sys.stderr, flush=True)
