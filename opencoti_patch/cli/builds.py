"""Click commands of the build side: rebuild and ci-workflow (logic in builds/builder.py,
builds/stamp.py, builds/workflow.py), verify-identical and check (verify/identical.py, verify/check.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from ..builds.builder import (
    CPU_VARIANT_CHOICES,
    DEFAULT_CPU_VARIANT,
    LIB_TARGETS,
    OPTIONAL_TARGETS,
    TOOL_TARGETS,
    BuildOptions,
    have_gpu,
)
from ..builds.stamp import rebuild
from ..builds.workflow import WORKFLOW_OUT, write_workflow
from ..config import Settings
from ..errors import CheckFailed, OpencotiError, PatchFailed
from ..report import info
from ..stack.gitrun import run_git
from ..stack.series import load_series
from ..stack.status import stale_against_series
from ..stack.tree import Tree, tree_lock
from ..verify.check import CHECK_CMAKE, check_series
from ..verify.identical import VerifyConfig, raise_on_failure, verify_identical
from .options import common_options, emit, option_group


def _targets(values: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    for v in values:
        out += [t.strip() for t in v.split(",") if t.strip()]
    return tuple(out) or default


def _cuda(flag: bool | None) -> bool:
    """--cuda / --no-cuda, else auto: nvcc on PATH and a GPU visible."""
    if flag is not None:
        if flag and not shutil.which("nvcc"):
            raise OpencotiError("--cuda: nvcc is not on PATH")
        return flag
    return bool(shutil.which("nvcc")) and have_gpu()


build_options = option_group(
    click.option("--cuda/--no-cuda", "cuda", default=None,
                 help="Build the CUDA backend (default: when nvcc is present and a GPU is visible)."),
    click.option("--cuda-arch", default="90-real", show_default=True,
                 help="CMAKE_CUDA_ARCHITECTURES ('90' also embeds PTX, which nvcc 13.0 does not "
                      "always reproduce byte for byte)."),
    click.option("--cpu-variant", type=click.Choice(CPU_VARIANT_CHOICES), default=DEFAULT_CPU_VARIANT,
                 show_default=True,
                 help="CPU baseline (ggml variant names); 'all' = GGML_CPU_ALL_VARIANTS, 'native' is "
                      "not reproducible across machines."),
    click.option("--no-ccache", is_flag=True, help="Do not use ccache."),
    click.option("-j", "--jobs", type=int, default=None, help="ninja -j (default: ninja's choice)."),
    click.option("--cmake-arg", "cmake_args", multiple=True, metavar="-DX=Y",
                 help="Extra CMake argument (repeatable)."),
    click.option("--no-progress", is_flag=True, help="No progress bar (the build log is kept anyway)."),
)


@click.command("rebuild")
@click.option("--rev", help="Build this commit of the tree (git archive) instead of its files as they are.")
@click.option("--pin", help="Upstream pin for the stamp (default: the pin the tree was backed up as; "
                            "only a folder opencoti-patch does not manage needs it).")
@click.option("--allow-stale", is_flag=True,
              help="Build a tree that is not exactly pristine + patches/series (the manifest says so).")
@click.option("--targets", "targets", multiple=True, metavar="T1,T2",
              help=f"Build targets (default: {', '.join(LIB_TARGETS + TOOL_TARGETS)}, plus "
                   f"{', '.join(OPTIONAL_TARGETS)} when the tree has it; ggml-cuda with --cuda).")
@click.option("--label", help="Build folder name under --build-root (default: cpu or cuda).")
@click.option("--build-root", type=click.Path(file_okay=False, path_type=Path),
              help="Where <label>/src and <label>/build go (default: <work-dir>/build).")
@click.option("--fresh", is_flag=True, help="Delete the build folder first.")
@click.option("--install", "install_dirs", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="Copy the stamped DSOs here and verify their hashes (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@build_options
@common_options
def rebuild_cmd(settings: Settings, rev: str | None, pin: str | None, allow_stale: bool,
                targets: tuple[str, ...],
                label: str | None, build_root: Path | None, fresh: bool, install_dirs: tuple[Path, ...],
                as_json: bool, cuda: bool | None, cuda_arch: str, cpu_variant: str, no_ccache: bool,
                jobs: int | None, cmake_args: tuple[str, ...], no_progress: bool) -> None:
    """Build the tree's DSOs (libggml-base, libggml, libggml-cpu, [libggml-cuda], libllama,
    libllama-common) and tools reproducibly, stamp them with <pin>+<series fingerprint> (<pin>@<release
    or commit>+... when the pin's name is neither) and write opencoti-build-manifest.{json,md} next to
    them, which name the pin's identity: its llama.cpp commit, or its release and archive sha256."""
    use_cuda = _cuda(cuda)
    opts = BuildOptions(
        targets=_targets(targets, (*LIB_TARGETS, *TOOL_TARGETS, *OPTIONAL_TARGETS)),
        cuda=use_cuda, cuda_arch=cuda_arch, cpu_variant=cpu_variant,
        ccache=not no_ccache, jobs=jobs, extra_cmake=cmake_args)
    root = (build_root or settings.work_dir / "build").resolve()
    with tree_lock(settings):  # nothing may apply/unapply while the files are exported
        stamp_pin, stale = _pin_and_staleness(settings, pin, rev)
        if stale and not allow_stale:
            raise CheckFailed(f"{settings.tree} is stale against {settings.patches_dir}: "
                              f"{'; '.join(stale)}; `{settings.command('apply')}` or `snapshot` first, "
                              "or pass --allow-stale")
        tree = Tree(settings)
        identity = tree.identity() if tree.is_repo() and tree.read_state().get("pin") else None
        manifest, out_dir = rebuild(settings.tree, root, opts, label=label or ("cuda" if use_cuda else "cpu"),
                                    rev=rev, pin=stamp_pin, patches_dir=settings.patches_dir,
                                    template_dirs=settings.templates_dirs, install_dirs=install_dirs,
                                    fresh=fresh, progress=not no_progress, stale=stale, identity=identity)
    if as_json:
        click.echo(json.dumps(manifest, indent=2, sort_keys=True))
        return
    click.echo(f"built {manifest['build_commit']} ({len(manifest['artifacts'])} artifacts; upstream "
               f"{manifest['upstream']['identity']}) in {out_dir}/bin")
    click.echo(f"manifest: {out_dir}/opencoti-build-manifest.json (.md)")
    for d in install_dirs:
        click.echo(f"installed + verified: {d}")


def _pin_and_staleness(settings: Settings, pin: str | None, rev: str | None) -> tuple[str, list[str]]:
    """The stamp's pin is the Tree's; the stamp's fingerprint is patches/, so the tree (or the commit
    ``rev`` of it that is built) must match it."""
    tree = Tree(settings)
    if tree.is_repo() and tree.read_state().get("pin"):
        if pin and pin != tree.pin:
            raise OpencotiError(f"--pin {pin}: {settings.tree} was backed up as pin {tree.pin}")
        stale = stale_against_series(tree, rev)
        return tree.pin, stale
    if not pin:
        raise OpencotiError(f"{settings.tree} is not a tree opencoti-patch backed up: "
                            "pass --pin for the stamp")
    return pin, [f"{settings.tree} is not managed by opencoti-patch: its match with patches/ is unchecked"]


@click.command("verify-identical")
@click.option("--pristine-rev", help="Pristine = this rev of --tree (default: the upstream/<pin> tag, else "
                                     "a tag named 'upstream').")
@click.option("--patched-rev", help="Patched = this rev of --tree (default: the tree's files as they are).")
@click.option("--pristine-dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Use this folder as the pristine tree instead.")
@click.option("--patched-dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Use this folder as the patched tree instead.")
@click.option("--patch-file", "patch_files", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Apply this diff (-p1) on top of the patched export; without --patched-rev/--patched-dir "
                   "the patched tree is then pristine + these diffs (repeatable).")
@click.option("--targets", "targets", multiple=True, metavar="T1,T2",
              help=f"Build targets (default: {', '.join(LIB_TARGETS[:4])}: the harness then uses its own "
                   "small parser; add llama-common for common's, e.g. to pass --sparse-attn).")
@click.option("--verify-root", type=click.Path(file_okay=False, path_type=Path),
              help="Build folders go here (default: <work-dir>/verify; the pristine build is reused).")
@click.option("--report-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where verify-identical.{md,json} go (default: <verify-root>/report).")
@click.option("--skip-repro", is_flag=True, help="Skip the second (fresh, ccache-less) pristine build.")
@click.option("--kv-types", default="f16,q8_0", show_default=True, help="KV cache types to run.")
@click.option("--prompt-tokens", type=int, default=2048, show_default=True)
@click.option("--decode", type=int, default=64, show_default=True)
@click.option("--seed", type=int, default=42, show_default=True, help="Model weights and prompt seed.")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--model", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Use this GGUF instead of the generated random-weight one.")
@click.option("--patched-arg", "patched_args", multiple=True,
              help="Extra harness argument for the patched runs only, e.g. '--sparse-attn=off' (repeatable).")
@click.option("--accept-not-checked", "accept_not_checked", multiple=True,
              type=click.Choice(["reproducibility", "binaries"]),
              help="Exit 0 on an INCOMPLETE verdict when only this stage was not checked (repeatable); "
                   "the report still says INCOMPLETE.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@build_options
@common_options
def verify_identical_cmd(settings: Settings, pristine_rev: str | None, patched_rev: str | None,
                         pristine_dir: Path | None, patched_dir: Path | None, patch_files: tuple[Path, ...],
                         targets: tuple[str, ...], verify_root: Path | None, report_dir: Path | None,
                         skip_repro: bool, kv_types: str, prompt_tokens: int, decode: int, seed: int,
                         threads: int, model: Path | None, patched_args: tuple[str, ...],
                         accept_not_checked: tuple[str, ...], as_json: bool,
                         cuda: bool | None, cuda_arch: str, cpu_variant: str, no_ccache: bool,
                         jobs: int | None, cmake_args: tuple[str, ...], no_progress: bool) -> None:
    """Build pristine and patched with the same flags and prove the patches are default-off: the
    patched tree holds every file of every patch (the --patch-file diffs, else <patches-dir>/series;
    neither is a FAIL), reproducible builds, byte-identical binaries wherever no patch feeds them, and
    bitwise-identical, finite logits, graph and buffer sizes with the feature off. Exit 4 on FAIL, and on
    INCOMPLETE (a stage that proves nothing in this run, e.g. --skip-repro) unless --accept-not-checked
    names its stage."""
    tree = settings.tree
    if pristine_dir is not None:
        pristine: tuple[Path, str | None] = (pristine_dir, None)
    else:
        pristine = (tree, pristine_rev or _default_pristine_rev(settings))
    if patched_dir is not None:
        patched: tuple[Path, str | None] = (patched_dir, None)
    elif patch_files and patched_rev is None:
        patched = pristine
    else:
        patched = (tree, patched_rev)
    use_cuda = _cuda(cuda)
    opts = BuildOptions(targets=_targets(targets, LIB_TARGETS[:4]), optional_targets=(), cuda=use_cuda,
                        cuda_arch=cuda_arch, cpu_variant=cpu_variant,
                        ccache=not no_ccache, jobs=jobs,
                        extra_cmake=cmake_args)
    root = (verify_root or settings.work_dir / "verify").resolve()
    cfg = VerifyConfig(work=root, pristine=pristine, patched=patched, patch_files=patch_files,
                       series_dir=settings.patches_dir, options=opts, repro=not skip_repro,
                       kv_types=tuple(k.strip() for k in kv_types.split(",") if k.strip()),
                       prompt_tokens=prompt_tokens, decode=decode, seed=seed, threads=threads, model=model,
                       patched_args=tuple(a for arg in patched_args for a in arg.split()),
                       progress=not no_progress)
    out = (report_dir or root / "report").resolve()
    with tree_lock(settings):
        data = verify_identical(cfg, settings.templates_dirs, out)
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        for c in data["checks"]:
            click.echo(f"{c['status']:>7}  [{c['stage']}] {c['name']}: {c['summary']}")
        click.echo(f"verdict: {data['verdict']}  (report: {out}/verify-identical.md)")
    raise_on_failure(data, accept_not_checked)


def _default_pristine_rev(settings: Settings) -> str:
    """The pristine upstream of the tree: the tag of the pin it was backed up as (Tree.pin)."""
    tree = Tree(settings)
    if tree.is_repo() and tree.read_state().get("pin"):
        return tree.tag
    if tree.is_repo() and run_git(settings.tree, "rev-parse", "--verify", "--quiet", "upstream").rc == 0:
        return "upstream"
    raise OpencotiError(f"{settings.tree} is not a tree opencoti-patch backed up (and has no 'upstream' "
                        "tag): pass --pristine-rev or --pristine-dir")


@click.command("ci-workflow")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=f"Output file (default: <root>/{WORKFLOW_OUT}).")
@click.option("--cuda-arch", default="90-real", show_default=True,
              help="CUDA_ARCH of the CUDA job (90-real: SASS only, reproducible).")
@click.option("--check", is_flag=True, help="Write nothing; exit 4 when the file is not up to date.")
@common_options
def ci_workflow_cmd(settings: Settings, out: Path | None, cuda_arch: str, check: bool) -> None:
    """Render templates/github-workflow.yml.j2 into .github/workflows/rebuild.yml (CPU job + CUDA job)."""
    path = out or settings.root / WORKFLOW_OUT
    changed = write_workflow(path, settings.templates_dirs, cuda_arch=cuda_arch, check=check)
    click.echo(f"{path}: {'written' if changed else 'up to date'}")


@click.command("check")
@click.option("--targets", "targets", multiple=True, metavar="T1,T2",
              help=f"Built after every patch (default: {', '.join(LIB_TARGETS[:4])}); each patch's "
                   "`Test:` targets are added.")
@click.option("--check-root", type=click.Path(file_okay=False, path_type=Path),
              help="The source copy and the one build folder (default: <work-dir>/check).")
@click.option("--timeout", type=float, default=1800, show_default=True, help="Seconds per test.")
@click.option("--verify", is_flag=True,
              help="After the top patch, verify-identical of pristine against the checked tree "
                   "(--accept-not-checked binaries, like ci/rebuild.sh).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report on stdout.")
@build_options
@common_options
@click.pass_context
def check_cmd(ctx: click.Context, settings: Settings, targets: tuple[str, ...], check_root: Path | None,
              timeout: float, verify: bool, as_json: bool, cuda: bool | None, cuda_arch: str,
              cpu_variant: str, no_ccache: bool, jobs: int | None, cmake_args: tuple[str, ...],
              no_progress: bool) -> None:
    """Apply the series one patch at a time onto pristine upstream; after each, build (CPU,
    incremental, one build folder) and run the checks its header declares (`Test:` lines: `markers`
    or a build target and its arguments). Stops at the first patch that fails to apply (exit 3), to
    build or to pass a check (exit 4). Progress on stderr, --json report on stdout."""
    tree = Tree(settings)
    tree.require()
    patches = load_series(settings.patches_dir)
    if not patches:
        raise OpencotiError(f"nothing to check: {settings.series_file} lists no patch")
    opts = BuildOptions(targets=_targets(targets, LIB_TARGETS[:4]), optional_targets=(), cuda=bool(cuda),
                        cuda_arch=cuda_arch, cpu_variant=cpu_variant, ccache=not no_ccache, jobs=jobs,
                        extra_cmake=(*CHECK_CMAKE, *cmake_args))
    root = (check_root or settings.work_dir / "check").resolve()
    with tree_lock(settings):
        report = check_series(settings.tree, tree.tag, patches, root, opts, pin=tree.pin, timeout=timeout,
                              progress=info, build_progress=not no_progress and not as_json)
    data = report.as_dict()
    if verify and report.ok:
        info("verify-identical: pristine against the checked tree")
        try:
            ctx.invoke(verify_identical_cmd, tree_path=settings.tree, work_dir=settings.work_dir,
                       patches_dir=settings.patches_dir, patched_dir=root / "src",
                       accept_not_checked=("binaries",), cuda=cuda, cpu_variant=cpu_variant,
                       no_ccache=no_ccache, jobs=jobs, cmake_args=cmake_args, no_progress=no_progress)
            data["verify"] = {"ok": True}
        except CheckFailed as exc:
            data["verify"] = {"ok": False, "error": exc.message}
    lines = [f"check of {len(patches)} patch(es) on {tree.tag} (build: {report.build})"]
    for step in report.steps:
        tests = ", ".join(f"{t.check}: {'ok' if t.ok else 'FAILED'}" for t in step.tests) or "no Test: line"
        lines.append(f"  {'ok' if step.ok else 'FAILED':<7} {step.patch}  ({tests})"
                     + (f"\n          {step.error.splitlines()[0]}" if step.error else ""))
        lines += [f"          at {where}" for where in step.where]
        failed = [t for t in step.tests if not t.ok]
        if failed:
            lines += [f"          {ln}" for ln in failed[0].output_tail.splitlines()[-10:]]
    if data.get("verify"):
        lines.append(f"  verify-identical: {'ok' if data['verify']['ok'] else data['verify']['error']}")
    emit(data, as_json, "\n".join(lines))
    if report.failed_at:
        step = report.steps[-1]
        if not step.applied:
            raise PatchFailed(f"check: {step.patch} {step.error}")
        why = step.error.splitlines()[0] if step.error else "a test failed"
        at = f"; at {'; '.join(step.where)}" if step.where else ""
        raise CheckFailed(f"check: {step.patch} failed ({why}{at})")
    if data.get("verify") and not data["verify"]["ok"]:
        raise CheckFailed(f"check: verify-identical: {data['verify']['error']}")


COMMANDS = [check_cmd, rebuild_cmd, verify_identical_cmd, ci_workflow_cmd]
