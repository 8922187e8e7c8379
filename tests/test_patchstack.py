"""Unit tests of the patch-stack core on tiny synthetic upstream trees (fast, offline)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import tarfile
import threading
import time
from pathlib import Path

import pytest
from stackutil import PIN_A, PIN_B, Project, write_upstream

from opencoti_patch.cli import cli
from opencoti_patch.cli.stack import COMMANDS
from opencoti_patch.config import Settings
from opencoti_patch.safe_extract import UnsafeArchive, extract_tar
from opencoti_patch.stack import apply as apply_mod
from opencoti_patch.stack.tree import tree_lock


def two_patches(p: Project) -> None:
    """0001 edits line 10 of a.c (+ a new file), 0002 edits line 38 and b.h."""
    p.prepared()
    p.edit("src/a.c", "int line_10 = 10;", "int line_10 = 1000; // opencoti")
    (p.tree / "src" / "sparse.c").write_text("// UPSTREAM_SYNC(sparse-attn): file\nint sparse;\n")
    p.run("snapshot", "--new", "first", "--subject", "first: edit a", "--feature",
          "sparse-attn (--sparse-attn, default off)", "--description", "Line ten.")
    p.edit("src/a.c", "int line_38 = 38;", "int line_38 = 3838; // opencoti")
    p.edit("src/b.h", "int b(void);", "int b(void);\nint c(void);")
    p.run("snapshot", "--new", "second", "--subject", "second: edit a and b")


def head(p: Project) -> str:
    return (p.tree / ".git" / "refs" / "heads" / "opencoti").read_text().strip()


# -- fetch / backup ----------------------------------------------------------------------------


def test_prepare_backs_up_exact_tree(project: Project) -> None:
    project.run("prepare")
    t = project.tree
    assert not (t / ".git" / "opencoti" / "txn").exists()
    assert (t / ".git").is_dir()  # the sdist's dangling .git file was dropped before git init
    assert (t / "win.bat").read_bytes() == b"@echo off\r\necho hi\r\n"
    assert (t / "mixed.txt").read_bytes() == b"lf\ncrlf\r\n"
    assert os.readlink(t / "link.md") == "README.md"
    assert os.access(t / "scripts" / "run.sh", os.X_OK)
    assert not (t / "setup.py").exists()
    manifest = json.loads((t / ".git" / "opencoti" / f"manifest-{PIN_A}.json").read_text())
    assert "models/vocab.gguf" in manifest["files"]  # ignored by the tree's .gitignore, still backed up
    out = project.run("backup", "--verify", "--worktree").output
    assert "intact" in out and "pristine" in out
    assert "already backed up" in project.run("backup").output
    status = json.loads(project.run("status", "--json", "--verify").output)
    assert status["pin"] == PIN_A and "verified intact" in status["backup"]


def test_backup_verify_detects_damage(project: Project) -> None:
    project.run("prepare")
    manifest = project.tree / ".git" / "opencoti" / f"manifest-{PIN_A}.json"
    data = json.loads(manifest.read_text())
    data["files"]["README.md"]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(data))
    assert "DAMAGED" in project.run("backup", "--verify", code=4).output


def test_sha_mismatch_stops_before_extracting(project: Project) -> None:
    toml = project.patches / "upstream.toml"
    toml.write_text(toml.read_text().replace(project.sha_a, "1" * 64))
    result = project.run("fetch", code=1)
    assert "sha256 mismatch" in result.output and "nothing extracted" in result.output
    assert not project.tree.exists()
    result = project.run("fetch", "--from", str(project.sdist_b), code=1)
    assert "sha256 mismatch" in result.output
    assert not project.tree.exists()


def test_fetch_from_file_and_env(project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = project.patches / "upstream.toml"
    # no local path: the archive must come from --from or $OPENCOTI_SDIST
    toml.write_text(toml.read_text().replace(f'path = "{project.sdist_a}"', 'env = "OPENCOTI_SDIST"'))
    assert "$OPENCOTI_SDIST is not set" in project.run("fetch", code=1).output
    monkeypatch.setenv("OPENCOTI_SDIST", str(project.sdist_a))
    project.run("fetch")
    assert (project.tree / "src" / "a.c").is_file()
    assert "already exists" in project.run("fetch", code=1).output
    monkeypatch.delenv("OPENCOTI_SDIST")
    other = project.root / "other"
    project.run("fetch", "--from", str(project.sdist_a), "--tree", str(other))
    assert (other / "src" / "a.c").is_file()


class _Server(http.server.SimpleHTTPRequestHandler):
    hits: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        _Server.hits.append(self.path)
        super().do_GET()


def test_download_progress_cache_and_mismatch(project: Project, tmp_path: Path) -> None:
    import functools

    handler = functools.partial(_Server, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.tar.gz"
        toml = project.patches / "upstream.toml"
        toml.write_text(toml.read_text().replace(f'path = "{project.sdist_a}"', f'url = "{url}"', 1))
        _Server.hits.clear()
        project.run("fetch", "--download-only")
        cached = list((tmp_path / "cache").iterdir())
        assert [c.name for c in cached] == [f"{project.sha_a}-a.tar.gz"]
        project.run("fetch")  # from the cache: no second download
        assert len(_Server.hits) == 1
        # another archive whose sha256 shares the first 16 digits: its failed fetch keeps A's cache
        twin = project.sha_a[:16] + ("0" if project.sha_a[16] != "0" else "1") + project.sha_a[17:]
        twin_toml = toml.read_text()
        toml.write_text(twin_toml.replace(project.sha_a, twin))
        result = project.run("fetch", "--tree", str(tmp_path / "t-twin"), code=1)
        assert "sha256 mismatch" in result.output
        assert [c.name for c in (tmp_path / "cache").iterdir()] == [f"{project.sha_a}-a.tar.gz"]
        toml.write_text(twin_toml)
        # a wrong sha256: error, no file kept in the cache, nothing extracted
        cached[0].unlink()
        toml.write_text(toml.read_text().replace(project.sha_a, "2" * 64))
        result = project.run("fetch", "--tree", str(tmp_path / "t2"), code=1)
        assert "sha256 mismatch" in result.output
        assert not (tmp_path / "t2").exists() and not list((tmp_path / "cache").iterdir())
    finally:
        server.shutdown()


def _hostile(tmp_path: Path, kind: str) -> Path:
    out = tmp_path / f"{kind}.tar"
    with tarfile.open(out, "w") as tar:
        def add(name: str, data: bytes = b"x", **attrs: object) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data) if attrs.get("type", tarfile.REGTYPE) == tarfile.REGTYPE else 0
            for k, v in attrs.items():
                setattr(info, k, v)
            tar.addfile(info, io.BytesIO(data) if info.size else None)

        add("pkg/vendor/llama.cpp/ok.txt")
        if kind == "abs":
            add("/tmp/evil.txt")
        elif kind == "dotdot":
            add("pkg/vendor/llama.cpp/../../../evil.txt")
        elif kind == "symlink":
            add("pkg/vendor/llama.cpp/escape", type=tarfile.SYMTYPE, linkname="../../../../etc")
        elif kind == "abs-symlink":
            add("pkg/vendor/llama.cpp/escape", type=tarfile.SYMTYPE, linkname="/etc/passwd")
        elif kind == "subdir-symlink":  # inside the archive, outside the extracted folder
            add("pkg/vendor/llama.cpp/up", type=tarfile.SYMTYPE, linkname="../../setup.py")
        elif kind == "through-link":
            add("pkg/vendor/llama.cpp/d", type=tarfile.SYMTYPE, linkname="sub")
            add("pkg/vendor/llama.cpp/d/x.txt")
        elif kind == "device":
            add("pkg/vendor/llama.cpp/dev", type=tarfile.CHRTYPE, devmajor=1, devminor=3)
        elif kind == "fifo":
            add("pkg/vendor/llama.cpp/fifo", type=tarfile.FIFOTYPE)
        elif kind == "hardlink":
            add("pkg/vendor/llama.cpp/hl", type=tarfile.LNKTYPE, linkname="../etc/passwd")
        elif kind == "hardlink-out":
            add("pkg/setup.py")
            add("pkg/vendor/llama.cpp/hl", type=tarfile.LNKTYPE, linkname="pkg/setup.py")
    return out


@pytest.mark.parametrize("kind", ["abs", "dotdot", "symlink", "abs-symlink", "subdir-symlink",
                                  "through-link", "device", "fifo", "hardlink", "hardlink-out"])
def test_hostile_tarball_refused(tmp_path: Path, kind: str) -> None:
    archive = _hostile(tmp_path, kind)
    dest = tmp_path / "out" / "tree"
    with pytest.raises(UnsafeArchive):
        extract_tar(archive, dest, subdir="vendor/llama.cpp")
    assert not dest.exists()
    assert list((tmp_path / "out").iterdir()) == []
    assert not Path("/tmp/evil.txt").exists()


def test_hostile_tarball_via_cli(project: Project, tmp_path: Path) -> None:
    archive = _hostile(tmp_path, "symlink")
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    toml = project.patches / "upstream.toml"
    toml.write_text(toml.read_text().replace(project.sha_a, sha).replace(str(project.sdist_a), str(archive)))
    result = project.run("fetch", code=1)
    assert "points outside" in result.output and "nothing extracted" in result.output
    assert not project.tree.exists()


def test_git_and_dir_sources(project: Project, tmp_path: Path) -> None:
    import subprocess

    src = write_upstream(tmp_path / "gitsrc")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "add", "-A", "-f"], check=True)
    subprocess.run(["git", "-C", str(src), "commit", "-qm", "u"], check=True, env=env)
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    toml = project.patches / "upstream.toml"
    toml.write_text(toml.read_text() + f'\n[pins.ggg]\ncommit = "{commit[:9]}"\n\n[[pins.ggg.sources]]\n'
                    f'kind = "git"\nurl = "{src}"\ncommit = "{commit[:9]}"\n'
                    f'\n[pins.ddd]\ncommit = "ddd"\n\n[[pins.ddd.sources]]\nkind = "dir"\npath = "{src}"\n')
    project.run("prepare", "--pin", "ggg")
    assert (project.tree / "win.bat").read_bytes() == b"@echo off\r\necho hi\r\n"
    assert not (project.tree / ".git" / "opencoti" / "manifest-ggg.json").read_text().count(".git/")
    other = tmp_path / "dirtree"
    project.run("prepare", "--pin", "ddd", "--tree", str(other))
    assert (other / "src" / "a.c").read_text() == (src / "src" / "a.c").read_text()


# -- apply / unapply / snapshot ----------------------------------------------------------------


def test_snapshot_apply_round_trip_deterministic(project: Project) -> None:
    two_patches(project)
    series = (project.patches / "series").read_text().split()
    assert series[-2:] == ["0001-first.patch", "0002-second.patch"]
    text = (project.patches / "0001-first.patch").read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n")
    feature = "Feature: sparse-attn (--sparse-attn, default off)\n"
    assert feature + "Patch-Filename: 0001-first.patch\n---\n" in text
    assert "Upstream-Status: " in text and "Date:" not in text
    edited = head(project)
    project.run("snapshot", "--check")
    files = {p.name: p.read_bytes() for p in project.patches.glob("*.patch")}
    project.run("snapshot")  # idempotent: same bytes
    assert files == {p.name: p.read_bytes() for p in project.patches.glob("*.patch")}
    assert "popped 2" in project.run("unapply").output
    project.run("backup", "--verify", "--worktree")
    out = project.run("apply").output
    assert "clean      0001-first.patch" in out
    assert head(project) == edited  # same commits, byte for byte: fixed dates and identities
    assert "already applied" in project.run("apply").output
    # a second, independent tree gets the same commit ids
    other = project.root / "other"
    project.run("prepare", "--tree", str(other))
    assert (other / ".git" / "refs" / "heads" / "opencoti").read_text().strip() == edited


def test_snapshot_check_detects_stale(project: Project) -> None:
    two_patches(project)
    p = project.patches / "0002-second.patch"
    p.write_text(p.read_text().replace("second: edit a and b", "second: renamed"))
    result = project.run("snapshot", "--check", code=4)
    assert "0002-second.patch" in result.output
    # the changed patch file is re-applied by apply
    out = project.run("apply").output
    assert "popped 0002-second.patch" in out
    project.run("snapshot", "--check")
    project.edit("README.md", "# tiny", "# edited")
    assert "uncaptured" in project.run("snapshot", "--check", code=4).output


def test_snapshot_default_top_and_refusal(project: Project) -> None:
    two_patches(project)
    project.edit("src/b.h", "int c(void);", "int c(void); // more")
    out = project.run("snapshot").output
    assert "folded into 0002-second.patch" in out
    assert "// more" in (project.patches / "0002-second.patch").read_text()
    project.edit("README.md", "# tiny", "# edited")
    assert "does not" in project.run("snapshot", code=1).output
    project.run("snapshot", "--top", "--subject", "second: now with readme")
    assert "README.md" in (project.patches / "0002-second.patch").read_text()
    assert "Subject: [PATCH] second: now with readme" in (project.patches / "0002-second.patch").read_text()


def test_snapshot_captures_commits_made_in_tree(project: Project) -> None:
    import subprocess

    two_patches(project)
    project.edit("README.md", "# tiny", "# committed")
    env = {**os.environ, "GIT_AUTHOR_NAME": "Dev", "GIT_AUTHOR_EMAIL": "dev@x", "GIT_COMMITTER_NAME": "Dev",
           "GIT_COMMITTER_EMAIL": "dev@x"}
    subprocess.run(["git", "-C", str(project.tree), "commit", "-qam", "Docs: tweak readme\n\nFeature: docs"],
                   check=True, env=env)
    status = json.loads(project.run("status", "--json").output)
    assert len(status["uncaptured_commits"]) == 1
    assert "uncaptured" in project.run("apply", code=1).output
    out = project.run("snapshot").output
    assert "created: 0003-docs-tweak-readme.patch" in out
    text = (project.patches / "0003-docs-tweak-readme.patch").read_text()
    assert "From: Dev <dev@x>" in text and "Feature: docs" in text
    assert json.loads(project.run("status", "--json").output)["uncaptured_commits"] == []


def test_unapply_top_n(project: Project) -> None:
    two_patches(project)
    out = project.run("unapply", "1", "--json").output
    assert json.loads(out)["popped"] == ["0002-second.patch"]
    status = json.loads(project.run("status", "--json").output)
    assert [a["name"] for a in status["applied"]] == ["0001-first.patch"]
    assert status["unapplied"] == ["0002-second.patch"]
    assert "would apply" not in project.run("apply", "--dry-run").output
    status = json.loads(project.run("status", "--json").output)
    assert status["unapplied"] == ["0002-second.patch"]  # dry run changed nothing
    project.run("apply")
    assert "no patch applied" not in project.run("unapply", "5").output
    assert "nothing to do" in project.run("unapply").output


def _write_patch(project: Project, name: str, body: str, subject: str = "hand made") -> None:
    text = (f"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\nFrom: T <t@t>\n"
            f"Subject: [PATCH] {subject}\n\nUpstream-Status: Pending\nFeature: none\n---\n{body}")
    (project.patches / name).write_text(text)
    series = project.patches / "series"
    series.write_text((series.read_text() if series.exists() else "") + name + "\n")


HUNK = """diff --git a/src/a.c b/src/a.c
--- a/src/a.c
+++ b/src/a.c
@@ -{start},7 +{start},7 @@
 int line_{a:02d} = {a};
 int line_{b:02d} = {b};
 int line_{c:02d} = {c};
-int line_{d:02d} = {d};
+int line_{d:02d} = 4242;
 int line_{e:02d} = {e};
 int line_{f:02d} = {f};
 int line_{g:02d} = {g};
"""


def _hunk(first: int, stated: int | None = None) -> str:
    n = dict(zip("abcdefg", range(first, first + 7), strict=True))
    return HUNK.format(start=stated or first, **n)


def test_fuzzy_patch_refused_then_3way(project: Project) -> None:
    two_patches(project)
    _write_patch(project, "0003-offset.patch", _hunk(20, stated=17))  # context is 3 lines later
    before = head(project)
    result = project.run("apply", code=3)
    assert "0003-offset.patch" in result.output and "src/a.c" in result.output
    assert "hunk #1" in result.output and "no fuzz" in result.output and "Recovery" in result.output
    assert head(project) == before and json.loads(project.run("status", "--json").output)["dirty"] == []
    out = project.run("apply", "--3way").output
    assert "merged     0003-offset.patch  (src/a.c)" in out


def test_context_mismatch_refused(project: Project) -> None:
    two_patches(project)
    body = _hunk(20).replace(" int line_21 = 21;", " int line_21 = 99;")
    _write_patch(project, "0003-fuzz.patch", body)
    result = project.run("apply", code=3)
    assert "does not match at line 21" in result.output
    result = project.run("apply", "--json", code=3)
    assert json.loads(result.stdout)["outcomes"][-1]["hunk"] == 1
    result = project.run("apply", "--dry-run", "--json", code=3)
    assert json.loads(result.stdout)["outcomes"][-1]["status"] == "failed"


def test_corrupt_patches(project: Project) -> None:
    project.prepared()
    _write_patch(project, "0001-short.patch", _hunk(20).rsplit("\n", 3)[0] + "\n")
    assert "corrupt patch" in project.run("apply", code=1).output
    (project.patches / "0001-short.patch").write_text("just text\n")
    assert "Subject" in project.run("apply", code=1).output
    (project.patches / "0001-short.patch").write_text("Subject: x\n\nno diff here\n")
    assert "no diff" in project.run("apply", code=1).output
    (project.patches / "series").write_text("bad name.patch\n")
    assert "bad patch name" in project.run("apply", code=1).output
    (project.patches / "series").write_text("0009-missing.patch\n")
    assert "missing" in project.run("apply", code=1).output


def test_patch_writing_outside_tree_refused(project: Project) -> None:
    project.prepared()
    body = ("diff --git a/../evil.c b/../evil.c\nnew file mode 100644\n--- /dev/null\n+++ b/../evil.c\n"
            "@@ -0,0 +1 @@\n+evil\n")
    _write_patch(project, "0001-evil.patch", body)
    assert "outside the tree" in project.run("apply", code=1).output
    assert not (project.tree.parent / "evil.c").exists()
    body = "--- /dev/null\n+++ b/.git/hooks/post-commit\n@@ -0,0 +1 @@\n+evil\n"
    (project.patches / "0001-evil.patch").write_text("Subject: x\n\n---\n" + body)
    assert "outside the tree" in project.run("apply", code=1).output


def test_drifted_upstream_fails_with_hunk(project: Project) -> None:
    two_patches(project)
    other = project.root / "drifted"
    result = project.run("prepare", "--pin", PIN_B, "--tree", str(other), code=3)
    assert "0001-first.patch does not apply to src/a.c (hunk #1, line 7)" in result.output
    assert "3 line(s) later" in result.output


def test_dirty_tree_never_overwritten(project: Project) -> None:
    two_patches(project)
    project.edit("README.md", "# tiny", "# precious")
    (project.tree / "untracked.txt").write_text("mine\n")
    for args in (["apply"], ["unapply"], ["restore"]):
        assert "uncaptured" in project.run(*args, code=1).output
        assert "# precious" in (project.tree / "README.md").read_text()
    project.run("restore", "--force")
    rescued = list((project.root / "work" / "rescue").iterdir())
    assert len(rescued) == 1 and "# precious" in rescued[0].read_text() and "mine" in rescued[0].read_text()
    assert not (project.tree / "untracked.txt").exists()
    project.run("backup", "--verify", "--worktree")


def test_restore_deletes_added_and_ignored_files(project: Project) -> None:
    two_patches(project)
    (project.tree / "build").mkdir()
    (project.tree / "build" / "out.o").write_text("obj")  # ignored by the tree's .gitignore
    project.run("restore")
    assert not (project.tree / "build").exists() and not (project.tree / "src" / "sparse.c").exists()
    project.run("backup", "--verify", "--worktree")


def test_interrupted_apply_rolls_back(project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    two_patches(project)
    project.run("unapply")
    calls: list[str] = []
    real = apply_mod.commit_patch

    def flaky(tree, patch):  # type: ignore[no-untyped-def]
        calls.append(patch.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C between `git apply --index` and the commit
        return real(tree, patch)

    monkeypatch.setattr(apply_mod, "commit_patch", flaky)
    result = project.run("apply", code=130)
    assert "interrupted" in result.output
    status = json.loads(project.run("status", "--json").output)
    assert [a["name"] for a in status["applied"]] == ["0001-first.patch"]
    assert status["dirty"] == [] and not status["interrupted"]
    monkeypatch.setattr(apply_mod, "commit_patch", real)
    project.run("apply")
    project.run("snapshot", "--check")


def test_killed_apply_is_recovered(project: Project) -> None:
    two_patches(project)
    project.run("unapply", "1")
    # a run killed mid-apply: patch half applied to index+worktree, txn marker left behind
    txn = project.tree / ".git" / "opencoti" / "txn"
    txn.write_text("x\n")
    project.edit("src/b.h", "int b(void);", "int b(void); // half")
    assert json.loads(project.run("status", "--json").output)["interrupted"]
    project.run("apply")
    assert not txn.exists()
    project.run("snapshot", "--check")
    assert "// half" in next((project.root / "work" / "rescue").iterdir()).read_text()


def test_lock_contention(project: Project) -> None:
    two_patches(project)  # apply has a series to apply (an empty one is refused)
    settings = Settings.resolve()
    with tree_lock(settings):
        result = project.run("apply", code=5)
        assert f"pid {os.getpid()}" in result.output

        def release_later() -> None:
            time.sleep(0.3)
            lock_cm.__exit__(None, None, None)

    lock_cm = tree_lock(settings)
    lock_cm.__enter__()
    threading.Thread(target=release_later).start()
    project.run("apply", "--lock-wait", "5")


# -- rebase ------------------------------------------------------------------------------------


def test_rebase_reports_and_resolves(project: Project) -> None:
    two_patches(project)
    result = project.run("rebase", "--to", PIN_B, "--json", code=3)
    report = json.loads(result.stdout)
    statuses = {o["patch"]: o["status"] for o in report["outcomes"]}
    assert statuses == {"0001-first.patch": "merged", "0002-second.patch": "conflicted"}
    assert report["outcomes"][1]["files"] == ["src/a.c"]
    assert "<<<<<<<" in (project.tree / "src" / "a.c").read_text()
    assert "conflict markers remain" in project.run("rebase", "--continue", code=1).output
    project.resolve_conflict("src/a.c", "int line_38 = 383800; // opencoti, rebased")
    out = project.run("rebase", "--continue").output
    assert "resolved   0002-second.patch" in out and "done" in out
    assert "0002-second.patch" in project.run("snapshot", "--check", code=4).output
    out = project.run("snapshot").output
    assert "round trip OK" in out
    status = json.loads(project.run("status", "--json").output)
    assert status["pin"] == PIN_B and len(status["applied"]) == 2
    # on a fresh tree of pin B the rewritten series applies exactly
    other = project.root / "fresh-b"
    project.run("prepare", "--pin", PIN_B, "--tree", str(other))
    assert "383800" in (other / "src" / "a.c").read_text()


def test_rebase_abort_and_write_pin(project: Project) -> None:
    two_patches(project)
    before = head(project)
    project.run("rebase", "--to", PIN_B, code=3)
    assert "rebase" in project.run("apply", code=1).output
    assert PIN_A in project.run("rebase", "--abort").output
    assert head(project) == before
    project.run("backup", "--verify")
    project.run("snapshot", "--check")
    # skip the conflicting patch, then make B the project pin
    project.run("rebase", "--to", PIN_B, code=3)
    out = project.run("rebase", "--skip", "--write-pin").output
    assert "skipped    0002-second.patch" in out and "default pin is now" in out
    assert f'default = "{PIN_B}"' in (project.patches / "upstream.toml").read_text()
    project.run("snapshot")
    assert (project.patches / "series").read_text().split()[-1] == "0001-first.patch"
    assert not (project.patches / "0002-second.patch").exists()
    assert (project.patches / "skipped" / "0002-second.patch").is_file()  # set aside, not deleted


# -- CLI surface -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_help(project: Project, name: str) -> None:
    out = project.run(name, "--help").output
    assert "Usage:" in out and "--tree" in out


def test_errors_are_one_line(project: Project) -> None:
    result = project.runner.invoke(cli, ["apply"])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert "no tree" in result.output
    assert project.runner.invoke(cli, ["unapply", "0"]).exit_code == 2
    assert "unknown pin" in project.run("fetch", "--pin", "nope", code=1).output


def test_snapshot_mark_adds_markers(project: Project) -> None:
    pytest.importorskip("opencoti_patch.markers.audit")
    project.prepared()
    project.edit("src/a.c", "int line_10 = 10;", "int line_10 = 1000;")
    out = project.run("snapshot", "--new", "gated", "--feature", "sparse-attn (--sparse-attn, default off)",
                      "--mark").stdout
    assert "markers added in src/a.c" in out
    assert "UPSTREAM_SYNC(sparse-attn): begin" in (project.tree / "src" / "a.c").read_text()
    project.run("snapshot", "--top")
    project.run("markers", "--patches-dir", str(project.patches), "--tree", str(project.tree))


def test_staged_folders_appear_complete_or_not_at_all(tmp_path: Path) -> None:
    """The one staging rule of extract_tar and the dir source (safe_extract.staged)."""
    from opencoti_patch.errors import OpencotiError
    from opencoti_patch.safe_extract import staged

    dest = tmp_path / "tree"
    with pytest.raises(KeyboardInterrupt), staged(dest) as staging:
        (staging / "half").write_text("x")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with staged(dest) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".tree.partial-")
        (staging / "f").write_text("x")
        assert not dest.exists()
    assert (dest / "f").read_text() == "x" and [p.name for p in tmp_path.iterdir()] == ["tree"]
    with pytest.raises(OpencotiError, match="already exists"), staged(dest):
        pass
