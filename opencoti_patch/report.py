"""Text rendering from the jinja2 templates in ``templates/`` (patch headers, reports).

Templates are looked up in the project's ``templates/`` first, then in the one shipped beside the
package. Rendering is strict (an undefined variable is an error) and byte-stable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click
import jinja2


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
    try:
        return environment(dirs).get_template(name).render(**context)
    except jinja2.TemplateNotFound as exc:
        raise click.ClickException(f"template {name} not found in {', '.join(map(str, dirs))}") from exc


def emit(data: Any, as_json: bool, text: str | None = None) -> None:
    """Print ``data`` as JSON (``--json``) or ``text`` for humans."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    elif text:
        click.echo(text.rstrip("\n"))


def info(message: str) -> None:
    """Progress and notes go to stderr so stdout stays parseable."""
    click.echo(message, err=True)
