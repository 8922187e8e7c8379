"""Click commands ``bench pack`` and ``bench report`` (the two ends of the H200 benchmark)."""

from __future__ import annotations

from pathlib import Path

import click

from ...cli.options import common_options
from ...config import Settings
from ...errors import OpencotiError
from ...stack.series import series_digest
from .. import bench


@click.group("bench")
def bench_group() -> None:
    """Decode benchmark on a GPU machine: dense vs sparse in one llama-bench run.

    \b
    1. opencoti-patch bench pack          slim patched tree -> .carry/llama-src.tar.gz
    2. on the GPU machine, from the repo root:
         bash ci/device/h200.sh start [STAGES...]; bash ci/device/h200.sh wait 540
       (it builds CUDA, writes random-weight 8B/14B-shaped models, runs the op tests and
       llama-bench -sa 0,1; results land in $OUT/results.tgz)
    3. opencoti-patch bench report results.tgz   tables + JSON + PNG into work/results/
    """


@bench_group.command("pack")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False),
              default=Path(".carry/llama-src.tar.gz"), show_default=True,
              help="Tarball to write (keep it in a git-ignored folder named in `carry`).")
@click.option("--rev", help="Pack this commit of the tree instead of its files, e.g. upstream/<pin> for the "
                           "pristine tree that `ci/rebuild.sh` fetches with FETCH_ARGS='--from DIR' offline.")
@common_options
def pack_command(settings: Settings, out: Path, rev: str | None) -> None:
    """Write a slim tarball (no models/docs/examples: ~11 MB) of the patched tree (--tree).

    The patched tree's tarball is stamped with the digest of patches/ (the series and its patches):
    ci/device/h200.sh refuses to build it once patches/ has changed (pack again)."""
    src = settings.tree
    if not (src / "CMakeLists.txt").is_file():
        raise OpencotiError(f"{src} is not a llama.cpp tree (run `{settings.command('prepare')}` first)")
    stamp = None
    if rev is None and (settings.patches_dir / "series").is_file():
        stamp = series_digest(settings.patches_dir)
    path = bench.pack_slim(src, out, rev=rev, stamp=stamp)
    click.echo(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)")


@bench_group.command("report")
@click.argument("results", type=click.Path(path_type=Path, exists=True))
@click.option("--out-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Report folder [default: <work>/results].")
@click.option("--name", default="h200-decode", show_default=True, help="Base name of the files written.")
@common_options
def report_command(settings: Settings, results: Path, out_dir: Path | None, name: str) -> None:
    """Turn llama-bench JSON (a results.tgz from ci/device/h200.sh, or a folder) into a report."""
    rows = bench.load_results(results)
    if not rows:
        raise OpencotiError(f"no llama-bench results in {results}")
    written = bench.write_reports(rows, out_dir or settings.results_dir, name)
    click.echo(bench.markdown_table(rows))
    click.echo("wrote " + ", ".join(str(p) for p in written))


COMMANDS = [bench_group]
