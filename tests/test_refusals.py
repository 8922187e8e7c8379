"""User mistakes that must be refused: one clear line, a non-zero exit, and nothing changed (the
tree, its git state, patches/ and work/ byte-identical before and after), on the tiny synthetic
upstream (docs/checks.md, "Refusals")."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
from stackutil import PIN_A, PIN_B, Project, upstream_toml
from test_patchstack import _write_patch, two_patches


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout


def project_state(p: Project) -> dict[str, str]:
    """sha256 of every file, link and folder of the project (patches/, work/: the tree, rescue/, fetch
    records, staging folders), with the tree's .git reduced to what a command changes: HEAD, the refs,
    the index's entries and opencoti-patch's own state (a read-only git call may refresh the index's stat
    data, which is no change). The tree lock file is left out: taking the lock writes it."""
    state: dict[str, str] = {}
    git_dir = p.tree / ".git"
    for dirpath, dirnames, filenames in os.walk(p.root):
        here = Path(dirpath)
        if here == git_dir:
            dirnames[:] = [d for d in dirnames if d == "opencoti"]
            filenames = []
        for name in dirnames:
            state[(here / name).relative_to(p.root).as_posix() + "/"] = "dir"
        for name in filenames:
            path = here / name
            rel = path.relative_to(p.root).as_posix()
            if rel == f"work/.{p.tree.name}.lock":
                continue
            data = os.fsencode(os.readlink(path)) if path.is_symlink() else path.read_bytes()
            kind = "link" if path.is_symlink() else oct(path.stat().st_mode & 0o777)
            state[rel] = f"{kind} {hashlib.sha256(data).hexdigest()}"
    if git_dir.is_dir():
        for what in (("rev-parse", "HEAD"), ("for-each-ref",), ("ls-files", "-s")):
            state["git " + " ".join(what)] = hashlib.sha256(_git(p.tree, *what).encode()).hexdigest()
    return state


def refused(p: Project, *args: str, needles: tuple[str, ...], code: int = 1) -> str:
    """Run ``args``; it must exit ``code`` with one ``Error:`` line holding every needle, and change
    nothing. Returns that line."""
    before = project_state(p)
    result = p.run(*args, code=code)
    errors = [ln for ln in result.output.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and result.output.rstrip().endswith(errors[0]), (args, result.output)
    for needle in needles:
        assert needle in errors[0], (args, needle, errors[0])
    after = project_state(p)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, (args, changed)
    return errors[0]


# -- 1. a missing or empty series --------------------------------------------------------------


SERIES_READERS = (("apply",), ("apply", "--dry-run"), ("status",), ("status", "--json"), ("snapshot",),
                  ("snapshot", "--check"), ("snapshot", "--top"), ("rebase", "--to", PIN_B),
                  ("check",), ("markers",), ("prepare",))


def test_no_patches_folder_is_refused(project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    """`--work-dir W` from a folder without patches/: the series is not there, not empty (apply used to
    pop every applied patch, status to list them [not in series], snapshot to die on a traceback)."""
    two_patches(project)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.delenv("OPENCOTI_ROOT")
    monkeypatch.chdir(elsewhere)
    work = ("--work-dir", str(project.root / "work"))
    for args in (*SERIES_READERS, ("rebase", "--abort"), ("rebuild",)):
        refused(project, *args, *work, needles=(f"no patches folder at {elsewhere / 'patches'}",
                                                "--patches-dir"))
    monkeypatch.chdir(project.root)
    assert "applied:  2" in project.run("status").output


@pytest.mark.parametrize("how", ["emptied", "removed"])
def test_empty_series_with_applied_patches_is_refused(project: Project, how: str) -> None:
    two_patches(project)
    series = project.patches / "series"
    if how == "emptied":
        series.write_text("# nothing here\n")
    else:
        series.unlink()
    for args in SERIES_READERS:
        needles = ("lists no patch",) if args[0] in ("check", "markers") else \
            ("lists no patch", "carries 2 applied (0001-first.patch, 0002-second.patch)", "unapply")
        refused(project, *args, needles=needles)


def test_empty_series_before_the_first_patch(project: Project) -> None:
    """A project before its first patch: prepare fetches and backs up, apply has nothing to apply (an
    error, not "0 patch(es)"), and the first patch comes from `snapshot --new`."""
    assert "lists no patch yet" in project.run("prepare").output
    refused(project, "apply", needles=("nothing to apply", "lists no patch", "snapshot --new NAME"))
    assert "applied:  0" in project.run("status").output
    project.run("snapshot", "--check")
    project.edit("src/a.c", "int line_10 = 10;", "int line_10 = 1000;")
    project.run("snapshot", "--new", "first")
    project.run("apply")


# -- 2. an interrupted transaction (apply killed outright) ----------------------------------------


def _killed_mid_apply(p: Project, index_lock: bool = False) -> None:
    """What `kill -9` in the middle of `apply` leaves: the transaction file, a patch half applied."""
    (p.tree / ".git" / "opencoti" / "txn").write_text("x\n")
    p.edit("src/b.h", "int b(void);", "int b(void); // half")
    if index_lock:
        (p.tree / ".git" / "index.lock").write_text("")


RECOVERY = ("was killed while applying a patch", "half-applied files", "`opencoti-patch apply",
            "brings the tree back", "restore")


@pytest.mark.parametrize("index_lock", [False, True])
def test_writers_refuse_an_interrupted_apply(project: Project, index_lock: bool) -> None:
    """`snapshot --top` used to fold the half-applied files into the top patch ("round trip OK"), and the
    next apply then failed: every command that writes patches/ or the tree refuses and names `apply`."""
    two_patches(project)
    project.run("unapply", "1")
    _killed_mid_apply(project, index_lock)
    for args in (("snapshot",), ("snapshot", "--top"), ("snapshot", "--new", "x"), ("snapshot", "--check"),
                 ("snapshot", "--mark", "--top"), ("refresh", "--top"), ("rebase", "--to", PIN_B),
                 ("markers", "--fix", "--tree", str(project.tree))):
        action = "snapshot" if args[0] == "refresh" else args[0]
        refused(project, *args, needles=(f"cannot {action}", *RECOVERY))
    assert "half-applied files of the interrupted apply: 1" in project.run("status").output
    project.run("apply")  # the way back it names
    project.run("snapshot", "--check")


def test_rebase_steps_refuse_an_interrupted_apply(project: Project) -> None:
    two_patches(project)
    project.run("rebase", "--to", PIN_B, code=3)
    project.resolve_conflict("src/a.c", "int line_38 = 383800;")
    _killed_mid_apply(project)
    for step in ("--continue", "--skip", "--abort"):
        refused(project, "rebase", step, needles=(f"cannot rebase {step}", *RECOVERY))


# -- 3. a broken archive whose sha256 a pin records -------------------------------------------------


def _flip(data: bytes, start: int, end: int) -> bytes:
    return data[:start] + bytes(b ^ 0x55 for b in data[start:end]) + data[end:]


def _at_member_boundary(raw: bytes) -> bytes:
    """A plain tar cut where a header starts: no end-of-archive block, and tarfile reads it as complete."""
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = tar.getmembers()
    return raw[: members[len(members) // 2].offset]


def _broken_archives(sdist: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, what the error must say)."""
    data = sdist.read_bytes()
    raw = gzip.decompress(data)
    raw_bz2, raw_xz = bz2.compress(raw), lzma.compress(raw)
    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("pkg/vendor/llama.cpp/a.c", "int a;\n" * 500)
    crc = len(data) - 8  # the gzip trailer: CRC32, then the length
    return {
        "cut.tar.gz": (data[: len(data) * 2 // 3], "truncated (gz data ends"),
        "no-trailer.tar.gz": (data[:-6], "truncated (gz data ends"),
        "corrupt.tar.gz": (_flip(data, 200, 400), "corrupt (gz-compressed tar data)"),
        "bad-crc.tar.gz": (_flip(data, crc, crc + 4), "corrupt (gz-compressed tar data): CRC check failed"),
        "cut.tar": (raw[: len(raw) // 2 + 100], "truncated"),
        "cut-at-member.tar": (_at_member_boundary(raw), "no end-of-archive block"),
        "cut.tar.bz2": (raw_bz2[: len(raw_bz2) // 2], "truncated (bz2 data ends"),
        "cut.tar.xz": (raw_xz[: len(raw_xz) // 2], "truncated (xz data ends"),
        "corrupt.tar.xz": (_flip(raw_xz, 100, 300), "corrupt (xz-compressed tar data)"),
        "not-a-tar.tar.gz": (b"hello " * 100, "not a tar archive"),
        "sdist.zip": (zipped.getvalue(), "a zip archive; only tar archives"),
        "cut.zip": (zipped.getvalue()[:60], "a zip archive; only tar archives"),
    }


def _pin_to(p: Project, pin: str, archive: Path) -> None:
    """upstream.toml with ``pin`` at ``archive`` (its sha256 recorded), the other pin as it was."""
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    pins = {PIN_A: (p.sdist_a, p.sha_a), PIN_B: (p.sdist_b, p.sha_b)} | {pin: (archive, sha)}
    (p.patches / "upstream.toml").write_text(upstream_toml(pins, PIN_A))


def test_broken_archive_with_a_pinned_sha256_is_named(project: Project, tmp_path: Path) -> None:
    """A truncated archive ended in click's bare "Aborted!" (tarfile's EOFError), a plain tar cut at a
    member boundary was extracted as a smaller tree: each is one line naming the file and what is wrong."""
    (project.root / "work").mkdir()
    for name, (data, what) in _broken_archives(project.sdist_a).items():
        archive = tmp_path / name
        archive.write_bytes(data)
        _pin_to(project, PIN_A, archive)
        line = refused(project, "fetch", needles=(str(archive), what, "nothing extracted"))
        damaged = "zip" not in name and "not-a-tar" not in name  # a broken copy: the pin is wrong
        assert (f"its sha256 is the one pin {PIN_A} records" in line and "pin add" in line) == damaged, line
        refused(project, "pin", "add", "broken", "--tarball", str(archive), "--commit", "c" * 40,
                needles=(str(archive), what))


def test_broken_archive_of_the_rebase_target_changes_nothing(project: Project, tmp_path: Path) -> None:
    two_patches(project)
    archive = tmp_path / "cut.tar.gz"
    archive.write_bytes(project.sdist_b.read_bytes()[:-200])
    _pin_to(project, PIN_B, archive)
    refused(project, "rebase", "--to", PIN_B, needles=(str(archive), "truncated"))
    assert "applied:  2" in project.run("status").output


def test_sha256_mismatch_stays_a_clear_error(project: Project) -> None:
    (project.root / "work").mkdir()
    toml = project.patches / "upstream.toml"
    toml.write_text(toml.read_text().replace(project.sha_a, "1" * 64))
    refused(project, "fetch", needles=("sha256 mismatch", str(project.sdist_a), "nothing extracted"))
    refused(project, "fetch", "--from", str(project.sdist_b),
            needles=("sha256 mismatch", str(project.sdist_b), "nothing extracted"))


# -- 4. backup --pin of another pin ------------------------------------------------------------------


def test_backup_as_another_pin_is_refused(project: Project) -> None:
    """`backup --pin X` on a tree backed up as another pin said "already backed up as ..." and exited 0."""
    two_patches(project)
    refused(project, "backup", "--pin", PIN_B, needles=(f"backed up as pin {PIN_A}, not {PIN_B}",
                                                        f"rebase --to {PIN_B}"))
    refused(project, "backup", "--pin", "nope", needles=("unknown pin 'nope'",))
    assert "already backed up" in project.run("backup", "--pin", PIN_A).output
    assert "already backed up" in project.run("backup", "--pin", PIN_A[:5]).output  # its commit, abbreviated


# -- 5. a patch that makes a symbolic link leave the tree --------------------------------------------


def _new_link(path: str, target: str) -> str:
    return (f"diff --git a/{path} b/{path}\nnew file mode 120000\nindex 0000000..1111111\n--- /dev/null\n"
            f"+++ b/{path}\n@@ -0,0 +1 @@\n+{target}\n\\ No newline at end of file\n")


def _retarget(path: str, old: str, new: str) -> str:
    return (f"diff --git a/{path} b/{path}\nindex 1111111..2222222 120000\n--- a/{path}\n+++ b/{path}\n"
            f"@@ -1 +1 @@\n-{old}\n\\ No newline at end of file\n+{new}\n\\ No newline at end of file\n")


def _renamed(old: str, new: str) -> str:
    return f"diff --git a/{old} b/{new}\nsimilarity index 100%\nrename from {old}\nrename to {new}\n"


ESCAPING_LINKS = {
    "absolute": (_new_link("src/etc", "/etc"), "src/etc -> '/etc'"),
    "dotdot": (_new_link("src/up", "../../outside"), "src/up -> '../../outside'"),
    "deep-dotdot": (_new_link("a/b/c/up", "../../../../x"), "a/b/c/up -> '../../../../x'"),
    "into-git": (_new_link("hooks", ".git/hooks"), "hooks -> '.git/hooks'"),
    "retarget": (_retarget("link.md", "README.md", "../../../etc/passwd"),
                 "link.md -> '../../../etc/passwd'"),
    "file-to-link": ("diff --git a/README.md b/README.md\nold mode 100644\nnew mode 120000\n",
                     "README.md"),
}


@pytest.mark.parametrize("kind", sorted(ESCAPING_LINKS))
def test_patch_making_a_link_leave_the_tree_is_refused(project: Project, kind: str) -> None:
    """`apply` accepted a patch creating a symbolic link to /etc or ../..: archives refused such links,
    patches did not. Refused when the series is read, before anything is written (the good first patch
    is not applied either)."""
    two_patches(project)
    project.run("unapply")
    body, named = ESCAPING_LINKS[kind]
    _write_patch(project, "0003-link.patch", body)
    for args in (("apply",), ("apply", "--dry-run"), ("prepare",), ("check",), ("markers",)):
        refused(project, *args, needles=("0003-link.patch", named, "refusing"))
    project.run("apply", "--force", code=1)  # --force does not change it either
    assert not (project.tree / "src" / "etc").is_symlink() and "applied:  0" in project.run("status").output


def test_patch_renaming_a_link_out_of_the_tree_is_refused(project: Project) -> None:
    """A relative link moved to another folder can point outside the tree: checked against the tree
    when its patch comes, before git writes anything of that patch."""
    two_patches(project)
    (project.patches / "series").write_text("0001-first.patch\n0002-second.patch\n")
    _write_patch(project, "0003-deep-link.patch", _new_link("a/b/link", "../c.txt"))  # a/c.txt: inside
    project.run("apply")
    _write_patch(project, "0004-move.patch", _renamed("a/b/link", "moved-link"))  # ../c.txt from the top
    refused(project, "apply", needles=("0004-move.patch", "moved-link -> '../c.txt'", "leaves the tree"))
    refused(project, "apply", "--dry-run", needles=("0004-move.patch", "moved-link -> '../c.txt'"))
    _write_patch(project, "0005-fine.patch", _new_link("fine", "src/a.c"))  # a link inside is fine
    _write_patch(project, "0006-move-inside.patch", _renamed("a/b/link", "a/b/link2"))  # (no a/ b/ prefix)
    (project.patches / "series").write_text("0001-first.patch\n0002-second.patch\n0003-deep-link.patch\n"
                                            "0005-fine.patch\n0006-move-inside.patch\n")
    project.run("apply")
    assert os.readlink(project.tree / "fine") == "src/a.c"
    assert os.readlink(project.tree / "a" / "b" / "link2") == "../c.txt"


# -- 6. rebase --abort over uncaptured edits -----------------------------------------------------------


def _rebase_done(p: Project) -> None:
    two_patches(p)
    p.run("rebase", "--to", PIN_B, code=3)
    p.resolve_conflict("src/a.c", "int line_38 = 383800; // opencoti, rebased")
    assert "done" in p.run("rebase", "--continue").output


def test_rebase_abort_refuses_uncaptured_edits(project: Project) -> None:
    """After a finished rebase, `rebase --abort` threw uncaptured edits away (exit 0, nothing in
    rescue/): refused, naming `snapshot` and `--force`, which saves them first as `restore --force` does."""
    _rebase_done(project)
    project.edit("src/b.h", "int c(void);", "int c(void);\nint d(void);")
    (project.tree / "src" / "new.c").write_text("int new_file;\n")
    assert "uncaptured edits: 2 file(s)" in project.run("status").output
    refused(project, "rebase", "--abort", needles=("uncaptured work", "2 edited file(s)", "src/b.h",
                                                   "opencoti-patch snapshot", "--force", "rescue"))
    out = project.run("rebase", "--abort", "--force").output
    assert f"back on {PIN_A}" in out and "uncaptured work saved to" in out
    saved = next((project.root / "work" / "rescue").iterdir())
    assert "int d(void);" in saved.read_text() and "int new_file;" in saved.read_text()
    assert "applied:  2" in project.run("status").output and not (project.tree / "src" / "new.c").exists()
    project.run("snapshot", "--check")


def test_rebase_abort_refuses_uncaptured_commits(project: Project) -> None:
    _rebase_done(project)
    project.edit("src/b.h", "int c(void);", "int c(void);\nint d(void);")
    _git(project.tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "mine")
    refused(project, "rebase", "--abort", needles=("1 commit(s) not captured", "--force"))


def test_rebase_abort_during_a_conflict_drops_the_resolution(project: Project) -> None:
    """During a conflict the tree's edits are the conflict being resolved: --abort drops them, as git's."""
    two_patches(project)
    project.run("rebase", "--to", PIN_B, code=3)
    assert f"back on {PIN_A}" in project.run("rebase", "--abort").output
    project.run("snapshot", "--check")
